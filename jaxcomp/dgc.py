"""Deep Gradient Compression: momentum-corrected top-k sparsification, and its coarse-grained variant.

Both transformations sit first in ``optax.chain`` and carry the momentum themselves, as the reference
``DGCSGD`` does, so the optimizer after them has none; weight decay goes before them so that it is local::

    tx = optax.chain(optax.add_decayed_weights(1e-4), jaxcomp.dgc(0.001), optax.sgd(lr))

Per step and per device, for every leaf the ``sparsify`` predicate picks (default: ``ndim > 1``):

1. local gradient clipping of the whole gradient to ``clip_norm · W^clip_exponent`` (optional);
2. momentum correction: ``u ← m·u + g; v ← v + u`` (Nesterov: ``u ← m·(u + g); v ← v + u + g``);
3. selection of at most k = ceil(numel·density) coordinates of ``|v|``;
4. exchange: ``dgc`` all-gathers k values and k int32 indices from every device and scatter-adds them
   (duplicates sum), then multiplies by 1/W; ``coarse_dgc`` all-reduces per-chunk L1 norms, every device
   takes the same top chunks, and only those chunks are averaged — its traffic does not grow with W;
5. ``v ← 0`` at the sent coordinates, and ``u ← 0`` there too with momentum factor masking.

The other floating-point leaves take the dense mean, and momentum is applied after averaging
(``u ← m·u + mean(g)``, output ``u``). Integer and boolean leaves pass through untouched.

Warm-up compiles a step-based density schedule into one program (``lax.switch`` over stages, each with
static k). A stage whose sparse exchange would send at least as many bytes as the dense all-reduce of the
leaf (for ``dgc``: ``W·k·(value bytes + 4) ≥ numel·value bytes``, i.e. ``W·density·2 ≥ 1`` for f32
values) sends the leaf's whole ``v`` as a dense mean instead. Every device sends all it holds then, no
coordinate is delayed, and so nothing is masked: a dense stage is exact momentum SGD on the mean gradient.

State: ``u`` and ``v`` (of the sparsified leaves) differ from device to device; ``dense_u`` (the dense
leaves' momentum) and ``count`` are the same everywhere. Map the state with ``in_axes=0`` under ``pmap``;
under ``shard_map`` take its specs from ``jaxcomp.state_partition_specs`` (``u`` and ``v`` are its
``PER_DEVICE_FIELDS``). The output is identical on every device. A step whose gradient is non-finite on any
device leaves the whole state untouched and outputs NaN everywhere, so ``optax.apply_if_finite`` or a loss
scaler downstream skips it.

References:
  Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for
  Distributed Training", ICLR 2018 (https://arxiv.org/abs/1712.01887); the first author's reference
  code, ``DGCCompressor`` / ``DGCSGDMemory`` (github.com/synxlin/deep-gradient-compression).
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

from jaxcomp import axis
from jaxcomp.buckets import GradBucket, TreeSignature, is_float

PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
"""The paper's warm-up densities, one per epoch, before the final ``ratio`` (0.001 in the paper)."""

_BLOCK = 32  # candidates are compacted block by block: XLA:CPU's cumsum over 10M elements is slow
_CANDIDATE_FACTOR = 2  # the candidate buffer holds 2·k coordinates; more fall back to exact top-k
_INDEX_BYTES = 4  # int32 indices on the wire
_VALUE_DTYPES = (None, jnp.float32, jnp.float16, jnp.bfloat16)


class DGCState(NamedTuple):
  """State of ``dgc`` and ``coarse_dgc``.

  Attributes:
    count: steps taken (non-finite steps are not counted); it drives the warm-up schedule.
    u: momentum of each sparsified leaf, per device (``optax.MaskedNode`` at the other leaves).
    v: accumulated velocity of each sparsified leaf, per device (``optax.MaskedNode`` elsewhere).
    dense_u: momentum of each dense floating-point leaf, applied after averaging, so identical on
      every device (``optax.MaskedNode`` elsewhere).
    signature: the gradient pytree's structure, shapes and dtypes.
    spec: the static settings (so that ``jaxcomp.hooks.dgc_hook(state, bucket)`` finds them).
  """
  count: jax.Array
  u: Any
  v: Any
  dense_u: Any
  signature: TreeSignature
  spec: "_Spec"

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


# ----------------------------------------------------------------------------------------- exchanges

