"""PowerSGD: low-rank gradient compression with error feedback, layer-wise and batched.

``powersgd`` is torch's ``powerSGD_hook`` step for step: with ``matrix_view="torch"`` and torch-layout
arrays it gives torch's outputs and error to float32 rounding (tests/test_powersgd_torch.py checks it
against torch's real hook on two Gloo processes). ``batched_powersgd`` is torch's
``batched_powerSGD_hook``, which raises at its first compressed step in torch 2.13 and works here. The
per-bucket hooks ``jaxcomp.hooks.powersgd_hook`` / ``batched_powersgd_hook`` run this same code on a
``comm_hook`` bucket.

The steps, per device, W devices (the ``# n:`` comments below point here; "torch n" is the numbered
list of ``powerSGD_hook``'s docstring, "Alg. n" the paper's algorithms):

1. Before ``start_iter`` steps: the plain mean, ÷W then one all-reduce SUM (torch: "vanilla
   allreduce for the first start_powerSGD_iter iterations").
2. ``M ← g + e``: add this device's error feedback (Alg. 2 line 7).
3. View and split (torch 1, 1.1, 1.2; Alg. 1 line 1). Layer-wise: each leaf is a matrix (n, m),
   compressed iff ``(n + m)·r·min_compression_rate < n·m`` with ``r = min(n, m, rank)``. Batched:
   each dtype's leaves, flattened and zero-padded to side² with ``side = ceil(sqrt(L))``, are one
   square matrix, always compressed.
4. Uncompressed leaves: one all-reduce SUM of all of them, then ÷W (torch 2.1, 2.2).
5. ``Q ← orth(Q)`` (the last step's Q with warm start, else a fresh draw); ``P = M·Q`` locally; all
   Ps in one all-reduce SUM, not divided; ``P̂ = orth(P)`` (torch 3.1–3.4; Alg. 1 lines 3–5).
6. ``Q = Mᵀ·P̂`` locally; all Qs in one all-reduce SUM, then ÷W (torch 3.5, 3.6; Alg. 1 lines 6–7).
7. Output ``P̂·Qᵀ`` (torch 3.7; Alg. 1 line 11); batched: truncated back to the leaves' length.
8. Error feedback: ``e ← M − output`` for every reduced leaf — "local minus mean" for uncompressed
   ones (Alg. 2 line 9, with the averaged factors as torch and the paper's code do).
9. Warm start keeps the divided Q of step 6 for the next step; without it Q is drawn afresh.

Three all-reduces per compressed step, in sequence (4, 5, 6), plus the 4-byte check that the
gradient is finite everywhere. Where torch breaks, jaxcomp does not: on a step whose gradient is
non-finite on any device the state (error, Q and count) is kept and the output is NaN (jaxcomp's
non-finite policy); 0-d and 1-D leaves work; an all-zero gradient gives zeros with ``epsilon=0`` (a
zero column is left at zero instead of divided by its zero norm, and a Q column that comes out
all-zero keeps its previous value instead of stalling the power iteration); Gram–Schmidt removes each
finished column twice, so a rank-deficient P still gives orthonormal columns; a rank above
``min(n, m)`` is clamped; float16 / bfloat16 leaves work.

Under ``jax.pmap`` the state's ``error`` differs per device: build the state per device (for example
``jax.pmap(tx.init)(replicated_params)``, or stack ``tx.init(params)`` W times) and map it with
``in_axes=0``. ``count`` and ``q`` come out identical on every device. Under ``shard_map`` the error is
varying along the axis, the rest invariant.

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019 (https://arxiv.org/abs/1905.13727), Algorithms 1 and 2.
  PyTorch, ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._src import axis, finite, validate
from jaxcomp._src import tree as tree_lib

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_MATRIX_VIEWS = ("torch", "flax")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PowerSGDConfig:
  """PowerSGD's settings, validated; a static pytree node kept in the state.

  The state carries it so that ``jaxcomp.hooks.powersgd_hook(state, bucket)`` finds it. The batched
  variant ignores ``epsilon``, ``min_compression_rate`` and ``matrix_view``.

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

  def __post_init__(self):
    static = "fixes the shapes of P and Q"
    checked = dict(
        rank=validate.integer(self.rank, "rank", 1, static=static),
        start_iter=validate.integer(self.start_iter, "start_iter", 0),
        error_feedback=validate.boolean(self.error_feedback, "error_feedback"),
        warm_start=validate.boolean(self.warm_start, "warm_start"),
        seed=validate.integer(self.seed, "seed", 0),
        epsilon=validate.number(self.epsilon, "epsilon", 0),
        min_compression_rate=validate.number(self.min_compression_rate, "min_compression_rate", 0,
                                             static="decides which leaves are compressed"),
        matrix_view=validate.choice(self.matrix_view, "matrix_view", _MATRIX_VIEWS),
        batched=validate.boolean(self.batched, "batched"))
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
    config: the static settings.
    signature: the gradient pytree's structure, shapes and dtypes.
  """
  count: jax.Array
  error: Any
  q: Any
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
  for i in signature.reduced:
    shape = signature.shapes[i]
    if not shape:
      n, m = 1, 1
    elif config.matrix_view == "torch":
      n, m = shape[0], math.prod(shape[1:])
    else:
      n, m = math.prod(shape[:-1]), shape[-1]
    rank = min(n, m, config.rank)
    # 3: compress iff (n + m)·r·rate < n·m, with the effective rank.
    plan[i] = _Matrix(n, m, rank, (n + m) * rank * config.min_compression_rate < n * m)
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
    taken so far (rate 0 before the first), as torch's ``PowerSGDState.compression_stats()``.
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
    else:
      plan = [p for p in _matrices(state.config, state.signature) if p is not None]
      before += steps * sum(p.n * p.m for p in plan)
      after += steps * sum((p.n + p.m) * p.rank if p.compress else p.n * p.m for p in plan)
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


def _power_step(mats: list, qs: list, epsilon: float, axis_name) -> tuple:
  """Steps 5–7 for all compressed matrices: two all-reduces in all.

  Args:
    mats: the local matrices M (n, m), error feedback already added.
    qs: their Q (m, r) from the last step or a fresh draw, not yet orthogonalized.
    epsilon: added to the column norms in Gram–Schmidt.
    axis_name: the mapped axis.

  Returns:
    ``(outputs P̂·Qᵀ, Qs divided by W)``.
  """
  # 5: Q ← orth(Q); P = M·Q locally; all Ps in one all-reduce SUM, not divided; P̂ = orth(P).
  qs = [orthogonalize(q, epsilon) for q in qs]
  ps = axis.psum_many([mat @ q for mat, q in zip(mats, qs)], axis_name)
  ps = [orthogonalize(p, epsilon) for p in ps]
  # 6: Q = Mᵀ·P̂ locally; all Qs in one all-reduce SUM, then ÷W.
  qs = [axis.divide_by_world(q, axis_name)
        for q in axis.psum_many([mat.T @ p for mat, p in zip(mats, ps)], axis_name)]
  # 7: decompress, P̂·Qᵀ.
  return [p @ q.T for p, q in zip(ps, qs)], qs


def _next_q(config: PowerSGDConfig, count, index: int, new: jax.Array, old: jax.Array) -> jax.Array:
  """9: the Q the next step starts from, in ``old``'s dtype.

  With warm start the new Q, except that an all-zero column keeps its old value (it would stall);
  without it a fresh draw.
  """
  if not config.warm_start:
    return _draw(config, count + 1, index, old.shape, old.dtype)
  return jnp.where(jnp.all(new == 0, axis=0, keepdims=True), old, new.astype(old.dtype))


def _draw(config: PowerSGDConfig, step, index: int, shape: tuple, dtype) -> jax.Array:
  """A standard-normal Q, the same on every device: from ``seed``, the step and the matrix's index."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), step), index)
  return jax.random.normal(key, shape, dtype)


