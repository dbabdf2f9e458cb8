"""PowerSGD on DDP's buckets: ``bucket_cap_mb``'s per-bucket collectives give the same step, and
the hooks (``powersgd_hook``, ``batched_powersgd_hook``, under ``fp16_compress_wrapper``) equal
the transformations."""


import chex
import jax
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import pmapped_update, replicate, rounding_tol
from jaxcomp._src.buckets import bucket_assignment
from powersgd_reference import W, grads_for, params_mixed, per_leaf

pytestmark = pytest.mark.numeric


@pytest.mark.parametrize("alternating", [False, True])
def test_bucketed_collectives_give_the_same_step(alternating):
  """bucket_cap_mb: one set of collectives per DDP bucket, the same numbers as one set for all."""
  params = {f"l{i}": {"kernel": np.zeros((24, 16), np.float32), "bias": np.zeros(16, np.float32)}
            for i in range(3)}
  kwargs = dict(start_iter=1, alternating=alternating)
  whole, bucketed = jaxcomp.powersgd(2, **kwargs), jaxcomp.powersgd(2, bucket_cap_mb=1e-3, **kwargs)
  states = [replicate(tx.init(params), W) for tx in (whole, bucketed)]
  steps = [pmapped_update(tx, W) for tx in (whole, bucketed)]
  reports = [jaxcomp.comm_report(f, grads_for(params, np.random.default_rng(0)), s)
             for f, s in zip(steps, states)]
  # Four buckets (DDP's rule cuts [l2.kernel], [l2.bias, l1.kernel], ...): the same bytes, in
  # more collectives. tests/test_overlap.py checks what each of them depends on.
  assert len(reports[1].collectives) > 2 * len(reports[0].collectives)
  # And comm_hook's 4-byte flag: a NaN in one bucket keeps every bucket's state.
  assert reports[1].payload_bytes == reports[0].payload_bytes + 4
  # Each leaf draws its factors from its path: the same whole and in its bucket.
  assert len(states[1].hook_states) == 4
  chex.assert_trees_all_equal(per_leaf(states[1]), per_leaf(states[0]))
  rng = np.random.default_rng(4)
  tol = rounding_tol(4 * (24 + 16 + W))  # two programs: the sums of P, Q and W devices, 4 steps
  for _ in range(4):
    grads = grads_for(params, rng)
    (a, states[0]), (b, states[1]) = [jax.block_until_ready(f(grads, s))
                                      for f, s in zip(steps, states)]
    chex.assert_trees_all_close(b, a, **tol)
    chex.assert_trees_all_close(per_leaf(states[1]), per_leaf(states[0]), **tol)
  assert ([int(s.count[0]) for s in states[1].hook_states] == [int(states[0].count[0])] * 4
          == [4] * 4)


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005])
def test_powersgd_hook_equals_the_transformation(bucket_cap_mb):
  """The hook on DDP's buckets: the same factors at init (drawn from each leaf's path), the same
  outputs and per-leaf state at every step, torch's statistics."""
  params = params_mixed()
  kwargs = dict(start_iter=1, epsilon=1e-8)
  tx = jaxcomp.powersgd(2, **kwargs)
  hook_tx = jaxcomp.comm_hook(jaxcomp.hooks.powersgd_hook,
                              jaxcomp.hooks.powersgd_state(2, **kwargs),
                              bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb)
  state, hook_state = tx.init(params), hook_tx.init(params)
  assert (len(hook_state.hook_states) > 1) == (bucket_cap_mb < 1)
  chex.assert_trees_all_equal(per_leaf(hook_state), per_leaf(state))
  state, hook_state = replicate(state, W), replicate(hook_state, W)
  step, hook_step = pmapped_update(tx, W), pmapped_update(hook_tx, W)
  rng = np.random.default_rng(0)
  # Two programs (buckets, or leaf by leaf): the sums of P, Q and W devices, 3 steps.
  tol = rounding_tol(3 * (20 + 12 + W))
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = jax.block_until_ready(step(grads, state))
    hook_out, hook_state = jax.block_until_ready(hook_step(grads, hook_state))
    chex.assert_trees_all_close(hook_out, out, **tol)
    chex.assert_trees_all_close(per_leaf(hook_state), per_leaf(state), **tol)
  assert jaxcomp.powersgd_stats(hook_state) == state.compression_stats()


