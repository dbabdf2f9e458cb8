"""Dion: orthonormalized low-rank updates whose data-parallel exchange is the low-rank factors.

Dion (Ahn et al.) is a Muon-family optimizer: the update of a weight matrix is an orthonormal factor
of its momentum, but found by one step of warm-started power iteration instead of Newton–Schulz, so
the devices exchange the two factors P and R of each matrix — r·(m + n) values for an (m, n)
matrix — instead of its m·n gradient. Every step is linear in the momentum, so the devices' mean of
what they send is what one device with the mean gradient would compute: the result is Dion's
centralized update exactly, the same on every device. Leaves that are not matrices (vectors,
scalars, embeddings; ``fan_in``) go through a scalar optimizer (optax's AdamW or Lion) on their
dense mean. ``dion`` is a whole optimizer (its output is the update; nothing is chained after it).

The steps, per device, W devices, at step t (the ``# n:`` comments below point here; "Alg. 1" is
the paper's Algorithm 1, "ref." microsoft/dion's ``dion_update``):

1. The leaves: a leaf is a matrix when ``fan_in(path, leaf)`` gives its number k of fan-in axes,
   viewed as (a, b) = (prod(shape[:k]), prod(shape[k:])), fan-in × fan-out (Flax's layout). Its
   rank is r = min(a, b, ``rank``) (or ⌈``rank_fraction``·min(a, b)⌉), and it is compressed iff
   r·(a + b) < a·b (ref.: otherwise the mean gradient is all-reduced). The power iteration works
   on the matrix with its longer side first (ref.'s transpose): P (long side, r), Q (short side,
   r). Every other leaf goes to the scalar optimizer (8). Matrices of one (a, b), rank and choice
   are stacked (G, a, b) and taken through 2–7 as one batch (``jaxcomp._src.stacks``); a stack of
   several compressed ones writes its B = M + G once for the products to read.
2. One all-reduce, ÷W (ref.'s "avg"): the dense mean of the scalar leaves and of the uncompressed
   matrices' gradients, and each compressed matrix's ``P = B·Q`` with ``B = M + G``, this device's
   momentum and gradient (Alg. 1).
3. Uncompressed matrices: ``B = M + Ḡ`` (the same on every device) and ``P = B·Q`` locally.
   ``P̂ = orth(P̄)`` (``powersgd.orthogonalize``: Gram–Schmidt for r ≤ 2, else QR; Alg. 1).
4. ``R = Bᵀ·P̂``; one all-reduce, ÷W, of the compressed matrices' R (Alg. 1).
5. Error feedback: ``M ← B − (1 − μ)·P̂·R̄ᵀ`` (Alg. 1); per device for compressed matrices.
6. ``Q ← R̄ / (‖R̄‖_col + eps)``, column-normalised (Alg. 1); a column of R̄ that is all zero
   (a zero momentum) keeps its old Q column, as ref.'s ``fix_all_zero_or_nan`` keeps Q.
7. The update ``−lr·(√(fan_out/fan_in)·P̂·Qᵀ + weight_decay·X)`` (Alg. 1, with decoupled weight
   decay; ref.'s ``scaled_lr``), in the leaf's shape.
8. The other leaves: ``optax.scale_by_adam(b1, b2, eps)`` or ``optax.scale_by_lion(b1, b2)`` on the
   dense mean ``ḡ`` of 2, and ``−lr_s·(direction + scalar_weight_decay·X)`` (ref.'s
   ``adamw_update`` / ``lion_update``).
9. Non-finite gradients: every value the update depends on was all-reduced in 2 or 4, so a NaN or
   infinity on any device shows in every device's copy (``finite.reduced_finite``): on such a step
   the state is kept (``finite.keep_if_finite``) and the learning rates are NaN, so that every
   update is.

Bytes per device per step (payload, ``comm_report``): 4·r·(a + b) per compressed matrix (float32
factors) plus 4 per value of the scalar leaves and uncompressed matrices, in two all-reduces in
sequence; no separate finiteness check.

Differences from the paper and microsoft/dion. The momentum, Q and the factors are float32 for
every gradient dtype (ref.: the parameter's dtype unless a mixed-precision config says otherwise).
Leaves of more than two dimensions are matrices too, through ``fan_in`` (ref.: 2-D only; Flax's
attention kernels (in, heads, head_dim) are (in, heads·head_dim)); the embeddings Flax names
``embedding`` go to the scalar optimizer by default, but the output layer cannot be told from the
model's other matrices by its shape or name: pass ``fan_in`` to send it there too, as the paper
does. The orthonormalisation is Gram–Schmidt or Householder QR (ref.: randomized Cholesky QR, a
faster way to the same factor up to column signs, which the update does not depend on). A zero
momentum gives a zero update with Q kept, decided on the all-reduced factors (ref. decides on each
device's own momentum, which under compressed exchange can differ between devices). The state is
saved whole, so a resumed run continues bitwise; ref. must all-reduce its per-device momenta before
a checkpoint (``synchronize_for_checkpoint``), which changes them.

References:
  Ahn et al., "Dion: Distributed Orthonormalized Updates", 2025
  (https://arxiv.org/abs/2504.05295), Algorithm 1 and Section 3 (the data-parallel exchange).
  microsoft/dion ``dion/dion_reference.py`` (``dion_update``, ``power_iteration``) and
  ``dion/scalar_opts.py`` (``adamw_update``, ``lion_update``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, compressor, finite, kernels, powersgd, stacks, validate
from jaxcomp._src import tree as tree_lib

SCALAR_OPTIMIZERS = ("adamw", "lion")
_ATTENTION = ("['query']", "['key']", "['value']")


def dion_fan_in(path: str, leaf) -> Optional[int]:
  """Which leaves are Dion's matrices, by default, and their fan-in axes (1).

  None (the scalar optimizer) for leaves of fewer than two dimensions and for Flax's embeddings
  (a last key ``embedding``: ``nn.Embed``, ``nnx.Embed``); 1 for the 3-D query, key and value
  kernels of Flax's attention, (in, heads, head_dim); otherwise ``ndim − 1``, Flax's kernels as
  (fan-in, fan-out): Dense (in, out), attention's output (heads, head_dim, out), Conv (kh, kw, in,
  out).
  """
  ndim = len(leaf.shape)
  if ndim < 2 or path.endswith("['embedding']"):
    return None
  if ndim == 3 and any(key in path for key in _ATTENTION):
    return 1
  return ndim - 1


def _decay(value, name: str) -> float:
  """A decay rate in [0, 1)."""
  return validate.number(value, name, 0, 1, high_open=True)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DionConfig(compressor.MeanConfig):
  """Dion's settings, validated; a static node in the state. Attributes: ``dion``'s arguments."""
  name = "dion"
  NONFINITE = "own"  # 9: from the factors and means it all-reduces anyway

  learning_rate: Any = validate.setting(check=validate.learning_rate, traceable=True)
  rank: Optional[int] = validate.setting(None, check=validate.optional(functools.partial(
      validate.integer, minimum=1, static="fixes the shapes of P and Q")))
  rank_fraction: Optional[float] = validate.setting(None, check=validate.optional(
      functools.partial(validate.density, static="fixes the shapes of P and Q")))
  mu: Any = validate.setting(0.95, check=functools.partial(validate.number, low=0, high=1),
                             traceable=True)
  weight_decay: Any = validate.setting(0.01, check=functools.partial(validate.number, low=0),
                                       traceable=True)
  scalar_optimizer: str = validate.setting("adamw", check=functools.partial(
      validate.choice, choices=SCALAR_OPTIMIZERS))
  scalar_learning_rate: Any = validate.setting(
      None, check=validate.optional(validate.learning_rate), traceable=True)
  b1: float = validate.setting(0.9, check=_decay, traceable=True)
  b2: float = validate.setting(0.95, check=_decay, traceable=True)
  eps: float = validate.setting(1e-8, check=functools.partial(validate.number, low=0),
                                traceable=True)
  scalar_weight_decay: Any = validate.setting(0.0, check=functools.partial(validate.number,
                                                                           low=0),
                                              traceable=True)
  fan_in: Optional[Callable] = validate.setting(None, check=validate.optional(functools.partial(
      validate.function, signature="fan_in(path, leaf) -> int or None")))
  seed: int = validate.setting(0, check=functools.partial(
      validate.integer, minimum=0, static="seeds the Qs drawn at init"))

  @property
  def output(self) -> str:
    return "update"

  def check(self):
    if self.rank is not None and self.rank_fraction is not None:
      raise ValueError(f"give rank or rank_fraction, not both; got rank={self.rank!r} and "
                       f"rank_fraction={self.rank_fraction!r}")

  def scalar_transformation(self) -> optax.GradientTransformation:
    """8: the scalar optimizer's direction (no learning rate, no weight decay)."""
    if self.scalar_optimizer == "lion":
      return optax.scale_by_lion(self.b1, self.b2)
    return optax.scale_by_adam(self.b1, self.b2, self.eps)


