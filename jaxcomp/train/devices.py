"""The device model: how long a compiled program's kernels take on a named device (a roofline).

A kernel (``hlo_cost.Kernel``) of F FLOPs that moves B bytes takes, on a device, the roofline's

  max(F / peak FLOP/s for its dtype, B / memory bandwidth),

and a program the sum over its kernels, each as often as it runs (its weight), with each kernel's
fixed cost: on an accelerator, whose host queues kernels ahead of the device, a kernel takes at
least ``launch`` (the roofline hides the launch of a long kernel, the launch a short kernel's
roofline); on a CPU, which runs each kernel when the last one ends, the cost adds. An accelerator
folds into a matrix product the elementwise kernels around it (XLA's GEMM rewrite makes
c₀·X + B·X, a scaled or transposed operand one cuBLAS call; XLA:TPU's fusions): such a kernel
(``hlo_cost.Kernel.fusable``) moves only what the product does not, and launches nothing. A dot or
convolution runs at the matrix units' peak for its operands' dtype — float32 as XLA runs it by
default: TensorFloat-32 on NVIDIA GPUs since Ampere, one bfloat16 pass on TPUs (JAX's "Matmul
precision" page) — any other arithmetic at the vector units' float32 peak. The peaks are the
vendors' dense figures (without 2:4 sparsity), which kernels approach only when large: the roofline
is a lower bound of a program's time, and the planner says so.

``PRESETS`` are the accelerators users train on, each dated, with its sources; ``this-cpu`` is the
machine the planner runs on, whose figures ``measure_this_cpu`` takes in a few seconds (a float32
matrix product, a streaming loop over 16 MB — larger buffers are fresh pages on every call, which
XLA:CPU's allocator does not keep, and measure the page faults — a chain of small kernels), so
that the planner's predictions can be checked against steps measured on the same machine
(``benchmarks/plan_check.py``).

``sustained`` is the share of the bfloat16 peak a training step's matrix products sustain, which
the planner's estimate of a model's step uses (``compute.model_step``): 0.40 on the accelerators —
Llama 3 trained at 38–43% of H100s' bfloat16 peak (Llama Team, "The Llama 3 Herd of Models", 2024,
Table 4), PaLM at 46.2% of TPU v4's (Chowdhery et al. 2022, Table 3) — and 1 on this CPU, whose
figure is itself a sustained rate.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence

TAKEN = "2026-12-07"
"""When the presets' figures were taken from their sources."""
LAUNCH_GPU = 3e-6
"""Seconds per kernel on an NVIDIA GPU: a CUDA launch and XLA's thunk, a few µs (an assumption;
``benchmarks/plan_check.py --platform gpu`` measures what the steps say)."""
LAUNCH_TPU = 1e-6
"""Seconds per operation on a TPU, where XLA runs the whole program on the chip (an
assumption)."""
SUSTAINED = 0.40
"""The share of the bfloat16 peak a training step's matrix products sustain (module docstring)."""