def _step(state: PowerSGDState, leaves: list, axis_name) -> tuple:
  """One step of either variant: step 1 before ``start_iter``, the compressed step from then on.

  Args:
    state: the state.
    leaves: the gradient's leaves (possibly of another float dtype than the state's, e.g. cast by
      ``fp16_compress_wrapper``: the step then runs in their dtype and the state keeps its own).
    axis_name: the mapped axis.

  Returns:
    ``(output leaves, new state)``; the new state is not gated on non-finite gradients.
  """
  reduced = list(state.signature.reduced)

  def plain(_):  # 1: ÷W, then one all-reduce SUM (torch's allreduce_hook)
    return axis.mean_many([leaves[i] for i in reduced], axis_name), state.error, state.q

  def compressed(_):
    return (_batched if state.config.batched else _layerwise)(state, leaves, reduced, axis_name)

  if state.config.start_iter == 0:
    outputs, error, q = compressed(None)
  else:
    outputs, error, q = lax.cond(state.count < state.config.start_iter, plain, compressed, None)
  leaves = list(leaves)
  for i, out in zip(reduced, outputs):
    leaves[i] = out
  return leaves, state._replace(count=state.count + 1, error=error, q=q)


def _layerwise(state: PowerSGDState, leaves: list, reduced: list, axis_name) -> tuple:
  """A compressed layer-wise step (steps 2–9, torch's order), leaf by leaf."""
  config, treedef = state.config, state.signature.treedef
  plan = _matrices(config, state.signature)
  errors, qs = treedef.flatten_up_to(state.error), treedef.flatten_up_to(state.q)
  # 2: M ← g + e.
  ms = {i: leaves[i] + errors[i].astype(leaves[i].dtype) if config.error_feedback else leaves[i]
        for i in reduced}
  # 3: split by the compress test (``_matrices``).
  dense = [i for i in reduced if not plan[i].compress]
  packed = [i for i in reduced if plan[i].compress]
  # 4: the uncompressed leaves in one all-reduce SUM, then ÷W.
  outputs = {i: axis.divide_by_world(s, axis_name)
             for i, s in zip(dense, axis.psum_many([ms[i] for i in dense], axis_name))}
  # 5–7: the power step.
  mats = [ms[i].reshape(plan[i].n, plan[i].m) for i in packed]
  low_rank, new_qs = _power_step(mats, [qs[i].astype(ms[i].dtype) for i in packed],
                                 config.epsilon, axis_name)
  for i, out in zip(packed, low_rank):
    outputs[i] = out.reshape(ms[i].shape)
  if config.error_feedback:  # 8: e ← M − output, "local minus mean" for the uncompressed leaves
    for i in reduced:
      errors[i] = (ms[i] - outputs[i]).astype(errors[i].dtype)
  for k, (i, new) in enumerate(zip(packed, new_qs)):  # 9: the next step's Q
    qs[i] = _next_q(config, state.count, k, new, qs[i])
  return ([outputs[i] for i in reduced], treedef.unflatten(errors), treedef.unflatten(qs))


