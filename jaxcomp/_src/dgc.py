"""Deep Gradient Compression: momentum-corrected top-k sparsification, and its coarse-grained
variant.

Both transformations sit first in ``optax.chain`` and carry the momentum themselves, as the
reference ``DGCSGD`` does, so the optimizer after them has none; weight decay goes before them so
that it is local::

    tx = optax.chain(optax.add_decayed_weights(1e-4), jaxcomp.dgc(0.001), optax.sgd(lr))

The step, per device, on the leaves ``sparsify(path, leaf)`` picks (default ``ndim > 1``; the others
take the dense mean, then momentum ``u ← m·u + mean(g)``, output ``u``):

1. local gradient clipping of the whole gradient to norm ``clip_norm · W^clip_exponent`` (optional);
2. momentum correction: ``u ← m·u + g; v ← v + u`` (Nesterov: ``u ← m·(u + g); v ← v + u + g``);
3. selection of at most k = ceil(numel·density) coordinates: ``dgc`` takes its own largest ``|v|``
   (the reference's threshold estimated from a sample, or exact top-k); ``coarse_dgc`` all-reduces
   the L1 norms of chunks of ``v`` and every device takes the same top chunks;
4. exchange: ``dgc`` all-gathers the k values and int32 indices of every device and scatter-adds
   them (duplicates sum) ×1/W; ``coarse_dgc`` averages the chosen chunks, so its bytes do not grow
   with W;
5. ``v ← 0`` at the sent coordinates, and ``u ← 0`` there too with momentum factor masking;
6. non-finite values (``jaxcomp._src.finite``'s policy), seen in what is sent, no flag: 2's ``v`` is
   computed where it is read, the state written after the exchange and kept if any device's ``v``
   was not finite (``dgc`` sends that device's values as NaN; ``coarse_dgc``'s norms and the dense
   means show it); every output is then NaN. Donated, ``g``, ``u`` and ``v`` are copied once.

Warm-up ramps the density through stages, one phase of the step each. Where a stage's sparse
exchange would send at least a leaf's dense all-reduce (``dgc``: ``W·density·2 ≥ 1`` for float32
values), the mean of its whole ``v`` is sent instead: nothing is delayed, so nothing is masked.

References:
  Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for
  Distributed Training", ICLR 2018 (https://arxiv.org/abs/1712.01887); the first author's reference
  code, ``DGCCompressor`` / ``DGCSGDMemory`` (github.com/synxlin/deep-gradient-compression).
  Sun, Feng, Han, Yan, Wen, "Optimizing Network Performance for Distributed DNN Training on GPU
  Clusters: ImageNet/AlexNet Training in 1.5 Minutes", 2019 (https://arxiv.org/abs/1902.06855): the
  coarse-grained sparse communication (CSC) of ``coarse_dgc``.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._src import axis, compressor, finite, kernels, topk
from jaxcomp._src import tree as tree_lib
from jaxcomp._src.dgc_config import ChunkExchange, DGCConfig, TopKExchange, config


class DGCState(NamedTuple):
  """State of ``dgc`` and ``coarse_dgc``.

  Attributes:
    count: steps taken (non-finite steps are not counted); it drives the warm-up.
    u, v: momentum and accumulated velocity of each sparsified leaf, per device
      (``optax.MaskedNode`` at the other leaves).
    dense_u: momentum of each dense reduced leaf, applied after averaging, so the same on every
      device (``optax.MaskedNode`` elsewhere).
    config, signature: the settings and the gradient's signature.
  """
  count: jax.Array
  u: Any
  v: Any
  dense_u: Any
  config: DGCConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("u", "v")


def _sparsified(config: DGCConfig, signature: tree_lib.TreeSignature) -> tuple:
  """Per reduced leaf: is it sparsified? Raises ValueError for one too large for int32 indices."""
  flags = tuple(bool(config.sparsify(signature.paths[i], leaf))
                for i, leaf in zip(signature.reduced, signature.reduced_structs()))
  for i, leaf, sparse in zip(signature.reduced, signature.reduced_structs(), flags):
    size = getattr(config.exchange, "chunk_size", 1)  # the last chunk's padding is addressed too
    if sparse and -(-leaf.size // size) * size >= 2**31:
      raise ValueError(f"sparsify: leaf {signature.paths[i]} has {leaf.size} elements; int32 "
                       "indices address at most 2**31 - 1: leave it to the dense mean")
  return flags


def init(config: DGCConfig, signature: tree_lib.TreeSignature) -> DGCState:
  """Zero momenta: ``u`` and ``v`` of the sparsified leaves, ``dense_u`` of the others."""
  sparse = _sparsified(config, signature)

  def where(kind: bool):  # new zeros for each field: a donated state must not hold a buffer twice
    return signature.place([jnp.zeros(leaf.shape, leaf.dtype) if s == kind else optax.MaskedNode()
                            for leaf, s in zip(signature.reduced_structs(), sparse)])

  return DGCState(jnp.zeros([], jnp.int32), where(True), where(True), where(False), config,
                  signature)


def _clipped(config: DGCConfig, leaves: list, axis_name) -> list:
  """1: local gradient clipping (paper §3.3) before accumulation, the threshold scaled by W^exp."""
  if config.clip_norm is None:
    return leaves
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))
  world = jnp.asarray(axis.axis_size(axis_name), jnp.float32)
  limit = config.clip_norm * world ** jnp.asarray(config.clip_exponent, jnp.float32)
  scale = jnp.minimum(1.0, limit / (norm + 1e-6))
  return [(g * scale).astype(g.dtype) for g in leaves]


def _momentum(config: DGCConfig, u, g) -> tuple:
  """2: momentum in ``u``'s dtype; returns the new ``u`` and what is added to ``v``."""
  m, g = jnp.asarray(config.momentum, u.dtype), g.astype(u.dtype)
  u = m * (u + g) if config.nesterov else m * u + g
  return u, u + g if config.nesterov else u


