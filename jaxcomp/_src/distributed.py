"""What PyTorch DDP guarantees besides the gradient exchange, for JAX data parallelism.

A jaxcomp transformation makes the gradient mean identical on every device. Three other promises of
``torch.nn.parallel.DistributedDataParallel`` are not about gradients, and a JAX job has to keep
them itself; this module holds one small function for each.

1. **Identical start.** DDP broadcasts rank 0's ``state_dict`` when it is constructed, "to make sure
   that all model replicas start from the exact same state". A JAX job that initialises every
   process from the same seed only *assumes* it: a process that restored another checkpoint, or runs
   a library version that initialises differently, trains on from another start, and every later
   step is identical only relative to that wrong start. ``broadcast_replicated`` copies process 0's
   value of every replicated leaf (parameters; the replicated parts of a jaxcomp state — every field
   a state does not declare in ``PER_DEVICE_FIELDS``) to every process and device;
   ``check_replicated`` compares a fingerprint of every such leaf across all copies and raises
   ``ReplicaMismatchError`` naming the first leaf that differs. Both are host-side calls, made by
   every process at the same point of the program.
2. **Buffer sync.** DDP broadcasts module buffers (BatchNorm's running statistics) from rank 0
   before every forward pass (``broadcast_buffers=True``). In JAX these are non-gradient collections
   — Linen's ``batch_stats``, NNX's ``nnx.BatchStat`` — that never pass through a jaxcomp
   transformation, so jaxcomp leaves them alone: each device updates its own running statistics from
   its own shard of the batch and they drift apart. ``sync_buffers`` is the choice DDP does not
   give: called inside the step, it averages them over the devices (``policy="mean"``) or gives
   every device device 0's (``"first"``, DDP's default), on every step or every ``every_k`` steps.
3. **Uneven inputs.** DDP's ``Join`` context lets a rank that ran out of batches shadow the others'
   collectives. In an SPMD program a process that stops calling the step leaves the others waiting
   in a collective until the distributed service's heartbeat timeout declares it dead.
   ``all_have_data`` is the cheap correct answer: every process passes whether it has a batch for
   this step, and all of them learn whether every one does — so they stop at the same step.
"""

from __future__ import annotations

import hashlib
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._src import axis
from jaxcomp._src import sharding
from jaxcomp._src import tree as tree_lib
from jaxcomp._src import validate

POLICIES = ("mean", "first")
_CHUNK_WORDS = 1 << 26  # process 0's bytes are broadcast in pieces of at most 256 MiB


class ReplicaMismatchError(ValueError):
  """A leaf meant to be identical on every process and device is not."""


# --- 1. Identical start ---------------------------------------------------------------------------


def _local_copies(leaf, path: str) -> list:
  """This process's copies of a replicated leaf: one per device it sits on, or the host value."""
  if isinstance(leaf, jax.Array):
    if not leaf.sharding.is_fully_replicated:
      raise ValueError(
          f"tree: leaf {path} is sharded ({leaf.sharding}), so it has no copies to compare. Only "
          "replicated leaves can be: declare per-device leaves in their state's PER_DEVICE_FIELDS, "
          "and pass a pmap tree before it is stacked over devices")
    return [shard.data for shard in leaf.addressable_shards]
  return [np.asarray(leaf)]


def _replicated_mask(tree):
  """True at every leaf not under a declared per-device field."""
  return jax.tree.map(lambda per_device: not per_device, sharding.per_device_mask(tree))


def _chosen(tree, chosen):
  """(paths, leaves) of every leaf where ``chosen`` is True, and the tree's treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  pairs = [(jax.tree_util.keystr(p), x) for (p, x), c in zip(flat, jax.tree.leaves(chosen)) if c]
  return [p for p, _ in pairs], [x for _, x in pairs], treedef


def _value_hash(x: np.ndarray) -> np.ndarray:
  """64 bits of BLAKE2b over the array's bytes, as two uint32 words (about 1 GB/s on the host)."""
  digest = hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=8).digest()
  return np.frombuffer(digest, np.uint32)