class DionState(NamedTuple):
  """State of ``dion``.

  Attributes:
    count: steps taken (non-finite steps are not counted).
    momentum: this device's momenta M of each stack of compressed matrices (1), float32, (G, a,
      b); per device.
    mean_momentum: the momenta of each stack of uncompressed matrices, whose mean gradient is
      all-reduced (1), likewise; the same on every device.
    q: the Qs of each stack, compressed then uncompressed, float32 (G, short side, r); the same on
      every device.
    scalar: the scalar optimizer's state (optax's) over the list of the other reduced leaves.
    config: the static settings.
    signature: the gradient pytree's structure, shapes, dtypes and paths.
  """
  count: jax.Array
  momentum: Any
  mean_momentum: Any
  q: Any
  scalar: Any
  config: DionConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("momentum",)  # see jaxcomp.sharding

  def by_leaf(self, field: str):
    """The state's ``field`` (``"momentum"``, ``"mean_momentum"`` or ``"q"``) in the params'
    structure (``stacks.by_leaf``): each matrix's momentum in its leaf's shape, its Q (short side,
    r); leading axes (a stacked state's) are kept."""
    groups = _layout(self.config, self.signature)
    members = {"momentum": groups.compressed, "mean_momentum": groups.dense,
               "q": groups.matrices}[field]
    return stacks.by_leaf(self.signature, [[m.index for m in s] for s in members],
                          getattr(self, field), 2, field != "q")


