"""DDP's bucket layout, GradBucket, comm_hook, the default hooks and the compress wrappers."""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import axis, hooks
from jaxcomp import TreeSignature
from jaxcomp._src.buckets import bucket_assignment
from helpers import (assert_identical_across_devices, dyadic, per_device_grads, pmap_update,
                     rounding_tol)

pytestmark = pytest.mark.numeric
W = 8
GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "ddp_buckets.json").read_text())
MIB = 1024 * 1024


def linear_stack(case):
  """The golden model's parameters as a pytree in torch's parameters() order (weight, bias per layer)."""
  params = GOLDEN[case]["params"]
  leaves = [jax.ShapeDtypeStruct(tuple(p["shape"]), jnp.dtype(p["dtype"])) for p in params]
  return [tuple(leaves[i:i + 2]) for i in range(0, len(leaves), 2)]


@pytest.mark.parametrize("case", ["default_cap", "cap_25", "cap_10", "cap_1_uneven"])
def test_bucket_layout_equals_torch_ddp(case):
  cap = GOLDEN[case]["bucket_cap_mb"]
  # DDP with bucket_cap_mb unset uses 25 MiB with a 1 MiB first bucket per dtype.
  cap, first = (25.0, 1.0) if cap is None else (cap, cap)
  assignment = bucket_assignment(TreeSignature.of(linear_stack(case)), cap * MIB, first * MIB)
  expected = [tuple(b["params"]) for b in GOLDEN[case]["buckets"]]
  assert list(assignment) == expected


def test_grad_bucket_views_paths_and_is_last_match_ddp():
  params = {"a": jnp.zeros((300, 500)), "b": jnp.zeros((500,)), "c": jnp.zeros((10, 2)),
            "n": jnp.zeros((3,), jnp.int32)}
  seen = []

  def recording_hook(state, bucket):
    seen.append(bucket)
    views = bucket.gradients()
    for view, path in zip(views, bucket.paths):
      name = path.strip("[]'")
      np.testing.assert_array_equal(view, grads[name])
    return bucket.buffer, state

  grads = {k: jnp.asarray(dyadic(np.random.default_rng(0), v.shape)).astype(v.dtype)
           for k, v in params.items()}
  tx = jaxcomp.comm_hook(recording_hook, bucket_cap_mb=0.001, axis_name=None)
  out, _ = tx.update(grads, tx.init(params))
  chex.assert_trees_all_equal(out, grads)
  assert [b.index for b in seen] == [0, 1]
  assert [b.paths for b in seen] == [("['c']", "['b']"), ("['a']",)]
  assert [b.is_last for b in seen] == [False, True]
  assert seen[0].buffer.shape == (20 + 500,)


def reference_mean(stacked):
  return stacked.mean(0)


