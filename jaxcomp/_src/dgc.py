"""Deep Gradient Compression: momentum-corrected top-k sparsification, and its coarse-grained variant.

Both transformations sit first in ``optax.chain`` and carry the momentum themselves, as the reference
``DGCSGD`` does, so the optimizer after them has none; weight decay goes before them so that it is local::

    tx = optax.chain(optax.add_decayed_weights(1e-4), jaxcomp.dgc(0.001), optax.sgd(lr))

The steps, per step and per device, for every leaf the ``sparsify`` predicate picks (default:
``ndim > 1``); the ``# n:`` comments below point here:

1. local gradient clipping of the whole gradient to ``clip_norm · W^clip_exponent`` (optional);
2. momentum correction: ``u ← m·u + g; v ← v + u`` (Nesterov: ``u ← m·(u + g); v ← v + u + g``);
3. selection of at most k = ceil(numel·density) coordinates of ``|v|``;
4. exchange: ``dgc`` all-gathers k values and k int32 indices from every device and scatter-adds them
   (duplicates sum), then multiplies by 1/W; ``coarse_dgc`` all-reduces per-chunk L1 norms, every device
   takes the same top chunks, and only those chunks are averaged — its traffic does not grow with W;
5. ``v ← 0`` at the sent coordinates, and ``u ← 0`` there too with momentum factor masking.

The other reduced leaves take the dense mean, and momentum is applied after averaging
(``u ← m·u + mean(g)``, output ``u``). Integer, boolean and zero-size leaves pass through untouched.

Warm-up compiles a step-based density schedule into one program (``lax.switch`` over stages, each with
static k). A stage whose sparse exchange would send at least as many bytes as the dense all-reduce of the
leaf (for ``dgc``: ``W·k·(value bytes + 4) ≥ numel·value bytes``, i.e. ``W·density·2 ≥ 1`` for f32
values) sends the leaf's whole ``v`` as a dense mean instead. Every device sends all it holds then, no
coordinate is delayed, and so nothing is masked: a dense stage is exact momentum SGD on the mean gradient.

State: ``u`` and ``v`` (of the sparsified leaves) differ from device to device; ``dense_u`` (the dense
leaves' momentum) and ``count`` are the same everywhere. Map the state with ``in_axes=0`` under ``pmap``;
under ``shard_map`` take its specs from ``jaxcomp.state_partition_specs`` (``u`` and ``v`` are its
``PER_DEVICE_FIELDS``). The output is identical on every device. On a step whose gradient is non-finite
on any device the state is kept and the output is NaN (jaxcomp's non-finite policy).

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
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._src import axis, finite, validate
from jaxcomp._src import tree as tree_lib
from jaxcomp._src.buckets import GradBucket, bucket_assignment

PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
"""The paper's warm-up densities, one per epoch, before the final ``ratio`` (0.001 in the paper)."""

_BLOCK = 32  # candidates are compacted block by block: XLA:CPU's cumsum over 10M elements is slow
_CANDIDATE_FACTOR = 2  # the candidate buffer holds 2·k coordinates; more fall back to exact top-k
_INDEX_BYTES = 4  # int32 indices on the wire
_VALUE_DTYPES = (None, "float32", "float16", "bfloat16")
_DENSITY_IS_STATIC = "fixes k, the number of coordinates sent; schedule the density with warmup=..."
_MIB = 1024 * 1024



class _Traced:
  """The type of ``TRACED``."""

  def __repr__(self) -> str:
    return "TRACED"


TRACED = _Traced()
"""``DGCConfig``'s value of a ``Traceable`` hyperparameter given as an array (``optax.inject_hyperparams``):
the transformation holds the array and hands it to each step; the static config records only this."""