def _fingerprints(copies: list, values: bool = True) -> np.ndarray:
  """Per leaf: [shape-and-dtype checksum, value hash (2 words), first local copy that differs from
  the first, or 2³²−1]; with ``values=False`` only the checksum. Device copies are read to the host
  one leaf at a time and hashed there: nothing to compile, and the same hash for the same bytes
  whether a process holds a NumPy or a JAX array."""
  rows = np.zeros((len(copies), 4), np.uint32)
  rows[:, 3] = 0xFFFFFFFF
  for i, leaf_copies in enumerate(copies):
    first = leaf_copies[0]
    rows[i, 0] = zlib.crc32(f"{np.dtype(first.dtype).name}{list(first.shape)}".encode())
    if values:
      hashes = [_value_hash(c) for c in jax.device_get(leaf_copies)]
      rows[i, 1:3] = hashes[0]
      rows[i, 3] = next((j for j, h in enumerate(hashes) if not np.array_equal(h, hashes[0])),
                        0xFFFFFFFF)
  return rows


def _gather(rows: np.ndarray) -> np.ndarray:
  """Every process's ``rows`` (the same shape on all), stacked along a new leading axis."""
  if jax.process_count() == 1:
    return rows[None]
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(rows))


def _compare(tree, chosen, values: bool) -> tuple:
  """Gathers every process's fingerprints of ``tree``'s leaves where ``chosen`` is True; raises on
  the first leaf that differs — in shape or dtype, and with ``values`` in any bit — on any process
  or device.

  Every process sees the same gathered table, so all of them raise together (none is left waiting
  in a later collective). Returns (paths, leaves, this process's copies of each leaf).
  """
  paths, leaves, treedef = _chosen(tree, chosen)
  layout = _gather(np.array([len(paths), zlib.crc32("\n".join(paths).encode())], np.uint32))
  if len({tuple(r) for r in layout}) > 1:
    raise ReplicaMismatchError(
        "tree: the processes hold trees of other structures (replicated leaves, checksum of their "
        f"paths) per process: {[tuple(int(v) for v in r) for r in layout]}; this process, "
        f"{jax.process_index()}, has {len(paths)} in {treedef}")
  copies = [_local_copies(x, p) for p, x in zip(paths, leaves)]
  if not copies:
    return paths, leaves, copies
  table = _gather(_fingerprints(copies, values))
  for i, path in enumerate(paths):
    column = table[:, i]
    here = f"{np.dtype(copies[i][0].dtype).name}{list(copies[i][0].shape)}"
    if len(set(column[:, 0].tolist())) > 1:
      raise ReplicaMismatchError(
          f"tree: leaf {path} has another shape or dtype on some processes (process "
          f"{jax.process_index()} has {here}; shape-and-dtype checksums per process: "
          f"{column[:, 0].tolist()})")
    if not values:
      continue
    local = [p for p in range(len(column)) if column[p, 3] != 0xFFFFFFFF]
    if local:
      raise ReplicaMismatchError(
          f"tree: leaf {path} ({here}) differs between the devices of process {local[0]}: its copy "
          f"on local device {int(column[local[0], 3])} is not the one on local device 0. "
          "broadcast_replicated gives every copy process 0's first; values that differ from device "
          "to device on purpose belong under a state's PER_DEVICE_FIELDS")
    others = [p for p in range(1, len(column))
              if not np.array_equal(column[p, 1:3], column[0, 1:3])]
    if others:
      raise ReplicaMismatchError(
          f"tree: leaf {path} ({here}) differs between processes: process {others[0]}'s value is "
          f"not process 0's (fingerprint {column[others[0], 1:3].tolist()} there, "
          f"{column[0, 1:3].tolist()} on process 0). Did a process start from another seed or "
          "checkpoint? broadcast_replicated gives every process process 0's value")
  return paths, leaves, copies