class _Matrix(NamedTuple):
  """1: the reduced leaf at ``index`` as an (a, b) = (fan-in, fan-out) matrix of rank ``rank``."""
  index: int
  a: int
  b: int
  rank: int
  compressed: bool
  name: str  # seeds its Q

  @property
  def transposed(self) -> bool:
    """The power iteration runs on Mᵀ (P on the fan-out side): the fan-out side is the longer."""
    return self.a < self.b

  @property
  def q_shape(self) -> tuple:
    return (min(self.a, self.b), self.rank)


class _Groups(NamedTuple):
  """1: the reduced leaves as Dion treats them: stacks (tuples of ``_Matrix`` of one (a, b), rank
  and choice), and positions among the reduced leaves."""
  compressed: tuple  # the stacks of matrices whose factors are exchanged
  dense: tuple  # the stacks of matrices too small to compress, whose mean gradient is exchanged
  scalars: tuple  # the scalar optimizer's leaves

  @property
  def matrices(self) -> tuple:
    return self.compressed + self.dense


def _layout(config: DionConfig, signature: tree_lib.TreeSignature) -> _Groups:
  """1: the groups of the reduced leaves."""
  fan_in = config.fan_in or dion_fan_in
  matrices, scalars = [], []
  for k, (leaf, i) in enumerate(zip(signature.reduced_structs(), signature.reduced)):
    axes = fan_in(signature.paths[i], leaf)
    if axes is None or axes is False:
      scalars.append(k)
      continue
    if isinstance(axes, bool) or not isinstance(axes, int) or not 1 <= axes < len(leaf.shape):
      raise ValueError(f"dion: fan_in({signature.paths[i]!r}, ...) must be None or the number of "
                       f"fan-in axes of the {list(leaf.shape)} leaf, from 1 to "
                       f"{len(leaf.shape) - 1}; got {axes!r}")
    a, b = math.prod(leaf.shape[:axes]), math.prod(leaf.shape[axes:])
    r = (min(a, b, config.rank) if config.rank is not None else
         min(a, b, math.ceil((config.rank_fraction or 0.25) * min(a, b))))
    matrices.append(_Matrix(k, a, b, r, r * (a + b) < a * b, signature.paths[i]))
  together = [tuple(matrices[i] for i in g)
              for g in stacks.groups_of([(m.a, m.b, m.rank, m.compressed) for m in matrices])]
  return _Groups(tuple(s for s in together if s[0].compressed),
                 tuple(s for s in together if not s[0].compressed), tuple(scalars))


