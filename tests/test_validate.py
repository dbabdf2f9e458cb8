"""Every compressor answers bad input with a correct result or a clear error naming the argument."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import hooks
from compressors import ALGORITHMS, COMPRESSORS, WRAPPERS
from helpers import replicate, rounding_tol

W = 8


def pmap_steps(name, grads, steps=4):
  """``steps`` pmapped updates: a compressor's output, or a wrapper's (local SGD, DiLoCo) new
  parameters, which start as device 0's gradients on every device (``start``). Every wrapper at
  test scale synchronizes after step 3."""
  tx = COMPRESSORS[name]()
  start = jax.tree.map(lambda g: g[:1], grads)
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads)))
  params = replicate(jax.tree.map(lambda g: g[0], grads))
  step = jax.pmap(tx.update, axis_name="batch")
  for _ in range(steps):
    out, state = jax.block_until_ready(step(grads, state, params))
    if name in WRAPPERS:
      out = params = optax.apply_updates(params, out)
  return out, state, start


@pytest.mark.parametrize("name", ALGORITHMS)
def test_empty_pytrees_update_to_outputs_of_the_same_structure(name):
  tx = COMPRESSORS[name](axis_name=None)
  for empty in ({}, [], {"a": {}}):
    out, _ = tx.update(empty, tx.init(empty), empty)
    assert jax.tree.structure(out) == jax.tree.structure(empty)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_integer_boolean_zero_d_zero_size_and_all_zero_leaves(name):
  """Integers and booleans pass through, a zero-size leaf keeps its shape, and all-zero float
  gradients (a 0-d one among them) give zeros, never NaN, for five steps (a compressor's output is
  zero; a wrapper's parameters do not move); the state holds no NaN and no zero-size leaf (orbax
  refuses those). Random float gradients among integer leaves, and float16 and bfloat16 matrices:
  test_properties.py."""
  grads = {"scalar": np.zeros((W,), np.float32), "count": np.arange(W, dtype=np.int32),
           "flag": np.ones((W, 3), bool), "empty": np.zeros((W, 0, 4), np.float32),
           "w": np.zeros((W, 16, 8), np.float32), "b": np.zeros((W, 8), np.float32)}
  out, state, start = pmap_steps(name, grads, steps=5)
  passed = start if name in WRAPPERS else grads  # a wrapper leaves such parameters as they were
  np.testing.assert_array_equal(out["count"], np.broadcast_to(passed["count"], (W,)))
  np.testing.assert_array_equal(out["flag"], np.broadcast_to(passed["flag"], (W, 3)))
  assert out["empty"].shape == (W, 0, 4)
  for key in ("scalar", "w", "b"):
    np.testing.assert_array_equal(np.asarray(out[key]), np.broadcast_to(start[key], out[key].shape)
                                  if name in WRAPPERS else 0, err_msg=key)
  inexact = [np.asarray(x) for x in jax.tree.leaves(state)
             if jnp.issubdtype(np.asarray(x).dtype, jnp.inexact)]
  assert all(np.isfinite(x.astype(np.float64)).all() for x in inexact)
  assert not any(np.asarray(x).size == 0 for x in jax.tree.leaves(state))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_changed_structure_shape_or_dtype_is_named(name):
  tx = COMPRESSORS[name](axis_name=None)
  state = tx.init({"a": jnp.zeros((4, 3)), "b": jnp.zeros(3)})
  with pytest.raises(ValueError, match="structure changed"):
    tx.update({"a": jnp.zeros((4, 3))}, state)
  with pytest.raises(ValueError, match=r"\['a'\]"):
    tx.update({"a": jnp.zeros((4, 4)), "b": jnp.zeros(3)}, state)
  with pytest.raises(ValueError, match=r"\['b'\]"):
    tx.update({"a": jnp.zeros((4, 3)), "b": jnp.zeros(3, jnp.float16)}, state)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_unbound_axis_runs_as_one_device_and_warns_once(name):
  tx = COMPRESSORS[name](axis_name="unbound")
  g = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(6, 5)), jnp.float32)}
  state = tx.init(g)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(4):
      out, state = jax.jit(tx.update)(g, state, g)
  assert sum("not bound" in str(w.message) for w in caught) == 1
  if name in WRAPPERS:
    out = optax.apply_updates(g, out)
  assert np.isfinite(np.asarray(out["w"])).all()


BAD_ARGUMENTS = [
    (lambda: jaxcomp.powersgd(0), "rank"),
    (lambda: jaxcomp.powersgd(-2), "rank"),
    (lambda: jaxcomp.powersgd(1.5), "rank"),
    (lambda: jaxcomp.powersgd(1, start_iter=-1), "start_iter"),
    (lambda: jaxcomp.powersgd(1, min_compression_rate=-1.0), "min_compression_rate"),
    (lambda: jaxcomp.powersgd(1, epsilon=float("nan")), "epsilon"),
    (lambda: jaxcomp.powersgd(1, matrix_view="numpy"), "matrix_view"),
    (lambda: jaxcomp.powersgd(1, error_feedback="yes"), "error_feedback"),
    (lambda: jaxcomp.batched_powersgd(0), "rank"),
    (lambda: jaxcomp.batched_powersgd(1, start_iter=-5), "start_iter"),
    (lambda: jaxcomp.dgc(0.0), "ratio"),
    (lambda: jaxcomp.dgc(1.5), "ratio"),
    (lambda: jaxcomp.dgc(-0.1), "ratio"),
    (lambda: jaxcomp.dgc(0.01, momentum=-0.9), "momentum"),
    (lambda: jaxcomp.dgc(0.01, momentum=1.0), "momentum"),
    (lambda: jaxcomp.dgc(0.01, clip_norm=0), "clip_norm"),
    (lambda: jaxcomp.dgc(0.01, sample_ratio=0), "sample_ratio"),
    (lambda: jaxcomp.dgc(0.01, selection="random"), "selection"),
    (lambda: jaxcomp.dgc(0.01, warmup="paper"), "steps_per_epoch"),
    (lambda: jaxcomp.dgc(0.01, warmup=[(10, 0.1), (5, 0.01)]), "warmup"),
    (lambda: jaxcomp.dgc(0.01, value_dtype=jnp.int8), "value_dtype"),
    (lambda: jaxcomp.coarse_dgc(2.0), "ratio"),
    (lambda: jaxcomp.coarse_dgc(0.1, chunk_size=0), "chunk_size"),
    (lambda: jaxcomp.coarse_dgc(0.1, momentum=-1), "momentum"),
    (lambda: jaxcomp.comm_hook(hooks.allreduce_hook, bucket_cap_mb=0), "bucket_cap_mb"),
    (lambda: jaxcomp.comm_hook(hooks.allreduce_hook, bucket_cap_mb=-3), "bucket_cap_mb"),
    (lambda: hooks.powersgd_state(0), "rank"),
    (lambda: hooks.dgc_state(0.0), "ratio"),
    (lambda: jaxcomp.accumulate(jaxcomp.allreduce(), every_k=0), "every_k"),
    (lambda: jaxcomp.local_sgd(optax.sgd(0.1), sync_every=0), "sync_every"),
    (lambda: jaxcomp.local_sgd(optax.sgd(0.1), sync_every=2.5), "sync_every"),
    (lambda: jaxcomp.local_sgd(optax.sgd(0.1), sync_every=4, start_iter=-1), "start_iter"),
    (lambda: jaxcomp.local_sgd("sgd", sync_every=4), "inner"),
    (lambda: jaxcomp.local_sgd(optax.sgd(0.1), sync_every=4, axis_name=["batch"]), "axis_name"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=0), "sync_every"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=jnp.int32(20)), "sync_every"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=20, outer_learning_rate=0.0),
     "outer_learning_rate"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=20, outer_momentum=1.0), "outer_momentum"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=20, outer_momentum=-0.1), "outer_momentum"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=20, nesterov="yes"), "nesterov"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=20, compressor=jaxcomp.powersgd),
     "compressor"),
    (lambda: jaxcomp.diloco(None, sync_every=20), "inner"),
    (lambda: jaxcomp.allreduce(axis_name=0), "axis_name"),
    (lambda: jaxcomp.powersgd(1, axis_name=["batch"]), "axis_name"),
    (lambda: jaxcomp.dgc(0.01, axis_name=("batch", 2)), "axis_name"),
    (lambda: jaxcomp.quantized(3), "bits"),
    (lambda: jaxcomp.quantized("int8"), "bits"),
    (lambda: jaxcomp.quantized(True), "bits"),
    (lambda: jaxcomp.quantized(8, block_size=0), "block_size"),
    (lambda: jaxcomp.quantized(8, block_size=16.0), "block_size"),
    (lambda: jaxcomp.quantized(8, stochastic_rounding="yes"), "stochastic_rounding"),
    (lambda: jaxcomp.quantized(8, seed=-1), "seed"),
    (lambda: hooks.quantized_state(bits=16), "bits"),
    (lambda: jaxcomp.sign_compress(error_feedback=1), "error_feedback"),
    (lambda: hooks.sign_state(error_feedback=None), "error_feedback"),
    (lambda: jaxcomp.onebit_adam(1e-3, freeze_steps=-1), "freeze_steps"),
    (lambda: jaxcomp.onebit_adam(1e-3, freeze_steps=2.5), "freeze_steps"),
    (lambda: jaxcomp.onebit_adam(0.0, freeze_steps=10), "learning_rate"),
    (lambda: jaxcomp.onebit_adam("fast", freeze_steps=10), "learning_rate"),
    (lambda: jaxcomp.onebit_adam(1e-3, freeze_steps=10, b1=1.0), "b1"),
    (lambda: jaxcomp.onebit_adam(1e-3, freeze_steps=10, b2=-0.1), "b2"),
    (lambda: jaxcomp.onebit_adam(1e-3, freeze_steps=10, eps=-1e-8), "eps"),
    (lambda: jaxcomp.onebit_adam(1e-3, freeze_steps=10, axis_name=1), "axis_name"),
    (lambda: hooks.onebit_adam_state(freeze_steps=-3), "freeze_steps"),
]


@pytest.mark.parametrize("make, argument", BAD_ARGUMENTS)
def test_nonsensical_arguments_fail_at_construction_naming_the_argument(make, argument):
  with pytest.raises((ValueError, TypeError), match=argument):
    make()


@pytest.mark.numeric
@pytest.mark.parametrize("rank", [5, 100])
def test_rank_above_min_n_m_is_clamped_to_the_exact_mean(rank):
  rng = np.random.default_rng(3)
  grads = {"w": rng.normal(size=(W, 4, 3)).astype(np.float32)}
  tx = jaxcomp.powersgd(rank, start_iter=0, min_compression_rate=0.0, error_feedback=False)
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads)))
  out, _ = jax.pmap(tx.update, axis_name="batch")(grads, state)
  # Full rank (QR): the mean, to rounding along the 4 + 3 sums of P and Q and the W devices.
  np.testing.assert_allclose(out["w"][0], grads["w"].mean(0), **rounding_tol(4 + 3 + W))
