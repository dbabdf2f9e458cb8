"""The main job's training loop: every compressor trained side by side on the same batches.

``train`` builds each compressor's step (``jaxcomp.train.training_step.make_step``: the recipe of
``jaxcomp.train.registry`` for the run's length), reads the bytes each phase's program sends
(``jaxcomp.report`` on the step's HLO), then advances the compressors side by side — step t of
every compressor before step t + 1 of any — so that their step times are measured under the same
load, evaluating on held-out data ``EVALUATIONS`` times; it returns a ``jaxcomp.train.runs.Run``
each.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

import numpy as np

from jaxcomp.train import network, registry, units
from jaxcomp.train.runs import Run, phase_programs, program_key
from jaxcomp.train.training_step import first_copy, make_mesh, make_step


EVALUATIONS = 30
"""Held-out evaluations over a run of ``--steps`` steps (every ``steps // 30`` steps, and at step
0). One evaluation of the chars task costs about 7 training steps on 8 simulated devices (it runs on
one): 30, not 60, keeps the default run within 5 minutes."""


def train(task, names: Sequence[str], *, steps: int, devices: list, batch_size: int, seed: int,
          max_steps: Optional[int] = None, progress: bool = True,
          schedule: str = "constant", stretch: float = 1.0) -> list:
  """Trains ``task`` once per compressor in ``names``, side by side, and returns a ``Run`` each.

  Every compressor runs its recipe for ``steps`` steps, its learning rates on ``schedule``
  (``tasks.SCHEDULES``) — every compressor but allreduce for ``round(stretch · steps)`` steps
  instead, recipe and schedule fitted to that length, where ``stretch`` is not 1 (does the
  compressor reach allreduce's loss when given ``stretch`` times its steps?); then, if
  ``allreduce`` is among them, those that have not reached allreduce's final held-out loss go on
  (side by side) until they do or until ``max_steps`` (default: no extra steps).
  """
  import jax
  import tqdm

  import jaxcomp

  if not stretch >= 1:
    raise ValueError(f"stretch must be at least 1 (times allreduce's steps); got {stretch!r}")
  n = len(devices)
  mesh = make_mesh(devices)
  steps_of = {name: steps if name == "allreduce" else round(stretch * steps) for name in names}
  max_steps = max([max_steps or steps] + list(steps_of.values()))
  every = max(steps // EVALUATIONS, 1)
  params0 = task.init(seed)
  x0, y0 = task.batch(seed, 0, batch_size)
  at_start = (0,) + task.evaluate(params0)  # every run's first evaluation: the same parameters

  def requested(entry, **settings):
    """The report of ``entry``'s steady state with ``settings``, read before XLA optimises: the
    wire dtypes jaxcomp asks for."""
    step = make_step(task, task.optimizer(entry, **settings), mesh)
    lowered = step.lower(*step.start(params0), x0, y0)
    return jaxcomp.comm_report(lowered, stage="lowered", num_devices=n)

  program_bytes, program_collectives = {}, {}
  for key, (name, settings) in tqdm.tqdm(phase_programs(steps_of).items(),
                                         desc="reading bytes", disable=not progress,
                                         file=sys.stderr):
    entry = registry.REGISTRY[name]
    report = requested(entry, **settings)
    program_bytes[key] = entry.bytes_per_step(report)
    program_collectives[key] = network.operands(report)

  runs, states = [], []
  for name in tqdm.tqdm(names, desc="compiling", disable=not progress, file=sys.stderr):
    entry = registry.REGISTRY[name]
    own = steps_of[name]
    step = make_step(task, task.optimizer(entry, steps=own, schedule=schedule), mesh)
    params, opt_state = step.start(params0)
    compiled = step.lower(params, opt_state, x0, y0).compile()
    phases = [(p.first_step, program_key(p.name, p.settings)) for p in entry.phases(own)]
    # A narrow wire dtype's bytes as XLA compiles them (the steady phase's share of the recipe's
    # program): more than requested where it widens bf16.
    steady = phases[-1][1]
    note = ""
    if entry.wire_dtype:
      sent = entry.bytes_per_step(jaxcomp.comm_report(compiled, num_devices=n))
      if sent != program_bytes[steady]:
        note = (f"{name}: XLA:{devices[0].platform.upper()} sends {units.human_bytes(sent)} "
                "after compiling (it widens the wire dtype)")
    run = Run(name, own, phases, {key: program_bytes[key] for _, key in phases},
              program_bytes[steady], note, {key: program_collectives[key] for _, key in phases})
    run.evals.append(at_start)
    runs.append(run)
    states.append([step, compiled, params, opt_state])

  bar = tqdm.tqdm(total=sum(steps_of.values()), desc=f"{task.name} x{len(names)}", unit="step",
                  disable=not progress, file=sys.stderr, mininterval=0.5)
  base = next((r for r in runs if r.name == "allreduce"), None)
  active = list(range(len(runs)))
  for t in range(max_steps):
    # A run ends after its own steps, unless allreduce ran too and the run is still short of its
    # final held-out loss: then it goes on until it reaches it (or diverged) or until max_steps.
    active = [i for i in active if t < runs[i].steps or (
        base is not None and not runs[i].diverged and runs[i].steps_to(base.final[0]) is None)]
    bar.total += sum(max_steps - t for i in active if t == runs[i].steps)
    if not active:
      break
    batch = task.batch(seed, t, batch_size)
    for i in active:
      run, (step, compiled, params, opt_state) = runs[i], states[i]
      start = time.perf_counter()
      params, opt_state, loss = compiled(params, opt_state, *step.dp.shard(batch))
      loss = float(np.mean(jax.device_get(loss)))  # blocks every step (XLA:CPU needs it)
      run.step_seconds.append(time.perf_counter() - start)
      run.losses.append(loss)
      states[i] = [step, compiled, params, opt_state]
      if (t + 1) % every == 0 or t + 1 == run.steps:
        run.evals.append((t + 1,) + task.evaluate(first_copy(params, params0)))
      bar.set_postfix_str(f"{run.name} loss {loss:.3f}", refresh=False)
      bar.update()
  bar.close()
  return runs