def _batched(state: PowerSGDState, leaves: list, reduced: list, axis_name) -> tuple:
  """A compressed batched step (steps 2–9): one zero-padded square matrix per dtype."""
  del reduced  # the squares list them
  config = state.config
  squares = _squares(config, state.signature)
  ms = []
  for k, square in enumerate(squares):
    # 3: each dtype's gradient as a square, zero-padded; 2: then M ← g + e over it.
    flat = tree_lib.flatten([leaves[i] for i in square.leaves])
    m = jnp.pad(flat, (0, square.side**2 - square.length))
    if config.error_feedback:
      m = m + state.error[k].astype(m.dtype)
    ms.append(m)
  # 5–7: one P and Q per square (torch's batched hook passes no epsilon).
  low_rank, qs = _power_step(
      [m.reshape(s.side, s.side) for m, s in zip(ms, squares)],
      [q.astype(m.dtype) for q, m in zip(state.q, ms)], 0.0, axis_name)
  outputs, new_errors, new_qs = [], list(state.error), list(state.q)
  for k, (square, m, out, new) in enumerate(zip(squares, ms, low_rank, qs)):
    out = out.reshape(-1)
    if config.error_feedback:  # 8: e ← M − output, the padding included
      new_errors[k] = (m - out).astype(state.error[k].dtype)
    new_qs[k] = _next_q(config, state.count, k, new, state.q[k])  # 9
    # 7: truncated to the leaves' length.
    outputs += tree_lib.unflatten(out[:square.length],
                                  [state.signature.shapes[i] for i in square.leaves])
  order = [i for square in squares for i in square.leaves]
  by_leaf = dict(zip(order, outputs))
  return [by_leaf[i] for i in sorted(order)], tuple(new_errors), tuple(new_qs)


