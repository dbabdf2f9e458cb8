"""The NumPy reference of the PowerSGD tests, in float64, from torch 2.13's ``powerSGD_hook`` and
the paper's Algorithms 1–2 (Vogels et al., NeurIPS 2019), and the pytrees they run it on."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomp

W = 4  # the devices the PowerSGD tests run on


def np_orthogonalize(x, eps=0.0):
  """torch's orthogonalization: MGS for r ≤ 2 (col /= norm + eps, then remove it from later
  ones)."""
  x = np.array(x, np.float64)
  if x.shape[1] > 2:
    return np.linalg.qr(x)[0]
  for i in range(x.shape[1]):
    denom = np.linalg.norm(x[:, i]) + eps
    x[:, i] /= denom if denom else 1.0
    for j in range(i + 1, x.shape[1]):
      x[:, j] -= np.sum(x[:, i] * x[:, j]) * x[:, i]
  return x


def matrix_shape(shape, view):
  if not shape:
    return 1, 1
  if view == "torch":
    return shape[0], int(np.prod(shape[1:]))
  return int(np.prod(shape[:-1])), shape[-1]


def np_step(grads, errors, qs, *, rank, rate=2.0, eps=0.0, view="flax", ef=True):
  """One compressed step. grads/errors: per device, name -> array; qs: name -> Q (compressed
  only)."""
  n_dev = len(grads)
  ms = [{k: g[k].astype(np.float64) + (errors[d][k] if ef else 0) for k in g}
        for d, g in enumerate(grads)]
  out, new_q = {}, {}
  for k in grads[0]:
    n, m = matrix_shape(grads[0][k].shape, view)
    r = min(n, m, rank)
    if not (n + m) * r * rate < n * m:
      out[k] = sum(mm[k] for mm in ms) / n_dev
      continue
    mats = [mm[k].reshape(n, m) for mm in ms]
    q = np_orthogonalize(qs[k], eps)
    p = np_orthogonalize(sum(mat @ q for mat in mats), eps)  # P summed, not divided
    q = sum(mat.T @ p for mat in mats) / n_dev
    out[k] = (p @ q.T).reshape(grads[0][k].shape)
    new_q[k] = q
  new_errors = [{k: mm[k] - out[k] for k in mm} for mm in ms]
  return out, new_errors, new_q


def np_batched_step(grads, errors, q, *, rank, ef=True):
  """One compressed batched step on flat per-device vectors (length L)."""
  n_dev, length = len(grads), grads[0].size
  side = int(np.ceil(np.sqrt(length)))
  ms = [np.pad(g.astype(np.float64), (0, side * side - length)) + (errors[d] if ef else 0)
        for d, g in enumerate(grads)]
  mats = [mm.reshape(side, side) for mm in ms]
  p = np_orthogonalize(sum(mat @ np_orthogonalize(q) for mat in mats))
  q = sum(mat.T @ p for mat in mats) / n_dev
  out = (p @ q.T).reshape(-1)
  return out[:length], [mm - out for mm in ms], q


def np_alternating_step(grads, errors, ps, qs, t, *, rank, rate=2.0, view="flax"):
  """epfml's BasicPowerSGD, one iteration per step: compressed step t (from 0) sends Qs if t is even
  (P̂ = orth(P), Q = Mᵀ·P̂), Ps if odd (Q̂ = orth(Q), P = M·Q̂); the error is M minus this device's
  own low-rank product; the uncompressed leaves are averaged (error: local minus mean)."""
  n_dev = len(grads)
  ms = [{k: g[k].astype(np.float64) + errors[d][k] for k in g} for d, g in enumerate(grads)]
  out, new_ps, new_qs = {}, dict(ps), dict(qs)
  new_errors = [{} for _ in range(n_dev)]
  for k in grads[0]:
    shape = grads[0][k].shape
    n, m = matrix_shape(shape, view)
    r = min(n, m, rank)
    if not (n + m) * r * rate < n * m:
      out[k] = sum(mm[k] for mm in ms) / n_dev
      for d in range(n_dev):
        new_errors[d][k] = ms[d][k] - out[k]
      continue
    mats = [mm[k].reshape(n, m) for mm in ms]
    if t % 2 == 0:
      p_hat = np_orthogonalize(ps[k])
      local = [mat.T @ p_hat for mat in mats]
      new_qs[k] = sum(local) / n_dev
      out[k] = (p_hat @ new_qs[k].T).reshape(shape)
      products = [p_hat @ q.T for q in local]
    else:
      q_hat = np_orthogonalize(qs[k])
      local = [mat @ q_hat for mat in mats]
      new_ps[k] = sum(local) / n_dev
      out[k] = (new_ps[k] @ q_hat.T).reshape(shape)
      products = [p @ q_hat.T for p in local]
    for d in range(n_dev):
      new_errors[d][k] = ms[d][k] - products[d].reshape(shape)
  return out, new_errors, new_ps, new_qs


def params_mixed():
  """Flax-layout leaves: conv kernel, dense kernels, biases, a 0-d scale and an int counter."""
  return {"conv": {"kernel": np.zeros((3, 3, 2, 8), np.float32), "bias": np.zeros(8, np.float32)},
          "dense": {"kernel": np.zeros((20, 12), np.float32), "bias": np.zeros(12, np.float32)},
          "head": {"kernel": np.zeros((12, 5), np.float32)},
          "scale": np.zeros((), np.float32), "steps": np.zeros(3, np.int32)}


def grads_for(params, rng, n_dev=W):
  def leaf(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return np.stack([rng.standard_normal(x.shape) for _ in range(n_dev)]).astype(x.dtype)
    return np.stack([np.asarray(x) + 7] * n_dev)
  return jax.tree.map(leaf, params)


def device(tree, d):
  return jax.tree.map(lambda x: np.asarray(x)[d], tree)


def named(tree):
  """Flattens a pytree to {path: leaf}, leaving out MaskedNode and non-array leaves."""
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def per_leaf(state):
  """``{field: {path: leaf}}`` of a layer-wise state, whole or a ``comm_hook`` state of one per
  bucket (each bucket's state names its parameters by their paths in the whole pytree)."""
  states = state.hook_states if isinstance(state, jaxcomp.CommHookState) else (state,)
  out = {"error": {}, "q": {}, "p": {}}
  for s in states:
    for field in out:
      leaves = s.signature.treedef.flatten_up_to(s.by_leaf(field))
      for path, leaf in zip(s.signature.paths, leaves):
        if not isinstance(leaf, optax.MaskedNode):
          out[field][path] = np.asarray(leaf)
  return out