class DGCState(NamedTuple):
  """State of ``dgc`` and ``coarse_dgc``.

  Attributes:
    count: steps taken (non-finite steps are not counted); it drives the warm-up schedule.
    u: momentum of each sparsified leaf, per device (``optax.MaskedNode`` at the other leaves).
    v: accumulated velocity of each sparsified leaf, per device (``optax.MaskedNode`` elsewhere).
    dense_u: momentum of each dense reduced leaf, applied after averaging, so identical on every
      device (``optax.MaskedNode`` elsewhere).
    signature: the gradient pytree's structure, shapes and dtypes.
    config: the static settings (so that ``jaxcomp.hooks.dgc_hook(state, bucket)`` finds them).
  """
  count: jax.Array
  u: Any
  v: Any
  dense_u: Any
  signature: tree_lib.TreeSignature
  config: "DGCConfig"

  PER_DEVICE_FIELDS = ("u", "v")


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

  No full-size array is written: counts are taken per block of 32 elements straight from ``x``, and
  only the blocks holding candidates are gathered and compacted (XLA:CPU's cumsum over millions of
  elements costs more than ``lax.top_k``).

  Args:
    x: the values, 1-D, ``plan.numel`` long; selection is by ``|x|``.
    plan: from ``sampling_plan``.
    key: PRNG key for the sampling offset.
    upper_bound, lower_bound, max_adaptation_iters: the reference's adaptation constants.

  Returns:
    ``(indices, threshold)``: int32 indices of shape ``(k,)``, every one of them with
    ``|x| >= threshold``; slots left empty hold ``numel`` (out of range, so a scatter with
    ``mode="drop"`` ignores them).
  """
  n, k = plan.numel, plan.k
  capacity = min(_CANDIDATE_FACTOR * k, n)
  num_blocks = -(-n // _BLOCK)

  def block_counts(threshold):
    # NaN padding never reaches a threshold. The barrier keeps XLA:CPU from writing the full-size
    # comparison out before summing it (it does when the counts have several users).
    padded = jnp.pad(x, (0, num_blocks * _BLOCK - n), constant_values=jnp.nan)
    return lax.optimization_barrier(
        (jnp.abs(padded.reshape(num_blocks, _BLOCK)) >= threshold).sum(1, dtype=jnp.int32))

  # Threshold estimate from strided samples at a random offset.
  if plan.num_samples == n:
    samples = jnp.abs(x)
  else:
    # x[start::stride] has num_samples or num_samples + 1 entries; a missing last one counts as -1.
    start = jax.random.randint(key, (), 0, plan.stride)
    where = start + plan.stride * jnp.arange(plan.num_samples + 1)
    samples = jnp.where(where < n, jnp.abs(x.at[where].get(mode="clip")), -1)
  # Via the indices: XLA:CPU rewrites a top_k whose values alone are used into a full sort.
  threshold = samples[lax.top_k(samples, plan.top_k_samples)[1]].min()
  counts = block_counts(threshold)
  iters = jnp.int32(0)
  if plan.num_samples < n:
    # Adaptation: lower the threshold while too few reach it.
    def too_few(carry):
      _, counts, iters = carry
      return (iters < max_adaptation_iters) & (counts.sum() < lower_bound * k)

    def lower(carry):
      threshold, _, iters = carry
      threshold = threshold * lower_bound
      return threshold, block_counts(threshold), iters + 1

    # Behind a cond: XLA hoists |x| out of the loop body, a full-size write only worth paying here.
    threshold, counts, iters = lax.cond(
        too_few((threshold, counts, iters)), lambda c: lax.while_loop(too_few, lower, c),
        lambda c: c, (threshold, counts, iters))
  total = counts.sum()
  # The reference checks the count again only if the loop stopped before its last iteration.
  resample = (total > upper_bound * k) & (iters < max_adaptation_iters)

  # Compact the first `capacity` candidates, in index order, from the blocks that hold them.
  rows = jnp.nonzero(counts > 0, size=capacity, fill_value=num_blocks)[0]
  row_counts = counts.at[rows].get(mode="fill", fill_value=0)
  row_start = jnp.cumsum(row_counts) - row_counts
  positions = rows[:, None] * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)
  magnitudes = jnp.abs(x.at[positions].get(mode="fill", fill_value=jnp.nan))
  hit = magnitudes >= threshold
  slot = jnp.where(hit, row_start[:, None] + jnp.cumsum(hit, axis=1, dtype=jnp.int32) - 1, capacity)
  candidates = jnp.full((capacity,), n, jnp.int32).at[slot].set(positions, mode="drop")
  candidate_magnitudes = jnp.full((capacity,), -1, x.dtype).at[slot].set(magnitudes, mode="drop")

  def top_k_of_candidates():  # capacity >= k
    return lax.cond(total > capacity, lambda: exact_topk(x, k),
                    lambda: candidates[lax.top_k(candidate_magnitudes, k)[1]])

  indices = lax.cond(resample, top_k_of_candidates, lambda: candidates[:k])
  return indices, threshold


# ------------------------------------------------------------------------------------- configuration

class Traceable(NamedTuple):
  """The hyperparameters a step may receive as (traced) arrays, e.g. from ``optax.inject_hyperparams``.

  They fix no shape, so they need not be static; ``DGCConfig`` holds ``TRACED`` in their place and the
  transformation hands the arrays to each step.
  """
  momentum: Any
  clip_norm: Any
  clip_exponent: Any


_TRACEABLE_CHECKS = {
    "momentum": lambda v: validate.number(v, "momentum", 0, 1, high_open=True),
    "clip_norm": lambda v: None if v is None else validate.number(v, "clip_norm", 0, low_open=True),
    "clip_exponent": lambda v: validate.number(v, "clip_exponent"),
}


def split_traced(**values) -> tuple:
  """``(settings, traced)``: the ``Traceable`` hyperparameters given as arrays become ``TRACED`` in
  the settings and go to ``traced``; a concrete array is checked as its number would be (a tracer
  cannot be: it is checked where it was concrete, at ``init``)."""
  settings, traced = {}, {}
  for name, value in values.items():
    if not isinstance(value, (jax.Array, np.ndarray)):
      settings[name] = value
      continue
    if np.ndim(value) != 0:
      raise ValueError(f"{name} must be a scalar; got an array of shape {np.shape(value)}")
    if not isinstance(value, jax.core.Tracer):
      _TRACEABLE_CHECKS[name](float(value))
    settings[name], traced[name] = TRACED, value
  return settings, traced



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
    seed: seeds the sampling offsets (a function of ``seed``, the step and the leaf).
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


def _default_sparsify(path: str, leaf) -> bool:
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
      ``momentum``, ``clip_norm`` and ``clip_exponent`` may be ``TRACED`` (see ``Traceable``).
    value_dtype: wire dtype of the values and of the dense means: None (the gradient's), float32,
      float16 or bfloat16. Indices are int32.
    sparsify: ``sparsify(path, leaf) -> bool`` with the leaf as a ``jax.ShapeDtypeStruct``: which
      reduced leaves are sparsified; default ``leaf.ndim > 1`` (biases and norm scales are small).
  """
  ratio: float = 0.001
  exchange: Union[TopKExchange, ChunkExchange] = TopKExchange()
  momentum: float = 0.9
  nesterov: bool = False
  momentum_masking: bool = True
  warmup: tuple = ()
  clip_norm: Optional[float] = None
  clip_exponent: float = -0.5
  value_dtype: Any = None
  sparsify: Callable = _default_sparsify

  def __post_init__(self):
    if not isinstance(self.exchange, (TopKExchange, ChunkExchange)):
      raise TypeError(f"exchange must be a TopKExchange or a ChunkExchange; got {self.exchange!r}")
    traceable = {name: value if value is TRACED else _TRACEABLE_CHECKS[name](value)
                 for name, value in ((n, getattr(self, n)) for n in Traceable._fields)}
    if validate.boolean(self.nesterov, "nesterov") and traceable["momentum"] == 0:
      raise ValueError("nesterov=True needs a momentum > 0; got momentum=0")
    value_dtype = None if self.value_dtype is None else _dtype_name(self.value_dtype)
    if value_dtype not in _VALUE_DTYPES:
      raise ValueError(f"value_dtype must be None, float32, float16 or bfloat16; got "
                       f"{self.value_dtype!r}")
    _set(self, ratio=validate.density(self.ratio, "ratio", static=_DENSITY_IS_STATIC),
         momentum_masking=validate.boolean(self.momentum_masking, "momentum_masking"),
         warmup=_checked_stages(self.warmup),
         value_dtype=None if value_dtype is None else jnp.dtype(value_dtype),
         sparsify=validate.function(self.sparsify, "sparsify", "sparsify(path, leaf) -> bool"),
         **traceable)

  @property
  def densities(self) -> tuple:
    """The density of each stage: the warm-up's, then ``ratio``."""
    return tuple(d for _, d in self.warmup) + (self.ratio,)