def _draw_q(config: DionConfig, stack: tuple) -> jax.Array:
  """Standard-normal Qs of a stack, the same on every device: each from ``seed`` and its leaf's
  path."""
  def draw(matrix):
    key = jax.random.fold_in(jax.random.key(config.seed), zlib.crc32(matrix.name.encode()))
    return jax.random.normal(key, matrix.q_shape, jnp.float32)
  return jnp.stack([draw(m) for m in stack])


def init(config: DionConfig, signature: tree_lib.TreeSignature) -> DionState:
  """Zero momenta, Qs drawn from ``seed``, the scalar optimizer's own init."""
  groups = _layout(config, signature)
  structs = signature.reduced_structs()
  zeros = lambda together: tuple(jnp.zeros((len(s), s[0].a, s[0].b), jnp.float32)  # noqa: E731
                                 for s in together)
  scalar = config.scalar_transformation().init(
      [jnp.zeros(structs[k].shape, jnp.float32) for k in groups.scalars])
  return DionState(jnp.zeros([], jnp.int32), zeros(groups.compressed), zeros(groups.dense),
                   tuple(_draw_q(config, s) for s in groups.matrices), scalar, config, signature)


def _rate(value, count):
  """A learning rate at ``count``: a schedule called with it, a number or array as it is."""
  return jnp.asarray(value(count) if callable(value) else value, jnp.float32)


def _nan_unless(ok: jax.Array, rate: jax.Array) -> jax.Array:
  """9: the learning rate, or NaN where ``ok`` is false: every update it scales is then NaN (a
  scalar, not a pass over the updates)."""
  return jnp.where(ok, rate, jnp.nan)


def _factor(m: _Matrix, terms: kernels.Sum, f: jax.Array, long_side: bool) -> jax.Array:
  """``B·f`` for the factor on the long side (P, from Q), ``Bᵀ·f`` for the short (R, from P̂), with
  ``B = M + G`` in the orientation 1 chose (``kernels.Sum``: B never written)."""
  if long_side != m.transposed:
    return kernels.product(terms, f)  # (a, b) · (b, r)
  return kernels.transposed_product(terms, f)  # (a, b)ᵀ · (a, r)


def _outer(m: _Matrix, p: jax.Array, r: jax.Array) -> jax.Array:
  """The (a, b) matrix ``P·Rᵀ`` in the leaf's orientation (``R·Pᵀ`` when transposed)."""
  return kernels.low_rank_product(r, p) if m.transposed else kernels.low_rank_product(p, r)


def _needs_params(config: DionConfig) -> bool:
  return any(validate.is_array(w) or w for w in (config.weight_decay, config.scalar_weight_decay))


def _split(values: list, *sizes: int) -> list:
  """``values`` cut into consecutive lists of ``sizes``, and the rest."""
  parts = []
  for size in sizes:
    parts.append(values[:size])
    values = values[size:]
  return parts + [values]


def _stacked(stack: tuple, xs: list) -> jax.Array:
  """The leaves ``xs[m.index]`` of a stack's matrices, each as (a, b), stacked (G, a, b)."""
  return jnp.stack([xs[m.index].reshape(m.a, m.b) for m in stack])


