"""Fully sharded data parallelism (ZeRO-3, FSDP) with compressed exchanges: gather a layer, scatter
its gradient.

``jaxcomp.sharded_optimizer`` (ZeRO-1/2) shards the optimizer state but every device still holds
the whole parameters. Fully sharded, each device stores 1/W of every parameter too (the layout of
``shards.py``, the same as ``sharded_optimizer``'s): a layer's parameters are all-gathered just
before the layer runs, and the backward pass reduce-scatters that layer's gradient. Here both
travel through jaxcomp's codecs. The steps, per device (the ``# n:`` comments below):

1. the loss function receives the parameters with each layer (a subtree at ``layer_depth`` of the
   parameters' pytree) as a ``Layer``: this device's shards and its gradient exchange's state;
2. ``gather_layer(layer)`` all-gathers the layer's shards in ``gather_dtype``: exactly (None), in
   bfloat16, or as int8 / float8_e4m3fn codes with a float32 scale per 256 values (ZeRO++'s qwZ,
   ``jaxcomp.quantized``'s block codec through the exchange's gather: ``zero.gather``, the sharded
   optimizer's), and casts them back to the parameters' dtype: the layer computes with the whole
   (dequantized) parameters, the stored shards stay exact (they are the master copy);
3. its VJP (``jax.custom_vjp``) reduce-scatters the layer's gradient through the jaxcomp exchange
   (its declared ``scatter``: ``allreduce`` and ``bf16_compress`` as a ``psum_scatter`` in their
   wire dtype, ``quantized(8)`` as the all-to-all of int8 codes with the sender's error feedback,
   ZeRO++'s qgZ): this device receives its shard of the layer's mean gradient. The exchange's new
   state rides back as the cotangent of its old state (as Flax's float8 training carries its
   scales), integer leaves bit-cast to float32 on the way, so error feedback is kept in
   ``FullyShardedState``. Each layer's gather and scatter are labelled for ``comm_report``
   (``fsdp.gather.<layer>``, ``fsdp.scatter.<layer>``);
4. leaves that cannot be sharded — 0-d leaves and leaves of fewer values than W — stay whole on
   every device (replicated), are not gathered, and their gradient is the exact mean
   (``axis.mean``, float32), taken after the backward pass and typed the same on every device;
5. the optimizer runs on the shards (an elementwise one: ``zero.elementwise_update`` refuses the
   others while the step is traced) and the shards move; nothing is gathered after the update: the
   next forward pass gathers;
6. with ``call_layer(fn, layer, x)`` instead of ``gather_layer``, the order is fixed by data: the
   gather waits for ``x``, the backward pass's re-gather for the gradient of ``fn``'s output, and
   the earlier layers' backward passes for the layer's scatter (``_after``), so the gathered
   parameters and whole gradients of about one layer are alive at a time;
7. each layer is gathered, and its gradient scattered, once per step: a second ``gather_layer``
   of it in the same trace returns the first one's result (tied weights: autodiff sums the uses'
   gradients before the one scatter). Before the step is differentiated, its forward program is
   read (``gathers_per_layer``): a layer gathered more than once (where JAX traced the gathers
   apart: ``jax.checkpoint``, a loop's body, ``call_layer``), or in some branches of a conditional
   only, is refused, naming it; each scatter would advance the exchange's state, and the backward
   pass would add the new states up. A layer the step does not gather keeps its exchange's state.

Bytes per device per step (ring): (W−1)/W·N values in the gather dtype and (W−1)/W·N in the
exchange's wire dtype, each layer's in its own collectives (plus the scales of the 8-bit codes: 4
bytes per 256 values). Gathered again in the backward pass (``call_layer``, or under
``jax.checkpoint``), the gather is paid twice. Memory per device: N/W parameters (plus at most
W − 1 padding values per leaf), the optimizer's state of them, and the exchange's state
(``quantized``'s error feedback is the whole gradient of a layer, float32, per device:
``quantized(8, error_feedback=False)`` keeps none).

The step builder, ``jaxcomp.fully_sharded``, is in ``jaxcomp._src.fsdp_step``.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020 (https://arxiv.org/abs/1910.02054): stage 3, the parameters partitioned.
  Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023
  (https://arxiv.org/abs/2304.11277): per-unit all-gather and reduce-scatter.
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", 2023
  (https://arxiv.org/abs/2306.10209): qwZ (quantized weight all-gather) and qgZ (quantized gradient
  reduce-scatter).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

import jax.extend

from jaxcomp._src import axis, jaxprs, phases, spmd, zero
from jaxcomp._src import tree as tree_lib

GATHER_DTYPES = (None, "bfloat16", "int8", "float8_e4m3fn")


def replicated(shape: tuple, world: int) -> bool:
  """Whether a leaf of ``shape`` stays whole on every device over ``world`` devices: 0-d, or fewer
  values than devices."""
  return not shape or math.prod(shape) < world


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _LayerSpec:
  """What a ``Layer``'s gather needs to know (static): its name (its keys joined by dots), its
  subtree's structure, the whole leaves' shapes and dtypes, which are replicated, how to gather and
  scatter, and the exchange state's structure and dtypes."""
  name: str
  treedef: Any
  shapes: tuple
  dtypes: tuple
  replicated: tuple
  gather_dtype: Optional[str]
  exchange: Any
  axis_name: Any
  state_treedef: Any
  state_dtypes: tuple

  @property
  def sharded(self) -> list:
    return [i for i, r in enumerate(self.replicated) if not r]


