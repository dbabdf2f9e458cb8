"""Reading a traced program (a jaxpr): which collectives it runs, and what it computes from what.

Some misuses show only in what a function computes, not in its Python objects: an inner optimizer
that communicates over the axis of the local steps around it (``local_steps.local_update``), an
optimizer that reduces over a shard's elements under ``jaxcomp.sharded_optimizer``
(``zero.elementwise_update``). The functions below read a ``jax.make_jaxpr`` of it, at trace time,
so the checks cost nothing when the step runs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.extend

from jaxcomp._src import jax_internals, phases

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
  line = jax_internals.source_line(eqn)
  return f"{eqn.primitive.name} at {line}" if line else eqn.primitive.name


def traced_once(fn, *args) -> tuple:
  """``(fn(*args), its closed jaxpr)``, ``fn`` traced once: its program, to be read, and its
  results, computed by that program in the trace that called this (``jaxpr_as_fun``)."""
  program, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
  outputs = jax.extend.core.jaxpr_as_fun(program)(*jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(shapes), outputs), program


def _reduces(eqn) -> bool:
  if eqn.primitive.name == "dot_general":
    return bool(eqn.params["dimension_numbers"][0][0])
  return eqn.primitive.name in _REDUCTIONS


def shard_local(jaxpr, taints: list, axes: frozenset, exchanged: list, drawn: list,
                typed: bool = False) -> list:
  """Propagates through ``jaxpr`` which values depend on a reduction over shard elements that no
  collective over ``axes`` made global (a taint: the reductions' names and lines).

  Args:
    jaxpr: the optimizer's update, or a jaxpr it calls.
    taints: a frozenset of reductions per input.
    axes: the axis names the state is sharded over.
    exchanged: collects the collectives over ``axes`` applied to shard values themselves.
    drawn: collects the draws of random numbers.
    typed: the values are typed varying or invariant along ``axes`` (``shard_map(check_vma=True)``):
      a reduction of values the same on every device (a leaf kept whole on every device) is over
      the whole leaf, not over a shard.

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
    elif _reduces(eqn) and (not typed or any(
        declared_varying(v) & axes for v in eqn.invars
        if not isinstance(v, jax.extend.core.Literal))):
      out = inputs | {where(eqn)}
    else:
      if eqn.primitive.name in _RANDOM:
        drawn.append(where(eqn))
      out = inputs
      for sub in subjaxprs(eqn):
        out = out.union(*shard_local(sub, [inputs] * len(sub.invars), axes, exchanged, drawn,
                                     typed))
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


# --------------------------------------------------------- what differs from device to device

# Collectives whose result is the same on every device of their axes, and those whose result is
# each device's own.
_SAME_EVERYWHERE = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather",
                              "all_gather_invariant", "pbroadcast"})
_EACH_ITS_OWN = frozenset({"all_to_all", "reduce_scatter", "psum_scatter", "ppermute",
                           "axis_index"})
# Equations whose jaxpr takes the equation's operands one for one (a jit, a rematerialisation, a
# custom derivative's primal function).
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


class Hazard(NamedTuple):
  """A collective that runs only on the devices whose own values take a branch.

  Attributes:
    decision: the conditional or loop (its primitive and the line that made it).
    collectives: the collectives under it over the axes its predicate differs along.
    axes: those axes.
  """
  decision: str
  collectives: tuple
  axes: frozenset


def declared_varying(var) -> frozenset:
  """The axes along which ``shard_map(check_vma=True)`` types the jaxpr variable ``var`` as
  differing from device to device (empty elsewhere)."""
  aval = getattr(var, "aval", None)
  vma = getattr(aval, "vma", None)  # jax 0.6 – 0.9
  if vma is None:  # jax 0.10: the aval's manual-axis type
    vma = getattr(getattr(aval, "mat", None), "varying", ())
  return frozenset(vma)


def collective_axes(jaxpr) -> dict:
  """Every axis a collective of ``jaxpr`` (or of a jaxpr it calls) runs over: its collectives
  (``where``), by axis."""
  found: dict = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in COLLECTIVES:
      for name in _axes_of(eqn):
        found.setdefault(name, []).append(where(eqn))
    for sub in subjaxprs(eqn):
      for name, places in collective_axes(sub).items():
        found.setdefault(name, []).extend(places)
  return found


