"""PowerSGD: low-rank gradient compression with error feedback, layer-wise and batched.

``powersgd`` is torch's ``powerSGD_hook`` step for step: with ``matrix_view="torch"`` and torch-layout
arrays it gives torch's outputs and error to float32 rounding (tests/test_powersgd_torch.py checks it
against torch's real hook on two Gloo processes). ``batched_powersgd`` is torch's
``batched_powerSGD_hook``, which raises at its first compressed step in torch 2.13 and works here. The
per-bucket hooks ``jaxcomp.hooks.powersgd_hook`` / ``batched_powersgd_hook`` run this same code on a
``comm_hook`` bucket. ``powersgd(..., alternating=True)`` is the variant of the PowerSGD authors' own
library (github.com/epfml/powersgd, ``num_iters_per_step=1``): half a power iteration per step, one
all-reduce per step instead of two in sequence.

The steps, per device, W devices (the ``# n:`` comments below point here; "torch n" is the numbered
list of ``powerSGD_hook``'s docstring, "Alg. n" the paper's algorithms):

1. Before ``start_iter`` steps: the plain mean, ÷W then one all-reduce SUM (torch: "vanilla
   allreduce for the first start_powerSGD_iter iterations").
2. ``M ← g + e``: add this device's error feedback (Alg. 2 line 7).
3. View and split (torch 1, 1.1, 1.2; Alg. 1 line 1). Layer-wise: each leaf is a matrix (n, m),
   compressed iff ``compress(path, leaf)`` allows it and ``(n + m)·r·min_compression_rate < n·m``
   with ``r = min(n, m, rank)``. Batched: each dtype's leaves, flattened and zero-padded to side²
   with ``side = ceil(sqrt(L))``, are one square matrix, always compressed.
4. Uncompressed leaves: summed in the all-reduce of step 5 (one collective for both; torch sends
   them first, in one of their own), then ÷W (torch 2.1, 2.2).
5. ``Q ← orth(Q)`` (the last step's Q with warm start, else a fresh draw); ``P = M·Q`` locally; all
   Ps in one all-reduce SUM, not divided; ``P̂ = orth(P)`` (torch 3.1–3.4; Alg. 1 lines 3–5).
6. ``Q = Mᵀ·P̂`` locally; all Qs in one all-reduce SUM, then ÷W (torch 3.5, 3.6; Alg. 1 lines 6–7).
7. Output ``P̂·Qᵀ`` (torch 3.7; Alg. 1 line 11); batched: truncated back to the leaves' length.
8. Error feedback: ``e ← M − output`` for every reduced leaf — "local minus mean" for uncompressed
   ones (Alg. 2 line 9, with the averaged factors as torch and the paper's code do).
9. Warm start keeps the divided Q of step 6 for the next step; without it Q is drawn afresh.

Alternating (epfml's ``BasicPowerSGD`` with one iteration per step), in place of 5–9, on the
compressed step number t (counted from ``start_iter``): on even t, ``P̂ = orth(P)``, ``Q = Mᵀ·P̂``
locally, ``e ← M − P̂·Qᵀ`` with this device's own Q (epfml's local error, so it needs no collective),
one all-reduce SUM of the Qs (and of the uncompressed leaves, step 4), output ``P̂·Q̄ᵀ`` with the
mean ``Q̄``, which is kept; on odd t the same with the roles of P and Q exchanged (``Q̂ = orth(Q)``,
``P = M·Q̂``, output ``P̄·Q̂ᵀ``). Each step is one half of the power iteration, started from the factor
the last step sent: one all-reduce per step, and each step sends either the Ps or the Qs.

Collectives per compressed step, in sequence: the 4-byte check that the gradient is finite
everywhere, then the Ps with the uncompressed leaves, then the Qs (alternating: Ps or Qs, with the
uncompressed leaves). Where torch breaks, jaxcomp does not: on a step whose gradient is non-finite on
any device the state (error, factors and count) is kept and the output is NaN (jaxcomp's non-finite
policy, applied inside the step: the gradient is replaced by -0.0, which leaves ``M = e`` exactly, and
the NaN reaches the output through the small factor Q, so no gradient-sized select or copy of the
error is needed); 0-d and 1-D leaves work; an all-zero gradient gives zeros with ``epsilon=0`` (a zero
column is left at zero instead of divided by its zero norm, and a factor column that comes out
all-zero keeps its previous value instead of stalling the power iteration); Gram–Schmidt removes each
finished column twice, so a rank-deficient P still gives orthonormal columns; a rank above
``min(n, m)`` is clamped; float16 / bfloat16 leaves work.

With ``bucket_cap_mb`` the leaves are cut into DDP's buckets (in reverse order, as the backward pass
produces them) and each bucket sends its own collectives, which depend on its own gradients only, so
that a scheduler can overlap them with the rest of the backward pass; the non-finite policy is then
applied after the last bucket (the old error is kept until then: one gradient-sized buffer more).

Under ``jax.pmap`` the state's ``error`` differs per device: build the state per device (for example
``jax.pmap(tx.init)(replicated_params)``, or stack ``tx.init(params)`` W times) and map it with
``in_axes=0``. ``count``, ``q`` and ``p`` come out identical on every device. Under ``shard_map`` the
error is varying along the axis, the rest invariant. Donate the state (``donate_argnums``): the error
is then updated in place.

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019 (https://arxiv.org/abs/1905.13727), Algorithms 1 and 2.
  PyTorch, ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``.
  The PowerSGD authors' library, github.com/epfml/powersgd, ``powersgd/powersgd.py``
  (``BasicPowerSGD``: alternating halves of the power iteration, local error feedback).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._src import axis, finite, validate
from jaxcomp._src import tree as tree_lib
from jaxcomp._src.buckets import bucket_assignment

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_MATRIX_VIEWS = ("torch", "flax")
_MIB = 1024 * 1024


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PowerSGDConfig:
  """PowerSGD's settings, validated; a static pytree node kept in the state.

  The state carries it so that ``jaxcomp.hooks.powersgd_hook(state, bucket)`` finds it. The batched
  variant ignores ``epsilon``, ``min_compression_rate``, ``matrix_view`` and ``compress``.

  Attributes:
    rank: the approximation rank r, clamped to ``min(n, m)`` per matrix. Rank 1 already matches SGD
      on many convolutional networks (the paper's ResNet-18: rank 2 does); transformers need more.
    start_iter: steps of plain mean before compression (torch's ``start_powerSGD_iter``): the first
      steps of training move the most and are the most hurt by compression.
    error_feedback: keep each device's compression error and add it to the next gradient, so
      nothing is lost over time, only delayed (without it PowerSGD is a biased compressor).
    warm_start: start each power iteration from the last step's Q: one iteration per step then
      tracks the gradient's top subspace across steps instead of starting from noise.
    seed: the seed of the random Qs, the same on every device.
    epsilon: added to the column norms in Gram–Schmidt (torch's ``orthogonalization_epsilon``).
    min_compression_rate: compress a leaf only if it shrinks by more than this factor; below it the
      extra compute and two extra all-reduces cost more than the bytes saved.
    matrix_view: ``"flax"``: a leaf of shape ``(..., k)`` is ``(prod(shape[:-1]), k)``, the fan-in
      × fan-out matrix of Flax's Dense and Conv kernels; ``"torch"``: ``(shape[0],
      prod(shape[1:]))``, torch's view of torch-layout arrays. 0-d leaves are (1, 1).
    batched: the batched variant (torch's ``batched_powerSGD_hook``): each dtype's leaves as one
      zero-padded square matrix, one P and Q for all of them, instead of one matrix per leaf.
    alternating: half a power iteration per step (epfml's library): one all-reduce per step instead
      of two in sequence, at the same bytes over two steps; where the network's latency, not its
      bandwidth, bounds the step (small models, many devices), it halves the communication time.
      Layer-wise only; needs ``warm_start`` (each step starts from the factor the last one sent).
    compress: ``compress(path, leaf) -> bool`` with the leaf as a ``jax.ShapeDtypeStruct``: which
      reduced leaves may be compressed (the others are averaged densely, as the leaves below
      ``min_compression_rate`` are); None: all. The replacement for ``optax.masked``, which would
      leave the other leaves un-averaged.
  """
  rank: int = 1
  start_iter: int = 1000
  error_feedback: bool = True
  warm_start: bool = True
  seed: int = 0
  epsilon: float = 0.0
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
        seed=validate.integer(self.seed, "seed", 0, static=in_state),
        epsilon=validate.number(self.epsilon, "epsilon", 0, static=in_state),
        min_compression_rate=validate.number(self.min_compression_rate, "min_compression_rate", 0,
                                             static="decides which leaves are compressed"),
        matrix_view=validate.choice(self.matrix_view, "matrix_view", _MATRIX_VIEWS),
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
    count: steps seen (int32); steps with a non-finite gradient are not counted.
    error: the error-feedback memory, per device. Layer-wise: the params' structure, with
      ``optax.MaskedNode()`` for leaves that are not reduced; batched: a tuple with the flat
      zero-padded error (length side²) of each square. ``optax.MaskedNode()`` everywhere without
      error feedback.
    q: the Q the next compressed step starts from (with warm start the last step's Q, else a fresh
      draw), identical on every device. Layer-wise: the params' structure, a compressed leaf holding
      its Q of shape ``(m, r)`` and the others ``optax.MaskedNode()``; batched: a tuple with the Q of
      shape ``(side, r)`` of each square.
    p: with ``config.alternating``, the P an odd step starts from (the params' structure, a
      compressed leaf holding its P of shape ``(n, r)``), identical on every device; otherwise
      ``optax.MaskedNode()`` throughout.
    config: the static settings.
    signature: the gradient pytree's structure, shapes and dtypes.
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


class _Matrix(NamedTuple):
  """How one leaf is compressed: viewed as (n, m), effective rank r, compressed or sent dense."""
  n: int
  m: int
  rank: int
  compress: bool


class _Square(NamedTuple):
  """One batched matrix: the leaves (indices) of one dtype, length L, side ceil(sqrt(L)), rank r."""
  leaves: tuple
  length: int
  side: int
  rank: int


@functools.lru_cache(maxsize=None)
def _matrices(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> tuple:
  """Per leaf a ``_Matrix``, or None for leaves passed through."""
  plan: list = [None] * len(signature.shapes)
  paths = signature.paths
  for i in signature.reduced:
    shape = signature.shapes[i]
    if not shape:
      n, m = 1, 1
    elif config.matrix_view == "torch":
      n, m = shape[0], math.prod(shape[1:])
    else:
      n, m = math.prod(shape[:-1]), shape[-1]
    rank = min(n, m, config.rank)
    # 3: compress iff the predicate allows it and (n + m)·r·rate < n·m, with the effective rank.
    allowed = config.compress is None or bool(
        config.compress(paths[i], jax.ShapeDtypeStruct(shape, signature.dtypes[i])))
    plan[i] = _Matrix(n, m, rank,
                      allowed and (n + m) * rank * config.min_compression_rate < n * m)
  return tuple(plan)


@functools.lru_cache(maxsize=None)
def _squares(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> tuple:
  """The batched matrices: one per dtype, in order of first appearance."""
  groups: dict = {}
  for i in signature.reduced:
    groups.setdefault(signature.dtypes[i], []).append(i)
  squares = []
  for leaves in groups.values():
    length = sum(math.prod(signature.shapes[i]) for i in leaves)
    side = math.ceil(math.sqrt(length))
    squares.append(_Square(tuple(leaves), length, side, min(side, config.rank)))
  return tuple(squares)


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
    steps = max(int(np.max(np.asarray(state.count))) - state.config.start_iter, 0)
    if state.config.batched:
      squares = _squares(state.config, state.signature)
      before += steps * sum(s.length for s in squares)
      after += steps * sum(2 * s.side * s.rank for s in squares)
      continue
    plan = [p for p in _matrices(state.config, state.signature) if p is not None]
    before += steps * sum(p.n * p.m for p in plan)
    after += steps * sum(p.n * p.m for p in plan if not p.compress)
    if state.config.alternating:
      q_steps, p_steps = (steps + 1) // 2, steps // 2
      after += sum((q_steps * p.m + p_steps * p.n) * p.rank for p in plan if p.compress)
    else:
      after += steps * sum((p.n + p.m) * p.rank for p in plan if p.compress)
  return (before / after if after else 0, before, after)


# ---------------------------------------------------------------------------------------------------
# The math shared by both variants and by the hooks.


def orthogonalize(x: jax.Array, epsilon: float = 0.0) -> jax.Array:
  """Orthonormalizes the columns of ``x`` (n, r) as torch does.

  Modified Gram–Schmidt when r ≤ 2 or ``x`` is float16 / bfloat16, else QR (which ignores
  ``epsilon``). Gram–Schmidt takes the columns in order: remove the earlier (finished) columns from
  column i, then ``col /= norm(col) + epsilon``. Three departures from torch, all at rounding level
  when ``x`` has full rank: the earlier columns are removed twice ("twice is enough"), because after
  torch's single pass the columns of a rank-deficient ``x`` come out far from orthogonal (194 of 200
  random rank-1 float32 (20, 2) matrices in torch 2.13), and P̂·Qᵀ then scales the gradient instead of
  projecting it; an all-zero column stays zero when ``epsilon`` is 0 instead of becoming NaN; and
  half-precision norms are taken in float32, where the squares cannot overflow.
  """
  rank = x.shape[1]
  if rank > 2 and x.dtype not in _HALF:
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


def _left_product(mat: jax.Array, p: jax.Array) -> jax.Array:
  """``Mᵀ·P`` (m, r) as one vector–matrix product ``P[:, j]ᵀ·M`` per column.

  XLA:CPU runs ``M.T @ P`` (and its ``einsum`` / ``dot_general`` forms) by walking M's columns with
  a stride of m elements: about 15× the time of reading M row by row, which is what each
  vector–matrix product does (measured on (1024, 1024) f32 matrices, r = 1 to 8).
  """
  return jnp.stack([p[:, j] @ mat for j in range(p.shape[1])], axis=1)


def _product(p: jax.Array, q: jax.Array) -> jax.Array:
  """``P·Qᵀ`` (n, m). Up to rank 8 as a sum of r outer products: elementwise, so XLA computes it
  inside whatever consumes it (the error update, the output) instead of writing an (n, m) matrix
  first, which it does for a matrix product."""
  if p.shape[1] > 8:
    return p @ q.T
  return sum(p[:, j, None] * q[None, :, j] for j in range(p.shape[1]))


def _kept_if_zero(new: jax.Array, old: jax.Array) -> jax.Array:
  """The factor kept for the next step, in ``old``'s dtype: a column that came out all-zero keeps
  its old value (it would stall the power iteration)."""
  return jnp.where(jnp.all(new == 0, axis=0, keepdims=True), old, new.astype(old.dtype))


def _next_q(config: PowerSGDConfig, count, index: int, new: jax.Array, old: jax.Array) -> jax.Array:
  """9: the Q the next step starts from: with warm start the new Q (``_kept_if_zero``), without it
  a fresh draw."""
  if not config.warm_start:
    return _draw(config, count + 1, index, old.shape, old.dtype)
  return _kept_if_zero(new, old)


def _draw(config: PowerSGDConfig, step, index: int, shape: tuple, dtype) -> jax.Array:
  """A standard-normal Q, the same on every device: from ``seed``, the step and the matrix's index."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), step), index)
  return jax.random.normal(key, shape, dtype)


def _plus_error(ok, g: jax.Array, error) -> jax.Array:
  """2: ``M = g + e``. Given the finiteness flag ``ok``, a non-finite step adds -0.0 instead of g,
  which leaves M equal to e bit for bit (x + -0.0 is x for every x, -0.0 included), so the error
  can be computed in place of the old one and still be kept exactly."""
  if ok is not None:
    g = finite.keep_if_finite(ok, g, jnp.full_like(g, -0.0))
  if error is None:
    return g
  # The barrier keeps XLA from recomputing g + e inside the error's update, which would read the old
  # error again after the new one is written to its buffer and so make XLA copy it first.
  return lax.optimization_barrier(g + error.astype(g.dtype))


def _kept_error(ok, new, m):
  """8 under the non-finite policy: ``new``, or on a non-finite step M (which is then e)."""
  return new if ok is None else finite.keep_if_finite(ok, new, m)


def _nan_factor(ok, factor):
  """The factor an output is made of, NaN on a non-finite step: the whole output is then NaN."""
  return factor if ok is None else finite.nan_unless_finite(ok, factor)


# ---------------------------------------------------------------------------------------------------
# Steps over a group of leaves (all of them, or one bucket's): ``(outputs, errors, qs, ps)`` as
# dicts from leaf index to value, for that group only.


def _torch_power_step(config, ms: dict, qs: dict, dense: list, packed: list, plan, ok,
                      axis_name) -> tuple:
  """Steps 4–9 as torch runs them: two all-reduces (the Ps with the uncompressed leaves, then Qs)."""
  mats = {i: ms[i].reshape(plan[i].n, plan[i].m) for i in packed}
  # 5: Q ← orth(Q); P = M·Q locally. 4 and 5: one all-reduce SUM of the uncompressed leaves and of
  # every P (torch sends the uncompressed leaves first, in an all-reduce of their own).
  in_qs = [orthogonalize(qs[i].astype(ms[i].dtype), config.epsilon) for i in packed]
  sums = axis.psum_many([ms[i] for i in dense] + [mats[i] @ q for i, q in zip(packed, in_qs)],
                        axis_name)
  outputs = {i: axis.divide_by_world(s, axis_name) for i, s in zip(dense, sums)}  # 4: then ÷W
  p_hats = [orthogonalize(p, config.epsilon) for p in sums[len(dense):]]  # 5: P̂ = orth(P)
  # 6: Q = Mᵀ·P̂ locally; all Qs in one all-reduce SUM, then ÷W.
  new_qs = [axis.divide_by_world(q, axis_name) for q in axis.psum_many(
      [_left_product(mats[i], p) for i, p in zip(packed, p_hats)], axis_name)]
  errors, next_qs = {}, {}
  for k, (i, p, q) in enumerate(zip(packed, p_hats, new_qs)):
    outputs[i] = _product(p, _nan_factor(ok, q)).reshape(ms[i].shape)  # 7: P̂·Qᵀ
    if config.error_feedback:  # 8: e ← M − P̂·Qᵀ
      errors[i] = _kept_error(ok, ms[i] - _product(p, q).reshape(ms[i].shape), ms[i])
    next_qs[i] = q
  return outputs, errors, next_qs, {}


def _alternating_step(config, ms: dict, qs: dict, ps: dict, ok, dense: list, packed: list, plan,
                      axis_name, q_half: bool) -> tuple:
  """Alternating steps 4–9: half the power iteration, one all-reduce (``q_half``: send the Qs)."""
  mats = {i: ms[i].reshape(plan[i].n, plan[i].m) for i in packed}
  ins = {i: orthogonalize((ps if q_half else qs)[i].astype(ms[i].dtype), config.epsilon)
         for i in packed}
  # Q = Mᵀ·P̂ (or P = M·Q̂) locally, and the local error with it, before any communication.
  outs = {i: _left_product(mats[i], ins[i]) if q_half else mats[i] @ ins[i] for i in packed}
  errors = {}
  if config.error_feedback:
    for i in packed:
      low_rank = _product(ins[i], outs[i]) if q_half else _product(outs[i], ins[i])
      errors[i] = _kept_error(ok, ms[i] - low_rank.reshape(ms[i].shape), ms[i])
  # 4 and the half step: one all-reduce SUM of the uncompressed leaves and of the factors, then ÷W.
  sums = [axis.divide_by_world(s, axis_name)
          for s in axis.psum_many([ms[i] for i in dense] + [outs[i] for i in packed], axis_name)]
  outputs = dict(zip(dense, sums))
  means = dict(zip(packed, sums[len(dense):]))
  for i in packed:
    mean = _nan_factor(ok, means[i])
    outputs[i] = (_product(ins[i], mean) if q_half else _product(mean, ins[i])).reshape(
        ms[i].shape)
  # The other factor is returned unchanged: both branches of the step's cond return both.
  kept_qs = {i: qs[i].astype(ms[i].dtype) for i in packed}
  kept_ps = {i: ps[i].astype(ms[i].dtype) for i in packed}
  return outputs, errors, means if q_half else kept_qs, kept_ps if q_half else means


def _layerwise(state: PowerSGDState, leaves: list, group: list, ok, axis_name) -> tuple:
  """A compressed layer-wise step (steps 2–9) over the leaves ``group``."""
  config, plan = state.config, _matrices(state.config, state.signature)
  flat = [state.signature.treedef.flatten_up_to(t) for t in (state.error, state.q, state.p)]
  errors, qs, ps = ({i: t[i] for i in group} for t in flat)
  # 2: M ← g + e.
  ms = {i: _plus_error(ok, leaves[i], errors[i] if config.error_feedback else None) for i in group}
  # 3: split by the compress test (``_matrices``).
  dense = [i for i in group if not plan[i].compress]
  packed = [i for i in group if plan[i].compress]
  if config.alternating:
    def half(q_half, operands):
      return _alternating_step(config, *operands, dense, packed, plan, axis_name, q_half)

    even = (state.count - config.start_iter) % 2 == 0
    outputs, new_errors, new_qs, new_ps = lax.cond(
        even, functools.partial(half, True), functools.partial(half, False), (ms, qs, ps, ok))
  else:
    outputs, new_errors, new_qs, new_ps = _torch_power_step(config, ms, qs, dense, packed, plan, ok,
                                                            axis_name)
  if config.error_feedback:  # 8: "local minus mean" for the uncompressed leaves
    for i in dense:
      new_errors[i] = _kept_error(ok, ms[i] - outputs[i], ms[i])
    errors = {i: new_errors[i].astype(errors[i].dtype) for i in group}
  for i in dense:
    outputs[i] = _nan_factor(ok, outputs[i])
  ordinal = _ordinals(plan)
  for i in packed:  # 9: the factors the next step starts from
    qs[i] = _next_q(config, state.count, ordinal[i], new_qs[i], qs[i])
    if config.alternating:
      ps[i] = _kept_if_zero(new_ps[i], ps[i])
  return outputs, errors, qs, ps


def _ordinals(plan) -> dict:
  """Leaf index -> the compressed matrix's number (it seeds the matrix's random Q)."""
  return {i: k for k, i in enumerate(i for i, p in enumerate(plan) if p is not None and p.compress)}


def _batched(state: PowerSGDState, leaves: list, ok, axis_name) -> tuple:
  """A compressed batched step (steps 2–9): one zero-padded square matrix per dtype.

  Returns ``(outputs, errors, qs)`` as dicts, from leaf index to output and from the square's
  number to its new error and Q.
  """
  config = state.config
  squares = _squares(config, state.signature)
  ms = []
  for k, square in enumerate(squares):
    # 3: each dtype's gradient as a square, zero-padded; 2: then M ← g + e over it.
    flat = tree_lib.flatten([leaves[i] for i in square.leaves])
    ms.append(_plus_error(ok, jnp.pad(flat, (0, square.side**2 - square.length)),
                          state.error[k] if config.error_feedback else None))
  # 5, 6: one P and Q per square (torch's batched hook passes no epsilon; nothing is uncompressed).
  mats = [m.reshape(s.side, s.side) for m, s in zip(ms, squares)]
  in_qs = [orthogonalize(q.astype(m.dtype)) for q, m in zip(state.q, ms)]
  p_hats = [orthogonalize(p) for p in axis.psum_many([m @ q for m, q in zip(mats, in_qs)],
                                                     axis_name)]
  new_qs = [axis.divide_by_world(q, axis_name) for q in axis.psum_many(
      [_left_product(m, p) for m, p in zip(mats, p_hats)], axis_name)]
  outputs, errors, qs = {}, dict(enumerate(state.error)), {}
  for k, (square, m, p, q) in enumerate(zip(squares, ms, p_hats, new_qs)):
    if config.error_feedback:  # 8: e ← M − P̂·Qᵀ, the padding included
      errors[k] = _kept_error(ok, m - _product(p, q).reshape(-1), m).astype(state.error[k].dtype)
    qs[k] = _next_q(config, state.count, k, q, state.q[k])  # 9
    # 7: P̂·Qᵀ, truncated to the leaves' length.
    out = _product(p, _nan_factor(ok, q)).reshape(-1)[:square.length]
    outputs.update(zip(square.leaves, tree_lib.unflatten(
        out, [state.signature.shapes[i] for i in square.leaves])))
  return outputs, errors, qs


def _step(state: PowerSGDState, leaves: list, groups: list, axis_name, ok=None) -> tuple:
  """One step of either variant on the reduced leaves, group by group (one group, or one per
  bucket): step 1 before ``start_iter``, the compressed step from then on.

  Args:
    state: the state.
    leaves: the gradient's leaves (possibly of another float dtype than the state's, e.g. cast by
      ``fp16_compress_wrapper``: the step then runs in their dtype and the state keeps its own).
    groups: lists of reduced leaf indices that send their own collectives, which depend on their own
      leaves only; batched: one group, all reduced leaves.
    axis_name: the mapped axis.
    ok: the all-device finiteness flag, to apply the non-finite policy inside the step (the leaves
      must then have the state's dtypes); None: the new state is not gated.

  Returns:
    ``(output leaves, new state)``.
  """
  config, treedef = state.config, state.signature.treedef
  if config.batched:  # the state is per square; keys below are square numbers
    errors, qs, ps = dict(enumerate(state.error)), dict(enumerate(state.q)), {}
  else:  # keys below are leaf indices
    errors, qs, ps = (dict(enumerate(treedef.flatten_up_to(t)))
                      for t in (state.error, state.q, state.p))
  outputs = list(leaves)
  for group in filter(None, groups):
    keys = list(errors) if config.batched else group

    def plain(operands, group=group, keys=keys):  # 1: ÷W, then one all-reduce SUM
      grads, ok = operands
      if ok is not None:
        grads = finite.nan_unless_finite(ok, grads)
      return (dict(zip(group, axis.mean_many(grads, axis_name))), {i: errors[i] for i in keys},
              {i: qs[i] for i in keys}, {i: ps[i] for i in keys if i in ps})

    def compressed(operands, group=group):
      if config.batched:
        return (*_batched(state, leaves, operands[1], axis_name), {})
      return _layerwise(state, leaves, group, operands[1], axis_name)

    operands = ([leaves[i] for i in group], ok)
    if config.start_iter == 0:
      out, new_errors, new_qs, new_ps = compressed(operands)
    else:
      out, new_errors, new_qs, new_ps = lax.cond(state.count < config.start_iter, plain,
                                                 compressed, operands)
    for i, value in out.items():
      outputs[i] = value
    errors.update(new_errors)
    qs.update(new_qs)
    ps.update(new_ps)
  if config.batched:
    new_fields = dict(error=tuple(errors.values()), q=tuple(qs.values()))
  else:
    new_fields = dict(zip(("error", "q", "p"), (treedef.unflatten(list(t.values()))
                                                for t in (errors, qs, ps))))
  new_state = state._replace(count=state.count + 1, **new_fields)
  if ok is not None:  # the error is kept inside the step; the count and the factors here
    kept = finite.keep_if_finite(ok, (new_state.count, new_state.q, new_state.p),
                                 (state.count, state.q, state.p))
    new_state = new_state._replace(count=kept[0], q=kept[1], p=kept[2])
  return outputs, new_state


def init_state(config: PowerSGDConfig, params) -> PowerSGDState:
  """The initial state for gradients shaped like ``params``: zero error, factors drawn from ``seed``."""
  signature = tree_lib.TreeSignature.of(params)
  if config.batched:
    squares = _squares(config, signature)
    dtypes = [signature.dtypes[s.leaves[0]] for s in squares]
    error = tuple(jnp.zeros([s.side**2], d) if config.error_feedback else optax.MaskedNode()
                  for s, d in zip(squares, dtypes))
    q = tuple(_draw(config, 0, k, (s.side, s.rank), d)
              for k, (s, d) in enumerate(zip(squares, dtypes)))
    return PowerSGDState(jnp.zeros([], jnp.int32), error, q,
                         signature.unflatten([optax.MaskedNode()] * len(signature.shapes)),
                         config, signature)
  plan = _matrices(config, signature)
  ordinal = _ordinals(plan)
  error, q, p = [], [], []
  for i, (shape, dtype, matrix) in enumerate(zip(signature.shapes, signature.dtypes, plan)):
    error.append(jnp.zeros(shape, dtype) if matrix is not None and config.error_feedback
                 else optax.MaskedNode())
    compressed = matrix is not None and matrix.compress
    q.append(_draw(config, 0, ordinal[i], (matrix.m, matrix.rank), dtype) if compressed
             else optax.MaskedNode())
    # The alternating variant's first step starts from P, drawn after every Q.
    p.append(_draw(config, 0, len(ordinal) + ordinal[i], (matrix.n, matrix.rank), dtype)
             if compressed and config.alternating else optax.MaskedNode())
  return PowerSGDState(jnp.zeros([], jnp.int32), *map(signature.unflatten, (error, q, p)), config,
                       signature)


def update(state: PowerSGDState, grads, axis_name: axis.AxisName, *, batched: bool) -> tuple:
  """One step on ``grads`` (shaped as at init; any float dtype), not gated on non-finite gradients.

  The core of ``jaxcomp.hooks.powersgd_hook`` (``batched=False``) and ``batched_powersgd_hook``.

  Returns:
    ``(the reduced leaves, identical on every device; the new state)``.
  """
  hook = "batched_powersgd_hook" if batched else "powersgd_hook"
  if not isinstance(state, PowerSGDState) or state.config.batched != batched:
    maker = hook[:-len("_hook")] + "_state"
    raise TypeError(f"{hook} needs the per-bucket state made by jaxcomp.hooks.{maker}(...), "
                    f"as in comm_hook({hook}, {maker}(rank=1)); got {type(state).__name__}"
                    + (f" of {'batched' if state.config.batched else 'layer-wise'} PowerSGD"
                       if isinstance(state, PowerSGDState) else ""))
  leaves = state.signature.check(grads, "bucket", dtypes=False)
  return _step(state, leaves, [list(state.signature.reduced)], axis_name)


def _transformation(config: PowerSGDConfig, axis_name,
                    bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """The transformation: the signature check, the step, the non-finite policy."""
  axis_name = axis.check_axis_name(axis_name)
  if bucket_cap_mb is not None:
    cap = validate.number(bucket_cap_mb, "bucket_cap_mb", 0, low_open=True,
                          static="decides which leaves share a collective") * _MIB

  init_fn = functools.partial(init_state, config)

  def update_fn(updates, state, params=None):
    del params
    tree_lib.check_state(state, init_fn, "batched_powersgd" if config.batched else "powersgd")
    leaves = state.signature.check(updates)
    ok = finite.all_finite(leaves, axis_name)
    if bucket_cap_mb is None:  # the policy inside the step: the error is updated in place
      outputs, new_state = _step(state, leaves, [list(state.signature.reduced)], axis_name, ok)
    else:  # per bucket, each independent of the flag (it needs the whole gradient); policy after
      buckets = [list(b) for b in bucket_assignment(state.signature, cap, cap)]
      outputs, new_state = _step(state, leaves, buckets, axis_name)
      outputs, new_state = finite.gated(ok, outputs, new_state, state)
    return tree_lib.like(updates, outputs), new_state

  return optax.GradientTransformation(init_fn, update_fn)


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

  Example::

    tx = optax.chain(jaxcomp.powersgd(rank=2, start_iter=100), optax.sgd(0.1, momentum=0.9))
    # Only the kernels, the rest averaged densely (instead of optax.masked, which would not average
    # the rest at all):
    tx = jaxcomp.powersgd(rank=2, compress=lambda path, leaf: "kernel" in path)

  Args:
    rank: the approximation rank r (clamped to ``min(n, m)`` per leaf).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    start_iter: number of steps of plain mean before compression starts (torch's
      ``start_powerSGD_iter``; 0 compresses from the first step). About 10% of training is torch's
      and the paper's advice.
    min_compression_rate: compress a leaf only if its size shrinks by more than this factor.
    error_feedback: keep each device's compression error and add it to the next gradient.
    warm_start: start each step's power iteration from the last step's Q (else a fresh random Q).
    epsilon: added to the column norms in Gram–Schmidt.
    seed: the seed of the random Qs, the same on every device.
    matrix_view: ``"flax"`` (fan-in × fan-out of Flax kernels) or ``"torch"`` (torch's view of
      torch-layout arrays); see ``PowerSGDConfig``.
    alternating: half a power iteration per step, one all-reduce (epfml's variant; see the module
      docstring and ``PowerSGDConfig``).
    compress: ``compress(path, leaf) -> bool``: which leaves may be compressed; the others are
      averaged densely (with their "local minus mean" error feedback). None: every leaf.
    bucket_cap_mb: None: every collective holds all leaves. A size in MiB: DDP's buckets, each
      sending its own collectives as soon as its gradients exist (for overlap with the backward
      pass; XLA may still combine them, as XLA:CPU always does, unless each exceeds its combine
      threshold). It keeps the old error until the end of the step (one gradient more memory).

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState``; its output is identical on every device.

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019. PyTorch ``powerSGD_hook`` (torch 2.13). epfml/powersgd
    (``BasicPowerSGD``, ``num_iters_per_step=1``) for ``alternating``.
  """
  config = PowerSGDConfig(rank=rank, start_iter=start_iter, error_feedback=error_feedback,
                          warm_start=warm_start, seed=seed, epsilon=epsilon,
                          min_compression_rate=min_compression_rate, matrix_view=matrix_view,
                          alternating=alternating, compress=compress)
  return _transformation(config, axis_name, bucket_cap_mb)


def batched_powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
                     error_feedback: bool = True, warm_start: bool = True,
                     seed: int = 0) -> optax.GradientTransformation:
  """Batched PowerSGD: the whole gradient as one zero-padded square matrix with one P and Q.

  Torch's ``batched_powerSGD_hook`` (which raises at its first compressed step in torch 2.13): the
  reduced leaves of each dtype are flattened into one vector of length L, zero-padded to side² with
  ``side = ceil(sqrt(L))`` and compressed as one (side, side) matrix with the steps of ``powersgd``
  (no epsilon); the error covers the padding too. Faster than layer-wise PowerSGD, but the square
  view destroys the layers' low-rank structure: torch recommends it only at rank 1, and with error
  feedback at high compression it can diverge (a property of the algorithm; see the README).

  Args:
    rank: the approximation rank r (clamped to ``side``).
    axis_name: the mapped axis to average over.
    start_iter: number of steps of plain mean before compression starts.
    error_feedback: keep each device's compression error and add it to the next gradient.
    warm_start: start each step from the last step's Q (else a fresh random Q).
    seed: the seed of the random Qs, the same on every device.

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState`` (``config.batched`` set).

  References:
    PyTorch ``batched_powerSGD_hook`` (torch 2.13); Vogels et al., NeurIPS 2019.
  """
  return _transformation(PowerSGDConfig(rank=rank, start_iter=start_iter,
                                        error_feedback=error_feedback, warm_start=warm_start,
                                        seed=seed, batched=True), axis_name)