class _Gathers:
  """7: the gathers of one trace of the loss function, by layer name: where (the trace), of what
  (the shards and carriers) and the whole leaves they made. Compared by identity: a pytree's
  static part, it tells the layers of one trace from another's."""

  def __init__(self):
    self.made = {}

  def whole(self, layer: "Layer") -> tuple:
    """7: the layer's whole leaves: an earlier gather's of it in this trace, else a new one."""
    here = jax.extend.core.get_opaque_trace_state(convention="jaxcomp")
    inputs = layer.shards + layer.carriers
    made = self.made.get(layer.spec.name)
    if made is not None and made[0] == here and all(a is b for a, b in zip(made[1], inputs)):
      return made[2]
    whole = _gather(layer.spec, layer.shards, layer.carriers)
    self.made[layer.spec.name] = (here, inputs, whole)
    return whole


@jax.tree_util.register_pytree_node_class
class Layer:
  """One layer's parameters as the loss function receives them: this device's shards (replicated
  leaves whole) and its gradient exchange's state. ``gather_layer`` makes the whole parameters.

  Attributes:
    spec: static: the layer's structure and how it travels.
    shards: a tuple, one array per leaf of the layer.
    carriers: the exchange state's leaves as floating-point arrays (``_carry``).
    gathers: static: the trace's record of gathers (``_Gathers``), shared by its layers.
  """

  def __init__(self, spec: _LayerSpec, shards_: tuple, carriers: tuple, gathers=None):
    self.spec, self.shards, self.carriers = spec, shards_, carriers
    self.gathers = _Gathers() if gathers is None else gathers

  def tree_flatten(self):
    return (self.shards, self.carriers), (self.spec, self.gathers)

  @classmethod
  def tree_unflatten(cls, static, children):
    return cls(static[0], *children, static[1])

  def __repr__(self) -> str:
    return f"jaxcomp.fsdp.Layer({jax.tree.unflatten(self.spec.treedef, self.spec.shapes)})"

  def _not_gathered(self, *_):
    raise TypeError(f"params[{self.spec.name!r}] is a fully sharded layer (this device's shards): "
                    "use jaxcomp.gather_layer(...) of it, or of a tree above it, for its whole "
                    "parameters (a replicated 0-d leaf at the layers' depth is a layer too)")

  # Indexing or computing with a layer instead of its gathered parameters: say so.
  __getitem__ = __array__ = __neg__ = _not_gathered
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _not_gathered
  __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = __rpow__ = _not_gathered


