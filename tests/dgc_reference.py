"""The NumPy reference of the DGC tests, written from the paper (Lin et al., ICLR 2018, §3) and its
reference code (synxlin/deep-gradient-compression), and the pytree they run it on."""

import math

import numpy as np

from jaxcomp._src import topk


def ref_sparsify(x, density, start, sample_ratio=0.01, upper=1.3, lower=0.8, iters=10):
  """The reference's _sparsify: strided sample threshold, adaptation, first k / top k among many."""
  n = x.size
  k = math.ceil(n * density)
  plan = topk.sampling_plan(n, density, sample_ratio)
  importance = np.abs(x)
  samples = importance if plan.num_samples == n else importance[start::plan.stride]
  threshold = np.sort(samples)[::-1][plan.top_k_samples - 1]
  indices = np.nonzero(importance >= threshold)[0]
  if n > plan.num_samples:
    for _ in range(iters):
      if len(indices) > k:
        if len(indices) > k * upper:
          indices = indices[np.argsort(-importance[indices], kind="stable")[:k]]
        break
      if len(indices) < lower * k:
        threshold = np.float32(threshold * np.float32(lower))
      else:
        break
      indices = np.nonzero(importance >= threshold)[0]
  return indices[:k], threshold


class RefDGC:
  """DGCCompressor + DGCSGDMemory for W workers, exact top-k, with the dense-stage rule of
  jaxcomp."""

  def __init__(self, params, world, ratio, momentum=0.9, nesterov=False, masking=True,
               clip_norm=None, warmup=()):
    self.world, self.ratio, self.m, self.nesterov = world, ratio, momentum, nesterov
    self.masking, self.clip_norm, self.warmup, self.count = masking, clip_norm, warmup, 0
    params = {k: p for k, p in params.items() if p.dtype == np.float32}
    self.sparse = {k: np.ndim(p) > 1 for k, p in params.items()}
    self.u = [{k: np.zeros_like(p) for k, p in params.items() if self.sparse[k]}
              for _ in range(world)]
    self.v = [{k: np.zeros_like(p) for k, p in params.items() if self.sparse[k]}
              for _ in range(world)]
    self.dense_u = {k: np.zeros_like(p) for k, p in params.items() if not self.sparse[k]}

  def momentum(self, u, g):
    if self.nesterov:
      u = np.float32(self.m) * (u + g)
      return u, u + g
    u = np.float32(self.m) * u + g
    return u, u

  def step(self, grads):  # grads: list over workers of dicts
    density = self.ratio
    for end, d in reversed(self.warmup):
      if self.count < end:
        density = d
    if self.clip_norm is not None:
      limit = self.clip_norm * self.world ** -0.5
      clipped = []
      for g in grads:
        norm = np.sqrt(sum(np.sum(np.square(x)) for x in g.values()))
        clipped.append({k: x * np.float32(min(1.0, limit / (norm + 1e-6))) for k, x in g.items()})
      grads = clipped
    out = {}
    for key in grads[0]:
      if not self.sparse[key]:
        mean = sum(g[key] / np.float32(self.world) for g in grads)
        self.dense_u[key], out[key] = self.momentum(self.dense_u[key], mean)
        continue
      n = grads[0][key].size
      k = math.ceil(n * density)
      dense = self.world * k * 8 >= n * 4
      total = np.zeros(n, np.float32)
      for w in range(self.world):
        self.u[w][key], step = self.momentum(self.u[w][key], grads[w][key])
        self.v[w][key] = self.v[w][key] + step
        flat = self.v[w][key].reshape(-1)
        if dense:
          total += flat / np.float32(self.world)
          self.v[w][key] = np.zeros_like(self.v[w][key])
          continue
        sent = np.argsort(-np.abs(flat), kind="stable")[:k]
        np.add.at(total, sent, flat[sent])
        self.v[w][key] = zero_at(self.v[w][key], sent)
        if self.masking:
          self.u[w][key] = zero_at(self.u[w][key], sent)
      out[key] = (total if dense else total * np.float32(1 / self.world)).reshape(
          grads[0][key].shape)
    self.count += 1
    return out


def zero_at(x, indices):
  """``x`` with its entries at the flat ``indices`` zeroed."""
  flat = x.reshape(-1).copy()
  flat[indices] = 0
  return flat.reshape(x.shape)


def make_params():
  """Two matrices (sparsified), a vector and a 0-d leaf (averaged densely), and an int leaf."""
  return {"w1": np.zeros((16, 32), np.float32), "b1": np.zeros((32,), np.float32),
          "w2": np.zeros((32, 8), np.float32), "t": np.zeros((), np.float32),
          "steps": np.zeros((3,), np.int32)}


def device_grads(rng, params, world):
  """Per-device standard normal gradients like ``params``; its int leaf the same on every device."""
  return {k: (rng.standard_normal((world,) + p.shape).astype(np.float32)
              if p.dtype == np.float32 else np.stack([p] * world)) for k, p in params.items()}
