"""DGC beyond pmap: world size one under a plain jit, ``shard_map`` with the state's partition
specs, ``data_parallel`` (replicas identical), and ``vmap`` with an axis name."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import hooks

from dgc_reference import device_grads, make_params
from helpers import assert_identical_across_devices, pmapped_update, replicate, rounding_tol
from training import pmap_step, run

pytestmark = pytest.mark.numeric
W = 4


def test_world_size_one_under_plain_jit():
  tx = optax.chain(jaxcomp.dgc(0.05, axis_name=None, selection="exact"), optax.sgd(0.1))
  params = make_params()
  state = tx.init(params)
  grads = {k: (np.full(p.shape, 0.5, np.float32) if p.dtype == np.float32 else p)
           for k, p in params.items()}
  grads["w1"][3, 4] = 9.0
  # The state donated, as in a training step: u and v must not share a buffer.
  out, _ = jax.jit(tx.update, donate_argnums=1)(grads, state)
  assert float(out["w1"][3, 4]) == pytest.approx(-0.9)
  assert np.count_nonzero(out["w1"]) == math.ceil(512 * 0.05)
  np.testing.assert_allclose(out["b1"], -0.05)


def test_shard_map_matches_pmap(batch_mesh):
  params = {"w": np.zeros((32, 16), np.float32), "b": np.zeros((16,), np.float32)}
  tx = jaxcomp.dgc(0.05)
  rng = np.random.default_rng(8)
  grads = {k: rng.standard_normal((W,) + p.shape).astype(np.float32) for k, p in params.items()}
  state = replicate(tx.init(params), W)
  expected, expected_state = jax.block_until_ready(pmapped_update(tx, W)(grads, state))
  specs = jaxcomp.state_partition_specs(tx, params)
  flat_state = tx.init(params)
  flat_state = flat_state._replace(
      u=jax.tree.map(lambda x: np.concatenate(list(state.u["w"])), flat_state.u),
      v=jax.tree.map(lambda x: np.concatenate(list(state.v["w"])), flat_state.v))
  step = jax.jit(jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
                               mesh=batch_mesh, in_specs=(P("batch"), specs),
                               out_specs=(P(), specs), check_vma=False))
  out, new_state = jax.block_until_ready(step(grads, flat_state))
  tol = rounding_tol(W + 3)  # two programs, one step: the momentum, v and the sum over W round
  chex.assert_trees_all_close(out, jax.tree.map(lambda x: x[0], expected), **tol)
  np.testing.assert_allclose(new_state.v["w"], np.concatenate(list(expected_state.v["w"])), **tol)


def regression_loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


# Two warm-up steps at density 0.25 (for dgc a dense stage: W·0.25·2 >= 1), then sparse ones.
DATA_PARALLEL_CASES = {
    "dgc": lambda: jaxcomp.dgc(0.05, warmup=((2, 0.25),)),
    "dgc_exact": lambda: jaxcomp.dgc(0.05, selection="exact", warmup=((2, 0.25),)),
    "coarse_dgc": lambda: jaxcomp.coarse_dgc(0.125, chunk_size=8, warmup=((2, 0.25),)),
    "dgc_hook": lambda: jaxcomp.comm_hook(hooks.dgc_hook,
                                          hooks.dgc_state(0.05, warmup=((2, 0.25),)),
                                          bucket_cap_mb=1e-4),
}


@pytest.mark.parametrize("name", list(DATA_PARALLEL_CASES))
def test_data_parallel_keeps_replicas_identical_and_matches_pmap(name, batch_mesh):
  """The mean of every DGC variant is typed invariant under shard_map(check_vma=True), so
  data_parallel accepts the parameters it updates as replicated; they equal pmap's."""
  make = lambda: optax.chain(optax.add_decayed_weights(1e-4), DATA_PARALLEL_CASES[name](),
                             optax.sgd(0.1))
  params = {"w": np.zeros((16, 8), np.float32), "b": np.zeros((8,), np.float32)}
  rng = np.random.default_rng(13)
  xs = rng.standard_normal((3, W, 2, 16)).astype(np.float32)
  ys = rng.standard_normal((3, W, 2, 8)).astype(np.float32)
  dp = jaxcomp.data_parallel(regression_loss, batch_mesh, tx=make())
  p, s = dp.make_params(params), dp.make_state(params)
  for x, y in zip(xs, ys):
    p, s, _ = jax.block_until_ready(dp.step(p, s, *dp.shard((x.reshape(2 * W, 16),
                                                              y.reshape(2 * W, 8)))))
  for leaf in jax.tree.leaves(p):
    assert_identical_across_devices(
        np.stack([np.asarray(x.data) for x in leaf.addressable_shards]))

  tx = make()
  step = pmap_step(regression_loss, tx, W, returns=None)
  ref, _, _ = run(step, replicate(params, W), replicate(tx.init(params), W), len(xs),
                  n_devices=W, batch=lambda t, n: (xs[t], ys[t]))
  # Two programs: per step the 16-term products, the 2-sample mean, momentum, v, the sum over W.
  chex.assert_trees_all_close(p, jax.tree.map(lambda a: a[0], ref),
                              **rounding_tol(3 * (16 + 2 + 3 + W)))


@pytest.mark.slow  # 20 s on the loaded 2-core machine (compiling DGC under vmap and pmap)
def test_vmap_with_an_axis_name_matches_pmap():
  tx = jaxcomp.dgc(0.05)
  params = make_params()
  grads = device_grads(np.random.default_rng(14), params, W)
  state = replicate(tx.init(params), W)
  out, new_state = jax.block_until_ready(jax.vmap(tx.update, axis_name="batch")(grads, state))
  expected, expected_state = jax.block_until_ready(pmapped_update(tx, W)(grads, state))
  assert_identical_across_devices(out)
  tol = rounding_tol(W + 3)  # two programs, one step: the momentum, v and the sum over W round
  chex.assert_trees_all_close((out, new_state.v), (expected, expected_state.v), **tol)