def _exchange(groups: _Groups, grads: list, own: list, shared: list, qs: list,
              axis_name) -> tuple:
  """Steps 2–4, the exchange: ``(the scalar leaves' mean gradients, the uncompressed stacks' mean
  gradients, and per stack of ``groups.matrices`` its B = M + G, P̂ and R̄; finite)``."""
  gs = [_stacked(stack, grads) for stack in groups.compressed]
  # A stack of several writes its B once (its gradients would be written stacked anyway).
  bs = [kernels.Sum((g, m)) if len(stack) == 1 else kernels.Sum((g + m,))
        for stack, g, m in zip(groups.compressed, gs, own)]
  # 2: one all-reduce (÷W) of the dense leaves and of every compressed matrix's P = (M + G)·Q.
  scalar_means, dense_means, ps = _split(axis.mean_many(
      [grads[k] for k in groups.scalars] + [_stacked(stack, grads) for stack in groups.dense]
      + [_factor(stack[0], b, q, True) for stack, b, q in zip(groups.compressed, bs, qs)],
      axis_name), len(groups.scalars), len(groups.dense))
  # 3: the uncompressed matrices' B = M + Ḡ and P = B·Q, locally; P̂ = orth(P̄).
  dense_bs = [kernels.Sum((g, m)) for g, m in zip(dense_means, shared)]
  ps += [_factor(stack[0], b, q, True)
         for stack, b, q in zip(groups.dense, dense_bs, qs[len(groups.compressed):])]
  bs += dense_bs
  p_hats = [powersgd.orthogonalize(p) for p in ps]
  # 4: R = Bᵀ·P̂; one all-reduce (÷W) of the compressed matrices' R.
  rs = [_factor(stack[0], b, p, False) for stack, b, p in zip(groups.matrices, bs, p_hats)]
  compressed_rs, dense_rs = _split(rs, len(groups.compressed))
  compressed_rs = axis.mean_many(compressed_rs, axis_name)
  ok = finite.reduced_finite((scalar_means, dense_means, ps[:len(groups.compressed)],
                              compressed_rs))  # 9
  return scalar_means, dense_means, bs, p_hats, compressed_rs + dense_rs, ok


def step(config: DionConfig, state: DionState, leaves: list, axis_name, phase,
         params: Optional[list] = None) -> tuple:
  """Steps 1–9 on the reduced leaves: ``(updates, new state, finite)``."""
  del phase
  if params is None and _needs_params(config):
    raise ValueError("dion: weight decay needs the parameters: call tx.update(grads, state, params)"
                     " (nnx.Optimizer and the usual optax loop do), or set weight_decay=0 and "
                     "scalar_weight_decay=0")
  signature = state.signature
  groups = _layout(config, signature)
  grads = [g.astype(jnp.float32) for g in leaves]
  own, shared, qs = (list(f) for f in (state.momentum, state.mean_momentum, state.q))
  scalar_means, _, bs, p_hats, rs, ok = _exchange(groups, grads, own, shared, qs,
                                                  axis_name)  # 2–4
  rate = _nan_unless(ok, _rate(config.learning_rate, state.count))
  x = [None] * len(leaves) if params is None else [p.astype(jnp.float32) for p in params]

  def decayed(u, w, k):  # 7, 8: the direction plus the decoupled weight decay w·X
    return u if x[k] is None or (not validate.is_array(w) and w == 0) else u + w * x[k]

  def momentum(e, first, o, terms):  # 5: B − (1 − μ)·P̂·R̄ᵀ, B = M + G from its terms or written
    return (e + first if terms > 1 else first) - (1 - config.mu) * o

  updates = [None] * len(leaves)
  momenta = own + shared
  for j, (stack, b, p_hat, r) in enumerate(zip(groups.matrices, bs, p_hats, rs)):
    m = stack[0]
    # 5: M ← B − (1 − μ)·P̂·R̄ᵀ, over the old momentum's block (kernels.in_place).
    momenta[j] = kernels.in_place(functools.partial(momentum, terms=len(b.terms)), momenta[j],
                                  b.terms[0], _outer(m, p_hat, r))
    # 6: Q ← R̄ column-normalised; an all-zero column keeps its old Q.
    q = r / (jnp.sqrt(jnp.sum(jnp.square(r), axis=-2, keepdims=True)) + config.eps)
    qs[j] = jnp.where(jnp.all(r == 0, axis=-2, keepdims=True), qs[j], q)
    # 7: −lr·(√(fan_out/fan_in)·P̂·Qᵀ + weight_decay·X).
    directions = math.sqrt(m.b / m.a) * _outer(m, p_hat, qs[j])
    for i, matrix in enumerate(stack):
      k = matrix.index
      updates[k] = -rate * decayed(directions[i].reshape(leaves[k].shape), config.weight_decay, k)
  # 8: the scalar optimizer on the dense means.
  directions, scalar = config.scalar_transformation().update(scalar_means, state.scalar)
  scalar_rate = (rate if config.scalar_learning_rate is None
                 else _nan_unless(ok, _rate(config.scalar_learning_rate, state.count)))
  for k, d in zip(groups.scalars, directions):
    updates[k] = -scalar_rate * decayed(d, config.scalar_weight_decay, k)
  compressed = len(groups.compressed)
  new_state = state._replace(momentum=tuple(momenta[:compressed]),
                             mean_momentum=tuple(momenta[compressed:]), q=tuple(qs),
                             scalar=scalar)
  new_state = finite.keep_if_finite(ok, new_state, state)  # 9
  return [u.astype(g.dtype) for u, g in zip(updates, leaves)], new_state, ok


