"""Deep Gradient Compression: momentum-corrected top-k sparsification, and its coarse-grained variant.

Both transformations sit first in ``optax.chain`` and carry the momentum themselves, as the reference
``DGCSGD`` does, so the optimizer after them has none; weight decay goes before them so that it is local::

    tx = optax.chain(optax.add_decayed_weights(1e-4), jaxcomp.dgc(0.001), optax.sgd(lr))

The step, per device, on the reduced leaves; ``sparsify(path, leaf)`` (default ``ndim > 1``) picks the
sparsified ones, the others take the dense mean and then momentum (``u ← m·u + mean(g)``, output ``u``).
The ``# n:`` comments below point here:

1. local gradient clipping of the whole gradient to norm ``clip_norm · W^clip_exponent`` (optional);
2. momentum correction: ``u ← m·u + g; v ← v + u`` (Nesterov: ``u ← m·(u + g); v ← v + u + g``);
3. selection of at most k = ceil(numel·density) coordinates: ``dgc`` takes its own largest ``|v|``
   (the reference's threshold estimated from a sample, or exact top-k); ``coarse_dgc`` all-reduces the
   L1 norms of chunks of ``v`` and every device takes the same top chunks;
4. exchange: ``dgc`` all-gathers k values and k int32 indices from every device and scatter-adds
   them (duplicates sum) ×1/W; ``coarse_dgc`` averages the chosen chunks (its traffic does not grow
   with W);
5. ``v ← 0`` at the sent coordinates, and ``u ← 0`` there too with momentum factor masking.

Warm-up ramps the density through stages (``warmup``), one phase of the step each, with a static k.
A stage whose sparse exchange would send at least the bytes of the leaf's dense all-reduce (for
``dgc``: ``W·k·(value bytes + 4) ≥ numel·value bytes``, i.e. ``W·density·2 ≥ 1`` for float32 values)
sends the leaf's whole ``v`` as a dense mean instead: nothing is delayed, so nothing is masked.

State: ``u`` and ``v`` (of the sparsified leaves) differ from device to device (``PER_DEVICE_FIELDS``);
``dense_u`` (the dense leaves' momentum) and ``count`` are the same everywhere.

References:
  Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for
  Distributed Training", ICLR 2018 (https://arxiv.org/abs/1712.01887); the first author's reference
  code, ``DGCCompressor`` / ``DGCSGDMemory`` (github.com/synxlin/deep-gradient-compression).
  Sun, Feng, Han, Yan, Wen, "Optimizing Network Performance for Distributed DNN Training on GPU
  Clusters: ImageNet/AlexNet Training in 1.5 Minutes", 2019 (https://arxiv.org/abs/1902.06855): the
  coarse-grained sparse communication (CSC) of ``coarse_dgc``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._src import axis, compressor, kernels, phases as phases_lib, validate
from jaxcomp._src import tree as tree_lib

PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
"""The paper's warm-up densities, one per epoch, before the final ``ratio`` (0.001 in the paper)."""

_DENSITY_IS_STATIC = "fixes k, the number of coordinates sent; schedule the density with warmup=..."
_INDEX_BYTES = 4  # int32 indices on the wire
_CANDIDATES = 2  # the sampled selection compacts up to 2·k candidates; more: exact top-k of all


# ------------------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True)
class TopKExchange:
  """``dgc``'s exchange: each device selects its own top coordinates; all-gather, scatter-add, ×1/W.

  Attributes:
    selection: ``"sampled"``, the reference's threshold estimated from a sample (at most k sent;
      ``lax.top_k`` over millions of elements costs more than the rest of the step), or ``"exact"``,
      ``lax.top_k`` (exactly k sent).
    sample_ratio: fraction of each leaf sampled for the threshold (at least 2/density samples).
    upper_bound: with more than ``upper_bound·k`` candidates take the exact top k among them.
    lower_bound: with fewer than ``lower_bound·k`` candidates lower the threshold by this factor.
    max_adaptation_iters: at most this many lowerings.
    seed: seeds the sampling offsets (a function of ``seed``, the step and the leaf's path).
  """
  selection: str = "sampled"
  sample_ratio: float = 0.01
  upper_bound: float = 1.3
  lower_bound: float = 0.8
  max_adaptation_iters: int = 10
  seed: int = 0

  def __post_init__(self):
    validate.choice(self.selection, "selection", ("sampled", "exact"))
    _set(self, sample_ratio=validate.density(self.sample_ratio, "sample_ratio"),
         upper_bound=validate.number(self.upper_bound, "upper_bound", 1),
         lower_bound=validate.number(self.lower_bound, "lower_bound", 0, 1, low_open=True,
                                     high_open=True),
         max_adaptation_iters=validate.integer(self.max_adaptation_iters, "max_adaptation_iters", 0),
         seed=validate.integer(self.seed, "seed", 0))