def _sends_dense(exchange, numel: int, density: float, world: int, value_bytes: int) -> bool:
  """Whether a leaf's sparse exchange sends at least the bytes of its dense all-reduce."""
  if isinstance(exchange, TopKExchange):  # values and int32 indices from every device
    sparse = world * math.ceil(numel * density) * (value_bytes + 4)
  else:  # the chunks' float32 norms, then the chosen chunks: independent of W
    num_chunks = -(-numel // exchange.chunk_size)
    sparse = num_chunks * 4 + math.ceil(num_chunks * density) * exchange.chunk_size * value_bytes
  return sparse >= numel * value_bytes


def _topk_exchange(exchange: TopKExchange, vs, density, keys, wires, axis_name, ok) -> tuple:
  """3–4, 6 for ``dgc``: ``([(mean, sent indices, sent values)], finite)`` from ``vs`` (functions
  computing each ``v``) and ``ok`` (the dense means'); one all-gather of values per dtype, one of
  indices. (A finite value overflowing its wire dtype is sent as ∞ and does not stop the step.)"""
  flats = [lambda v=v: v().ravel() for v in vs]
  if exchange.selection == "exact":  # 3, and 6: a pass over v for whether it is finite
    selected = [(topk.exact_topk(flat(), math.ceil(flat().size * density)), None,
                 jnp.isfinite(flat()).all()) for flat in flats]
  else:  # 3, and 6: the selection's first pass over v says whether it is finite
    selected = [topk.sampled_topk(
        flat, topk.sampling_plan(flat().size, density, exchange.sample_ratio), key,
        upper_bound=exchange.upper_bound, lower_bound=exchange.lower_bound,
        max_adaptation_iters=exchange.max_adaptation_iters) for flat, key in zip(flats, keys)]
  sent = [jnp.where(finite, flat().at[i].get(mode="fill", fill_value=0), jnp.nan)
          for flat, (i, _, finite) in zip(flats, selected)]  # 6
  values = axis.all_gather_many([x.astype(d) for x, d in zip(sent, wires)], axis_name)  # 4
  indices = axis.all_gather_many([i for i, _, _ in selected], axis_name)
  ok = functools.reduce(jnp.logical_and, [~jnp.isnan(x).any() for x in values], ok)  # 6
  # ÷W before they are added (duplicates sum), into zeros (NaN where not finite) alike everywhere.
  means = [kernels.scatter_add(v().shape, i.ravel(), axis.divide_by_world(
      x.ravel().astype(v().dtype), axis_name), jnp.where(ok, 0.0, jnp.nan))
           for v, i, x in zip(vs, indices, values)]
  return list(zip(means, [i for i, _, _ in selected], sent)), ok


def _chunk_exchange(exchange: ChunkExchange, vs, density, _, wires, axis_name, ok) -> tuple:
  """3–4, 6 for ``coarse_dgc``, as ``_topk_exchange``: an all-reduce of the norms, one of chunks."""
  size = exchange.chunk_size
  norms = axis.psum_many([jnp.abs(jnp.pad(v().ravel(), (0, -v().size % size)).reshape(-1, size))
                          .sum(1, jnp.float32) for v in vs], axis_name)
  ok = ok & finite.reduced_finite(norms)  # 6
  coords = [(lax.top_k(n, math.ceil(n.size * density))[1][:, None] * size  # 3: the same chunks
             + jnp.arange(size, dtype=jnp.int32)).ravel() for n in norms]  # on every device
  sent = [v().ravel().at[i].get(mode="fill", fill_value=0) for v, i in zip(vs, coords)]
  means = axis.mean_many([x.astype(d) for x, d in zip(sent, wires)], axis_name)  # 4
  return [(kernels.scatter_add(v().shape, i, mean.astype(v().dtype), jnp.where(ok, 0.0, jnp.nan)),
           i, x) for v, i, mean, x in zip(vs, coords, means, sent)], ok


def step(config: DGCConfig, state: DGCState, leaves: list, axis_name, phase) -> tuple:
  """One step at the density ``phase.value`` on the reduced leaves: ``(means, state, finite)``."""
  signature = state.signature
  sparse = _sparsified(config, signature)
  wires = [g.dtype if config.value_dtype is None else config.value_dtype for g in leaves]
  leaves = _clipped(config, leaves, axis_name)  # 1
  us, vs, dense_us = (signature.pick(t) for t in (state.u, state.v, state.dense_u))
  accumulated = lambda i: vs[i] + _momentum(config, us[i], leaves[i])[1]  # noqa: E731  # 2, lazily
  dense, exchanged = {}, []
  for i, g in enumerate(leaves):
    if not sparse[i]:  # the mean, then momentum (the reference's compensate(accumulate=False))
      dense[i] = axis.mean(g, axis_name, wires[i])
    elif _sends_dense(config.exchange, g.size, phase.value, axis.axis_size(axis_name),
                      np.dtype(wires[i]).itemsize):
      dense[i] = axis.mean(accumulated(i), axis_name, wires[i])
    else:
      exchanged.append(i)
  # Sampling keys from the seed, the step and the leaf's path: alike whole, bucketed, in dgc_hook.
  step_key = jax.random.fold_in(jax.random.PRNGKey(getattr(config.exchange, "seed", 0)),
                                state.count)
  keys = [jax.random.fold_in(step_key, zlib.crc32(signature.paths[signature.reduced[i]].encode())
                             & 0x7FFFFFFF) for i in exchanged]
  results, ok = (_topk_exchange if isinstance(config.exchange, TopKExchange) else _chunk_exchange)(
      config.exchange, [functools.partial(accumulated, i) for i in exchanged], phase.value, keys,
      [wires[i] for i in exchanged], axis_name, finite.reduced_finite(list(dense.values())))  # 3–6
  means = {i: r[0] for i, r in zip(exchanged, results)}
  for i, g in enumerate(leaves):  # 2, 6: the new state, or the old one where not finite
    if not sparse[i]:
      u, means[i] = _momentum(config, dense_us[i], dense[i])
      dense_us[i] = jnp.where(ok, u, dense_us[i])
    else:  # v (0 where sent whole: nothing delayed), then u, each from the old u
      vs[i] = kernels.in_place(lambda old, u, g, ok, whole=i in dense: jnp.where(
          ok, jnp.zeros_like(old) if whole else old + _momentum(config, u, g)[1], old),
                               vs[i], us[i], g, ok)
      us[i] = kernels.in_place(lambda old, g, ok: jnp.where(ok, _momentum(config, old, g)[0], old),
                               us[i], g, ok)
    if i not in exchanged:  # NaN where not finite (the sparse means start from NaN)
      means[i] = jnp.where(ok, means[i] if not sparse[i] else dense[i], jnp.nan)
  for i, (_, sent_indices, sent_values) in zip(exchanged, results):
    kept = jnp.where(ok, sent_indices, leaves[i].size)  # out of range, dropped, where not finite
    vs[i] = kernels.subtract_at(vs[i], kept, sent_values)  # 5
    if config.momentum_masking:
      us[i] = kernels.zero_at(us[i], kept)
  new_state = state._replace(u=signature.place(us), v=signature.place(vs),
                             dense_u=signature.place(dense_us))
  return [means[i].astype(g.dtype) for i, g in enumerate(leaves)], new_state, ok


def dgc(ratio: float = 0.001, *, axis_name: axis.AxisName = "batch", momentum: float = 0.9,
        nesterov: bool = False, momentum_masking: bool = True, clip_norm: Optional[float] = None,
        clip_exponent: float = -0.5, warmup: Union[None, str, Sequence] = None,
        steps_per_epoch: Optional[int] = None, value_dtype=None,
        sparsify: Optional[Callable] = None, selection: str = "sampled",
        sample_ratio: Optional[float] = None, upper_bound: Optional[float] = None,
        lower_bound: Optional[float] = None, max_adaptation_iters: Optional[int] = None,
        seed: Optional[int] = None,
        bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """Deep Gradient Compression: the cross-device mean of momentum-corrected top-k sparse gradients.

  Use with a momentum-free optimizer, weight decay before it::

    tx = optax.chain(optax.add_decayed_weights(1e-4),
                     jaxcomp.dgc(0.001, warmup="paper", steps_per_epoch=390), optax.sgd(0.1))
    # A momentum schedule (the density fixes shapes: it stays static, scheduled by warmup=...):
    tx = optax.inject_hyperparams(jaxcomp.dgc, static_args=("ratio",))(
        ratio=0.001, momentum=optax.linear_schedule(0.5, 0.9, 1000))

  Example:
    >>> import jax, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.dgc(0.01), optax.sgd(0.1))
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 32, 32))}  # one per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
    >>> int((updates["w"][0] != 0).sum()) <= 8 * 11  # each device sends at most 11 of 1,024
    True

  Args:
    ratio: density after warm-up; each sparsified leaf sends k = ceil(numel·ratio) coordinates.
      Static: it fixes k (under ``optax.inject_hyperparams`` list it in ``static_args``).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    momentum, nesterov, momentum_masking, clip_norm, clip_exponent, value_dtype, sparsify: see
      ``DGCConfig`` (``sparsify`` None: ``leaf.ndim > 1``). ``momentum``, ``clip_norm`` and
      ``clip_exponent`` may be arrays, e.g. schedules through ``optax.inject_hyperparams``.
    warmup: None; ``"paper"`` (densities ``PAPER_WARMUP`` = 0.25, 0.0625, 0.015625, 0.004, one epoch
      of ``steps_per_epoch`` steps each, then ``ratio``); or ``((end_step, density), ...)`` with
      increasing ``end_step`` — density applies while ``count < end_step`` — then ``ratio``. Each
      density is a phase of the step (``jaxcomp.comm_report``: ``"dgc.density=0.25"``).
    steps_per_epoch: steps per epoch, for ``warmup="paper"``.
    selection, sample_ratio, upper_bound, lower_bound, max_adaptation_iters, seed: see
      ``TopKExchange``; None: its defaults (0.01, 1.3, 0.8, 10, 0), which
      ``optax.inject_hyperparams`` leaves static.
    bucket_cap_mb: None, or DDP's bucket cap in MiB: each bucket sends its own collectives as soon
      as its gradients exist (XLA may still combine them), with its own ``DGCState`` in a
      ``jaxcomp.CommHookState``. Not with ``clip_norm``.

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018, §3 (momentum correction, local gradient
    clipping, momentum factor masking, warm-up training); reference ``DGCCompressor``.
  """
  settings = config(
      TopKExchange, ratio, momentum=momentum, nesterov=nesterov,
      momentum_masking=momentum_masking, clip_norm=clip_norm, clip_exponent=clip_exponent,
      warmup=warmup, steps_per_epoch=steps_per_epoch, value_dtype=value_dtype, sparsify=sparsify,
      selection=selection, sample_ratio=sample_ratio, upper_bound=upper_bound,
      lower_bound=lower_bound, max_adaptation_iters=max_adaptation_iters, seed=seed)
  return compressor.transformation(settings, init, step, axis_name, bucket_cap_mb=bucket_cap_mb)


def coarse_dgc(ratio: float = 0.01, *, axis_name: axis.AxisName = "batch",
               chunk_size: Optional[int] = None, momentum: float = 0.9, nesterov: bool = False,
               momentum_masking: bool = True, clip_norm: Optional[float] = None,
               clip_exponent: float = -0.5, warmup: Union[None, str, Sequence] = None,
               steps_per_epoch: Optional[int] = None, value_dtype=None,
               sparsify: Optional[Callable] = None,
               bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """Coarse-grained DGC: every device sends the same top chunks, so traffic does not grow with W.

  Each sparsified leaf's momentum-corrected ``v`` is cut into chunks of ``chunk_size`` elements; the
  chunks' L1 norms are all-reduced, every device takes the same ceil(chunks·ratio) chunks of largest
  summed norm, and only those are averaged.

  Example:
    >>> import jax, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.coarse_dgc(0.25, chunk_size=64), optax.sgd(0.1))
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 32, 32))}  # one per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
    >>> int((updates["w"][0] != 0).sum())  # the same 4 of 16 chunks of 64 on every device
    256

  Args:
    ratio: fraction of chunks sent after warm-up.
    axis_name: the mapped axis to average over.
    chunk_size: elements per chunk; None: 256 (static: it fixes the chunks' shape).
    momentum: as in ``dgc``, and so are nesterov, momentum_masking, clip_norm, clip_exponent,
      warmup, steps_per_epoch, value_dtype, sparsify and bucket_cap_mb (a stage sends the dense
      mean where norms and chunks would send at least the leaf's bytes).

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Sun et al., "Optimizing Network Performance for Distributed DNN Training on GPU Clusters:
    ImageNet/AlexNet Training in 1.5 Minutes", 2019 (coarse-grained sparse communication); Lin et
    al., "Deep Gradient Compression", ICLR 2018 (momentum correction, clipping, warm-up).
  """
  settings = config(
      ChunkExchange, ratio, chunk_size=chunk_size, momentum=momentum, nesterov=nesterov,
      momentum_masking=momentum_masking, clip_norm=clip_norm, clip_exponent=clip_exponent,
      warmup=warmup, steps_per_epoch=steps_per_epoch, value_dtype=value_dtype, sparsify=sparsify)
  return compressor.transformation(settings, init, step, axis_name, bucket_cap_mb=bucket_cap_mb)
