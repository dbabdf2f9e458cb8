"""Compression time against parameter count, from 1M to 100M parameters.

The gradient is a stack of L layers, each a (1024, 1024) Dense kernel and its bias, with L = 1, 3,
10, 30 and 96 (1.05M to 100.8M parameters; ``--quick``: (32, 32) layers). Each compressor's jitted
``update`` runs on one device (``axis_name=None``), its state threaded from call to call; at one
size all compressors run round-robin. Reported: the median time, and that time divided by
allreduce's — at world size 1 allreduce is one pass over the gradient (÷1), so the ratio counts
gradient-sized passes and does not depend on how busy the machine is.

  PYTHONPATH=. python benchmarks/scaling.py [--quick] [--write]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.compute_vs_torch import jax_runner  # noqa: E402

LAYERS = (1, 3, 10, 30, 96)


def layers(count: int, width: int) -> dict:
  return {f"layer{i}": common.dense(width, width) for i in range(count)}


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 2)")
  args = common.parse(p, argv)
  repeats = args.repeats or (2 if args.quick else 5)
  width = 32 if args.quick else 1024
  compressor_list = common.compressors(args.compressors)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  rows = []
  for count in (LAYERS[:2] if args.quick else LAYERS):
    tree = layers(count, width)
    grads = common.random_like(tree)
    runners = {c.name: jax_runner(c.make(None), grads) for c in compressor_list}
    times = common.interleaved(runners, repeats)
    del runners, grads
    n = common.num_params(tree)
    row = [f"{n:,}"]
    for c in compressor_list:
      passes = common.ratio(times, c.name, "allreduce")
      row.append(f"{1e3 * common.median(times[c.name]):.1f} ({passes:.1f})")
    rows.append(row)
    print(f"  {n:,} params: " + ", ".join(rows[-1][1:]), file=sys.stderr, flush=True)
  table = common.markdown_table(["params"] + [c.name for c in compressor_list], rows)
  body = (f"One device, jitted `update`, median of {repeats} interleaved rounds: milliseconds (for "
          "scale only), and in parentheses the time as a multiple of allreduce's in the same round "
          "(allreduce at world size 1 is one pass over the gradient).\n\n" + table)
  common.emit(args, "scaling", "Compression time against parameter count", "scaling.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