@dataclasses.dataclass(frozen=True)
class Device:
  """A device's roofline.

  Attributes:
    name: the ``--device`` name.
    about: the device, in words.
    matmul: peak FLOP/s of a dot or convolution by operand dtype class: ``"f32"`` (as XLA runs
      float32 dots by default), ``"bf16"`` (bfloat16 and float16), ``"int8"`` (8-bit).
    vector: peak FLOP/s of other float32 arithmetic.
    bandwidth: memory bandwidth, bytes/s.
    launch: seconds per kernel.
    memory_gib: memory per device, GiB (None: not a limit the planner checks).
    date: when the figures were taken (from the sources, or measured).
    sources: where each figure comes from.
    sustained: the share of the bfloat16 peak a training step's matrix products sustain.
    accelerator: kernels are queued ahead and the fusable ones fused (module docstring); False: a
      CPU.
  """
  name: str
  about: str
  matmul: dict
  vector: float
  bandwidth: float
  launch: float
  memory_gib: Optional[float]
  date: str
  sources: tuple
  sustained: float = SUSTAINED
  accelerator: bool = True

  def peak(self, dtype: Optional[str]) -> float:
    """Peak FLOP/s of a kernel whose matrix product has operands of ``dtype`` (None: none)."""
    if dtype is None:
      return self.vector
    if dtype in ("bf16", "f16"):
      return self.matmul["bf16"]
    if dtype in ("s8", "u8", "f8e4m3fn", "f8e5m2"):
      return self.matmul.get("int8", self.matmul["bf16"])
    return self.matmul["f32"]

  def kernel_parts(self, flops: float, nbytes: float, dtype: Optional[str],
                   fusable: float = 0.0) -> tuple:
    """``(kind, seconds)`` of one run of a kernel (module docstring): kind ``"flops"``,
    ``"memory"`` or ``"launch"``, whichever bounds it."""
    if self.accelerator and fusable:
      nbytes, fixed = max(nbytes - fusable, 0.0), 0.0
    else:
      fixed = self.launch
    arithmetic, memory = flops / self.peak(dtype), nbytes / self.bandwidth
    kind, roof = ("flops", arithmetic) if arithmetic > memory else ("memory", memory)
    if not self.accelerator:
      return kind, roof + fixed
    return (kind, roof) if roof >= fixed else ("launch", fixed)

  def kernel_seconds(self, flops: float, nbytes: float, dtype: Optional[str],
                     fusable: float = 0.0) -> float:
    """One run of a kernel (module docstring)."""
    return self.kernel_parts(flops, nbytes, dtype, fusable)[1]

  def seconds(self, summary: Sequence) -> float:
    """Seconds of a program per step: its kernels (``hlo_cost.summary`` rows ``[flops, bytes,
    dtype, weight, collective, fusable]``) but the collectives, each times its weight."""
    return sum(w * self.kernel_seconds(f, b, d, e) for f, b, d, w, c, e in summary if not c)

  def parts(self, summary: Sequence) -> dict:
    """``{"flops": s, "memory": s, "launch": s}``: the seconds of the kernels bound by their
    arithmetic, by their memory traffic, and by their fixed cost (on a CPU, every kernel's fixed
    cost is counted apart)."""
    out = {"flops": 0.0, "memory": 0.0, "launch": 0.0}
    for f, b, d, w, c, e in summary:
      if c:
        continue
      kind, seconds = self.kernel_parts(f, b, d, e)
      if not self.accelerator:
        out["launch"] += w * self.launch
        seconds -= self.launch
      out[kind] += w * seconds
    return out

  def describe(self) -> str:
    """One line: the figures and where they come from."""
    gib = f", {self.memory_gib:g} GiB" if self.memory_gib else ""
    return (f"{self.about}: {self.matmul['bf16'] / 1e12:,.4g} TFLOP/s bf16, "
            f"{self.matmul['f32'] / 1e12:,.4g} float32 dots, {self.vector / 1e12:,.4g} vector, "
            f"{self.bandwidth / 1e9:,.4g} GB/s{gib}, {1e6 * self.launch:.3g} µs a kernel "
            f"({self.date}; {'; '.join(self.sources)})")


_H100 = "NVIDIA H100 datasheet, SXM5 (nvidia.com/en-us/data-center/h100), dense = half the " \
        "sparse figures"
