"""Strict axes: inside a mapped context (pmap, vmap with an axis name, shard_map) that does not bind
a transformation's axis, every compressor raises ``UnboundAxisError`` naming the missing axis and the
bound ones — averaging over nothing there would let the replicas drift. (World size 1 where no axis
is bound at all, with a warning on every new trace: tests/test_dense.py, tests/test_bad_input.py.)"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from compressors import COMPRESSORS, optimizer
from helpers import replicate

W = 4
MESSAGE = r"axis_name 'batch' is not bound here; the bound axes are 'data'.*axis_name='data'"


def setup(name):
  """The entry's whole optimizer on the default axis, "batch"; gradients, and its state and
  parameters replicated (the parameters: local SGD and DiLoCo need them)."""
  tx = optimizer(name, optax.sgd(0.1))
  rng = np.random.default_rng(0)
  grads = {"w": rng.normal(size=(W, 6, 5)).astype(np.float32),
           "b": rng.normal(size=(W, 5)).astype(np.float32)}
  params = jax.tree.map(lambda g: g[0], grads)
  return tx, grads, replicate((tx.init(params), params), W)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_pmap_over_another_axis_raises_naming_both(name):
  tx, grads, state = setup(name)
  step = jax.pmap(lambda g, s: tx.update(g, *s), axis_name="data", devices=jax.devices()[:W])
  with pytest.raises(jaxcomp.UnboundAxisError, match=MESSAGE):
    step(grads, state)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_vmap_with_an_axis_name_raises_naming_both(name):
  tx, grads, state = setup(name)
  with pytest.raises(jaxcomp.UnboundAxisError, match=MESSAGE):
    jax.vmap(lambda g, s: tx.update(g, *s), axis_name="data")(grads, state)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_shard_map_over_another_axis_raises_naming_both(name):
  tx, grads, state = setup(name)
  mesh = jax.make_mesh((W,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
  def step(g, s):
    local = lambda tree: jax.tree.map(lambda x: x[0], tree)
    return tx.update(local(g), *local(s))[0]

  with pytest.raises(jaxcomp.UnboundAxisError, match=MESSAGE):
    jax.jit(step)(grads, state)
