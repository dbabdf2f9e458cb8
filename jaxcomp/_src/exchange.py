"""The two-phase compressed mean with error feedback at both ends: reduce-scatter, encode, gather.

An all-reduce sums on the wire, so whatever travels must be summable: an integer psum of int8 codes
overflows and a shared scale wastes range. A compressed mean is built from the collectives that only
move data instead (XLA's collective quantizer narrows exactly these). With W devices, each holding
float32 arrays ``x`` (L values in all), laid out in W rows, one per owner (``layout``):

1. ``p = x + e``: this device's worker error is added (error feedback);
2. ``p``'s rows are encoded (``codec.encode``): small codes plus their scales;
3. ``all_to_all``: row d of every device's encoding goes to device d, its owner — a reduce-scatter
   whose reduction the owner does itself; ``e ← p − decode(encoding)`` (the worker error);
4. the owner decodes the W encodings of its row and averages them in float32 (each ÷W, then
   summed in device order), adds its server error ``s`` and zeroes the padding;
5. the owner encodes that mean once more, ``s ← mean − decode(encoding)`` (the server error);
6. ``all_gather`` of every owner's encoding: each device decodes the whole mean, identically;
7. non-finite values (the policy of ``jaxcomp._src.finite``), from the scales every device now
   holds: a codec's scale is not finite where the values it encodes are not (``kernels.max_abs``,
   a sum of magnitudes), so a NaN or an infinity in any device's ``x`` makes its owner's mean and
   that mean's scales non-finite. Where one is, every scale becomes NaN (so does every output) and
   both errors keep their old values: no pass over ``x`` and no flag of its own on the wire.

Each device sends (W−1)/W of its encoding twice: 2·(W−1)/W·L codes plus the scales, against
2·(W−1)/W·L float32 values for a ring all-reduce. With both errors kept, nothing is lost, only
delayed: summed over steps, the outputs are the mean inputs minus the mean of the final worker
errors and minus the final server errors (each device holds the server error of its own row, zero
elsewhere).

The rows (``layout``): each array of a multiple of W·``granule`` values (the codec's block, or 8
bits of a byte) is W rows by a reshape, row d its d-th S consecutive values, so that it is neither
copied nor padded on its way to the codec; the other (small) arrays are raveled and concatenated
into one flat vector, zero-padded to W shards of S values (S a multiple of ``granule``), shard d
being row d. Where the mesh leaves other axes to the SPMD partitioner (``kernels.keeps_leaves``: a
2-D ``jaxcomp.data_parallel`` mesh whose parameters are sharded over a model axis) these rows would
move the sharded values across the mesh, so there each array is laid out on its own: its last axis
dealt round-robin to the owners (value j to owner j mod W), its other axes kept, so that its rows
keep its sharding, and each array travels in collectives of its own.

Sharded optimizer state (``jaxcomp.sharded_optimizer``) runs the two halves apart, in the rows of
``shard_layout`` (each leaf's shards, ``shards.py``): ``scatter_mean`` (1–4) gives the owner its
float32 mean, which its optimizer takes as it is (nothing is re-encoded: no server error), and
``gather_rows`` (5–6) sends every device's update in 8 bits (ZeRO++'s qwZ).

A codec decides how values travel (``jaxcomp.quantized``: int8 or float8 codes with one scale per
block; ``jaxcomp.scale_by_onebit_adam``: sign bits with one scale per encoded row). The errors have
the arrays' own shapes, whatever W is, so a state does not depend on the number of devices: padding
is zero before encoding and decodes to nothing that is kept.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021, Algorithm 1 (worker and server error); DeepSpeed ``compressed_allreduce``
  (``deepspeed/runtime/comm/nccl.py``: all-to-all of the worker's chunks, server averaging and
  re-compression, all-gather).
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", 2023
  (qgZ: the gradient reduce-scatter as an all-to-all of block-quantized int values).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import axis, finite, kernels, shards
from jaxcomp._src import tree as tree_lib


class Codec(NamedTuple):
  """How values travel.

  Attributes:
    encode: ``encode(rows, count, key) -> (payload, decoded)``: ``rows`` is a list of float32
      pieces of shape (R, …) holding ``count`` values in all and zero padding; ``payload`` is a list
      of arrays with the leading axis R (what is sent), ``decoded`` the float32 pieces the receiver
      will decode from it; ``key`` is a PRNG key for stochastic rounding, or None.
    decode: ``decode(payload, tails) -> decoded``, the inverse on the receiving side; ``tails`` are
      the pieces' shapes after their leading axis.
    granule: the flat layout's shard length S is a multiple of it (a block, or 8 bits of a byte).
  """
  encode: Callable
  decode: Callable
  granule: int


class Layout(NamedTuple):
  """How a list of arrays is cut into W rows, one per owner.

  Attributes:
    split: ``split(arrays) -> pieces``, each of shape (W, …): row d of every piece is owner d's.
    join: ``join(pieces) -> arrays``, the inverse (padding dropped).
    valid: ``valid(owner) -> masks``: a bool array per piece of shape (1, …), False at the padding
      of the owner's row.
    count: ``count(owner)``: the number of values (not padding) in the owner's row, an int32.
    row: ``row(arrays, owner) -> rows``: the owner's row of each piece of ``split(arrays)``, each
      of shape (1, …), read without splitting the arrays (the server error's).
    with_row: ``with_row(arrays, rows, owner) -> arrays``: arrays that hold zeros outside the
      owner's row (the server error) with ``rows`` there, written in place where it can.
  """
  split: Callable
  join: Callable
  valid: Callable
  count: Callable
  row: Optional[Callable] = None
  with_row: Optional[Callable] = None


def shard_length(length: int, world: int, granule: int) -> int:
  """The per-device shard S: W shards of S elements hold ``length``, S a multiple of ``granule``."""
  return max(math.ceil(length / (world * granule)), 1) * granule


def flat_layout(shapes: Sequence[tuple], world: int, granule: int) -> Layout:
  """One piece (W, S): the arrays raveled, concatenated, zero-padded and cut into W shards."""
  length = sum(math.prod(s) for s in shapes)
  shard = shard_length(length, world, granule)

  def split(arrays):
    padding = [jnp.zeros([world * shard - length], jnp.float32)]
    return [tree_lib.flatten(list(arrays) + padding).reshape(world, shard)]

  def join(pieces):
    return tree_lib.unflatten(pieces[0].reshape(-1)[:length], shapes)

  def valid(owner):
    return [owner * shard + jnp.arange(shard)[None] < length]

  def count(owner):
    return jnp.clip(length - owner * shard, 0, shard)

  def row(arrays, owner):
    return [kernels.row_of_arrays(arrays, owner, shard, world)[None]]

  def with_row(arrays, rows, owner):
    return kernels.row_update_arrays(arrays, rows[0].reshape(-1), owner)

  return Layout(split, join, valid, count, row, with_row)


def row_layout(shapes: Sequence[tuple], world: int, granule: int) -> Layout:
  """A piece (W, S) per array of a multiple of W·granule values, the array itself reshaped (row d
  its d-th S consecutive values: no copy, no padding); the other arrays in one ``flat_layout``
  piece after them."""
  whole = [i for i, s in enumerate(shapes) if math.prod(s) % (world * granule) == 0
           and math.prod(s)]
  rest = [i for i in range(len(shapes)) if i not in whole]
  flat = flat_layout([shapes[i] for i in rest], world, granule) if rest else None
  sizes = [math.prod(shapes[i]) // world for i in whole]

  def pick(arrays, members):
    return [arrays[i] for i in members]

  def split(arrays):
    return ([arrays[i].reshape(world, -1) for i in whole]
            + (flat.split(pick(arrays, rest)) if flat else []))

  def join(pieces):
    arrays = [None] * len(shapes)
    for i, piece in zip(whole, pieces):
      arrays[i] = piece.reshape(shapes[i])
    for i, x in zip(rest, flat.join(pieces[len(whole):]) if flat else []):
      arrays[i] = x
    return arrays

  def valid(owner):
    return ([jnp.ones((1, size), bool) for size in sizes]
            + (flat.valid(owner) if flat else []))

  def count(owner):
    return sum(sizes) + (flat.count(owner) if flat else 0)

  def row(arrays, owner):
    return ([lax.dynamic_index_in_dim(arrays[i].reshape(world, -1), owner) for i in whole]
            + (flat.row(pick(arrays, rest), owner) if flat else []))

  def with_row(arrays, rows, owner):
    out = list(arrays)
    for i, r in zip(whole, rows):
      out[i] = lax.dynamic_update_index_in_dim(arrays[i].reshape(world, -1), r[0], owner,
                                               0).reshape(shapes[i])
    for i, x in zip(rest, flat.with_row(pick(arrays, rest), rows[len(whole):], owner)
                    if flat else []):
      out[i] = x
    return out

  return Layout(split, join, valid, count, row, with_row)


def leaf_layout(shapes: Sequence[tuple], world: int) -> Layout:
  """A piece per array, (W, …, C): its last axis (B values, C = ⌈B/W⌉) dealt round-robin, value j
  to owner j mod W; its other axes kept (a 0-d array is one value)."""
  lasts = [s[-1] if s else 1 for s in shapes]
  columns = [-(-b // world) for b in lasts]

  def split(arrays):
    pieces = []
    for x, b, c in zip(arrays, lasts, columns):
      x = jnp.atleast_1d(x)
      if world * c > b:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, world * c - b)])
      pieces.append(jnp.moveaxis(x.reshape(x.shape[:-1] + (c, world)), -1, 0))
    return pieces

  def join(pieces):
    arrays = []
    for piece, shape, b in zip(pieces, shapes, lasts):
      x = jnp.moveaxis(piece, 0, -1)
      arrays.append(x.reshape(x.shape[:-2] + (-1,))[..., :b].reshape(shape))
    return arrays

  def valid(owner):
    return [jnp.broadcast_to(owner + world * jnp.arange(c) < b, (1,) + tuple(s[:-1]) + (c,))
            for s, b, c in zip(shapes, lasts, columns)]

  def count(owner):  # values j < b with j mod W = owner, in each row of the last axis
    return sum(math.prod(s[:-1]) * ((b - 1 - owner) // world + 1) for s, b in zip(shapes, lasts))

  def row(arrays, owner):
    return [lax.dynamic_index_in_dim(x, owner) for x in split(arrays)]

  def with_row(arrays, rows, owner):
    mine = jnp.arange(world) == owner
    return join([jnp.where(mine.reshape((world,) + (1,) * (r.ndim - 1)), r, 0.0) for r in rows])

  return Layout(split, join, valid, count, row, with_row)


def layout(shapes: Sequence[tuple], world: int, granule: int) -> Layout:
  """The row layout, or the leaf layout where the mesh may shard the arrays over other axes."""
  if kernels.keeps_leaves():
    return leaf_layout(shapes, world)
  return row_layout(shapes, world, granule)


def shard_layout(shapes: Sequence[tuple], world: int) -> Layout:
  """The rows of sharded optimizer state (``shards.layout``): each array's W shards, all of them
  packed into one piece (W, ΣS) (``shards``' flat layout), or a piece per array (by leaf)."""
  cut = shards.Layout(world, kernels.keeps_leaves())
  if cut.by_leaf:
    leaves = leaf_layout(shapes, world)
    return leaves._replace(split=lambda arrays: [cut.split(x) for x in arrays],
                           join=lambda pieces: [cut.join(p, s) for p, s in zip(pieces, shapes)],
                           valid=lambda owner: [v.reshape((1,) + cut.shape(s)) for v, s in
                                                zip(leaves.valid(owner), shapes)])
  sizes = [math.prod(cut.shape(s)) for s in shapes]
  counts = [math.prod(s) for s in shapes]

  def split(arrays):
    return [jnp.concatenate([cut.split(x).reshape(world, -1) for x in arrays], axis=1)]

  def join(pieces):
    rows = tree_lib.unflatten(pieces[0], [(size,) for size in sizes])
    return [cut.join(r, s) for r, s in zip(rows, shapes)]

  def valid(owner):
    return [jnp.concatenate([owner * size + jnp.arange(size) < n
                             for n, size in zip(counts, sizes)])[None]]

  def count(owner):
    return sum(jnp.clip(n - owner * size, 0, size) for n, size in zip(counts, sizes))

  return Layout(split, join, valid, count)


def owned_shards(rows: list, shapes: Sequence[tuple], world: int) -> list:
  """Each array's shard (``shards.Layout.shape``) from this device's rows of ``shard_layout``'s
  pieces, each of shape (1, …)."""
  cut = shards.Layout(world, kernels.keeps_leaves())
  if cut.by_leaf:
    return [r[0] for r in rows]
  return tree_lib.unflatten(rows[0][0], [cut.shape(s) for s in shapes])


def shard_rows(owned: list) -> list:
  """The inverse of ``owned_shards``: this device's rows of ``shard_layout``'s pieces."""
  if kernels.keeps_leaves():
    return [x[None] for x in owned]
  return [tree_lib.flatten(owned)[None]]


def _owner_mean(codec: Codec, received: list, tails: list, world: int) -> list:
  """4: per piece, the mean of the W decoded rows, each ÷W first (no overflow), summed in device
  order; shape (1, …)."""
  return kernels.device_mean(lambda w: codec.decode([r[w:w + 1] for r in received], tails), world)


def scatter_mean(codec: Codec, rows_of: Layout, x: list, worker_error: Optional[list],
                 axis_name: axis.AxisName, key: Optional[jax.Array] = None) -> tuple:
  """Steps 1–4 of the exchange, but the server error: the owner's mean of its row of every piece.

  Args:
    codec: how values travel.
    rows_of: the layout of the rows (``layout``, or ``shard_layout`` for sharded optimizer state).
    x, worker_error, axis_name, key: as for ``compressed_mean``.

  Returns:
    ``(mean, new worker error, finite)``: the float32 mean of this device's row of each piece, of
    shape (1, …), its padding zeroed; the worker error as given (None stays None); whether the
    scales this device received are finite (7, for its own row only).
  """
  world = axis.axis_size(axis_name)
  me = axis.axis_index(axis_name)
  key = None if key is None else jax.random.fold_in(jax.random.fold_in(key, 0), me)
  # 1: p = x + e, in rows.
  with kernels.part("error_feedback"):
    p = x if worker_error is None else [a + e for a, e in zip(x, worker_error)]
  with kernels.part("layout"):
    rows = rows_of.split(p)
  # 2–3: encode, send row d to device d; e ← p − decode(encoding).
  with kernels.part("encode"):
    payload, decoded = codec.encode(rows, sum(a.size for a in x), key)
  if worker_error is not None:
    with kernels.part("error_feedback"):
      worker_error = rows_of.join([r - d for r, d in zip(rows, decoded)])
  received = kernels.all_to_all(payload, axis_name)
  # 4: the owner's mean of its row; the padding is zeroed.
  with kernels.part("decode"):
    mean = _owner_mean(codec, received, [r.shape[1:] for r in rows], world)
    return ([jnp.where(v, m, 0.0) for v, m in zip(rows_of.valid(me), mean)], worker_error,
            finite.reduced_finite(received))


def gather_rows(codec: Codec, rows_of: Layout, rows: list, count, axis_name: axis.AxisName,
                key: Optional[jax.Array] = None) -> tuple:
  """Steps 5–6 of the exchange, but the server error: every device's row of every piece, encoded,
  gathered and decoded.

  Args:
    codec: how values travel.
    rows_of: the layout of the rows.
    rows: this device's row of each piece, float32 of shape (1, …), its padding zero.
    count: the number of values (not padding) in ``rows``.
    axis_name, key: as for ``compressed_mean``.

  Returns:
    ``(arrays, decoded, finite)``: the whole arrays, identical on every device, NaN everywhere
    where a scale was not (7); this device's rows as the others decode them; whether every scale
    gathered was finite, the same on every device.
  """
  me = axis.axis_index(axis_name)
  key = None if key is None else jax.random.fold_in(jax.random.fold_in(key, 1), me)
  # 5: encode this device's rows.
  with kernels.part("encode"):
    payload, decoded = codec.encode(rows, count, key)
  # 6: every device's encoding to every device; 7: NaN scales where one is not finite.
  gathered = [g[:, 0] for g in kernels.all_gather(payload, axis_name)]
  ok = finite.reduced_finite(gathered)
  gathered = finite.nan_unless_finite(ok, gathered)
  with kernels.part("decode"):
    return rows_of.join(codec.decode(gathered, [r.shape[1:] for r in rows])), decoded, ok


def compressed_mean(codec: Codec, x: list, worker_error: Optional[list],
                    server_error: Optional[list], axis_name: axis.AxisName,
                    key: Optional[jax.Array] = None) -> tuple:
  """The two-phase compressed mean of the float32 arrays ``x`` (steps 1–6).

  Args:
    codec: how values travel.
    x: this device's values, a non-empty list of float32 arrays.
    worker_error: this device's worker error, arrays shaped as ``x``, or None without error
      feedback.
    server_error: the server error of the row this device owns, shaped as ``x`` (zero outside that
      row), or None without error feedback.
    axis_name: the mapped axis.
    key: PRNG key for stochastic rounding (the same on every device; each device and phase folds in
      its own index), or None for deterministic rounding.

  Returns:
    ``(mean, new worker error, new server error, finite)``: the mean of each array, identical on
    every device (NaN where ``finite`` is false); the errors as given (None stays None), kept
    where ``finite`` is false; whether every device's ``x`` was finite (7).
  """
  world = axis.axis_size(axis_name)
  rows_of = layout([a.shape for a in x], world, codec.granule)
  me = axis.axis_index(axis_name)
  # 1–4: the owner's mean of its row (padding zeroed), plus its server error (zero at the padding).
  old_worker_error = worker_error
  mean, worker_error, _ = scatter_mean(codec, rows_of, x, worker_error, axis_name, key)
  if server_error is not None:
    with kernels.part("error_feedback"):
      old_rows = rows_of.row(server_error, me)
      mean = [m + s for m, s in zip(mean, old_rows)]
  # 5–7: re-encode and gather; s ← mean − decode(encoding), at this device's row.
  whole, decoded, ok = gather_rows(codec, rows_of, mean, rows_of.count(me), axis_name, key)
  with kernels.part("error_feedback"):  # 7: both errors kept where not finite (in place)
    if server_error is not None:
      rows = [jnp.where(v, m - d, 0.0) for m, d, v in zip(mean, decoded, rows_of.valid(me))]
      server_error = rows_of.with_row(server_error, finite.keep_if_finite(ok, rows, old_rows),
                                      me)
    if worker_error is not None:
      worker_error = finite.keep_if_finite(ok, worker_error, old_worker_error)
  return whole, worker_error, server_error, ok
