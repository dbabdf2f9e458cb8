"""DGC on DDP's buckets (``bucket_cap_mb``): the same step as on the whole tree, a non-finite
bucket keeping every bucket's state, and local clipping refused."""

import functools

import chex
import jax
import numpy as np
import pytest

import jaxcomp
from jaxcomp import hooks

from helpers import pmapped_update, replicate

pytestmark = pytest.mark.numeric
W = 4


def momenta(state):
  """``{path: (u, v, dense_u)}`` of a ``DGCState``, or of the per-bucket ones of a bucketed
  state."""
  states = getattr(state, "hook_states", (state,))
  return {s.signature.paths[i]: leaves for s in states
          for i, leaves in zip(s.signature.reduced,
                               zip(*(s.signature.pick(t) for t in (s.u, s.v, s.dense_u))))}


# Sampled selection too: a leaf's sampling key comes from its path, the same in a bucket.
@pytest.mark.parametrize("factory", [functools.partial(jaxcomp.dgc, 0.05, selection="exact"),
                                     functools.partial(jaxcomp.dgc, 0.05),
                                     functools.partial(jaxcomp.coarse_dgc, 0.25, chunk_size=8)],
                         ids=["exact", "sampled", "coarse"])
def test_bucketed_dgc_gives_the_same_step(factory):
  params = {f"l{i}": {"kernel": np.zeros((24, 16), np.float32), "bias": np.zeros(16, np.float32)}
            for i in range(3)}
  txs = [factory(), factory(bucket_cap_mb=1e-3)]
  states = [replicate(tx.init(params), W) for tx in txs]
  updates = [pmapped_update(tx, W) for tx in txs]
  rng = np.random.default_rng(12)
  for _ in range(3):
    grads = {k: {n: rng.standard_normal((W,) + p.shape).astype(np.float32) for n, p in v.items()}
             for k, v in params.items()}
    (a, states[0]), (b, states[1]) = [jax.block_until_ready(f(grads, s))
                                      for f, s in zip(updates, states)]
    chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(states[1].hook_states) > 1  # one DGCState per bucket, each with its own count
    assert all(int(s.count[0]) == int(states[0].count[0]) for s in states[1].hook_states)
    whole, bucketed = momenta(states[0]), momenta(states[1])
    assert set(whole) == set(bucketed) and len(whole) == 6
    chex.assert_trees_all_close(whole, bucketed, rtol=1e-6, atol=1e-6)
  bad = jax.tree.map(np.copy, grads)
  bad["l1"]["kernel"][1, 2, 3] = np.inf
  out, kept = jax.block_until_ready(updates[1](bad, states[1]))
  chex.assert_trees_all_equal(kept, states[1])
  assert all(np.isnan(x).all() for x in jax.tree.leaves(out))


def test_clip_norm_is_refused_bucket_by_bucket():
  for make in (lambda: jaxcomp.dgc(0.01, clip_norm=1.0, bucket_cap_mb=1.0),
               lambda: jaxcomp.coarse_dgc(0.01, clip_norm=1.0, bucket_cap_mb=1.0),
               lambda: hooks.dgc_state(0.01, clip_norm=1.0)):
    with pytest.raises(ValueError, match=r"local clipping \(clip_norm\) needs the whole "
                       r"gradient's norm, which a bucket does not see"):
      make()
