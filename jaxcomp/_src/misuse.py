"""Misuse found from the program: the hazards of wrapping a cross-device mean, and
``jaxcomp.check``.

A jaxcomp transformation is a cross-device mean: every device must run its collectives, in the
same order, on every step, and every leaf the step returns as one replicated value must have been
averaged. Three hazards break that, whoever wrote the wrapper that causes them (optax, Flax, the
user):

1. **a collective under a decision taken on each device alone**: ``optax.apply_if_finite`` around
   a compressor, ``optax.MultiSteps`` with a ``should_skip_update_fn``, a ``lax.cond`` of the
   user's on a value computed from the batch. The device that decides otherwise skips the
   collective the others wait in, and the job hangs. Found in the traced step: a conditional or a
   loop whose predicate differs from device to device along an axis that a collective inside it
   runs over (``jaxprs.varying``);
2. **a leaf the mean must cover that reaches no collective** (``optax.masked`` around a
   compressor): it comes out of the step different on each device while the step returns it as
   one value, and the replicas drift apart. Found from what differs between devices at the
   step's outputs (``shard_map(check_vma=True)``'s types under ``jaxcomp.data_parallel``; the
   same propagation from the values given to ``check`` for a ``pmap`` step);
3. **k times the traffic under ``optax.MultiSteps``**, which runs the inner update, and its
   collectives, on every micro-step (a warning: ``jaxcomp.accumulate`` gives the same update), and
   an optimizer chained after a whole optimizer (``jaxcomp.onebit_adam``, ``dion``, ``demo``,
   ``diloco``, ...), which would take its update for a gradient. Found from the optimizer state the
   step carries: its types are optax's public ones and jaxcomp's own.

jaxcomp checks wherever it traces the whole step — ``data_parallel`` (and so ``fully_sharded``)
and ``comm_report`` — and ``check(step, *args)`` checks a hand-written ``pmap`` or ``shard_map``
step, once. Nothing here reads another library's internals; each check runs at trace time only.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
import optax

from jaxcomp._src import axis, buckets, jaxprs, sharding

_HANG_FIX = (
    "Decide from every device: jaxcomp.skip_if_nonfinite(inner, n) in place of "
    "optax.apply_if_finite around a compressor (optax.apply_if_finite after the compressor in the "
    "chain is safe: every device sees the same mean there); "
    "jaxcomp.accumulate(jaxcomp.skip_if_nonfinite(inner, n), every_k=k) in place of "
    "optax.MultiSteps with a should_skip_update_fn; in a lax.cond of your own, decide from a value "
    "summed over the axis (jaxcomp.axis.psum)")
_DRIFT_FIX = (
    "A leaf left out of the compressor: optax.masked around a compressor (choose the compressed "
    "leaves with the compressor's own predicate, jaxcomp.powersgd(compress=...) or "
    "jaxcomp.dgc(sparsify=...), and the others are averaged densely; or average them with another "
    "jaxcomp transformation in the same optax.chain, optax.masked(jaxcomp.allreduce(), <the "
    "complementary mask>); or use optax.multi_transform with a jaxcomp transformation for every "
    "label), a hook that does not average, or a per-device state leaf that no state declares "
    "(PER_DEVICE_FIELDS, or jaxcomp.PerDevice)")


def refuse_hazards(hazards: list) -> None:
  """Raises for the first ``jaxprs.Hazard`` (1).

  Raises:
    ValueError: naming the collectives, the decision and the fix.
  """
  if not hazards:
    return
  hazard = hazards[0]
  axes = ", ".join(map(repr, sorted(hazard.axes)))
  raise ValueError(
      f"a collective over {axes} runs under a decision taken on each device alone: "
      f"{'; '.join(dict.fromkeys(hazard.collectives))}, under the {hazard.decision}, whose "
      "predicate differs from device to device (it is computed from each device's own gradient or "
      "batch). A device that decides otherwise skips the collective the others wait in, and the "
      f"job hangs. {_HANG_FIX}")


def check_program(jaxpr, seeds: list) -> list:
  """1 for ``jaxpr`` (a mapped step's body) whose inputs differ along ``seeds``: raises, or
  returns what differs at its outputs (per output, the axes)."""
  hazards: list = []
  outputs = jaxprs.varying(jaxpr, seeds, hazards)
  refuse_hazards(hazards)
  return outputs


def diagnose(unchecked: Callable, *args, error: Exception) -> None:
  """1 for a mapped step that JAX refused to trace with its types (``shard_map(check_vma=True)``
  refuses a conditional whose branches differ in what varies between devices, as a collective in
  one branch makes them): ``unchecked`` is the same step with ``check_vma=False``, traced to find
  the hazard from its specs (what they split over an axis differs along it).

  Raises:
    ValueError: the hazard, from ``error``; nothing where none is found (``error`` stands).
  """
  try:
    program = jax.make_jaxpr(unchecked)(*args)
  except Exception:  # noqa: BLE001 (the step fails untyped too: the original error stands)
    return
  for body in _mapped_bodies(program.jaxpr, {}, {}):
    params = body.eqn.params
    seeds = [frozenset(a for names in _spec_axes(spec) for a in names)
             for spec in params["in_specs"]]
    hazards: list = []
    jaxprs.varying(params["jaxpr"], seeds, hazards)
    if hazards:
      try:
        refuse_hazards(hazards)
      except ValueError as found:
        raise found from error


# -------------------------------------------------------------------- the optimizer state (3)


def _config(node):
  """The jaxcomp configuration of a state node (any NamedTuple with a ``config`` that has a
  ``name``), or None."""
  config = getattr(node, "config", None) if isinstance(node, tuple) else None
  return config if hasattr(config, "name") else None


def _children(node) -> list:
  """The sub-states of an optimizer state node: a NamedTuple's fields, a tuple's or list's
  entries, a dict's values."""
  if isinstance(node, dict):
    return list(node.values())
  if isinstance(node, (tuple, list)):
    return list(node)
  return []


def _communicating(node) -> list:
  """The public names of the jaxcomp transformations whose states ``node`` holds."""
  config = _config(node)
  if config is not None:
    return [config.name]
  if isinstance(node, buckets.CommHookState):
    return ["comm_hook"]
  return [name for child in _children(node) for name in _communicating(child)]


def _whole_optimizer(node):
  """The configuration of the whole optimizer (its output the update, or ``Assign``) whose state
  ``node`` is or holds, or None."""
  config = _config(node)
  if config is not None and getattr(config, "output", "gradient") != "gradient":
    return config
  for child in _children(node):
    found = _whole_optimizer(child)
    if found is not None:
      return found
  return None


def _is_guard(node) -> bool:
  """Whether a state is that of a guard that may follow a whole optimizer:
  ``optax.apply_if_finite`` around nothing (``optax.identity()``) or around such guards."""
  if isinstance(node, optax.ApplyIfFiniteState):
    return _is_guard_inside(node.inner_state)
  return False


def _is_guard_inside(node) -> bool:
  if isinstance(node, optax.EmptyState):
    return True
  if isinstance(node, tuple) and not hasattr(node, "_fields"):
    return all(_is_guard_inside(child) or _is_guard(child) for child in node)
  return _is_guard(node)


def check_state(tree) -> None:
  """3: refuses an optimizer chained after a whole optimizer, and warns of ``optax.MultiSteps``
  around a jaxcomp transformation, from an optimizer state (or any pytree holding one).

  ``optax.chain``'s state is a plain tuple of its elements' states: an element after one that
  holds a whole optimizer's state is refused, unless it is an ``optax.apply_if_finite`` guard
  (after an optimizer whose output is the update; nothing may follow one that sets the
  parameters).

  Raises:
    ValueError: naming the optimizer, what follows it and the fix.
  """
  if isinstance(tree, optax.MultiStepsState):
    names = _communicating(tree.inner_opt_state)
    if names:
      axis.warn_once_per_trace(("optax.MultiSteps", tuple(names)), (
          f"jaxcomp: optax.MultiSteps runs jaxcomp.{names[0]} inside it, and its collectives, on "
          "every micro-step: k times the traffic. jaxcomp.accumulate(inner, every_k=k) gives the "
          "same update and communicates once per k micro-steps"))
  if _is_chain_state(tree):
    for i, element in enumerate(tree[:-1]):
      whole = _whole_optimizer(element)
      after = [e for e in tree[i + 1:] if whole is not None
               and (whole.output == "assign" or not _is_guard(e))]
      if after:
        _refuse_follower(whole)
      if getattr(_config(element), "name", None) == "sign_compress" and _holds(
          tree[i + 1:], optax.TraceState):
        axis.warn_once_per_trace("sign_compress and momentum", (
            "jaxcomp: sign_compress is followed by momentum (optax.sgd(..., momentum=...) or "
            "optax.trace): its error feedback already carries what a step leaves out, and "
            "momentum on top of the scaled signs trains badly. Use optax.sgd without momentum "
            "after it, or jaxcomp.onebit_adam, whose momentum is what crosses the wire"))
  for child in _children(tree):
    check_state(child)


def _is_chain_state(node) -> bool:
  """Whether ``node`` looks like ``optax.chain``'s state: a plain tuple of optimizer states (each
  a NamedTuple, or such a tuple), not of arrays or dicts (a step's ``(params, opt_state)``)."""
  return (isinstance(node, tuple) and not hasattr(node, "_fields")
          and all(hasattr(e, "_fields") or _is_chain_state(e) for e in node))


def takes_the_loss(tree) -> bool:
  """Whether an optimizer state holds ``optax.contrib.reduce_on_plateau``'s, whose update needs the
  loss (``value=``): ``jaxcomp.data_parallel`` passes it the devices' mean, so that every device
  takes the same decision."""
  if isinstance(tree, optax.contrib.ReduceLROnPlateauState):
    return True
  return any(takes_the_loss(child) for child in _children(tree))


def refuse_lookahead(tree) -> None:
  """``optax.lookahead`` needs its parameters as ``optax.LookaheadParams(fast, slow)``, which the
  loss form of ``jaxcomp.data_parallel`` cannot give it (the loss function takes the model's).

  Raises:
    ValueError: naming the fix.
  """
  if isinstance(tree, optax.LookaheadState):
    raise ValueError(
        "tx: optax.lookahead keeps two copies of the parameters, optax.LookaheadParams(fast, "
        "slow), and its update needs them, which jaxcomp.data_parallel's loss form cannot pass "
        "(its loss function takes the model's parameters). Use the per-device-step form, "
        "data_parallel(step, mesh), with LookaheadParams in the state and tx.update(grads, "
        "opt_state, lookahead_params) in the step; or jaxcomp.diloco, whose outer step is a "
        "lookahead across the devices")
  for child in _children(tree):
    refuse_lookahead(child)


def _holds(tree, kind: type) -> bool:
  """Whether an optimizer state (or a sequence of them) holds a state of type ``kind``."""
  return isinstance(tree, kind) or any(_holds(child, kind) for child in _children(tree))


def _refuse_follower(whole) -> None:
  name = f"jaxcomp.{whole.name}"
  if whole.output == "assign":
    raise ValueError(
        f"{name} is followed in an optax.chain by another transformation: {name} is a whole "
        "optimizer that sets the parameters (its updates are jaxcomp.Assign, not a gradient). Use "
        "it alone, and put gradient processing (clipping, weight decay, a learning-rate schedule) "
        f"into its inner optimizer: {name}(optax.chain(optax.clip_by_global_norm(1.0), "
        "optax.adamw(1e-3)), ...)")
  raise ValueError(
      f"{name} is followed in an optax.chain by another transformation: {name} is a whole "
      "optimizer whose output is the parameter update, and a transformation after it would take "
      f"that update for a gradient. Use {name} alone (only optax.apply_if_finite guards may follow "
      "it; jaxcomp.skip_if_nonfinite goes around it)"
      + (", or jaxcomp.scale_by_onebit_adam(...) followed by a learning rate "
         "(optax.chain(jaxcomp.scale_by_onebit_adam(...), optax.scale_by_learning_rate(lr)))"
         if whole.name == "onebit_adam" else ""))


# ------------------------------------------------------------------------- jaxcomp.check


def check(step: Callable, *args, **kwargs) -> None:
  """Checks a mapped training step for the hazards of wrapping a cross-device mean, once.

  ``jaxcomp.data_parallel`` (and ``fully_sharded``) check the steps they build as they trace
  them; call ``check`` once on a step of your own, written with ``jax.pmap`` or ``jax.shard_map``,
  with the arguments of a real step (per-device batches that differ, parameters and state as the
  step takes them). It traces the step — nothing runs — and raises where:

  * a collective over a mapped axis runs under a decision taken on each device alone
    (``optax.apply_if_finite`` around a compressor, ``optax.MultiSteps`` with a
    ``should_skip_update_fn``, a ``lax.cond`` of your own on a value of the batch): the job would
    hang at the first step where the devices decide differently;
  * a value that is the same on every device when the step starts (a parameter, a replicated
    state leaf) comes out different on each device at the same place of the step's results,
    without a state declaring it per device: it reached no collective (``optax.masked`` around a
    compressor), and the replicas would drift apart;
  * an optimizer follows a whole optimizer in an ``optax.chain`` (the optimizer state says so);

  and warns where ``optax.MultiSteps`` runs a jaxcomp transformation on every micro-step.

  Under ``pmap`` (and ``shard_map(check_vma=False)``) which inputs differ from device to device is
  read from their values (an abstract argument, ``jax.ShapeDtypeStruct``, is taken to differ if it
  is floating point); under ``shard_map(check_vma=True)`` from JAX's own types.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.apply_if_finite(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), 3)
    >>> step = jax.pmap(lambda g, s: tx.update(g, s)[0], axis_name="batch")
    >>> grads = jnp.arange(8.0).reshape(8, 1)  # device i's gradient is [i]
    >>> state = jax.pmap(tx.init)(grads)
    >>> jaxcomp.check(step, grads, state)
    Traceback (most recent call last):
    ...
    ValueError: a collective over 'batch' runs under a decision taken on each device alone: ...

  Args:
    step: the step: a ``jax.pmap``, a ``jax.jit`` of a ``jax.shard_map``, or a function that
      calls either.
    *args: its arguments (arrays, or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments.

  Raises:
    ValueError: naming the hazard, where it is and the fix.
  """
  for arg in (*args, *kwargs.values()):
    check_state(arg)
  program, results = jax.make_jaxpr(step, return_shape=True)(*args, **kwargs)
  flat = jax.tree.leaves((args, kwargs))
  origin = dict(zip(program.jaxpr.invars, range(len(flat))))
  destination = {v: i for i, v in enumerate(program.jaxpr.outvars)}
  drifting = set()  # the step's outputs that differ from device to device, by index
  for body in _mapped_bodies(program.jaxpr, origin, destination):
    drifting |= _check_body(body, flat)
  if drifting:
    _refuse_drift(drifting, args, results, flat)


class _Body:
  """A ``shard_map`` in a step's program: its equation, and where its operands come from and its
  results go (indices of the step's flat arguments and results, or None)."""

  def __init__(self, eqn, sources: list, targets: list):
    self.eqn, self.sources, self.targets = eqn, sources, targets


def _mapped_bodies(jaxpr, origin: dict, destination: dict) -> list:
  """The ``shard_map`` equations of ``jaxpr``, also inside the jits that call them."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      found.append(_Body(eqn, [origin.get(v) for v in eqn.invars],
                         [destination.get(v) for v in eqn.outvars]))
      continue
    for sub in jaxprs.subjaxprs(eqn):
      inner_origin = {s: origin.get(v) for s, v in zip(sub.invars, eqn.invars)
                      if len(sub.invars) == len(eqn.invars)}
      inner_destination = {s: destination.get(v) for s, v in zip(sub.outvars, eqn.outvars)
                           if len(sub.outvars) == len(eqn.outvars)}
      found += _mapped_bodies(sub, inner_origin, inner_destination)
  return found


def _spec_axes(spec) -> list:
  """Per dimension of a ``PartitionSpec``, the mesh axes it is split over."""
  dims = []
  for entry in tuple(spec or ()):
    dims.append(() if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,))
  return dims


def _differs(value, spec, mesh) -> frozenset:
  """The axes of ``spec`` along which ``value`` (a global array split by ``spec``) differs from
  device to device: compared where it is concrete; where it is abstract, all of them for floating
  point and none otherwise (counts, labels)."""
  dims = _spec_axes(spec)
  named = frozenset(a for names in dims for a in names)
  if not named:
    return frozenset()
  if isinstance(value, jax.core.Tracer) or not hasattr(value, "__array__"):
    return named if np.issubdtype(np.dtype(value.dtype), np.floating) else frozenset()
  value = np.asarray(value)
  differs = set()
  for d, names in enumerate(dims):
    parts = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if parts > 1 and value.shape[d] % parts == 0:
      pieces = np.split(value, parts, axis=d)
      if not all(np.array_equal(p, pieces[0], equal_nan=True) for p in pieces[1:]):
        differs |= set(names)
  return frozenset(differs)


def _check_body(body: _Body, flat: list) -> set:
  """1 for one ``shard_map`` of the step; the indices of the step's results that come out of it
  different from device to device where its spec splits them."""
  params = body.eqn.params
  inner = params["jaxpr"]
  if params["check_vma"]:
    seeds = [jaxprs.declared_varying(v) for v in inner.invars]
  else:
    seeds = [_differs(flat[k], spec, params["mesh"]) if k is not None
             else frozenset(a for names in _spec_axes(spec) for a in names)
             for k, spec in zip(body.sources, params["in_specs"])]
  outputs = check_program(inner, seeds)
  if params["check_vma"]:  # JAX's own types keep what the step returns as replicated so
    return set()
  return {target for target, axes in zip(body.targets, outputs)
          if target is not None and axes}


def _refuse_drift(drifting: set, args: tuple, results, flat: list) -> None:
  """2: raises for a result that differs from device to device at the place of an argument leaf
  that is the same on every device and not declared per device."""
  per_device_params = any(sharding.params_per_device(arg) for arg in args)
  starts = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in args])
  result_parts = list(results) if isinstance(results, tuple) else [results]
  offset = 0
  for part in result_parts:
    leaves = jax.tree.leaves(part)
    for a, arg in enumerate(args):
      if not _same_layout(arg, part):
        continue
      declared = jax.tree.leaves(sharding.per_device_mask(arg))
      free = per_device_params and not any(declared)  # the parameters of local steps
      paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(arg)]
      for i in range(len(leaves)):
        same_at_start = not _value_differs(flat[starts[a] + i])
        if offset + i in drifting and same_at_start and not declared[i] and not free:
          raise ValueError(
              f"argument {a}{paths[i]} is the same on every device when the step starts, and the "
              "step returns it at the same place different on each device: it reached no "
              f"collective, and the replicas drift apart. {_DRIFT_FIX}")
      break
    offset += len(leaves)


def _same_layout(arg, result) -> bool:
  """Whether a result has an argument's structure, shapes and dtypes (it is its new value)."""
  if jax.tree.structure(arg) != jax.tree.structure(result):
    return False
  return all(np.shape(x) == tuple(r.shape) and np.dtype(x.dtype) == np.dtype(r.dtype)
             for x, r in zip(jax.tree.leaves(arg), jax.tree.leaves(result)))


def _value_differs(value) -> bool:
  """Whether a stacked per-device value (leading axis: the devices) differs between them;
  unknown (abstract) values are taken to."""
  if not hasattr(value, "__array__") or isinstance(value, jax.core.Tracer):
    return True
  value = np.asarray(value)
  return bool(value.ndim) and not all(np.array_equal(v, value[0], equal_nan=True) for v in value)