@dataclasses.dataclass(frozen=True)
class ChunkExchange:
  """``coarse_dgc``'s exchange: all-reduce chunk L1 norms, then the mean of the same top chunks.

  Attributes:
    chunk_size: elements per chunk; larger chunks select more coarsely and cost fewer norms.
  """
  chunk_size: int = 256

  def __post_init__(self):
    _set(self, chunk_size=validate.integer(self.chunk_size, "chunk_size", 1,
                                           static="fixes the chunks' shape"))


def _set(config, **values) -> None:
  for name, value in values.items():
    object.__setattr__(config, name, value)


def _ndim_above_one(path: str, leaf) -> bool:
  del path
  return leaf.ndim > 1


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DGCConfig:
  """DGC's settings, validated; a static pytree node kept in the state.

  Attributes:
    ratio: density after warm-up (``dgc``: fraction of coordinates; ``coarse_dgc``: of chunks). The
      paper sends 0.1%: with momentum correction and warm-up that loses no accuracy on ImageNet.
    exchange: a ``TopKExchange`` (``dgc``) or a ``ChunkExchange`` (``coarse_dgc``).
    momentum: momentum factor m of the momentum correction (and of the dense leaves' momentum):
      the optimizer's momentum moves here, so that delayed coordinates keep their momentum.
    nesterov: Nesterov momentum correction, ``u ← m·(u + g); v ← v + u + g``.
    momentum_masking: also zero ``u`` at the sent coordinates (momentum factor masking): stale
      momentum of a coordinate just sent would otherwise push it again.
    warmup: ``((end_step, density), ...)`` with increasing ends: the density while ``count <
      end_step``, then ``ratio``. Sparsity ramped up over the first epochs keeps early training,
      where gradients change fastest, from being delayed.
    clip_norm: local gradient clipping: each device scales its whole gradient to global L2 norm at
      most ``clip_norm · W^clip_exponent`` before accumulation (None: no clipping, the reference's
      default); it keeps the velocity accumulated over many steps from exploding.
    clip_exponent: the world-size exponent of the clipping threshold; the paper's N^(-1/2).
      ``momentum``, ``clip_norm`` and ``clip_exponent`` may be ``validate.TRACED`` (schedules).
    value_dtype: wire dtype of the values and of the dense means: None (the gradient's), float32,
      float16 or bfloat16. Indices are int32.
    sparsify: ``sparsify(path, leaf) -> bool`` with the leaf as a ``jax.ShapeDtypeStruct``: which
      reduced leaves are sparsified; default ``leaf.ndim > 1`` (biases and norm scales are small).
  """
  ratio: float = 0.001
  exchange: Union[TopKExchange, ChunkExchange] = TopKExchange()
  momentum: Any = 0.9
  nesterov: bool = False
  momentum_masking: bool = True
  warmup: tuple = ()
  clip_norm: Any = None
  clip_exponent: Any = -0.5
  value_dtype: Any = None
  sparsify: Callable = _ndim_above_one

  def __post_init__(self):
    if not isinstance(self.exchange, (TopKExchange, ChunkExchange)):
      raise TypeError(f"exchange must be a TopKExchange or a ChunkExchange; got {self.exchange!r}")
    momentum = validate.traceable(
        self.momentum, lambda v: validate.number(v, "momentum", 0, 1, high_open=True))
    if validate.boolean(self.nesterov, "nesterov") and isinstance(momentum, float) and not momentum:
      raise ValueError("nesterov=True needs a momentum > 0; got momentum=0")
    if _dtype_name(self.value_dtype) not in (None, "float32", "float16", "bfloat16"):
      raise ValueError(f"value_dtype must be None, float32, float16 or bfloat16; got "
                       f"{self.value_dtype!r}")
    _set(self, ratio=validate.density(self.ratio, "ratio", static=_DENSITY_IS_STATIC),
         momentum=momentum,
         momentum_masking=validate.boolean(self.momentum_masking, "momentum_masking"),
         warmup=_checked_stages(self.warmup),
         clip_norm=None if self.clip_norm is None else validate.traceable(
             self.clip_norm, lambda v: validate.number(v, "clip_norm", 0, low_open=True)),
         clip_exponent=validate.traceable(
             self.clip_exponent, lambda v: validate.number(v, "clip_exponent")),
         value_dtype=None if self.value_dtype is None else jnp.dtype(self.value_dtype),
         sparsify=validate.function(self.sparsify, "sparsify", "sparsify(path, leaf) -> bool"))

  @property
  def densities(self) -> tuple:
    """The density of each stage: the warm-up's, then ``ratio``."""
    return tuple(d for _, d in self.warmup) + (self.ratio,)


