"""Shared test helpers: per-device gradients and running a transformation on simulated devices."""

import jax
import jax.numpy as jnp
import numpy as np


def dyadic(rng, shape, scale=64):
  """Random values k/scale with small integer k: sums and ÷8 are exact in float32 in any order."""
  return (rng.integers(-256, 256, size=shape) / scale).astype(np.float32)


def per_device_grads(rng, params, n_devices, make=dyadic):
  """A pytree like ``params`` whose float leaves get a leading device axis of distinct values."""
  def leaf(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return np.stack([make(rng, x.shape) for _ in range(n_devices)]).astype(x.dtype)
    return np.stack([np.asarray(x)] * n_devices)
  return jax.tree.map(leaf, params)


def pmap_update(tx, grads, n_devices=8, axis_name="batch", state=None):
  """Runs ``tx.update`` under pmap on per-device ``grads``; returns (outputs, new per-device states)."""
  params = jax.tree.map(lambda g: g[0], grads)
  if state is None:
    state = jax.tree.map(lambda x: np.stack([x] * n_devices), tx.init(params))
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=axis_name,
                  devices=jax.devices()[:n_devices])
  return jax.block_until_ready(step(grads, state))


def assert_identical_across_devices(tree):
  """Bitwise equality across the leading device axis of every reduced (floating-point) leaf."""
  for x in jax.tree.leaves(tree):
    x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      continue
    for d in range(1, x.shape[0]):
      np.testing.assert_array_equal(x[d:d + 1].view(np.uint8), x[:1].view(np.uint8))


def replicate(tree, n_devices=8):
  """Stacks ``tree`` n_devices times along a new leading axis (pmap's per-device layout)."""
  return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n_devices), tree)


def run_updates(tx, grads_per_step, n_devices=8, axis_name="batch"):
  """``tx.update`` under pmap, compiled once, on each per-device gradient pytree in turn.

  Returns:
    ``(outputs, states)``: one per step; the state starts from ``tx.init`` stacked over devices.
  """
  step = jax.pmap(tx.update, axis_name=axis_name, devices=jax.devices()[:n_devices])
  state = replicate(tx.init(jax.tree.map(lambda g: g[0], grads_per_step[0])), n_devices)
  outputs, states = [], []
  for grads in grads_per_step:
    out, state = jax.block_until_ready(step(grads, state))  # blocked: XLA:CPU needs it
    outputs.append(out)
    states.append(state)
  return outputs, states
