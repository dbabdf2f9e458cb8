"""allreduce / fp16_compress / bf16_compress under pmap, shard_map, a 2-D mesh and without an
axis."""

import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from helpers import assert_identical_across_devices, dyadic, per_device_grads, pmap_update

pytestmark = pytest.mark.numeric
W = 8
PARAMS = {"dense": {"kernel": jnp.zeros((5, 3)), "bias": jnp.zeros(3)}, "scale": jnp.zeros(()),
          "steps": jnp.zeros((2,), jnp.int32), "mask": jnp.zeros((4,), bool)}


def torch_order_mean(stacked, wire_dtype):
  """The reference: cast each device's gradient, divide by W in the wire dtype, sum in order."""
  parts = [(x.astype(wire_dtype) / wire_dtype(W)).astype(wire_dtype) for x in stacked]
  total = parts[0]
  for p in parts[1:]:
    total = (total + p).astype(wire_dtype)
  return total.astype(stacked.dtype)


def test_allreduce_is_exact_mean_and_identical_under_pmap():
  grads = per_device_grads(np.random.default_rng(0), PARAMS, W)
  out, _ = pmap_update(jaxcomp.allreduce(), grads)
  assert_identical_across_devices(out)
  for key in ("scale",):
    np.testing.assert_array_equal(out[key][0], grads[key].mean(0))
  np.testing.assert_array_equal(out["dense"]["kernel"][0], grads["dense"]["kernel"].mean(0))
  np.testing.assert_array_equal(out["dense"]["bias"][0], grads["dense"]["bias"].mean(0))
  chex.assert_trees_all_equal(out["steps"], grads["steps"])  # integers pass through untouched
  chex.assert_trees_all_equal(out["mask"], grads["mask"])


@pytest.mark.parametrize("make, wire", [
    (jaxcomp.fp16_compress, np.float16),
    (jaxcomp.bf16_compress, ml_dtypes.bfloat16),
])
def test_cast_compress_matches_torch_order_to_wire_rounding(make, wire):
  rng = np.random.default_rng(1)
  grads = per_device_grads(rng, PARAMS, W, make=lambda r, s: r.normal(size=s).astype(np.float32))
  out, _ = pmap_update(make(), grads)
  assert_identical_across_devices(out)
  kernel = grads["dense"]["kernel"]
  assert out["dense"]["kernel"].dtype == np.float32
  reference = torch_order_mean(kernel, wire)
  eps = float(ml_dtypes.finfo(wire).eps)
  # The sum order on the wire may differ from the reference's: W roundings of the wire dtype at
  # most.
  np.testing.assert_allclose(out["dense"]["kernel"][0], reference, rtol=0, atol=W * eps * 2)
  exact = kernel.mean(0)
  # It really went through the wire dtype.
  assert np.abs(out["dense"]["kernel"][0] - exact).max() > 0


def test_fp16_divides_before_summing_so_large_gradients_do_not_overflow():
  grads = {"g": np.full((W, 4), 30000.0, np.float32)}  # 8 * 30000 overflows float16 (max 65504)
  out, _ = pmap_update(jaxcomp.fp16_compress(), grads)
  np.testing.assert_allclose(out["g"][0], 30000.0, rtol=1e-3)


def test_fp16_keeps_dtype_of_bf16_and_fp16_params():
  params = {"a": jnp.zeros((3, 4), jnp.bfloat16), "b": jnp.zeros(4, jnp.float16)}
  grads = per_device_grads(np.random.default_rng(2), params, W)
  out, _ = pmap_update(jaxcomp.fp16_compress(), grads)
  assert out["a"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(out["b"][0], np.float32),
                                np.asarray(grads["b"], np.float32).mean(0))


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_with_and_without_vma_checking(check_vma):
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  grads = per_device_grads(np.random.default_rng(3), params, W)
  tx = jaxcomp.allreduce()
  state = tx.init(params)

  def step(g):
    g = jax.tree.map(lambda x: x[0], g)
    out, _ = tx.update(g, state)
    return out

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("batch"), out_specs=P(),
                            check_vma=check_vma))
  out = f(grads)
  chex.assert_trees_all_equal(out, jax.tree.map(lambda g: g.mean(0), grads))


