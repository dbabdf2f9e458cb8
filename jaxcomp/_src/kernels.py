"""Backend workarounds: where a computation is written for the compiler rather than for the reader.

Each function here computes what its one-line definition says, in a form that a backend (XLA:CPU, as
measured on this project's machines) runs much faster or in less memory than the obvious form; each
docstring gives the measurement that justifies it and the command that re-measures it. Algorithm
modules call these instead of spelling the trick out in their math. (One workaround lives below this
module, in ``axis``, because every collective goes through it: float16 sums over devices on
XLA:CPU, ``axis.sum_in_rows``.)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from jaxcomp._src import axis


def part(name: str):
  """The name scope of one part of an exchange or of the compressor adapter (``"encode"``,
  ``"decode"``, ``"error_feedback"``, ``"layout"``, ``"nonfinite"``, ``"update"``). Metadata only
  (the compiled program is the same): ``benchmarks/step_profile.py`` reads it back from the compiled
  HLO's ``op_name`` to say where a step's time goes."""
  return jax.named_scope(f"jaxcomp.{name}")


# ----------------------------------------------------------------------------------------- PowerSGD


class Sum(NamedTuple):
  """``M = Σ terms`` (PowerSGD's ``g + e``, Dion's ``M + G``), a matrix that ``product`` and
  ``transposed_product`` read term by term, so that it is never written to memory (XLA:CPU does
  not fuse a sum into a dot): ``benchmarks/memory.py --quick``, layer-wise PowerSGD rank 1, 2.02 →
  1.60 temporaries per gradient, alternating 1.90 → 1.68 (ResNet-18: 1.22 either way). The memory
  traffic stays the same (the products read g and e instead of writing M and reading it back); the
  products' flops double, which rank ≤ 8 products, bound by memory, do not notice.

  Attributes:
    terms: the arrays, all of M's shape and dtype.
  """
  terms: tuple

  def value(self) -> jax.Array:
    """M itself, written (for a value that is not a product's operand)."""
    return sum(self.terms)


def product(m: Sum, q: jax.Array) -> jax.Array:
  """``M·Q``, as the sum of each term's product (``Sum``); M (…, n, m) and Q (…, m, r) may carry
  leading axes of a stack of matrices (a batched product)."""
  return sum(t @ q for t in m.terms)


def transposed_product(m: Sum, p: jax.Array) -> jax.Array:
  """``Mᵀ·P`` (m, r), term by term (``Sum``), as one vector–matrix product ``P[:, j]ᵀ·M`` per
  column.

  XLA:CPU runs ``M.T @ P`` (and its ``einsum`` / ``dot_general`` forms) by walking M's columns with
  a stride of m elements; each vector–matrix product reads M row by row. The update of the MLP
  gradient (784-1024×3-10, W = 8, pmap, donated), ``t.T @ P`` per term / this: layer-wise PowerSGD
  rank 1 2.30× the time, rank 4 2.26×, the same temporaries; the outputs differ in rounding (the
  dot adds in another order). ``PYTHONPATH=. python benchmarks/kernels.py --repeats 10
  --compressors powersgd_r1,powersgd_r4`` (2 shared cores). Above rank 8 (Dion's ¼ of a matrix's
  side) one product per column is too many to unroll: one product ``(Pᵀ·M)ᵀ`` then, which also
  reads M's rows. Not ``t.T @ P``: for that XLA:CPU lays the gradient out transposed as the
  backward pass writes it, and the error update then reads it across its rows. The MLP's
  ``data_parallel`` step against allreduce's, rank 16, two alternating rounds: Dion 2.66–2.70 →
  2.06–2.07, PowerSGD 2.24–2.36 → 1.54–1.65 (``PYTHONPATH=. python benchmarks/step_time.py
  --models mlp --devices 8 --repeats 6 --variant dion_r16=dion_r8,rank=16 --variant
  psgd_r16=powersgd_r4,rank=16 --compressors allreduce,dion_r8,dion_r16,psgd_r16``).
  Leading axes of a stack of matrices (M (…, n, m), P (…, n, r)) are batched.
  """
  if p.shape[-1] > 8:
    return sum(jnp.swapaxes(jnp.swapaxes(p, -1, -2) @ t, -1, -2) for t in m.terms)
  return sum(jnp.stack([jnp.einsum("...n,...nm->...m", p[..., j], t) for j in range(p.shape[-1])],
                       axis=-1) for t in m.terms)


def zero_padded(arrays: Sequence, size: int) -> jax.Array:
  """The arrays raveled, concatenated and zero-padded to ``size`` values (batched PowerSGD's
  square), the zeros concatenated as one more array.

  XLA:CPU writes ``jnp.pad`` of the concatenation as a buffer of its own, beside the concatenation.
  Batched PowerSGD rank 1's update of the MLP gradient (784-1024×3-10, W = 8, pmap, donated),
  ``jnp.pad`` / this: 2.25× the time (3.42× in another run), temporaries 3.00 → 1.36 per gradient;
  ``PYTHONPATH=. python benchmarks/kernels.py --repeats 10 --compressors batched_powersgd_r1`` (2
  shared cores).
  """
  padding = jnp.zeros(size - sum(x.size for x in arrays), arrays[0].dtype)
  return jnp.concatenate([jnp.ravel(x) for x in arrays] + [padding])


def in_place(update: Callable, old: jax.Array, *operands: jax.Array) -> jax.Array:
  """``update(old, *operands)``, an elementwise new value of the state leaf ``old`` (the operands
  broadcast to its shape), computed with a leading axis of size 1 on every array.

  A state leaf reaches the update as one device's block of the stacked state, its leading axis of
  size 1 dropped (``jax.pmap``; ``jaxcomp.data_parallel``'s ``shard_map``), and the non-finite gate
  (``where``) reads ``old`` as that block. Computed in the leaf's own shape, the fusion that writes
  the new value reads ``old`` through two views of its buffer, and XLA:CPU writes the value into a
  temporary that it then copies into ``old``'s donated buffer; in the block's shape it writes it in
  place. Batched PowerSGD rank 1's error (its update of the MLP gradient, as ``zero_padded``),
  ``update(old, *operands)`` / this: 1.35× the time, temporaries 2.00 → 1.36 per gradient (1.00 the
  square of the leaves, 0.36 the zeros of the non-finite check, broadcast to the largest leaf);
  ``PYTHONPATH=. python benchmarks/kernels.py --repeats 10 --compressors batched_powersgd_r1``.
  Layer-wise PowerSGD's error, in place of ``(g + e).reshape(e.shape) − x`` in the leaf's shape: the
  update of ResNet-18's gradient, temporaries 1.22 → 1.00 per gradient, rank 1 and 4, outputs and
  state bit for bit the same (``PYTHONPATH=. python benchmarks/memory.py --compressors
  powersgd_r1,powersgd_r4``).
  """
  return update(old[None], *(x[None] for x in operands))[0]


def low_rank_product(p: jax.Array, q: jax.Array) -> jax.Array:
  """``P·Qᵀ`` (…, n, m), leading axes batched. Up to rank 8 as a sum of r outer products:
  elementwise, so XLA computes it inside whatever consumes it (the error update, the output)
  instead of writing an (n, m) matrix first, which it does for a matrix product."""
  if p.shape[-1] > 8:
    return p @ jnp.swapaxes(q, -1, -2)
  return sum(p[..., :, j, None] * q[..., None, :, j] for j in range(p.shape[-1]))


# ---------------------------------------------------------------------------------------------- DGC
#
# Measured with ``PYTHONPATH=. python benchmarks/dgc_selection.py --kernels [--density 0.015625]``
# (each kernel swapped for the obvious form it replaces), XLA:CPU, jax 0.10.2, 2 shared cores: the
# sampled selection of 10M float32 elements at density 0.001 (or 1/64), and the temporaries of a
# whole DGC update of ResNet-18's gradient (W = 8, gradient and state donated;
# ``benchmarks/memory.py``'s measure), 1.05× the gradient with every kernel, sampled or exact
# selection.

_BLOCK = 32  # elements per block of ``bits_at_least``: the bits of one uint32


def bits_at_least(x: jax.Array, threshold) -> tuple:
  """Per block of 32 elements of the 1-D ``x``, a uint32 whose bit j says ``|x[32·block + j]| >=
  threshold`` (``ceil(x.size / 32)`` words; ``lax.population_count`` gives the blocks' counts): the
  candidates of ``first_at_least``; and whether every element of ``x`` is finite. Both in one pass
  over ``x``: one reduction of two operands, the words and ``Σ(x − x)`` (NaN exactly where an
  element is not finite), which XLA:CPU fuses into one loop; ``isfinite(x).all()`` beside it was a
  second pass. Returns ``(words, finite)``."""
  num_blocks = -(-x.size // _BLOCK)
  padded = jnp.pad(x, (0, num_blocks * _BLOCK - x.size)).reshape(num_blocks, _BLOCK)
  lanes = jnp.left_shift(jnp.uint32(1), jnp.arange(_BLOCK, dtype=jnp.uint32))
  hit = jnp.abs(padded) >= threshold
  if num_blocks * _BLOCK > x.size:  # the zero padding is never a candidate
    hit &= (lax.broadcasted_iota(jnp.int32, padded.shape, 0) * _BLOCK
            + lax.broadcasted_iota(jnp.int32, padded.shape, 1)) < x.size
  words, nan_sums = lax.reduce(
      (jnp.where(hit, lanes, jnp.uint32(0)), (padded - padded).astype(jnp.float32)),
      (jnp.uint32(0), jnp.float32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
  return words, ~jnp.isnan(nan_sums.sum())


def first_at_least(x: jax.Array, bits: jax.Array, capacity: int) -> tuple:
  """The first ``capacity`` indices of the 1-D ``x`` whose bit is set in ``bits``
  (``bits_at_least(x, threshold)``), in index order, and their ``|x|``: ``(int32 indices,
  magnitudes)``, empty slots holding ``x.size`` and -1.

  ``jnp.nonzero(jnp.abs(x) >= threshold, size=capacity)``, found slot by slot: slot i's block is
  the first whose running count exceeds i (a binary search in the blocks' prefix sum), its lane the
  set bit of that rank in the block's word (a binary search by population counts). Past the one
  prefix sum over the blocks, the work grows with ``capacity``, not with ``x.size``. XLA:CPU's
  cumsum (and so ``jnp.nonzero``) is a reduce-window over all of ``x``: the sampled selection takes
  18 ms this way, 556 ms through ``jnp.nonzero``; at density 1/64, 73 and 324 ms. (A compaction of
  the candidate blocks, a cumsum and a scatter over their 32 elements each, grew with the density to
  all of ``x`` at 1/64.)
  """
  counts = lax.population_count(bits).astype(jnp.int32)
  ends = lax.associative_scan(jnp.add, counts)  # each block's running count, inclusive
  slots = jnp.arange(capacity, dtype=jnp.int32)
  block = jnp.minimum(jnp.searchsorted(ends, slots, side="right", method="scan_unrolled"),
                      counts.size - 1).astype(jnp.int32)
  rank, word = slots - (ends[block] - counts[block]), bits[block]  # rank among the word's bits
  lane = jnp.zeros_like(word)
  for width in (16, 8, 4, 2, 1):  # the window [lane, lane + 2·width) holds the bit of that rank
    below = lax.population_count((word >> lane) & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
    up = rank >= below
    rank, lane = jnp.where(up, rank - below, rank), jnp.where(up, lane + width, lane)
  filled = slots < ends[-1]
  indices = jnp.where(filled, block * _BLOCK + lane.astype(jnp.int32), x.size)
  return indices, jnp.where(filled, jnp.abs(x.at[indices].get(mode="clip")), -1).astype(x.dtype)


def kth_largest(x: jax.Array, k: int) -> jax.Array:
  """The k-th largest entry of the 1-D ``x``, read through ``lax.top_k``'s indices: XLA:CPU rewrites
  a ``top_k`` whose values alone are used into a full sort (selection 18 ms, 84 ms from the
  values)."""
  return x[lax.top_k(x, k)[1]].min()


def while_loop_if_needed(cond_fun: Callable, body_fun: Callable, init):
  """``lax.while_loop(cond_fun, body_fun, init)``, entered only if ``cond_fun(init)``: XLA hoists
  the loop's full-size invariants (DGC's ``|v|``) out of the body, a full-size write worth paying
  only when the loop runs (rarely: DGC's threshold adaptation). Selection 18 ms, 55 ms entered
  always."""
  return lax.cond(cond_fun(init), lambda c: lax.while_loop(cond_fun, body_fun, c), lambda c: c,
                  init)


def _coordinates(flat_indices: jax.Array, shape: tuple) -> tuple:
  """Flat int32 indices as one index array per dimension; ``prod(shape)`` and beyond (the empty
  slots' filler) stay out of range in the first dimension (``jnp.unravel_index`` would clip
  them)."""
  out, stride = [], math.prod(shape)
  for i, size in enumerate(shape):
    stride //= size
    out.append(flat_indices // stride if i == 0 else (flat_indices // stride) % size)
  return tuple(out)


def scatter_add(shape: tuple, flat_indices: jax.Array, values: jax.Array,
                fill=None) -> jax.Array:
  """``zeros(shape).ravel().at[flat_indices].add(values)`` reshaped (duplicates sum; indices out of
  range dropped), in less memory; with ``fill`` (a scalar: DGC's NaN on a step that is not finite),
  into ``full(shape, fill)`` instead, at no cost beyond the zeros':

  * addressed in ``shape``: through a flat view XLA:CPU writes a flat copy and reshapes it
    (ResNet-18 update, with ``zero_at`` and ``subtract_at`` flat too and shared zeros: 3.29×
    sampled, 4.20× exact);
  * into zeros of their own (a 0 that XLA cannot see is one, read from ``flat_indices``, which are
    never negative): XLA shares one broadcast of 0 between leaves of the same shape and copies it
    for each scatter (1.29× sampled, 2.00× exact).
  """
  zero = jnp.minimum(flat_indices[0], 0).astype(values.dtype)
  if fill is not None:
    zero = zero + jnp.asarray(fill, values.dtype)
  return jnp.broadcast_to(zero, shape).at[_coordinates(flat_indices, shape)].add(values,
                                                                                 mode="drop")


def zero_at(x: jax.Array, flat_indices: jax.Array) -> jax.Array:
  """``x`` with the entries at ``flat_indices`` (of its flat view) zeroed, addressed in its own
  shape as ``scatter_add`` is; indices out of range are dropped."""
  return x.at[_coordinates(flat_indices, x.shape)].set(0, mode="drop")


def subtract_at(x: jax.Array, flat_indices: jax.Array, values: jax.Array) -> jax.Array:
  """``x`` minus ``values`` at ``flat_indices`` (as ``zero_at`` addresses them; a repeated index
  is subtracted once per repetition): with ``values`` read from ``x`` at distinct indices (DGC's),
  the sent entries become +0.0, as ``zero_at`` makes them. Reading the values
  sent makes the scatter wait for the collective that sends them, so XLA:CPU updates ``x`` in place
  instead of copying it first (ResNet-18 update as ``zero_at``: 1.29× sampled, 2.00× exact)."""
  return x.at[_coordinates(flat_indices, x.shape)].add(-values, mode="drop")


# ------------------------------------------------------------------------------ the non-finite
# policy


def max_abs(x: jax.Array, axis) -> jax.Array:
  """``max |x|`` along ``axis``, NaN where ``x`` holds a NaN or an infinity: ``max(max x, −min x)
  + Σ(x − x)`` (x − x is NaN exactly where x is not finite, and 0 elsewhere).

  XLA:CPU (jaxlib 0.10.2) reduces with a ``max`` that drops NaN — over 256, 4,096 or 65,536 values
  alike, a row with one NaN gave its largest finite magnitude — so the NaN must reach the result
  another way for a codec's scale to show it. Turned infinite before the reduction
  (``max(where(isnan(x), inf, |x|))``), it cost a whole copy of ``x``: XLA:CPU's reductions (its
  XNNPACK fusions) take an ``abs`` or a subtraction into themselves but not a select, which was
  written out first (``x · 0`` was too: its zero became a broadcast array). In the int8
  exchange's update that copy was at the peak of its temporaries (``row_update_arrays`` has the
  figures)."""
  return jnp.maximum(jnp.max(x, axis=axis), -jnp.min(x, axis=axis)) + jnp.sum(x - x, axis=axis)



def where(pred: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """``jnp.where(pred, new, old)`` for a scalar ``pred``, as a scatter of ``new`` into ``old``: at
  index 0 of a new leading axis, or at index 1, out of range and dropped.

  With ``old`` donated (the state a step replaces), XLA:CPU writes a select that reads ``old`` into
  a temporary and copies it into ``old``'s buffer (every state leaf of a "select" algorithm, the
  count included); the scatter it writes in place. In ``finite.keep_if_finite``, the update of the
  MLP gradient (W = 8, pmap, gradient and state donated), ``jnp.where`` / this: quantized(8)
  1.53× the time (temporaries 2.36 → 2.17× the gradient), 1-bit Adam 1.45× (2.36 either way),
  sign_compress 0.88× (1.67 → 1.40; its update is within noise of the select's on a shared
  machine). ``PYTHONPATH=. python benchmarks/kernels.py --repeats 10``, 2 shared cores.
  """
  return old[None].at[jnp.where(pred, 0, 1)].set(new, mode="drop")[0]


# ----------------------------------------------------------------------- quantized, sign, 1-bit
# Adam

def keeps_leaves() -> bool:
  """Whether a compressed exchange should handle each gradient leaf on its own (the leaf layout of
  ``exchange``, one collective per array) rather than as one flat vector of all leaves (one
  collective per dtype): where a mesh axis in scope is left to the SPMD partitioner (a 2-D
  ``jaxcomp.data_parallel`` mesh's model axis, a plain ``jit`` on a mesh), which may shard the
  leaves over it.

  Raveling a leaf sharded along any axis but its first, and concatenating sharded leaves (a flat
  vector, or the buffer that packs several arrays into one collective), gives an array whose
  sharding the partitioner cannot express: it moves the values across the mesh to build it.
  ``jaxcomp.quantized(8)`` under ``jaxcomp.data_parallel`` on a (data 4, model 2) Auto mesh, a
  6,404-byte gradient sharded over model (``tests/test_low_bit_training.py``'s mesh test), bytes
  per step: flat, 16,968 of float32 across model and 4,724 across both axes; leaf by leaf, 72 of
  scales and 2,000 of int8 codes across model, nothing across both (with the leaves packed into one
  collective per dtype, 5,047 of codes across model and 1,024 across both). sign_compress: 16,708
  and 8,192 bytes of float32, then none (48 of scales); 1-bit Adam: 16,960 and 2,228, then none.
  XLA replicates the operand of an all-to-all or all-gather over a manual axis across the others
  (an all-reduce's it keeps sharded), so the codes still cross model once. Re-measure with
  ``jaxcomp.comm_report(dp.step, ...).by_axes(mesh)`` as that test does.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and any(kind != AxisType.Manual and size > 1 for kind, size in
                                zip(mesh.axis_types, mesh.axis_sizes))


def all_to_all(arrays: Sequence, axis_name) -> list:
  """``axis.all_to_all`` of every array (leading axis W): one collective per dtype, or one per
  array where ``keeps_leaves()``."""
  if keeps_leaves():
    return [axis.all_to_all(x, axis_name) for x in arrays]
  return axis.all_to_all_many(arrays, axis_name)


def all_gather(arrays: Sequence, axis_name) -> list:
  """``axis.all_gather`` of every array: one collective per dtype, or one per array where
  ``keeps_leaves()``."""
  if keeps_leaves():
    return [axis.all_gather(x, axis_name) for x in arrays]
  return axis.all_gather_many(arrays, axis_name)


def device_mean(term: Callable[[int], list], world: int) -> list:
  """The mean over devices w = 0, …, W−1 of the arrays ``term(w)``: each ÷W (no overflow), summed
  in device order, unrolled.

  Written as a running sum of W terms, XLA fuses the whole mean into one pass over the W devices'
  (compressed) inputs. The obvious forms materialize all W terms in float32 first — W times the
  gradient's size per device. The update of the MLP gradient (W = 8, pmap, donated), the mean of
  the stacked terms / this: ``sign_compress`` 1.18× the time, ``quantized(8)``'s owner's mean
  1.06×, the same temporaries; ``PYTHONPATH=. python benchmarks/kernels.py --repeats 10`` (2
  shared cores).
  """
  with part("decode"):
    total = [x / world for x in term(0)]
    for w in range(1, world):
      total = [t + x / world for t, x in zip(total, term(w))]
    return total


def to_float8_e4m3fn(y: jax.Array) -> jax.Array:
  """``y.astype(jnp.float8_e4m3fn)`` (to the nearest, ties to even) for float32 ``|y| ≤ 448``, as
  its bits (uint8), in integer arithmetic.

  XLA:CPU widens float8 arithmetic to float16 and converts between the two in software, wherever a
  float8-typed array appears (even one only bitcast to its bits); in these integer ops none does.
  ``jaxcomp.quantized("fp8")``'s update of the MLP gradient (784-1024×3-10, W = 8, pmap, donated),
  the float8 casts / both conversions here: 1.24× the time, outputs bit-identical;
  ``PYTHONPATH=. python benchmarks/kernels.py --repeats 10`` (2 shared cores).
  Bit-exact with ml_dtypes on every float8 value, every midpoint and its neighbours
  (``tests/test_kernels.py``).
  """
  bits = lax.bitcast_convert_type(y, jnp.uint32)
  sign = (bits >> 24) & 0x80
  magnitude = bits & 0x7FFFFFFF
  # Normal codes (|y| ≥ 2⁻⁶): keep 3 of the 23 mantissa bits, to the nearest, ties to even (a carry
  # rolls into the exponent); rebias the exponent from 127 to 7.
  rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
  normal = rounded - (120 << 3)
  # Subnormal codes (|y| < 2⁻⁶): the multiple of 2⁻⁹ nearest |y|, ties to even (8 is 2⁻⁶ itself).
  subnormal = jnp.round(lax.bitcast_convert_type(magnitude, jnp.float32) * 512.0).astype(jnp.uint32)
  code = jnp.where(magnitude >= 0x3C800000, normal, subnormal)  # 0x3C800000: 2⁻⁶
  return (code | sign).astype(jnp.uint8)


def from_float8_e4m3fn(bits: jax.Array) -> jax.Array:
  """float8_e4m3fn values given as their bits (uint8) to float32, in integer arithmetic (NaN, 0x7F,
  is never sent): ``lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)``, which
  XLA:CPU runs one element at a time (see ``to_float8_e4m3fn``). Exact."""
  b = bits.astype(jnp.uint32)
  exponent, mantissa = (b >> 3) & 0xF, b & 0x7
  normal = lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
  magnitude = jnp.where(exponent > 0, normal, mantissa.astype(jnp.float32) * (1.0 / 512))
  return jnp.where(b >= 0x80, -magnitude, magnitude)


def row_of_arrays(arrays: Sequence, owner, length: int, rows: int) -> jax.Array:
  """Row ``owner`` (of ``rows``) of the ``arrays`` raveled, concatenated, zero-padded to
  ``rows·length`` values and cut into rows of ``length``: the flat layout's ``split``
  (``exchange.flat_layout``) for one row, the inverse of ``row_update_arrays``.

  A ``lax.switch`` over the rows, each branch concatenating the static slices of the arrays its
  row overlaps: XLA:CPU copies ``length`` values. Split, then indexed by the dynamic ``owner``, all
  the arrays are concatenated first, unfused, to read one row of them. The update of the MLP
  gradient (784-1024×3-10, W = 8, pmap, donated), the split / this: ``jaxcomp.quantized(8)`` 1.10×
  the time, 1-bit Adam 1.04×, the same temporaries, outputs bit-identical; ``PYTHONPATH=. python
  benchmarks/kernels.py --repeats 10 --compressors quantized_int8,onebit_adam`` (2 shared cores).
  In the training step (``benchmarks/step_profile.py``) quantized(8)'s error feedback fell from
  17–19% of the step to 10%.
  """
  sizes = [x.size for x in arrays]
  starts = [sum(sizes[:i]) for i in range(len(sizes))]

  def row(w):
    low, high = w * length, (w + 1) * length
    parts = [x.reshape(-1)[max(low, start) - start:min(high, start + size) - start]
             for x, start, size in zip(arrays, starts, sizes)
             if max(low, start) < min(high, start + size)]
    # A row of padding alone: an empty slice still gives it the arrays' type (under shard_map,
    # varying over the mesh's axes), which every branch of the switch must share.
    parts = parts or [arrays[-1].reshape(-1)[:0]]
    filled = sum(p.size for p in parts)
    return jnp.concatenate(parts + [jnp.zeros([length - filled], jnp.float32)])

  return lax.switch(owner, [lambda w=w: row(w) for w in range(rows)])


def row_update_arrays(arrays: Sequence, row: jax.Array, owner) -> list:
  """``arrays`` with the positions ``owner·S`` to ``owner·S + S − 1`` of their raveled
  concatenation (``exchange.flat_layout``'s row ``owner``) set to the 1-D ``row`` of S values,
  where the arrays hold zeros outside that row (the exchange's server error, which a device keeps
  for its own row only): the flat layout's join of W rows all zero but the owner's.

  Each array takes one window of min(S, its size) values, ``lax.dynamic_update_slice`` at its
  overlap with the row, read from ``row`` with zeros beyond it (where the array held zeros, and in
  the whole window of an array the row misses). With the arrays donated, XLA:CPU writes the
  windows in place: about S values per array, not the whole arrays with their zeros, nor a
  select of them for the non-finite policy (the caller keeps the old row where not finite).
  ``PYTHONPATH=. python benchmarks/memory.py --models mlp,resnet18 --no-sharded`` (W = 8, pmap,
  donated), with ``max_abs``'s change: ``jaxcomp.quantized(8)``'s update temporaries 2.11 → 1.64×
  the gradient on the MLP (784-1024×3-10), 2.00 → 1.51 on ResNet-18; 1-bit Adam's 1.84 → 1.64 and
  1.53 → 1.42; outputs bit-identical, the step's time unchanged within noise.
  """
  length = row.shape[0]
  out, offset = [], 0
  for x in arrays:
    window = min(length, x.size)
    at = jnp.clip(owner * length - offset, 0, x.size - window)
    where = offset + at - owner * length + jnp.arange(window)  # positions in the row
    inside = (where >= 0) & (where < length)
    piece = jnp.where(inside, row[jnp.clip(where, 0, length - 1)], 0.0)
    out.append(lax.dynamic_update_slice_in_dim(x.reshape(-1), piece, at, 0).reshape(x.shape))
    offset += x.size
  return out


# ------------------------------------------------------------------------------------ chunked top-k


def scatter_rows_add(terms: Sequence[tuple], shape: tuple, fill=None) -> jax.Array:
  """``Σ_t zeros(shape).at[rows, positions_t].add(values_t)`` for the ``(positions, values)`` terms
  (each ``(R, k)``, the positions distinct in each row), added term after term, unrolled; with
  ``fill`` (a scalar: chunked top-k's NaN on a step that is not finite), into ``full(shape,
  fill)`` instead, at no cost beyond the zeros' (a select after it was a pass of its own).

  Into zeros of their own (a 0 read from the first positions, never negative): from ``jnp.zeros``,
  XLA shares one broadcast of 0 between the scatters of leaves of the same shape and copies it for
  each (the buffer assignment holds the copies). ``jaxcomp.chunked_topk``'s update of ResNet-18's
  gradient (W = 8, pmap, gradient and state donated), the W devices' terms added in a
  ``fori_loop`` from ``jnp.zeros`` / this: 3.39 → 2.39 temporaries per gradient, the same
  outputs; ``PYTHONPATH=. python benchmarks/memory.py --compressors chunked_topk``.
  """
  positions, values = terms[0]
  zero = jnp.minimum(positions[0, 0], 0).astype(values.dtype)
  if fill is not None:
    zero = zero + jnp.asarray(fill, values.dtype)
  total = jnp.broadcast_to(zero, shape)
  rows = jnp.arange(shape[0])[:, None]
  for positions, values in terms:
    total = total.at[rows, positions].add(values, unique_indices=True)
  return total