def test_fp16_wrapped_powersgd_hook_runs_in_float16_as_torch():
  """fp16_compress_wrapper(powersgd_hook) = PowerSGD on the float16 gradient; float16 state
  values."""
  params = {"w": np.zeros((16, 12), np.float32), "b": np.zeros(12, np.float32)}
  hook_tx = jaxcomp.comm_hook(jaxcomp.fp16_compress_wrapper(jaxcomp.hooks.powersgd_hook),
                              jaxcomp.hooks.powersgd_state(1, start_iter=1))
  half = jax.tree.map(lambda x: x.astype(np.float16), params)
  tx = jaxcomp.powersgd(1, start_iter=1)
  hook_state = hook_tx.init(params)
  (bucket,) = hook_state.hook_states
  leaves = lambda s, field: s.signature.pick(s.by_leaf(field))  # noqa: E731  (the bucket's order)
  w = [isinstance(q, optax.MaskedNode) for q in leaves(bucket, "q")].index(False)  # w's place
  state = tx.init(half)
  state = state.with_leaves("q", {"w": leaves(bucket, "q")[w].astype(np.float16),
                                  "b": optax.MaskedNode()})
  state, hook_state = replicate(state, W), replicate(hook_state, W)
  step, hook_step = pmapped_update(tx, W), pmapped_update(hook_tx, W)
  rng = np.random.default_rng(0)
  # Two programs computing in float16: a few float16 roundings of values up to ~4.
  tol = rounding_tol(4, scale=4, dtype=np.float16)
  for _ in range(4):
    grads = grads_for(params, rng)
    hook_out, hook_state = jax.block_until_ready(hook_step(grads, hook_state))
    out, state = jax.block_until_ready(
        step(jax.tree.map(lambda x: x.astype(np.float16), grads), state))
    chex.assert_trees_all_close(hook_out, jax.tree.map(lambda x: x.astype(np.float32), out), **tol)
  (bucket,) = hook_state.hook_states
  error, q = leaves(bucket, "error")[w], leaves(bucket, "q")[w]
  assert error.dtype == np.float32  # kept in the bucket's dtype, holding float16 values
  assert np.array_equal(error.astype(np.float16).astype(np.float32), error)
  np.testing.assert_allclose(error, state.by_leaf("error")["w"].astype(np.float32), **tol)
  np.testing.assert_allclose(q, state.by_leaf("q")["w"].astype(np.float32), **tol)


def test_batched_hook_equals_the_transformation():
  params = {"a": np.zeros((9, 7), np.float32), "b": np.zeros(7, np.float32)}
  hook_tx = jaxcomp.comm_hook(jaxcomp.hooks.batched_powersgd_hook,
                              jaxcomp.hooks.batched_powersgd_state(1, start_iter=1))
  hook_state = hook_tx.init(params)
  assert bucket_assignment(hook_state.signature, 25 * 2**20, 25 * 2**20) == ((1, 0),)
  # The bucket holds b, then a (DDP's reverse order): give the transformation that order too.
  as_bucket = lambda tree: {"0": tree["b"], "1": tree["a"]}
  tx = jaxcomp.batched_powersgd(1, start_iter=1)
  state = tx.init(as_bucket(params))
  chex.assert_trees_all_equal(hook_state.hook_states[0].q, state.q)  # same seed, same square
  state, hook_state = replicate(state, W), replicate(hook_state, W)
  step, hook_step = pmapped_update(tx, W), pmapped_update(hook_tx, W)
  rng = np.random.default_rng(0)
  tol = rounding_tol(3 * (9 + 9 + W))  # two programs: the sums of P, Q (side 9) and W, 3 steps
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = jax.block_until_ready(step(as_bucket(grads), state))
    hook_out, hook_state = jax.block_until_ready(hook_step(grads, hook_state))
    chex.assert_trees_all_close(as_bucket(hook_out), out, **tol)
  chex.assert_trees_all_close(hook_state.hook_states[0].error, state.error, **tol)
  assert jaxcomp.powersgd_stats(hook_state) == state.compression_stats()
