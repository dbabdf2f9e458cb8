"""Restoring a per-device state onto another number of devices (``jaxcomp._src.restore``):
``fully_sharded``'s state saved at W = 8 and restored at W = 4 (and back) gives the same
parameters and Adam moments, exactly, and its error feedback starts afresh with a warning; the
restored run continues as the saved one; a state that orbax's ``strict=False`` padded or
truncated is refused by the step. ``data_parallel``'s ``sharded_optimizer`` shards and Dion's
per-device momenta are laid out (or started afresh) the same way."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomp
from helpers import rounding_tol

ocp = pytest.importorskip("orbax.checkpoint")


def mesh_1d(n):
  return jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def init_params():
  rng = np.random.default_rng(0)
  return {"dense0": {"w": rng.normal(0, 0.5, (5, 7)).astype(np.float32),
                     "b": np.zeros(7, np.float32)},
          "dense1": {"w": rng.normal(0, 0.5, (7, 3)).astype(np.float32),
                     "b": np.zeros(3, np.float32)},
          "scale": np.float32(1.5)}


def loss_fn(p, x, y):
  dense0, dense1 = jaxcomp.gather_layer(p["dense0"]), jaxcomp.gather_layer(p["dense1"])
  hidden = jnp.tanh(x @ dense0["w"] + dense0["b"])
  return jnp.mean(((hidden @ dense1["w"] + dense1["b"]) * jaxcomp.gather_layer(p["scale"])
                   - y) ** 2)


def batches(n):
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(16, 5)).astype(np.float32),
           rng.normal(size=(16, 3)).astype(np.float32)) for _ in range(n)]


def train(fs, state, data):
  for batch in data:
    state, loss = fs.step(state, *fs.shard(batch))
    float(loss.mean())  # read a value every step (XLA:CPU)
  return state


def save(path, state):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)


def whole(tree, shapes, world):
  """The whole leaves of per-device parts stacked for ``world`` (flat layout: a leaf of fewer
  values than ``world`` whole on every device, the others raveled and cut), by leaf."""
  return [np.asarray(x)[0] if np.prod(shape) < world
          else np.asarray(x).reshape(-1)[:np.prod(shape, dtype=int)].reshape(shape)
          for x, shape in zip(jax.tree.leaves(tree), shapes)]


@pytest.mark.parametrize("saved_on, restored_on", [(8, 4), (4, 8)])
def test_a_fully_sharded_state_restored_on_another_number_of_devices(tmp_path, saved_on,
                                                                     restored_on):
  """The parameters and Adam's moments exactly; the int8 exchange's error feedback afresh."""
  exchange, optimizer = jaxcomp.quantized(8), optax.adam(0.05)
  saving = jaxcomp.fully_sharded(loss_fn, mesh_1d(saved_on), exchange, optimizer)
  state = train(saving, saving.make_state(init_params()), batches(2))
  save(tmp_path / "ckpt", state)
  restoring = jaxcomp.fully_sharded(loss_fn, mesh_1d(restored_on), exchange, optimizer)
  with pytest.warns(UserWarning, match=r"restore: state.exchange\[0\].*starts afresh"):
    restored = restoring.restore(tmp_path / "ckpt", init_params())
  chex.assert_trees_all_equal(restoring.gather_params(restored), saving.gather_params(state))
  shapes = state.signature.shapes
  for moment in ("mu", "nu"):
    got = whole(getattr(restored.inner[0], moment), shapes, restored_on)
    want = whole(getattr(state.inner[0], moment), shapes, saved_on)
    chex.assert_trees_all_equal(got, want)
  np.testing.assert_array_equal(np.asarray(restored.inner[0].count), [2] * restored_on)
  np.testing.assert_array_equal(np.asarray(restored.exchange[0].count), [0] * restored_on)
  train(restoring, restored, batches(1))  # it runs on


@pytest.mark.numeric
def test_the_restored_run_continues_as_the_saved_one(tmp_path):
  """With the exact exchange (no state of its own): 2 steps at W = 8, saved, 2 more at W = 4
  from the restored state or at W = 8 from the saved one: the same parameters, to rounding.
  Restored on the mesh it was saved from, the state is the saved one."""
  exchange, optimizer = jaxcomp.allreduce(), optax.adam(0.05)
  wide = jaxcomp.fully_sharded(loss_fn, mesh_1d(8), exchange, optimizer)
  state = train(wide, wide.make_state(init_params()), batches(2))
  save(tmp_path / "ckpt", state)
  chex.assert_trees_all_equal(wide.restore(tmp_path / "ckpt", init_params()), state)  # as saved
  narrow = jaxcomp.fully_sharded(loss_fn, mesh_1d(4), exchange, optimizer)
  restored = narrow.restore(tmp_path / "ckpt", init_params())
  chex.assert_trees_all_close(narrow.gather_params(train(narrow, restored, batches(4)[2:])),
                              wide.gather_params(train(wide, state, batches(4)[2:])),
                              **rounding_tol(2 * 16))


def test_a_state_padded_or_truncated_by_strict_false_is_refused_before_the_step(tmp_path):
  saving = jaxcomp.fully_sharded(loss_fn, mesh_1d(8), jaxcomp.allreduce(), optax.adam(0.05))
  save(tmp_path / "ckpt", saving.make_state(init_params()))
  restoring = jaxcomp.fully_sharded(loss_fn, mesh_1d(4), jaxcomp.allreduce(), optax.adam(0.05))
  fresh = restoring.make_state(init_params())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        fresh)
  with ocp.StandardCheckpointer() as checkpointer:  # (orbax refuses the shapes without it)
    scrambled = checkpointer.restore(tmp_path / "ckpt", target, strict=False)
  with pytest.raises(ValueError, match=r"state: laid out for 8 devices \(flat\) along 'batch', "
                     r"and this step runs on 4.*fs.restore\(directory, params\)"):
    restoring.step(scrambled, *restoring.shard(batches(1)[0]))
  chex.assert_trees_all_equal(restoring.gather_params(restoring.restore(tmp_path / "ckpt",
                                                                        init_params())),
                              restoring.gather_params(fresh))


def plain_loss(p, x, y):
  return loss_fn(p, x, y)  # gather_layer passes unsharded parameters through


@pytest.mark.parametrize("gather_dtype", [None, "int8"], ids=["exact", "int8-master"])
def test_a_sharded_optimizer_state_restored_on_another_number_of_devices(tmp_path, gather_dtype):
  """``data_parallel``'s ZeRO-1/2 state: Adam's moments (and the float32 master of a lossy
  gather) laid out for W = 4 exactly; the int8 exchange's error feedback afresh, named."""
  tx = jaxcomp.sharded_optimizer(jaxcomp.quantized(8), optax.adam(0.05),
                                 gather_dtype=gather_dtype)
  wide = jaxcomp.data_parallel(plain_loss, mesh_1d(8), tx=tx)
  params, opt_state = init_params(), wide.make_state(init_params())
  for batch in batches(2):
    params, opt_state, loss = wide.step(params, opt_state, *wide.shard(batch))
    float(loss.mean())
  save(tmp_path / "ckpt", opt_state)
  params = jax.tree.map(np.asarray, params)  # the parameters, saved apart (to the host here)
  narrow = jaxcomp.data_parallel(plain_loss, mesh_1d(4), tx=tx)
  with pytest.warns(UserWarning, match=r"restore: state.exchange.worker_error.*starts afresh"):
    restored = narrow.restore(tmp_path / "ckpt", params)
  shapes = opt_state.signature.shapes
  sharded = lambda tree, world: [  # noqa: E731  (every leaf is cut, the 0-d one too)
      np.asarray(x).reshape(-1)[:np.prod(shape, dtype=int)].reshape(shape)
      for x, shape in zip(jax.tree.leaves(tree), shapes)]
  pairs = [(restored.inner[0].mu, opt_state.inner[0].mu),
           (restored.inner[0].nu, opt_state.inner[0].nu)]
  if gather_dtype:  # the float32 master of each device's shard
    pairs.append((restored.master, opt_state.master))
  for got, want in pairs:
    chex.assert_trees_all_equal(sharded(got, 4), sharded(want, 8))
  params, restored, loss = narrow.step(params, restored, *narrow.shard(batches(1)[0]))
  assert np.isfinite(float(loss.mean()))