def _carry(x: jax.Array) -> jax.Array:
  """A state leaf as a cotangent can carry it: floating point as it is, 32-bit integers and bools
  bit-cast to float32 (exact: no arithmetic touches a carrier)."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return x
  if x.dtype == jnp.bool_:
    return x.astype(jnp.float32)
  if jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize == 4:
    return lax.bitcast_convert_type(x, jnp.float32)
  raise TypeError(f"exchange: its state holds a {x.dtype} leaf, which fully_sharded cannot carry "
                  "through the backward pass; use allreduce, bf16_compress or quantized")


def _uncarry(c: jax.Array, dtype) -> jax.Array:
  """The inverse of ``_carry``."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return c
  if dtype == jnp.bool_:
    return c != 0
  return lax.bitcast_convert_type(c, dtype)


def _varying(x, axis_name):
  """``x`` typed varying along the axis where values are typed (``shard_map(check_vma=True)``),
  as the per-device inputs the backward pass returns cotangents for are."""
  return axis.make_varying(x, spmd.axes(axis.bound_axis(axis_name))) if axis.vma_checked(
      axis_name) else x


def _whole(spec: _LayerSpec, shards_: tuple) -> tuple:
  """2 and 4: the layer's whole leaves from this device's shards."""
  whole = list(shards_)  # 4: replicated leaves as they are
  if spec.sharded:
    # 2: the sharded leaves gathered in gather_dtype, cast back to their dtype.
    gathered = phases.run(phases.Phase(f"fsdp.gather.{spec.name}", 1.0), zero.gather,
                          [shards_[i] for i in spec.sharded],
                          [spec.shapes[i] for i in spec.sharded], spec.gather_dtype,
                          spec.axis_name)
    for i, x in zip(spec.sharded, gathered):  # varying: no implicit all-reduce of the gradient
      whole[i] = _varying(x.astype(spec.dtypes[i]), spec.axis_name)
  return tuple(whole)


def _scatter(spec: _LayerSpec, carriers: tuple, cotangents: tuple) -> tuple:
  """3: this device's shards of the layer's mean gradient, and the exchange's new state as
  carriers: ``(grads, carriers)``; 4: a replicated leaf's gradient as it is (``unview`` takes
  its mean)."""
  grads = list(cotangents)  # 4: a replicated leaf's own gradient; unview averages it
  if spec.sharded:
    # 3: the reduce-scatter through the exchange, its new state carried back.
    state = jax.tree.unflatten(spec.state_treedef,
                               [_uncarry(c, d) for c, d in zip(carriers, spec.state_dtypes)])
    owned, state = phases.run(phases.Phase(f"fsdp.scatter.{spec.name}", 1.0),
                              spec.exchange.scatter, [cotangents[i] for i in spec.sharded], state)
    for i, x in zip(spec.sharded, jax.tree.leaves(owned)):
      grads[i] = _varying(x.astype(spec.dtypes[i]), spec.axis_name)
    carriers = tuple(_varying(_carry(x), spec.axis_name) for x in jax.tree.leaves(state))
  return tuple(grads), carriers


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(spec: _LayerSpec, shards_: tuple, carriers: tuple) -> tuple:
  return _whole(spec, shards_)


def _gather_fwd(spec: _LayerSpec, shards_: tuple, carriers: tuple):
  return _whole(spec, shards_), carriers


_gather.defvjp(_gather_fwd, _scatter)


