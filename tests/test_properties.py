"""Property-based tests over random pytrees of shapes and dtypes, for every compressor."""

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from compressors import (ALGORITHMS, COMPRESSORS, ERROR_FEEDBACK, MEAN_COMPRESSORS, WIRE_DTYPE,
                         WRAPPERS, synced)
from helpers import assert_identical_across_devices, replicate

W = 8
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "int32": np.int32, "bool": np.bool_}
FLOATS = ("float32", "float16", "bfloat16")

shapes = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)
leaf_specs = st.tuples(shapes, st.sampled_from(list(DTYPES)))
tree_specs = st.dictionaries(st.sampled_from("abcdefgh"), leaf_specs, min_size=1, max_size=5)
# derandomize: the same examples on every run, so CI cannot fail on a draw nobody has seen.
common = settings(max_examples=4, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def make_grads(spec, seed, scale):
  rng = np.random.default_rng(seed)
  grads = {}
  for name, (shape, dtype) in spec.items():
    if dtype == "bool":
      grads[name] = rng.integers(0, 2, size=(W,) + shape).astype(bool)
    elif dtype == "int32":
      grads[name] = rng.integers(-5, 5, size=(W,) + shape).astype(np.int32)
    else:
      grads[name] = (rng.standard_normal((W,) + shape) * scale).astype(DTYPES[dtype])
  return grads


def run_steps(tx, grads, steps, sets_params=False):
  """``steps`` pmapped updates on the same per-device gradients; returns every (output, old state,
  new state). The parameters start as device 0's gradients on every device. A wrapper of the
  optimizer (``sets_params``: local SGD, DiLoCo) moves them, and its output is the new
  parameters."""
  params = replicate(jax.tree.map(lambda g: g[0], grads))
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads)))

  def update(grads, state, params):
    out, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, out) if sets_params else out), state

  step = jax.pmap(update, axis_name="batch")
  history = []
  for _ in range(steps):
    out, new_state = jax.block_until_ready(step(grads, state, params))
    history.append((out, state, new_state))
    state = new_state
    if sets_params:
      params = out
  return history


def is_float_dtype(dtype):
  return dtype in (np.float32, np.float16, ml_dtypes.bfloat16)


DGC = ("dgc", "dgc_exact_fp16", "coarse_dgc")
# The entries whose run is also checked against a reference within rounding (rerun under AVX in CI).
AGAINST_A_REFERENCE = set(MEAN_COMPRESSORS) | set(ERROR_FEEDBACK) | set(DGC)
STEPS = 5  # PowerSGD compresses from step 3, 1-bit Adam from step 2: both phases are covered


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.numeric)
                                  if name in AGAINST_A_REFERENCE else name
                                  for name in ALGORITHMS])
@common
@given(spec=tree_specs, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 100.0]))
# Dtypes interleaved (batched PowerSGD once returned its outputs out of order), and float16 and
# bfloat16 matrices large enough for every compressor to compress them.
@example(spec={"a": ((), "float32"), "b": ((2,), "float16"), "c": ((3, 3), "float32"),
               "d": ((12, 6), "bfloat16"), "e": ((6, 8), "float16")}, seed=0, scale=1.0)
def test_every_property_that_applies(name, spec, seed, scale):
  """One run of ``STEPS`` steps per drawn pytree (one compiled program), checked for every property
  of the entry:

  1. every entry: the output is identical on every device at every step; a wrapper of the optimizer
     (local SGD, DiLoCo) gives every device the same parameters right after each synchronization,
     and its devices' parameters differ in between (each moved by its own gradient); dtypes and
     shapes are kept, floats stay finite, integers and booleans pass through untouched;
  2. a mean compressor: the first output is the mean, within the wire dtype's rounding;
  3. torch-style error feedback: output + new error = gradient + old error, per device, at the last
     step (compressing);
  4. DGC: from a fresh state (u = g, v = g), what is sent plus the velocity kept is the mean
     gradient, on average over the devices.
  """
  grads = make_grads(spec, seed, scale)
  history = run_steps(COMPRESSORS[name](), grads, STEPS, sets_params=name in WRAPPERS)
  check_identical_finite_and_dtype_preserving(name, grads, history)
  if name in MEAN_COMPRESSORS:
    check_mean(name, grads, history[0][0])
  if name in ERROR_FEEDBACK:
    check_error_feedback(name, grads, *history[-1])
  if name in DGC:
    check_dgc_velocity(name, grads, history[0][0], history[0][2])