def check_replicated(tree) -> None:
  """Raises unless every replicated leaf of ``tree`` is identical on every process and device.

  The cheap check of an identical start (and of replicas that never drifted): every process hashes
  each of its copies of each leaf into 64 bits (BLAKE2b on the host, one leaf at a time, about
  1 GB/s; nothing to compile), and one all-gather of 16 bytes per leaf compares them. Every process
  must call it at the same point; in a single process it compares the copies on its own devices.

  Replicated leaves are all but those a jaxcomp state declares per device (``PER_DEVICE_FIELDS``,
  the leaves ``state_partition_specs`` shards): a parameter tree, a whole optimizer state, or a dict
  of both. Arrays replicated over a mesh (``PartitionSpec()``) count with every device copy; NumPy
  arrays and scalars with the process's one value.

  Call it after init or restore, and whenever drift is suspected.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    >>> params = jax.device_put({"w": jnp.ones((4, 2))}, replicated)  # a copy on every device
    >>> jaxcomp.check_replicated({"params": params, "step": 0})  # silent: every copy agrees

  Args:
    tree: a pytree of ``jax.Array``\\ s replicated across devices, NumPy arrays or scalars.

  Raises:
    ReplicaMismatchError: naming the first leaf (in tree order) that differs in shape, dtype or any
      bit between processes or between the devices of one process, or saying how the trees'
      structures differ.
    ValueError: a leaf that is not under a per-device field is sharded across devices.
  """
  check_where(tree, _replicated_mask(tree))


def check_where(tree, chosen) -> None:
  """``check_replicated`` of the leaves of ``tree`` where ``chosen`` (a tree of bools) is True."""
  _compare(tree, chosen, values=True)


def _rebuild(leaf, value: np.ndarray):
  """``value`` in the form of ``leaf``: a NumPy array, a scalar, or an array with its sharding."""
  if isinstance(leaf, jax.Array):
    if not leaf.committed:  # as model.init returns them: jax.device_put may still place it anywhere
      return jax.device_put(value)
    return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: value[index])
  if isinstance(leaf, np.ndarray):
    return value
  return value.item() if isinstance(leaf, (bool, int, float, complex)) else value[()]


