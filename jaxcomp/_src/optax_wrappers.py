"""Optax wrappers that break collectives, caught where a collective is about to run.

A jaxcomp transformation is a cross-device mean, so every device must run its collectives, in the same
order, on every step. Some optax wrappers, wrapped around one, break that:

* ``optax.apply_if_finite`` decides *per device* whether to run it: a device whose gradient is
  non-finite skips the collectives the others wait in, and the job hangs (XLA:CPU aborts at its
  rendezvous timeout). So does ``optax.MultiSteps`` with a ``should_skip_update_fn``. An error here,
  at trace time: use ``jaxcomp.skip_if_nonfinite``, which decides from all devices.
* ``optax.masked`` hands it only the selected leaves: the others are never averaged, and the replicas
  drift apart silently. An error here: choose the compressed leaves with the transformation's own
  predicate (the rest are averaged densely), or use ``optax.multi_transform`` with a jaxcomp
  transformation for every label (``multi_transform`` is built on ``masked`` and is not refused).
* ``optax.MultiSteps`` runs it, and its collectives, on every micro-step: k times the traffic of
  ``jaxcomp.accumulate``, which gives the same update. A warning, once per trace.

They are recognised by their update functions' code on the Python stack while the step is traced, so
the check costs nothing when the step runs. It runs only where an axis is bound: at world size 1
nothing communicates and the wrappers are harmless.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import jax
import optax


def _update_code(transformation) -> Optional[object]:
  return getattr(getattr(transformation, "update", None), "__code__", None)


_APPLY_IF_FINITE = _update_code(optax.apply_if_finite(optax.identity(), 0))
_MASKED = _update_code(optax.masked(optax.identity(), True))
_MULTI_TRANSFORM = _update_code(optax.multi_transform({0: optax.identity()}, 0))
_MULTI_STEPS = optax.MultiSteps.update.__code__
_NO_SKIP = optax.MultiSteps(optax.identity(), 2)._should_skip_update_fn.__code__  # its default


def _name(axis_name) -> str:
  return repr(axis_name)


def check(axis_name, warn: Callable[[str, str], None]) -> None:
  """Raises (or warns, through ``warn(key, message)``) if the caller runs inside a wrapper above.

  Args:
    axis_name: the bound axis a collective is about to run over.
    warn: ``warn(key, message)`` warns once per trace and key.

  Raises:
    ValueError: the collective runs inside ``optax.apply_if_finite``, inside ``optax.MultiSteps``
      with a ``should_skip_update_fn``, or inside ``optax.masked`` (not from ``multi_transform``).
  """
  frame, masked, under_multi_transform = sys._getframe(1), None, False
  while frame is not None:
    code = frame.f_code
    if code is _APPLY_IF_FINITE:
      raise ValueError(
          f"optax.apply_if_finite wraps a jaxcomp transformation that communicates over axis "
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
            "optax.MultiSteps with a should_skip_update_fn wraps a jaxcomp transformation that "
            f"communicates over axis {_name(axis_name)}: it skips on each device alone, and a "
            "device that skips misses the collectives the others wait in. Use "
            "jaxcomp.accumulate(jaxcomp.skip_if_nonfinite(inner, ...), every_k=k)")
      warn("optax.MultiSteps",
           "jaxcomp: optax.MultiSteps runs the jaxcomp transformation inside it, and its collectives "
           f"over axis {_name(axis_name)}, on every micro-step: k times the traffic. "
           "jaxcomp.accumulate(inner, every_k=k) gives the same update and communicates once per "
           "k micro-steps")
    if code is _MASKED and masked is None:
      masked = frame
    under_multi_transform |= code is _MULTI_TRANSFORM  # its masks cover every leaf once
    frame = frame.f_back
  if masked is not None and not under_multi_transform:
    mask = masked.f_locals.get("mask_tree")
    left_out = [jax.tree_util.keystr(path) for path, selected in
                jax.tree_util.tree_leaves_with_path(mask) if not selected]
    if left_out or mask is None:
      raise ValueError(
          f"optax.masked leaves {', '.join(left_out) or 'some leaves'} out of a jaxcomp "
          f"transformation that averages over axis {_name(axis_name)}: nothing averages them, and "
          "the replicas drift apart. Choose the compressed leaves with the transformation's own "
          "predicate — jaxcomp.powersgd(compress=...), jaxcomp.dgc(sparsify=...) — and the others "
          "are averaged densely; or use optax.multi_transform with a jaxcomp transformation for "
          "every label")