def _itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class _TopKExchange:
  """``dgc``'s exchange: all-gather k values and k indices, scatter-add, ×1/W.

  All leaves of a step share one all-gather of values (per value dtype) and one of indices.
  """
  selection: str
  sample_ratio: float
  upper_bound: float
  lower_bound: float
  max_adaptation_iters: int

  def sparse_bytes(self, numel, density, world, value_bytes):
    return world * math.ceil(numel * density) * (value_bytes + _INDEX_BYTES)

  def select(self, flat, density, key):
    if self.selection == "exact":
      return exact_topk(flat, math.ceil(flat.size * density))
    plan = sampling_plan(flat.size, density, self.sample_ratio)
    return sampled_topk(flat, plan, key, upper_bound=self.upper_bound,
                        lower_bound=self.lower_bound,
                        max_adaptation_iters=self.max_adaptation_iters)[0]

  def __call__(self, vs, density, keys, value_dtypes, axis_name):
    flats = [v.ravel() for v in vs]
    indices = [self.select(flat, density, key) for flat, key in zip(flats, keys)]
    values = [flat.at[i].get(mode="fill", fill_value=0).astype(d)
              for flat, i, d in zip(flats, indices, value_dtypes)]
    all_values = axis.all_gather_many(values, axis_name)
    all_indices = axis.all_gather_many(indices, axis_name)
    scale = 1 / axis.axis_size(axis_name)
    results = []
    for v, flat, mine, gathered_values, gathered_indices in zip(vs, flats, indices, all_values,
                                                                all_indices):
      total = jnp.zeros_like(flat).at[gathered_indices.ravel()].add(
          gathered_values.ravel().astype(flat.dtype), mode="drop")

      def clear(x, mine=mine):
        return x.ravel().at[mine].set(0, mode="drop").reshape(x.shape)

      results.append(((total * jnp.asarray(scale, flat.dtype)).reshape(v.shape), clear))
    return results


