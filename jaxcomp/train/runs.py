"""What a run of the main job produced, and the table that compares the runs.

``Run`` holds one compressor's training (its phases' bytes and collectives, each step's loss and
time, the held-out evaluations); ``target_of`` picks the baseline and its final held-out loss (the
target); ``modelled_to_target`` models the wall-clock until the target at a link speed (the step
measured in the run plus its collectives through the α-β model of ``jaxcomp.train.network``, phase
by phase); ``table`` is the job's Markdown table; ``write_results`` writes a job's
``OUT/results.md`` and ``OUT/results.json``. A run's phases are keyed by the steady-state program
they behave like (``program_key``; ``phase_programs`` lists those of the recipes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from jaxcomp.train import network, registry, units


WINDOW = 5
"""The held-out loss at step t is the mean of the last ``WINDOW`` evaluations up to t (the last
sixth of a run): a single evaluation moves by several percent from step to step at a constant
learning rate."""


@dataclasses.dataclass
class Run:
  """What one compressor's training produced.

  Attributes:
    name: the registry name.
    steps: the run's nominal length (the recipe's); the run may go on past it to reach the target.
    phases: ``[(first_step, program key)]`` of its recipe (``registry.Phase``, ``program_key``).
    program_bytes: ``{program key: bytes each device sends per step}`` (ring algorithm, requested
      wire dtypes).
    bytes_per_step: bytes of the steady (compressing) state.
    wire_note: where XLA sends more than requested (bf16 widened), else "".
    losses, step_seconds: training loss and wall-clock of every step.
    evals: ``[(step, held-out loss, held-out accuracy)]``, step 0 first.
    program_collectives: ``{program key: [(op, bytes, share)]}``, its collectives as the α-β model
      takes them (``network.operands``).
    link_seconds: ``{program key: seconds per step}`` over a slow link, when one was timed.
  """
  name: str
  steps: int
  phases: list
  program_bytes: dict
  bytes_per_step: float
  wire_note: str
  program_collectives: dict = dataclasses.field(default_factory=dict)
  losses: list = dataclasses.field(default_factory=list)
  step_seconds: list = dataclasses.field(default_factory=list)
  evals: list = dataclasses.field(default_factory=list)
  link_seconds: Optional[dict] = None

  def phase_at(self, step: int) -> str:
    """The program key of the phase step ``step`` (0-based) belongs to."""
    return [key for first, key in self.phases if first <= step][-1]

  @property
  def compute_seconds(self) -> dict:
    """``{program key: the median measured step of its phase}`` over the nominal steps, the run's
    first two left out (warming up); a phase with no such step gets the run's median."""
    timed = {}
    for t in range(2, min(self.steps, len(self.step_seconds))):
      timed.setdefault(self.phase_at(t), []).append(self.step_seconds[t])
    whole = self.step_seconds[2:self.steps] or self.step_seconds
    return {key: float(np.median(timed.get(key, whole))) for _, key in self.phases}

  @property
  def median_step_seconds(self) -> float:
    """The median step of the steady phase (``compute_seconds``)."""
    return self.compute_seconds[self.phases[-1][1]]

  def modelled_seconds(self, gbits: float, world: int, alpha: float = network.ALPHA) -> dict:
    """``{program key: modelled seconds per step}`` on ``world`` workers whose links run at
    ``gbits`` Gbit/s: the step measured in the run plus its collectives through the α-β model."""
    beta = network.gbits_to_beta(gbits)
    return {key: compute + network.step_time(self.program_collectives[key], world, alpha, beta)
            for key, compute in self.compute_seconds.items()}

  def held_out(self, step: int) -> tuple:
    """(loss, accuracy) at ``step``: the mean of the last ``WINDOW`` evaluations up to it."""
    done = [e for e in self.evals[1:] if e[0] <= step] or self.evals[:1]
    window = np.asarray([e[1:] for e in done[-WINDOW:]], np.float64)
    return float(window[:, 0].mean()), float(window[:, 1].mean())

  @property
  def final(self) -> tuple:
    """(loss, accuracy) held out after the run's nominal ``steps``."""
    return self.held_out(self.steps)

  @property
  def diverged(self) -> bool:
    """The held-out loss ended non-finite or above where it started."""
    loss = self.final[0]
    return not np.isfinite(loss) or loss > self.evals[0][1]

  def steps_to(self, target: float) -> Optional[int]:
    """The first evaluated step whose held-out loss (``held_out``) is at most ``target``."""
    for step, _, _ in self.evals[1:]:
      if self.held_out(step)[0] <= target:
        return step
    return None

  def bytes_to(self, steps: int) -> float:
    """Bytes each device sent in the first ``steps`` steps, phase by phase."""
    return sum(self.program_bytes[self.phase_at(t)] for t in range(steps))

  def seconds_to(self, steps: int, seconds: dict) -> float:
    """Wall-clock of the first ``steps`` steps at ``seconds[program key]`` per step, phase by
    phase."""
    return sum(seconds[self.phase_at(t)] for t in range(steps))

  def link_seconds_to(self, steps: int) -> float:
    """Wall-clock of the first ``steps`` steps over the timed link: steps × measured step time,
    phase by phase."""
    return self.seconds_to(steps, self.link_seconds)



