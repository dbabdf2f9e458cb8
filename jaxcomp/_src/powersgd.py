"""PowerSGD: low-rank gradient compression with error feedback, layer-wise and batched.

``powersgd`` is torch's ``powerSGD_hook`` step for step (tests/test_powersgd_torch.py), with the
PowerSGD authors' ``alternating`` variant; ``batched_powersgd`` is torch's
``batched_powerSGD_hook``. The steps, per device, W devices ("torch n": ``powerSGD_hook``'s
docstring; "Alg. n": the paper's):

1. Phase "warmup", the first ``start_iter`` steps: the plain mean, ÷W then one all-reduce SUM.
   Phase "compressed" from then on:
2. ``M ← g + e``: add this device's error feedback (Alg. 2 line 7).
3. Blocks as matrices (torch 1–1.2): layer-wise, a leaf as (n, m), compressed iff ``compress(path,
   leaf)`` and ``(n + m)·r·min_compression_rate < n·m``, ``r = min(n, m, rank)``; batched, each
   dtype's leaves raveled and zero-padded into one square. Blocks of one (n, m), rank, dtype and
   choice go through 4–9 as one stack (G, n, m) (``jaxcomp._src.stacks``; torch's
   ``batch_tensors_with_same_shape``); a stack of several writes M = g + e once.
4. Uncompressed blocks: summed in the all-reduce of step 5, then ÷W (torch 2.1, 2.2).
5. ``P = M·orth(Q)`` locally; one all-reduce SUM, not ÷W; ``P̂ = orth(P)`` (torch 3.1–3.4; Alg. 1).
6. ``Q = Mᵀ·P̂`` locally; one all-reduce SUM, then ÷W (torch 3.5, 3.6; Alg. 1 lines 6–7).
7. Output ``P̂·Qᵀ``, cut back to the leaves (torch 3.7; Alg. 1 line 11).
8. ``e ← M − P̂·Qᵀ``; "local minus mean" for the uncompressed blocks (Alg. 2 line 9).
9. The next Q: this one with warm start (an all-zero column keeps its old value), else a fresh draw.
10. Non-finite gradients (the policy of ``jaxcomp._src.finite``), from what was all-reduced anyway:
    a NaN or an infinity in any device's M reaches the sum of its P (an entry times anything,
    zero included, is not finite) and so every device's copy of it, and the dense blocks' sums;
    where a sum is not finite, the error and the factors keep their old values (in the same
    pass that writes the new ones) and the output is NaN (by its Q, the small factor): no pass
    over g and e and no all-reduce of a flag beyond the step's own.

Alternating (epfml's ``BasicPowerSGD``), in place of 5–6, phases "even" and "odd" within
"compressed": even steps send ``Q = Mᵀ·orth(P)``, odd ones ``P = M·orth(Q)``, in one all-reduce with
the uncompressed blocks, ÷W; the output uses the mean factor, which is kept, the error this device's
own (epfml's local error).

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019 (https://arxiv.org/abs/1905.13727), Algorithms 1 and 2.
  PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``; epfml/powersgd.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import axis, compressor, finite, kernels, phases, stacks, validate
from jaxcomp._src import tree as tree_lib

_Q, _P = 0, 1  # the factor a random draw is for
_LAYERWISE_ONLY = ("epsilon", "min_compression_rate", "matrix_view", "alternating", "compress")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PowerSGDConfig(compressor.MeanConfig):
  """PowerSGD's settings, validated; a static pytree node kept in the state. Attributes:
  ``powersgd``'s arguments (``epsilon`` may be an array), and ``batched`` (``batched_powersgd``)."""
  NONFINITE = "own"  # 10: from P, Q and the dense sums

  rank: int = validate.setting(1, check=functools.partial(
      validate.integer, minimum=1, static="fixes the shapes of P and Q"))
  start_iter: int = validate.setting(1000, check=functools.partial(
      validate.integer, minimum=0, static="starts the stats"))
  min_compression_rate: float = validate.setting(2.0, check=functools.partial(validate.number,
                                                                              low=0))
  error_feedback: bool = validate.setting(True, check=validate.boolean)
  warm_start: bool = validate.setting(True, check=validate.boolean)
  epsilon: Any = validate.setting(0.0, check=functools.partial(validate.number, low=0),
                                  traceable=True)
  seed: int = validate.setting(0, check=functools.partial(
      validate.integer, minimum=0, static="seeds the factors drawn at init"))
  matrix_view: str = validate.setting("flax", check=functools.partial(
      validate.choice, choices=("torch", "flax")))
  alternating: bool = validate.setting(False, check=validate.boolean)
  compress: Optional[Callable] = validate.setting(None, check=validate.optional(
      functools.partial(validate.function, signature="compress(path, leaf) -> bool")))
  batched: bool = validate.setting(False, check=validate.boolean)

  @property
  def name(self) -> str:
    return "batched_powersgd" if self.batched else "powersgd"

  def settings(self) -> tuple:
    """Batched PowerSGD takes none of layer-wise PowerSGD's own settings."""
    every = super().settings()
    return tuple(n for n in every if n not in _LAYERWISE_ONLY) if self.batched else every

  def check(self):
    layerwise = [f.name for f in dataclasses.fields(self) if f.name in _LAYERWISE_ONLY and (
        validate.is_array(getattr(self, f.name)) or getattr(self, f.name) != f.default)]
    if self.batched and layerwise:
      got = ", ".join(f"{name}={getattr(self, name)!r}" for name in layerwise)
      raise ValueError(f"batched PowerSGD takes no {', '.join(layerwise)} (got {got}): they are "
                       "layer-wise PowerSGD's settings; leave them out, or use jaxcomp.powersgd")
    if self.alternating and not self.warm_start:
      raise ValueError("alternating=True needs warm_start=True: each step starts from the factor "
                       "the last step sent; got warm_start=False")

  def phases(self) -> tuple:
    """1: the warm-up (if ``start_iter``), then "compressed"."""
    return ((phases.Phase(f"{self.name}.warmup", 0.0, "warmup"),) * (self.start_iter > 0)
            + (phases.Phase(f"{self.name}.compressed", 1.0, "compressed"),))

  def phase_of(self, count) -> jax.Array:
    return (count >= self.start_iter).astype(jnp.int32) * (self.start_iter > 0)

  def halves(self) -> tuple:
    """Alternating: the halves of "compressed", even and odd steps."""
    return phases.Phase(f"{self.name}.even", 0.5), phases.Phase(f"{self.name}.odd", 0.5)


