"""PowerSGD: low-rank gradient compression with error feedback, layer-wise and batched.

``powersgd`` is torch's ``powerSGD_hook`` step for step: with ``matrix_view="torch"`` and torch-layout
arrays it gives torch's outputs and error to float32 rounding (tests/test_powersgd_torch.py checks it
against torch's real hook). ``batched_powersgd`` is torch's ``batched_powerSGD_hook``, which raises at
its first compressed step in torch 2.13 and works here. ``alternating=True`` is the variant of the
PowerSGD authors' library (github.com/epfml/powersgd, ``num_iters_per_step=1``).

The steps, per device, W devices ("torch n": the numbered list of ``powerSGD_hook``'s docstring;
"Alg. n": the paper's algorithms):

1. Phase "warmup", the first ``start_iter`` steps: the plain mean, ÷W then one all-reduce SUM
   (torch's "vanilla allreduce"). Phase "compressed" from then on:
2. ``M ← g + e``: add this device's error feedback (Alg. 2 line 7).
3. Each block as a matrix (torch 1, 1.1, 1.2; Alg. 1 line 1). Layer-wise, a block is a leaf viewed
   as (n, m), compressed iff ``compress(path, leaf)`` allows it and ``(n + m)·r·min_compression_rate
   < n·m`` with ``r = min(n, m, rank)``; batched, each dtype's leaves, raveled and zero-padded to
   side² with ``side = ceil(sqrt(L))``, are one square, always compressed.
4. Uncompressed blocks: summed in the all-reduce of step 5, then ÷W (torch 2.1, 2.2; torch sends
   them first, in one of their own).
5. ``Q ← orth(Q)``; ``P = M·Q`` locally; all Ps in one all-reduce SUM, not divided; ``P̂ = orth(P)``
   (torch 3.1–3.4; Alg. 1 lines 3–5).
6. ``Q = Mᵀ·P̂`` locally; all Qs in one all-reduce SUM, then ÷W (torch 3.5, 3.6; Alg. 1 lines 6–7).
7. Output ``P̂·Qᵀ`` (torch 3.7; Alg. 1 line 11); batched: cut back to the leaves.
8. ``e ← M − P̂·Qᵀ``, and "local minus mean" for uncompressed blocks (Alg. 2 line 9, with the
   averaged factors as torch and the paper's code do).
9. The Q the next step starts from: with warm start this one (a column that came out all-zero
   keeps its old value), else a fresh draw.

Alternating, in place of 5–9, half the power iteration per step from the factor the last step sent,
in phases "even" and "odd" (compressed steps counted from ``start_iter``): on even steps ``P̂ =
orth(P)``, ``Q = Mᵀ·P̂`` locally, ``e ← M − P̂·Qᵀ`` with this device's own Q (epfml's local error),
one all-reduce SUM of the Qs with the uncompressed blocks, ÷W, output ``P̂·Q̄ᵀ``, keep ``Q̄``; odd
steps the same with P and Q exchanged. One all-reduce per step instead of two in sequence.

Random factors come from ``seed``, the step and the block's name (a leaf's path, a batched square's
dtype), so a leaf gets the same Q whole, in a ``bucket_cap_mb`` bucket and in ``powersgd_hook``.
Where torch breaks, jaxcomp does not: 0-d and 1-D leaves work; an all-zero column is left at zero
with ``epsilon=0`` instead of divided by its zero norm; Gram–Schmidt removes each finished column
twice, so a rank-deficient P still gives orthonormal columns; a rank above ``min(n, m)`` is clamped;
half-precision leaves work. The adapter (``compressor.py``) adds the rest: a step with a non-finite
gradient keeps the state and outputs NaN, buckets, per-phase byte counts, ``epsilon`` as a schedule.

The state's ``error`` differs per device (``PER_DEVICE_FIELDS``); ``count``, ``q`` and ``p`` are
identical on every device. Donate the state: the error is then updated in place.

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019 (https://arxiv.org/abs/1905.13727), Algorithms 1 and 2.
  PyTorch, ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``.
  epfml/powersgd, ``powersgd/powersgd.py`` (``BasicPowerSGD``: alternating halves, local error).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import axis, compressor, kernels, phases, validate
from jaxcomp._src import tree as tree_lib

WARMUP = phases.Phase("warmup", 0.0)
COMPRESSED = phases.Phase("compressed", 1.0)
EVEN = phases.Phase("even", 0.5)  # alternating: sends the Qs
ODD = phases.Phase("odd", 0.5)  # alternating: sends the Ps
_Q, _P = 0, 1  # which factor a random draw is for


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PowerSGDConfig:
  """PowerSGD's settings, validated; a static pytree node kept in the state.

  Attributes:
    rank: the approximation rank r, clamped to ``min(n, m)`` per matrix. Rank 1 already matches SGD
      on many convolutional networks (the paper's ResNet-18: rank 2 does); transformers need more.
    start_iter: steps of plain mean before compression (torch's ``start_powerSGD_iter``): the first
      steps of training move the most and are the most hurt by compression.
    error_feedback: keep each device's compression error and add it to the next gradient, so
      nothing is lost over time, only delayed (without it PowerSGD is a biased compressor).
    warm_start: start each power iteration from the last step's Q: one iteration per step then
      tracks the gradient's top subspace across steps instead of starting from noise.
    seed: the seed of the random factors, the same on every device.
    epsilon: added to the column norms in Gram–Schmidt (torch's ``orthogonalization_epsilon``); may
      be an array (a schedule under ``optax.inject_hyperparams``).
    min_compression_rate: compress a leaf only if it shrinks by more than this factor; below it the
      extra compute and two extra all-reduces cost more than the bytes saved.
    matrix_view: ``"flax"``: a leaf of shape ``(..., k)`` is ``(prod(shape[:-1]), k)``, the fan-in
      × fan-out matrix of Flax's Dense and Conv kernels; ``"torch"``: ``(shape[0],
      prod(shape[1:]))``, torch's view of torch-layout arrays. 0-d leaves are (1, 1).
    batched: torch's ``batched_powerSGD_hook``: each dtype's leaves as one zero-padded square
      matrix; ``epsilon``, ``min_compression_rate``, ``matrix_view`` and ``compress`` do not apply.
    alternating: half a power iteration per step (epfml's library): one all-reduce per step instead
      of two in sequence, the same bytes over two steps; where latency, not bandwidth, bounds the
      step, it halves the communication time. Layer-wise only; needs ``warm_start``.
    compress: ``compress(path, leaf) -> bool`` with the leaf as a ``jax.ShapeDtypeStruct``: which
      reduced leaves may be compressed (the others are averaged densely); None: all. The
      replacement for ``optax.masked``, which would leave the other leaves un-averaged.
  """
  rank: int = 1
  start_iter: int = 1000
  error_feedback: bool = True
  warm_start: bool = True
  seed: int = 0
  epsilon: Any = 0.0
  min_compression_rate: float = 2.0
  matrix_view: str = "flax"
  batched: bool = False
  alternating: bool = False
  compress: Optional[Callable] = None

  def __post_init__(self):
    in_state = "is kept in the state's static configuration"
    checked = dict(
        rank=validate.integer(self.rank, "rank", 1, static="fixes the shapes of P and Q"),
        start_iter=validate.integer(self.start_iter, "start_iter", 0, static=in_state),
        error_feedback=validate.boolean(self.error_feedback, "error_feedback"),
        warm_start=validate.boolean(self.warm_start, "warm_start"),
        seed=validate.integer(self.seed, "seed", 0, static="seeds the Qs drawn at init"),
        epsilon=validate.traceable(self.epsilon, lambda v: validate.number(v, "epsilon", 0)),
        min_compression_rate=validate.number(self.min_compression_rate, "min_compression_rate", 0,
                                             static="decides which leaves are compressed"),
        matrix_view=validate.choice(self.matrix_view, "matrix_view", ("torch", "flax")),
        batched=validate.boolean(self.batched, "batched"),
        alternating=validate.boolean(self.alternating, "alternating"),
        compress=None if self.compress is None else validate.function(
            self.compress, "compress", "compress(path, leaf) -> bool"))
    if checked["alternating"] and checked["batched"]:
      raise ValueError("alternating=True is layer-wise PowerSGD's option; batched PowerSGD has one "
                       "square matrix and no alternating variant")
    if checked["alternating"] and not checked["warm_start"]:
      raise ValueError("alternating=True needs warm_start=True: each step starts from the factor "
                       "the last step sent; got warm_start=False")
    for name, value in checked.items():
      object.__setattr__(self, name, value)


class PowerSGDState(NamedTuple):
  """State of PowerSGD, layer-wise or batched (``config.batched``).

  Attributes:
    count: steps taken (int32); steps with a non-finite gradient are not counted.
    error: the error feedback, per device. Layer-wise: the params' structure, ``optax.MaskedNode()``
      at leaves that are not reduced; batched: a tuple with each square's flat zero-padded error
      (length side²). ``optax.MaskedNode()`` throughout without error feedback.
    q: the Q the next compressed step starts from, identical on every device. Layer-wise: the
      params' structure, a compressed leaf holding its Q of shape ``(m, r)``, the others
      ``optax.MaskedNode()``; batched: a tuple with each square's Q of shape ``(side, r)``.
    p: alternating: the P an odd step starts from (as ``q``, of shape ``(n, r)``); otherwise
      ``optax.MaskedNode()`` throughout.
    config: the static settings.
    signature: the gradient pytree's structure, shapes, dtypes and paths.
  """
  count: jax.Array
  error: Any
  q: Any
  p: Any
  config: PowerSGDConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("error",)  # see jaxcomp.sharding

  def compression_stats(self) -> tuple:
    """torch's ``compression_stats()``: ``(rate, numel before, numel after)``, summed over steps."""
    return powersgd_stats(self)


class _Block(NamedTuple):
  """One matrix: reduced leaves ``members`` raveled, concatenated, zero-padded and viewed as (n, m)."""
  members: tuple  # positions among the reduced leaves
  shapes: tuple
  n: int
  m: int
  rank: int
  compress: bool
  name: str  # seeds its random factors: the leaf's path, or the batched square's dtype

  @property
  def length(self) -> int:
    return sum(math.prod(s) for s in self.shapes)


def _view(shape: tuple, matrix_view: str) -> tuple:
  if not shape:
    return 1, 1
  if matrix_view == "torch":
    return shape[0], math.prod(shape[1:])
  return math.prod(shape[:-1]), shape[-1]


def _blocks(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> list:
  """3: the matrices of the reduced leaves, in order."""
  structs = signature.reduced_structs()
  if config.batched:  # one square per dtype, in order of first appearance
    groups: dict = {}
    for k, leaf in enumerate(structs):
      groups.setdefault(leaf.dtype.name, []).append(k)
    blocks = []
    for dtype, members in groups.items():
      shapes = tuple(structs[k].shape for k in members)
      side = math.ceil(math.sqrt(sum(math.prod(s) for s in shapes)))
      blocks.append(_Block(tuple(members), shapes, side, side, min(side, config.rank), True, dtype))
    return blocks
  blocks = []
  for k, (path, leaf) in enumerate(zip([signature.paths[i] for i in signature.reduced], structs)):
    n, m = _view(leaf.shape, config.matrix_view)
    rank = min(n, m, config.rank)
    allowed = config.compress is None or bool(config.compress(path, leaf))
    blocks.append(_Block((k,), (leaf.shape,), n, m, rank,
                         allowed and (n + m) * rank * config.min_compression_rate < n * m, path))
  return blocks


def _per_block(config: PowerSGDConfig, signature: tree_lib.TreeSignature, field) -> list:
  """A state field's entry for each block (batched: a tuple already; layer-wise: the params' tree)."""
  return list(field) if config.batched else signature.pick(field)


def _field(config: PowerSGDConfig, signature: tree_lib.TreeSignature, values: list):
  """The state field holding ``values``, one per block (the inverse of ``_per_block``)."""
  return tuple(values) if config.batched else signature.place(values)


def _draw(config: PowerSGDConfig, step, block: _Block, factor: int, dtype) -> jax.Array:
  """A standard-normal Q (or alternating P) of ``block``, the same on every device and in every
  layout: from ``seed``, the step and the block's name."""
  key = jax.random.fold_in(jax.random.key(config.seed), step)
  key = jax.random.fold_in(jax.random.fold_in(key, zlib.crc32(block.name.encode())), factor)
  return jax.random.normal(key, ((block.m, block.n)[factor], block.rank), dtype)


def init(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> PowerSGDState:
  """Zero error; the factors of the compressed blocks drawn from ``seed``."""
  dtypes = [signature.reduced_structs()[b.members[0]].dtype for b in _blocks(config, signature)]
  error, q, p = [], [], []
  for block, dtype in zip(_blocks(config, signature), dtypes):
    shape = (block.n * block.m,) if config.batched else block.shapes[0]
    error.append(jnp.zeros(shape, dtype) if config.error_feedback else optax.MaskedNode())
    q.append(_draw(config, 0, block, _Q, dtype) if block.compress else optax.MaskedNode())
    p.append(_draw(config, 0, block, _P, dtype) if block.compress and config.alternating
             else optax.MaskedNode())
  return PowerSGDState(jnp.zeros([], jnp.int32), *(_field(config, signature, f) for f in (error, q, p)),
                       config, signature)


def step_phases(config: PowerSGDConfig) -> tuple:
  """The warm-up (if ``start_iter``), then "compressed", or "even" and "odd" when alternating."""
  return (WARMUP,) * (config.start_iter > 0) + ((EVEN, ODD) if config.alternating else (COMPRESSED,))


def phase_of(config: PowerSGDConfig, count) -> jax.Array:
  """The index into ``step_phases(config)`` of the step taken at ``count``."""
  steady = (count - config.start_iter) % 2 if config.alternating else 0
  return jnp.where(count < config.start_iter, 0, (config.start_iter > 0) + steady).astype(jnp.int32)


def orthogonalize(x: jax.Array, epsilon=0.0) -> jax.Array:
  """Orthonormalizes the columns of ``x`` (n, r) as torch does.

  Modified Gram–Schmidt when r ≤ 2 or ``x`` is float16 / bfloat16, else QR (which ignores
  ``epsilon``). Gram–Schmidt takes the columns in order: remove the earlier (finished) columns from
  column i, then ``col /= norm(col) + epsilon``. Three departures from torch, all at rounding level
  when ``x`` has full rank: the earlier columns are removed twice ("twice is enough"), because after
  torch's single pass the columns of a rank-deficient ``x`` come out far from orthogonal (194 of 200
  random rank-1 float32 (20, 2) matrices in torch 2.13); an all-zero column stays zero when
  ``epsilon`` is 0 instead of becoming NaN; half-precision norms are taken in float32.
  """
  rank = x.shape[1]
  if rank > 2 and x.dtype not in (jnp.float16, jnp.bfloat16):
    return jnp.linalg.qr(x)[0]
  norm_dtype = jnp.promote_types(x.dtype, jnp.float32)
  cols = []
  for i in range(rank):
    col = x[:, i]
    for _ in range(2):
      for done in cols:
        col = col - jnp.sum(done * col) * done
    norm = jnp.sqrt(jnp.sum(jnp.square(col.astype(norm_dtype)))).astype(x.dtype)
    denom = norm + jnp.asarray(epsilon, x.dtype)
    cols.append(col / jnp.where(denom == 0, jnp.ones_like(denom), denom))
  return jnp.stack(cols, axis=1)


def _matrix(block: _Block, leaves: list, error) -> jax.Array:
  """2, 3: ``M = g + e`` as the block's (n, m) matrix."""
  g = tree_lib.flatten([leaves[k] for k in block.members])
  g = jnp.pad(g, (0, block.n * block.m - block.length))
  if error is not None:
    g = kernels.computed_once(g + error.reshape(-1).astype(g.dtype))
  return g.reshape(block.n, block.m)


def _sum_then_divide(arrays: list, axis_name) -> list:
  return [axis.divide_by_world(s, axis_name) for s in axis.psum_many(arrays, axis_name)]


def _power_iteration(config, mats: list, qs: list, dense: list, axis_name) -> tuple:
  """Steps 4–6: ``(means of the dense blocks, P̂s, Qs)``."""
  # 5: Q ← orth(Q); P = M·Q locally. 4, 5: one all-reduce SUM of the dense blocks and every P.
  ps = [mat @ orthogonalize(q.astype(mat.dtype), config.epsilon) for mat, q in zip(mats, qs)]
  sums = axis.psum_many(dense + ps, axis_name)
  means = [axis.divide_by_world(s, axis_name) for s in sums[:len(dense)]]  # 4: then ÷W
  p_hats = [orthogonalize(p, config.epsilon) for p in sums[len(dense):]]  # 5: P̂ = orth(P)
  # 6: Q = Mᵀ·P̂ locally; all Qs in one all-reduce SUM, then ÷W.
  new_qs = _sum_then_divide([kernels.transposed_product(mat, p) for mat, p in zip(mats, p_hats)],
                            axis_name)
  return means, p_hats, new_qs


def _half_iteration(config, mats: list, factors: list, dense: list, axis_name, sends_q: bool):
  """Alternating steps 4–6 from ``factors`` (P on even steps, Q on odd ones): ``(means of the
  dense blocks, orth(factors), the mean of the factors sent, this device's own)``."""
  fixed = [orthogonalize(f.astype(mat.dtype), config.epsilon) for mat, f in zip(mats, factors)]
  local = [kernels.transposed_product(mat, f) if sends_q else mat @ f
           for mat, f in zip(mats, fixed)]
  sums = _sum_then_divide(dense + local, axis_name)
  return sums[:len(dense)], fixed, sums[len(dense):], local


def _kept_if_zero(new: jax.Array, old: jax.Array) -> jax.Array:
  """9: ``new`` in ``old``'s dtype, but a column that came out all-zero keeps its old value (it
  would stall the power iteration)."""
  return jnp.where(jnp.all(new == 0, axis=0, keepdims=True), old, new.astype(old.dtype))


def step(config: PowerSGDConfig, state: PowerSGDState, leaves: list, axis_name,
         phase: phases.Phase) -> tuple:
  """One step on the reduced ``leaves`` (the module docstring's steps)."""
  if phase == WARMUP:  # 1: ÷W, then one all-reduce SUM
    return axis.mean_many(leaves, axis_name), state
  signature = state.signature
  blocks = _blocks(config, signature)
  errors, qs, ps = (_per_block(config, signature, f) for f in (state.error, state.q, state.p))
  ms = [_matrix(b, leaves, e if config.error_feedback else None) for b, e in zip(blocks, errors)]
  dense = [k for k, b in enumerate(blocks) if not b.compress]
  packed = [k for k, b in enumerate(blocks) if b.compress]
  mats = [ms[k] for k in packed]
  if phase == COMPRESSED:
    means, p_hats, new_qs = _power_iteration(config, mats, [qs[k] for k in packed],
                                             [ms[k] for k in dense], axis_name)
    outs = residuals = list(zip(p_hats, new_qs))
    for k, q in zip(packed, new_qs):  # 9
      qs[k] = (_kept_if_zero(q, qs[k]) if config.warm_start
               else _draw(config, state.count + 1, blocks[k], _Q, qs[k].dtype))
  else:
    sends_q = phase == EVEN
    means, fixed, sent, local = _half_iteration(
        config, mats, [(ps if sends_q else qs)[k] for k in packed], [ms[k] for k in dense],
        axis_name, sends_q)
    if sends_q:
      outs, residuals = list(zip(fixed, sent)), list(zip(fixed, local))
    else:
      outs, residuals = list(zip(sent, fixed)), list(zip(local, fixed))
    for k, factor in zip(packed, sent):  # 9
      kept = qs if sends_q else ps
      kept[k] = _kept_if_zero(factor, kept[k])
  low_rank = dict(zip(dense, means))
  for k, (p, q) in zip(packed, outs):  # 7: P̂·Qᵀ
    low_rank[k] = kernels.low_rank_product(p, q)
  if config.error_feedback:  # 8: e ← M − P̂·Qᵀ; M − mean for the dense blocks
    residual = {**dict(zip(dense, means)),
                **{k: kernels.low_rank_product(p, q) for k, (p, q) in zip(packed, residuals)}}
    errors = [(ms[k] - residual[k]).reshape(e.shape).astype(e.dtype) for k, e in enumerate(errors)]
  means_out = [None] * len(leaves)
  for k, block in enumerate(blocks):  # 7: cut back to the leaves
    for i, x in zip(block.members, tree_lib.unflatten(low_rank[k].reshape(-1)[:block.length],
                                                      block.shapes)):
      means_out[i] = x
  return means_out, state._replace(
      **{name: _field(config, signature, values) for name, values in
         (("error", errors), ("q", qs), ("p", ps))})


def powersgd_stats(tree) -> tuple:
  """Compression statistics counted as torch counts them, for every PowerSGD state in ``tree``.

  Args:
    tree: a ``PowerSGDState``, or any pytree holding them (an optax chain state, a ``comm_hook`` state
      with one state per bucket); a state stacked over devices works too.

  Returns:
    ``(numel before / numel after, numel before, numel after)`` summed over the compressed steps
    taken so far (rate 0 before the first), as torch's ``PowerSGDState.compression_stats()``; the
    alternating variant counts the factor each step sent (Qs on even steps, Ps on odd ones).
  """
  before = after = 0
  for state in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PowerSGDState)):
    if not isinstance(state, PowerSGDState):
      continue
    config = state.config
    steps = max(int(np.max(np.asarray(state.count))) - config.start_iter, 0)
    for block in _blocks(config, state.signature):
      before += steps * block.length
      if not block.compress:
        after += steps * block.length
      elif config.alternating:
        after += ((steps + 1) // 2 * block.m + steps // 2 * block.n) * block.rank
      else:
        after += steps * (block.n + block.m) * block.rank
  return (before / after if after else 0, before, after)


_LAYERWISE_ONLY = ("epsilon", "min_compression_rate", "matrix_view", "alternating", "compress")


def _batched_config(**settings) -> PowerSGDConfig:
  """Batched PowerSGD's configuration: ``PowerSGDConfig(batched=True, ...)``."""
  extra = [name for name in _LAYERWISE_ONLY + ("batched",) if name in settings]
  if extra:
    raise TypeError(f"batched_powersgd takes no {', '.join(extra)}: they are layer-wise PowerSGD's "
                    "settings (jaxcomp.powersgd); batched PowerSGD compresses one square per dtype")
  return PowerSGDConfig(batched=True, **settings)


POWERSGD = compressor.Algorithm("powersgd", PowerSGDState, PowerSGDConfig, init, step,
                                phases=step_phases, phase_of=phase_of, traceable=("epsilon",))
BATCHED_POWERSGD = dataclasses.replace(POWERSGD, name="batched_powersgd", configure=_batched_config,
                                       traceable=())


def powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
             min_compression_rate: float = 2.0, error_feedback: bool = True,
             warm_start: bool = True, epsilon: float = 0.0, seed: int = 0,
             matrix_view: str = "flax", alternating: bool = False,
             compress: Optional[Callable] = None,
             bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """Layer-wise PowerSGD: the cross-device mean of a rank-``rank`` approximation of each matrix.

  Torch's ``powerSGD_hook`` step for step (the module docstring numbers the steps). Before
  ``start_iter`` steps the plain mean. From then on, each reduced leaf ``g`` plus its error ``e`` is
  viewed as a matrix M (n, m) and compressed iff ``compress`` allows it and ``(n + m)·r·
  min_compression_rate < n·m``; the other leaves are summed in the all-reduce of the Ps and divided
  by W. For the compressed ones, ``P = M·orth(Q)`` is summed and orthogonalized to ``P̂``; ``Q =
  Mᵀ·P̂`` is summed and divided by W; the output is ``P̂·Qᵀ`` and the error ``M − output``.
  ``jaxcomp.comm_report`` reports the compressed step (``.phase("powersgd.warmup")``: a warm-up step).

  Example::

    tx = optax.chain(jaxcomp.powersgd(rank=2, start_iter=100), optax.sgd(0.1, momentum=0.9))
    # Only the kernels, the rest averaged densely (optax.masked would not average the rest at all):
    tx = jaxcomp.powersgd(rank=2, compress=lambda path, leaf: "kernel" in path)

  Args:
    rank: the approximation rank r (clamped to ``min(n, m)`` per leaf).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    start_iter: steps of plain mean before compression starts (torch's ``start_powerSGD_iter``; 0
      compresses from the first step). About 10% of training is torch's and the paper's advice.
    min_compression_rate: compress a leaf only if its size shrinks by more than this factor.
    error_feedback: keep each device's compression error and add it to the next gradient.
    warm_start: start each step's power iteration from the last step's Q (else a fresh random Q).
    epsilon: added to the column norms in Gram–Schmidt; may be scheduled
      (``optax.inject_hyperparams(jaxcomp.powersgd, static_args=("rank", "start_iter",
      "min_compression_rate", "seed"))``).
    seed: the seed of the random factors, the same on every device.
    matrix_view: ``"flax"`` (fan-in × fan-out of Flax kernels) or ``"torch"`` (torch's view of
      torch-layout arrays); see ``PowerSGDConfig``.
    alternating: half a power iteration per step, one all-reduce (epfml's variant; see the module
      docstring and ``PowerSGDConfig``).
    compress: ``compress(path, leaf) -> bool``: which leaves may be compressed; the others are
      averaged densely (with their "local minus mean" error feedback). None: every leaf.
    bucket_cap_mb: None: every collective holds all leaves. A size in MiB: DDP's buckets, each with
      its own state and collectives, which depend on its own gradients only (for overlap with the
      backward pass; XLA may still combine them, as XLA:CPU does).

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState`` (with ``bucket_cap_mb``: a
    ``CommHookState`` of one per bucket); its output is identical on every device.

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019. PyTorch ``powerSGD_hook`` (torch 2.13). epfml/powersgd
    (``BasicPowerSGD``, ``num_iters_per_step=1``) for ``alternating``.
  """
  return compressor.transformation(
      POWERSGD, axis_name, bucket_cap_mb, rank=rank, start_iter=start_iter,
      min_compression_rate=min_compression_rate, error_feedback=error_feedback,
      warm_start=warm_start, epsilon=epsilon, seed=seed, matrix_view=matrix_view,
      alternating=alternating, compress=compress)


def batched_powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
                     error_feedback: bool = True, warm_start: bool = True,
                     seed: int = 0) -> optax.GradientTransformation:
  """Batched PowerSGD: the whole gradient as one zero-padded square matrix with one P and Q.

  Torch's ``batched_powerSGD_hook`` (which raises at its first compressed step in torch 2.13): the
  reduced leaves of each dtype are raveled into one vector of length L, zero-padded to side² with
  ``side = ceil(sqrt(L))`` and compressed as one (side, side) matrix with the steps of ``powersgd``
  (no epsilon); the error covers the padding too. Faster than layer-wise PowerSGD, but the square
  view destroys the layers' low-rank structure: torch recommends it only at rank 1, and with error
  feedback at high compression it can diverge (a property of the algorithm; see the README).

  Example::

    tx = optax.chain(jaxcomp.batched_powersgd(rank=1, start_iter=100), optax.sgd(0.1))

  Args:
    rank: the approximation rank r (clamped to ``side``).
    axis_name: the mapped axis to average over.
    start_iter: steps of plain mean before compression starts.
    error_feedback: keep each device's compression error and add it to the next gradient.
    warm_start: start each step from the last step's Q (else a fresh random Q).
    seed: the seed of the random Qs, the same on every device.

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState`` (``config.batched`` set).

  References:
    PyTorch ``batched_powerSGD_hook`` (torch 2.13); Vogels et al., NeurIPS 2019.
  """
  return compressor.transformation(BATCHED_POWERSGD, axis_name, rank=rank, start_iter=start_iter,
                                   error_feedback=error_feedback, warm_start=warm_start, seed=seed)
