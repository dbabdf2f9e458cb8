"""DGC on the chars transformer: which parts of its recipe close its gap to allreduce's held-out
loss.

Each variant is the registry's ``dgc`` entry (top 0.1% of each matrix, momentum 0.9 inside, masking
on, the paper's four warm-up densities over the first 10% of the steps) with one or more things
changed: the density, the warm-up's length, local gradient clipping (``clip_norm``, the paper's
§3.3), momentum factor masking, AdamW behind it instead of SGD, and where the main job's global
clipping sits. The variants are trained side by side with allreduce by the main job's own loop
(``jaxcomp.train.training_loop.train``: the same batches, initial parameters, learning-rate schedule
and evaluations as ``benchmarks/quality.py``), and the table is ``quality.py``'s.

The main job's optimizer is ``chain(compressor, clip_by_global_norm(1), sgd(lr))``
(``tasks.Task.optimizer``). After allreduce the clip sees the mean gradient; after DGC it sees DGC's
output, the momentum-corrected velocity, whose norm is a multiple of the gradient's (the momentum
sums ~1/(1 - m) steps, and a sent coordinate carries the steps it waited). The ``_unclipped``
variants leave that clip out (``StudyTask``), so DGC's updates are not shrunk where allreduce's are
not; ``_local_clip`` clips each device's gradient before accumulation instead, as the paper does.

  PYTHONPATH=. python benchmarks/dgc_study.py [--steps 600] [--variants dgc,dgc_unclipped]
      [--devices 8] [--out rows.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks import common, quality  # noqa: E402
from jaxcomp.train import device_setup, registry, tasks, training_loop  # noqa: E402
from jaxcomp.train.runs import WINDOW, target_of  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
  """One recipe of the study: a registry entry with its settings changed.

  Attributes:
    about: one line for the legend.
    base: the registry entry it starts from.
    settings: the factory's settings over the entry's (``jaxcomp.dgc``'s keywords).
    warmup: the fraction of the run over which DGC's four warm-up densities ramp (the registry:
      0.1); None keeps the entry's recipe.
    clipped: the main job's ``clip_by_global_norm(1)`` after the compressor (``Task.optimizer``).
    inner: the optimizer behind it, ``"sgd"`` (momentum inside DGC) or ``"adamw"``.
  """
  about: str
  base: str = "dgc"
  settings: dict = dataclasses.field(default_factory=dict)
  warmup: float | None = None
  clipped: bool = True
  inner: str = "sgd"

  def entry(self, name: str) -> registry.Compressor:
    """The registry entry the variant trains as, named ``name``."""
    base = registry.REGISTRY[self.base]
    recipe = base.recipe if self.warmup is None else warmup_recipe(self.warmup)
    return dataclasses.replace(base, name=name, settings={**base.settings, **self.settings},
                               recipe=recipe, inner=self.inner)


def warmup_recipe(fraction: float) -> registry.Recipe | None:
  """The registry's DGC warm-up (``PAPER_WARMUP``'s four densities in equal stages) over the first
  ``fraction`` of the run, instead of its 10%; 0: none."""
  if not fraction:
    return None
  def length(steps: int) -> int:  # the run whose first 10% is this run's first ``fraction``
    return max(round(steps * fraction / registry._WARMUP_FRACTION), 1)
  return registry.Recipe(settings=lambda steps: {"warmup": registry._dgc_stages(length(steps))},
                         phases=lambda steps: registry._dgc_phases(length(steps)))


_MOMENTUM_FREE = {"momentum": 0.0}  # plain accumulation of the gradient: AdamW keeps the moments

VARIANTS = {
    "allreduce": Variant("the f32 mean, SGD with momentum 0.9 (the target)", base="allreduce"),
    "allreduce_inner_adamw": Variant("the f32 mean, AdamW behind it (lr 3e-3, b2 0.99, wd 0.1)",
                               base="allreduce", inner="adamw"),
    "dgc": Variant("the registry's: 0.1%, warm-up over 10%, masking, the job's clip after it"),
    "dgc_unclipped": Variant("dgc without the job's global clip after it", clipped=False),
    "dgc_local_clip": Variant("dgc_unclipped, each device's gradient clipped to 1·W^-1/2 before "
                              "accumulation (the paper's local clipping)", clipped=False,
                              settings={"clip_norm": 1.0}),
    "dgc_1pct": Variant("dgc at 1%", settings={"ratio": 0.01}),
    "dgc_1pct_unclipped": Variant("dgc_unclipped at 1%", settings={"ratio": 0.01},
                                  clipped=False),
    "dgc_0.3pct_unclipped": Variant("dgc_unclipped at 0.3%", settings={"ratio": 0.003},
                                    clipped=False),
    "dgc_0.3pct_warm25_unclipped": Variant("dgc_unclipped at 0.3%, warm-up over 25% of the steps",
                                           settings={"ratio": 0.003}, warmup=0.25, clipped=False),
    "dgc_warm25_unclipped": Variant("dgc_unclipped, warm-up over 25% of the steps", warmup=0.25,
                                    clipped=False),
    "dgc_nowarm_unclipped": Variant("dgc_unclipped without warm-up", warmup=0, clipped=False),
    "dgc_nomask_unclipped": Variant("dgc_unclipped without momentum factor masking",
                                    settings={"momentum_masking": False}, clipped=False),
    "dgc_adamw": Variant("0.1% top-k of the accumulated gradient (momentum 0), AdamW behind it, "
                         "the job's clip between", settings=_MOMENTUM_FREE, inner="adamw"),
    "dgc_adamw_unclipped": Variant("dgc_adamw without the clip", settings=_MOMENTUM_FREE,
                                   inner="adamw", clipped=False),
}
"""Every variant, by name."""

SCREEN = ("allreduce", "allreduce_inner_adamw", "dgc", "dgc_unclipped", "dgc_local_clip",
          "dgc_1pct", "dgc_1pct_unclipped", "dgc_warm25_unclipped", "dgc_nomask_unclipped",
          "dgc_adamw")
"""The default variants: one factor at a time against the registry's entry."""