class PowerSGDState(NamedTuple):
  """State of PowerSGD: a tuple entry per group of blocks (3) in each field, stacked; ``by_leaf``
  gives a field in the params' structure.

  Attributes:
    count: steps taken (int32); steps with a non-finite gradient are not counted.
    error: the error feedback, per device: ``(G, n, m)`` per group (``optax.MaskedNode()`` without
      error feedback); batched, ``(1, side, side)`` per square.
    q: the Q the next compressed step starts from, the same on every device: ``(G, m, r)`` per
      compressed group, else ``optax.MaskedNode()``; batched, ``(1, side, r)`` per square.
    p: alternating: the P an odd step starts from, as ``q`` (``(G, n, r)``).
    config, signature: the settings; the gradient's structure, shapes, dtypes and paths.
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

  def by_leaf(self, field: str):
    """Layer-wise: ``field`` (``"error"``, ``"q"``, ``"p"``) in the params' structure
    (``stacks.by_leaf``): a leaf's error in its shape, its Q ``(m, r)``, its P ``(n, r)``."""
    return stacks.by_leaf(self.signature, _members(self), getattr(self, field), 2, field == "error")

  def with_leaves(self, field: str, tree) -> "PowerSGDState":
    """The state with ``field`` set from ``tree``, in the params' structure (``by_leaf``'s)."""
    return self._replace(**{field: stacks.with_leaves(
        self.signature, _members(self), getattr(self, field), tree, 2, field == "error")})


