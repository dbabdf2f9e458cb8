"""Shared test helpers: tolerances, per-device gradients, and running a transformation on simulated
devices (pmapped, compiled once, waited for every step)."""

import functools
import socket

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23


def rounding_tol(ops, scale=1.0, dtype=np.float32):
  """``dict(rtol=..., atol=...)`` for comparing two DIFFERENT programs that compute the same values.

  XLA:CPU emits different code per instruction set (FMA or not, vector width) and per program
  (fusion), so two programs, or one program on another CPU, may round the same arithmetic
  differently: they agree only to rounding. ``ops`` is how many roundings can differ on the way to
  a value (about the number of terms in its reductions, times the steps it went through); each is
  ``eps`` of ``dtype`` (float32, or the wire dtype where a value went through float16/bfloat16)
  relative to ``scale``, the magnitude of the terms (absolute: where terms cancel, the result is
  far smaller than the error). rtol counts the same number of float32 roundings of the value
  itself.
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


def replicate(tree, n_devices=8):
  """Stacks ``tree`` n_devices times along a new leading axis (pmap's per-device layout)."""
  return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n_devices), tree)


def assert_identical_across_devices(tree):
  """Bitwise equality across the leading device axis of every reduced (floating-point) leaf."""
  for x in jax.tree.leaves(tree):
    x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      continue
    for d in range(1, x.shape[0]):
      np.testing.assert_array_equal(x[d:d + 1].view(np.uint8), x[:1].view(np.uint8))


def pmapped(fn, n_devices=8, axis_name="batch", **pmap_kwargs):
  """``fn`` under ``jax.pmap`` over the first ``n_devices`` devices, its axis named
  ``axis_name``."""
  return jax.pmap(fn, axis_name=axis_name, devices=jax.devices()[:n_devices], **pmap_kwargs)


def pmapped_update(tx, n_devices=8, axis_name="batch"):
  """``tx.update`` under pmap: ``step(grads, state[, params]) -> (outputs, state)``, per device."""
  return pmapped(tx.update, n_devices, axis_name)


@functools.lru_cache(maxsize=None)
def pmapped_applied_update(tx, n_devices=8):
  """``tx.update`` under pmap (compiled once per ``tx``), its updates applied to the parameters as
  a guard after it would: ``step(grads, state, params) -> (updates, state, params)``; a
  non-finite step (NaN updates) leaves the parameters."""

  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return updates, state, jax.tree.map(
        lambda p, u: jnp.where(jnp.isfinite(u), p + u, p), params, updates)

  return pmapped(update, n_devices)


def fetched(tree):
  """The program's outputs, waited for, as NumPy arrays (indexed device by device below)."""
  return jax.tree.map(np.asarray, jax.block_until_ready(tree))


def run_updates(tx, grads_per_step, n_devices=8, axis_name="batch", *, state=None, params=None):
  """``tx.update`` under pmap, compiled once, on each per-device gradient pytree in turn, waited for
  every step (XLA:CPU needs it).

  Args:
    tx: the transformation.
    grads_per_step: per-device gradient pytrees (a leading device axis), one per step.
    n_devices: how many devices (the first ones) run it.
    axis_name: the mapped axis' name.
    state: the per-device state the first step starts from; by default ``tx.init(params)`` stacked
      over the devices.
    params: what ``tx.init`` sees; by default the first step's gradients on device 0.

  Returns:
    ``(outputs, states)``: one per step, each state the one after that step.
  """
  step = pmapped_update(tx, n_devices, axis_name)
  if state is None:
    if params is None:
      params = jax.tree.map(lambda g: g[0], grads_per_step[0])
    state = replicate(tx.init(params), n_devices)
  outputs, states = [], []
  for grads in grads_per_step:
    out, state = jax.block_until_ready(step(grads, state))
    outputs.append(out)
    states.append(state)
  return outputs, states


def pmap_update(tx, grads, n_devices=8, axis_name="batch", state=None):
  """One step of ``run_updates``: ``tx.update`` under pmap on per-device ``grads``; returns
  (outputs, new per-device states)."""
  (out,), (state,) = run_updates(tx, [grads], n_devices, axis_name, state=state)
  return out, state


def run_applied_updates(tx, grads_per_step, params, n_devices=8, state=None):
  """``pmapped_applied_update`` on each per-device gradient pytree in turn, from ``params`` (one
  copy, replicated here) and ``state`` (per device; by default ``tx.init(params)``, jitted,
  replicated).

  Returns:
    ``(updates, states)``: one per step, as NumPy arrays (inputs of another kind would compile the
    step again).
  """
  step = pmapped_applied_update(tx, n_devices)
  if state is None:
    state = replicate(jax.jit(tx.init)(params), n_devices)
  params = replicate(params, n_devices)
  outs, states = [], []
  for grads in grads_per_step:
    updates, state, params = fetched(step(grads, state, params))
    outs.append(updates)
    states.append(state)
  return outs, states


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now (for a job's coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
