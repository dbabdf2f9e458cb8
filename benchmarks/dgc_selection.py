"""DGC selection: the sampled threshold estimate against exact ``lax.top_k``, side by side.

One gradient-like vector of 10M float32 elements (``--quick``: 100k), density 0.001 (k = 10,000).
``sampled`` is ``jaxcomp.dgc``'s selection (strided 1% sample, threshold adaptation, compaction of
the candidates, exact top-k among them when too many); ``exact`` is ``lax.top_k`` of ``|x|`` — the
two selection modes of ``jaxcomp.dgc``. Both are jitted and timed round-robin in one run; the
reported figure is the median over rounds of time(exact) / time(sampled). Absolute times are for
scale only (a shared CPU). ``--quick`` is for CI: small shapes, three rounds, no claims.

``--kernels`` measures instead the backend workarounds of the DGC section of
``jaxcomp._src.kernels``, each against the obvious form it replaces: the sampled selection's time
with each selection kernel swapped for its obvious form, and the temporaries of a whole DGC update
(ResNet-18's gradient shapes, ``--quick``: a small pytree; W = 8 under ``jax.pmap``, gradient and
state donated, as ``benchmarks/memory.py`` measures them) with each scatter kernel swapped.

  PYTHONPATH=. python benchmarks/dgc_selection.py [--quick] [--kernels] [--n N] [--density D]
      [--repeats R]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp._src import dgc, kernels, topk  # noqa: E402


def _nonzero_candidates(x, bits, capacity):  # a cumsum over all of x
  hits = (bits[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  indices = jnp.nonzero(hits.reshape(-1)[:x.size], size=capacity, fill_value=x.size)[0]
  return indices, jnp.where(indices < x.size, jnp.abs(x.at[indices].get(mode="clip")), -1)


def _flat(update):  # the same update through the leaf's flat view
  return lambda x, i, *values: update(x.ravel(), i, *values).reshape(x.shape)


# What each kernel replaces: {label: {kernel name: the obvious form}}.
SELECTION_KERNELS = {
    "first_at_least as jnp.nonzero": {"first_at_least": _nonzero_candidates},
    "kth_largest from top_k's values": {"kth_largest": lambda x, k: lax.top_k(x, k)[0][-1]},
    "a while_loop entered always": {"while_loop_if_needed": lax.while_loop},
}
SCATTER_KERNELS = {
    "scatter_add into shared zeros": {"scatter_add": lambda shape, i, values: jnp.zeros(
        shape, values.dtype).at[kernels._coordinates(i, shape)].add(values, mode="drop")},
    "scatters through the flat view": {
        "scatter_add": lambda shape, i, values: _flat(lambda x, i, v: x.at[i].add(v, mode="drop"))(
            jnp.zeros(shape, values.dtype), i, values),
        "zero_at": _flat(lambda x, i: x.at[i].set(0, mode="drop")),
        "subtract_at": _flat(lambda x, i, v: x.at[i].add(-v, mode="drop"))},
    "v cleared by zero_at": {"subtract_at": lambda x, i, values: kernels.zero_at(x, i)},
}


def _patched(replacements: dict) -> contextlib.ExitStack:
  """A context in which ``kernels`` holds ``replacements`` (``{name: function}``)."""
  stack = contextlib.ExitStack()
  for name, fn in replacements.items():
    stack.enter_context(mock.patch.object(kernels, name, fn))
  return stack


def _update_temporaries(tree, **settings) -> float:
  """Temporaries of one DGC update / the gradient's bytes, as ``benchmarks/memory.py`` measures
  them."""
  tx = dgc.dgc(axis_name=common.AXIS, **settings)
  state = jax.eval_shape(tx.init, tree)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=common.AXIS, devices=jax.devices()[:8],
                  donate_argnums=(0, 1))
  compiled = step.lower(common.stacked(tree, 8), common.stacked(state, 8)).compile()
  grad = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
  return compiled.memory_analysis().temp_size_in_bytes / grad


def measure_kernels(x, plan, key, repeats: int, quick: bool) -> None:
  """Prints each DGC kernel against the obvious form it replaces."""
  fns = {}
  for label, replacements in {"with the kernels": {}, **SELECTION_KERNELS}.items():
    with _patched(replacements):
      select = jax.jit(lambda x, key: topk.sampled_topk(x, plan, key)[0])
      jax.block_until_ready(select(x, key))  # traced and compiled with the replacements
    fns[label] = lambda select=select: jax.block_until_ready(select(x, key))
  times = common.interleaved(fns, repeats)
  print(f"sampled selection of {x.size:,} elements, median of {repeats} rounds:")
  for label in fns:
    print(f"  {label:<38} {1e3 * common.median(times[label]):8.1f} ms "
          f"({common.ratio(times, label, 'with the kernels'):.2f}x)")
  tree = common.tiny() if quick else common.resnet18()
  print(f"DGC update temporaries / gradient ({'tiny' if quick else 'ResNet-18'}, W = 8, donated):")
  for label, replacements in {"with the kernels": {}, **SCATTER_KERNELS}.items():
    with _patched(replacements):
      row = [_update_temporaries(tree, ratio=0.001, selection=s) for s in ("sampled", "exact")]
    print(f"  {label:<38} sampled {row[0]:.2f}, exact {row[1]:.2f}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="100k elements, 3 rounds (CI; no claims)")
  p.add_argument("--kernels", action="store_true",
                 help="each DGC kernel against the obvious form it replaces")
  p.add_argument("--n", type=int, default=None, help="elements (default 10M, --quick 100k)")
  p.add_argument("--density", type=float, default=0.001)
  p.add_argument("--repeats", type=int, default=None, help="rounds (default 21, --quick 3)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  n = args.n or (100_000 if args.quick else 10_000_000)
  repeats = args.repeats or (3 if args.quick else 21)
  plan = topk.sampling_plan(n, args.density)
  x = jax.random.normal(jax.random.PRNGKey(args.seed), (n,), jnp.float32)
  key = jax.random.PRNGKey(args.seed + 1)
  if args.kernels:
    measure_kernels(x, plan, key, repeats, args.quick)
    return 0
  sampled = jax.jit(lambda x, key: topk.sampled_topk(x, plan, key)[0])
  exact = jax.jit(lambda x: topk.exact_topk(x, plan.k))

  chosen = np.asarray(sampled(x, key))
  sent = int(np.sum(chosen < n))
  times = common.interleaved({"sampled": lambda: jax.block_until_ready(sampled(x, key)),
                              "exact": lambda: jax.block_until_ready(exact(x))}, repeats)
  speedup = common.ratio(times, "exact", "sampled")
  print(f"n = {n:,}, density {args.density}: k = {plan.k:,}; {plan.num_samples:,} samples at "
        f"stride {plan.stride}, threshold from the top {plan.top_k_samples}")
  print(f"sampled selection sent {sent:,} of at most {plan.k:,} "
        f"({sent / plan.k:.3f}·k; the reference's band is 0.8·k–k)")
  print(f"median over {repeats} rounds: sampled {1e3 * common.median(times['sampled']):.1f} ms, "
        f"lax.top_k {1e3 * common.median(times['exact']):.1f} ms")
  print(f"speed-up of sampled over exact (median of per-round ratios): {speedup:.2f}x")
  if not 0 < sent <= plan.k or math.isnan(speedup):
    return 1
  return 0


if __name__ == "__main__":
  from jaxcomp.train import device_setup
  device_setup.simulate_cpu_devices(8)  # --kernels runs a DGC update on W = 8
  sys.exit(main())