def _broadcast_bytes(values: list) -> list:
  """Process 0's ``values`` on every process, bit for bit, as one stream of 32-bit words."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils
  padding = np.zeros(-sum(v.nbytes for v in values) % 4, np.uint8)
  stream = np.concatenate([np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in values]
                          + [padding]).view(np.uint32)
  received = np.concatenate(
      [np.asarray(multihost_utils.broadcast_one_to_all(stream[i:i + _CHUNK_WORDS]))
       for i in range(0, stream.size, _CHUNK_WORDS)] or [stream]).view(np.uint8)
  out, start = [], 0
  for v in values:
    out.append(received[start:start + v.nbytes].view(v.dtype).reshape(v.shape))
    start += v.nbytes
  return out


def broadcast_replicated(tree):
  """``tree`` with process 0's value in every replicated leaf, on every process and device.

  DDP's identical start: call it once every process has built (or restored) its parameters and
  optimizer state, before the first step. Leaves a jaxcomp state declares per device
  (``PER_DEVICE_FIELDS``: error feedback, momenta, accumulators) are returned as they are — each
  process keeps its own. Every replicated copy gets process 0's first device's bits, exactly
  (``-0.0`` and NaN payloads included), so ``check_replicated`` passes afterwards. It first checks
  that every process holds leaves of the same paths, shapes and dtypes; then one all-reduce carries
  process 0's bytes (in pieces of at most 256 MiB). In a single process it makes the copies on its
  devices equal to the first.

  Example:
    >>> import numpy as np, jaxcomp
    >>> params = jaxcomp.broadcast_replicated({"w": np.ones(3)})  # every process: process 0's
    >>> params["w"]  # a NumPy array stays one
    array([1., 1., 1.])

  Args:
    tree: a pytree of ``jax.Array``\\ s replicated across devices, NumPy arrays or scalars; every
      process passes its own, of the same structure, shapes and dtypes.

  Returns:
    A tree of the same structure and kinds of leaves: NumPy arrays stay NumPy arrays, a
    ``jax.Array`` keeps its sharding.

  Raises:
    ReplicaMismatchError: the processes' trees differ in structure, or a leaf in shape or dtype.
    ValueError: a leaf that is not under a per-device field is sharded across devices.
  """
  return broadcast_where(tree, _replicated_mask(tree))


def broadcast_where(tree, chosen):
  """``broadcast_replicated`` of the leaves of ``tree`` where ``chosen`` (a tree of bools) is True;
  the others are returned as they are. ``data_parallel``'s ``make_state`` broadcasts every leaf of
  a one-device state this way, per-device ones included (before they are stacked, they are that one
  device's value, the start of every device)."""
  copies = _compare(tree, chosen, values=False)[2]
  source = jax.process_index() == 0  # the others only need the shapes: they receive the bytes
  values = iter(_broadcast_bytes([np.asarray(c[0]) if source else np.zeros(c[0].shape, c[0].dtype)
                                  for c in copies]))
  return jax.tree.map(lambda x, c: _rebuild(x, next(values)) if c else x, tree, chosen)


# --- 2. Buffer sync -------------------------------------------------------------------------------


def _mean(leaves: list, paths: tuple, axis_name) -> list:
  for path, x in zip(paths, leaves):
    if not tree_lib.is_float(x) and math.prod(x.shape) > 0:
      raise TypeError(f"buffers: leaf {path} is {x.dtype.name}; policy 'mean' averages "
                      "floating-point buffers only. Use policy='first' to give every device device "
                      "0's value of it")
  chosen = [i for i, x in enumerate(leaves) if tree_lib.is_reduced(x)]
  out = list(leaves)
  for i, mean in zip(chosen, axis.mean_many([leaves[i] for i in chosen], axis_name)):
    out[i] = mean
  return out


def _first(leaves: list, axis_name) -> list:
  # Device 0 contributes its value, every other device zeros: one all-reduce per dtype whose sum is
  # device 0's value exactly (x + 0 = x), where an all-gather would send W times as much.
  is_first = lax.axis_index(axis_name) == 0
  sent = [jnp.where(is_first, x, jnp.zeros_like(x)).astype(jnp.int32 if x.dtype == jnp.bool_
                                                            else x.dtype) for x in leaves]
  return [y.astype(x.dtype) for x, y in zip(leaves, axis.psum_many(sent, axis_name))]


def sync_buffers(buffers, policy: str = "mean", *, axis_name: axis.AxisName = "batch",
                 every_k: int = 1, step=None):
  """Makes non-gradient state (BatchNorm's running statistics) the same on every device.

  jaxcomp averages gradients only; Linen's ``batch_stats`` and NNX's ``nnx.BatchStat`` never pass
  through it, so each device keeps the running statistics of its own shard of the batch. Call this
  inside the step, on the updated statistics, to choose what they are:

  * ``"mean"``: their mean over the devices (of the statistics, not of the batches: with equal
    shards, the running mean equals the single-device one, the running variance misses the spread
    between the shards' means). One all-reduce per dtype.
  * ``"first"``: device 0's along the axis (process 0's first device on a mesh of ``jax.devices()``)
    on every device: DDP's ``broadcast_buffers``.
    One all-reduce per dtype too (device 0 sends its value, the others zeros).

  With ``every_k > 1`` they are synchronised only on the k-th, 2k-th, … step (``(step + 1) % every_k
  == 0``) and stay per device in between, so a ``shard_map`` step must give them a per-device spec
  (``PartitionSpec(axis_name)``, stacked over devices), as pmap does. The decision is taken on the
  largest ``step`` over the devices (a 4-byte all-reduce), so a device whose counter disagrees
  cannot skip a collective the others wait in. ``flax.linen.BatchNorm(axis_name=...)`` is the other
  answer — torch's SyncBatchNorm: it normalises with the statistics of the whole batch, at an
  all-reduce per layer per forward pass.

  In a Flax model, inside the pmap'd or shard_map'd step::

    # Linen
    logits, updates = model.apply({"params": p, "batch_stats": bs}, x, mutable=["batch_stats"])
    bs = jaxcomp.sync_buffers(updates["batch_stats"], "mean", axis_name="batch")
    # NNX
    nnx.update(model, jaxcomp.sync_buffers(nnx.state(model, nnx.BatchStat), "first"))

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> stats = {"mean": jnp.arange(8.0), "var": jnp.arange(8.0)}  # device i's are i
    >>> sync = lambda s: {"mean": jaxcomp.sync_buffers(s["mean"], "mean", axis_name="batch"),
    ...                   "var": jaxcomp.sync_buffers(s["var"], "first", axis_name="batch")}
    >>> synced = jax.pmap(sync, axis_name="batch")(stats)
    >>> print(synced["mean"], synced["var"])
    [3.5 3.5 3.5 3.5 3.5 3.5 3.5 3.5] [0. 0. 0. 0. 0. 0. 0. 0.]

  Args:
    buffers: the pytree of statistics (arrays or NNX Variables).
    policy: ``"mean"`` or ``"first"``.
    axis_name: the mapped axis to synchronise over. When no axis is bound (world size 1) the buffers
      are returned as they are.
    every_k: synchronise every this many steps (a static Python int ≥ 1).
    step: the number of steps before this one (this step's index counted from 0; an optimizer
      state's count before this step's update); required when ``every_k > 1``.

  Returns:
    ``buffers`` in their own structure, synchronised (on a synchronising step).

  Raises:
    TypeError: ``policy="mean"`` meets a non-empty integer or boolean leaf.
    ValueError: a policy other than these, or ``every_k > 1`` without ``step``.
  """
  policy = validate.choice(policy, "policy", POLICIES)
  every_k = validate.integer(every_k, "every_k", 1, static="decides which steps communicate")
  if every_k > 1 and step is None:
    raise ValueError("step is required with every_k > 1: pass the number of steps before this one "
                     "(e.g. an optimizer state's count before this step's update)")
  axis_name = axis.check_axis_name(axis_name)
  leaves = jax.tree.leaves(buffers)
  name = axis.bound_axis(axis_name)
  if name is None or not leaves:
    return buffers

  def sync(leaves):
    if policy == "mean":
      return _mean(leaves, tree_lib.paths_of(buffers), name)
    return _first(leaves, name)

  if every_k == 1:
    return tree_lib.like(buffers, sync(leaves))
  # The synchronised branch returns values that are the same on every device; ``where`` types them
  # like the local ones (varying along the axis under shard_map's check_vma), as cond requires.
  due = (axis.pmax(jnp.asarray(step, jnp.int32), name) + 1) % every_k == 0
  synced = lax.cond(due, lambda xs: [jnp.where(True, y, x) for x, y in zip(xs, sync(xs))],
                    lambda xs: list(xs), leaves)
  return tree_lib.like(buffers, synced)


# --- 3. Uneven inputs -----------------------------------------------------------------------------


def all_have_data(has_data: bool) -> bool:
  """Whether every process has a batch for this step: the same answer on every process.

  A process that runs out of data and stops calling the step leaves the others waiting in its
  collectives until the distributed service's heartbeat timeout. Every process calls this once per
  step, before the step, with whether it has a batch, and stops when the answer is False — so all
  stop at the same step, the first that some process cannot fill (DDP's ``Join`` instead lets the
  others continue while the exhausted rank shadows their collectives). One all-gather of 4 bytes per
  process per step; in a single process it returns ``has_data``.

  Example:
    >>> import jaxcomp
    >>> batches, steps = iter(["batch 0", "batch 1", "batch 2"]), 0  # this process's batches
    >>> while jaxcomp.all_have_data((batch := next(batches, None)) is not None):
    ...   steps += 1  # state = train_step(state, batch)
    >>> steps
    3

  To use every batch instead, continue while any process has data, and let an exhausted process feed
  a batch whose examples have weight zero (and the loss divide by the all-reduced total weight):
  ``not all_have_data(not has_data)`` is whether any has.

  Args:
    has_data: whether this process has a batch for the coming step.

  Returns:
    True iff every process passed True.
  """
  has_data = validate.boolean(has_data, "has_data")
  return bool(_gather(np.array([has_data], np.uint32)).all())
