"""DGC selection: the sampled threshold estimate against exact ``lax.top_k``, side by side.

One gradient-like vector of 10M float32 elements (``--quick``: 100k), density 0.001 (k = 10,000).
``sampled`` is ``jaxcomp.dgc``'s selection (strided 1% sample, threshold adaptation, compaction of the
candidates, exact top-k among them when too many); ``exact`` is ``lax.top_k`` of ``|x|`` — the two
selection modes of ``jaxcomp.dgc``. Both are jitted and timed round-robin in one run; the reported
figure is the median over rounds of time(exact) / time(sampled). Absolute times are for scale only (a
shared CPU). ``--quick`` is for CI: small shapes, three rounds, no claims.

  PYTHONPATH=. python benchmarks/dgc_selection.py [--quick] [--n N] [--density D] [--repeats R]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp._src import dgc  # noqa: E402



def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="100k elements, 3 rounds (CI; no claims)")
  p.add_argument("--n", type=int, default=None, help="elements (default 10M, --quick 100k)")
  p.add_argument("--density", type=float, default=0.001)
  p.add_argument("--repeats", type=int, default=None, help="rounds (default 21, --quick 3)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  n = args.n or (100_000 if args.quick else 10_000_000)
  repeats = args.repeats or (3 if args.quick else 21)
  plan = dgc.sampling_plan(n, args.density)
  x = jax.random.normal(jax.random.PRNGKey(args.seed), (n,), jnp.float32)
  key = jax.random.PRNGKey(args.seed + 1)
  sampled = jax.jit(lambda x, key: dgc.sampled_topk(x, plan, key)[0])
  exact = jax.jit(lambda x: dgc.exact_topk(x, plan.k))

  chosen = np.asarray(sampled(x, key))
  sent = int(np.sum(chosen < n))
  times = common.interleaved({"sampled": lambda: jax.block_until_ready(sampled(x, key)),
                              "exact": lambda: jax.block_until_ready(exact(x))}, repeats)
  speedup = common.ratio(times, "exact", "sampled")
  print(f"n = {n:,}, density {args.density}: k = {plan.k:,}; {plan.num_samples:,} samples at stride "
        f"{plan.stride}, threshold from the top {plan.top_k_samples}")
  print(f"sampled selection sent {sent:,} of at most {plan.k:,} "
        f"({sent / plan.k:.3f}·k; the reference's band is 0.8·k–k)")
  print(f"median over {repeats} rounds: sampled {1e3 * common.median(times['sampled']):.1f} ms, "
        f"lax.top_k {1e3 * common.median(times['exact']):.1f} ms")
  print(f"speed-up of sampled over exact (median of per-round ratios): {speedup:.2f}x")
  if not 0 < sent <= plan.k or math.isnan(speedup):
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