def test_one_axis_of_a_2d_mesh_and_a_tuple_of_axes():
  mesh = jax.make_mesh((2, 4), ("model", "data"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(4)
  tx = jaxcomp.allreduce(axis_name="data")
  state = tx.init({"w": jnp.zeros((6, 3))})

  # Compress over `data` only; the kernel's rows stay sharded over `model` by the partitioner.
  grads = jax.device_put({"w": dyadic(rng, (4, 6, 3))},
                         jax.sharding.NamedSharding(mesh, P("data", "model")))
  data_only = jax.jit(jax.shard_map(
      lambda g: tx.update({"w": g["w"][0]}, state)[0], mesh=mesh, in_specs=P("data"),
      out_specs=P(), axis_names={"data"}, check_vma=False))
  np.testing.assert_array_equal(data_only(grads)["w"], np.asarray(grads["w"]).mean(0))

  both_tx = jaxcomp.allreduce(axis_name=("model", "data"))
  grads = {"w": dyadic(rng, (2, 4, 6, 3))}
  both = jax.jit(jax.shard_map(
      lambda g: both_tx.update({"w": g["w"][0, 0]}, state)[0], mesh=mesh,
      in_specs=P("model", "data"), out_specs=P(), check_vma=False))
  np.testing.assert_array_equal(both(grads)["w"], grads["w"].mean((0, 1)))


def test_unbound_axis_runs_as_world_size_one_and_warns_on_every_new_trace():
  tx = jaxcomp.fp16_compress(axis_name="nowhere")
  g = {"w": jnp.linspace(-1, 1, 7)}
  state = tx.init(g)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, _ = jax.jit(tx.update)(g, state)  # one warning, however many helpers the trace calls
    jax.jit(tx.update)(g, state)  # the cached trace: no new warning
    jax.jit(lambda g, s: tx.update(g, s))(g, state)  # a new trace warns again
  assert sum("not bound" in str(w.message) for w in caught) == 2
  out2, _ = tx.update(g, state)
  # Jitted or not, one correctly rounded cast (and ÷1): exact in any program.
  np.testing.assert_array_equal(out["w"], g["w"].astype(jnp.float16).astype(jnp.float32))
  np.testing.assert_array_equal(out2["w"], out["w"])


def test_axis_none_is_silent_world_size_one():
  tx = jaxcomp.allreduce(axis_name=None)
  g = {"w": jnp.arange(4.0)}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out, _ = tx.update(g, tx.init(g))
  chex.assert_trees_all_equal(out, g)


@pytest.mark.parametrize("bad", [3, ["batch"], (), ("a", 1)])
def test_bad_axis_name_is_named(bad):
  with pytest.raises(TypeError, match="axis_name"):
    jaxcomp.allreduce(axis_name=bad)


def test_changed_structure_shape_or_dtype_is_named():
  tx = jaxcomp.allreduce(axis_name=None)
  state = tx.init({"a": jnp.zeros(3), "b": jnp.zeros(2)})
  with pytest.raises(ValueError, match="structure changed"):
    tx.update({"a": jnp.zeros(3)}, state)
  with pytest.raises(ValueError, match=r"\['b'\].*float32\[2\].*float32\[4\]"):
    tx.update({"a": jnp.zeros(3), "b": jnp.zeros(4)}, state)
  with pytest.raises(ValueError, match=r"\['a'\].*float16"):
    tx.update({"a": jnp.zeros(3, jnp.float16), "b": jnp.zeros(2)}, state)


def test_chains_with_optax_and_applies_the_mean():
  params = {"w": jnp.ones((3, 2))}
  grads = per_device_grads(np.random.default_rng(5), params, W)
  tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.5))
  state = jax.tree.map(lambda x: np.stack([x] * W), tx.init(params))
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="batch")
  updates, _ = step(grads, state)
  np.testing.assert_array_equal(updates["w"][3], -0.5 * grads["w"].mean(0))
