"""The fully sharded step (ZeRO-3, FSDP): ``jaxcomp.fully_sharded``; the gather and its compressed
VJP, and the numbered steps, are in ``jaxcomp._src.fsdp``.

Why not ``jaxcomp.data_parallel(loss_fn, mesh, tx=...)``: there the loss function receives the
whole parameters, so its forward pass cannot gather a layer at a time, and ``tx`` sees the gradient
only after the whole backward pass. ``fully_sharded`` builds its step with ``data_parallel``'s
per-device-step form (the same ``shard_map``, placement and checks) around a per-device step whose
loss function receives ``Layer``\\ s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomp._src import axis, fsdp, interface, shards, spmd, validate, zero
from jaxcomp._src import data_parallel as data_parallel_lib
from jaxcomp._src import tree as tree_lib
from jaxcomp._src.fsdp import replicated


class FullyShardedState(NamedTuple):
  """State of ``fully_sharded``'s step: everything is per device (stacked along a leading W axis).

  Attributes:
    params: the parameters' structure; each sharded leaf is this device's shard
      (``shards.Layout.shape``), each replicated one (``replicated``) the whole leaf.
    inner: the optimizer's state of ``params``.
    exchange: one gradient exchange state per layer (None for a layer with nothing sharded).
    signature: the whole parameters' structure, shapes and dtypes (static).
  """
  params: Any
  inner: Any
  exchange: tuple
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("params", "inner", "exchange")  # see jaxcomp.sharding


def _step(loss_fn: Callable, exchange, optimizer, gather_dtype, depth: int, axis_name,
          state: FullyShardedState, *batch) -> tuple:
  """The per-device step: ``(new state, loss)``."""
  signature = state.signature
  # 1–4: the loss of the layers' view; gather_layer gathers and its VJP scatters.
  layers = lambda: fsdp.view(signature, state.params, state.exchange, depth,  # noqa: E731
                             gather_dtype, exchange, axis_name)
  local_loss = lambda v: loss_fn(v, *batch)  # noqa: E731
  gathered = fsdp.gathers_per_layer(local_loss, layers())  # 7: once per layer, or refused
  loss, view_grads = jax.value_and_grad(local_loss)(layers())
  grads, exchanges = fsdp.unview(signature, view_grads, depth, state.exchange, gathered)
  # 5: the optimizer on the shards; no gather of the update.
  zero.check_elementwise(optimizer, (grads, state.inner, state.params), signature, axis_name)
  updates, inner = optimizer.update(grads, state.inner, state.params)
  params = optax.apply_updates(state.params, updates)
  return FullyShardedState(params, inner, exchanges, signature), loss


def _other_spec(x, axis_name) -> PartitionSpec:
  """How the array ``x`` is split over the mesh axes other than ``axis_name`` (not at all for a
  host array)."""
  spec = getattr(getattr(x, "sharding", None), "spec", None)
  return spmd.without(spec, spmd.axes(axis_name)) if spec is not None else PartitionSpec()


def _is_spec(node) -> bool:
  return isinstance(node, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class FullySharded:
  """A jitted fully sharded step and how to make, place and read what it takes; made by
  ``jaxcomp.fully_sharded``.

  Attributes:
    step: ``step(state, *batch) -> (state, loss)``: the jitted global step; ``loss`` has one entry
      per device.
    mesh: the mesh, as given.
    axis_name: the data axis the parameters are sharded over.
    layer_depth: the depth of the layers in the parameters' pytree.
    exchange, optimizer, gather_dtype: as given.
  """
  step: Callable
  mesh: Mesh
  axis_name: Any
  layer_depth: int
  exchange: Any
  optimizer: Any
  gather_dtype: Optional[str]
  _parallel: Any

  @property
  def world_size(self) -> int:
    """W, the number of devices along ``axis_name``."""
    return self._parallel.world_size

  def _layout(self) -> shards.Layout:
    """The shards' layout on this mesh: by leaf where another axis may shard the leaves."""
    others = [size for name, size in self.mesh.shape.items()
              if name not in spmd.axes(self.axis_name)]
    return shards.Layout(self.world_size, any(size > 1 for size in others))

  def shard(self, batch):
    """``batch`` placed with its leading axis split over ``axis_name``."""
    return self._parallel.shard(batch)

  def make_state(self, params) -> FullyShardedState:
    """The step's state from the whole parameters (as made on one device): each device's shards
    of them, the optimizer's state of those and the exchange's state, placed on the mesh.

    A leaf split over other mesh axes (tensor parallelism) keeps that split: its shards, and the
    optimizer's state of them, are split over those axes too.

    Raises:
      TypeError: a leaf of ``params`` is not floating point.
    """
    signature = tree_lib.TreeSignature.of(params)
    for path, dtype in zip(signature.paths, signature.dtypes):
      if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"params: leaf {path} is {dtype}; fully_sharded shards floating-point "
                        "parameters only (keep other leaves out of the parameters)")
    world, cut = self.world_size, self._layout()
    indices = fsdp.layers_of(signature, self.layer_depth)[0]
    stack = lambda x: jnp.broadcast_to(x, (world,) + jnp.shape(x))

    def make(params):
      leaves = [lax.convert_element_type(x, jnp.dtype(d))  # not weakly typed, as in the step
                for x, d in zip(signature.treedef.flatten_up_to(params), signature.dtypes)]
      owned = signature.unflatten([stack(x) if replicated(x.shape, world) else cut.split(x)
                                   for x in leaves])
      exchanges = []
      for idx in indices:
        sharded = [leaves[i] for i in idx if not replicated(leaves[i].shape, world)]
        exchanges.append(jax.tree.map(stack, self.exchange.scatter_init(sharded)) if sharded
                         else None)
      return FullyShardedState(owned, jax.vmap(self.optimizer.init)(owned), tuple(exchanges),
                               signature)

    # Each shard keeps its leaf's split over the other mesh axes (the by-leaf layout keeps every
    # axis in place), and so does the optimizer's state of it.
    def stacked(spec):
      return NamedSharding(self.mesh, PartitionSpec(self.axis_name, *spec))
    specs = signature.unflatten([_other_spec(x, self.axis_name)
                                 for x in signature.treedef.flatten_up_to(params)])
    shape = jax.eval_shape(make, params)
    shardings = FullyShardedState(
        jax.tree.map(stacked, specs, is_leaf=_is_spec),
        optax.tree_utils.tree_map_params(
            self.optimizer, lambda _, spec: stacked(spec), shape.inner, specs,
            transform_non_params=lambda _: stacked(()), is_leaf=_is_spec),
        jax.tree.map(lambda _: stacked(()), shape.exchange), signature)
    with jax.set_mesh(self.mesh):
      return jax.jit(make, out_shardings=shardings)(params)

  def gather_params(self, state: FullyShardedState):
    """The whole parameters from the state's shards, replicated over the data axis (split over
    other mesh axes as the leaves were): for evaluation and export (a leaf split over no other
    axis takes all its values on every device)."""
    signature, world, cut = state.signature, self.world_size, self._layout()

    # Each leaf whole over the data axis, split over the others as its shards are.
    specs = [_other_spec(x, self.axis_name)[1:]
             for x in signature.treedef.flatten_up_to(state.params)]

    def whole(params):
      leaves = [spmd.constrain(x, NamedSharding(self.mesh, PartitionSpec(None, *spec)))
                for x, spec in zip(signature.treedef.flatten_up_to(params), specs)]
      return signature.unflatten([
          x[0] if replicated(shape, world) else cut.join(x, shape)
          for x, shape in zip(leaves, signature.shapes)])

    shardings = signature.unflatten([NamedSharding(self.mesh, PartitionSpec(*spec))
                                     for spec in specs])
    with jax.set_mesh(self.mesh):
      return jax.jit(whole, out_shardings=shardings)(state.params)


