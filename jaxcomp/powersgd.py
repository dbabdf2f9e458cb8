"""PowerSGD: low-rank gradient compression with error feedback, layer-wise and batched.

``powersgd`` is torch's ``powerSGD_hook`` step for step: with ``matrix_view="torch"`` and torch-layout
arrays it gives torch's outputs and error to float32 rounding (tests/test_powersgd_torch.py checks it
against torch's real hook on two Gloo processes). ``batched_powersgd`` is torch's
``batched_powerSGD_hook``, which raises at its first compressed step in torch 2.13 and works here. The
per-bucket hooks ``jaxcomp.hooks.powersgd_hook`` / ``batched_powersgd_hook`` run this same code on a
``comm_hook`` bucket.

Where torch breaks, jaxcomp does not: a step whose gradient is non-finite on any device leaves the
state (error, Q and count) untouched; 0-d and 1-D leaves work; an all-zero gradient gives zeros with
``epsilon=0`` (a zero column is left at zero instead of divided by its zero norm, and a Q column that
comes out all-zero keeps its previous value instead of stalling the power iteration); Gram–Schmidt
removes each finished column twice, so a rank-deficient P still gives orthonormal columns; a rank
above ``min(n, m)`` is clamped; float16 / bfloat16 leaves work.

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
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import axis
from jaxcomp.buckets import TreeSignature

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PowerSGDConfig:
  """The static settings of a PowerSGD state (a pytree node without array leaves).

  Kept in the state so that ``jaxcomp.hooks.powersgd_hook(state, bucket)`` finds them; ``epsilon``,
  ``min_compression_rate`` and ``matrix_view`` are unused by the batched variant.
  """
  rank: int
  start_iter: int
  error_feedback: bool
  warm_start: bool
  seed: int
  epsilon: float = 0.0
  min_compression_rate: float = 2.0
  matrix_view: str = "flax"


def _int_arg(value, name: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    what = "a positive" if minimum == 1 else "a non-negative"
    raise ValueError(f"{name} must be {what} int; got {value!r}")
  return int(value)


def _bool_arg(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool; got {value!r}")
  return bool(value)


def _nonnegative_arg(value, name: str) -> float:
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
      or value < 0):
    raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
  return float(value)


def make_config(rank=1, *, start_iter=1000, min_compression_rate=2.0, error_feedback=True,
                warm_start=True, epsilon=0.0, seed=0, matrix_view="flax") -> PowerSGDConfig:
  """Validates PowerSGD's arguments (see ``powersgd``) and returns them as a ``PowerSGDConfig``.

  Raises:
    ValueError / TypeError: naming the argument and what was wrong with it.
  """
  if matrix_view not in ("torch", "flax"):
    raise ValueError(f"matrix_view must be 'torch' or 'flax'; got {matrix_view!r}")
  return PowerSGDConfig(
      rank=_int_arg(rank, "rank", 1), start_iter=_int_arg(start_iter, "start_iter", 0),
      error_feedback=_bool_arg(error_feedback, "error_feedback"),
      warm_start=_bool_arg(warm_start, "warm_start"), seed=_int_arg(seed, "seed", 0),
      epsilon=_nonnegative_arg(epsilon, "epsilon"),
      min_compression_rate=_nonnegative_arg(min_compression_rate, "min_compression_rate"),
      matrix_view=matrix_view)


class PowerSGDState(NamedTuple):
  """State of layer-wise PowerSGD.

  Attributes:
    count: steps seen (int32); steps with a non-finite gradient are not counted.
    error: the error-feedback memory, the params' structure, per device; ``optax.MaskedNode()`` for
      leaves that are not floating point or have no elements, and everywhere without error feedback.
    q: the params' structure; a compressed leaf holds the Q of shape ``(m, r)`` the next compressed
      step starts from (with warm start the last step's Q, else a fresh draw), identical on every
      device; other leaves hold ``optax.MaskedNode()``.
    config: the static settings.
    signature: the gradient pytree's structure, shapes and dtypes.
  """
  count: jax.Array
  error: Any
  q: Any
  config: PowerSGDConfig
  signature: TreeSignature

  PER_DEVICE_FIELDS = ("error",)  # see jaxcomp.sharding

  def compression_stats(self) -> tuple:
    """torch's ``compression_stats()``: ``(rate, numel before, numel after)``, summed over steps."""
    return powersgd_stats(self)


class BatchedPowerSGDState(NamedTuple):
  """State of batched PowerSGD: one square matrix per dtype of the gradient (one per bucket in hooks).

  Attributes:
    count: steps seen (int32); steps with a non-finite gradient are not counted.
    error: a tuple with, per matrix, the flat zero-padded error of length side², per device;
      ``optax.MaskedNode()`` entries without error feedback.
    q: a tuple with, per matrix, its Q of shape ``(side, r)``, identical on every device.
    config: the static settings.
    signature: the gradient pytree's structure, shapes and dtypes.
  """
  count: jax.Array
  error: tuple
  q: tuple
  config: PowerSGDConfig
  signature: TreeSignature

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


def _reduced(shape, dtype) -> bool:
  """Leaves PowerSGD reduces: floating point with at least one element (the rest pass through)."""
  return jnp.issubdtype(jnp.dtype(dtype), jnp.floating) and math.prod(shape) > 0


@functools.lru_cache(maxsize=None)
def _matrices(config: PowerSGDConfig, signature: TreeSignature) -> tuple:
  """Per leaf a ``_Matrix``, or None for leaves passed through."""
  plan = []
  for shape, dtype in zip(signature.shapes, signature.dtypes):
    if not _reduced(shape, dtype):
      plan.append(None)
      continue
    if not shape:
      n, m = 1, 1
    elif config.matrix_view == "torch":
      n, m = shape[0], math.prod(shape[1:])
    else:
      n, m = math.prod(shape[:-1]), shape[-1]
    rank = min(n, m, config.rank)
    # 3: compress iff (n + m)·r·rate < n·m, with the effective rank.
    plan.append(_Matrix(n, m, rank, (n + m) * rank * config.min_compression_rate < n * m))
  return tuple(plan)


@functools.lru_cache(maxsize=None)
def _squares(config: PowerSGDConfig, signature: TreeSignature) -> tuple:
  """The batched matrices: one per dtype, in order of first appearance."""
  groups: dict = {}
  for i, (shape, dtype) in enumerate(zip(signature.shapes, signature.dtypes)):
    if _reduced(shape, dtype):
      groups.setdefault(dtype, []).append(i)
  squares = []
  for leaves in groups.values():
    length = sum(math.prod(signature.shapes[i]) for i in leaves)
    side = math.ceil(math.sqrt(length))
    squares.append(_Square(tuple(leaves), length, side, min(side, config.rank)))
  return tuple(squares)


def powersgd_stats(tree) -> tuple:
  """Compression statistics counted as torch counts them, for every PowerSGD state in ``tree``.

  Args:
    tree: a ``PowerSGDState`` / ``BatchedPowerSGDState``, or any pytree holding them (an optax chain
      state, a ``comm_hook`` state with one state per bucket); a state stacked over devices works too.

  Returns:
    ``(numel before / numel after, numel before, numel after)`` summed over the compressed steps
    taken so far (rate 0 before the first), as torch's ``PowerSGDState.compression_stats()``.
  """
  kinds = (PowerSGDState, BatchedPowerSGDState)
  before = after = 0
  for state in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kinds)):
    if not isinstance(state, kinds):
      continue
    steps = max(int(np.max(np.asarray(state.count))) - state.config.start_iter, 0)
    if isinstance(state, PowerSGDState):
      plan = [p for p in _matrices(state.config, state.signature) if p is not None]
      before += steps * sum(p.n * p.m for p in plan)
      after += steps * sum((p.n + p.m) * p.rank if p.compress else p.n * p.m for p in plan)
    else:
      squares = _squares(state.config, state.signature)
      before += steps * sum(s.length for s in squares)
      after += steps * sum(2 * s.side * s.rank for s in squares)
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


