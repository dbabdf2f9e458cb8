"""Wire bytes per step per compressor, from the compiled step, against the algorithm's minimum.

For ResNet-18, ResNet-50 and GPT-2 small shaped gradients (shapes only: nothing is allocated), each
compressor's ``update`` is compiled under ``jax.pmap`` over W = 8 simulated devices and
``jaxcomp.comm_report`` reads the bytes of every collective from the compiled HLO. The update
alone, not a training step (``jaxcomp.data_parallel`` builds one from a loss, which shape-only
models do not have): what a step sends besides its compressor is the step builder's doing, and
``tests/test_train.py`` checks that the main job's ``data_parallel`` step sends nothing else. The
minimum is each algorithm's byte count from its definition, ``jaxcomp.train.wire`` (its docstring
has every formula), the one the planner (``python -m jaxcomp.train --plan``) projects with: the
formulas are written from the definitions, not computed by jaxcomp's code, so this table
checks them against the compiled step. Local SGD
and DiLoCo (``registry.PERIODIC``) send once every H steps: their bytes are amortised (sync bytes
/ H); their compiled step holds the sync in a conditional branch, which
``Compressor.bytes_per_step`` divides by H.

Payload bytes are those of ``comm_report``: the reduced buffer for all-reduce, the gathered result
(W contributions) for all-gather, the input for all-to-all. Under the ring algorithm an all-reduce
sends 2·(W−1)/W of its payload per device and the others (W−1)/W, so the last column, what each
device sends against a float32 all-reduce, is the fair comparison between them. bf16 is read before
optimisation (``stage="lowered"``): XLA:CPU widens bf16 collectives to f32 when it compiles (GPUs
keep them narrow); the compiled figure is shown too. A float16 all-reduce (or reduce-scatter) runs
on XLA:CPU as an all-to-all (and an all-gather) that ``comm_report`` counts as the collective it
replaces, its bytes that collective's; "compiled collectives" names both.

  PYTHONPATH=. python benchmarks/bytes.py [--quick] [--write]
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

device_setup.simulate_cpu_devices(8)  # before JAX starts its backends

from benchmarks import common  # noqa: E402
from jaxcomp.train import wire  # noqa: E402
from jaxcomp.train.registry import DEFAULT, PERIODIC  # noqa: E402

W = 8


def minimum(name: str, tree, world: int = W) -> float:
  """The algorithm's bytes per step per device (payload), from its definition (``wire``)."""
  sent = wire.messages(name, tree, world)
  if sent is None:
    raise KeyError(f"{name}: jaxcomp.train.wire has no formula for it")
  return wire.payload_bytes(sent)


def measure(compressor, tree):
  """``(compiled CommReport, lowered CommReport)`` of one update step on W devices."""
  inner = {"inner": compressor.plainest_inner(0.1)} if compressor.wraps_optimizer else {}
  tx = compressor.make(common.AXIS, **inner)
  state = common.stacked(jax.eval_shape(tx.init, tree), W)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=common.AXIS,
                  devices=jax.devices()[:W])
  grads = common.stacked(tree, W)
  from jaxcomp import comm_report
  return (comm_report(step, grads, state, grads, num_devices=W),
          comm_report(step, grads, state, grads, stage="lowered", num_devices=W))


def _compiled_op(collective) -> str:
  """The collective's op, and what runs in its place where that differs (float16 on XLA:CPU)."""
  if not collective.runs_as:
    return collective.op
  return f"{collective.op} (run as {' + '.join(collective.runs_as)})"


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
      report = lowered if c.name == "bf16" else compiled
      compiled_bytes = c.bytes_per_step(compiled, "payload_bytes")
      sent = c.bytes_per_step(report, "payload_bytes")
      lo = minimum(c.name, tree)
      ops = ", ".join(f"{n}× {op}" for op, n in sorted(
          collections.Counter(_compiled_op(x) for x in compiled.collectives).items()))
      if c.wraps_optimizer and "sync_every" in c.settings:
        ops += f", once every {c.settings['sync_every']} steps"
      elif c.wraps_optimizer:  # several periods (DES-LOC's parameters and moments)
        ops += ", " + ", ".join(f"{k} {v}" for k, v in c.settings.items()
                                if k.endswith("sync_every"))
      rows.append([model, f"{numel:,}", c.name, _amount(compiled_bytes), _amount(sent),
                   _amount(lo), f"{sent / lo:.2f}", f"{4 * numel / sent:.1f}×", ops,
                   f"{2 * (W - 1) / W * 4 * numel / c.bytes_per_step(report):.1f}×"])
      print(f"  {model} {c.name}: {_amount(sent)} B vs minimum {_amount(lo)} B "
            f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
      # Each compiled program keeps its code mapped: a hundred of them (GPT-2 small's after
      # ResNet-50's) exhaust the process's memory maps and LLVM aborts ("Cannot allocate memory").
      jax.clear_caches()
  table = common.markdown_table(
      ["model", "params", "compressor", "compiled B", "sent B", "minimum B", "ratio",
       "vs f32", "compiled collectives", "ring vs f32"], rows, "lrlrrrrrlr")
  body = (f"W = {W} simulated devices (`jax.pmap`); bytes per device per step (payload: reduced "
          "buffer of an all-reduce, gathered result of an all-gather). \"sent\" is the compiled "
          "HLO's, except bf16: XLA:CPU widens bf16 collectives to f32 when compiling "
          "(\"compiled B\"), so its wire is read before optimisation. The minimum is each "
          "algorithm's count from its definition (`jaxcomp.train.wire`, whose docstring has each "
          "formula; it counts the 4-byte finiteness flag of chunked top-k and `comm_hook`). An "
          "all-reduce "
          "moves its buffer twice under the ring algorithm, an all-gather or all-to-all once: "
          "\"ring vs f32\" compares what each device sends (`CommReport.ring_bytes`) with a "
          "float32 ring all-reduce's. Local SGD and DiLoCo send once every H steps: their bytes "
          "are amortised (sync bytes / H).\n\n" + table)
  common.emit(args, "bytes", "Wire bytes per step against the algorithm's minimum", "bytes.py",
              body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