def test_dion_momenta_start_afresh_and_the_rest_is_restored(tmp_path):
  """Dion's state: its momenta are each device's own (error feedback): started afresh, named;
  its Q and count, the same on every device, restored as saved."""
  tx = jaxcomp.dion(0.02)
  wide = jaxcomp.data_parallel(plain_loss, mesh_1d(8), tx=tx)
  params, opt_state = init_params(), wide.make_state(init_params())
  for batch in batches(2):
    params, opt_state, loss = wide.step(params, opt_state, *wide.shard(batch))
    float(loss.mean())
  save(tmp_path / "ckpt", opt_state)
  params = jax.tree.map(np.asarray, params)  # the parameters, saved apart (to the host here)
  narrow = jaxcomp.data_parallel(plain_loss, mesh_1d(4), tx=tx)
  with pytest.warns(UserWarning, match=r"restore: state.momentum.*starts afresh"):
    restored = narrow.restore(tmp_path / "ckpt", params)
  fresh = narrow.make_state(params)
  chex.assert_trees_all_equal(restored.momentum, fresh.momentum)
  kept = lambda s: [x for x, m in zip(jax.tree.leaves(s),  # noqa: E731
                                      jax.tree.leaves(jaxcomp.per_device_mask(s))) if not m]
  chex.assert_trees_all_equal(kept(restored), kept(opt_state))
  params, restored, loss = narrow.step(params, restored, *narrow.shard(batches(1)[0]))
  assert np.isfinite(float(loss.mean()))