def _power_step(mats: list, qs: list, epsilon: float, world: int, axis_name) -> tuple:
  """One power-iteration round for all compressed matrices: two all-reduces in all.

  Args:
    mats: the local matrices M (n, m), error feedback already added.
    qs: their Q (m, r) from the last step or a fresh draw, not yet orthogonalized.
    epsilon: added to the column norms in Gram–Schmidt.
    world: the world size W.
    axis_name: the mapped axis.

  Returns:
    ``(outputs P̂·Qᵀ, Qs divided by W)``.
  """
  # 5: Q ← orth(Q); P = M·Q locally; all Ps in one all-reduce SUM, not divided; P̂ = orth(P).
  #    (paper Alg. 1: P ← MQ, P ← all-reduce(P), P̂ ← orthogonalize(P))
  qs = [orthogonalize(q, epsilon) for q in qs]
  ps = axis.psum_many([mat @ q for mat, q in zip(mats, qs)], axis_name)
  ps = [orthogonalize(p, epsilon) for p in ps]
  # 6: Q = Mᵀ·P̂ locally; all Qs in one all-reduce SUM, then ÷W (paper: Q ← all-reduce mean(MᵀP̂)).
  qs = [mat.T @ p for mat, p in zip(mats, ps)]
  qs = [q / jnp.asarray(world, q.dtype) for q in axis.psum_many(qs, axis_name)]
  # 7: decompress, P̂·Qᵀ.
  return [p @ q.T for p, q in zip(ps, qs)], qs