def init_state(config: PowerSGDConfig, params) -> PowerSGDState:
  """The initial state for gradients shaped like ``params``: zero error, Q drawn from ``seed``."""
  signature = tree_lib.TreeSignature.of(params)
  if config.batched:
    squares = _squares(config, signature)
    dtypes = [signature.dtypes[s.leaves[0]] for s in squares]
    error = tuple(jnp.zeros([s.side**2], d) if config.error_feedback else optax.MaskedNode()
                  for s, d in zip(squares, dtypes))
    q = tuple(_draw(config, 0, k, (s.side, s.rank), d)
              for k, (s, d) in enumerate(zip(squares, dtypes)))
    return PowerSGDState(jnp.zeros([], jnp.int32), error, q, config, signature)
  plan = _matrices(config, signature)
  error, q, k = [], [], 0
  for shape, dtype, matrix in zip(signature.shapes, signature.dtypes, plan):
    error.append(jnp.zeros(shape, dtype) if matrix is not None and config.error_feedback
                 else optax.MaskedNode())
    if matrix is not None and matrix.compress:
      q.append(_draw(config, 0, k, (matrix.m, matrix.rank), dtype))
      k += 1
    else:
      q.append(optax.MaskedNode())
  return PowerSGDState(jnp.zeros([], jnp.int32), signature.unflatten(error),
                       signature.unflatten(q), config, signature)


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
  return _step(state, state.signature.check(grads, "bucket", dtypes=False), axis_name)


def _transformation(config: PowerSGDConfig, axis_name) -> optax.GradientTransformation:
  """The transformation: the signature check, the step, the non-finite policy."""
  return finite.gated_transformation(functools.partial(init_state, config), _step,
                                     axis.check_axis_name(axis_name))


def powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
             min_compression_rate: float = 2.0, error_feedback: bool = True,
             warm_start: bool = True, epsilon: float = 0.0, seed: int = 0,
             matrix_view: str = "flax") -> optax.GradientTransformation:
  """Layer-wise PowerSGD: the cross-device mean of a rank-``rank`` approximation of each matrix.

  Torch's ``powerSGD_hook`` step for step (the module docstring numbers the steps). Before
  ``start_iter`` steps the plain mean. From then on, each reduced leaf ``g`` plus its error ``e`` is
  viewed as a matrix M (n, m) and compressed iff ``(n + m)·r·min_compression_rate < n·m``; the other
  leaves are summed in one all-reduce and divided by W. For the compressed ones, ``P = M·orth(Q)`` is
  summed in one all-reduce and orthogonalized to ``P̂``; ``Q = Mᵀ·P̂`` is summed and divided by W; the
  output is ``P̂·Qᵀ`` and the error ``M − output``.

  Example::

    tx = optax.chain(jaxcomp.powersgd(rank=2, start_iter=100), optax.sgd(0.1, momentum=0.9))

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

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState``; its output is identical on every device.

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019. PyTorch ``powerSGD_hook`` (torch 2.13).
  """
  config = PowerSGDConfig(rank=rank, start_iter=start_iter, error_feedback=error_feedback,
                          warm_start=warm_start, seed=seed, epsilon=epsilon,
                          min_compression_rate=min_compression_rate, matrix_view=matrix_view)
  return _transformation(config, axis_name)


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