@dataclasses.dataclass(frozen=True)
class _ChunkExchange:
  """``coarse_dgc``'s exchange: all-reduce chunk L1 norms, then the mean of the top chunks only.

  All leaves of a step share one all-reduce of norms and one of chunks (per wire dtype).
  """
  chunk_size: int

  def sparse_bytes(self, numel, density, world, value_bytes):
    del world  # the point of the coarse-grained variant
    num_chunks = -(-numel // self.chunk_size)
    return num_chunks * 4 + math.ceil(num_chunks * density) * self.chunk_size * value_bytes

  def __call__(self, vs, density, keys, value_dtypes, axis_name):
    del keys
    size = self.chunk_size

    def as_chunks(x):
      num_chunks = -(-x.size // size)
      return jnp.pad(x.ravel(), (0, num_chunks * size - x.size)).reshape(num_chunks, size)

    chunked = [as_chunks(v) for v in vs]
    norms = axis.psum_many([jnp.abs(c).sum(1, dtype=jnp.float32) for c in chunked], axis_name)
    # The same chunks on every device: the top ceil(chunks·density) of the summed norms.
    chosen = [lax.top_k(n, math.ceil(n.size * density))[1] for n in norms]
    world = axis.axis_size(axis_name)
    sent = axis.psum_many([(c[i].astype(d) / jnp.asarray(world, d)) for c, i, d in
                           zip(chunked, chosen, value_dtypes)], axis_name)
    results = []
    for v, c, i, mean in zip(vs, chunked, chosen, sent):

      def from_chunks(x, v=v):
        return x.ravel()[:v.size].reshape(v.shape)

      def clear(x, i=i, from_chunks=from_chunks):
        return from_chunks(as_chunks(x).at[i].set(0))

      results.append((from_chunks(jnp.zeros_like(c).at[i].set(mean.astype(c.dtype))), clear))
    return results


# ------------------------------------------------------------------------------ the shared algorithm

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one DGC configuration; ``dgc``, ``coarse_dgc`` and the hook share it."""
  exchange: Any
  ratio: float
  stages: tuple  # ((first step after the stage, density), ...), then `ratio` for good
  axis_name: axis.AxisName
  momentum: float
  nesterov: bool
  momentum_masking: bool
  value_dtype: Any
  sparsify: Callable
  seed: int

  def sparse_flags(self, paths, shapes, dtypes) -> list:
    """Per leaf: "skip" (not float / empty), "dense" or "sparse"."""
    flags = []
    for path, shape, dtype in zip(paths, shapes, dtypes):
      if not jnp.issubdtype(dtype, jnp.floating) or math.prod(shape) == 0:
        flags.append("skip")
      elif self.sparsify(path, jax.ShapeDtypeStruct(shape, dtype)):
        if math.prod(shape) >= 2**31:
          raise ValueError(f"sparsify: leaf {path} has {math.prod(shape)} elements; int32 indices "
                           "address at most 2**31 - 1")
        flags.append("sparse")
      else:
        flags.append("dense")
    return flags

  def init(self, leaves, paths) -> tuple:
    """Zero ``(u, v, dense_u)`` lists for the leaves."""
    flags = self.sparse_flags(paths, [np.shape(x) for x in leaves],
                              [jnp.result_type(x) for x in leaves])

    def zeros_where(kind):
      return [jnp.zeros(np.shape(x), jnp.result_type(x)) if f == kind else optax.MaskedNode()
              for f, x in zip(flags, leaves)]

    sparse = zeros_where("sparse")
    return sparse, list(sparse), zeros_where("dense")

  def wire_dtype(self, g):
    """The dtype ``g``'s values travel in."""
    return g.dtype if self.value_dtype is None else self.value_dtype

  def momentum_step(self, u, g):
    """Momentum correction (paper §3.2): returns the new ``u`` and what is added to ``v``."""
    if self.nesterov:
      u = self.momentum * (u + g)
      return u, u + g
    u = self.momentum * u + g
    return u, u

  def sparse_stage(self, density, world, leaves, us, vs, keys):
    """One warm-up stage (static density) over the sparsified leaves."""
    outs, new_u, new_v, exchanged = [], [], [], []
    for i, (g, u, v) in enumerate(zip(leaves, us, vs)):
      u, step = self.momentum_step(u, g)  # 2. momentum correction
      v = v + step
      value_bytes = _itemsize(self.wire_dtype(g))
      if self.exchange.sparse_bytes(g.size, density, world, value_bytes) >= g.size * value_bytes:
        # Dense stage: everything is sent, nothing delayed, so nothing to mask.
        outs.append(axis.mean(v, self.axis_name, self.value_dtype))
        v = jnp.zeros_like(v)
      else:
        outs.append(None)
        exchanged.append(i)
      new_u.append(u)
      new_v.append(v)
    results = self.exchange(  # 3., 4. select, exchange, decompress
        [new_v[i] for i in exchanged], density, [keys[i] for i in exchanged],
        [self.wire_dtype(leaves[i]) for i in exchanged], self.axis_name)
    for i, (out, clear) in zip(exchanged, results):
      outs[i] = out
      new_v[i] = clear(new_v[i])  # 5. sent coordinates restart, momentum too with masking
      if self.momentum_masking:
        new_u[i] = clear(new_u[i])
    return outs, new_u, new_v

  def update(self, count, leaves, paths, us, vs, dense_us) -> tuple:
    """One step over lists of leaves: returns the outputs and the new ``u``, ``v``, ``dense_u``."""
    flags = self.sparse_flags(paths, [x.shape for x in leaves], [x.dtype for x in leaves])
    outs, us, vs, dense_us = list(leaves), list(us), list(vs), list(dense_us)
    for i, flag in enumerate(flags):
      if flag == "dense":  # the mean, then momentum (the reference's compensate(accumulate=False))
        dense_us[i], outs[i] = self.momentum_step(
            dense_us[i], axis.mean(leaves[i], self.axis_name, self.value_dtype))
    sparse = [i for i, f in enumerate(flags) if f == "sparse"]
    if not sparse:
      return outs, us, vs, dense_us
    world = axis.axis_size(self.axis_name)
    step_key = jax.random.fold_in(jax.random.PRNGKey(self.seed), count)
    operands = ([leaves[i] for i in sparse], [us[i] for i in sparse], [vs[i] for i in sparse],
                [jax.random.fold_in(step_key, i) for i in sparse])
    densities = [d for _, d in self.stages] + [self.ratio]
    branches = [lambda ops, d=d: self.sparse_stage(d, world, *ops) for d in densities]
    if len(branches) == 1:
      results = branches[0](operands)
    else:
      stage = sum((count >= b).astype(jnp.int32) for b, _ in self.stages)
      results = lax.switch(stage, branches, operands)
    for j, i in enumerate(sparse):
      outs[i], us[i], vs[i] = results[0][j], results[1][j], results[2][j]
    return outs, us, vs, dense_us


def _transformation(spec: _Spec, clip_norm: Optional[float],
                    clip_exponent: float) -> optax.GradientTransformation:
  """The optax transformation around ``spec``: clipping, the step, non-finite gating."""

  def init_fn(params):
    signature = TreeSignature.of(params)
    trees = [jax.tree.unflatten(signature.treedef, x)
             for x in spec.init(jax.tree.leaves(params), signature.paths)]
    return DGCState(jnp.zeros([], jnp.int32), *trees, signature, spec)

  def update_fn(updates, state: DGCState, params=None):
    del params
    leaves = state.signature.check(updates)
    finite = axis.all_finite(updates, spec.axis_name)
    grads = leaves
    if clip_norm is not None:
      # 1. Local gradient clipping (paper §3.3), before accumulation, threshold scaled by W^exponent.
      floats = [g for g in leaves if is_float(g)]
      norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in floats))
      limit = clip_norm * axis.axis_size(spec.axis_name) ** clip_exponent
      scale = jnp.minimum(1.0, limit / (norm + 1e-6))
      grads = [(g * scale).astype(g.dtype) if is_float(g) else g for g in leaves]
    treedef = state.signature.treedef
    outs, *trees = spec.update(state.count, grads, state.signature.paths,
                               *(treedef.flatten_up_to(t) for t in (state.u, state.v, state.dense_u)))
    outs = [jnp.where(finite, o, jnp.nan).astype(o.dtype) if is_float(o) else o for o in outs]
    new_state = DGCState(state.count + 1, *(jax.tree.unflatten(treedef, t) for t in trees),
                         state.signature, spec)
    return jax.tree.unflatten(treedef, outs), axis.keep_if_finite(finite, new_state, state)

  return optax.GradientTransformation(init_fn, update_fn)