def _after(tree, dependency):
  """6: ``tree`` as values computed from ``dependency`` (a pytree): each floating-point array plus
  0·(the first value of ``dependency``), so that the compiler computes them only once that value
  exists, and cannot merge two gathers of a layer that wait for different values. XLA folds
  neither 0·v (NaN where v is not finite, which makes the layer's output and gradient NaN as they
  would be) nor the sum; ``lax.optimization_barrier`` did not hold: XLA:CPU removes it before it
  merges equal instructions."""
  first = next((x for x in jax.tree.leaves(dependency) if tree_lib.is_float(x) and jnp.size(x)),
               None)
  if first is None:
    return tree
  naught = jnp.ravel(first)[0] * 0  # 0, or NaN where that value is not finite
  return jax.tree.map(lambda x: x + naught.astype(x.dtype) if tree_lib.is_float(x) else x, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _call(fn, spec: _LayerSpec, shards_: tuple, carriers: tuple, args: tuple):
  return _call_fwd(fn, spec, shards_, carriers, args)[0]


def _call_fwd(fn, spec: _LayerSpec, shards_: tuple, carriers: tuple, args: tuple):
  # 6: gathered once the layer's inputs exist; nothing gathered kept for the backward pass.
  params = jax.tree.unflatten(spec.treedef, _whole(spec, _after(shards_, args)))
  return fn(params, *args), (shards_, carriers, args)


def _call_bwd(fn, spec: _LayerSpec, residuals: tuple, cotangent):
  shards_, carriers, args = residuals
  # 6: gathered again once the output's gradient exists, then the layer's own backward pass.
  _, pullback = jax.vjp(lambda whole, a: fn(jax.tree.unflatten(spec.treedef, whole), *a),
                        _whole(spec, _after(shards_, cotangent)), args)
  whole_grads, arg_grads = pullback(cotangent)
  grads, carriers = _scatter(spec, carriers, whole_grads)
  # 6: the earlier layers' backward passes wait for this scatter, so its whole gradient is freed.
  return grads, carriers, _after(arg_grads, grads)


_call.defvjp(_call_fwd, _call_bwd)


def call_layer(fn: Callable, layer, *args):
  """``fn(gather_layer(layer), *args)``, holding the layer's whole parameters only while it runs:
  FSDP's per-layer gather, free and re-gather (the module docstring's 6).

  The forward pass gathers the layer once ``args`` exist and keeps nothing gathered; the backward
  pass gathers it again once the gradient of ``fn``'s output exists, runs ``fn``'s backward pass
  (recomputing its activations, as ``jax.checkpoint`` does) and reduce-scatters the gradient
  before the earlier layers' backward passes start. So at most about one layer's gathered
  parameters and one layer's whole gradient are alive at a time. ``gather_layer`` under
  ``jax.checkpoint`` leaves the compiler free to run every gather first, and XLA:CPU does and
  keeps them all. The price is order: a layer's collectives do not overlap another layer's
  computation.

  Example:
    >>> import jax.numpy as jnp, jaxcomp
    >>> dense = lambda p, x: x @ p["w"]
    >>> jaxcomp.call_layer(dense, {"w": jnp.eye(2)}, jnp.ones(2))  # unsharded: fn(layer, x)
    Array([1., 1.], dtype=float32)

  Args:
    fn: ``fn(params, *args)``: the layer's computation on its whole parameters. Whatever needs a
      gradient, beside the parameters, must come in ``args`` (a value ``fn`` closes over gets
      none).
    layer: a ``Layer`` (one entry of ``fully_sharded``'s parameters at its ``layer_depth``), or
      parameters without ``Layer``\\ s, which ``fn`` receives as they are.
    *args: ``fn``'s other inputs (pytrees of arrays).

  Returns:
    ``fn``'s output.

  Raises:
    TypeError: ``layer`` holds ``Layer``\\ s but is not one.
  """
  if not _is_layer(layer):
    if any(_is_layer(x) for x in jax.tree.leaves(layer, is_leaf=_is_layer)):
      raise TypeError("call_layer: layer must be one Layer (an entry of fully_sharded's "
                      "parameters at its layer_depth) or parameters without Layers; got a tree "
                      "holding Layers: call it once per layer")
    return fn(layer, *args)
  return _call(fn, layer.spec, layer.shards, layer.carriers, args)


def _is_layer(node) -> bool:
  return isinstance(node, Layer)


def gather_layer(tree):
  """The whole parameters of every ``Layer`` in ``tree``, all-gathered in the layer's gather dtype;
  in the backward pass, each layer's gradient is reduce-scattered through its exchange.

  Call it in the loss function given to ``fully_sharded``, where a layer's parameters are used.
  A second call for the same layer in the same trace (tied weights: an embedding and the output
  layer) returns the first call's result: one gather, and one scatter of the summed gradient.
  Where JAX traces a second gather apart (inside ``jax.checkpoint`` or a loop's body, beside a
  ``call_layer`` of the layer), or in some branches of a conditional only, the step is refused:
  gather once and pass the result in. A tree without ``Layer``\\ s is returned as it is, so the
  same model code runs unsharded. Under
  ``jax.checkpoint`` around the layer (gather and compute), the forward pass keeps no gathered
  parameters for the backward pass, which gathers them again.

  Example:
    >>> import jax.numpy as jnp, jaxcomp
    >>> jaxcomp.gather_layer({"w": jnp.ones(3)})  # unsharded: as it is
    {'w': Array([1., 1., 1.], dtype=float32)}

  Args:
    tree: a pytree that may hold ``Layer``\\ s (the parameters ``fully_sharded``'s loss function
      receives, or a part of them).

  Returns:
    ``tree`` with each ``Layer`` replaced by its subtree of whole parameters.
  """
  def whole(node):
    if not _is_layer(node):
      return node
    return jax.tree.unflatten(node.spec.treedef, node.gathers.whole(node))
  return jax.tree.map(whole, tree, is_leaf=_is_layer)


def _subtrees(tree, depth: int) -> list:
  """The nodes of ``tree`` at ``depth`` (a leaf above it is one), in the order of its leaves."""
  children = jax.tree.flatten(tree, is_leaf=lambda node: node is not tree)[0]
  if depth == 0 or children == [tree]:
    return [tree]
  return [node for child in children for node in _subtrees(child, depth - 1)]


def layers_of(signature: tree_lib.TreeSignature, depth: int) -> tuple:
  """The layers: ``(indices, treedefs, names, above)``: each layer's leaf indices (of
  ``signature``), its subtree's structure, its name (its keys joined by dots) and the treedef above
  the layers (whose leaves they are)."""
  index_tree = signature.unflatten(range(len(signature.shapes)))
  nodes = _subtrees(index_tree, depth)
  ids = {id(node) for node in nodes}
  is_layer = lambda node: id(node) in ids  # noqa: E731
  with_paths = jax.tree_util.tree_flatten_with_path(index_tree, is_leaf=is_layer)[0]
  paths = [path for path, _ in with_paths]
  names = [jax.tree_util.keystr(path, simple=True, separator=".") or "params" for path in paths]
  return ([jax.tree.leaves(node) for node in nodes], [jax.tree.structure(node) for node in nodes],
          names, jax.tree.structure(index_tree, is_leaf=is_layer))


def view(signature: tree_lib.TreeSignature, params, exchanges: tuple, depth: int, gather_dtype,
         exchange, axis_name):
  """1: the parameters as the loss function receives them, a ``Layer`` per layer: ``params``
  (the structure of ``signature``: shards, replicated leaves whole) and each layer's exchange
  state."""
  world = axis.axis_size(axis_name)
  flat = signature.treedef.flatten_up_to(params)
  indices, treedefs, names, above = layers_of(signature, depth)
  layers, gathers = [], _Gathers()
  for idx, treedef, name, ex in zip(indices, treedefs, names, exchanges):
    leaves = jax.tree.leaves(ex)
    spec = _LayerSpec(name, treedef, tuple(signature.shapes[i] for i in idx),
                      tuple(signature.dtypes[i] for i in idx),
                      tuple(replicated(signature.shapes[i], world) for i in idx),
                      gather_dtype, exchange, axis_name, jax.tree.structure(ex),
                      tuple(x.dtype.name for x in leaves))
    layers.append(Layer(spec, tuple(flat[i] for i in idx), tuple(_carry(x) for x in leaves),
                        gathers))
  return above.unflatten(layers)


def unview(signature: tree_lib.TreeSignature, view_grads, depth: int, old: tuple,
           gathered: dict) -> tuple:
  """The gradient of ``view``'s result: ``(grads, exchanges)``, the gradient shards (and the
  replicated leaves' mean gradients, 4) in the parameters' structure and each layer's new exchange
  state (3), or its ``old`` one where the step did not gather it (``gathered``, 7)."""
  grads = [None] * len(signature.shapes)
  exchanges = []
  for idx, layer, before in zip(layers_of(signature, depth)[0],
                                jax.tree.leaves(view_grads, is_leaf=_is_layer), old):
    for i, g, r in zip(idx, layer.shards, layer.spec.replicated):
      # 4: a replicated leaf's exact mean, the same on every device (typed so: the optimizer's
      # sharded_clip_by_global_norm counts it once).
      grads[i] = phases.run(phases.Phase(f"fsdp.mean.{layer.spec.name}", 1.0), axis.mean, g,
                            layer.spec.axis_name) if r else g
    if not gathered.get(layer.spec.name):  # 7: not gathered: no scatter, the state as it was
      exchanges.append(before)
      continue
    exchanges.append(jax.tree.unflatten(layer.spec.state_treedef, [
        _uncarry(c, d) for c, d in zip(layer.carriers, layer.spec.state_dtypes)]))
  return signature.unflatten(grads), tuple(exchanges)


def _gathered_layer(jaxpr, labels: dict) -> Optional[str]:
  """The layer whose gather a custom rule's ``jaxpr`` runs (its label, ``phases.run``), if any;
  custom rules inside it are gathers of their own."""
  for eqn in jaxpr.eqns:
    stack = str(eqn.source_info.name_stack)
    name = next((n for n, label in labels.items() if label in stack), None)
    if name is None and eqn.primitive.name != "custom_vjp_call":
      name = next(filter(None, (_gathered_layer(s, labels) for s in jaxprs.subjaxprs(eqn))), None)
    if name is not None:
      return name
  return None


def _count(jaxpr, labels: dict) -> dict:
  """7: how many times ``jaxpr`` runs each layer's gather, by name: a loop's body its trip count
  of times (a ``while`` loop's: ``inf``), a conditional's branches as they agree (``nan`` where
  they do not)."""
  counts: dict = {}

  def add(found: dict, times=1):
    for name, count in found.items():
      counts[name] = counts.get(name, 0) + (count * times if count else 0)

  for eqn in jaxpr.eqns:
    subs, kind = jaxprs.subjaxprs(eqn), eqn.primitive.name
    name = _gathered_layer(subs[0], labels) if kind == "custom_vjp_call" and subs else None
    if name is not None:
      add({name: 1})
    elif kind == "cond":
      branches = [_count(s, labels) for s in subs]
      for n in set().union(*branches):
        times = {b.get(n, 0) for b in branches}
        add({n: times.pop() if len(times) == 1 else math.nan})
    else:
      times = eqn.params["length"] if kind == "scan" else math.inf if kind == "while" else 1
      for sub in subs:
        add(_count(sub, labels), times)
  return counts


def gathers_per_layer(loss: Callable, layers) -> dict:
  """7: whether one run of ``loss(layers)`` gathers each layer, read from its forward program
  (``jax.make_jaxpr``: the loss is traced once more), and a refusal where it would gather one
  more than once.

  Args:
    loss: the loss function of ``view``'s result.
    layers: ``view``'s result (of its own: its record of gathers is the trace's).

  Returns:
    ``{layer name: gathered once}`` (False: not gathered).

  Raises:
    ValueError: a layer is gathered more than once, or in some branches of a conditional and not
      in others (naming it and the fix).
  """
  names = [layer.spec.name for layer in jax.tree.leaves(layers, is_leaf=_is_layer)]
  labels = {n: phases.label(phases.Phase(f"fsdp.gather.{n}", 1.0)) for n in names}
  counts = _count(jax.make_jaxpr(loss)(layers).jaxpr, labels)
  for name in names:
    count = counts.get(name, 0)
    if count == 0 or count == 1:
      continue
    why = ("in some branches of a conditional and not in others in one step: its exchange's "
           "state would be lost on the steps of the others" if math.isnan(count) else
           f"{'in a while loop' if math.isinf(count) else f'{count:g} times'} in one step, "
           "traced apart (jax.checkpoint, a loop's body, call_layer): each gather would scatter "
           "its gradient and advance its exchange's state")
    raise ValueError(f"gather_layer: params[{name!r}] is gathered {why}. Gather it once where the "
                     f"step begins, whole = jaxcomp.gather_layer(params[{name!r}]), and pass "
                     "whole in")
  return {name: counts.get(name, 0) == 1 for name in names}