def dion(learning_rate, *, rank: Optional[int] = None, rank_fraction: Optional[float] = None,
         mu: float = 0.95, weight_decay: float = 0.01, scalar_optimizer: str = "adamw",
         scalar_learning_rate=None, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
         scalar_weight_decay: float = 0.0, fan_in: Optional[Callable] = None, seed: int = 0,
         axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """Dion as an optax optimizer: it averages the gradient itself, sending low-rank factors.

  Each matrix's update is the orthonormal factor Dion's warm-started power iteration finds in its
  momentum, with error feedback (the module docstring numbers the steps); the devices exchange the
  factors, r·(m + n) values per (m, n) matrix, and the result is what one device would compute
  with the mean gradient. The other leaves (vectors, embeddings) follow a scalar optimizer on their
  dense mean. Use it in place of ``optax.chain(jaxcomp.allreduce(), optax.contrib.muon(lr))``, with
  nothing chained after it but a guard. On a step whose gradient is non-finite on any device the
  state is kept and the update is NaN.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> tx = jaxcomp.dion(0.02, rank=4)  # each matrix through rank-4 factors
    >>> params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)}
    >>> grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(0), (8,) + p.shape),
    ...                      params)  # one gradient per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> stacked = jax.tree.map(lambda p: jnp.stack([p] * 8), params)
    >>> jaxcomp.comm_report(step, grads, state, stacked).payload_bytes  # 4·(4·128 + 64)
    2304

  Args:
    learning_rate: a positive number or an optax schedule of the step count (called with the
      steps taken; a non-finite step is not counted); an array under ``optax.inject_hyperparams``.
    rank: the rank r of every matrix's factors, clamped to min(m, n).
    rank_fraction: or r = ⌈rank_fraction · min(m, n)⌉ per matrix (default ¼, when ``rank`` is not
      given: the paper finds ¼ nearly as good as full rank).
    mu: the momentum's decay μ: the error feedback keeps (1 − μ) less of what the update took.
    weight_decay: decoupled weight decay of the matrices, scaled by the learning rate.
    scalar_optimizer: ``"adamw"`` or ``"lion"``, for the leaves that are not matrices.
    scalar_learning_rate: its learning rate (number, schedule or array); default ``learning_rate``
      (microsoft/dion's default).
    b1, b2, eps: the scalar optimizer's (Lion takes no eps); microsoft/dion's defaults.
    scalar_weight_decay: the scalar optimizer's decoupled weight decay.
    fan_in: ``fan_in(path, leaf) -> int or None`` (``leaf`` a ``jax.ShapeDtypeStruct``): the number
      of leading fan-in axes of a matrix, None for a leaf of the scalar optimizer; default
      ``dion_fan_in`` (2-D and more, Flax layouts, embeddings excluded). The paper's output
      layer goes to the scalar optimizer too: ``fan_in=lambda path, leaf: None if "head" in path
      else dion_fan_in(path, leaf)``.
    seed: the seed of the Qs, the same on every device.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A ``jaxcomp.Transformation`` whose updates are identical on every device, in the gradients'
    dtypes; its state is a ``DionState``. Its update needs the parameters for weight decay
    (``tx.update(grads, state, params)``).

  References:
    Ahn et al., "Dion: Distributed Orthonormalized Updates", 2025, Algorithm 1; microsoft/dion.
  """
  config = DionConfig(
      learning_rate=learning_rate, rank=rank, rank_fraction=rank_fraction, mu=mu,
      weight_decay=weight_decay, scalar_optimizer=scalar_optimizer,
      scalar_learning_rate=scalar_learning_rate, b1=b1, b2=b2, eps=eps,
      scalar_weight_decay=scalar_weight_decay, fan_in=fan_in, seed=seed)
  return compressor.transformation(config, init, step, axis_name)