def init_bucket_state(spec: _Spec, bucket: GradBucket) -> DGCState:
  """The zero ``DGCState`` of one ``comm_hook`` bucket; see ``jaxcomp.hooks.dgc_state``."""
  grads = bucket.gradients()
  return DGCState(jnp.zeros([], jnp.int32), *map(tuple, spec.init(grads, bucket.paths)),
                  TreeSignature.of(grads), spec)


def update_bucket(state: DGCState, bucket: GradBucket) -> tuple:
  """One DGC step on a bucket's parameters: ``(reduced buffer, new state)``; see ``dgc_hook``."""
  grads = state.signature.check(bucket.gradients(), "bucket", dtypes=False)
  bucket_spec = dataclasses.replace(state.spec, axis_name=bucket.axis_name)
  outs, u, v, dense_u = bucket_spec.update(state.count, grads, bucket.paths, state.u, state.v,
                                           state.dense_u)
  return (jnp.concatenate([o.ravel() for o in outs]),
          state._replace(count=state.count + 1, u=tuple(u), v=tuple(v), dense_u=tuple(dense_u)))


# ------------------------------------------------------------------------------ construction helpers

def _default_sparsify(path: str, leaf) -> bool:
  del path
  return leaf.ndim > 1


def _density(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
    raise ValueError(f"{name} must be a number in (0, 1]; got {value!r}")
  return float(value)


def _warmup_stages(warmup, steps_per_epoch) -> tuple:
  if warmup is None:
    return ()
  if isinstance(warmup, str):
    if warmup != "paper":
      raise ValueError(f"warmup must be None, 'paper' or a sequence of (step, density); got {warmup!r}")
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
      raise ValueError("steps_per_epoch must be a positive int when warmup='paper'; "
                       f"got {steps_per_epoch!r}")
    return tuple(((e + 1) * steps_per_epoch, d) for e, d in enumerate(PAPER_WARMUP))
  try:
    stages = [(b, d) for b, d in warmup]
  except (TypeError, ValueError):
    raise ValueError(f"warmup must be None, 'paper' or a sequence of (step, density) pairs; "
                     f"got {warmup!r}") from None
  previous = 0
  for b, d in stages:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= previous:
      raise ValueError("warmup: stage ends must be increasing positive ints (the first step after "
                       f"each stage); got {b!r} after {previous}")
    _density(d, "warmup density")
    previous = int(b)
  return tuple((int(b), float(d)) for b, d in stages)


def _spec(exchange, ratio, *, axis_name, momentum, nesterov, momentum_masking, warmup, steps_per_epoch,
          value_dtype, sparsify, seed) -> _Spec:
  if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
    raise ValueError(f"momentum must be a number in [0, 1); got {momentum!r}")
  if nesterov and momentum == 0:
    raise ValueError("nesterov=True needs a momentum > 0; got momentum=0")
  if not any(value_dtype is d or (d is not None and value_dtype is not None
                                  and np.dtype(value_dtype) == np.dtype(d)) for d in _VALUE_DTYPES):
    raise ValueError(f"value_dtype must be None, float32, float16 or bfloat16; got {value_dtype!r}")
  if sparsify is not None and not callable(sparsify):
    raise TypeError(f"sparsify must be callable as sparsify(path, leaf) -> bool; got {sparsify!r}")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"seed must be an int; got {seed!r}")
  return _Spec(exchange=exchange, ratio=_density(ratio, "ratio"),
               stages=_warmup_stages(warmup, steps_per_epoch),
               axis_name=axis.check_axis_name(axis_name), momentum=float(momentum),
               nesterov=bool(nesterov), momentum_masking=bool(momentum_masking),
               value_dtype=None if value_dtype is None else jnp.dtype(value_dtype),
               sparsify=sparsify or _default_sparsify, seed=seed)


