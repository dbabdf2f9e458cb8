"""DDP's bucket layout, GradBucket and comm_hook (the hooks themselves: ``test_hooks.py``)."""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import axis, hooks
from jaxcomp import TreeSignature
from jaxcomp._src.buckets import bucket_assignment
from helpers import dyadic, per_device_grads, pmap_update

pytestmark = pytest.mark.numeric
W = 8
GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "ddp_buckets.json").read_text())
MIB = 1024 * 1024


def linear_stack(case):
  """The golden model's parameters as a pytree in torch's parameters() order (weight, bias per
  layer)."""
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


def counting_hook(state, bucket):
  """A stateful user hook: counts its steps and keeps a running sum of its bucket."""
  return axis.mean(bucket.buffer, bucket.axis_name), {
      "steps": state["steps"] + 1, "sum": state["sum"] + bucket.buffer}


def test_per_bucket_state_from_a_factory_and_non_finite_gating():
  tx = jaxcomp.comm_hook(counting_hook,
                         lambda b: {"steps": jnp.zeros((), jnp.int32),
                                    "sum": jnp.zeros_like(b.buffer)},
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
