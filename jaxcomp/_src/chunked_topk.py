"""Chunked top-k with low-bit values and decayed error feedback: SparseLoCo's exchange.

Every device keeps, in each chunk of each leaf, the ``k`` coordinates of its error-fed values of
largest magnitude, quantizes them to ``bits`` bits, sends positions and codes in a few bytes, and
keeps what it did not send for later. The output is the mean over the devices of what they sent,
the same on every device. ``jaxcomp.sparseloco`` runs it on DiLoCo's pseudo-gradient once every H
steps; as a gradient compressor (``optax.chain(chunked_topk(...), optax.sgd(lr))``) it is top-k
sparsification with error feedback (Stich et al. 2018) and low-bit values.

Chunks: a reduced leaf of n elements is cut into m = ceil(n / ``chunk``) chunks of c = ceil(n / m) ≤
``chunk`` consecutive elements (row-major; the last chunk zero-padded, never by more than m − 1),
and each chunk keeps k_c = min(c, ceil(``k``·c / ``chunk``)) coordinates: the density ``k / chunk``
everywhere, a leaf smaller than one chunk keeping at least one.

The steps, per device and per reduced leaf (the ``# n:`` comments below point here):

1. error feedback: ``e ← β·e + g`` (float32), β = ``error_decay``;
2. selection: in each chunk, the k_c positions of largest ``|e|`` (ties to the lower position;
   padding only after every real coordinate), in increasing order;
3. quantization of the selected values v: a sign bit, and ``bits − 1`` bits for the magnitude: the
   range [min ``|v|``, max ``|v|``] of the chunk's selected magnitudes is cut into L = 2^(bits−1)
   equal bins (the top edge in the last bin), and each bin's magnitude is the mean of the magnitudes
   in it (its centroid), rounded to bfloat16; ``v̂ = ±centroid``. With ``bits=1`` that is the sign
   times the mean magnitude. Sending each bin's mean follows SparseLoCo's reference code (templar's
   ``TopKCompressor`` bins a whole tensor's kept values over ±3σ about their mean and sends the
   bins' means); here the bins are per chunk and symmetric in the sign, so the quantizer is odd;
4. ``e ← e − ê``, ê being v̂ at the selected positions and 0 elsewhere (what was not sent stays, as
   does the quantization error of what was), written once the exchange has said whether to (8);
5. encoding: one byte row per chunk — the positions in Elias–Fano code (``jaxcomp._src.bitpack``),
   then the codes (sign · L + bin, ``bits`` bits each), packed least significant bit first, then the
   L centroids as bfloat16 bytes; every row of every leaf in one ``uint8`` vector;
6. one ``all_gather`` of the bytes;
7. every device decodes the W devices' rows and adds each device's ê ÷ W in device order, each
   device's positions distinct (no scatter collisions: the sum is the same on every backend and
   every device), and casts the mean back to the leaf's dtype;
8. non-finite values (``jaxcomp._src.finite``'s policy), seen in what is sent, with no pass of their
   own: a NaN or an infinity has the largest magnitude of its chunk (2 ranks a NaN as ∞, whatever
   order a backend's ``top_k`` gives NaN), so 2 selects it; a device whose selected values are not
   all finite sends every centroid of the leaf as NaN, every device decodes NaN values from it, and
   on such a step every output is NaN and the error is kept.

Bytes per device per step: each chunk's row is ceil((k_c·l + k_c + ((c − 1) >> l) + k_c·bits) / 8)
+ 2·L bytes, l = floor(log2(c / k_c)) (``payload_bytes``). For the default 64 of 4,096 at 2 bits:
511 bits of positions (the information bound log2 C(4096, 64) is 471.3; 12-bit indices would take
768) and 128 bits of codes, 80 bytes, plus 4 bytes of centroids: 84 bytes per 4,096 values, 0.16
bits a value. An all-gather receives it from every device, (W − 1)·84 bytes per device per 4,096
values under the ring algorithm, against 2·(W − 1)/W·16,384 for a float32 all-reduce — ``4096·8 /
(W·84)`` = 49× fewer at W = 8 (the ratio falls as W grows: sparse supports differ from device to
device, so they cannot be summed on the wire).

State: the error ``e`` of each reduced leaf, per device (``PER_DEVICE_FIELDS``), kept exactly on a
step whose gradient is non-finite on any device (8).

References:
  Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
  2025 (https://arxiv.org/abs/2508.15706): chunked top-k of the decayed error feedback, 2-bit
  values. Lidin et al., "Covenant-72B", 2026 (https://arxiv.org/abs/2603.08163): 64 of every 4,096,
  β = 0.95. Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (top-k with error
  feedback).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp._src import axis, bitpack, compressor, finite, kernels, validate
from jaxcomp._src import tree as tree_lib

_CENTROID_DTYPE = jnp.bfloat16  # float32's range (no overflow to clamp), 2 bytes; 8 bits of
# mantissa are far finer than a 2-bit code, and the sender keeps the rounding in its error.


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ChunkedTopKConfig(compressor.MeanConfig):
  """``chunked_topk``'s settings, validated; a static node of the state.

  Attributes:
    k: coordinates kept per chunk (static: it fixes the message's size). The density is
      ``k / chunk``: SparseLoCo reports 1–3% densities, Covenant-72B sends 64 of 4,096
      (1.56%).
    chunk: the chunk length (static). Selecting per chunk spreads the kept coordinates over the
      whole leaf (a global top-k lets a few large rows take all of it) and bounds a position to
      log2(chunk) bits; 4,096 is Covenant-72B's chunk for vectors (its matrices use 64×64 tiles).
    bits: bits per kept value, 1 to 4 (static): a sign and ``bits − 1`` bits of magnitude, with
      2^(bits−1) bfloat16 centroids per chunk. SparseLoCo sends 2 bits and still does better than
      DiLoCo sending float32.
    error_decay: β, the decay of the error feedback (traceable). 1 keeps everything not yet sent
      (classic error feedback); below 1 the buffer is SparseLoCo's stand-in for DiLoCo's outer
      momentum, which forgets old pseudo-gradients (Covenant-72B: 0.95).
  """
  name = "chunked_topk"
  NONFINITE = "own"  # 8: from the centroids it sends anyway

  k: int = validate.setting(64, check=functools.partial(
      validate.integer, minimum=1, static="fixes how many coordinates a chunk sends"))
  chunk: int = validate.setting(4096, check=functools.partial(
      validate.integer, minimum=1, static="fixes the chunks' shape"))
  bits: int = validate.setting(2, check=functools.partial(
      validate.integer, minimum=1, static="fixes the codes' width"))
  error_decay: Any = validate.setting(1.0, check=functools.partial(validate.number, low=0, high=1),
                                      traceable=True)

  def check(self):
    if self.k > self.chunk:
      raise ValueError(f"k must be at most chunk (it counts coordinates kept per chunk); got "
                       f"k={self.k}, chunk={self.chunk}. Lower k or raise chunk")
    if self.bits > 4:
      raise ValueError(f"bits must be 1, 2, 3 or 4 (a sign and up to 3 bits of magnitude, with "
                       f"2^(bits-1) centroids per chunk); got {self.bits}")

  @property
  def levels(self) -> int:
    """L = 2^(bits−1): magnitude bins, and bfloat16 centroids, per chunk."""
    return 2 ** (self.bits - 1)


class ChunkLayout(NamedTuple):
  """How one leaf is cut into chunks and how each chunk's row is coded (static).

  Attributes:
    size: n, the leaf's elements.
    rows: m, its chunks.
    width: c, elements per chunk (the last chunk zero-padded).
    k: k_c, coordinates kept per chunk.
    positions: the Elias–Fano layout of k_c positions in [0, c).
    code_bits: the bits of a row's positions and value codes.
    code_bytes: those bits packed, the last byte zero-padded.
    row_bytes: a row's bytes: the packed bits, then the centroids.
  """
  size: int
  rows: int
  width: int
  k: int
  positions: bitpack.EliasFano
  code_bits: int
  code_bytes: int
  row_bytes: int


def layout(config: ChunkedTopKConfig, size: int) -> ChunkLayout:
  """The chunks of a leaf of ``size`` elements (the module docstring: chunks, and step 5)."""
  rows = -(-size // config.chunk)
  width = -(-size // rows)
  k = min(width, -(-config.k * width // config.chunk))
  positions = bitpack.EliasFano.of(width, k)
  code_bits = positions.bits(k) + k * config.bits
  code_bytes = -(-code_bits // 8)
  centroid_bytes = config.levels * jnp.dtype(_CENTROID_DTYPE).itemsize
  return ChunkLayout(size, rows, width, k, positions, code_bits, code_bytes,
                     code_bytes + centroid_bytes)


def payload_bytes(config: ChunkedTopKConfig, shapes: Sequence[tuple]) -> int:
  """The bytes each device sends per step for reduced leaves of these shapes (one all-gather
  receives W times as many)."""
  return sum(lay.rows * lay.row_bytes for lay in (layout(config, math.prod(s)) for s in shapes))


def init(config: ChunkedTopKConfig,
         signature: tree_lib.TreeSignature) -> compressor.ErrorFeedbackState:
  """Zero error feedback, in each leaf's dtype."""
  error = signature.place([jnp.zeros(s.shape, s.dtype) for s in signature.reduced_structs()])
  return compressor.ErrorFeedbackState(jnp.zeros([], jnp.int32), error, config, signature)


def _chunks(x: jax.Array, lay: ChunkLayout) -> jax.Array:
  """``x`` raveled and zero-padded into ``(rows, width)``."""
  return jnp.pad(x.ravel(), (0, lay.rows * lay.width - lay.size)).reshape(lay.rows, lay.width)


def _leaf(chunks: jax.Array, lay: ChunkLayout, like: jax.Array) -> jax.Array:
  """The inverse of ``_chunks``: the padding dropped, ``like``'s shape and dtype."""
  return chunks.reshape(-1)[:lay.size].reshape(like.shape).astype(like.dtype)


def _select(chunks: jax.Array, lay: ChunkLayout) -> jax.Array:
  """2: the positions of each row's k_c largest magnitudes, increasing; padding after the rest.
  ``chunks`` is computed where it is read: the magnitudes are the one array of the leaf's size
  written for ``lax.top_k``, and the error fed is never written."""
  real = jnp.arange(lay.rows * lay.width).reshape(lay.rows, lay.width) < lay.size
  magnitude = jnp.where(jnp.isnan(chunks), jnp.inf, jnp.abs(chunks))  # 8: NaN as large as ∞
  _, positions = lax.top_k(jnp.where(real, magnitude, -1.0), lay.k)
  return jnp.sort(positions, axis=-1)


def _at(x: jax.Array, positions: jax.Array, lay: ChunkLayout) -> jax.Array:
  """``_chunks(x)`` at each row's ``positions`` (R, k): read from ``x`` itself (0 at the padding),
  so that the chunks need not be written for the gather."""
  at = jnp.arange(lay.rows)[:, None] * lay.width + positions
  return x.reshape(-1).at[at].get(mode="fill", fill_value=0)


def _quantize(values: jax.Array, bits: int) -> tuple:
  """3: ``(codes, centroids)`` of each row of ``values`` (float32, ``(R, k)``): int32 codes
  ``sign · L + bin`` and ``(R, L)`` bfloat16 centroids, the mean magnitude in each bin (0 if
  empty)."""
  levels = 2 ** (bits - 1)
  magnitude = jnp.abs(values)
  low = magnitude.min(-1, keepdims=True)
  span = magnitude.max(-1, keepdims=True) - low
  scaled = (magnitude - low) / jnp.where(span > 0, span, 1.0) * levels
  bins = jnp.clip(jnp.floor(scaled), 0, levels - 1).astype(jnp.int32)
  member = bins[..., None] == jnp.arange(levels)
  sums = jnp.where(member, magnitude[..., None], 0.0).sum(-2)
  counts = member.sum(-2)
  centroids = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0).astype(_CENTROID_DTYPE)
  return bins + levels * (values < 0), centroids