def _check_clip(clip_norm, clip_exponent):
  if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                or not clip_norm > 0):
    raise ValueError(f"clip_norm must be None or a positive number; got {clip_norm!r}")
  if isinstance(clip_exponent, bool) or not isinstance(clip_exponent, (int, float)):
    raise ValueError(f"clip_exponent must be a number; got {clip_exponent!r}")


def topk_spec(ratio: float = 0.001, *, axis_name: axis.AxisName = "batch", momentum: float = 0.9,
              nesterov: bool = False, momentum_masking: bool = True,
              warmup: Union[None, str, Sequence] = None, steps_per_epoch: Optional[int] = None,
              sample_ratio: float = 0.01, selection: str = "sampled", value_dtype=None,
              sparsify: Optional[Callable] = None, upper_bound: float = 1.3, lower_bound: float = 0.8,
              max_adaptation_iters: int = 10, seed: int = 0) -> _Spec:
  """The validated static configuration of ``dgc`` (shared with ``jaxcomp.hooks.dgc_state``)."""
  if selection not in ("sampled", "exact"):
    raise ValueError(f"selection must be 'sampled' or 'exact'; got {selection!r}")
  _density(sample_ratio, "sample_ratio")
  if not (isinstance(upper_bound, (int, float)) and upper_bound >= 1):
    raise ValueError(f"upper_bound must be a number >= 1; got {upper_bound!r}")
  if not (isinstance(lower_bound, (int, float)) and 0 < lower_bound < 1):
    raise ValueError(f"lower_bound must be a number in (0, 1); got {lower_bound!r}")
  if isinstance(max_adaptation_iters, bool) or not isinstance(max_adaptation_iters, int) or (
      max_adaptation_iters < 0):
    raise ValueError(f"max_adaptation_iters must be a non-negative int; got {max_adaptation_iters!r}")
  exchange = _TopKExchange(selection, float(sample_ratio), float(upper_bound), float(lower_bound),
                           max_adaptation_iters)
  return _spec(exchange, ratio, axis_name=axis_name, momentum=momentum, nesterov=nesterov,
               momentum_masking=momentum_masking, warmup=warmup, steps_per_epoch=steps_per_epoch,
               value_dtype=value_dtype, sparsify=sparsify, seed=seed)


# ---------------------------------------------------------------------------------- public functions