def _next_q(new: jax.Array, old: jax.Array) -> jax.Array:
  """Warm start: the new Q, except that an all-zero column keeps its old value (it would stall)."""
  return jnp.where(jnp.all(new == 0, axis=0, keepdims=True), old, new)


def _draw(config: PowerSGDConfig, step, index: int, shape: tuple, dtype) -> jax.Array:
  """A standard-normal Q, the same on every device: from ``seed``, the step and the matrix's index."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), step), index)
  return jax.random.normal(key, shape, dtype)


def _step(state, grads, axis_name, compressed_fn) -> tuple:
  """The driver both variants share: the plain mean before ``start_iter``, compression from then on.

  Args:
    state: a ``PowerSGDState`` or ``BatchedPowerSGDState``.
    grads: the gradient pytree (its leaves may be of another float dtype than the state's, e.g. cast
      by ``fp16_compress_wrapper``: the step then runs in their dtype and the state keeps its own).
    axis_name: the mapped axis.
    compressed_fn: ``(state, leaves, reduced, world, axis_name) -> (outputs, error, q)``, a
      compressed step; ``reduced`` indexes the leaves it reduces, ``outputs`` follows it.

  Returns:
    ``(output pytree, new state)``; the new state is not gated on non-finite gradients.
  """
  leaves = state.signature.check(grads, "grads", dtypes=False)
  reduced = [i for i, (shape, dtype) in enumerate(zip(state.signature.shapes,
                                                       state.signature.dtypes))
             if _reduced(shape, dtype)]
  world = axis.axis_size(axis_name)

  def plain(_):  # 1: before start_iter, ÷W then one all-reduce SUM (torch's allreduce_hook)
    outputs = axis.psum_many(
        [leaves[i] / jnp.asarray(world, leaves[i].dtype) for i in reduced], axis_name)
    return outputs, state.error, state.q

  def compressed(_):
    return compressed_fn(state, leaves, reduced, world, axis_name)

  if state.config.start_iter == 0:
    outputs, error, q = compressed(None)
  else:
    outputs, error, q = lax.cond(state.count < state.config.start_iter, plain, compressed, None)
  for i, out in zip(reduced, outputs):
    leaves[i] = out
  new_state = state._replace(count=state.count + 1, error=error, q=q)
  return jax.tree.unflatten(state.signature.treedef, leaves), new_state


def _layerwise(state: PowerSGDState, leaves: list, reduced: list, world: int, axis_name) -> tuple:
  """A compressed layer-wise step (steps 2–8 of REFERENCE.md §1, torch's order), leaf by leaf."""
  config, treedef = state.config, state.signature.treedef
  plan = _matrices(config, state.signature)
  errors, qs = treedef.flatten_up_to(state.error), treedef.flatten_up_to(state.q)
  # 2: M ← g + e (paper Alg. 2: Δ ← g + e).
  ms = {i: leaves[i] + errors[i].astype(leaves[i].dtype) if config.error_feedback else leaves[i]
        for i in reduced}
  dense = [i for i in reduced if not plan[i].compress]
  packed = [i for i in reduced if plan[i].compress]
  # 3: split by the compress test (``_matrices``); 4: the uncompressed leaves in one all-reduce SUM,
  # then ÷W.
  outputs = {i: s / jnp.asarray(world, s.dtype)
             for i, s in zip(dense, axis.psum_many([ms[i] for i in dense], axis_name))}
  mats = [ms[i].reshape(plan[i].n, plan[i].m) for i in packed]
  low_rank, new_qs = _power_step(mats, [qs[i].astype(ms[i].dtype) for i in packed],
                                 config.epsilon, world, axis_name)
  for i, out in zip(packed, low_rank):
    outputs[i] = out.reshape(ms[i].shape)
  if config.error_feedback:  # 8: e ← M − output, "local minus mean" for the uncompressed leaves
    for i in reduced:
      errors[i] = (ms[i] - outputs[i]).astype(errors[i].dtype)
  for k, (i, new) in enumerate(zip(packed, new_qs)):
    qs[i] = (_next_q(new.astype(qs[i].dtype), qs[i]) if config.warm_start
             else _draw(config, state.count + 1, k, qs[i].shape, qs[i].dtype))
  return ([outputs[i] for i in reduced], treedef.unflatten(errors), treedef.unflatten(qs))


def _batched(state: BatchedPowerSGDState, leaves: list, reduced: list, world: int,
             axis_name) -> tuple:
  """A compressed batched step: each dtype's gradient flattened, zero-padded to side², one P and Q."""
  config = state.config
  squares = _squares(config, state.signature)
  ms, new_errors, new_qs = [], list(state.error), list(state.q)
  for k, square in enumerate(squares):
    # torch's batched step 1: the flat gradient as a square, zero-padded; then M ← g + e over it.
    flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in square.leaves])
    m = jnp.pad(flat, (0, square.side**2 - square.length))
    if config.error_feedback:
      m = m + state.error[k].astype(m.dtype)
    ms.append(m)
  # Steps 2–8: one P and Q per square, as layer-wise (torch's batched hook passes no epsilon).
  low_rank, qs = _power_step(
      [m.reshape(s.side, s.side) for m, s in zip(ms, squares)],
      [q.astype(m.dtype) for q, m in zip(state.q, ms)], 0.0, world, axis_name)
  outputs = {}
  for k, (square, m, out, new) in enumerate(zip(squares, ms, low_rank, qs)):
    out = out.reshape(-1)
    if config.error_feedback:  # e ← M − output, the padding included
      new_errors[k] = (m - out).astype(state.error[k].dtype)
    new_qs[k] = (_next_q(new.astype(state.q[k].dtype), state.q[k]) if config.warm_start
                 else _draw(config, state.count + 1, k, state.q[k].shape, state.q[k].dtype))
    offsets = np.cumsum([0] + [math.prod(state.signature.shapes[i]) for i in square.leaves])
    for j, i in enumerate(square.leaves):  # step 9: truncate to the length
      outputs[i] = out[offsets[j]:offsets[j + 1]].reshape(state.signature.shapes[i])
  return [outputs[i] for i in reduced], tuple(new_errors), tuple(new_qs)


