"""Optax wrappers and chains that break jaxcomp, caught while the step is traced.

A jaxcomp transformation is a cross-device mean, so every device must run its collectives, in the same
order, on every step. Some optax wrappers, wrapped around one, break that:

* ``optax.apply_if_finite`` decides *per device* whether to run it: a device whose gradient is
  non-finite skips the collectives the others wait in, and the job hangs (XLA:CPU aborts at its
  rendezvous timeout). So does ``optax.MultiSteps`` with a ``should_skip_update_fn``. An error here,
  at trace time: use ``jaxcomp.skip_if_nonfinite``, which decides from all devices.
* ``optax.masked`` hands it only the selected leaves: the others are never averaged, and the replicas
  drift apart silently. An error here, naming them — unless other jaxcomp transformations of the
  enclosing ``optax.chain`` average exactly those (complementary masks:
  ``optax.chain(optax.masked(jaxcomp.powersgd(...), m), optax.masked(jaxcomp.allreduce(), not_m))``).
  Otherwise: choose the compressed leaves with the transformation's own predicate (the rest are
  averaged densely), or use ``optax.multi_transform`` with a jaxcomp transformation for every label
  (``multi_transform`` is built on ``masked`` and is not refused).
* ``optax.MultiSteps`` runs it, and its collectives, on every micro-step: k times the traffic of
  ``jaxcomp.accumulate``, which gives the same update. A warning, once per trace.

They are recognised by their update functions' code on the Python stack (and what a chain or a
masked transformation holds by the variables its update function closes over), read once each time
a jaxcomp transformation's ``update`` is traced — at its entry, never inside a collective — so the
check costs nothing when the step runs. ``check`` looks only where the axis is bound: at world size
1 nothing communicates and the wrappers are harmless.

``check_last_in_chain`` guards whole optimizers: those whose output is the parameter update
(``jaxcomp.onebit_adam``), which another optimizer after them in an ``optax.chain`` would take for a
gradient (training diverges without an error), and those that set the parameters (``local_sgd``,
``diloco``, ...: their ``Assign`` updates are no gradient at all). It refuses anything after them
but guards, and after those that set the parameters even guards.
"""

from __future__ import annotations

import inspect
from typing import Optional

import jax
import optax

from jaxcomp._src import axis


def _code(update_fn) -> Optional[object]:
  return getattr(update_fn, "__code__", None)


def _update_code(transformation) -> Optional[object]:
  return _code(getattr(transformation, "update", None))


_APPLY_IF_FINITE = _update_code(optax.apply_if_finite(optax.identity(), 0))
_MASKED = _update_code(optax.masked(optax.identity(), True))
_MULTI_TRANSFORM = _update_code(optax.multi_transform({0: optax.identity()}, 0))
_MULTI_STEPS = optax.MultiSteps.update.__code__
_NO_SKIP = optax.MultiSteps(optax.identity(), 2)._should_skip_update_fn.__code__  # its default
_CHAIN = _update_code(optax.chain(optax.identity()))
_IDENTITY = _update_code(optax.identity())
# What optax.chain puts around an element without extra-args support (it closes over ``tx``).
_EXTRA_ARGS = _update_code(optax.with_extra_args_support(optax.identity()))


def _name(axis_name) -> str:
  return repr(axis_name)


def _closure(update_fn) -> dict:
  """The variables ``update_fn`` closes over and that are set, by name (none for what is not a
  Python function)."""
  code, cells = _code(update_fn), getattr(update_fn, "__closure__", None) or ()
  closure = {}
  for name, cell in zip(code.co_freevars if code else (), cells):
    try:
      closure[name] = cell.cell_contents
    except ValueError:  # a variable not assigned yet
      pass
  return closure


def _unwrapped(update_fn):
  """``update_fn`` without the wrapper ``optax.chain`` adds for extra-args support."""
  while _code(update_fn) is _EXTRA_ARGS:
    update_fn = _closure(update_fn)["tx"].update
  return update_fn


def _chain_position(frame) -> Optional[tuple]:
  """``(update_fns, i)`` in a frame of ``optax.chain``'s update: its elements' update functions and
  the index of the one running now (as many as have returned a state); else None."""
  if frame.f_code is not _CHAIN:
    return None
  update_fns, done = frame.f_locals.get("update_fns"), frame.f_locals.get("new_state")
  if update_fns is None or done is None:
    return None
  return list(update_fns), len(done)


def _is_jaxcomp(update_fn) -> bool:
  module = getattr(update_fn, "__module__", None) or ""
  return module == "jaxcomp" or module.startswith("jaxcomp.")


def _selected(mask, updates) -> list:
  """Per leaf of ``updates``, whether ``optax.masked``'s ``mask`` (a tree of bools, a prefix of
  ``updates``, or a function of it) selects it."""
  tree = mask(updates) if callable(mask) else mask
  return jax.tree.leaves(jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub),
                                      tree, updates))