PARAMS = {"conv": jnp.zeros((3, 3, 4, 8)), "bias": jnp.zeros(8), "head": jnp.zeros((8, 10)),
          "step": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("hook, exact", [
    (hooks.allreduce_hook, True),
    (hooks.fp16_compress_hook, False),
    (hooks.bf16_compress_hook, False),
])
def test_default_hooks_equal_the_dense_transformations(hook, exact):
  grads = per_device_grads(np.random.default_rng(1), PARAMS, W,
                           make=lambda r, s: r.normal(size=s).astype(np.float32))
  dense = {hooks.allreduce_hook: jaxcomp.allreduce, hooks.fp16_compress_hook: jaxcomp.fp16_compress,
           hooks.bf16_compress_hook: jaxcomp.bf16_compress}[hook]()
  out, _ = pmap_update(jaxcomp.comm_hook(hook, bucket_cap_mb=0.001), grads)
  expected, _ = pmap_update(dense, grads)
  assert_identical_across_devices(out)
  # Two programs (buckets, or leaf by leaf) for the same mean of W unit-scale terms: float32 rounding
  # of the W terms, or, through the wire dtype, a wire rounding or two of the unit-scale mean.
  wire = {hooks.fp16_compress_hook: np.float16, hooks.bf16_compress_hook: ml_dtypes.bfloat16}
  tol = rounding_tol(W) if exact else rounding_tol(2, dtype=wire[hook])
  chex.assert_trees_all_close(out, expected, **tol)
  if exact:  # against NumPy's float32 mean
    chex.assert_trees_all_close(out["conv"][0], grads["conv"].mean(0), **rounding_tol(W))
  np.testing.assert_array_equal(out["step"], grads["step"])


def test_noop_hook_returns_local_gradients():
  grads = per_device_grads(np.random.default_rng(2), PARAMS, W)
  out, _ = pmap_update(jaxcomp.comm_hook(hooks.noop_hook), grads)
  chex.assert_trees_all_equal(out, grads)


def int8_hook(state, bucket):
  """The README's worked user hook: int8 values with a shared per-bucket scale."""
  scale = jaxcomp.axis.pmax(jnp.abs(bucket.buffer).max(), bucket.axis_name) / 127
  q = jnp.round(bucket.buffer / jnp.maximum(scale, 1e-30)).astype(jnp.int32)
  total = jaxcomp.axis.psum(q, bucket.axis_name)
  n = jaxcomp.axis.axis_size(bucket.axis_name)
  return (total * scale / n).astype(bucket.buffer.dtype), state


def test_documented_user_hook_works_and_is_in_the_docs():
  assert "def int8_hook(state, bucket):" in hooks.__doc__
  grads = per_device_grads(np.random.default_rng(3), PARAMS, W,
                           make=lambda r, s: r.normal(size=s).astype(np.float32))
  out, _ = pmap_update(jaxcomp.comm_hook(int8_hook), grads)
  assert_identical_across_devices(out)
  scale = max(np.abs(g).max() for g in jax.tree.leaves(grads) if g.dtype == np.float32) / 127
  np.testing.assert_allclose(out["conv"][0], grads["conv"].mean(0), atol=scale)


@pytest.mark.parametrize("wrapper, wire", [(jaxcomp.fp16_compress_wrapper, np.float16),
                                           (jaxcomp.bf16_compress_wrapper, ml_dtypes.bfloat16)])
@pytest.mark.parametrize("inner", [hooks.allreduce_hook, int8_hook, hooks.noop_hook])
def test_wrappers_compose_with_any_hook(wrapper, wire, inner):
  grads = per_device_grads(np.random.default_rng(4), PARAMS, W,
                           make=lambda r, s: r.normal(size=s).astype(np.float32))
  seen_dtypes = []

  def spy(state, bucket):
    seen_dtypes.append(bucket.buffer.dtype)
    return inner(state, bucket)

  out, _ = pmap_update(jaxcomp.comm_hook(wrapper(spy)), grads)
  assert set(seen_dtypes) == {jnp.dtype(wire)}
  assert out["conv"].dtype == jnp.float32
  # The inner hook ran on the wire-dtype bucket: same as running it on pre-rounded gradients.
  rounded = jax.tree.map(lambda g: g.astype(wire).astype(g.dtype)
                         if g.dtype == np.float32 else g, grads)
  expected, _ = pmap_update(jaxcomp.comm_hook(wrapper(inner)), rounded)
  # The same program on inputs that the wrapper's cast maps to the same wire values: bitwise.
  chex.assert_trees_all_equal(out, expected)
  if inner is hooks.allreduce_hook:
    plain, _ = pmap_update(jaxcomp.comm_hook(
        {np.float16: hooks.fp16_compress_hook,
         ml_dtypes.bfloat16: hooks.bf16_compress_hook}[wire]), grads)
    # Another program (cast, then allreduce_hook's sum and ÷W; or cast, ÷W, sum): the same mean of
    # W wire-dtype terms, to a wire rounding or two of the unit-scale result.
    chex.assert_trees_all_close(out, plain, **rounding_tol(2, dtype=wire))


def counting_hook(state, bucket):
  """A stateful user hook: counts its steps and keeps a running sum of its bucket."""
  return axis.mean(bucket.buffer, bucket.axis_name), {
      "steps": state["steps"] + 1, "sum": state["sum"] + bucket.buffer}


def test_per_bucket_state_from_a_factory_and_non_finite_gating():
  tx = jaxcomp.comm_hook(counting_hook,
                         lambda b: {"steps": jnp.zeros((), jnp.int32), "sum": jnp.zeros_like(b.buffer)},
                         bucket_cap_mb=0.0005)
  rng = np.random.default_rng(5)
  grads = per_device_grads(rng, PARAMS, W)
  _, state = pmap_update(tx, grads)
  assert len(state.hook_states) > 1
  assert all(int(s["steps"][0]) == 1 for s in state.hook_states)
  bad = jax.tree.map(np.copy, grads)
  bad["head"][5, 2, 3] = np.nan  # one device, one coordinate
  out, after = pmap_update(tx, bad, state=state)
  assert np.isnan(out["head"][0, 2, 3])  # the non-finite mean still flows out
  chex.assert_trees_all_equal(after.hook_states, state.hook_states)


def test_hook_returning_a_wrong_buffer_is_named():
  tx = jaxcomp.comm_hook(lambda s, b: (b.buffer[:-1], s), axis_name=None)
  g = {"w": jnp.ones(4)}
  with pytest.raises(ValueError, match="bucket 0"):
    tx.update(g, tx.init(g))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1.0, ValueError), ("25", TypeError),
                                        (True, TypeError), (float("nan"), ValueError)])
def test_bad_bucket_cap_is_named(bad, error):
  with pytest.raises(error, match="bucket_cap_mb"):
    jaxcomp.comm_hook(hooks.allreduce_hook, bucket_cap_mb=bad)
  with pytest.raises(error, match="first_bucket_cap_mb"):
    jaxcomp.comm_hook(hooks.allreduce_hook, first_bucket_cap_mb=bad)


def test_bad_hook_and_axis_name_are_named():
  with pytest.raises(TypeError, match="hook"):
    jaxcomp.comm_hook("allreduce")
  with pytest.raises(TypeError, match="axis_name"):
    jaxcomp.comm_hook(hooks.allreduce_hook, axis_name=7)


def test_changed_pytree_is_named():
  tx = jaxcomp.comm_hook(hooks.allreduce_hook, axis_name=None)
  state = tx.init({"a": jnp.zeros(3)})
  with pytest.raises(ValueError, match="structure changed"):
    tx.update({"a": jnp.zeros(3), "b": jnp.zeros(1)}, state)


def test_trains_in_an_optax_chain_under_jit_and_scan():
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  tx = optax.chain(jaxcomp.comm_hook(hooks.fp16_compress_hook, axis_name=None), optax.sgd(0.1))

  def step(carry, _):
    p, s = carry
    g = jax.grad(lambda p: jnp.sum((p["w"] + p["b"]) ** 2))(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  (p, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=20))((params, tx.init(params)))
  assert float(jnp.abs(p["w"] + p["b"]).max()) < 0.1