def init_state(config: PowerSGDConfig, params) -> PowerSGDState:
  """The initial layer-wise state for gradients shaped like ``params``: zero error, Q from ``seed``."""
  signature = TreeSignature.of(params)
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
  return PowerSGDState(jnp.zeros([], jnp.int32), signature.treedef.unflatten(error),
                       signature.treedef.unflatten(q), config, signature)


def init_batched_state(config: PowerSGDConfig, params) -> BatchedPowerSGDState:
  """The initial batched state for gradients shaped like ``params``: zero error, Q from ``seed``."""
  signature = TreeSignature.of(params)
  squares = _squares(config, signature)
  dtypes = [signature.dtypes[s.leaves[0]] for s in squares]
  error = tuple(jnp.zeros([s.side**2], d) if config.error_feedback else optax.MaskedNode()
                for s, d in zip(squares, dtypes))
  q = tuple(_draw(config, 0, k, (s.side, s.rank), d) for k, (s, d) in enumerate(zip(squares, dtypes)))
  return BatchedPowerSGDState(jnp.zeros([], jnp.int32), error, q, config, signature)


def _check_state(state, kind, hook: str):
  if not isinstance(state, kind):
    raise TypeError(f"{hook} needs the per-bucket state made by jaxcomp.hooks.{hook[:-5]}_state(...), "
                    f"as in comm_hook({hook}, {hook[:-5]}_state(rank=1)); got {type(state).__name__}")


def update(state: PowerSGDState, grads, axis_name: axis.AxisName) -> tuple:
  """One layer-wise step on ``grads`` (shaped as at init; any float dtype), not gated on non-finite.

  The shared core of ``powersgd`` and ``jaxcomp.hooks.powersgd_hook``.

  Returns:
    ``(the reduced gradients, identical on every device; the new state)``.
  """
  _check_state(state, PowerSGDState, "powersgd_hook")
  return _step(state, grads, axis_name, _layerwise)


def update_batched(state: BatchedPowerSGDState, grads, axis_name: axis.AxisName) -> tuple:
  """As ``update``, for batched PowerSGD (the core of ``batched_powersgd`` and its hook)."""
  _check_state(state, BatchedPowerSGDState, "batched_powersgd_hook")
  return _step(state, grads, axis_name, _batched)


def _transformation(init, step, axis_name) -> optax.GradientTransformation:
  """Wraps a core step as a transformation: signature check, then the state kept on non-finite."""

  def update_fn(updates, state, params=None):
    del params
    state.signature.check(updates)
    reduced, new_state = step(state, updates, axis_name)
    finite = axis.all_finite(updates, axis_name)
    return reduced, axis.keep_if_finite(finite, new_state, state)

  return optax.GradientTransformation(init, update_fn)


def powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
             min_compression_rate: float = 2.0, error_feedback: bool = True,
             warm_start: bool = True, epsilon: float = 0.0, seed: int = 0,
             matrix_view: str = "flax") -> optax.GradientTransformation:
  """Layer-wise PowerSGD: the cross-device mean of a rank-``rank`` approximation of each matrix.

  Torch's ``powerSGD_hook`` step for step. Before ``start_iter`` steps the plain mean (÷W, sum).
  From then on, each floating-point leaf ``g`` plus its error ``e`` is viewed as a matrix M (n, m)
  and compressed iff ``(n + m)·r·min_compression_rate < n·m`` with ``r = min(n, m, rank)``. The other
  leaves are summed in one all-reduce and divided by W. For the compressed ones, ``P = M·orth(Q)`` is
  summed over devices in one all-reduce (not divided) and orthogonalized to ``P̂``; ``Q = Mᵀ·P̂`` is
  summed in one all-reduce and divided by W; the output is ``P̂·Qᵀ``. The error becomes
  ``M − output`` for every leaf (for an uncompressed leaf: local minus mean). Three all-reduces per
  step, plus the 4-byte check that the gradient is finite everywhere.

  Orthogonalization is Gram–Schmidt for r ≤ 2 and half precision, QR otherwise (``orthogonalize``
  lists its rounding-level departures from torch, which keep rank-deficient and all-zero matrices
  safe). On a step whose
  gradient is non-finite on any device the state is kept (error, Q and count); the non-finite mean
  still flows out, for ``optax.apply_if_finite`` or a loss scaler to skip.

  Under ``pmap`` the state is per device (its ``error`` differs): map it with ``in_axes=0``, e.g.
  ``state = jax.pmap(tx.init)(replicated_params)``.

  Args:
    rank: the approximation rank r (clamped to ``min(n, m)`` per leaf).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    start_iter: number of steps of plain mean before compression starts (torch's
      ``start_powerSGD_iter``; 0 compresses from the first step).
    min_compression_rate: compress a leaf only if its size shrinks by more than this factor.
    error_feedback: keep each device's compression error and add it to the next gradient.
    warm_start: start each step's power iteration from the last step's Q (else a fresh random Q).
    epsilon: added to the column norms in Gram–Schmidt.
    seed: the seed of the random Qs, the same on every device.
    matrix_view: ``"flax"``: a leaf of shape ``(..., k)`` is ``(prod(shape[:-1]), k)``, the fan-in ×
      fan-out matrix of Flax's Dense and Conv kernels; ``"torch"``: ``(shape[0], prod(shape[1:]))``,
      torch's view of torch-layout arrays. 0-d leaves are (1, 1).

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState``; its output is identical on every device.

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019. PyTorch ``powerSGD_hook`` (torch 2.13).
  """
  config = make_config(rank, start_iter=start_iter, min_compression_rate=min_compression_rate,
                       error_feedback=error_feedback, warm_start=warm_start, epsilon=epsilon,
                       seed=seed, matrix_view=matrix_view)
  return _transformation(functools.partial(init_state, config), update,
                         axis.check_axis_name(axis_name))


def batched_powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
                     error_feedback: bool = True, warm_start: bool = True,
                     seed: int = 0) -> optax.GradientTransformation:
  """Batched PowerSGD: the whole gradient as one zero-padded square matrix with one P and Q.

  Torch's ``batched_powerSGD_hook`` (which raises at its first compressed step in torch 2.13): the
  floating-point leaves of each dtype are flattened into one vector of length L, zero-padded to
  side² with ``side = ceil(sqrt(L))`` and compressed as one (side, side) matrix with the steps of
  ``powersgd`` (no epsilon); the error covers the padding too. Faster than layer-wise PowerSGD, but
  the square view destroys the layers' low-rank structure: torch recommends it only at rank 1.

  Args:
    rank: the approximation rank r (clamped to ``side``).
    axis_name: the mapped axis to average over.
    start_iter: number of steps of plain mean before compression starts.
    error_feedback: keep each device's compression error and add it to the next gradient.
    warm_start: start each step from the last step's Q (else a fresh random Q).
    seed: the seed of the random Qs, the same on every device.

  Returns:
    A ``GradientTransformation`` with a ``BatchedPowerSGDState``.

  References:
    PyTorch ``batched_powerSGD_hook`` (torch 2.13); Vogels et al., NeurIPS 2019.
  """
  config = make_config(rank, start_iter=start_iter, error_feedback=error_feedback,
                       warm_start=warm_start, seed=seed)
  return _transformation(functools.partial(init_batched_state, config), update_batched,
                         axis.check_axis_name(axis_name))
