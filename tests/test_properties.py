"""Property-based tests over random pytrees of shapes and dtypes, for every compressor."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from compressors import COMPRESSORS, WIRE_DTYPE
from helpers import assert_identical_across_devices, pmap_update

W = 8
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "int32": np.int32, "bool": np.bool_}

shapes = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)
leaf_specs = st.tuples(shapes, st.sampled_from(list(DTYPES)))
tree_specs = st.dictionaries(st.sampled_from("abcdefgh"), leaf_specs, min_size=1, max_size=5)


def make_grads(spec, seed, scale):
  rng = np.random.default_rng(seed)
  grads = {}
  for name, (shape, dtype) in spec.items():
    if dtype == "bool":
      value = rng.integers(0, 2, size=(W,) + shape).astype(bool)
    elif dtype == "int32":
      value = rng.integers(-5, 5, size=(W,) + shape).astype(np.int32)
    else:
      value = (rng.standard_normal((W,) + shape) * scale).astype(DTYPES[dtype])
    grads[name] = value
  return grads


common = settings(max_examples=12, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@common
@given(spec=tree_specs, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 100.0]))
def test_identical_finite_dtype_preserving_and_close_to_the_mean(name, spec, seed, scale):
  grads = make_grads(spec, seed, scale)
  out, _ = pmap_update(COMPRESSORS[name](), grads)
  assert_identical_across_devices(out)
  for key, g in grads.items():
    o = np.asarray(out[key])
    assert o.dtype == g.dtype and o.shape == g.shape
    if not np.issubdtype(g.dtype, np.floating) and g.dtype != ml_dtypes.bfloat16:
      np.testing.assert_array_equal(o, g)  # integers and booleans pass through untouched
      continue
    assert np.isfinite(o.astype(np.float32)).all()
    mean = g.astype(np.float64).mean(0)
    wire = WIRE_DTYPE.get(name)
    eps = float(ml_dtypes.finfo(DTYPES[wire] if wire else g.dtype).eps)
    eps = max(eps, float(ml_dtypes.finfo(g.dtype).eps))
    bound = 4 * W * eps * (np.abs(g.astype(np.float64)).max() + 1e-30)
    np.testing.assert_allclose(o[0].astype(np.float64), mean, rtol=0, atol=bound)


@common
@given(spec=tree_specs, seed=st.integers(0, 2**31 - 1))
def test_allreduce_equals_the_mean_of_dyadic_values_exactly(spec, seed):
  grads = make_grads(spec, seed, 1.0)
  grads = {k: (np.round(g.astype(np.float32) * 8) / 8).astype(g.dtype)
           if np.issubdtype(g.dtype, np.floating) or g.dtype == ml_dtypes.bfloat16 else g
           for k, g in grads.items()}
  out, _ = pmap_update(COMPRESSORS["allreduce"](), grads)
  for key, g in grads.items():
    if np.issubdtype(g.dtype, np.floating) or g.dtype == ml_dtypes.bfloat16:
      expected = (g.astype(np.float64).mean(0)).astype(g.dtype)
      np.testing.assert_array_equal(np.asarray(out[key][0]), expected)