def _dequantize(codes: jax.Array, centroids: jax.Array) -> jax.Array:
  """3: ``v̂ = ±centroid`` (float32) of each code, as the sender and every receiver compute it."""
  levels = centroids.shape[-1]
  magnitude = jnp.take_along_axis(centroids.astype(jnp.float32), codes % levels, axis=-1)
  return jnp.where(codes >= levels, -magnitude, magnitude)


def _encode(positions, codes, centroids, lay: ChunkLayout, bits: int) -> jax.Array:
  """5: each chunk's row of bytes: packed positions and codes, then the centroids' bytes."""
  packed = bitpack.pack(jnp.concatenate(
      [lay.positions.encode(positions), bitpack.to_bits(codes, bits)], axis=-1))
  centroid_bytes = lax.bitcast_convert_type(centroids, jnp.uint8).reshape(lay.rows, -1)
  return jnp.concatenate([packed, centroid_bytes], axis=-1)


def _decode(rows: jax.Array, lay: ChunkLayout, config: ChunkedTopKConfig) -> tuple:
  """The inverse of ``_encode`` on ``(..., rows, row_bytes)``: ``(positions, values)``."""
  batch = rows.shape[:-1]
  rows = rows.reshape(-1, lay.row_bytes)
  bits = bitpack.unpack(rows[:, :lay.code_bytes], lay.code_bits)
  split = lay.positions.bits(lay.k)
  positions = lay.positions.decode(bits[:, :split], lay.k)
  codes = bitpack.from_bits(bits[:, split:], config.bits)
  centroids = lax.bitcast_convert_type(
      rows[:, lay.code_bytes:].reshape(-1, config.levels, jnp.dtype(_CENTROID_DTYPE).itemsize),
      _CENTROID_DTYPE)
  values = _dequantize(codes, centroids)
  return positions.reshape(batch + (lay.k,)), values.reshape(batch + (lay.k,))