def _dtype_name(dtype) -> Optional[str]:
  try:
    return None if dtype is None else np.dtype(dtype).name
  except TypeError:
    return repr(dtype)


def _checked_stages(stages) -> tuple:
  try:
    pairs = [(end, density) for end, density in stages]
  except (TypeError, ValueError):
    raise ValueError(f"warmup must be None, 'paper' or a sequence of (end_step, density) pairs; "
                     f"got {stages!r}") from None
  previous = 0
  for end, density in pairs:
    if isinstance(end, (bool, np.bool_)) or not isinstance(end, (int, np.integer)) or end <= previous:
      raise ValueError("warmup: stage ends must be increasing positive ints (the first step after "
                       f"each stage); got {end!r} after {previous}")
    validate.density(density, "warmup density", static=_DENSITY_IS_STATIC)
    previous = int(end)
  return tuple((int(end), float(density)) for end, density in pairs)


def warmup_stages(warmup, steps_per_epoch: Optional[int]) -> tuple:
  """``warmup`` as ``((end_step, density), ...)``: None, ``"paper"`` (``PAPER_WARMUP``, one epoch of
  ``steps_per_epoch`` steps each) or already such a sequence."""
  if warmup is None:
    return ()
  if isinstance(warmup, str):
    validate.choice(warmup, "warmup", ("paper",))
    if steps_per_epoch is None:
      raise ValueError("steps_per_epoch must be given with warmup='paper' (one warm-up stage per "
                       "epoch); got None")
    steps = validate.integer(steps_per_epoch, "steps_per_epoch", 1)
    return tuple(((e + 1) * steps, d) for e, d in enumerate(PAPER_WARMUP))
  return _checked_stages(warmup)


def _configure(exchange: type, ratio: float, *, warmup=None, steps_per_epoch=None, sparsify=None,
               **settings) -> DGCConfig:
  """The ``DGCConfig`` of a factory's keyword arguments: ``exchange``'s fields (None: its default)
  go to the exchange, the rest to the configuration."""
  fields = {f.name for f in dataclasses.fields(exchange)}
  return DGCConfig(
      ratio=ratio, exchange=exchange(**{k: v for k, v in settings.items()
                                        if k in fields and v is not None}),
      warmup=warmup_stages(warmup, steps_per_epoch), sparsify=sparsify or _ndim_above_one,
      **{k: v for k, v in settings.items() if k not in fields})


# ----------------------------------------------------------------------------------- state, phases