def dgc(ratio: float = 0.001, *, axis_name: axis.AxisName = "batch", momentum: float = 0.9,
        nesterov: bool = False, momentum_masking: bool = True, clip_norm: Optional[float] = None,
        clip_exponent: float = -0.5, warmup: Union[None, str, Sequence] = None,
        steps_per_epoch: Optional[int] = None, sample_ratio: float = 0.01,
        selection: str = "sampled", value_dtype=None, sparsify: Optional[Callable] = None,
        upper_bound: float = 1.3, lower_bound: float = 0.8, max_adaptation_iters: int = 10,
        seed: int = 0) -> optax.GradientTransformation:
  """Deep Gradient Compression: the cross-device mean of momentum-corrected top-k sparse gradients.

  Use with a momentum-free optimizer, weight decay before it:
  ``optax.chain(optax.add_decayed_weights(wd), dgc(0.001), optax.sgd(lr))``.

  Args:
    ratio: density after warm-up; each sparsified leaf sends k = ceil(numel·ratio) coordinates.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    momentum: momentum factor m of the momentum correction (and of the dense leaves' momentum).
    nesterov: Nesterov momentum correction, ``u ← m·(u + g); v ← v + u + g``.
    momentum_masking: also zero ``u`` at the sent coordinates (momentum factor masking).
    clip_norm: local gradient clipping: each device scales its whole gradient to global L2 norm at
      most ``clip_norm · W^clip_exponent`` before accumulation. None: no clipping (the reference's
      default).
    clip_exponent: the world-size exponent of the clipping threshold; the paper's N^(-1/2) by default.
    warmup: None; ``"paper"`` (densities 0.25, 0.0625, 0.015625, 0.004, one epoch of
      ``steps_per_epoch`` steps each, then ``ratio``); or a sequence of ``(end_step, density)`` with
      increasing ``end_step`` — density applies while ``count < end_step`` — then ``ratio``.
    steps_per_epoch: steps per epoch, for ``warmup="paper"``.
    sample_ratio: fraction of each leaf sampled for the threshold (at least 2/density samples).
    selection: ``"sampled"`` (the reference's threshold estimate, at most k sent) or ``"exact"``
      (``lax.top_k``, exactly k sent).
    value_dtype: wire dtype of the values and of the dense means: None (the gradient's), float32,
      float16 or bfloat16. Indices are int32.
    sparsify: ``sparsify(path, leaf) -> bool`` with the leaf as a ``jax.ShapeDtypeStruct``: which
      floating-point leaves are sparsified; default ``leaf.ndim > 1``.
    upper_bound, lower_bound, max_adaptation_iters: the reference's threshold adaptation: with more
      than ``upper_bound·k`` candidates take the exact top-k among them; with fewer than
      ``lower_bound·k`` multiply the threshold by ``lower_bound`` (at most that many times).
    seed: seeds the sampling offsets (a function of ``seed``, the step and the leaf).

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018, §3 (momentum correction, local gradient
    clipping, momentum factor masking, warm-up training); reference ``DGCCompressor``.
  """
  _check_clip(clip_norm, clip_exponent)
  spec = topk_spec(ratio, axis_name=axis_name, momentum=momentum, nesterov=nesterov,
                   momentum_masking=momentum_masking, warmup=warmup, steps_per_epoch=steps_per_epoch,
                   sample_ratio=sample_ratio, selection=selection, value_dtype=value_dtype,
                   sparsify=sparsify, upper_bound=upper_bound, lower_bound=lower_bound,
                   max_adaptation_iters=max_adaptation_iters, seed=seed)
  return _transformation(spec, clip_norm, clip_exponent)


def coarse_dgc(ratio: float = 0.01, *, chunk_size: int = 256, axis_name: axis.AxisName = "batch",
               momentum: float = 0.9, nesterov: bool = False, momentum_masking: bool = True,
               clip_norm: Optional[float] = None, clip_exponent: float = -0.5,
               warmup: Union[None, str, Sequence] = None, steps_per_epoch: Optional[int] = None,
               value_dtype=None,
               sparsify: Optional[Callable] = None) -> optax.GradientTransformation:
  """Coarse-grained DGC: every device sends the same top chunks, so traffic does not grow with W.

  Each sparsified leaf's momentum-corrected ``v`` is cut into chunks of ``chunk_size`` elements (the
  last zero-padded); the per-chunk L1 norms are all-reduced, every device takes the same
  ceil(chunks·ratio) chunks of largest summed norm, and only those are averaged (all-reduce), with the
  same momentum correction, masking, clipping and warm-up as ``dgc``.

  Args:
    ratio: fraction of chunks sent after warm-up.
    chunk_size: elements per chunk.
    axis_name, momentum, nesterov, momentum_masking, clip_norm, clip_exponent, warmup,
      steps_per_epoch, value_dtype, sparsify: as in ``dgc`` (a stage falls back to the dense mean
      when norms plus chunks would send at least the leaf's size).

  Returns:
    A ``GradientTransformation`` with state ``DGCState``; its output is the same on every device.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018; the coarse-grained sparsification of the
    jaxcomp seed notes ("CSC").
  """
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
  _check_clip(clip_norm, clip_exponent)
  spec = _spec(_ChunkExchange(chunk_size), ratio, axis_name=axis_name, momentum=momentum,
               nesterov=nesterov, momentum_masking=momentum_masking, warmup=warmup,
               steps_per_epoch=steps_per_epoch, value_dtype=value_dtype, sparsify=sparsify, seed=0)
  return _transformation(spec, clip_norm, clip_exponent)
