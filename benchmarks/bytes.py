"""Wire bytes per step per compressor, from the compiled step, against the algorithm's minimum.

For ResNet-18, ResNet-50 and GPT-2 small shaped gradients (shapes only: nothing is allocated), each
compressor's ``update`` is compiled under ``jax.pmap`` over W = 8 simulated devices and
``jaxcomp.comm_report`` reads the bytes of every collective from the compiled HLO. The minimum is
computed here from the algorithm's definition, independently of jaxcomp:

* dense means: 4 bytes per element (2 for fp16 / bf16);
* PowerSGD: 4·r·(n + m) per compressed leaf (P and Q) and 4·n·m for the rest, with each leaf viewed as
  (prod(shape[:-1]), shape[-1]), r = min(n, m, rank), compressed iff (n + m)·r·2 < n·m;
* batched PowerSGD: 4·2·side·r, side = ceil(sqrt(total elements));
* DGC: W·k·(4 value + 4 index bytes) per leaf with ndim > 1, k = ceil(numel·density), and 4·numel for
  the rest; coarse DGC: 4 bytes per chunk norm plus the chosen chunks, 4·numel for the rest;
* stateful compressors add the 4-byte int32 all-reduce that checks that the gradient is finite on
  every device (their state must not absorb a NaN step);
* local SGD and DiLoCo (``registry.PERIODIC``) send once every H steps: the parameters (local SGD) or
  the pseudo-gradient (DiLoCo) in f32, or through their compressor by its formula above, divided by
  H — amortised bytes per step. Their compiled step holds the sync in a conditional branch, which
  ``Compressor.bytes_per_step`` divides by H.

Payload bytes are those of ``comm_report``: the reduced buffer for all-reduce, the gathered result (W
contributions) for all-gather. bf16 is read before optimisation (``stage="lowered"``): XLA:CPU widens
bf16 collectives to f32 when it compiles (GPUs keep them narrow); the compiled figure is shown too.

  PYTHONPATH=. python benchmarks/bytes.py [--quick] [--write]
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from benchmarks import common  # noqa: E402
from jaxcomp.train.registry import DEFAULT, PERIODIC  # noqa: E402

W = 8
FLAG = 4  # the int32 finiteness all-reduce of stateful compressors


def _sizes(tree):
  return [tuple(x.shape) for x in jax.tree.leaves(tree)]


def _powersgd_min(tree, rank):
  total = 0
  for shape in _sizes(tree):
    n, m = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    r = min(n, m, rank)
    total += 4 * r * (n + m) if (n + m) * r * 2 < n * m else 4 * n * m
  return total + FLAG


def _batched_min(tree, rank):
  side = math.ceil(math.sqrt(sum(math.prod(s) for s in _sizes(tree))))
  return 4 * 2 * side * min(side, rank) + FLAG


def _dgc_min(tree, density):
  total = 0
  for shape in _sizes(tree):
    numel = math.prod(shape)
    sparse = W * math.ceil(numel * density) * (4 + 4)
    total += sparse if len(shape) > 1 and sparse < 4 * numel else 4 * numel
  return total + FLAG


def _coarse_min(tree, density, chunk=256):
  total = 0
  for shape in _sizes(tree):
    numel = math.prod(shape)
    chunks = -(-numel // chunk)
    sparse = 4 * chunks + 4 * math.ceil(chunks * density) * chunk
    total += sparse if len(shape) > 1 and sparse < 4 * numel else 4 * numel
  return total + FLAG


def minimum(name: str, tree) -> float:
  """The algorithm's bytes per step per device (payload), computed from its definition."""
  numel = common.num_params(tree)
  return {
      "local_sgd_h8": lambda: 4 * numel / 8,
      "diloco_h20": lambda: 4 * numel / 20,
      "diloco_h20_fp16": lambda: 2 * numel / 20,
      "diloco_h20_powersgd_r2": lambda: _powersgd_min(tree, 2) / 20,
      "allreduce": lambda: 4 * numel,
      "fp16": lambda: 2 * numel,
      "bf16": lambda: 2 * numel,
      "powersgd_r1": lambda: _powersgd_min(tree, 1),
      "powersgd_r2": lambda: _powersgd_min(tree, 2),
      "powersgd_r4": lambda: _powersgd_min(tree, 4),
      "batched_powersgd_r1": lambda: _batched_min(tree, 1),
      "dgc": lambda: _dgc_min(tree, 0.001),
      "coarse_dgc": lambda: _coarse_min(tree, 0.01),
  }[name]()


def measure(compressor, tree):
  """``(compiled CommReport, lowered CommReport)`` of one update step on W devices."""
  inner = {"inner": optax.sgd(0.1)} if compressor.wraps_optimizer else {}
  tx = compressor.make(common.AXIS, **inner)
  state = common.stacked(jax.eval_shape(tx.init, tree), W)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=common.AXIS,
                  devices=jax.devices()[:W])
  grads = common.stacked(tree, W)
  from jaxcomp import comm_report
  return (comm_report(step, grads, state, grads, num_devices=W),
          comm_report(step, grads, state, grads, stage="lowered", num_devices=W))


def _amount(num_bytes: float) -> str:
  """Bytes with thousands separators, one decimal where an amortised figure has a fraction."""
  return f"{num_bytes:,.0f}" if num_bytes == int(num_bytes) else f"{num_bytes:,.1f}"


def main(argv=None) -> int:
  args = common.parse(common.parser(__doc__.split("\n\n")[0]), argv)
  rows = []
  for model, tree in common.models(args.quick).items():
    numel = common.num_params(tree)
    for c in common.compressors(args.compressors or ",".join(DEFAULT + PERIODIC)):
      start = time.perf_counter()
      compiled, lowered = measure(c, tree)
      compiled_bytes = c.bytes_per_step(compiled, "payload_bytes")
      sent = c.bytes_per_step(lowered if c.name == "bf16" else compiled, "payload_bytes")
      lo = minimum(c.name, tree)
      ops = ", ".join(f"{n}× {op}" for op, n in sorted(
          {op: sum(x.op == op for x in compiled.collectives) for op in
           {x.op for x in compiled.collectives}}.items()))
      if c.wraps_optimizer:
        ops += f", once every {c.settings['sync_every']} steps"
      rows.append([model, f"{numel:,}", c.name, _amount(compiled_bytes), _amount(sent),
                   _amount(lo), f"{sent / lo:.2f}", f"{4 * numel / sent:.1f}×", ops])
      print(f"  {model} {c.name}: {_amount(sent)} B vs minimum {_amount(lo)} B "
            f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
  table = common.markdown_table(
      ["model", "params", "compressor", "compiled B", "sent B", "minimum B", "ratio",
       "vs f32", "compiled collectives"], rows, "lrlrrrrrl")
  body = (f"W = {W} simulated devices (`jax.pmap`); bytes per device per step (payload: reduced "
          "buffer of an all-reduce, gathered result of an all-gather). \"sent\" is the compiled HLO's, "
          "except bf16: XLA:CPU widens bf16 collectives to f32 when compiling (\"compiled B\"), so its "
          "wire is read before optimisation. The minimum counts the 4-byte finiteness flag of the "
          "stateful compressors (see the script's docstring for each formula). Local SGD and DiLoCo "
          "send once every H steps: their bytes are amortised (sync bytes / H).\n\n" + table)
  common.emit(args, "bytes", "Wire bytes per step against the algorithm's minimum", "bytes.py",
              body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