def program_key(name: str, settings: dict) -> str:
  """A readable, unique key of a steady-state program: ``dgc[ratio=0.25,warmup=None]``."""
  if not settings:
    return name
  return name + "[" + ",".join(f"{k}={settings[k]!r}" for k in sorted(settings)) + "]"


def phase_programs(steps_of: dict) -> dict:
  """``{program key: (registry name, settings)}`` of every phase of the compressors' recipes, each
  for its run's steps (``steps_of``: ``{registry name: steps}``)."""
  programs = {}
  for name, steps in steps_of.items():
    for phase in registry.REGISTRY[name].phases(steps):
      programs[program_key(phase.name, phase.settings)] = (phase.name, phase.settings)
  return programs


def _ratio(value: float, base: float) -> str:
  return f"{value / base:.2f}x" if base else "-"


def target_of(runs: Sequence[Run]) -> tuple:
  """(the baseline run — allreduce, else the first —, its final held-out loss: the target)."""
  base = next((r for r in runs if r.name == "allreduce"), runs[0])
  return base, base.final[0]


def rate_label(gbits: float) -> str:
  """A link speed as people write it: ``1 Gbit/s``, ``100 Mbit/s``."""
  return f"{gbits:g} Gbit/s" if gbits >= 1 else f"{1e3 * gbits:g} Mbit/s"


def modelled_to_target(runs: Sequence[Run], world: int, gbits: Sequence[float]) -> dict:
  """``{gbits: {name: modelled seconds until the held-out loss first reaches the target}}`` (None
  where a run diverged or never reached it) on ``world`` workers whose links run at ``gbits``:
  steps × (the step measured in the run + its collectives through the α-β model), phase by phase."""
  _, target = target_of(runs)
  reached = {r.name: None if r.diverged else r.steps_to(target) for r in runs}
  return {g: {r.name: None if reached[r.name] is None
              else r.seconds_to(reached[r.name], r.modelled_seconds(g, world)) for r in runs}
          for g in gbits}


def modelled_note(world: int, gbits: Sequence[float]) -> str:
  """What the modelled columns are, and how far the model was off on a real link."""
  low, high = network.MEASURED_RATIOS
  rates = ", ".join(map(rate_label, gbits))
  return (f"modelled to target at {rates} per worker: steps to target x "
          f"(the step measured in this run + its collectives' bytes through the α-β model of a "
          f"switched network, W = {world}, α = {1e6 * network.ALPHA:g} µs), phase by phase; the "
          "measured step is this host's, with the collectives between its devices in memory. The "
          f"model's predicted / measured step time over a real rate-limited link was {low:.2f}–"
          f"{high:.2f} (its shared-medium form, benchmarks/slow_link.py in BENCHMARKS.md); the "
          "switched form is unmeasured")


