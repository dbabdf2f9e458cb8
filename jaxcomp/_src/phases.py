"""Phases: the branches of a step that run on some steps and not on others, labelled for the report.

A compressor's warm-up (PowerSGD's ``start_iter``, DGC's density stages, 1-bit Adam's dense Adam),
the two halves of alternating PowerSGD, the synchronization of local SGD and DiLoCo, the
communicating micro-step of ``accumulate``: each is a branch of a ``lax.switch`` (or ``lax.cond``,
or ``when``'s loop run once or never) over a counter, and the collectives inside a branch run only
on the steps that take it. ``switch`` runs such a branch under a JAX name scope that names the phase
and its share of the steady state — the fraction of steps, once warm-ups are over, that take it (0
for a warm-up, ½ for each half of alternating PowerSGD, 1/H for a synchronization every H steps).
The label reaches every instruction of the branch as its ``op_name`` metadata, so
``jaxcomp.comm_report`` reads it back (``parse``) and reports each phase's collectives, and the
steady state's bytes per step, instead of adding up branches that never run together. A phase is
named by the transformation that owns it, ``"<transformation>.<phase>"`` (``"powersgd.warmup"``):
the configuration that makes it knows its public name (``validate.Config.name``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import axis

WHEN = "jaxcomp_when"  # the name scope of ``when``'s loop
# The name scope of a decision every device takes alike (a phase chosen by the step count): the
# check for collectives under a per-device decision (jaxprs.varying) passes it by, as the type
# checker cannot tell that every device holds the same count.
AGREED = "jaxcomp_agreed"
_LABEL = re.compile(r"jaxcomp_phase\[(?P<name>[^|\]]+)\|(?P<share>[0-9.e+-]+)\]")


class Phase(NamedTuple):
  """One branch of a step.

  Attributes:
    name: the phase's name as the report gives it, ``"<transformation>.<phase>"``
      (``"powersgd.warmup"``).
    share: the fraction of steady-state steps that take it: 0 for a warm-up phase, 1 for the only
      steady phase, 1/H for a synchronization every H steps.
    value: what the step needs to know of the phase (DGC's density), or None.
  """
  name: str
  share: float
  value: Any = None


def label(phase: Phase) -> str:
  """The name scope that marks ``phase``'s instructions."""
  return f"jaxcomp_phase[{phase.name}|{float(phase.share)!r}]"


def parse(op_name: str) -> tuple:
  """The ``(name, share)`` of every phase label in an instruction's ``op_name``, outermost first,
  each once: XLA may repeat a scope's name in an instruction it has moved out of a nested
  computation (seen on a 2-D Auto mesh), and a phase is never nested in itself."""
  labels = ((m.group("name"), float(m.group("share"))) for m in _LABEL.finditer(op_name))
  return tuple(dict.fromkeys(labels))


def run(phase: Phase, branch: Callable, *operands):
  """``branch(*operands)`` with its instructions labelled as ``phase``."""
  with jax.named_scope(label(phase)):
    return branch(*operands)


def switch(index, phases: Sequence[Phase], branches: Sequence[Callable], *operands):
  """``lax.switch(index, branches, *operands)`` with branch i labelled as ``phases[i]``; a single
  phase runs without a switch (still labelled)."""
  if len(branches) == 1:
    return run(phases[0], branches[0], *operands)
  labelled = [lambda *ops, p=p, b=b: run(p, b, *ops) for p, b in zip(phases, branches)]
  with jax.named_scope(AGREED):
    return lax.switch(index, labelled, *operands)


def cond(predicate, phase: Phase, branch: Callable, otherwise: Callable, *operands):
  """``lax.cond(predicate, branch, otherwise, *operands)`` with ``branch`` labelled as ``phase``
  (``otherwise`` is the rest of the steps; it sends nothing)."""
  with jax.named_scope(AGREED):
    return lax.cond(predicate, lambda *ops: run(phase, branch, *ops), otherwise, *operands)


def when(predicate, phase: Optional[Phase], branch: Callable, *operands):
  """``branch(*operands)`` labelled as ``phase`` if ``predicate``, else ``operands`` as they are:
  a loop that runs ``branch`` zero times or once. ``phase`` None: a branch that runs no
  collective, unlabelled (``local_steps.local_update``'s restoring of a non-finite step).

  Not ``cond(predicate, phase, branch, lambda *ops: ops, *operands)``: XLA gives a conditional's
  result buffers of its own, so a donated state that the branch reads and rewrites around a
  collective is held twice; a loop carries its operands in place. DiLoCo's update of ResNet-18's
  gradient (W = 8, donated): temporaries 4.54 → 2.27 times the gradient, Streaming DiLoCo's (P = 2)
  2.84 → 1.85 (``PYTHONPATH=. python benchmarks/memory.py --compressors diloco_h20,
  streaming_diloco_h20_p2``; ``tests/test_phases.py`` checks a small case).

  XLA moves the instructions of a loop's body that read only values the loop does not change
  before the loop (loop-invariant code motion), collectives included, where they run on every
  step, whatever the predicate. So the operands enter the branch through an optimization barrier
  with the loop's counter, which makes everything computed from them depend on the loop, and the
  branch must compute what it sends from its operands, not from values it closes over: Streaming
  DiLoCo's pieces, closed over, were all sent on every step, merged into one all-reduce.
  """
  single = len(operands) == 1  # branch returns the operand itself, as with ``cond``

  def body(i, ops):
    # See above: nothing is hoisted out of the loop. One barrier per leaf: a barrier's results
    # vary along every mesh axis along which any of its operands does (shard_map's check_vma).
    ops = jax.tree.map(lambda x: lax.optimization_barrier((i, x))[1], ops)
    results = branch(*ops) if phase is None else run(phase, branch, *ops)
    results = (results,) if single else tuple(results)
    # The carry keeps its type: a branch may return what every device agrees on for an operand
    # that differs per device (``local_update`` restoring replicated parameters), as ``cond``
    # allows.
    return jax.tree.map(lambda r, o: axis.make_varying(r, tuple(axis.varying_axes(o))), results,
                        ops)

  # The report reads the loop as the conditional it is; a labelled phase is one every device
  # takes alike.
  agreed = jax.named_scope(AGREED) if phase is not None else contextlib.nullcontext()
  with jax.named_scope(WHEN), agreed:
    results = lax.fori_loop(0, jnp.asarray(predicate, jnp.int32), body, operands)
  return results[0] if single else results
