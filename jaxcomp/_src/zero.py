"""Sharded optimizer state (ZeRO-1/2), compressed exchanges: reduce-scatter, update a shard, gather.

Models that fill their accelerators shard the optimizer state over the data-parallel devices
(DeepSpeed ZeRO-1/2, PyTorch FSDP's ``SHARD_GRAD_OP``, ``jax.jit`` with sharded optimizer state).
``sharded_optimizer(exchange, optimizer)`` is ``optax.chain(exchange, optimizer)`` with the
optimizer's state split over the W devices of the axis: each device keeps 1/W of it (AdamW's
moments, momentum buffers) and runs the optimizer on its shard of every leaf only (``shards.py``'s
layout). The steps, per device (the ``# n:`` comments below):

1. reduce-scatter: the exchange — a jaxcomp compressor — gives this device its shard of each leaf's
   mean gradient (its ``scatter``, a declared part of ``jaxcomp.Transformation``): the dense means
   natively as a ``psum_scatter`` in their wire dtype (float32, float16, bfloat16); ``quantized`` as
   the all-to-all of its 8-bit codes, the owner averaging them in float32, with the sender's error
   feedback (ZeRO++'s qgZ); the others (PowerSGD, DGC, sign, ...) as their whole mean, of which the
   shard is kept;
2. the parameters' shard: cut out of the parameters (``gather_dtype=None``), or the device's
   float32 master of its shard (a lossy gather: its state);
3. the optimizer updates the shard: ``optimizer.update(gradient shards, its state's shards,
   parameter shards)``, checked first to be computed element by element (below);
4. all-gather of the update. Exact (``gather_dtype=None``): every device's update shard in its own
   dtype, so the parameters move exactly as under ``optax.chain(exchange, optimizer)``. Lossy
   (``"bfloat16"``, ``"float16"``, ``"int8"``: codes with a float32 scale per 256 values, ZeRO++'s
   qwZ): the master shard moves (m ← m + u) and its owner sends the difference between it and the
   parameters every device holds, d = m − p, rounded to the gather dtype: the parameters follow the
   exact master to within one rounding of a step's change (not of the parameters themselves), and
   what a rounding leaves out is in the next step's difference — never lost, never drifting;
5. the output is the update of the whole parameters, the same on every device
   (``optax.apply_updates``).

Bytes per device per step (ring): (W−1)/W·N values in the exchange's wire dtype for the
reduce-scatter and (W−1)/W·N in the gather dtype, against 2·(W−1)/W·N float32 values for an
all-reduce; the padding of each leaf to a multiple of W adds at most W − 1 values per leaf to each.

**What the optimizer may do.** It sees one shard of each leaf. Elementwise optimizers (SGD,
momentum, Adam, AdamW, Lion, RMSProp, Adagrad, ...; masks on the rank, which shards keep) compute on
a shard exactly what they compute on that part of the whole leaf. Two things would silently differ,
and are refused while the step is traced, naming what was found:

* a computation that depends on a leaf's shape (Adafactor's factored moments, a mask on a
  dimension's size): the optimizer's program on the shards differs from its program on the leaves;
* a reduction over a shard's elements (a global norm, a trust ratio, ``optax.apply_if_finite``'s
  check) that reaches the update or the state without being summed over the axis: it would see one
  shard only; and random numbers (``optax.add_noise``), which every shard would draw alike.
  ``sharded_clip_by_global_norm`` sums the squares over the devices; ``jaxcomp.skip_if_nonfinite``
  around the sharded optimizer takes its decision from every device's whole gradient; a collective
  over the axis on anything else (a compressor inside the optimizer) is refused too.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020 (https://arxiv.org/abs/1910.02054): optimizer state (stage 1) and gradients (stage 2)
  partitioned.
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", 2023
  (https://arxiv.org/abs/2306.10209): qgZ, the quantized gradient reduce-scatter; qwZ, the quantized
  weight all-gather.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

import functools

from jaxcomp._src import axis, exchange, interface, jaxprs, quantized, shards
from jaxcomp._src import validate
from jaxcomp._src import tree as tree_lib

GATHER_DTYPES = (None, "bfloat16", "float16", "int8")
# qwZ: 8-bit codes with a float32 scale per block of 256 values (jaxcomp.quantized's codec); also
# the fully sharded step's gather (fsdp.py).
CODECS = {"int8": quantized.block_codec(quantized.QuantizedConfig(bits=8, block_size=256)),
          "float8_e4m3fn": quantized.block_codec(
              quantized.QuantizedConfig(bits="fp8", block_size=256))}


class ShardedOptimizerState(NamedTuple):
  """State of ``sharded_optimizer``.

  Attributes:
    exchange: the exchange's state (its own per-device fields declared as ever).
    inner: the optimizer's state for this device's shards of the parameters; per device.
    master: this device's shards of the parameters, kept exact for a lossy gather; per device
      (``optax.MaskedNode()`` for the exact gather, which cuts them out of the parameters).
    signature: the parameters' structure, shapes and dtypes.
  """
  exchange: Any
  inner: Any
  master: Any
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("inner", "master")  # see jaxcomp.sharding


def holds_sharded_state(tree) -> bool:
  """Whether ``tree`` holds a ``ShardedOptimizerState`` (made per device: it holds that device's
  shards)."""
  is_state = lambda node: isinstance(node, ShardedOptimizerState)
  return any(is_state(node) for node in jax.tree.leaves(tree, is_leaf=is_state))


def _own(signature: tree_lib.TreeSignature, tree, axis_name) -> Any:
  """``tree`` (the parameters' structure) with this device's shard of every reduced leaf; the other
  leaves whole."""
  leaves = signature.check(tree, "params")
  for i in signature.reduced:
    leaves[i] = shards.own(leaves[i], axis_name)
  return signature.unflatten(leaves)


def gather(sent: list, shapes: list, gather_dtype: Optional[str], axis_name) -> list:
  """4: the whole arrays of ``shapes`` from every device's shards ``sent``, the same on every
  device, sent in ``gather_dtype``: exactly (None), cast (``"bfloat16"``, ``"float16"``), or as the
  8-bit codes of ``CODECS`` (the exchange's 5–6), which arrive as float32."""
  if gather_dtype not in CODECS:
    return shards.gather([x if gather_dtype is None else x.astype(gather_dtype) for x in sent],
                         shapes, axis_name)
  rows_of = exchange.shard_layout(shapes, axis.axis_size(axis_name))
  rows = exchange.shard_rows([x.astype(jnp.float32) for x in sent])
  count = rows_of.count(axis.axis_index(axis_name))
  return exchange.gather_rows(CODECS[gather_dtype], rows_of, rows, count, axis_name)[0]


def sharded_optimizer(exchange: optax.GradientTransformation,
                      optimizer: optax.GradientTransformation, *,
                      gather_dtype: Optional[str] = None,
                      axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """``optax.chain(exchange, optimizer)`` with the optimizer's state sharded over the devices.

  Each device keeps 1/W of the optimizer's state, receives its shard of the mean gradient (a
  reduce-scatter through the jaxcomp compressor ``exchange``), updates that shard of the parameters,
  and every device's updated shard is all-gathered (the module docstring numbers the steps)::

    tx = jaxcomp.sharded_optimizer(jaxcomp.bf16_compress(), optax.adamw(1e-3),
                                   gather_dtype="bfloat16")
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)        # each device's shards, stacked
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard(batch))

  Its state is made on each device (under ``jax.pmap``: ``jax.pmap(tx.init, axis_name=...)``;
  ``data_parallel`` does it for you), and its ``update`` needs the parameters.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adam(1e-3))
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> params = jnp.ones((64, 16))  # 1,024 parameters
    >>> opt_state = dp.make_state(params)
    >>> opt_state.inner[0].mu.shape  # Adam's first moment: 8 devices, 128 values each
    (8, 1, 128)
    >>> params, opt_state, loss = dp.step(params, opt_state, dp.shard(jnp.ones((16, 64))))
    >>> params.shape
    (64, 16)

  Args:
    exchange: the gradient exchange, any jaxcomp compressor (``allreduce``, ``fp16_compress``,
      ``bf16_compress``, ``quantized``: a native reduce-scatter; ``powersgd``, ``dgc``, ...: the
      whole mean, of which each device keeps its shard).
    optimizer: the optimizer that runs on the shards: one that computes element by element (SGD,
      Adam, AdamW, ...); clip with ``sharded_clip_by_global_norm`` in it; guard this
      transformation with ``jaxcomp.skip_if_nonfinite`` around it.
    gather_dtype: how the updated shards travel: None (exactly: the update in its own dtype),
      ``"bfloat16"``, ``"float16"`` (half the bytes) or ``"int8"`` (a quarter, plus a float32
      scale per 256 values); each device then keeps a float32 master of its shard, and the
      parameters follow it to within one rounding of a step's change.
    axis_name: the mapped axis the optimizer state is sharded over: the exchange's ``axis_name``.

  Returns:
    A ``GradientTransformation`` with a ``ShardedOptimizerState``; its output, the update of the
    whole parameters, is the same on every device.

  Raises:
    TypeError: ``exchange`` is not a jaxcomp compressor, or ``optimizer`` not an optax
      transformation.
    ValueError: ``gather_dtype`` is not one above.

  References:
    Rajbhandari et al., "ZeRO", SC 2020; Wang et al., "ZeRO++", 2023 (qgZ, qwZ).
  """
  exchange = interface.mean(exchange, "exchange", "jaxcomp.bf16_compress()")
  optimizer = validate.transformation(optimizer, "optimizer", "optax.adamw(1e-3)")
  gather_dtype = validate.choice(gather_dtype, "gather_dtype", GATHER_DTYPES)
  axis_name = axis.check_axis_name(axis_name)
  lossy = gather_dtype is not None

  def init_fn(params):
    signature = tree_lib.TreeSignature.of(params)
    owned = _own(signature, params, axis_name)
    return ShardedOptimizerState(exchange.scatter_init(params), optimizer.init(owned),
                                 owned if lossy else optax.MaskedNode(), signature)

  def update_fn(updates, state: ShardedOptimizerState, params=None):
    # The exchange checks its own state; tree_lib.check_state cannot read the optimizer's PRNG keys.
    if not isinstance(state, ShardedOptimizerState):
      raise TypeError(f"sharded_optimizer: update needs the state its init made; got "
                      f"{type(state).__name__}")
    if params is None:
      raise ValueError("sharded_optimizer: update needs the parameters, "
                       "tx.update(grads, opt_state, params), to cut this device's shard of them")
    signature = state.signature
    # 1: this device's shard of each leaf's mean gradient.
    owned, exchange_state = exchange.scatter(updates, state.exchange)
    owned = signature.unflatten(jax.tree.leaves(tree_lib.unwrap(owned)))
    # 2: the parameters' shards.
    current = _own(signature, params, axis_name)
    base = state.master if lossy else current
    # 3: the optimizer on the shards, checked to compute element by element.
    step, inner = elementwise_update(optimizer, (owned, state.inner, base), signature, axis_name)
    # 4: the update's shards gathered; lossy: the rounded distance to the new master.
    leaves = signature.treedef.flatten_up_to(tree_lib.unwrap(step))
    master = optax.MaskedNode()
    if lossy:
      master = optax.apply_updates(base, step)
      sent = [m - c for m, c in zip(signature.pick(master), signature.pick(current))]
    else:
      sent = signature.pick(step)
    gathered = gather(sent, [signature.shapes[i] for i in signature.reduced], gather_dtype,
                      axis_name)
    for i, whole in zip(signature.reduced, gathered):
      leaves[i] = whole.astype(signature.dtypes[i])
    # 5: the update of the whole parameters, in the gradient's structure.
    return (tree_lib.like(updates, leaves),
            ShardedOptimizerState(exchange_state, inner, master, signature))

  return optax.GradientTransformation(init_fn, update_fn)


def sharded_clip_by_global_norm(max_norm: float, *,
                                axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` for a gradient sharded over the devices (``sharded_optimizer``'s
  optimizer): the norm of the whole gradient, from every device's shards.

  Each device sums the squares of its shards (their padding is zero), one 4-byte all-reduce sums
  those over the devices; then every shard is scaled as ``optax.clip_by_global_norm`` scales the
  whole gradient. Under ``jaxcomp.data_parallel`` (``shard_map`` types what differs between
  devices), a leaf the same on every device — ``fully_sharded``'s replicated leaves — counts once;
  under ``pmap`` every leaf counts as a shard. A gradient replicated whole (not sharded) would be
  counted W times: use optax's there.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> clipped_sgd = optax.chain(jaxcomp.sharded_clip_by_global_norm(1.0), optax.sgd(1.0))
    >>> tx = jaxcomp.sharded_optimizer(jaxcomp.allreduce(), clipped_sgd)
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: (x @ p).sum(), mesh, tx=tx)
    >>> params = jnp.zeros((64, 16))
    >>> new, _, _ = dp.step(params, dp.make_state(params), dp.shard(jnp.ones((16, 64))))
    >>> f"{float(jnp.linalg.norm(new - params)):.2f}"  # the whole step's norm, clipped to 1
    '1.00'

  Args:
    max_norm: the largest global norm the update may have.
    axis_name: the axis the gradient is sharded over.

  Returns:
    A stateless ``GradientTransformation``.

  Raises:
    ValueError: under ``jaxcomp.data_parallel``, the gradient is the same on every device (not
      sharded).
  """
  max_norm = validate.traceable(max_norm, lambda v: validate.number(v, "max_norm", 0,
                                                                     low_open=True))
  axis_name = axis.check_axis_name(axis_name)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

  def update_fn(updates, state, params=None):
    del params
    leaves = [x for x in jax.tree.leaves(updates) if tree_lib.is_reduced(x)]
    # A leaf the same on every device (fully_sharded's replicated leaves) counts once.
    typed = axis.vma_checked(axis_name)
    same = [typed and not set(names) & axis.varying_axes(x) for x in leaves]
    if leaves and all(same):
      raise ValueError(
          "sharded_clip_by_global_norm: the gradient is the same on every device along "
          f"{axis_name!r}, not sharded, and its squares would be counted once per device. Use "
          "optax.clip_by_global_norm in optax.chain(compressor, ...); this one belongs in "
          "jaxcomp.sharded_optimizer's optimizer")

    def squares(once):
      return sum((jnp.sum(jnp.square(x)) for x, s in zip(leaves, same) if s == once),
                 jnp.zeros([], jnp.float32))
    norm = jnp.sqrt(axis.psum(squares(False), axis_name) + squares(True))
    trigger = norm < max_norm
    clip = lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)
    return tree_lib.map_reduced(clip, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


# ----------------------------------------------------------- what the optimizer may do on a shard


def elementwise_update(optimizer: optax.GradientTransformation, shard_args: tuple,
                       signature: tree_lib.TreeSignature, axis_name) -> tuple:
  """``optimizer.update(*shard_args)``, checked to compute on each shard what it computes on the
  corresponding part of the whole leaves (the module docstring), from its program: traced once on
  the shards (read, then run), and once per optimizer and leaf shapes on the whole leaves.

  Raises:
    ValueError: the optimizer's program differs between shards and leaves (it depends on a leaf's
      shape), a reduction over a shard's elements reaches its outputs unsummed over the axis, or it
      communicates over the axis (naming what was found and the fix).
  """
  axes = frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))
  typed = axis.vma_checked(axis_name)
  shard_args = _strongly_typed(shard_args)  # a weakly typed scalar traces as its leaf does
  # What differs from device to device, per argument leaf: the leaves' program is traced alike.
  vmas = tuple(axis.varying_axes(x) & axes if typed else frozenset()
               for x in jax.tree.leaves(shard_args))
  outputs, on_shards = jaxprs.traced_once(optimizer.update, *shard_args)
  if axis.axis_size(axis_name) > 1:
    exchanged, drawn = [], []
    reductions = frozenset().union(*jaxprs.shard_local(
        on_shards.jaxpr, [frozenset()] * len(on_shards.jaxpr.invars), axes, exchanged, drawn,
        typed))
    if exchanged:
      raise ValueError(
          f"sharded_optimizer: the optimizer communicates over {axis_name!r} on the shards "
          f"themselves ({'; '.join(exchanged)}): a compressor inside it? The exchange is "
          "sharded_optimizer's first argument; pass the optimizer alone as the second")
    if drawn:
      raise ValueError(
          f"sharded_optimizer: the optimizer draws random numbers ({'; '.join(drawn)}): every "
          "device would draw the same ones for its shard, where the whole leaf draws independent "
          "ones (optax.add_noise). Use optax.chain(exchange, optimizer) without sharding")
    if reductions:
      raise ValueError(
          "sharded_optimizer: the optimizer reduces over the elements of a leaf, and would see "
          f"only this device's shard ({'; '.join(sorted(reductions))}). Sum such a reduction over "
          f"{axis_name!r} (jaxcomp.axis.psum): jaxcomp.sharded_clip_by_global_norm replaces "
          "optax.clip_by_global_norm; jaxcomp.skip_if_nonfinite(sharded_optimizer(...), n) "
          "replaces optax.apply_if_finite inside it; a per-leaf norm (LAMB, LARS) needs the whole "
          "leaf: use optax.chain(exchange, optimizer)")
  if jaxprs.program(on_shards.jaxpr) != _program_on_leaves(optimizer, signature, vmas):
    raise ValueError(
        "sharded_optimizer: the optimizer computes differently on a shard of a leaf than on the "
        "whole leaf: it decides by the leaves' shapes (Adafactor's factored moments, a mask on a "
        "dimension's size, a matrix method such as Muon), which a shard does not keep. Use an "
        "elementwise optimizer (SGD, Adam, AdamW, Lion, ...) or optax.chain(exchange, optimizer) "
        "without sharding")
  return outputs


def _strongly_typed(tree):
  """``tree`` with weakly typed arrays (``jnp.asarray(1.0)``) made strong: the program on them is
  then the one on their leaves' ``jax.ShapeDtypeStruct``."""
  return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype)
                      if getattr(x, "weak_type", False) else x, tree)


@functools.lru_cache(maxsize=256)
def _program_on_leaves(optimizer: optax.GradientTransformation,
                       signature: tree_lib.TreeSignature, vmas: tuple) -> tuple:
  """The primitives of ``optimizer.update`` on whole leaves of ``signature``, each argument leaf
  typed as the shards' (``vmas``, the axes along which it differs between devices); traced once per
  optimizer, leaf shapes and types."""
  whole = signature.unflatten([jax.ShapeDtypeStruct(s, d)
                               for s, d in zip(signature.shapes, signature.dtypes)])
  flat, treedef = jax.tree.flatten((whole, jax.eval_shape(optimizer.init, whole), whole))

  def update(*leaves):
    leaves = [axis.make_varying(x, tuple(sorted(v))) for x, v in zip(leaves, vmas)]
    return optimizer.update(*jax.tree.unflatten(treedef, leaves))

  return jaxprs.program(jax.make_jaxpr(update)(*flat).jaxpr)
