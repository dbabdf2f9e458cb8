"""Layer-wise and batched PowerSGD (jaxcomp.powersgd, jaxcomp.batched_powersgd) against the NumPy
reference of powersgd_reference.py, written in torch's step order, on simulated devices: the
state, every step's output, error and Q, the orthogonalization, ``shard_map`` against ``pmap``,
and ``compress=``. Parity with torch's own hook is in test_powersgd_torch.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from helpers import (assert_identical_across_devices, pmap_update, pmapped, pmapped_update,
                     replicate, rounding_tol)
from jaxcomp._src.powersgd import orthogonalize
from powersgd_reference import (W, device, grads_for, named, np_batched_step, np_orthogonalize,
                                np_step, params_mixed)

pytestmark = pytest.mark.numeric


def test_state_has_q_only_for_leaves_worth_compressing_drawn_from_the_seed():
  state = jaxcomp.powersgd(rank=2).init(params_mixed())
  q, error = named(state.by_leaf("q")), named(state.by_leaf("error"))
  # conv kernel (3,3,2,8) is (18, 8) in the flax view, dense (20, 12): compressed at rank 2. Head
  # (12, 5) is not worth it ((12 + 5)·2·2 ≥ 60), nor are vectors.
  assert {k: v.shape for k, v in q.items()} == {
      "['conv']['kernel']": (8, 2), "['dense']['kernel']": (12, 2)}
  assert isinstance(state.by_leaf("q")["conv"]["bias"], optax.MaskedNode)
  # An int leaf: no error, it passes through.
  assert isinstance(state.by_leaf("error")["steps"], optax.MaskedNode)
  assert error["['scale']"].shape == () and not error["['scale']"].any()
  torch_view = jaxcomp.powersgd(rank=1, matrix_view="torch").init(params_mixed())
  # torch's (3, 48) view of the same array:
  assert torch_view.by_leaf("q")["conv"]["kernel"].shape == (48, 1)
  no_ef = jaxcomp.powersgd(error_feedback=False).init(params_mixed())
  assert not jax.tree.leaves(no_ef.error)
  # Q comes from the seed: the same for the same seed, different for another.
  chex.assert_trees_all_equal(jaxcomp.powersgd(rank=2).init(params_mixed()).q, state.q)
  other_seed = jaxcomp.powersgd(rank=2, seed=1).init(params_mixed())
  assert not np.array_equal(other_seed.by_leaf("q")["dense"]["kernel"],
                            q["['dense']['kernel']"])


@pytest.mark.parametrize("rank, warm_start", [(1, True), (2, False), (3, True)])
def test_layerwise_matches_numpy_reference_across_the_start_iteration(rank, warm_start):
  """Mixed leaves on 4 devices across the start iteration; rank 3 takes the QR path."""
  params = params_mixed()
  tx = jaxcomp.powersgd(rank, start_iter=2, warm_start=warm_start, epsilon=1e-8)
  state = replicate(tx.init(params), W)
  step = pmapped_update(tx, W)
  rng = np.random.default_rng(rank)
  float_keys = [k for k, v in named(params).items() if v.dtype == np.float32]
  errors = [{k: 0.0 for k in float_keys} for _ in range(W)]
  # float32 against the float64 reference: per step, roundings along the n + m ≤ 32 sums of P and
  # Q and the W devices, carried by the error feedback through 5 steps; unit-scale gradients.
  tol = rounding_tol(5 * (20 + 12 + W))
  for t in range(5):
    grads = grads_for(params, rng)
    qs = {k: v[0] for k, v in named(state.by_leaf("q")).items()}  # the Q this step starts from
    out, state = jax.block_until_ready(step(grads, state))
    assert_identical_across_devices(out)
    assert_identical_across_devices((state.q, state.count))
    per_device = [{k: v for k, v in named(device(grads, d)).items() if k in float_keys}
                  for d in range(W)]
    if t < 2:  # plain mean, error untouched
      expected = {k: np.mean([g[k] for g in per_device], axis=0) for k in float_keys}
    else:
      expected, errors, new_q = np_step(per_device, errors, qs, rank=rank, eps=1e-8)
      for k, q in named(state.by_leaf("q")).items():
        if warm_start:
          np.testing.assert_allclose(q[0], new_q[k], **tol, err_msg=k)
        else:  # a fresh draw each step
          assert not np.allclose(q[0], qs[k])
    got = named(out)
    for k in float_keys:
      np.testing.assert_allclose(got[k][0], expected[k], **tol, err_msg=(t, k))
    np.testing.assert_array_equal(got["['steps']"], np.asarray(grads["steps"]))  # passed through
    for d in range(W):
      for k, e in named(device(state.by_leaf("error"), d)).items():
        np.testing.assert_allclose(e, errors[d][k], **tol, err_msg=(t, d, k))
  assert int(state.count[0]) == 5


def test_no_error_feedback_and_uncompressed_error_is_local_minus_mean():
  params = {"w": np.zeros((16, 16), np.float32), "b": np.zeros(16, np.float32)}
  rng = np.random.default_rng(0)
  grads = grads_for(params, rng)
  tx = jaxcomp.powersgd(1, start_iter=0)
  out, state = pmap_update(tx, grads, W, state=replicate(tx.init(params), W))
  scale = max(np.abs(g).max() for g in grads.values())
  # Against NumPy: the mean's W roundings, and one each for error = m - out and error + out.
  tol = rounding_tol(W + 2, scale=scale)
  np.testing.assert_allclose(state.by_leaf("error")["b"], grads["b"] - grads["b"].mean(0), **tol)
  np.testing.assert_allclose(state.by_leaf("error")["w"] + out["w"], grads["w"], **tol)
  tx = jaxcomp.powersgd(1, start_iter=0, error_feedback=False)
  out2, state2 = pmap_update(tx, grads, W, state=replicate(tx.init(params), W))
  # First step, no error to add yet; another program: the 16 + 16 sums of P and Q and W devices.
  chex.assert_trees_all_close(out2, out, **rounding_tol(16 + 16 + W, scale=scale))
  assert not jax.tree.leaves(state2.error)


def test_rank_is_clamped_and_full_rank_gives_the_mean():
  params = {"w": np.zeros((4, 6), np.float32), "s": np.zeros((), np.float32),
            "v": np.zeros(5, np.float32)}
  tx = jaxcomp.powersgd(50, start_iter=0, min_compression_rate=0.0)  # compress everything
  state = tx.init(params)
  q = state.by_leaf("q")
  assert q["w"].shape == (6, 4) and q["s"].shape == (1, 1)
  assert q["v"].shape == (5, 1)  # a vector is (1, 5) in the flax view
  grads = grads_for(params, np.random.default_rng(1))
  out, _ = pmap_update(tx, grads, W, state=replicate(state, W))
  # r = n: P̂ is a full orthonormal basis, so P̂·Qᵀ is the mean (QR path, r = 4): to rounding along
  # the 4 + 6 sums of P and Q and the W devices.
  tol = rounding_tol(4 + 6 + W)
  np.testing.assert_allclose(out["w"][0], grads["w"].mean(0), **tol)
  np.testing.assert_allclose(out["s"][0], grads["s"].mean(0), **tol)


def test_orthogonalize_matches_torch_and_stays_finite_and_orthonormal_where_torch_fails():
  rng = np.random.default_rng(0)
  for shape in [(7, 1), (7, 2), (7, 4)]:
    x = rng.standard_normal(shape).astype(np.float32)
    # float32 against float64: roundings along the 7-long norms and projections of each column.
    np.testing.assert_allclose(orthogonalize(jnp.asarray(x)), np_orthogonalize(x),
                               **rounding_tol(7 * shape[1]))
  zero = orthogonalize(jnp.zeros((5, 2)))
  np.testing.assert_array_equal(zero, 0)  # torch gives NaN here
  # Rank-deficient: still orthonormal.
  for dtype, tol in [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)]:
    for _ in range(20):
      p = rng.standard_normal((20, 1)) @ rng.standard_normal((1, 2))
      p_hat = np.asarray(orthogonalize(jnp.asarray(p, dtype)), np.float32)
      np.testing.assert_allclose(p_hat.T @ p_hat, np.eye(2), atol=tol)
  half = orthogonalize(jnp.asarray(rng.standard_normal((6, 3)) * 300, jnp.float16))
  assert half.dtype == jnp.float16 and jnp.isfinite(half).all()  # 300² overflows float16 norms
  np.testing.assert_allclose(np.asarray(half, np.float32).T @ np.asarray(half, np.float32),
                             np.eye(3), atol=1e-2)


def test_shard_map_with_state_partition_specs_matches_pmap(batch_mesh):
  """check_vma=True: the error is varying (sharded), count and Q invariant (replicated)."""
  params = {"w": np.zeros((12, 10), np.float32), "b": np.zeros(10, np.float32)}
  tx = jaxcomp.powersgd(2, start_iter=1)
  specs = jaxcomp.state_partition_specs(tx, params)
  # Groups in leaf order: b (dense), w.
  assert specs.error == (P("batch"), P("batch")) and specs.q == (optax.MaskedNode(), P())
  state = jax.jit(jax.shard_map(tx.init, mesh=batch_mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=batch_mesh, in_specs=(P("batch"), specs),
                     out_specs=(P(), specs), check_vma=True)
  def step(grads, state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), state)

  ref_step, ref_state = pmapped_update(tx, W), replicate(tx.init(params), W)
  rng = np.random.default_rng(0)
  tol = rounding_tol(3 * (12 + 10 + W))  # two programs: the sums of P, Q and W devices, 3 steps
  for _ in range(3):
    grads = grads_for(params, rng)
    out, state = jax.block_until_ready(step(grads, state))
    ref_out, ref_state = jax.block_until_ready(ref_step(grads, ref_state))
    chex.assert_trees_all_close(out, device(ref_out, 0), **tol)
  np.testing.assert_allclose(state.error[1], np.concatenate(list(ref_state.error[1])), **tol)
  chex.assert_trees_all_close(state.q, device(ref_state.q, 0), **tol)


def test_compress_predicate_averages_the_other_leaves_densely():
  """compress= replaces optax.masked: the rejected kernel is averaged (error: local minus mean)."""
  params = {"conv": {"kernel": np.zeros((3, 3, 4, 16), np.float32)},
            "dense": {"kernel": np.zeros((64, 32), np.float32), "bias": np.zeros(32, np.float32)}}
  only_conv = jaxcomp.powersgd(1, start_iter=0, compress=lambda path, leaf: "conv" in path)
  everything = jaxcomp.powersgd(1, start_iter=0)
  state = only_conv.init(params)
  assert isinstance(state.by_leaf("q")["dense"]["kernel"], optax.MaskedNode)
  assert state.by_leaf("q")["conv"]["kernel"].shape == (16, 1)
  grads = grads_for(params, np.random.default_rng(3))
  out, new_state = pmap_update(only_conv, grads, W, state=replicate(state, W))
  ref_out, _ = pmap_update(everything, grads, W, state=replicate(everything.init(params), W))
  mean = grads["dense"]["kernel"].mean(0)
  np.testing.assert_allclose(out["dense"]["kernel"][0], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_state.by_leaf("error")["dense"]["kernel"],
                             grads["dense"]["kernel"] - mean,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["conv"]["kernel"], ref_out["conv"]["kernel"], rtol=1e-5,
                             atol=1e-6)
  assert_identical_across_devices(out)
  report = jaxcomp.comm_report(pmapped_update(only_conv, W), grads, replicate(state, W))
  assert report.payload_bytes == 4 * (64 * 32 + 32) + 4 * (36 + 16)
  with pytest.raises(TypeError, match=r"compress must be callable as compress\(path, leaf\)"):
    jaxcomp.powersgd(compress="kernel")


# ------------------------------------------------------------------------------- batched PowerSGD

@pytest.mark.parametrize("rank, warm_start", [(1, True), (3, False)])
def test_batched_matches_numpy_reference(rank, warm_start):
  params = {"a": np.zeros((7, 5), np.float32), "b": np.zeros(9, np.float32),
            "c": np.zeros((), np.float32), "i": np.zeros(2, np.int32)}
  tx = jaxcomp.batched_powersgd(rank, start_iter=1, warm_start=warm_start)
  state = replicate(tx.init(params), W)
  # L = 45, side 7: one square, a group of one.
  assert state.error[0].shape == (W, 1, 7, 7) and state.q[0].shape == (W, 1, 7, rank)
  step = pmapped_update(tx, W)
  rng = np.random.default_rng(0)
  errors = [0.0] * W
  tol = rounding_tol(4 * (7 + 7 + W))  # float32 against float64: as the layer-wise reference test
  for t in range(4):
    grads = grads_for(params, rng)
    q = np.asarray(state.q[0][0, 0])
    out, state = jax.block_until_ready(step(grads, state))
    flat = [np.concatenate([np.ravel(grads[k][d]) for k in "abc"]) for d in range(W)]
    if t == 0:
      expected = np.mean(flat, axis=0)
    else:
      expected, errors, new_q = np_batched_step(flat, errors, q, rank=rank)
      if warm_start:
        np.testing.assert_allclose(state.q[0][0, 0], new_q, **tol)
      for d in range(W):
        np.testing.assert_allclose(np.ravel(state.error[0][d]), errors[d], **tol)
    got = np.concatenate([np.ravel(out[k][0]) for k in "abc"])
    np.testing.assert_allclose(got, expected, **tol, err_msg=t)
    np.testing.assert_array_equal(out["i"], grads["i"])
  assert state.compression_stats()[1:] == (3 * 45, 3 * 2 * 7 * rank)


def test_batched_one_square_per_dtype():
  params = {"a": np.zeros((6, 6), np.float32), "h": np.zeros((5, 5), jnp.bfloat16)}
  state = jaxcomp.batched_powersgd(2).init(params)
  assert [e.shape for e in state.error] == [(1, 6, 6), (1, 5, 5)]
  assert [q.dtype for q in state.q] == [np.float32, jnp.bfloat16]


def test_batched_update_writes_the_error_in_place():
  """The square of the leaves is the update's only scratch of its size: M = g + e is never written
  (the products and the error take g and e as two terms), the new error is written over the old,
  and the output's P̂·Qᵀ reuses the square's memory (before: 2.0× the gradient)."""
  tx = jaxcomp.batched_powersgd(1, start_iter=0)
  # 12 leaves (XLA:CPU fuses a concatenation of at most 8), most starting and ending mid-row.
  one = {f"w{i}": jax.ShapeDtypeStruct((40 + i, 96 + 3 * i), jnp.float32) for i in range(12)}
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype),
                       jax.eval_shape(tx.init, one))
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype), one)
  step = pmapped(tx.update, 8, donate_argnums=(0, 1))
  grad_bytes = sum(4 * np.prod(x.shape) for x in jax.tree.leaves(one))
  temp = step.lower(grads, state).compile().memory_analysis().temp_size_in_bytes
  assert temp < 1.1 * grad_bytes