def _mean_in_device_order(positions: jax.Array, values: jax.Array, lay: ChunkLayout,
                          fill) -> jax.Array:
  """7: Σ_w ê_w ÷ W as ``(rows, width)``, added device after device (``positions``, ``values``:
  ``(W, rows, k)``) to ``fill`` (0, or 8's NaN); each device's positions are distinct, so no
  addition ever collides."""
  world = positions.shape[0]
  return kernels.scatter_rows_add([(positions[w], values[w] / world) for w in range(world)],
                                  (lay.rows, lay.width), fill)


def step(config: ChunkedTopKConfig, state: compressor.ErrorFeedbackState, leaves: list,
         axis_name, phase) -> tuple:
  """Steps 1–8 on the reduced ``leaves``: ``(means, new state, finite)``; nothing to send without
  any."""
  del phase
  if not leaves:
    return [], state, jnp.array(True)
  layouts = [layout(config, g.size) for g in leaves]
  errors = state.signature.pick(state.error)
  selected, rows = [], []
  for g, e, lay in zip(leaves, errors, layouts):
    # 1: e ← β·e + g, computed where it is read; 2: the k_c largest per chunk.
    positions = _select(_chunks(_error_fed(config, e, g), lay), lay)
    # 3: sign and magnitude bin, centroids in bfloat16; 8: NaN centroids for values not finite.
    values = _error_fed(config, _at(e, positions, lay), _at(g, positions, lay))
    codes, centroids = _quantize(values, config.bits)
    centroids = jnp.where(jnp.isfinite(values).all(), centroids, jnp.nan)
    selected.append((positions, _dequantize(codes, centroids)))
    # 5: the chunks' rows of bytes.
    rows.append(_encode(positions, codes, centroids, lay, config.bits).reshape(-1))
  # 6: one all-gather of every leaf's bytes.
  gathered = axis.all_gather(jnp.concatenate(rows), axis_name)
  # 7: decode every device's rows, the mean in device order.
  decoded, start = [], 0
  for lay in layouts:
    part = gathered[:, start:start + lay.rows * lay.row_bytes]
    start += lay.rows * lay.row_bytes
    decoded.append(_decode(part.reshape(-1, lay.rows, lay.row_bytes), lay, config))
  ok = finite.reduced_finite([values for _, values in decoded])  # 8: alike on every device
  fill = jnp.where(ok, 0.0, jnp.nan)  # 8: NaN means where not finite
  means = [_leaf(_mean_in_device_order(positions, values, lay, fill), lay, g)
           for (positions, values), lay, g in zip(decoded, layouts, leaves)]
  # 4, 8: e ← β·e + g − ê where every device's values were finite, else e as it was.
  errors = [_new_error(config, e, g, *sent, lay, ok)
            for e, g, sent, lay in zip(errors, leaves, selected, layouts)]
  return means, state._replace(error=state.signature.place(errors)), ok