def _dtype_name(dtype) -> Optional[str]:
  try:
    return np.dtype(dtype).name
  except TypeError:
    return repr(dtype)


def _checked_stages(stages) -> tuple:
  try:
    pairs = [(b, d) for b, d in stages]
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
  return tuple((int(b), float(d)) for b, d in pairs)


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


# -------------------------------------------------------------------------------------------- steps

def _leaf_kinds(config: DGCConfig, paths, shapes, dtypes) -> list:
  """Per leaf: "skip" (not reduced), "dense" or "sparse"."""
  kinds = []
  for path, shape, dtype in zip(paths, shapes, dtypes):
    leaf = jax.ShapeDtypeStruct(shape, dtype)
    if not tree_lib.is_reduced(leaf):
      kinds.append("skip")
    elif config.sparsify(path, leaf):
      if math.prod(shape) >= 2**31:
        raise ValueError(f"sparsify: leaf {path} has {math.prod(shape)} elements; int32 indices "
                         "address at most 2**31 - 1")
      kinds.append("sparse")
    else:
      kinds.append("dense")
  return kinds


def init_leaves(config: DGCConfig, leaves: Sequence, paths: Sequence) -> tuple:
  """Zero ``(u, v, dense_u)`` lists for the leaves."""
  kinds = _leaf_kinds(config, paths, [tree_lib.shape_of(x) for x in leaves],
                      [tree_lib.dtype_of(x) for x in leaves])

  def zeros_where(kind):
    return [jnp.zeros(tree_lib.shape_of(x), tree_lib.dtype_of(x)) if k == kind
            else optax.MaskedNode() for k, x in zip(kinds, leaves)]

  sparse = zeros_where("sparse")
  return sparse, list(sparse), zeros_where("dense")


