"""The private pieces of JAX that jaxcomp uses, in one place: every ``jax._src`` import is here.

Each has no public equivalent in JAX 0.10; each is checked on jax 0.10.2 (CPU, this project's
tests) and 0.11.2 (the lent GPU machines' image), and each falls back to something public, and
weaker, where a later JAX moves it:

* ``bound_axis_names``: the named axes bound in the current trace (``jax.core``'s
  ``unsafe_get_axis_names``); without it, an unbound axis is told apart only by probing it.
* ``trace_key``: an object that identifies the outermost trace being built, so that a warning is
  given once per compilation rather than once per process; without it, once per call.
* ``all_gather_invariant``: the all-gather whose result ``shard_map(check_vma=True)`` types as
  the same on every device (``lax.all_gather``'s is typed varying); without it, ``lax.all_gather``.
* ``source_line``: the user's line that made an equation of a jaxpr, for messages; without it,
  the primitive's name alone;
* ``name_stack``: the name scopes an equation of a jaxpr was made in (relative to its jaxpr);
  without it, none (jaxcomp's own decisions are then checked as a user's are).
* ``distributed_client``: this process's client of ``jax.distributed``'s coordination service (its
  key-value store and ``get_live_nodes``, the barrier that ``multihost_utils.live_devices`` is
  built on); without it, None (``jaxcomp.train.membership`` then refuses to start).
"""

from __future__ import annotations

from typing import Callable, Optional

from jax import lax


def bound_axis_names() -> list:
  """The named axes bound in the current trace (pmap, shard_map, vmap with ``axis_name``)."""
  try:
    from jax._src import core
    return [n for n in core.unsafe_get_axis_names() if isinstance(n, (str, tuple))]
  except (ImportError, AttributeError):
    return []


def trace_key() -> Optional[object]:
  """The outermost trace being built (a cond's or a scan's branches are traced as child traces of
  it), or None where it cannot be read or nothing is being traced."""
  try:
    from jax._src import core
    trace = core.trace_ctx.trace
    if isinstance(trace, core.EvalTrace):
      return None
    while isinstance(getattr(trace, "parent_trace", None), core.Trace) and not isinstance(
        trace.parent_trace, core.EvalTrace):
      trace = trace.parent_trace
    return trace
  except (ImportError, AttributeError, TypeError):
    return None


def all_gather_invariant() -> Callable:
  """JAX's all-gather whose result is typed invariant along the axis under ``check_vma=True``."""
  try:
    from jax._src.lax import parallel
    return parallel.all_gather_invariant
  except (ImportError, AttributeError):
    return lax.all_gather


def source_line(eqn) -> str:
  """The user's line that made the jaxpr equation ``eqn`` (``file:line (function)``), or ""."""
  try:
    from jax._src import source_info_util
    return source_info_util.summarize(eqn.source_info)
  except (ImportError, AttributeError):
    return ""


def name_stack(eqn) -> str:
  """The name scopes the jaxpr equation ``eqn`` was made in, joined by ``/``, or ""."""
  try:
    return str(eqn.source_info.name_stack)
  except AttributeError:
    return ""


def distributed_client():
  """This process's client of the coordination service ``jax.distributed.initialize`` started, or
  None where there is none or it cannot be read."""
  try:
    from jax._src import distributed
    return distributed.global_state.client
  except (ImportError, AttributeError):
    return None