class DGCState(NamedTuple):
  """State of ``dgc`` and ``coarse_dgc``.

  Attributes:
    count: steps taken (non-finite steps are not counted); it drives the warm-up schedule.
    u: momentum of each sparsified leaf, per device (``optax.MaskedNode`` at the other leaves).
    v: accumulated velocity of each sparsified leaf, per device (``optax.MaskedNode`` elsewhere).
    dense_u: momentum of each dense reduced leaf, applied after averaging, so identical on every
      device (``optax.MaskedNode`` elsewhere).
    config: the static settings.
    signature: the gradient pytree's structure, shapes, dtypes and paths.
  """
  count: jax.Array
  u: Any
  v: Any
  dense_u: Any
  config: DGCConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("u", "v")


def _last_index(exchange, numel: int) -> int:
  """The largest flat index the exchange of a leaf writes (the empty slots' filler, the last chunk's
  padding)."""
  if isinstance(exchange, TopKExchange):
    return numel
  return -(-numel // exchange.chunk_size) * exchange.chunk_size - 1


def _sparsified(config: DGCConfig, signature: tree_lib.TreeSignature) -> tuple:
  """Per reduced leaf: is it sparsified?

  Raises:
    ValueError: a sparsified leaf is too large for int32 indices.
  """
  flags = []
  for i, leaf in zip(signature.reduced, signature.reduced_structs()):
    path = signature.paths[i]
    flags.append(bool(config.sparsify(path, leaf)))
    if flags[-1] and _last_index(config.exchange, leaf.size) >= 2**31:
      raise ValueError(f"sparsify: leaf {path} has {leaf.size} elements; int32 indices address at "
                       "most 2**31 - 1: leave it to the dense mean (sparsify=...) or split it")
  return tuple(flags)


def init(config: DGCConfig, signature: tree_lib.TreeSignature) -> DGCState:
  """Zero momenta: ``u`` and ``v`` for the sparsified leaves, ``dense_u`` for the others."""
  sparse = _sparsified(config, signature)
  zeros = [jnp.zeros(leaf.shape, leaf.dtype) for leaf in signature.reduced_structs()]

  def where(kind: bool):
    return signature.place([z if s == kind else optax.MaskedNode() for z, s in zip(zeros, sparse)])

  return DGCState(jnp.zeros([], jnp.int32), where(True), where(True), where(False), config,
                  signature)


def phases(config: DGCConfig) -> tuple:
  """One phase per density: the warm-up's (share 0), then ``ratio`` (share 1)."""
  warm = dict.fromkeys(d for d in config.densities[:-1] if d != config.ratio)
  return (tuple(phases_lib.Phase(f"density={d:g}", 0.0, d) for d in warm)
          + (phases_lib.Phase(f"density={config.ratio:g}", 1.0, config.ratio),))


def phase_of(config: DGCConfig, count) -> jax.Array:
  """The phase of the step at ``count``: that of the warm-up stage ``count`` is in."""
  densities = [p.value for p in phases(config)]
  stage = sum((count >= end).astype(jnp.int32) for end, _ in config.warmup)
  return jnp.asarray([densities.index(d) for d in config.densities], jnp.int32)[stage]


# ----------------------------------------------------------------------------------------- selection

class SamplingPlan(NamedTuple):
  """Static sizes of one leaf's sampled-threshold selection (the reference's ``initialize``).

  Attributes:
    numel: elements in the leaf.
    k: coordinates sent at most, ceil(numel·density).
    num_samples: magnitudes sampled for the threshold estimate.
    top_k_samples: the threshold is the smallest of the top ceil(num_samples·density) samples.
    stride: samples are taken every ``stride`` elements from a random offset in [0, stride).
  """
  numel: int
  k: int
  num_samples: int
  top_k_samples: int
  stride: int


def sampling_plan(numel: int, density: float, sample_ratio: float = 0.01) -> SamplingPlan:
  """The reference's sample sizes: ~``sample_ratio`` of the leaf, and at least 2/density samples."""
  cpr_numel = math.ceil(2 / density)
  if sample_ratio >= 1.0 or numel <= cpr_numel:
    stride, num_samples = 1, numel
  else:
    wanted = max(math.ceil(numel * sample_ratio), cpr_numel)
    stride = math.ceil(numel / wanted / 32) * 32 + 1
    num_samples = numel // stride
    while num_samples < wanted:  # ends at stride 1 at the latest
      stride -= 8
      num_samples = numel // stride
  return SamplingPlan(numel, math.ceil(numel * density), num_samples,
                      math.ceil(num_samples * density), stride)


def exact_topk(x: jax.Array, k: int) -> jax.Array:
  """The int32 indices of the k entries of largest magnitude of the 1-D ``x`` (``lax.top_k``)."""
  return lax.top_k(jnp.abs(x), k)[1].astype(jnp.int32)


def sampled_topk(x: jax.Array, plan: SamplingPlan, key: jax.Array, *, upper_bound: float = 1.3,
                 lower_bound: float = 0.8, max_adaptation_iters: int = 10) -> tuple:
  """At most k coordinates of the 1-D ``x`` whose magnitude reaches a threshold estimated by sampling.

  The reference's ``_sparsify``, with static shapes: the threshold is the smallest of the top
  ``plan.top_k_samples`` strided sample magnitudes; while fewer than ``lower_bound·k`` entries reach
  it, it is multiplied by ``lower_bound`` (at most ``max_adaptation_iters`` times); if then more than
  ``upper_bound·k`` reach it, the exact top k among them are taken, otherwise the first k (in index
  order) of those reaching it. Without sampling (``num_samples == numel``) the threshold is exact.

  Args:
    x: the values, 1-D, ``plan.numel`` long; selection is by ``|x|``.
    plan: from ``sampling_plan``.
    key: PRNG key for the sampling offset.
    upper_bound, lower_bound, max_adaptation_iters: the reference's adaptation constants.

  Returns:
    ``(indices, threshold)``: int32 indices of shape ``(k,)``, every one of them with
    ``|x| >= threshold``; slots left empty hold ``numel`` (out of range: scatters drop them).
  """
  n, k = plan.numel, plan.k
  if plan.num_samples == n:
    samples = jnp.abs(x)
  else:  # x[start::stride] has num_samples or num_samples + 1 entries; a missing last one is -1
    start = jax.random.randint(key, (), 0, plan.stride)
    where = start + plan.stride * jnp.arange(plan.num_samples + 1)
    samples = jnp.where(where < n, jnp.abs(x.at[where].get(mode="clip")), -1)
  threshold = kernels.kth_largest(samples, plan.top_k_samples)
  counts, iters = kernels.count_at_least(x, threshold), jnp.int32(0)
  if plan.num_samples < n:  # adaptation: lower the threshold while too few reach it

    def too_few(carry):
      _, counts, iters = carry
      return (iters < max_adaptation_iters) & (counts.sum() < lower_bound * k)

    def lower(carry):
      threshold, _, iters = carry
      return threshold * lower_bound, kernels.count_at_least(x, threshold * lower_bound), iters + 1

    threshold, counts, iters = kernels.while_loop_if_needed(too_few, lower,
                                                            (threshold, counts, iters))
  total = counts.sum()
  capacity = min(_CANDIDATES * k, n)
  candidates, magnitudes = kernels.first_at_least(x, threshold, counts, capacity)

  def top_k_of_candidates():
    return lax.cond(total > capacity, lambda: exact_topk(x, k),
                    lambda: candidates[lax.top_k(magnitudes, k)[1]])

  # The reference counts again only if the loop stopped before its last iteration.
  resample = (total > upper_bound * k) & (iters < max_adaptation_iters)
  return lax.cond(resample, top_k_of_candidates, lambda: candidates[:k]), threshold


# -------------------------------------------------------------------------------------------- step

def _clipped(config: DGCConfig, leaves: list, axis_name) -> list:
  """1: local gradient clipping (paper §3.3), before accumulation, threshold scaled by W^exponent."""
  if config.clip_norm is None:
    return leaves
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))
  world = jnp.asarray(axis.axis_size(axis_name), jnp.float32)
  limit = config.clip_norm * world ** jnp.asarray(config.clip_exponent, jnp.float32)
  scale = jnp.minimum(1.0, limit / (norm + 1e-6))
  return [(g * scale).astype(g.dtype) for g in leaves]