def _averaged(update_fn, updates) -> list:
  """Per leaf of ``updates``, whether the transformation with ``update_fn`` averages it over the
  devices.

  A jaxcomp transformation averages every leaf it is given, unless it wraps an ``inner``
  transformation (``skip_if_nonfinite``, ``accumulate``), which averages what that one does; an
  ``optax.chain`` what any of its elements does; ``optax.masked`` what its inner one does among the
  leaves its mask selects. Nothing else is known to average.
  """
  update_fn = _unwrapped(update_fn)
  code, closure = _code(update_fn), _closure(update_fn)
  nothing = [False] * len(jax.tree.leaves(updates))
  if code is _CHAIN:
    by_element = [_averaged(fn, updates) for fn in closure.get("update_fns", ())]
    return [any(leaf) for leaf in zip(nothing, *by_element)]
  if code is _MASKED:
    if "mask" not in closure or "inner" not in closure:
      return nothing
    return [selected and averaged for selected, averaged in
            zip(_selected(closure["mask"], updates), _averaged(closure["inner"].update, updates))]
  if _is_jaxcomp(update_fn):
    inner = closure.get("inner")
    if isinstance(inner, optax.GradientTransformation):
      return _averaged(inner.update, updates)
    return [True] * len(nothing)
  return nothing


def _left_out(masked) -> Optional[list]:
  """The paths of the leaves that the ``optax.masked`` running in the frame ``masked`` leaves out
  and that no other element of the ``optax.chain`` it is an element of averages; None if its mask
  cannot be read.

  Its siblings see the same tree as it does, so their masks apply as they are.
  """
  updates, mask = masked.f_locals.get("updates"), masked.f_locals.get("mask_tree")
  if updates is None or mask is None:
    return None
  with_path = jax.tree_util.tree_leaves_with_path(updates)
  covered = [False] * len(with_path)
  position = _chain_position(masked.f_back) if masked.f_back is not None else None
  if position is not None:
    update_fns, running = position
    for i, fn in enumerate(update_fns):
      if i != running:
        covered = [c or a for c, a in zip(covered, _averaged(fn, updates))]
  return [jax.tree_util.keystr(path) for (path, _), selected, c in
          zip(with_path, _selected(mask, updates), covered) if not selected and not c]


def _callers() -> list:
  """The frames that called the jaxcomp ``update`` running now, innermost first (read once per
  trace)."""
  frame, found = inspect.currentframe(), []
  while frame is not None:
    found.append(frame)
    frame = frame.f_back
  return found[2:]  # not this function and its caller in this module


def check(name: str, axis_name) -> None:
  """Raises (or warns) if the jaxcomp transformation ``name`` is traced inside a wrapper above.

  Called at the entry of every jaxcomp ``update``, once per trace.

  Args:
    name: the transformation's public name, for the message.
    axis_name: the axis it averages over; nothing is checked where it is not bound.

  Raises:
    ValueError: it runs inside ``optax.apply_if_finite``, inside ``optax.MultiSteps`` with a
      ``should_skip_update_fn``, or inside ``optax.masked`` (not from ``multi_transform``) whose
      left-out leaves no other jaxcomp transformation of its chain averages.
  """
  if not axis.is_bound(axis_name):
    return
  masked, under_multi_transform = None, False
  for frame in _callers():
    code = frame.f_code
    if code is _APPLY_IF_FINITE:
      raise ValueError(
          f"optax.apply_if_finite wraps jaxcomp.{name}, which communicates over axis "
          f"{_name(axis_name)}: it decides on each device alone whether to run it, and a device "
          "whose gradient is non-finite skips the collectives the others wait in (the job hangs at "
          "the first such step). Use jaxcomp.skip_if_nonfinite(inner, max_consecutive_errors, "
          f"axis_name={_name(axis_name)}), which decides from every device, or put "
          "optax.apply_if_finite after the compressor in the chain")
    if code is _MULTI_STEPS:
      multi_steps = frame.f_locals.get("self")
      skip = getattr(getattr(multi_steps, "_should_skip_update_fn", None), "__code__", _NO_SKIP)
      if skip is not _NO_SKIP:
        raise ValueError(
            f"optax.MultiSteps with a should_skip_update_fn wraps jaxcomp.{name}, which "
            f"communicates over axis {_name(axis_name)}: it skips on each device alone, and a "
            "device that skips misses the collectives the others wait in. Use "
            "jaxcomp.accumulate(jaxcomp.skip_if_nonfinite(inner, ...), every_k=k)")
      axis.warn_once_per_trace(
          "optax.MultiSteps",
          f"jaxcomp: optax.MultiSteps runs jaxcomp.{name} inside it, and its collectives over axis "
          f"{_name(axis_name)}, on every micro-step: k times the traffic. "
          "jaxcomp.accumulate(inner, every_k=k) gives the same update and communicates once per "
          "k micro-steps")
    if code is _MASKED and masked is None:
      masked = frame
    under_multi_transform |= code is _MULTI_TRANSFORM  # its masks cover every leaf once
  if masked is not None and not under_multi_transform:
    left_out = _left_out(masked)
    if left_out is None or left_out:
      raise ValueError(
          f"optax.masked leaves {', '.join(left_out or []) or 'some leaves'} out of jaxcomp.{name}, "
          f"which averages over axis {_name(axis_name)}: nothing averages them, and "
          "the replicas drift apart. Choose the compressed leaves with the transformation's own "
          "predicate — jaxcomp.powersgd(compress=...), jaxcomp.dgc(sparsify=...) — and the others "
          "are averaged densely; or average them with another jaxcomp transformation in the same "
          "optax.chain (optax.masked(jaxcomp.allreduce(), <the complementary mask>)); or use "
          "optax.multi_transform with a jaxcomp transformation for every label")


