"""Trains every compressor for --steps steps; with --save-at it checkpoints there on the way (and
stops there unless --out is given), with --resume-from it restores that checkpoint (in this fresh
process) and continues. Writes the final params to --out.

    python tests/workers/resume.py --steps 30 --save-at 12 --ckpt DIR --out full.npz
    python tests/workers/resume.py --steps 30 --resume-from 12 --ckpt DIR --out resumed.npz
"""

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import conftest  # noqa: E402,F401  (8 simulated CPU devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from compressors import ALGORITHMS  # noqa: E402
from training import make_step, run, start  # noqa: E402

POISON = ((3, 5, float("nan")), (17, 2, float("inf")))  # (step, device, value)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--save-at", type=int)
  parser.add_argument("--resume-from", type=int)
  parser.add_argument("--ckpt")
  parser.add_argument("--out")
  args = parser.parse_args()
  checkpointer = ocp.StandardCheckpointer()
  results = {}
  for name in ALGORITHMS:
    tx, pstep = make_step(name)
    params, opt_state = start(tx)
    first = args.resume_from or 0
    path = os.path.join(os.path.abspath(args.ckpt or "."), name)
    if args.resume_from is not None:
      restored = checkpointer.restore(path, {"params": params, "opt_state": opt_state})
      params, opt_state = restored["params"], restored["opt_state"]
    if args.save_at is not None:
      params, opt_state, _ = run(pstep, params, opt_state, args.save_at - first, first, POISON)
      checkpointer.save(path, jax.device_get({"params": params, "opt_state": opt_state}))
      checkpointer.wait_until_finished()
      first = args.save_at
      if not args.out:
        continue
    params, opt_state, _ = run(pstep, params, opt_state, args.steps - first, first, POISON)
    for key, leaf in jax.tree_util.tree_leaves_with_path(params):
      results[f"{name}/{jax.tree_util.keystr(key)}"] = np.asarray(leaf)
  if args.out:
    np.savez(args.out, **results)


if __name__ == "__main__":
  main()