def check_identical_finite_and_dtype_preserving(name, grads, history):
  wrapper = name in WRAPPERS
  for step, (out, old_state, _) in enumerate(history):
    if synced(name, old_state, step):
      assert_identical_across_devices(out)
    else:
      moving = [k for k, g in grads.items() if is_float_dtype(g.dtype) and g[0].size
                and np.abs(np.diff(g.astype(np.float64), axis=0)).max() > 0]
      if moving:
        assert max(float(np.abs(np.diff(np.asarray(out[k], np.float64), axis=0)).max())
                   for k in moving) > 0, "a local step moved every device alike"
    for key, g in grads.items():
      o = np.asarray(out[key])
      assert o.dtype == g.dtype and o.shape == g.shape
      if is_float_dtype(g.dtype):
        assert np.isfinite(o.astype(np.float32)).all()
      else:  # integers and booleans pass through untouched (a wrapper leaves such parameters alone)
        np.testing.assert_array_equal(o, np.broadcast_to(g[:1], g.shape) if wrapper else g)


def check_mean(name, grads, out):
  for key, g in grads.items():
    if not is_float_dtype(g.dtype):
      continue
    wire = WIRE_DTYPE.get(name)
    eps = max(float(ml_dtypes.finfo(DTYPES[wire] if wire else g.dtype).eps),
              float(ml_dtypes.finfo(g.dtype).eps))
    bound = 4 * W * eps * (np.abs(g.astype(np.float64)).max() + 1e-30)
    np.testing.assert_allclose(np.asarray(out[key][0], np.float64), g.astype(np.float64).mean(0),
                               rtol=0, atol=bound)


@pytest.mark.numeric  # against a reference, within rounding
@common
@given(spec=tree_specs, seed=st.integers(0, 2**31 - 1))
def test_allreduce_equals_the_mean_of_dyadic_values_exactly(spec, seed):
  grads = {k: (np.round(g.astype(np.float32) * 8) / 8).astype(g.dtype)
           if is_float_dtype(g.dtype) else g for k, g in make_grads(spec, seed, 1.0).items()}
  ((out, _, _),) = run_steps(COMPRESSORS["allreduce"](), grads, 1)
  for key, g in grads.items():
    if is_float_dtype(g.dtype):
      expected = g.astype(np.float64).mean(0).astype(g.dtype)
      np.testing.assert_array_equal(np.asarray(out[key][0]), expected)


def per_dtype_flat(tree, keys_by_dtype):
  """The batched PowerSGD layout: per dtype (first appearance order), the leaves' flat
  concatenation."""
  return [np.concatenate([np.asarray(tree[k], np.float64).reshape(W, -1) for k in keys], axis=1)
          for keys in keys_by_dtype]


def check_error_feedback(name, grads, out, old, new):
  float_keys = [k for k in sorted(grads) if is_float_dtype(grads[k].dtype) and grads[k][0].size]
  if not float_keys:
    return
  if name == "batched_powersgd_r1":
    dtypes = list(dict.fromkeys(grads[k].dtype for k in float_keys))
    keys_by_dtype = [[k for k in float_keys if grads[k].dtype == d] for d in dtypes]
    pairs = []
    for o, g, e_old, e_new in zip(per_dtype_flat(out, keys_by_dtype),
                                  per_dtype_flat(grads, keys_by_dtype), old.error, new.error):
      length = o.shape[1]
      e_old = np.asarray(e_old, np.float64).reshape(W, -1)[:, :length]  # each (side, side)
      e_new = np.asarray(e_new, np.float64).reshape(W, -1)[:, :length]
      pairs.append((o + e_new, g + e_old, e_old))
  else:
    dtypes = [grads[k].dtype for k in float_keys]
    # PowerSGD keeps its errors per group of same-shape leaves: by_leaf gives them per leaf.
    old_error, new_error = (s.by_leaf("error") if hasattr(s, "by_leaf") else s.error
                            for s in (old, new))
    pairs = [(np.asarray(out[k], np.float64) + np.asarray(new_error[k], np.float64),
              grads[k].astype(np.float64) + np.asarray(old_error[k], np.float64),
              np.asarray(old_error[k], np.float64)) for k in float_keys]
  assert any(np.abs(e).max() > 0 for _, _, e in pairs), "error feedback never engaged"
  # One pair per dtype for batched PowerSGD, per leaf otherwise: each with its own dtype's eps.
  for (left, right, _), dtype in zip(pairs, dtypes):
    eps = float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(left, right, rtol=0, atol=8 * eps * (np.abs(right).max() + 1))


def check_dgc_velocity(name, grads, out, new):
  for key, g in grads.items():
    if not is_float_dtype(g.dtype):
      continue
    kept = new.v[key]
    kept = 0.0 if isinstance(kept, optax.MaskedNode) else np.asarray(kept, np.float64).mean(0)
    eps = float(ml_dtypes.finfo(np.float16 if "fp16" in name else g.dtype).eps)
    np.testing.assert_allclose(np.asarray(out[key][0], np.float64) + kept,
                               g.astype(np.float64).mean(0), rtol=0,
                               atol=4 * eps * (np.abs(g.astype(np.float64)).max() + 1e-30))