def _is_guard(update_fn) -> bool:
  """Whether the transformation passes an update through or drops it whole: ``optax.identity()``,
  ``optax.apply_if_finite`` around a guard, a chain of guards."""
  update_fn = _unwrapped(update_fn)
  code, closure = _code(update_fn), _closure(update_fn)
  if code is _IDENTITY:
    return True
  if code is _CHAIN and "update_fns" in closure:
    return all(_is_guard(fn) for fn in closure["update_fns"])
  if code is _APPLY_IF_FINITE and "inner" in closure:
    return _is_guard(closure["inner"].update)
  return False


def _describe(update_fn) -> str:
  update_fn = _unwrapped(update_fn)
  if _code(update_fn) is _CHAIN:
    return "an optax.chain (optax's optimizers, optax.adam and the like, are chains)"
  qualname = getattr(update_fn, "__qualname__", type(update_fn).__name__)
  return f"{qualname.split('.<locals>')[0]} (from {getattr(update_fn, '__module__', '?')})"


def check_last_in_chain(name: str, alternative: Optional[str] = None,
                        sets_params: bool = False) -> None:
  """Raises if the calling transformation is followed in an ``optax.chain`` by anything but guards.

  For whole optimizers: those whose output is the parameter update (``jaxcomp.onebit_adam``), which
  a transformation after it would take for a gradient — ``optax.chain(jaxcomp.onebit_adam(...),
  optax.adamw(...))`` diverges without an error — and those that set the parameters
  (``sets_params``: ``jaxcomp.diloco`` and the other local-step optimizers, whose updates are
  ``jaxcomp.Assign``). Call it from the optimizer's ``update`` function; it reads the Python stack,
  so under ``jit`` it runs once, at trace time. What may follow an optimizer whose output is the
  update: ``optax.identity()``, ``optax.apply_if_finite`` around such a guard, and chains of them
  (``jaxcomp.skip_if_nonfinite`` goes around the optimizer); nothing may follow one that sets the
  parameters (a guard's zero update would set them to zero). Every enclosing chain is checked, so
  a chain that ends with the optimizer and is itself followed by another optimizer is refused too.

  Args:
    name: the optimizer's public name, for the message (e.g. ``"jaxcomp.onebit_adam"``).
    alternative: a transformation that computes the same direction without the learning rate
      (e.g. ``"jaxcomp.scale_by_onebit_adam"``), offered in the message to chain with others.
    sets_params: the optimizer's updates set the parameters (``jaxcomp.Assign``).

  Raises:
    ValueError: naming the optimizer, what follows it and the fix.
  """
  for frame in _callers():
    position = _chain_position(frame)
    if position is None:
      continue
    update_fns, running = position
    after = [fn for fn in update_fns[running + 1:] if sets_params or not _is_guard(fn)]
    if not after:
      continue
    if sets_params:
      raise ValueError(
          f"{name} is followed in an optax.chain by {_describe(after[0])}: {name} is a whole "
          "optimizer that sets the parameters (its updates are jaxcomp.Assign, not a gradient). "
          "Use it alone, and put gradient processing (clipping, weight decay, a learning-rate "
          f"schedule) into its inner optimizer: {name}(optax.chain(optax.clip_by_global_norm(1.0), "
          "optax.adamw(1e-3)), ...)")
    instead = (f", or {alternative}(...) followed by a learning rate (e.g. "
               f"optax.chain({alternative}(...), optax.scale(-lr)))" if alternative else "")
    raise ValueError(
        f"{name} is followed in an optax.chain by {_describe(after[0])}: {name} is a whole "
        "optimizer whose output is the parameter update, and a transformation after it would "
        f"take that update for a gradient. Use {name} alone (only guards such as "
        "optax.apply_if_finite(optax.identity(), ...) may follow it; "
        f"jaxcomp.skip_if_nonfinite goes around it){instead}")