def _wire_dtype(config: DGCConfig, g):
  """The dtype ``g``'s values travel in."""
  return g.dtype if config.value_dtype is None else config.value_dtype


def _traceable(config: DGCConfig, traced: dict) -> Traceable:
  """The step's values: the config's, or where it says ``TRACED``, the arrays in ``traced``."""
  return Traceable(*(traced[name] if getattr(config, name) is TRACED else getattr(config, name)
                     for name in Traceable._fields))


def _momentum_step(config: DGCConfig, momentum, u, g) -> tuple:
  """2: momentum correction; returns the new ``u`` and what is added to ``v``."""
  momentum = jnp.asarray(momentum, u.dtype)
  if config.nesterov:
    u = momentum * (u + g)
    return u, u + g
  u = momentum * u + g
  return u, u


def _sparse_bytes(exchange, numel: int, density: float, world: int, value_bytes: int) -> int:
  """What the sparse exchange of one leaf sends."""
  if isinstance(exchange, TopKExchange):
    return world * math.ceil(numel * density) * (value_bytes + _INDEX_BYTES)
  num_chunks = -(-numel // exchange.chunk_size)  # coarse: norms and chunks, independent of W
  return num_chunks * 4 + math.ceil(num_chunks * density) * exchange.chunk_size * value_bytes


def _select(exchange: TopKExchange, flat, density: float, key):
  """3: the int32 indices this device sends."""
  if exchange.selection == "exact":
    return exact_topk(flat, math.ceil(flat.size * density))
  plan = sampling_plan(flat.size, density, exchange.sample_ratio)
  return sampled_topk(flat, plan, key, upper_bound=exchange.upper_bound,
                      lower_bound=exchange.lower_bound,
                      max_adaptation_iters=exchange.max_adaptation_iters)[0]


def _unless_finite(ok, indices, out_of_range: int):
  """The coordinates to clear, all out of range (so that nothing is cleared) on a non-finite step."""
  return indices if ok is None else jnp.where(ok, indices, out_of_range)


def _zeros(ok, like):
  """The zero base the exchanged coordinates are added to: NaN on a non-finite step, so that the
  whole output is NaN (the policy) without a gradient-sized select afterwards."""
  zeros = jnp.zeros_like(like)
  return zeros if ok is None else finite.nan_unless_finite(ok, zeros)


def _topk_exchange(exchange: TopKExchange, vs, density, keys, value_dtypes, ok, axis_name) -> list:
  """3–4 for ``dgc``: one all-gather of values (per value dtype) and one of indices for all leaves.

  Returns:
    Per leaf ``(mean, clear, clear_v)``: the averaged sparse gradient, and two functions that zero
    the coordinates this device sent (none on a non-finite step): ``clear`` for any array of the
    leaf's shape, ``clear_v`` for v (it subtracts the values sent).
  """
  flats = [v.ravel() for v in vs]
  indices = [_select(exchange, flat, density, key) for flat, key in zip(flats, keys)]
  sent_values = [flat.at[i].get(mode="fill", fill_value=0) for flat, i in zip(flats, indices)]
  values = [x.astype(d) for x, d in zip(sent_values, value_dtypes)]
  all_values = axis.all_gather_many(values, axis_name)
  all_indices = axis.all_gather_many(indices, axis_name)
  results = []
  for v, flat, mine, sent, gathered_values, gathered_indices in zip(
      vs, flats, indices, sent_values, all_values, all_indices):
    # The W·k values are divided by W before they are added (duplicates sum): no pass over the
    # whole output afterwards. Scatters address the leaf in its own shape: through a flat view XLA
    # would write a flat copy and reshape it, instead of updating the buffer in place.
    total = _zeros(ok, v).at[_unravel(gathered_indices.ravel(), v.shape)].add(
        axis.divide_by_world(gathered_values.ravel().astype(flat.dtype), axis_name), mode="drop")
    mine = _unravel(_unless_finite(ok, mine, flat.size), v.shape)

    def clear(x, mine=mine):
      return x.at[mine].set(0, mode="drop")

    def clear_sent(x, mine=mine, sent=sent):
      # x − x is +0.0, as set(0) gives; subtracting what was sent makes the scatter wait for the
      # gather of the sent values, so that XLA can clear v in place instead of copying it.
      return x.at[mine].add(-sent, mode="drop")

    results.append((total, clear, clear_sent))
  return results


def _unravel(indices, shape: tuple) -> tuple:
  """Flat int32 indices as one index array per dimension; ``prod(shape)`` (the out-of-range slot
  filler) stays out of range in the first dimension (``jnp.unravel_index`` would clip it)."""
  out, stride = [], math.prod(shape)
  for i, size in enumerate(shape):
    stride //= size
    out.append(indices // stride if i == 0 else (indices // stride) % size)
  return tuple(out)


def _chunk_exchange(exchange: ChunkExchange, vs, density, keys, value_dtypes, ok,
                    axis_name) -> list:
  """3–4 for ``coarse_dgc``: one all-reduce of norms and one of the chosen chunks for all leaves."""
  del keys
  size = exchange.chunk_size

  def as_chunks(x):
    num_chunks = -(-x.size // size)
    return jnp.pad(x.ravel(), (0, num_chunks * size - x.size)).reshape(num_chunks, size)

  chunked = [as_chunks(v) for v in vs]
  norms = axis.psum_many([jnp.abs(c).sum(1, dtype=jnp.float32) for c in chunked], axis_name)
  # The same chunks on every device: the top ceil(chunks·density) of the summed norms.
  chosen = [lax.top_k(n, math.ceil(n.size * density))[1] for n in norms]
  sent = axis.mean_many([c[i].astype(d) for c, i, d in zip(chunked, chosen, value_dtypes)],
                        axis_name)
  results = []
  for v, c, i, mean in zip(vs, chunked, chosen, sent):

    def from_chunks(x, v=v):
      return x.ravel()[:v.size].reshape(v.shape)

    def clear(x, i=_unless_finite(ok, i, c.shape[0]), from_chunks=from_chunks):
      return from_chunks(as_chunks(x).at[i].set(0, mode="drop"))

    results.append((from_chunks(_zeros(ok, c).at[i].set(mean.astype(c.dtype))), clear, clear))
  return results


def _sparse_stage(config: DGCConfig, momentum, density: float, leaves, us, vs, keys, ok,
                  axis_name) -> tuple:
  """Steps 2–5 over the sparsified leaves at one warm-up stage (static density)."""
  world = axis.axis_size(axis_name)
  outs, new_u, new_v, exchanged = [], [], [], []
  for i, (g, u, v) in enumerate(zip(leaves, us, vs)):
    # 2, one pass over g, u and v. On a non-finite step u and v are kept by the same pass. v's update
    # reads the (gated) new u: from the ungated m·u + g XLA would compute u's update twice, reading
    # the old u after the new one is written to its buffer (so it would copy u first).
    u_next, _ = _momentum_step(config, momentum, u, g)
    if ok is not None:
      u_next = finite.keep_if_finite(ok, u_next, u)
    v_next = v + (u_next + g if config.nesterov else u_next)
    if ok is not None:
      v_next = finite.keep_if_finite(ok, v_next, v)
    value_bytes = np.dtype(_wire_dtype(config, g)).itemsize
    if _sparse_bytes(config.exchange, g.size, density, world, value_bytes) >= g.size * value_bytes:
      # Dense stage: everything is sent, nothing delayed, so nothing to mask.
      mean = axis.mean(v_next, axis_name, config.value_dtype)
      outs.append(mean if ok is None else finite.nan_unless_finite(ok, mean))
      v_next = jnp.zeros_like(v) if ok is None else finite.keep_if_finite(ok, jnp.zeros_like(v),
                                                                           v)
    else:
      outs.append(None)
      exchanged.append(i)
    new_u.append(u_next)
    new_v.append(v_next)
  exchange_fn = _topk_exchange if isinstance(config.exchange, TopKExchange) else _chunk_exchange
  results = exchange_fn(  # 3, 4
      config.exchange, [new_v[i] for i in exchanged], density, [keys[i] for i in exchanged],
      [_wire_dtype(config, leaves[i]) for i in exchanged], ok, axis_name)
  for i, (out, clear, clear_v) in zip(exchanged, results):
    outs[i] = out
    new_v[i] = clear_v(new_v[i])  # 5: sent coordinates restart, momentum too with masking
    if config.momentum_masking:
      new_u[i] = clear(new_u[i])
  return outs, new_u, new_v


def step(config: DGCConfig, values: Traceable, count, leaves, paths, us, vs, dense_us, axis_name,
         ok=None, key_ids: Optional[Sequence] = None) -> tuple:
  """Steps 2–5 over lists of leaves: returns the outputs and the new ``u``, ``v``, ``dense_u``.

  With the all-device finiteness flag ``ok`` the non-finite policy is applied inside the step (u and v
  kept by the same pass that updates them, the clearing skipped, the outputs NaN); without it (None)
  nothing is gated. ``key_ids`` (one per leaf) number the sampling keys; default: the sparsified
  leaves in order.
  """
  kinds = _leaf_kinds(config, paths, [x.shape for x in leaves], [x.dtype for x in leaves])
  outs, us, vs, dense_us = list(leaves), list(us), list(vs), list(dense_us)
  for i, kind in enumerate(kinds):
    if kind == "dense":  # the mean, then momentum (the reference's compensate(accumulate=False))
      new_u, outs[i] = _momentum_step(config, values.momentum, dense_us[i],
                                      axis.mean(leaves[i], axis_name, config.value_dtype))
      if ok is not None:
        new_u, outs[i] = (finite.keep_if_finite(ok, new_u, dense_us[i]),
                          finite.nan_unless_finite(ok, outs[i]))
      dense_us[i] = new_u
  sparse = [i for i, kind in enumerate(kinds) if kind == "sparse"]
  if not sparse:
    return outs, us, vs, dense_us
  seed = config.exchange.seed if isinstance(config.exchange, TopKExchange) else 0
  step_key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
  operands = ([leaves[i] for i in sparse], [us[i] for i in sparse], [vs[i] for i in sparse],
              [jax.random.fold_in(step_key, j if key_ids is None else key_ids[i])
               for j, i in enumerate(sparse)], ok, values.momentum)
  branches = [lambda ops, d=d: _sparse_stage(config, ops[5], d, *ops[:5], axis_name)
              for d in config.densities]
  if len(branches) == 1:
    results = branches[0](operands)
  else:
    stage = sum((count >= end).astype(jnp.int32) for end, _ in config.warmup)
    results = lax.switch(stage, branches, operands)
  for j, i in enumerate(sparse):
    outs[i], us[i], vs[i] = results[0][j], results[1][j], results[2][j]
  return outs, us, vs, dense_us


def _clipped(values: Traceable, leaves: list, axis_name) -> list:
  """1: local gradient clipping (paper §3.3), before accumulation, threshold scaled by W^exponent."""
  if values.clip_norm is None:
    return leaves
  reduced = [g for g in leaves if tree_lib.is_reduced(g)]
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in reduced))
  limit = values.clip_norm * jnp.asarray(axis.axis_size(axis_name), jnp.float32) ** jnp.asarray(
      values.clip_exponent, jnp.float32)
  scale = jnp.minimum(1.0, limit / (norm + 1e-6))
  return [(g * scale).astype(g.dtype) if tree_lib.is_reduced(g) else g for g in leaves]


# ------------------------------------------------------------------------------ transformation, hook

def _transformation(config: DGCConfig, axis_name, traced: Optional[dict] = None,
                    bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """The optax transformation: clipping, the step, the non-finite policy.

  Args:
    config: the settings; ``TRACED`` where ``traced`` holds the value.
    axis_name: the mapped axis.
    traced: the arrays of the ``Traceable`` hyperparameters given as arrays.
    bucket_cap_mb: None, or DDP's bucket cap: one step, and so one set of collectives, per bucket.
  """
  axis_name = axis.check_axis_name(axis_name)
  values = _traceable(config, traced or {})
  if bucket_cap_mb is not None:
    cap = validate.number(bucket_cap_mb, "bucket_cap_mb", 0, low_open=True,
                          static="decides which leaves share a collective") * _MIB
    if values.clip_norm is not None:
      raise ValueError("bucket_cap_mb cannot be combined with clip_norm: local clipping needs the "
                       "whole gradient's norm before any bucket can be sent, so no collective could "
                       "start before the backward pass ends; drop one of them")

  def init_fn(params):
    signature = tree_lib.TreeSignature.of(params)
    leaves = jax.tree.leaves(tree_lib.unwrap(params))
    trees = [signature.unflatten(x) for x in init_leaves(config, leaves, signature.paths)]
    return DGCState(jnp.zeros([], jnp.int32), *trees, signature, config)

  def update_fn(updates, state: DGCState, params=None):
    del params
    tree_lib.check_state(state, init_fn, "dgc")
    leaves = state.signature.check(updates)
    treedef = state.signature.treedef
    ok = finite.all_finite(leaves, axis_name)
    clipped = _clipped(values, leaves, axis_name)
    trees = [treedef.flatten_up_to(t) for t in (state.u, state.v, state.dense_u)]
    paths = state.signature.paths
    if bucket_cap_mb is None:  # the policy inside the step: u and v are updated in place
      outs, *trees = step(config, values, state.count, clipped, paths, *trees, axis_name, ok)
    else:  # per bucket, each independent of the flag (it needs the whole gradient); policy after
      outs = list(clipped)
      kinds = _leaf_kinds(config, paths, state.signature.shapes, state.signature.dtypes)
      key_ids = {i: j for j, i in enumerate(i for i, k in enumerate(kinds) if k == "sparse")}
      for bucket in bucket_assignment(state.signature, cap, cap):
        pick = lambda xs, bucket=bucket: [xs[i] for i in bucket]  # noqa: E731
        results = step(config, values, state.count, pick(clipped), pick(paths),
                       *map(pick, trees), axis_name, key_ids=[key_ids.get(i) for i in bucket])
        for collected, result in zip([outs] + trees, results):
          for i, value in zip(bucket, result):
            collected[i] = value
    new_state = DGCState(state.count + 1, *(state.signature.unflatten(t) for t in trees),
                         state.signature, config)
    if bucket_cap_mb is None:
      new_state = new_state._replace(count=finite.keep_if_finite(ok, new_state.count, state.count))
    else:
      outs, new_state = finite.gated(ok, outs, new_state, state)
    return tree_lib.like(updates, outs), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def init_bucket_state(config: DGCConfig, bucket: GradBucket) -> DGCState:
  """The zero ``DGCState`` of one ``comm_hook`` bucket; see ``jaxcomp.hooks.dgc_state``."""
  grads = bucket.gradients()
  return DGCState(jnp.zeros([], jnp.int32), *map(tuple, init_leaves(config, grads, bucket.paths)),
                  tree_lib.TreeSignature.of(grads), config)


def update_bucket(state: DGCState, bucket: GradBucket) -> tuple:
  """One DGC step on a bucket's parameters: ``(reduced buffer, new state)``; see ``dgc_hook``."""
  grads = state.signature.check(bucket.gradients(), "bucket", dtypes=False)
  outs, u, v, dense_u = step(state.config, _traceable(state.config, {}), state.count, grads,
                             bucket.paths, state.u, state.v, state.dense_u, bucket.axis_name)
  return (tree_lib.flatten(outs),
          state._replace(count=state.count + 1, u=tuple(u), v=tuple(v), dense_u=tuple(dense_u)))


# ---------------------------------------------------------------------------------- public functions

def topk_config(ratio: float = 0.001, *, warmup: Union[None, str, Sequence] = None,
                steps_per_epoch: Optional[int] = None, sparsify: Optional[Callable] = None,
                **options) -> DGCConfig:
  """The ``DGCConfig`` of ``dgc(ratio, **options)`` (without ``axis_name``): ``TopKExchange``'s
  fields go to the exchange (None: its default), the rest to the config. Shared with
  ``jaxcomp.hooks.dgc_state``."""
  exchange_fields = {f.name for f in dataclasses.fields(TopKExchange)}
  exchange = TopKExchange(**{k: v for k, v in options.items()
                             if k in exchange_fields and v is not None})
  return DGCConfig(ratio=ratio, exchange=exchange, warmup=warmup_stages(warmup, steps_per_epoch),
                   sparsify=sparsify or _default_sparsify,
                   **{k: v for k, v in options.items() if k not in exchange_fields})


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
    steps_per_epoch: steps per epoch, for ``warmup="paper"``.
    sparsify: ``sparsify(path, leaf) -> bool``; default ``leaf.ndim > 1`` (see ``DGCConfig``).
    selection, sample_ratio, upper_bound, lower_bound, max_adaptation_iters, seed: the top-k
      selection, see ``TopKExchange``; None: its defaults (0.01, 1.3, 0.8, 10, 0), so that
      ``optax.inject_hyperparams`` leaves them static.
    bucket_cap_mb: None: each collective holds every leaf. A size in MiB: DDP's buckets, each sending
      its own collectives as soon as its gradients exist (for overlap with the backward pass; XLA may
      still combine them, as XLA:CPU always does, unless each exceeds its combine threshold). It keeps
      the old u and v until the end of the step (two gradients more memory); not with clip_norm.

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018, §3 (momentum correction, local gradient
    clipping, momentum factor masking, warm-up training); reference ``DGCCompressor``.
  """
  settings, traced = split_traced(momentum=momentum, clip_norm=clip_norm,
                                  clip_exponent=clip_exponent)
  return _transformation(topk_config(
      ratio, nesterov=nesterov, momentum_masking=momentum_masking, warmup=warmup,
      steps_per_epoch=steps_per_epoch, value_dtype=value_dtype, sparsify=sparsify,
      selection=selection, sample_ratio=sample_ratio, upper_bound=upper_bound,
      lower_bound=lower_bound, max_adaptation_iters=max_adaptation_iters, seed=seed, **settings),
      axis_name, traced, bucket_cap_mb)


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
  same momentum correction, masking, clipping and warm-up as ``dgc``.

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
  settings, traced = split_traced(momentum=momentum, clip_norm=clip_norm,
                                  clip_exponent=clip_exponent)
  exchange = ChunkExchange() if chunk_size is None else ChunkExchange(chunk_size)
  return _transformation(DGCConfig(
      ratio=ratio, exchange=exchange, nesterov=nesterov, momentum_masking=momentum_masking,
      warmup=warmup_stages(warmup, steps_per_epoch), value_dtype=value_dtype,
      sparsify=sparsify or _default_sparsify, **settings), axis_name, traced, bucket_cap_mb)
