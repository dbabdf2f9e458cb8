"""The planner's "Fully sharded" table: memory per device against bytes per step, for DDP, ZeRO-1/2
and ``jaxcomp.fully_sharded`` (ZeRO-3 / FSDP) with its compressed gathers and scatters.

For the planner's model, W devices and link speeds (``jaxcomp.train.planner``), a row per way to
train with Adam:

* **memory per device** of the parameters and Adam's two moments (float32; Adam's 4-byte step count
  left out), N parameters, each leaf of n values: DDP 12·N; ZeRO-1/2 4·N + 8·Σ⌈n/W⌉ (every leaf
  sharded, a 0-d one as one value); FSDP 12·(Σ⌈n/W⌉ over the sharded leaves + Σ n over the
  replicated ones: 0-d, or n < W). A lossy gather keeps no other copy: the stored float32 shards
  are the master. Apart, the exchange's state: ``quantized(8)``'s error feedback is the whole
  float32 gradient of every sharded leaf on every device (4·N, not sharded), plus a 4-byte step
  count per layer; ``quantized(8, error_feedback=False)`` keeps the counts only;
* **bytes** each device sends per step (ring algorithm), exact at the model's layer shapes
  (``wire.fsdp_messages``, ``wire.zero_messages``, ``wire.messages("allreduce")``: formulas the
  tests hold equal to the compiled steps' ``comm_report``), and against FSDP with bfloat16 both
  ways;
* **communication time** per step under the α-β model (``jaxcomp.train.network``), ring and
  recursive doubling; a reduce-scatter of N bytes a worker is costed as the all-gather it mirrors
  (N/W bytes from each worker: (W−1)·(α + N/(W·β)) by ring, recursive halving ⌈log2 W⌉·α +
  (W−1)·N/(W·β));
* **fits**: with ``device_gib``, whether the parameters, Adam's moments and the exchange's state
  fit that many GiB per device (activations, the gathered layer and temporaries not counted: a
  necessary condition, not a sufficient one).

The step time of ``fully_sharded`` against DDP's and its steps to target are not measured: the
table says "not measured"; where DDP does not fit a device, the recommendation ranks the exact
sharded ways (``jaxcomp.train.recommend``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

from jaxcomp.train import network, units, wire

GIB = 2**30

VARIANTS = (
    # (label, kind, gather dtype, exchange, error feedback)
    ("DDP (allreduce)", "ddp", None, "allreduce", False),
    ("ZeRO-1/2 exact", "zero", None, "allreduce", False),
    ("FSDP exact", "fsdp", None, "allreduce", False),
    ("FSDP bf16 both ways", "fsdp", "bfloat16", "bf16_compress", False),
    ("FSDP int8 both ways", "fsdp", "int8", "quantized_int8", True),
    ("FSDP int8 both ways, no error feedback", "fsdp", "int8", "quantized_int8", False),
    ("FSDP fp8 gather, int8 scatter", "fsdp", "float8_e4m3fn", "quantized_int8", True),
)
"""The rows: what each is in ``jaxcomp``: DDP ``optax.chain(allreduce(), adam)``; ZeRO-1/2
``sharded_optimizer(allreduce(), adam)``; FSDP ``fully_sharded(loss, mesh, exchange, adam,
gather_dtype=...)`` with ``allreduce()``, ``bf16_compress()``, ``quantized(8)`` or
``quantized(8, error_feedback=False)``."""


@dataclasses.dataclass
class FsdpRow:
  """One way to train: ``label``; per device ``state`` (parameters + Adam's moments) and
  ``exchange_state`` bytes; ``sent``, ring bytes per step; ``vs_bf16``, ``sent`` over FSDP bf16's;
  ``comm_ms``, ``{gbits: {"ring": ms, "doubling": ms, "best": ms}}``; ``fits``, None without
  ``device_gib``."""
  label: str
  state: int
  exchange_state: int
  sent: float
  vs_bf16: float = 0.0
  comm_ms: dict = dataclasses.field(default_factory=dict)
  fits: Optional[bool] = None

  @property
  def total(self) -> int:
    """Bytes per device of the parameters, Adam's moments and the exchange's state."""
    return self.state + self.exchange_state


def memory(tree, world: int, kind: str, exchange: str = "allreduce",
           error_feedback: bool = False) -> tuple:
  """``(parameters + Adam's moments, exchange state)``: bytes per device for ``kind`` ("ddp",
  "zero", "fsdp") on ``world`` devices with ``exchange`` (a key of ``wire.FSDP_SCATTERS``; its
  state: ``quantized_int8``'s, with or without ``error_feedback``), the module docstring's
  formulas."""
  items = wire.leaves(tree)
  n = sum(math.prod(s) for _, s in items)
  if kind == "ddp":
    return 12 * n, 0
  if kind == "zero":
    return 4 * n + 8 * sum(-(-max(math.prod(s), 1) // world) for _, s in items), 0
  held = kept = 0
  for layer in wire.fsdp_layers(tree):
    sharded = [math.prod(s) for _, s in layer if s and math.prod(s) >= world]
    held += sum(-(-v // world) for v in sharded) + sum(
        math.prod(s) for _, s in layer if not s or math.prod(s) < world)
    if sharded and exchange == "quantized_int8":
      kept += 4 + (4 * sum(sharded) if error_feedback else 0)
  return 12 * held, kept


def check_device_gib(device_gib) -> None:
  """Refuses a ``device_gib`` that is not None or a positive number of GiB.

  Raises:
    TypeError: ``device_gib`` is not a number.
    ValueError: ``device_gib`` is not a positive number of GiB.
  """
  if device_gib is None:
    return
  if not isinstance(device_gib, numbers.Real) or isinstance(device_gib, bool):
    raise TypeError(f"device_gib must be a number of GiB per device (e.g. 80); got "
                    f"{type(device_gib).__name__}")
  if not 0 < device_gib < float("inf"):
    raise ValueError(f"device_gib must be a positive number of GiB per device (e.g. 80); got "
                     f"{device_gib!r}")


def rows(tree, world: int, gbits: Sequence[float], alpha: float = network.ALPHA,
         device_gib: Optional[float] = None) -> list:
  """An ``FsdpRow`` per ``VARIANTS`` entry for ``tree`` on ``world`` devices at each of ``gbits``.

  Raises:
    TypeError: ``device_gib`` is not a number.
    ValueError: ``device_gib`` is not a positive number of GiB.
  """
  check_device_gib(device_gib)
  out = []
  for label, kind, gather, exchange, feedback in VARIANTS:
    if kind == "ddp":
      sent = wire.messages("allreduce", tree, world)
    elif kind == "zero":
      sent = wire.zero_messages(tree, world)
    else:
      sent = wire.fsdp_messages(tree, world, gather, exchange)
    state, exchange_state = memory(tree, world, kind, exchange, feedback)
    row = FsdpRow(label, state, exchange_state, wire.ring_bytes(sent, world))
    operands = wire.operands(sent, world)
    for g in gbits:
      beta = network.gbits_to_beta(g)
      row.comm_ms[g] = {a: 1e3 * network.step_time(operands, world, alpha, beta, a)
                        for a in network.ALGORITHMS}
    if device_gib is not None:
      row.fits = row.total <= device_gib * GIB
    out.append(row)
  bf16 = next(r for r in out if r.label == "FSDP bf16 both ways")
  for row in out:
    row.vs_bf16 = row.sent / bf16.sent
  return out


def _gib(b: float) -> str:
  return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b:,} B"


def render(table: list, world: int, gbits: Sequence[float], alpha: float,
           device_gib: Optional[float] = None) -> str:
  """The "Fully sharded" table and where its figures come from, its bytes and times written as
  the compressor table's."""
  head = ["way to train (Adam)", "params + Adam / device", "exchange state / device"]
  head += [f"fits {device_gib:g} GiB"] if device_gib is not None else []
  head += ["sent/step/device", "vs FSDP bf16"]
  head += [f"comm/step at {g:g} Gbit/s, ring / tree" for g in gbits]
  head += ["compute overhead", "steps to target"]
  lines = ["", f"Fully sharded (ZeRO-3 / FSDP: jaxcomp.fully_sharded, a layer per top-level entry) "
           f"against DDP and ZeRO-1/2, W = {world} (α-β model, α = {1e6 * alpha:g} µs):", "",
           "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  for r in table:
    cells = [r.label, _gib(r.state), _gib(r.exchange_state) if r.exchange_state else "0"]
    cells += ["yes" if r.fits else "no"] if device_gib is not None else []
    cells += [units.human_bytes(r.sent), f"{r.vs_bf16:.2f}x"]
    cells += [f"{units.human_ms(r.comm_ms[g]['ring'])} / "
              f"{units.human_ms(r.comm_ms[g]['doubling'])}" for g in gbits]
    measured = r.label.startswith("DDP")  # the compressor table's allreduce row
    cells += ["0 (the baseline)" if measured else "not measured",
              "1.00x (the baseline)" if measured else "not measured"]
    lines.append("| " + " | ".join(cells) + " |")
  lines += [
      "", "Where these figures come from:",
      "* memory: parameters and Adam's two moments, float32, per device (12·N for DDP; ZeRO-1/2 "
      "4·N + 8·Σ⌈n/W⌉; FSDP 12·Σ⌈n/W⌉ over the sharded leaves, 12·n for the replicated ones: "
      "0-d or fewer values than W); a lossy gather keeps no other copy (the stored shards are "
      "the master). The exchange's state apart: quantized(8)'s error feedback is the whole "
      "float32 gradient on every device. Activations, the gathered layer and temporaries are not "
      "counted" + (", so \"fits\" is necessary, not sufficient" if device_gib is not None else "")
      + ".",
      "* bytes: exact at this model's layer shapes (jaxcomp/train/wire.py: fsdp_messages, "
      "zero_messages, held equal to the compiled steps' comm_report by tests/test_fsdp_plan.py), "
      "ring algorithm, each layer gathered once: with jaxcomp.call_layer (one layer's "
      "parameters held at a time) or under jax.checkpoint around a layer, the backward pass "
      "gathers it again (add the gather's bytes once more).",
      "* comm: the α-β model (jaxcomp/train/network.py), ring / tree (recursive doubling; a "
      "reduce-scatter as the all-gather it mirrors, recursive halving), no overlap with compute "
      "here (the recommendation credits FSDP's prefetch of the next layer's gather).",
      "* compute overhead and steps to target: not measured for the sharded ways (benchmarks/"
      "fsdp.py times fully_sharded against DDP on an MLP on CPU); where DDP does not fit, the "
      "recommendation ranks the exact ones (ZeRO-1/2, FSDP exact) with allreduce's steps, the "
      "same arithmetic, and allreduce's update."]
  return "\n".join(lines)