class _Block(NamedTuple):
  """One matrix: reduced leaves ``members`` raveled, concatenated, zero-padded, viewed as (n, m)."""
  members: tuple  # positions among the reduced leaves
  shapes: tuple
  length: int
  n: int
  m: int
  rank: int
  compress: bool
  name: str  # seeds its random factors
  dtype: Any


def _blocks(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> list:
  """3: the blocks of the reduced leaves: one per leaf, or one square per dtype (batched)."""
  leaves, groups = signature.reduced_structs(), {}
  for k, (leaf, i) in enumerate(zip(leaves, signature.reduced)):
    groups.setdefault(leaf.dtype.name if config.batched else signature.paths[i], []).append(k)
  blocks = []
  for name, ks in groups.items():
    shapes = tuple(leaves[k].shape for k in ks)
    length = sum(map(math.prod, shapes))
    shape = shapes[0] or (1,)  # a 0-d leaf is (1, 1)
    n, m = ((math.ceil(math.sqrt(length)),) * 2 if config.batched
            else (shape[0], length // shape[0]) if config.matrix_view == "torch"
            else (length // shape[-1], shape[-1]))
    r = min(n, m, config.rank)
    compress = config.batched or ((config.compress is None or bool(config.compress(
        name, leaves[ks[0]]))) and (n + m) * r * config.min_compression_rate < n * m)
    blocks.append(_Block(tuple(ks), shapes, length, n, m, r, compress, name, leaves[ks[0]].dtype))
  return blocks


def _groups(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> list:
  """3: tuples of the blocks of one (n, m), rank, dtype and choice, stacked as (G, n, m) (batched:
  each square alone), in the order of their first block."""
  blocks = _blocks(config, signature)
  keys = [(b.name,) if config.batched else (b.n, b.m, b.rank, b.compress, b.dtype.name)
          for b in blocks]
  return [tuple(blocks[i] for i in group) for group in stacks.groups_of(keys)]


def _members(state: PowerSGDState) -> list:
  """The leaves of each group (layer-wise: a block is a leaf)."""
  return [[b.members[0] for b in g] for g in _groups(state.config, state.signature)]


def _draw(config: PowerSGDConfig, step, group: tuple, factor: int, dtype) -> jax.Array:
  """Standard-normal Qs (or Ps) of the group's blocks, stacked, the same on every device: each from
  ``seed``, the step and its block's name."""
  def draw(block):
    key = jax.random.fold_in(jax.random.key(config.seed), step)
    key = jax.random.fold_in(jax.random.fold_in(key, zlib.crc32(block.name.encode())), factor)
    return jax.random.normal(key, ((block.m, block.n)[factor], block.rank), dtype)
  return jnp.stack([draw(block) for block in group])


def init(config: PowerSGDConfig, signature: tree_lib.TreeSignature) -> PowerSGDState:
  """Zero error; the factors of the compressed blocks drawn from ``seed``."""
  error, q, p = [], [], []
  for group in _groups(config, signature):
    b, dtype = group[0], group[0].dtype
    error.append(jnp.zeros((len(group), b.n, b.m), dtype) if config.error_feedback
                 else optax.MaskedNode())
    q.append(_draw(config, 0, group, _Q, dtype) if b.compress else optax.MaskedNode())
    p.append(_draw(config, 0, group, _P, dtype) if b.compress and config.alternating
             else optax.MaskedNode())
  return PowerSGDState(jnp.zeros([], jnp.int32), tuple(error), tuple(q), tuple(p), config,
                       signature)


def orthogonalize(x: jax.Array, epsilon=0.0) -> jax.Array:
  """The columns of ``x`` (…, n, r; a stack batched) orthonormalized as torch does: modified
  Gram–Schmidt when r ≤ 2 or ``x`` is float16 / bfloat16 (``col /= norm(col) + epsilon``), else QR
  (no ``epsilon``). Unlike torch (alike at rounding level for full-rank ``x``): finished columns
  are removed twice, as one pass left 194 of 200 random rank-1 float32 (20, 2) matrices far from
  orthogonal in torch 2.13; an all-zero column stays zero with ``epsilon=0`` (torch: NaN);
  half-precision norms in float32."""
  if x.shape[-1] > 2 and x.dtype not in (jnp.float16, jnp.bfloat16):
    return jnp.linalg.qr(x)[0]
  cols = []
  wide = jnp.promote_types(x.dtype, jnp.float32)
  for i in range(x.shape[-1]):
    col = x[..., i]
    for _ in range(2):
      for done in cols:
        col = col - jnp.sum(done * col, axis=-1, keepdims=True) * done
    norm = jnp.sqrt(jnp.sum(jnp.square(col.astype(wide)), axis=-1, keepdims=True))
    denom = norm.astype(x.dtype) + jnp.asarray(epsilon, x.dtype)
    cols.append(col / jnp.where(denom == 0, jnp.ones_like(denom), denom))
  return jnp.stack(cols, axis=-1)


def _matrix(group: tuple, leaves: list, error) -> kernels.Sum:
  """2, 3: ``M = g + e``, the group's (G, n, m) matrices: g (leaves, or the batched square of the
  leaves) plus this device's error, a ``kernels.Sum`` that the products read term by term; for a
  group of several blocks, M itself, written once (the stacked g would be written anyway)."""
  b, gs = group[0], []
  for block in group:
    members = [leaves[k] for k in block.members]
    if len(members) == 1 and b.n * b.m == block.length:
      gs.append(members[0].reshape(b.n, b.m))
    else:  # batched: raveled, concatenated, zero-padded
      gs.append(kernels.zero_padded(members, b.n * b.m).reshape(b.n, b.m))
  g = jnp.stack(gs)
  e = None if error is None else error.astype(g.dtype)
  return kernels.Sum((g,) if e is None else (g, e) if len(gs) == 1 else (g + e,))


def _new_error(m: kernels.Sum, x: jax.Array, error: jax.Array, ok: jax.Array) -> jax.Array:
  """8, 10: ``e ← M − x``, in e's dtype, over the old error's block (``kernels.in_place``): ``M =
  g + e`` from its terms, or M as written; the old error where ``ok`` is false."""
  def new(e, g, x, ok):
    value = g + e.astype(g.dtype) if len(m.terms) > 1 else g
    return jnp.where(ok, (value - x).astype(e.dtype), e)
  return kernels.in_place(new, error, m.terms[0], x, ok)


def _leaves(groups: list, values: list, count: int) -> list:
  """7: each group's (G, n, m) value cut back to its ``count`` leaves (``_matrix``'s inverse)."""
  leaves = [None] * count
  for group, value in zip(groups, values):
    for block, x in zip(group, value):
      flat = x.reshape(-1)[:block.length]
      for k, leaf in zip(block.members, tree_lib.unflatten(flat, block.shapes)):
        leaves[k] = leaf
  return leaves


def _mean_of_sums(arrays: list, axis_name) -> list:
  """One all-reduce SUM of ``arrays``, then ÷W (torch's order for the Qs and dense blocks)."""
  return [axis.divide_by_world(s, axis_name) for s in axis.psum_many(arrays, axis_name)]


def _kept(new: list, old: list) -> list:
  """9: ``new`` in ``old``'s dtypes, but an all-zero column keeps its old value (it would stall)."""
  return [jnp.where(jnp.all(x == 0, axis=-2, keepdims=True), y, x.astype(y.dtype))
          for x, y in zip(new, old)]


def _power_iteration(config, operands: tuple, axis_name) -> tuple:
  """Steps 4–6 on ``(M of the compressed blocks, their Qs, their Ps, M of the dense blocks)``:
  ``(the dense means, (P̂, Q) of each output, the same for the error, Qs, Ps)``."""
  mats, qs, ps, dense = operands
  # 5: P = M·orth(Q) locally. 4, 5: one all-reduce SUM of the dense blocks and every P.
  sums = axis.psum_many([m.value() for m in dense] + [
      kernels.product(m, orthogonalize(q.astype(m.terms[0].dtype), config.epsilon))
      for m, q in zip(mats, qs)], axis_name)
  means = [axis.divide_by_world(s, axis_name) for s in sums[:len(dense)]]  # 4: then ÷W
  p_hats = [orthogonalize(p, config.epsilon) for p in sums[len(dense):]]  # 5: P̂ = orth(P)
  # 6: Q = Mᵀ·P̂ locally; all Qs in one all-reduce SUM, then ÷W.
  new = _mean_of_sums([kernels.transposed_product(m, p) for m, p in zip(mats, p_hats)], axis_name)
  ok = finite.reduced_finite((sums, new))  # 10
  return means, list(zip(p_hats, new)), list(zip(p_hats, new)), _kept(new, qs), ps, ok


def _half_iteration(config, parity, operands: tuple, axis_name) -> tuple:
  """Alternating 4–6, as ``_power_iteration``: on even steps (``parity`` 0) send ``Q = Mᵀ·orth(P)``,
  on odd ones ``P = M·orth(Q)``; the error's factors are this device's own. Both local products
  are taken and only the all-reduce is switched: a conditional with the gradient among its operands
  makes XLA:CPU copy it (``benchmarks/memory.py``, ResNet-18, rank 1: temporaries 1.06 → 0.46 per
  gradient; ``step_time.py``, 2.9M-parameter MLP, W = 8: 1.37 → 1.04 of allreduce's step)."""
  mats, qs, ps, dense = operands
  p_hats, q_hats = ([orthogonalize(f.astype(m.terms[0].dtype), config.epsilon)
                     for m, f in zip(mats, fs)]
                    for fs in (ps, qs))
  local_qs = [kernels.transposed_product(m, p) for m, p in zip(mats, p_hats)]
  local_ps = [kernels.product(m, q) for m, q in zip(mats, q_hats)]
  dense = [m.value() for m in dense]

  def send(local):  # one all-reduce SUM of the dense blocks and the factors sent, then ÷W
    means = _mean_of_sums(dense + local, axis_name)
    return means[:len(dense)], means[len(dense):], finite.reduced_finite(means)  # 10

  def even():
    means, q_means, ok = send(local_qs)
    return means, q_means, ps, ok  # (dense means, Q means, the Ps unchanged)

  def odd():
    means, p_means, ok = send(local_ps)
    return means, qs, p_means, ok

  means, q_means, p_means, ok = phases.switch(parity, config.halves(), [even, odd])
  pick = lambda xs, ys: [jnp.where(parity == 0, x, y) for x, y in zip(xs, ys)]  # noqa: E731
  outputs = list(zip(pick(p_hats, p_means), pick(q_means, q_hats)))
  residuals = list(zip(pick(p_hats, local_ps), pick(local_qs, q_hats)))
  return (means, outputs, residuals, pick(_kept(q_means, qs), qs), pick(ps, _kept(p_means, ps)),
          ok)


def step(config: PowerSGDConfig, state: PowerSGDState, leaves: list, axis_name,
         phase: phases.Phase) -> tuple:
  """One step on the reduced ``leaves`` (the module docstring's steps): ``(outputs, state, ok)``."""
  if phase.value == "warmup":  # 1: ÷W, then one all-reduce SUM
    means = axis.mean_many(leaves, axis_name)
    return means, state, finite.reduced_finite(means)  # 10: the state is unchanged
  groups = _groups(config, state.signature)
  errors, qs, ps = (list(f) for f in state[1:4])
  ms = [_matrix(g, leaves, e if config.error_feedback else None) for g, e in zip(groups, errors)]
  dense = [k for k, g in enumerate(groups) if not g[0].compress]
  packed = [k for k, g in enumerate(groups) if g[0].compress]
  operands = ([ms[k] for k in packed], [qs[k] for k in packed], [ps[k] for k in packed],
              [ms[k] for k in dense])
  if config.alternating:
    means, outputs, residuals, new_qs, new_ps, ok = _half_iteration(
        config, (state.count - config.start_iter) % 2, operands, axis_name)
  else:
    means, outputs, residuals, new_qs, new_ps, ok = _power_iteration(config, operands, axis_name)
  for k, q, p in zip(packed, new_qs, new_ps):  # 9, 10: kept where not finite (P: if any)
    fresh = q if config.warm_start else _draw(config, state.count + 1, groups[k], _Q, q.dtype)
    qs[k], ps[k] = finite.keep_if_finite(ok, (fresh, p), (qs[k], ps[k]))

  def per_group(factors):  # the dense means, and P·Qᵀ of the compressed groups
    values = {**dict(zip(dense, means)),
              **{k: kernels.low_rank_product(p, q) for k, (p, q) in zip(packed, factors)}}
    return [values[k] for k in range(len(groups))]

  if config.error_feedback:  # 8: e ← M − P̂·Qᵀ, M − mean for the dense groups; 10: kept
    errors = [_new_error(m, r, e, ok) for m, r, e in zip(ms, per_group(residuals), errors)]
  new_state = dict(error=tuple(errors), q=tuple(qs), p=tuple(ps))
  # 10: NaN outputs where not finite, through the small factors and the dense means.
  outputs = [(p, finite.nan_unless_finite(ok, q)) for p, q in outputs]
  means = finite.nan_unless_finite(ok, means)
  return _leaves(groups, per_group(outputs), len(leaves)), state._replace(**new_state), ok


def powersgd_stats(tree) -> tuple:
  """torch's ``PowerSGDState.compression_stats()``, summed over every PowerSGD state in ``tree``.

  Args:
    tree: a ``PowerSGDState`` or a pytree of them (a chain's, ``comm_hook``'s), maybe stacked.

  Returns:
    ``(numel before / numel after, numel before, numel after)`` over the compressed steps so far
    (rate 0 before the first); alternating counts the factor each step sent.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> tx = jaxcomp.powersgd(rank=2, start_iter=0)
    >>> grads = jnp.ones((8, 32, 32))  # a 32 × 32 gradient per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> for _ in range(3):
    ...   _, state = step(grads, state)
    >>> jaxcomp.powersgd_stats(state)  # 3 steps of 1,024 numbers, each sent as 2 × (32 + 32)
    (8.0, 3072, 384)
  """
  before = after = 0
  for state in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PowerSGDState)):
    if isinstance(state, PowerSGDState):
      steps = max(int(np.max(np.asarray(state.count))) - state.config.start_iter, 0)
      for b in _blocks(state.config, state.signature):
        factors = ((steps + 1) // 2 * b.m + steps // 2 * b.n if state.config.alternating
                   else steps * (b.n + b.m))  # alternating: Qs on even steps, Ps on odd ones
        before, after = before + steps * b.length, after + (
            factors * b.rank if b.compress else steps * b.length)
  return (before / after if after else 0, before, after)


def powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
             min_compression_rate: float = 2.0, error_feedback: bool = True,
             warm_start: bool = True, epsilon: float = 0.0, seed: int = 0,
             matrix_view: str = "flax", alternating: bool = False,
             compress: Optional[Callable] = None,
             bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """Layer-wise PowerSGD: the cross-device mean of a rank-``rank`` approximation of each matrix.

  The plain mean for ``start_iter`` steps, then torch's ``powerSGD_hook`` (the module docstring);
  ``jaxcomp.comm_report`` gives a step's bytes, ``.phase("powersgd.warmup")`` a warm-up's.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.powersgd(rank=1, start_iter=1), optax.sgd(0.1))
    >>> grads = {"w": jnp.ones((8, 16, 16))}  # a 16 × 16 gradient per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> report = jaxcomp.comm_report(step, grads, state)  # bytes: the mean, then P and Q (rank 1)
    >>> report.phase("powersgd.warmup").payload_bytes, report.payload_bytes
    (1024, 128)

  Args:
    rank: the approximation rank r, clamped to ``min(n, m)`` per leaf (ResNet-18: 2, see the paper).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    start_iter: steps of plain mean first (torch's ``start_powerSGD_iter``; about 10% of training).
    min_compression_rate: compress a leaf only if it shrinks by more than this factor.
    error_feedback: add each device's compression error to its next gradient (else biased).
    warm_start: start each power iteration from the last step's Q (else a fresh random Q).
    epsilon: added to the column norms in Gram–Schmidt (torch's ``orthogonalization_epsilon``); a
      schedule under ``optax.inject_hyperparams(jaxcomp.powersgd, static_args=("rank",
      "start_iter", "min_compression_rate", "seed"))``.
    seed: the seed of the random factors, the same on every device.
    matrix_view: ``"flax"``: a leaf ``(..., k)`` is ``(prod(shape[:-1]), k)``, fan-in × fan-out of
      Flax kernels; ``"torch"``: ``(shape[0], prod(shape[1:]))`` for torch-layout arrays.
    alternating: half a power iteration per step, one all-reduce instead of two in sequence, the
      same bytes over two steps (epfml's variant; needs ``warm_start``).
    compress: ``compress(path, leaf) -> bool`` (leaf: a ``jax.ShapeDtypeStruct``): which leaves may
      be compressed; the others are averaged densely (``optax.masked`` would not average them).
    bucket_cap_mb: None, or DDP's buckets of this many MiB, each with its own state and
      collectives, which can overlap the backward pass.

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState`` (with ``bucket_cap_mb``, a
    ``CommHookState`` of one per bucket); its output is identical on every device.

  References:
    Vogels et al., NeurIPS 2019; torch's ``powerSGD_hook``; epfml/powersgd for ``alternating``.
  """
  config = PowerSGDConfig(
      rank=rank, start_iter=start_iter, error_feedback=error_feedback, warm_start=warm_start,
      seed=seed, epsilon=epsilon, min_compression_rate=min_compression_rate,
      matrix_view=matrix_view, alternating=alternating, compress=compress)
  return compressor.transformation(config, init, step, axis_name, bucket_cap_mb=bucket_cap_mb)


def batched_powersgd(rank: int = 1, *, axis_name: axis.AxisName = "batch", start_iter: int = 1000,
                     error_feedback: bool = True, warm_start: bool = True,
                     seed: int = 0) -> optax.GradientTransformation:
  """Batched PowerSGD: each dtype's leaves as one zero-padded square matrix with one P and Q.

  The leaves, raveled and zero-padded to side² (``side = ceil(sqrt(L))``), go through ``powersgd``'s
  steps without epsilon. Cheaper than layer-wise PowerSGD, but the square loses the layers' low-rank
  structure: torch recommends rank 1, and with error feedback it can diverge (see the README).

  Example:
    >>> import jax, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.batched_powersgd(rank=1, start_iter=0), optax.sgd(0.1))
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 16, 16))}  # one per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
    >>> bool((updates["w"] == updates["w"][0]).all())  # the same update on every device
    True

  Args:
    rank: the approximation rank r (clamped to ``side``).
    axis_name, start_iter, error_feedback, warm_start, seed: as ``powersgd``.

  Returns:
    A ``GradientTransformation`` with a ``PowerSGDState`` (``config.batched`` set).

  References:
    PyTorch ``batched_powerSGD_hook`` (torch 2.13; it raises at its first compressed step).
  """
  config = PowerSGDConfig(rank=rank, start_iter=start_iter, error_feedback=error_feedback,
                          warm_start=warm_start, seed=seed, batched=True)
  return compressor.transformation(config, init, step, axis_name)
