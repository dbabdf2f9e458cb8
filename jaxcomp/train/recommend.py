"""The planner's answer: one way to train for the user's model, devices, link and device, with its
reasons, the runner-up, and the link speeds at which the answer changes.

The ranking, at each link speed: every registry entry whose steps to target were measured and
reached (``evidence``), whose update compiled and whose bytes are known, ordered by its projected
time to target over allreduce's, overlap credited (``planner``'s stated assumption; the answer
without the credit is said where it differs). Where the model with DDP and Adam does not fit the
device's memory (``device_gib``: the parameters and the transformation's state with Adam, as the
"Fully sharded" table counts them; the gradient, activations and temporaries not counted), only
the ways that fit are ranked, and the exact sharded ways to train enter: ZeRO-1/2 and
``jaxcomp.fully_sharded`` with exact gathers and scatters, whose steps to target are allreduce's
by construction (the same arithmetic), their communication hidden behind the model's step up to
its length (FSDP prefetches the next layer's parameters while this one computes; ZeRO's
reduce-scatter runs bucket by bucket in the backward pass), their update costed as allreduce's.

Not ranked, and said: entries not measured (what to run), entries that did not reach the target
where they were measured (a lower bound: they would have to reach it within a stated factor of
allreduce's steps to win), entries that diverged.

What limits the answer: the link (exposed communication longer than the compute), the compute, the
memory (DDP does not fit), and the quality evidence — the steps ratio measured at a model size far
below the user's is flagged with the command that measures it at the user's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from jaxcomp.train import network, step_cost, wire

GIB = 2**30
EXACT_SHARDED = ("ZeRO-1/2 exact", "FSDP exact")
"""The sharded ways to train that compute what DDP computes, ranked where DDP does not fit."""


@dataclasses.dataclass
class Candidate:
  """A way to train in the ranking: its ``label``, its time to target over allreduce's as a
  function of the link speed (``ratio(gbits, credit)``), its bytes of memory per device, its steps
  ratio and their source."""
  label: str
  ratio: Callable
  memory: int
  steps: float
  source: str


@dataclasses.dataclass
class Recommendation:
  """The answer at one link speed (None where there is none).

  Attributes:
    gbits: the link speed.
    winner, runner_up: the first two ``Candidate``\\ s.
    ranking: every candidate, ``[(label, time to target / allreduce's)]``, fastest first.
    step_ms, compute_ms: the winner's projected step (overlap credited) and its compute.
    vs_bf16: the winner's time to target over bf16's (None: bf16 not ranked).
    fits: whether DDP with Adam fits the device (None: no memory given).
    limit: "the link", "compute" or "memory".
    without_credit: the winner without the overlap credit, where it differs.
    below, above: ``(gbits, label)``: the nearest speeds at which the answer changes.
    thin: ``[(label, reason)]`` of entries that could win but whose evidence is too thin.
    not_ranked: ``[(label, reason)]``.
    measure: a command that measures the steps to target at this model size.
  """
  gbits: float
  winner: Optional[Candidate] = None
  runner_up: Optional[Candidate] = None
  ranking: list = dataclasses.field(default_factory=list)
  step_ms: Optional[float] = None
  compute_ms: Optional[float] = None
  vs_bf16: Optional[float] = None
  fits: Optional[bool] = None
  limit: Optional[str] = None
  without_credit: Optional[str] = None
  below: Optional[tuple] = None
  above: Optional[tuple] = None
  thin: list = dataclasses.field(default_factory=list)
  not_ranked: list = dataclasses.field(default_factory=list)
  measure: Optional[str] = None


def _entries(result, context) -> tuple:
  """``(candidates, thin, not ranked)`` among the registry entries."""
  backward_s = step_cost.BACKWARD * context.model_s
  out, thin, skipped = [], [], []
  for row in result.rows:
    run = result.sources.get(row.steps_source) if row.steps_source else None
    base_steps = run["base_steps"] if run else 1000
    if row.update_ms is None or row.sent is None:
      skipped.append((row.name, "its update did not compile" if row.update_ms is None
                      else "its bytes have no formula"))
      continue
    if not row.points:
      skipped.append((row.name, "steps to target not measured"))
      continue
    if row.diverged:
      skipped.append((row.name, f"diverged [{row.steps_source}]"))
      continue
    mine = context.programs(row.name, run, round(row.steps_ratio * base_steps))
    theirs = context.programs("allreduce", run, base_steps)

    def ratio(g, credit=True, mine=mine, theirs=theirs):
      return (step_cost.seconds(mine, context.world, result.alpha, g, backward_s, credit)
              / step_cost.seconds(theirs, context.world, result.alpha, g, backward_s, credit))
    candidate = Candidate(row.name, ratio, row.memory, row.steps_ratio, row.steps_source)
    (thin if row.steps_bound else out).append(candidate)
  return out, thin, skipped


def _sharded(result, context) -> list:
  """The exact sharded ways to train as candidates (module docstring)."""
  allreduce = context.update_s["allreduce"]
  theirs = context.programs("allreduce", None, 1)
  backward_s = step_cost.BACKWARD * context.model_s
  out = []
  for row in result.fsdp:
    if row.label not in EXACT_SHARDED:
      continue
    sent = (wire.zero_messages(context.tree, context.world) if row.label.startswith("ZeRO")
            else wire.fsdp_messages(context.tree, context.world))
    ops = wire.operands(sent, context.world)
    compute_s = context.model_s + allreduce

    def ratio(g, credit=True, ops=ops, compute_s=compute_s):
      comm = network.step_time(ops, context.world, result.alpha, network.gbits_to_beta(g))
      mine = compute_s + comm - (min(comm, context.model_s) if credit else 0.0)
      return mine / step_cost.seconds(theirs, context.world, result.alpha, g, backward_s, credit)
    out.append(Candidate(row.label, ratio, row.total, 1.0,
                         "exact: allreduce's steps by construction"))
  return out


def _switch(candidates: list, gbits: float, winner: str) -> tuple:
  """``(below, above)``: the nearest link speeds, each ``(gbits, label)``, at which another
  candidate wins (None: not within a factor of 10,000)."""
  def best(g):
    return min(candidates, key=lambda c: c.ratio(g)).label
  found = []
  for grid in (np.geomspace(gbits, gbits / 1e4, 81), np.geomspace(gbits, gbits * 1e4, 81)):
    change = None
    for g in grid[1:]:
      label = best(g)
      if label != winner:
        change = (float(g), label)
        break
    found.append(change)
  return tuple(found)


def measure_command(result, names: list) -> str:
  """The commands that measure the steps to target of ``names`` with the job and plan again."""
  listed = ",".join(dict.fromkeys(["allreduce", "bf16"] + names))
  return (f"python -m jaxcomp.train --compressors {listed} --steps 2000 --out run && "
          f"python -m jaxcomp.train --plan {result.model} --devices {result.world} --gbits "
          f"{','.join(f'{g:g}' for g in result.gbits)} --device {result.device.name} "
          "--from-run run/results.json")


def recommend(result, context, gbits: float) -> Recommendation:
  """The answer at ``gbits`` for a ``planner.Plan`` (its rows filled) and its ``Context``."""
  out = Recommendation(gbits)
  candidates, thin, out.not_ranked = _entries(result, context)
  limit = result.device_gib * GIB if result.device_gib else None
  ddp = next((r for r in result.rows if r.name == "allreduce"), None)
  out.fits = None if limit is None or ddp is None else ddp.memory <= limit
  if limit is not None:
    too_big = [c for c in candidates if c.memory > limit]
    out.not_ranked += [(c.label, f"needs {c.memory / GIB:.1f} GiB a device, over "
                        f"{result.device_gib:g}") for c in too_big]
    candidates = [c for c in candidates if c.memory <= limit]
    if out.fits is False:
      candidates += [c for c in _sharded(result, context) if c.memory <= limit]
  if not candidates:
    return out
  ranked = sorted(candidates, key=lambda c: c.ratio(gbits))
  out.ranking = [(c.label, c.ratio(gbits)) for c in ranked]
  out.winner = ranked[0]
  out.runner_up = ranked[1] if len(ranked) > 1 else None
  bare = min(candidates, key=lambda c: c.ratio(gbits, False)).label
  out.without_credit = bare if bare != out.winner.label else None
  out.below, out.above = _switch(candidates, gbits, out.winner.label)
  best = out.winner.ratio(gbits)
  out.thin = [(c.label, f"did not reach the target in {c.steps:.2f}x allreduce's steps "
               f"[{c.source}]; it wins if it reaches it within "
               f"{c.steps * best / c.ratio(gbits):.2f}x")
              for c in thin if c.ratio(gbits) < best]
  bf16 = next((c for c in candidates if c.label == "bf16"), None)
  out.vs_bf16 = best / bf16.ratio(gbits) if bf16 else None
  row = next((r for r in result.rows if r.name == out.winner.label), None)
  if row is not None:
    out.step_ms = row.step_credit_ms.get(gbits)
    out.compute_ms = result.model_ms + (row.update_ms or 0.0)
  else:  # a sharded way to train: its step from its ratio against allreduce's
    base = next(r for r in result.rows if r.name == "allreduce")
    out.step_ms = best * base.step_credit_ms.get(gbits, 0.0)
    out.compute_ms = result.model_ms + (base.update_ms or 0.0)
  out.limit = ("memory" if out.fits is False else "the link"
               if out.step_ms is not None and out.step_ms - out.compute_ms > out.compute_ms
               else "compute")
  largest = max((p.params for r in result.rows for p in r.points), default=0)
  if largest * 10 < result.params:
    out.measure = measure_command(result, [c.label for c in ranked[:3] if c.label in
                                           {r.name for r in result.rows}] +
                                  [label for label, _ in out.thin])
  return out

