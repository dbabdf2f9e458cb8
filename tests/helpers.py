"""Shared test helpers: per-device gradients and running a transformation on simulated devices."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23


def rounding_tol(ops, scale=1.0, dtype=np.float32):
  """``dict(rtol=..., atol=...)`` for comparing two DIFFERENT programs that compute the same values.

  XLA:CPU emits different code per instruction set (FMA or not, vector width) and per program (fusion),
  so two programs, or one program on another CPU, may round the same arithmetic differently: they agree
  only to rounding. ``ops`` is how many roundings can differ on the way to a value (about the number of
  terms in its reductions, times the steps it went through); each is ``eps`` of ``dtype`` (float32, or
  the wire dtype where a value went through float16/bfloat16) relative to ``scale``, the magnitude of the
  terms (absolute: where terms cancel, the result is far smaller than the error). rtol counts the same
  number of float32 roundings of the value itself.
  """
  return dict(rtol=ops * F32_EPS, atol=ops * float(ml_dtypes.finfo(dtype).eps) * scale)


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