def fully_sharded(loss_fn: Callable, mesh: Mesh, exchange, optimizer, *,
                  gather_dtype: Optional[str] = None, layer_depth: int = 1,
                  axis_name: axis.AxisName = "batch") -> FullySharded:
  """Fully sharded data parallelism (ZeRO-3, FSDP): parameters stored 1/W per device, gathered a
  layer at a time in ``gather_dtype``, each layer's gradient reduce-scattered through ``exchange``.

  The loss function receives the parameters with each subtree at ``layer_depth`` as a ``Layer``
  and calls ``jaxcomp.gather_layer`` where a layer is used (the module docstring numbers the
  steps)::

    def loss_fn(params, x, y):
      for name in ("dense0", "dense1"):
        layer = jaxcomp.gather_layer(params[name])   # {"w": ..., "b": ...}, whole
        x = jnp.tanh(x @ layer["w"] + layer["b"])
      return jnp.mean((x - y) ** 2)

    fs = jaxcomp.fully_sharded(loss_fn, mesh, jaxcomp.quantized(8), optax.adam(1e-3),
                               gather_dtype="int8")
    state = fs.make_state(params)                    # each device's shards
    state, loss = fs.step(state, *fs.shard((x, y)))
    params = fs.gather_params(state)                 # whole, for evaluation and export

  ``jaxcomp.call_layer(fn, params[name], x)`` in place of ``gather_layer`` holds one layer's
  gathered parameters at a time (gathered again in the backward pass). Leaves that are 0-d or
  have fewer values than W stay whole on every device (``replicated``), and their gradient is the
  exact float32 mean.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> loss_fn = lambda p, x: ((x @ jaxcomp.gather_layer(p["dense"])["w"]) ** 2).mean()
    >>> fs = jaxcomp.fully_sharded(loss_fn, mesh, jaxcomp.allreduce(), optax.sgd(0.1))
    >>> state = fs.make_state({"dense": {"w": jnp.ones((64, 16))}})
    >>> state.params["dense"]["w"].shape  # 8 devices, 128 values each
    (8, 1, 128)
    >>> state, loss = fs.step(state, fs.shard(jnp.ones((16, 64))))
    >>> fs.gather_params(state)["dense"]["w"].shape
    (64, 16)

  Args:
    loss_fn: ``loss_fn(params, *batch) -> loss`` on one device's shard of the batch; ``params``
      holds a ``Layer`` for each layer, which ``gather_layer`` makes whole.
    mesh: the device mesh.
    exchange: the gradient exchange, a jaxcomp compressor: ``allreduce()`` (exact),
      ``bf16_compress()`` or ``quantized(8)`` (int8 codes with error feedback, qgZ) reduce-scatter
      natively; the others send their whole mean, of which each device keeps its shard.
    optimizer: an elementwise optax optimizer (SGD, Adam, AdamW, ...), run on the shards.
    gather_dtype: how the parameters travel to the forward pass: None (exactly), ``"bfloat16"``,
      ``"int8"`` or ``"float8_e4m3fn"`` (codes with a float32 scale per 256 values). The stored
      shards stay exact.
    layer_depth: the depth of a layer in the parameters' pytree: 1, each entry of the top-level
      container (``params["dense0"]``); 2, each entry of those (``params["blocks"][3]``).
    axis_name: the mesh axis the batch and the parameters are split over: the exchange's.

  Returns:
    A ``FullySharded``: ``step``, ``make_state``, ``shard``, ``gather_params``.

  Raises:
    TypeError: ``mesh`` is not a ``Mesh``, ``exchange`` not a jaxcomp compressor, ``optimizer``
      not an optax transformation.
    ValueError: ``gather_dtype`` is not one above, ``layer_depth`` below 1, or ``axis_name`` not
      an axis of ``mesh`` or not the exchange's.

  References:
    Rajbhandari et al., "ZeRO", SC 2020 (stage 3); Zhao et al., "PyTorch FSDP", VLDB 2023; Wang et
    al., "ZeRO++", 2023 (qwZ, qgZ).
  """
  validate.function(loss_fn, "loss_fn", "loss_fn(params, *batch)")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)); got "
                    f"{type(mesh).__name__}")
  exchange = interface.mean(exchange, "exchange", "jaxcomp.bf16_compress()")
  optimizer = validate.transformation(optimizer, "optimizer", "optax.adam(1e-3)")
  gather_dtype = validate.choice(gather_dtype, "gather_dtype", fsdp.GATHER_DTYPES)
  layer_depth = validate.integer(layer_depth, "layer_depth", 1)
  axis_name = axis.check_axis_name(axis_name)
  if exchange.axis_name != axis_name:
    raise ValueError(f"axis_name: the exchange averages over {exchange.axis_name!r}, the "
                     f"parameters would be sharded over {axis_name!r}; give both the same axis")
  step = functools.partial(_step, loss_fn, exchange, optimizer, gather_dtype, layer_depth,
                           axis_name)
  parallel = data_parallel_lib.data_parallel(step, mesh, axis_name=axis_name)
  return FullySharded(parallel.step, mesh, axis_name, layer_depth, exchange, optimizer,
                      gather_dtype, parallel)
