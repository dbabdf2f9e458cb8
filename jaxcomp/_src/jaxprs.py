"""Reading a traced program (a jaxpr): which collectives it runs, and what it computes from what.

Some misuses show only in what a function computes, not in its Python objects: an inner optimizer
that communicates over the axis of the local steps around it (``local_steps.local_update``), an
optimizer that reduces over a shard's elements under ``jaxcomp.sharded_optimizer``
(``zero.check_elementwise``). The functions below read a ``jax.make_jaxpr`` of it, at trace time,
so the checks cost nothing when the step runs.
"""

from __future__ import annotations

import jax
import jax.extend

# Primitives that combine the elements of an array (a dot_general only when it contracts).
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "dot_general", "conv_general_dilated", "sort", "top_k", "approx_top_k"})
COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant", "all_to_all",
    "reduce_scatter", "psum_scatter", "ppermute", "pbroadcast"})
_TYPE_ONLY = frozenset({"pvary", "pcast"})  # change what the type says varies, not the values
# Primitives that draw random numbers: the same key draws the same numbers on every shard.
_RANDOM = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


def subjaxprs(eqn) -> list:
  """The jaxprs an equation calls (a jit, a cond's branches, a loop's body, a custom rule)."""
  found = []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(v, "eqns"):
        found.append(v)
      elif hasattr(getattr(v, "jaxpr", None), "eqns"):
        found.append(v.jaxpr)
  return found


def program(jaxpr) -> tuple:
  """The primitives of ``jaxpr`` in order, nested as it nests them; type-only ones left out."""
  return tuple((eqn.primitive.name, tuple(program(s) for s in subjaxprs(eqn)))
               for eqn in jaxpr.eqns if eqn.primitive.name not in _TYPE_ONLY)


def where(eqn) -> str:
  """The equation's primitive and, where JAX knows it, the line that made it."""
  try:
    from jax._src import source_info_util  # the only way JAX offers to name an equation's line
    line = source_info_util.summarize(eqn.source_info)
  except (ImportError, AttributeError):
    line = ""
  return f"{eqn.primitive.name} at {line}" if line else eqn.primitive.name


def _reduces(eqn) -> bool:
  if eqn.primitive.name == "dot_general":
    return bool(eqn.params["dimension_numbers"][0][0])
  return eqn.primitive.name in _REDUCTIONS


def shard_local(jaxpr, taints: list, axes: frozenset, exchanged: list, drawn: list) -> list:
  """Propagates through ``jaxpr`` which values depend on a reduction over shard elements that no
  collective over ``axes`` made global (a taint: the reductions' names and lines).

  Args:
    jaxpr: the optimizer's update, or a jaxpr it calls.
    taints: a frozenset of reductions per input.
    axes: the axis names the state is sharded over.
    exchanged: collects the collectives over ``axes`` applied to shard values themselves.
    drawn: collects the draws of random numbers.

  Returns:
    A frozenset of reductions per output.
  """
  taint = dict(zip(jaxpr.invars, taints))
  of = lambda v: (frozenset() if isinstance(v, jax.extend.core.Literal)
                  else taint.get(v, frozenset()))
  for eqn in jaxpr.eqns:
    inputs = frozenset().union(*(of(v) for v in eqn.invars))
    if eqn.primitive.name in COLLECTIVES and _axes_of(eqn) & axes:
      if not inputs:
        exchanged.append(where(eqn))
      out = frozenset()  # made the same on every device: global
    elif _reduces(eqn):
      out = inputs | {where(eqn)}
    else:
      if eqn.primitive.name in _RANDOM:
        drawn.append(where(eqn))
      out = inputs
      for sub in subjaxprs(eqn):
        out = out.union(*shard_local(sub, [inputs] * len(sub.invars), axes, exchanged, drawn))
    for v in eqn.outvars:
      taint[v] = out
  return [of(v) for v in jaxpr.outvars]


def _axes_of(eqn) -> frozenset:
  names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  return frozenset(names if isinstance(names, (tuple, list)) else (names,))


def collectives_over(jaxpr, axes: frozenset) -> list:
  """Every collective of ``jaxpr`` (and of the jaxprs it calls) over one of ``axes``: its primitive
  and the line that made it."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in COLLECTIVES and _axes_of(eqn) & axes:
      found.append(where(eqn))
    for sub in subjaxprs(eqn):
      found += collectives_over(sub, axes)
  return found