def varying(jaxpr, seeds: list, hazards: list) -> list:
  """Which values of ``jaxpr`` differ from device to device: from ``seeds`` (per input, the axes
  along which it differs), through every equation (a collective that makes its result the same
  on every device clears its axes; ``axis_index``, an all-to-all or ``pvary`` adds them), into
  the jaxprs it calls. Per output, the axes along which it differs.

  ``hazards`` collects every ``Hazard``: a conditional or loop whose predicate differs along an
  axis that a collective under it runs over. The devices whose own values decide otherwise skip
  that collective (or run it again) while the others wait in it.
  """
  taint = dict(zip(jaxpr.invars, seeds))
  of = lambda v: (frozenset() if isinstance(v, jax.extend.core.Literal)  # noqa: E731
                  else taint.get(v, frozenset()))
  for eqn in jaxpr.eqns:
    inputs = [of(v) for v in eqn.invars]
    outputs = _varying_outputs(eqn, inputs, hazards)
    for v, axes in zip(eqn.outvars, outputs):
      taint[v] = axes
  return [of(v) for v in jaxpr.outvars]


def _varying_outputs(eqn, inputs: list, hazards: list) -> list:
  """``varying`` for one equation: the axes along which each of its outputs differs."""
  name, every = eqn.primitive.name, frozenset().union(*inputs)
  count = len(eqn.outvars)
  if name in _SAME_EVERYWHERE:
    return [every - _axes_of(eqn)] * count
  if name in _EACH_ITS_OWN:
    return [every | _axes_of(eqn)] * count
  if name in _TYPE_ONLY:
    return [every | _axes_of(eqn) if eqn.params.get("to", "varying") == "varying" else every
            ] * count
  if name == "cond":
    predicate, operands = inputs[0], inputs[1:]
    outs = [frozenset()] * count
    for branch in eqn.params["branches"]:
      _hazard(eqn, predicate, branch.jaxpr, hazards)
      outs = [a | b for a, b in zip(outs, varying(branch.jaxpr, operands, hazards))]
    return [axes | predicate for axes in outs]
  if name == "while":
    return _while(eqn, inputs, hazards)
  if name == "scan":
    return _scan(eqn, inputs, hazards)
  subs = subjaxprs(eqn)
  if name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(inputs):
    return varying(subs[0], inputs, hazards)
  for sub in subs:  # anything else: every input may reach every output
    every = every.union(*varying(sub, [every] * len(sub.invars), hazards))
  return [every] * count


def _hazard(eqn, predicate: frozenset, body, hazards: list) -> None:
  """Records a ``Hazard`` where a collective of ``body`` runs over an axis ``predicate`` differs
  along; not for jaxcomp's own phases (``phases.AGREED``), chosen by a count every device holds
  alike."""
  if phases.AGREED in jax_internals.name_stack(eqn):
    return
  under = {a: places for a, places in collective_axes(body).items() if a in predicate}
  if under:
    hazards.append(Hazard(where(eqn), tuple(p for places in under.values() for p in places),
                          frozenset(under)))


def _fixed_point(body, consts: list, carry: list, rest: list, hazards: list) -> tuple:
  """A loop's carry: the axes of ``carry`` once ``body`` (on ``consts + carry + rest``) adds no
  more; ``(carry, body's outputs)``, the last pass recording its hazards."""
  while True:
    outs = varying(body, consts + carry + rest, [])
    grown = [a | b for a, b in zip(carry, outs)]
    if grown == carry:
      return carry, varying(body, consts + carry + rest, hazards)
    carry = grown


def _while(eqn, inputs: list, hazards: list) -> list:
  cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
  nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  cond_consts, body_consts, carry = inputs[:nc], inputs[nc:nc + nb], inputs[nc + nb:]
  carry, _ = _fixed_point(body, body_consts, carry, [], hazards)
  predicate = varying(cond, cond_consts + carry, hazards)[0]
  _hazard(eqn, predicate, body, hazards)
  return [axes | predicate for axes in carry]


def _scan(eqn, inputs: list, hazards: list) -> list:
  body = eqn.params["jaxpr"].jaxpr
  nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
  consts, carry, xs = inputs[:nc], inputs[nc:nc + ncarry], inputs[nc + ncarry:]
  carry, outs = _fixed_point(body, consts, carry, xs, hazards)
  return carry + outs[ncarry:]