PRESETS = {
    "h100": Device("h100", "NVIDIA H100 SXM5 80GB", {"f32": 494.7e12, "bf16": 989.4e12,
                                                     "int8": 1978.9e12},
                   66.9e12, 3.35e12, LAUNCH_GPU, 80, TAKEN, (_H100,)),
    "h200": Device("h200", "NVIDIA H200 SXM 141GB", {"f32": 494.7e12, "bf16": 989.4e12,
                                                     "int8": 1978.9e12},
                   66.9e12, 4.8e12, LAUNCH_GPU, 141, TAKEN,
                   ("NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the H100's "
                    "compute, 141 GB at 4.8 TB/s",)),
    "a100": Device("a100", "NVIDIA A100 SXM4 80GB", {"f32": 156e12, "bf16": 312e12,
                                                     "int8": 624e12},
                   19.5e12, 2.039e12, LAUNCH_GPU, 80, TAKEN,
                   ("NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), dense",)),
    "b200": Device("b200", "NVIDIA B200 (HGX, 1,000 W)", {"f32": 1100e12, "bf16": 2250e12,
                                                         "int8": 4500e12},
                   80e12, 8e12, LAUNCH_GPU, 180, TAKEN,
                   ("NVIDIA Blackwell architecture technical brief: HGX B200 dense, 180 GB of "
                    "HBM3e at 8 TB/s (DGX B200: 1,440 GB for 8)",)),
    "tpu-v5e": Device("tpu-v5e", "Google TPU v5e", {"f32": 197e12, "bf16": 197e12,
                                                   "int8": 394e12},
                      197e12 / 16, 819e9, LAUNCH_TPU, 16, TAKEN,
                      ("cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 394 int8, 16 GB at "
                       "819 GB/s; float32 dots as one bfloat16 pass; vector unit 1/16 of the "
                       "MXUs (an assumption)",)),
    "tpu-v5p": Device("tpu-v5p", "Google TPU v5p", {"f32": 459e12, "bf16": 459e12,
                                                   "int8": 918e12},
                      459e12 / 16, 2765e9, LAUNCH_TPU, 95, TAKEN,
                      ("cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB at 2,765 GB/s; "
                       "float32 dots as one bfloat16 pass; vector unit 1/16 of the MXUs (an "
                       "assumption)",)),
}
"""The accelerators users train on, by ``--device`` name."""
NAMES = tuple(PRESETS) + ("this-cpu",)


def _best(fn, *args, repeats: int = 5) -> float:
  """The shortest of ``repeats`` blocked runs of compiled ``fn`` (after one to warm up)."""
  fn(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return min(times)


@functools.lru_cache(maxsize=None)
def measure_this_cpu() -> Device:
  """The machine this process runs on, measured (a few seconds; once per process): the float32
  rate of a 1,024² matrix product, the bandwidth of a loop over 16 MB in and out, and the cost per
  kernel of a chain of 256 small matrix products (each a kernel of its own, the chain's kernels
  counted from its compiled program)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxcomp.train import hlo_cost
  cpu = jax.devices("cpu")[0]
  put = functools.partial(jax.device_put, device=cpu)
  n = 1024
  a = put(np.random.default_rng(0).standard_normal((n, n), np.float32))
  matmul = 2 * n**3 / _best(jax.jit(lambda x: x @ x), a)
  x = put(np.ones(4 * 2**20, np.float32))  # 16 MB: larger buffers page-fault on every call
  stream = jax.jit(lambda v: v * 2.0 + 1.0)
  bandwidth = 2 * x.nbytes / _best(stream, x)

  def chain(v, w):
    for _ in range(256):
      v = jnp.tanh(v @ w)
    return v
  small = put(np.eye(8, dtype=np.float32))
  compiled = jax.jit(chain).lower(small, small).compile()
  program = hlo_cost.kernels(compiled.as_text())
  count = sum(k.weight for k in program.kernels)
  launch = _best(compiled, small, small) / max(count, 1)  # the small kernels' work included
  return Device("this-cpu", f"this machine's CPU ({cpu.device_kind}, measured)",
                {"f32": matmul, "bf16": matmul, "int8": matmul}, matmul, bandwidth, launch, None,
                time.strftime("%Y-%m-%d"),
                (f"measured now: a {n}² float32 matrix product, a loop over 16 MB, a chain of "
                 f"{count:.0f} small kernels (jaxcomp.train.devices.measure_this_cpu)",),
                sustained=1.0, accelerator=False)


def get(name: str) -> Device:
  """The device called ``name`` (a key of ``PRESETS`` or ``"this-cpu"``, measured now).

  Raises:
    ValueError: an unknown name (the message lists the known ones).
  """
  if name == "this-cpu":
    return measure_this_cpu()
  if name not in PRESETS:
    raise ValueError(f"unknown device {name!r}; choose from {', '.join(NAMES)}")
  return PRESETS[name]