def _error_fed(config: ChunkedTopKConfig, e: jax.Array, g: jax.Array) -> jax.Array:
  """1: β·e + g in float32."""
  return config.error_decay * e.astype(jnp.float32) + g.astype(jnp.float32)


def _new_error(config: ChunkedTopKConfig, e: jax.Array, g: jax.Array, positions: jax.Array,
               sent: jax.Array, lay: ChunkLayout, ok: jax.Array) -> jax.Array:
  """4: ``e ← β·e + g − ê``, ê subtracted where it was sent; 8: ``e`` as it was where ``ok`` is
  false. Written after the exchange, from ``e`` and ``g`` (not from the chunks the selection read),
  so that nothing of the leaf's size waits for the flag, and in place where the state is donated."""
  shape = e.shape or (1,)  # a scalar as one value
  fed = jnp.where(ok, _error_fed(config, e, g), e.astype(jnp.float32)).reshape(shape)
  at = (jnp.arange(lay.rows)[:, None] * lay.width + positions).ravel()  # padding: ≥ size, dropped
  return kernels.subtract_at(fed, jnp.where(ok, at, lay.size), sent.ravel()).reshape(
      e.shape).astype(e.dtype)


def chunked_topk(k: int = 64, *, chunk: int = 4096, bits: int = 2, error_decay: Any = 1.0,
                 axis_name: axis.AxisName = "batch",
                 bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """The mean of every device's chunked top-k, with ``bits``-bit values and error feedback.

  Each device adds its gradient to its error feedback (decayed by ``error_decay``), keeps in every
  chunk of ``chunk`` elements the ``k`` coordinates of largest magnitude, sends their positions
  (Elias–Fano code) and ``bits``-bit codes with a few bfloat16 centroids per chunk in one ``uint8``
  all-gather, and keeps the rest in its error. The output is the mean of what the devices sent, the
  same on every device (the module docstring numbers the steps and counts the bytes).

  Example:
    >>> import jax, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.chunked_topk(2, chunk=64), optax.sgd(0.1, momentum=0.9))
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 32, 32))}  # 4 KiB per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> jaxcomp.comm_report(step, grads, state).bytes_by_dtype()  # 112 B gathered from each device
    {'u8': 896}
    >>> updates, state = step(grads, state)
    >>> int((updates["w"][0] != 0).sum()) <= 8 * 16 * 2  # 2 of every 64 from each device
    True

  ``jaxcomp.sparseloco`` runs it on DiLoCo's pseudo-gradient.

  Args:
    k: coordinates kept per chunk; the density is ``k / chunk`` (``ChunkedTopKConfig``).
    chunk: elements per chunk.
    bits: bits per kept value, 1 to 4 (a sign and ``bits − 1`` bits of magnitude).
    error_decay: β of ``e ← β·e + g``; 1 is classic error feedback. May be scheduled under
      ``optax.inject_hyperparams``.
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    bucket_cap_mb: None, or DDP's bucket cap in MiB: one state and one all-gather per bucket.

  Returns:
    A ``GradientTransformation`` with a ``jaxcomp.ErrorFeedbackState`` (per-bucket states under
    ``bucket_cap_mb``).

  References:
    Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", 2025.
    Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
  """
  config = ChunkedTopKConfig(k=k, chunk=chunk, bits=bits, error_decay=error_decay)
  return compressor.transformation(config, init, step, axis_name, bucket_cap_mb=bucket_cap_mb)
