"""DeMo: decoupled momentum, of which only the largest DCT coefficients cross the wire.

DeMo (Peng, Quesnelle, Kingma) keeps each device's momentum to itself and exchanges only its fast
components: the largest coefficients of a chunked DCT-II of the momentum, tile by tile, as (index,
value) pairs from every device. What was sent is removed from the momentum (the error feedback);
the slow components stay and grow until they are sent. The update is the sign of what the devices
sent, decoded, an SGD step with decoupled weight decay. ``demo`` is a whole optimizer (its output
is the update; nothing is chained after it).

The steps, per device, W devices, at step t (the ``# n:`` comments below point here; "ref." is
bloc97/DeMo's ``demo.py``, the paper's Algorithm 1):

1. The tiles: a leaf is a matrix (a, b) = (prod(shape[:-1]), shape[-1]) (a vector (1, n), a scalar
   (1, 1)), cut into tiles of h × w, h the largest divisor of a that is at most ``chunk`` (w of b;
   ref.'s ``_get_smaller_split``); k' = min(k, h·w) coefficients of each tile are sent. A leaf
   whose tiles would send at least its dense mean — the W devices' k' values and positions per
   tile against an all-reduce of its values: a side with no divisor near ``chunk`` (a prime)
   cuts thin tiles, and a small leaf has few values to choose from — sends every coefficient,
   as that all-reduce (steps 4–7 with every coefficient sent by every device: the mean of C),
   and keeps none. DeMo never sends more than the mean for a leaf.
2. ``δ ← decay·δ + lr(t)·g``, this device's own gradient (ref.: ``delta.mul_(decay).add_(grad,
   alpha=lr)``), kept as its DCT coefficients C (the state): ``C ← decay·C + lr(t)·DCT(g)``, the
   DCT being linear.
3. The orthonormal DCT-II of each tile of g, as products with the basis matrices (ref.'s
   ``TransformDCT.encode`` of δ): ``Fₕᵀ·tile·F_w``.
4. The k' coefficients of largest magnitude of each tile (``lax.top_k``; ref.'s
   ``CompressDCT.compress``), their positions in the tile as int16 (int32 for a tile of more than
   32,768 coefficients).
5. Error feedback: ``δ ← δ − IDCT(the coefficients sent)`` (ref.: ``delta.sub_(transmit_grad)``)
   is, in the coefficients, C with the ones sent set to zero: no inverse DCT.
6. One all-gather of every leaf's positions (int16) and one of the values (float32), from every
   device (ref.'s ``_demo_all_gather``).
7. The decode, the same on every device: per coefficient, the sum of the values the devices sent
   for it, added in device order (one scatter per device for all the tiles of one size), divided
   by how many sent it (ref.'s ``scatter_reduce(..., "mean", include_self=False)``; 0 where none
   did); the inverse DCT (``Fₕ·C·F_wᵀ``).
8. The update ``−lr(t)·(sign(decoded) + weight_decay·X)`` (ref.: ``p.mul_(1 − lr·wd)``, then
   SGD on ``grad.sign_()``).
9. Non-finite gradients: a NaN or infinity anywhere in a device's tile makes every coefficient of
   that tile non-finite (each is a sum over the whole tile), so it reaches every device in the
   gathered values (``finite.reduced_finite``): on such a step the state is kept
   (``finite.keep_if_finite``) and the learning rate that scales every update is NaN.

Bytes per device per step (payload, ``comm_report``): W·k'·(4 + 2) per tile (the gathered values
and int16 positions of every device), against 4·h·w of a float32 mean. With 64 × 64 tiles and
k = 32 a device's own share is 85× smaller than its float32 tile (the paper's "data per GPU"); at
W = 8 the gathered payload is 10.7× smaller than a float32 all-reduce's and the ring traffic 21×
(an all-gather forwards every device's share). A leaf that falls back to its mean (1) sends 4 bytes
per value, an all-reduce.

Differences from ref. The momentum is kept as its DCT coefficients, so a step takes one DCT (of
the gradient) and one inverse (of the mean) where ref. takes three (δ's DCT, the inverse of what
was sent for the error feedback, the inverse of the mean); the two agree to rounding. The
positions travel as int16, not int64 (4× fewer index bytes). The decode
adds the devices' values in device order, so every device computes the same bits (ref.'s
``scatter_reduce`` may add them in any order, so its replicas can drift apart). Leaves of more than
two dimensions are matrices of their last axis (ref. handles 1-D and 2-D tensors only). The
momentum and the values sent are float32 for every gradient dtype (ref.: the parameter's). The
parameters keep their own dtype: the update is computed in float32 and cast. A non-finite
gradient leaves the state as it was (9; ref. has no such policy: one NaN poisons its momentum).
A leaf whose tiles would cost more than its mean is averaged whole (1; ref. sends its tiles).

References:
  Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", 2024
  (https://arxiv.org/abs/2411.19870), Algorithm 1; bloc97/DeMo ``demo.py`` (``DeMo.step``,
  ``TransformDCT``, ``CompressDCT``).
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

from jaxcomp._src import axis, compressor, finite, kernels, validate
from jaxcomp._src import tree as tree_lib

_INT16_TILE = 2 ** 15  # the largest tile whose positions fit int16


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DeMoConfig(compressor.MeanConfig):
  """DeMo's settings, validated; a static node in the state. Attributes: ``demo``'s arguments."""
  name = "demo"
  NONFINITE = "own"  # 9: from the values gathered anyway

  learning_rate: Any = validate.setting(check=validate.learning_rate, traceable=True)
  chunk: int = validate.setting(64, check=functools.partial(
      validate.integer, minimum=1, static="fixes the tiles' shapes"))
  k: int = validate.setting(32, check=functools.partial(
      validate.integer, minimum=1, static="fixes how many coefficients are sent"))
  decay: Any = validate.setting(0.999, check=functools.partial(
      validate.number, low=0, high=1, high_open=True), traceable=True)
  weight_decay: Any = validate.setting(0.0, check=functools.partial(validate.number, low=0),
                                       traceable=True)

  @property
  def output(self) -> str:
    return "update"


class DeMoState(NamedTuple):
  """State of ``demo``.

  Attributes:
    count: steps taken (non-finite steps are not counted).
    coefficients: the DCT coefficients of this device's momentum δ (2), float32, each leaf's
      tiles one after the other, a tile's h·w coefficients row by row, in the leaf's shape; the
      params' structure (``optax.MaskedNode()`` where not reduced); per device. ``momentum``
      gives δ.
    config: the static settings.
    signature: the gradient pytree's structure, shapes and dtypes.
  """
  count: jax.Array
  coefficients: Any
  config: DeMoConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("coefficients",)  # see jaxcomp.sharding


def largest_divisor(n: int, at_most: int) -> int:
  """1: the largest divisor of ``n`` that is at most ``at_most`` (ref.'s ``_get_smaller_split``)."""
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


class _Tiles(NamedTuple):
  """1: a leaf as an (a, b) matrix of (a/h)·(b/w) tiles of h × w, k coefficients sent per tile."""
  a: int
  b: int
  h: int
  w: int
  k: int

  @property
  def grid(self) -> tuple:
    return (self.a // self.h, self.b // self.w)

  @property
  def index_dtype(self):
    return jnp.int16 if self.h * self.w <= _INT16_TILE else jnp.int32


def _tiles(config: DeMoConfig, shape: tuple) -> _Tiles:
  a, b = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
  h, w = largest_divisor(a, config.chunk), largest_divisor(b, config.chunk)
  return _Tiles(a, b, h, w, min(config.k, h * w))


@functools.lru_cache(maxsize=None)
def dct_basis(n: int) -> np.ndarray:
  """The orthonormal DCT-II basis, (n, n): column j is the j-th cosine, ``F[i, j] = c_j·cos(π(2i +
  1)j / 2n)`` with ``c_0 = √(1/n)``, ``c_j = √(2/n)``; ``x @ F`` is the DCT of ``x``, ``y @ F.T``
  its inverse (ref.'s ``f_dict``, ``b_dict``)."""
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  basis = np.cos(np.pi * (2 * i + 1) * j / (2 * n)) * np.sqrt(2.0 / n)
  basis[:, 0] = np.sqrt(1.0 / n)
  return basis.astype(np.float32)


def _encode(t: _Tiles, x: jax.Array) -> jax.Array:
  """3: the DCT of each tile of the (a, b) ``x``: (rows, cols, h·w)."""
  tiles = x.reshape(t.grid[0], t.h, t.grid[1], t.w)
  c = jnp.einsum("yhxw,hp,wq->yxpq", tiles, dct_basis(t.h), dct_basis(t.w))
  return c.reshape(*t.grid, t.h * t.w)


def _decode(t: _Tiles, c: jax.Array) -> jax.Array:
  """3, 7: ``_encode``'s inverse: the (a, b) matrix of the tiles' coefficients ``c``."""
  tiles = c.reshape(*t.grid, t.h, t.w)
  x = jnp.einsum("yxpq,hp,wq->yhxw", tiles, dct_basis(t.h), dct_basis(t.w))
  return x.reshape(t.a, t.b)


def _mean_of_sent(positions: jax.Array, values: jax.Array, size: int) -> jax.Array:
  """7: per coefficient of (tiles, ``size``), the devices' values added in device order ÷ how many
  sent it (0 where none did), from the gathered (W, tiles, k) ``positions`` and ``values``."""
  tiles = jnp.arange(values.shape[1])[:, None]
  total = jnp.zeros((values.shape[1], size), jnp.float32)
  count = jnp.zeros((values.shape[1], size), jnp.int8 if values.shape[0] < 128 else jnp.int32)
  for d in range(values.shape[0]):  # positions are distinct within a device's tile
    where = (tiles, positions[d].astype(jnp.int32))
    total = total.at[where].add(values[d])
    count = count.at[where].add(1)
  return total / jnp.maximum(count, 1).astype(jnp.float32)


def _groups(layout: list) -> dict:
  """7: the leaves by tile size, whose tiles are decoded together (one scatter per device for all
  of them, not one per leaf)."""
  groups: dict = {}
  for i, t in enumerate(layout):
    groups.setdefault(t.h * t.w, []).append(i)
  return groups


def _split(joined: jax.Array, layout: list, members: list) -> list:
  """Each member leaf's (tiles, size) rows of the tiles of ``members`` joined in order."""
  ends = np.cumsum([math.prod(layout[i].grid) for i in members])[:-1]
  return jnp.split(joined, ends) if len(members) > 1 else [joined]


def init(config: DeMoConfig, signature: tree_lib.TreeSignature) -> DeMoState:
  """Zero momenta for gradients of ``signature``."""
  zeros = [jnp.zeros(s.shape, jnp.float32) for s in signature.reduced_structs()]
  return DeMoState(jnp.zeros([], jnp.int32), signature.place(zeros), config, signature)


def momentum(state: DeMoState):
  """This device's momentum δ (2) in the params' structure, from the state's DCT coefficients."""
  deltas = []
  for c in state.signature.pick(state.coefficients):
    t = _tiles(state.config, c.shape)
    deltas.append(_decode(t, c.reshape(-1, t.h * t.w)).reshape(c.shape))
  return state.signature.place(deltas)


def step(config: DeMoConfig, state: DeMoState, leaves: list, axis_name, phase,
         params=None) -> tuple:
  """Steps 1–9 on the reduced leaves: ``(updates, new state, finite)``."""
  del phase
  decays = validate.is_array(config.weight_decay) or config.weight_decay != 0
  if params is None and decays:
    raise ValueError("demo: weight decay needs the parameters: call tx.update(grads, state, "
                     "params) (nnx.Optimizer and the usual optax loop do), or set weight_decay=0")
  rate = config.learning_rate
  rate = jnp.asarray(rate(state.count) if callable(rate) else rate, jnp.float32)
  layout = [_tiles(config, g.shape) for g in leaves]
  world = axis.axis_size(axis_name)
  dense = [i for i, t in enumerate(layout) if _sends_dense(t, world)]
  sparse = [i for i in range(len(leaves)) if i not in dense]
  coefficients, kept = [None] * len(leaves), [None] * len(leaves)
  positions, values = [], []
  for i, (t, g, old) in enumerate(zip(layout, leaves, state.signature.pick(state.coefficients))):
    with kernels.part("encode"):
      # 2–3: C ← decay·C + lr·DCT(g), tile by tile.
      c = (config.decay * old.reshape(-1, t.h * t.w)
           + rate * _encode(t, g.astype(jnp.float32).reshape(t.a, t.b)).reshape(-1, t.h * t.w))
    if i in dense:  # 4–5: every coefficient sent, none kept
      coefficients[i], kept[i] = c, jnp.zeros_like(old)
      continue
    with kernels.part("encode"):  # 4: the k' largest |coefficients| of each tile
      where = lax.top_k(jnp.abs(c), t.k)[1]
      sent = jnp.take_along_axis(c, where, axis=-1)
    with kernels.part("error_feedback"):  # 5: δ − IDCT(sent): C without the coefficients sent
      kept[i] = c.at[jnp.arange(c.shape[0])[:, None], where].set(0.0).reshape(g.shape)
    positions.append(where.astype(t.index_dtype))
    values.append(sent)
  # 6: every device's positions and values (one all-gather per dtype); the dense leaves' mean.
  gathered = kernels.all_gather(positions + values, axis_name) if sparse else []
  means = [None] * len(leaves)
  for i in dense:
    means[i] = axis.mean(coefficients[i], axis_name)
  ok = finite.reduced_finite(gathered[len(sparse):] + [means[i] for i in dense])  # 9
  rate = jnp.where(ok, rate, jnp.nan)  # 9: every update it scales NaN
  with kernels.part("decode"):  # 7: the mean of what was sent, the tiles of one size together
    tiled = [layout[i] for i in sparse]
    for size, members in _groups(tiled).items():
      joined = [jnp.concatenate([gathered[j + m] for m in members], axis=1)
                if len(members) > 1 else gathered[j + members[0]] for j in (0, len(sparse))]
      for m, part in zip(members, _split(_mean_of_sent(*joined, size), tiled, members)):
        means[sparse[m]] = part
  updates = []
  for i, (t, g) in enumerate(zip(layout, leaves)):
    with kernels.part("decode"):  # 7: its inverse DCT
      decoded = _decode(t, means[i])
    direction = jnp.sign(decoded).reshape(g.shape)  # 8
    if decays:
      direction = direction + config.weight_decay * params[i].astype(jnp.float32)
    updates.append((-rate * direction).astype(g.dtype))
  new_state = state._replace(coefficients=state.signature.place(kept))
  return updates, finite.keep_if_finite(ok, new_state, state), ok  # 9


def _sends_dense(t: _Tiles, world: int) -> bool:
  """1: whether a leaf's tiles would send at least its dense mean: the all-gather of every
  device's k' values and positions per tile, against an all-reduce of its a·b float32 values
  (per device, (W − 1)·sent against 2(W − 1)/W·4ab bytes). A side whose largest divisor is small
  (a prime) cuts thin tiles, and a small leaf has few values to choose from."""
  sent = math.prod(t.grid) * t.k * (4 + jnp.dtype(t.index_dtype).itemsize)
  return world * sent >= 8 * t.a * t.b


def demo(learning_rate, *, chunk: int = 64, k: int = 32, decay: float = 0.999,
         weight_decay: float = 0.0,
         axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """DeMo as an optax optimizer: sign-SGD on the largest DCT coefficients of the devices' momenta.

  Each device keeps its own momentum δ (of ``learning_rate``-scaled gradients) and sends, for every
  ``chunk`` × ``chunk`` tile of every leaf, the ``k`` largest coefficients of its DCT, removing them
  from δ; the update is the sign of the devices' decoded mean, bit-identical on every device (the
  module docstring numbers the steps). Use it in place of ``optax.chain(jaxcomp.allreduce(),
  optax.adamw(lr))``, with nothing chained after it but a guard. On a step whose gradient is
  non-finite on any device the state is kept and the update is NaN.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> tx = jaxcomp.demo(1e-3)  # the top 32 of each 64 × 64 tile's DCT
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 128, 64))}  # one per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> jaxcomp.comm_report(step, grads, state).payload_bytes  # 8 devices × 2 tiles × 32 × (4 + 2)
    3072
    >>> updates, state = step(grads, state)
    >>> bool((updates["w"] == updates["w"][0]).all())  # the same update on every device
    True

  Args:
    learning_rate: a positive number or an optax schedule of the step count (called with the
      steps taken; a non-finite step is not counted); an array under ``optax.inject_hyperparams``.
      It scales the gradient into δ and the sign step out of it, as in the paper.
    chunk: the tiles' largest side: each side of a leaf's matrix is cut at its largest divisor
      that is at most ``chunk``.
    k: coefficients sent per tile (all of a tile with fewer).
    decay: the momentum's decay β.
    weight_decay: decoupled weight decay, scaled by the learning rate.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A ``jaxcomp.Transformation`` whose updates are identical on every device, in the gradients'
    dtypes; its state is a ``DeMoState``. With weight decay its update needs the parameters
    (``tx.update(grads, state, params)``).

  References:
    Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", 2024, Algorithm 1;
    bloc97/DeMo ``demo.py``.
  """
  config = DeMoConfig(learning_rate=learning_rate, chunk=chunk, k=k, decay=decay,
                      weight_decay=weight_decay)
  return compressor.transformation(config, init, step, axis_name)
