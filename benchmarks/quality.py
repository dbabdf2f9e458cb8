"""Quality on a transformer: every registry entry trained for hundreds of steps, against allreduce.

The main job's machinery (``jaxcomp.train.job.train``: the chars task, the registry's recipes for
the run's length, ``jaxcomp.data_parallel``'s step on W simulated CPU devices, every entry side by
side on the same batches from the same initial parameters), with the learning rates on a schedule
(``--schedule``, default warm-up and cosine decay: ``jaxcomp.train.tasks.learning_rate_schedule``).
Per entry it prints the final held-out loss (the mean of the last evaluations, as the main job's)
and its ratio to allreduce's, the steps until the held-out loss first reaches allreduce's final one
(the target) and their ratio to allreduce's own, and the bytes each device sends per step in the
steady state (``jaxcomp.report``, ring algorithm, requested wire dtypes) with allreduce's bytes /
the entry's. Entries that have not reached the target after their steps go on up to
``--max-steps`` (the recipes and the schedule stay those of their steps, so the rate stays at the
schedule's last).

Under a decaying schedule every run's loss falls most as its rate decays, at its own end, so an
entry a little short of the target at ``--steps`` seldom reaches it in the extra steps, at a tenth
of the peak rate. "Does it reach allreduce's loss within F× allreduce's steps?" is answered by
``--stretch F``: every entry but allreduce trains for F × ``--steps`` steps, its recipe and schedule
fitted to that length, as a user with F× the budget would train it.

  PYTHONPATH=. python benchmarks/quality.py [--quick] [--write] [--compressors a,b] [--steps N]
      [--stretch F]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from jaxcomp.train import job, registry, tasks  # noqa: E402

QUICK = ("allreduce", "fp16")
"""The entries of a ``--quick`` run: the baseline and one compressor."""


def row(run, base, target: float) -> list:
  """One entry's cells: held-out loss (and / the target), steps to the target (and / allreduce's),
  bytes per step (and allreduce's / its)."""
  loss = run.final[0]
  reached = None if run.diverged else run.steps_to(target)
  base_steps = base.steps_to(target) or base.steps
  if run.diverged:
    steps = "diverged"
  elif reached is None:
    steps = f"not in {len(run.losses)}"
  else:
    steps = f"{reached} ({reached / base_steps:.2f}x)"
  fewer = base.bytes_per_step / run.bytes_per_step if run.bytes_per_step else float("inf")
  return [run.name, f"{loss:.3f}", f"{loss / target:.3f}", steps,
          common.human(run.bytes_per_step), f"{fewer:.1f}x"]


def table(runs) -> str:
  """The Markdown table of ``runs`` against allreduce (the first run when allreduce is absent)."""
  base, target = job.target_of(runs)
  return common.markdown_table(
      ["entry", "held-out loss", "/ allreduce's", "steps to allreduce's loss (/ its steps)",
       "sent/step/device", "allreduce's bytes / its"], [row(r, base, target) for r in runs])


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=None,
                 help="training steps per entry, and the recipes' length (default 600, quick 6)")
  p.add_argument("--max-steps", type=int, default=None,
                 help="entries short of allreduce's final held-out loss go on up to this many "
                      "steps (default 1.5 x --steps)")
  p.add_argument("--devices", type=int, default=8, help="data-parallel simulated CPU devices")
  p.add_argument("--schedule", choices=tasks.SCHEDULES, default="cosine",
                 help="every learning rate's schedule (tasks.learning_rate_schedule)")
  p.add_argument("--stretch", type=float, default=1.0,
                 help="every entry but allreduce trains for this many times --steps, its recipe "
                      "and schedule fitted to that length (default 1)")
  args = common.parse(p, argv)
  if not args.stretch >= 1:
    p.error(f"--stretch must be at least 1 (times allreduce's steps); got {args.stretch}")
  steps = args.steps or (6 if args.quick else 600)
  own = round(args.stretch * steps)
  max_steps = args.max_steps or own * 3 // 2
  names = [c.name for c in common.compressors(args.compressors or ",".join(
      QUICK if args.quick else registry.REGISTRY))]
  if "allreduce" not in names:
    names.insert(0, "allreduce")
  devices = job.setup_devices(2 if args.quick else args.devices)
  task = tasks.chars(quick=args.quick)
  start = time.perf_counter()
  runs = job.train(task, names, steps=steps, devices=devices, batch_size=32, seed=0,
                   max_steps=max_steps, progress=not args.quick, schedule=args.schedule,
                   stretch=args.stretch)
  base, target = job.target_of(runs)
  length = (f"{steps} steps with each entry's recipe for {steps}" if own == steps else
            f"allreduce {steps} steps, every other entry {own} ({args.stretch:g}x) with its "
            f"recipe and schedule for {own}")
  body = (f"The chars transformer ({common.num_params(task.init(0)):,} parameters), {length} "
          f"(entries short of the target go on up to "
          f"{max_steps}), {len(devices)} simulated CPU devices, global batch 32, seed 0, learning "
          f"rates {args.schedule} (`tasks.learning_rate_schedule`); "
          f"{time.perf_counter() - start:.0f} s on a machine shared with other jobs. "
          f"Held-out loss: the mean of the last {job.WINDOW} evaluations after the entry's steps; "
          f"target: {base.name}'s, {target:.3f}; bytes: each device's per step in the steady "
          "state (ring algorithm, requested wire dtypes).\n\n" + table(runs))
  common.emit(args, "quality", "Quality on a transformer", "quality.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
