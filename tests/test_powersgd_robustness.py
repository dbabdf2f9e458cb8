"""What torch's PowerSGD hook lacks: a non-finite gradient keeps the state, a zero gradient neither
gives NaN nor stalls, half-precision parameters, an unbound axis as world size one; and a
checkpoint resume, bit for bit."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxcomp
from helpers import pmapped_update, replicate, rounding_tol
from powersgd_reference import W, grads_for, params_mixed

pytestmark = pytest.mark.numeric


@pytest.mark.parametrize("make", [
    functools.partial(jaxcomp.powersgd, 2, start_iter=1),
    functools.partial(jaxcomp.batched_powersgd, 2, start_iter=1),
    functools.partial(jaxcomp.powersgd, 2, start_iter=1, alternating=True),
    functools.partial(jaxcomp.powersgd, 2, start_iter=1, bucket_cap_mb=1e-4),
], ids=["layerwise", "batched", "alternating", "bucketed"])
def test_non_finite_gradient_keeps_the_state(make):
  params = {"w": np.zeros((12, 10), np.float32), "b": np.zeros(10, np.float32)}
  tx = make()
  step = pmapped_update(tx, W)
  rng = np.random.default_rng(0)
  state = replicate(tx.init(params), W)
  for _ in range(2):
    _, state = jax.block_until_ready(step(grads_for(params, rng), state))
  bad = grads_for(params, rng)
  bad["w"][2, 3, 4] = np.nan
  out, kept = jax.block_until_ready(step(bad, state))
  assert np.isnan(out["w"]).all() and np.isnan(out["b"]).all()  # every output NaN ...
  chex.assert_trees_all_equal(kept, state)  # ... and the state is kept bit for bit, count included
  out, state = jax.block_until_ready(step(grads_for(params, rng), kept))
  assert np.isfinite(out["w"]).all() and np.isfinite(jax.tree.leaves(state)[1]).all()
  chex.assert_tree_all_finite(state)


@pytest.mark.parametrize("rank", [1, 3])
def test_zero_gradient_gives_zeros_and_does_not_stall(rank):
  params = {"w": np.zeros((12, 10), np.float32)}
  tx = jaxcomp.powersgd(rank, start_iter=0)
  step = pmapped_update(tx, W)
  state = replicate(tx.init(params), W)
  out, after_zero = jax.block_until_ready(step({"w": np.zeros((W, 12, 10), np.float32)},
                                                state))
  np.testing.assert_array_equal(out["w"], 0)
  chex.assert_trees_all_equal(after_zero.q, state.q)  # an all-zero Q would stall warm start
  grads = grads_for(params, np.random.default_rng(0))
  chex.assert_trees_all_close(jax.block_until_ready(step(grads, after_zero))[0],
                              jax.block_until_ready(step(grads, state))[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_params_keep_their_dtype_and_match_float32(dtype):
  params = {"w": np.zeros((24, 16), dtype), "b": np.zeros(16, dtype)}
  tx = jaxcomp.powersgd(4, start_iter=0)  # rank 4 in half precision: Gram–Schmidt, as torch
  ref = jaxcomp.powersgd(4, start_iter=0)
  state = replicate(tx.init(params), W)
  ref_state = jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == dtype else x, state)
  ref_state = ref_state._replace(signature=jaxcomp.TreeSignature.of(
      jax.tree.map(lambda x: x.astype(np.float32), params)))
  step, ref_step = pmapped_update(tx, W), pmapped_update(ref, W)
  rng = np.random.default_rng(0)
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = jax.block_until_ready(step(grads, state))
    ref_out, ref_state = jax.block_until_ready(
        ref_step(jax.tree.map(lambda x: x.astype(np.float32), grads), ref_state))
    assert out["w"].dtype == dtype and state.by_leaf("error")["w"].dtype == dtype
    assert state.by_leaf("q")["w"].dtype == dtype
    chex.assert_tree_all_finite(out)
    # Half precision against float32: a few roundings of the half dtype on values up to ~4.
    np.testing.assert_allclose(np.asarray(out["w"], np.float32), ref_out["w"],
                               **rounding_tol(4, scale=4, dtype=dtype))


def test_unbound_axis_is_world_size_one():
  params = {"w": np.zeros((10, 8), np.float32)}
  tx = jaxcomp.powersgd(8, start_iter=0, min_compression_rate=0.0, axis_name="nope")
  grads = {"w": np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)}
  with pytest.warns(UserWarning, match="not bound"):
    out, state = jax.jit(tx.update)(grads, tx.init(params))
  # Full rank on one device: exact up to rounding along the 10 + 8 sums of P and Q.
  tol = rounding_tol(10 + 8, scale=np.abs(grads["w"]).max())
  np.testing.assert_allclose(out["w"], grads["w"], **tol)
  np.testing.assert_allclose(state.by_leaf("error")["w"], 0, **tol)


@pytest.mark.parametrize("make", [
    functools.partial(jaxcomp.powersgd, 2, start_iter=1),
    functools.partial(jaxcomp.powersgd, 3, start_iter=1, warm_start=False),
    functools.partial(jaxcomp.batched_powersgd, 2, start_iter=1),
], ids=["layerwise", "fresh-q", "batched"])
def test_checkpoint_resume_is_bit_identical(make, tmp_path):
  params = params_mixed()
  tx = make()
  step = pmapped_update(tx, W)
  rng = np.random.default_rng(0)
  grads = [grads_for(params, rng) for _ in range(6)]
  state = replicate(tx.init(params), W)
  for g in grads[:3]:
    _, state = jax.block_until_ready(step(g, state))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  chex.assert_trees_all_equal(restored, state)
  assert restored.config == state.config and restored.signature == state.signature
  for g in grads[3:]:
    out, state = jax.block_until_ready(step(g, state))
    resumed_out, restored = jax.block_until_ready(step(g, restored))
    chex.assert_trees_all_equal(resumed_out, out)
  chex.assert_trees_all_equal(restored, state)