QUICK = ("allreduce", "dgc", "dgc_unclipped")


@dataclasses.dataclass(frozen=True)
class StudyTask(tasks.Task):
  """``tasks.Task`` whose optimizer leaves out the global clip after the entries in
  ``unclipped``."""
  unclipped: frozenset = frozenset()

  def optimizer(self, entry, steps=None, schedule="constant", clip=True, **overrides):
    return super().optimizer(entry, steps, schedule, clip=clip and entry.name not in self.unclipped,
                             **overrides)


def study_task(task: tasks.Task, names) -> StudyTask:
  """``task`` as a ``StudyTask`` for the variants ``names``."""
  fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(tasks.Task)}
  return StudyTask(**fields, unclipped=frozenset(n for n in names if not VARIANTS[n].clipped))


def variant_names(text: str) -> list:
  """The variants of ``--variants`` (allreduce first, always); an unknown one exits."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in VARIANTS]
  if unknown or not names:
    raise SystemExit(f"--variants: unknown {', '.join(unknown) or '(none)'}; choose from "
                     f"{', '.join(VARIANTS)}")
  return ["allreduce"] + [n for n in dict.fromkeys(names) if n != "allreduce"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="the tiny transformer, 2 devices, 6 steps")
  p.add_argument("--steps", type=int, default=None,
                 help="training steps per variant, and the recipes' length (default 600)")
  p.add_argument("--variants", default=None,
                 help=f"comma-separated variants (default: {','.join(SCREEN)}); choose from "
                      f"{', '.join(VARIANTS)}")
  p.add_argument("--devices", type=int, default=None, help="simulated CPU devices (default 8)")
  p.add_argument("--out", default=None, help="also write the rows as JSON to this file")
  args = p.parse_args(argv)
  steps = args.steps or (6 if args.quick else 600)
  if steps < 1:
    p.error(f"--steps must be a positive number of steps; got {steps}")
  names = variant_names(args.variants or ",".join(QUICK if args.quick else SCREEN))
  devices = device_setup.setup_devices(args.devices or (2 if args.quick else 8))
  task = study_task(tasks.chars(quick=args.quick), names)
  start = time.perf_counter()
  with registry.registered([VARIANTS[n].entry(n) for n in names]):
    runs = training_loop.train(task, names, steps=steps, devices=devices, batch_size=32, seed=0,
                               max_steps=steps, progress=not args.quick, schedule="cosine")
  trained = time.perf_counter() - start
  base, target = target_of(runs)
  whole = {r.name: r.bytes_to(r.steps) / r.steps for r in runs}  # warm-up's dense steps included
  header = quality.HEADER + ["whole run: allreduce's bytes / its"]
  rows = [quality.row(r, base, target) + [f"{whole[base.name] / whole[r.name]:.1f}x"]
          for r in runs]
  params = common.num_params(jax.eval_shape(task.init, 0))
  common.write_out(args.out, "dgc_study.py", argv, header, rows, True, steps=steps,
                   seconds=round(trained, 1), params=params, target=target,
                   losses={r.name: r.final[0] for r in runs})
  print(f"The chars transformer ({params:,} parameters), {steps} steps, {len(devices)} simulated "
        f"CPU devices, global batch 32, seed 0, learning rates cosine; {trained:.0f} s training. "
        f"Held-out loss: the mean of the last {WINDOW} evaluations; target: allreduce's, "
        f"{target:.3f}; bytes: each device's per step in the steady state (ring), and over the "
        "whole run (the warm-up's dense and denser steps included).\n")
  print(common.markdown_table(header, rows) + "\n")
  print("\n".join(f"* `{n}`: {VARIANTS[n].about}" for n in names))
  return 0


if __name__ == "__main__":
  sys.exit(main())