def _momentum(config: DGCConfig, u, g) -> tuple:
  """2: momentum, in ``u``'s dtype; returns the new ``u`` and what is added to ``v``."""
  m, g = jnp.asarray(config.momentum, u.dtype), g.astype(u.dtype)
  if config.nesterov:
    u = m * (u + g)
    return u, u + g
  u = m * u + g
  return u, u


def _sends_dense(exchange, numel: int, density: float, world: int, value_bytes: int) -> bool:
  """Whether the sparse exchange of a leaf sends at least the bytes of its dense all-reduce."""
  if isinstance(exchange, TopKExchange):
    sparse = world * math.ceil(numel * density) * (value_bytes + _INDEX_BYTES)
  else:  # the chunks' norms, then the chosen chunks: independent of W
    num_chunks = -(-numel // exchange.chunk_size)
    sparse = num_chunks * 4 + math.ceil(num_chunks * density) * exchange.chunk_size * value_bytes
  return sparse >= numel * value_bytes


def _topk_exchange(config: DGCConfig, vs: list, density: float, keys: list, wire_dtypes: list,
                   axis_name) -> list:
  """3–4 for ``dgc``: one all-gather of values (per dtype) and one of indices for all leaves.

  Returns:
    Per leaf ``(mean, sent indices, sent values)``.
  """
  exchange, flats = config.exchange, [v.ravel() for v in vs]
  if exchange.selection == "exact":  # 3
    mine = [exact_topk(flat, math.ceil(flat.size * density)) for flat in flats]
  else:
    mine = [sampled_topk(flat, sampling_plan(flat.size, density, exchange.sample_ratio), key,
                         upper_bound=exchange.upper_bound, lower_bound=exchange.lower_bound,
                         max_adaptation_iters=exchange.max_adaptation_iters)[0]
            for flat, key in zip(flats, keys)]
  sent = [flat.at[i].get(mode="fill", fill_value=0) for flat, i in zip(flats, mine)]
  values = axis.all_gather_many([x.astype(d) for x, d in zip(sent, wire_dtypes)], axis_name)  # 4
  indices = axis.all_gather_many(mine, axis_name)
  # The W·k values are divided by W before they are added (duplicates sum): no pass over the
  # whole output afterwards. The zeros they are added to are the same on every device.
  means = [kernels.scatter_add(v.shape, i.ravel(),
                               axis.divide_by_world(x.ravel().astype(v.dtype), axis_name))
           for v, i, x in zip(vs, indices, values)]
  return list(zip(means, mine, sent))


def _chunk_exchange(config: DGCConfig, vs: list, density: float, keys: list, wire_dtypes: list,
                    axis_name) -> list:
  """3–4 for ``coarse_dgc``: one all-reduce of chunk norms and one of the chosen chunks for all
  leaves; returns per leaf ``(mean, sent indices, sent values)``."""
  del keys
  size = config.exchange.chunk_size

  def norms(v):
    flat = jnp.pad(v.ravel(), (0, -v.size % size))
    return jnp.abs(flat.reshape(-1, size)).sum(1, dtype=jnp.float32)

  summed = axis.psum_many([norms(v) for v in vs], axis_name)  # 3: the same chunks everywhere
  chosen = [lax.top_k(n, math.ceil(n.size * density))[1] for n in summed]
  coords = [(c[:, None] * size + jnp.arange(size, dtype=jnp.int32)).ravel() for c in chosen]
  sent = [v.ravel().at[i].get(mode="fill", fill_value=0) for v, i in zip(vs, coords)]
  means = axis.mean_many([x.astype(d) for x, d in zip(sent, wire_dtypes)], axis_name)  # 4
  return [(kernels.scatter_add(v.shape, i, mean.astype(v.dtype)), i, x)
          for v, i, mean, x in zip(vs, coords, means, sent)]


def _sampling_key(config: DGCConfig, count, path: str) -> jax.Array:
  """The sampling key of a leaf at a step: from the seed, the step and the leaf's path, so that a
  leaf draws alike whole, in a bucket and in ``dgc_hook``."""
  seed = getattr(config.exchange, "seed", 0)
  step_key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
  return jax.random.fold_in(step_key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def step(config: DGCConfig, state: DGCState, leaves: list, axis_name, phase) -> tuple:
  """One DGC step at ``phase.value``'s density on the reduced leaves: ``(means, new state)``."""
  signature = state.signature
  sparse = _sparsified(config, signature)
  paths = [signature.paths[i] for i in signature.reduced]
  world = axis.axis_size(axis_name)
  leaves = _clipped(config, leaves, axis_name)  # 1
  us, vs, dense_us = (signature.pick(t) for t in (state.u, state.v, state.dense_u))
  means, exchanged = list(leaves), []
  for i, g in enumerate(leaves):
    wire = g.dtype if config.value_dtype is None else config.value_dtype
    if not sparse[i]:  # the mean, then momentum (the reference's compensate(accumulate=False))
      dense_us[i], means[i] = _momentum(config, dense_us[i], axis.mean(g, axis_name, wire))
      continue
    us[i], added = _momentum(config, us[i], g)  # 2
    vs[i] = vs[i] + added
    if _sends_dense(config.exchange, g.size, phase.value, world, np.dtype(wire).itemsize):
      means[i], vs[i] = axis.mean(vs[i], axis_name, wire), jnp.zeros_like(vs[i])
    else:
      exchanged.append(i)
  exchange = _topk_exchange if isinstance(config.exchange, TopKExchange) else _chunk_exchange
  results = exchange(  # 3, 4
      config, [vs[i] for i in exchanged], phase.value,
      [_sampling_key(config, state.count, paths[i]) for i in exchanged],
      [leaves[i].dtype if config.value_dtype is None else config.value_dtype for i in exchanged],
      axis_name)
  for i, (mean, sent_indices, sent_values) in zip(exchanged, results):
    means[i] = mean
    vs[i] = kernels.subtract_at(vs[i], sent_indices, sent_values)  # 5
    if config.momentum_masking:
      us[i] = kernels.zero_at(us[i], sent_indices)
  new_state = state._replace(u=signature.place(us), v=signature.place(vs),
                             dense_u=signature.place(dense_us))
  return [m.astype(g.dtype) for m, g in zip(means, leaves)], new_state


def _unbucketable(config: DGCConfig) -> Optional[str]:
  if config.clip_norm is not None:
    return ("local clipping (clip_norm) needs the whole gradient's norm, which a bucket does not "
            "see: clip without buckets (jaxcomp.dgc(..., clip_norm=...), no bucket_cap_mb), or "
            "drop clip_norm")
  return None


def _check_arrays(**traceable) -> None:
  """Checks the traceable settings given as concrete arrays as their numbers would be (a tracer
  cannot be). Workaround: ``compressor.configure`` hands them to the step unchecked."""
  DGCConfig(**{name: value for name, value in traceable.items() if validate.is_array(value)})


_TRACEABLE = ("momentum", "clip_norm", "clip_exponent")
DGC = compressor.Algorithm("dgc", DGCState, functools.partial(_configure, TopKExchange), init,
                           step, phases, phase_of, traceable=_TRACEABLE,
                           unbucketable=_unbucketable)
COARSE_DGC = dataclasses.replace(DGC, name="coarse_dgc",
                                 configure=functools.partial(_configure, ChunkExchange))


# ---------------------------------------------------------------------------------- public functions

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

  Args:
    ratio: density after warm-up; each sparsified leaf sends k = ceil(numel·ratio) coordinates.
      Static: it fixes k (under ``optax.inject_hyperparams`` list it in ``static_args``).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    momentum, nesterov, momentum_masking, clip_norm, clip_exponent, value_dtype: see ``DGCConfig``.
      ``momentum``, ``clip_norm`` and ``clip_exponent`` may be arrays, traced or not (schedules
      through ``optax.inject_hyperparams``).
    warmup: None; ``"paper"`` (densities ``PAPER_WARMUP`` = 0.25, 0.0625, 0.015625, 0.004, one epoch
      of ``steps_per_epoch`` steps each, then ``ratio``); or a sequence of ``(end_step, density)``
      with increasing ``end_step`` — density applies while ``count < end_step`` — then ``ratio``.
      ``jaxcomp.comm_report`` reports each stage as a phase, ``"dgc.density=0.25"``.
    steps_per_epoch: steps per epoch, for ``warmup="paper"``.
    sparsify: ``sparsify(path, leaf) -> bool``; default ``leaf.ndim > 1`` (see ``DGCConfig``).
    selection, sample_ratio, upper_bound, lower_bound, max_adaptation_iters, seed: the top-k
      selection, see ``TopKExchange``; None: its defaults (0.01, 1.3, 0.8, 10, 0), so that
      ``optax.inject_hyperparams`` leaves them static.
    bucket_cap_mb: None: each collective holds every leaf. A size in MiB: DDP's buckets, each sending
      its own collectives as soon as its gradients exist (for overlap with the backward pass; XLA may
      still combine them, as XLA:CPU always does); the state is then a ``CommHookState`` of one
      ``DGCState`` per bucket. Not with ``clip_norm``.

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018, §3 (momentum correction, local gradient
    clipping, momentum factor masking, warm-up training); reference ``DGCCompressor``.
  """
  _check_arrays(momentum=momentum, clip_norm=clip_norm, clip_exponent=clip_exponent)
  return compressor.transformation(
      DGC, axis_name, bucket_cap_mb, ratio=ratio, momentum=momentum, nesterov=nesterov,
      momentum_masking=momentum_masking, clip_norm=clip_norm, clip_exponent=clip_exponent,
      warmup=warmup, steps_per_epoch=steps_per_epoch, value_dtype=value_dtype, sparsify=sparsify,
      selection=selection, sample_ratio=sample_ratio, upper_bound=upper_bound,
      lower_bound=lower_bound, max_adaptation_iters=max_adaptation_iters, seed=seed)


def coarse_dgc(ratio: float = 0.01, *, axis_name: axis.AxisName = "batch",
               chunk_size: Optional[int] = None, momentum: float = 0.9, nesterov: bool = False,
               momentum_masking: bool = True, clip_norm: Optional[float] = None,
               clip_exponent: float = -0.5, warmup: Union[None, str, Sequence] = None,
               steps_per_epoch: Optional[int] = None, value_dtype=None,
               sparsify: Optional[Callable] = None,
               bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """Coarse-grained DGC: every device sends the same top chunks, so traffic does not grow with W.

  Each sparsified leaf's momentum-corrected ``v`` is cut into chunks of ``chunk_size`` elements (the
  last zero-padded); the per-chunk L1 norms are all-reduced, every device takes the same
  ceil(chunks·ratio) chunks of largest summed norm, and only those are averaged (all-reduce), with the
  same momentum correction, masking, clipping and warm-up as ``dgc``::

    tx = optax.chain(jaxcomp.coarse_dgc(0.01, chunk_size=256), optax.sgd(0.1))

  Args:
    ratio: fraction of chunks sent after warm-up (``ratio`` counts chunks here, not coordinates).
    axis_name: the mapped axis to average over.
    chunk_size: elements per chunk; None: 256 (static: it fixes the chunks' shape).
    momentum, nesterov, momentum_masking, clip_norm, clip_exponent, warmup, steps_per_epoch,
      value_dtype, sparsify, bucket_cap_mb: as in ``dgc`` (a stage falls back to the dense mean when
      norms plus chunks would send at least the leaf's size).

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Sun et al., "Optimizing Network Performance for Distributed DNN Training on GPU Clusters:
    ImageNet/AlexNet Training in 1.5 Minutes", 2019 (coarse-grained sparse communication); Lin et
    al., "Deep Gradient Compression", ICLR 2018 (momentum correction, clipping, warm-up).
  """
  _check_arrays(momentum=momentum, clip_norm=clip_norm, clip_exponent=clip_exponent)
  return compressor.transformation(
      COARSE_DGC, axis_name, bucket_cap_mb, ratio=ratio, chunk_size=chunk_size, momentum=momentum,
      nesterov=nesterov, momentum_masking=momentum_masking, clip_norm=clip_norm,
      clip_exponent=clip_exponent, warmup=warmup, steps_per_epoch=steps_per_epoch,
      value_dtype=value_dtype, sparsify=sparsify)