def table(runs: Sequence[Run], world: int = 1, gbits: Sequence[float] = ()) -> str:
  """The results as a Markdown table; ratios are against ``allreduce`` (or the first run).

  "to target" columns: steps (and bytes, the wall-clock modelled for ``world`` workers at each of
  ``gbits`` Gbit/s per worker, and the wall-clock over the link) until the held-out loss first
  reaches allreduce's final held-out loss; held-out loss and accuracy are after the nominal steps.
  """
  base, target = target_of(runs)
  base_steps = base.steps_to(target) or base.steps
  linked = all(r.link_seconds for r in runs)
  modelled = modelled_to_target(runs, world, gbits)
  header = (["compressor", "sent/step/device", "compression", "step time"]
            + (["step over link", "wall-clock to target"] if linked else [])
            + ["steps to target", "sent to target"]
            + [f"to target, {rate_label(g)} (modelled)" for g in gbits]
            + ["held-out loss", "accuracy"])
  rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
  for r in runs:
    loss, accuracy = r.final
    reached = r.steps_to(target)
    if r.diverged:
      to_target = sent = clock = "diverged"
    elif reached is None:
      to_target = f"not in {len(r.losses)}"
      sent = clock = "-"
    else:
      to_target = f"{reached} ({_ratio(reached, base_steps)})"
      sent = (f"{units.human_bytes(r.bytes_to(reached))} "
              f"({_ratio(r.bytes_to(reached), base.bytes_to(base_steps))})")
      if linked:
        clock = _clock(r.link_seconds_to(reached), base.link_seconds_to(base_steps))
    compression = base.bytes_per_step / r.bytes_per_step if r.bytes_per_step else float("inf")
    cells = [r.name, units.human_bytes(r.bytes_per_step), f"{compression:.1f}x",
             _ratio(r.median_step_seconds, base.median_step_seconds)]
    if linked:
      cells += [f"{r.link_seconds[r.phases[-1][1]]:.3f} s", clock]
    cells += [to_target, sent]
    cells += ["diverged" if r.diverged else _clock(modelled[g][r.name], modelled[g][base.name])
              for g in gbits]
    cells += [f"{loss:.3f}" + (" (diverged)" if r.diverged else ""), f"{100 * accuracy:.1f}%"]
    rows.append("| " + " | ".join(cells) + " |")
  notes = [r.wire_note for r in runs if r.wire_note]
  return "\n".join(rows + ([""] + notes if notes else []))


def _clock(seconds: Optional[float], base: Optional[float]) -> str:
  """``12.3 s (0.85x)``: seconds and their ratio to the baseline's; ``-`` when not reached."""
  if seconds is None:
    return "-"
  value = f"{seconds:.0f}" if seconds >= 100 else f"{seconds:#.3g}"
  return f"{value} s ({_ratio(seconds, base)})"


def command_line(argv: Optional[Sequence[str]]) -> str:
  """The ``python -m jaxcomp.train`` command that ran with ``argv`` (None: this process's own)."""
  return ("python -m jaxcomp.train " + " ".join(sys.argv[1:] if argv is None else argv)).strip()


def write_results(out: str, argv: Optional[Sequence[str]], header: str, table: str, note: str,
                  record: dict) -> None:
  """Writes a job's ``OUT/results.md`` (its command, ``header``, ``table`` and ``note``) and
  ``OUT/results.json`` (its command and ``record``)."""
  os.makedirs(out, exist_ok=True)
  command = command_line(argv)
  with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
    f.write(f"`{command}`\n\n{header}\n\n{table}\n\n{note}\n")
  with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
    json.dump({"command": command, **record}, f, indent=1)
