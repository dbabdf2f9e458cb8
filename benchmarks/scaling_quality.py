"""Quality against model size and bits: each method's held-out loss gap to AdamW's data-parallel
training at several sizes of the chars transformer, and its loss against the bits it sends.

The papers measure communication-efficient training so (Charles et al. 2025, "Scaling Laws for
DiLoCo": the gap to data-parallel training against model size; MuLoCo: the loss against total bits
sent). Each size of ``SIZES`` (``tasks.CHARS_SIZES``: 32, 64 and 128 wide, two blocks, about 4×
apart in parameters) trains for ``--tokens-per-param`` tokens per parameter, its global batch
doubling with the width (so the steps grow by 1.8× per size), on 8 simulated CPU devices, every
entry of ``ENTRIES`` from the same initial parameters on the same batches, with the learning rates
of the registry's baselines on a warm-up and cosine schedule (``tasks.learning_rate_schedule``):
AdamW 3e-3 (b2 0.95, weight decay 0.1) inside the DiLoCo family and after the gradient
compressors, Muon 0.02 inside MuLoCo. Seeds 0, 1, 2 at the smallest size (the further seeds for
``SEED_ENTRIES`` only), seed 0 at the others.

Each run appends one JSON object to ``--results`` (one line, written as the run finishes; a run
already there is not run again, so an interrupted study resumes where it stopped): the result
format, which the planner reads too —

  entry, size, width, depth, seed: what ran (``size`` a key of ``tasks.CHARS_SIZES``);
  params: the model's parameters; steps, batch: its steps and global batch (sequences of 64);
  tokens: steps · batch · 64, the characters it trained on;
  heldout_loss: the held-out loss (256 windows of the last tenth of the text) of the devices'
    parameters averaged at the end (what a last synchronization would give; the same as any
    device's for data-parallel entries);
  evals: ``[[step, held-out loss], ...]``, 20 evaluations and the last;
  bytes_per_step: what each device sends per step (ring algorithm, requested wire dtypes, the
    recipe's phases weighted by their steps; ``jaxcomp.comm_report``);
  bits_per_device: 8 · the bytes each device sent over the run;
  allreduce_loss, allreduce_bits_per_device: the baseline's (``allreduce_adamw``), same size and
    seed;
  steps_to_allreduce_loss: the first evaluated step whose held-out loss is at most
    ``allreduce_loss``, or null;
  seconds, date, machine, command.

``--report`` (implied by a finished study) prints the table of the gap against size, draws the
gap against the parameters and the loss against the bits (with each size's Pareto front), and with
``--write`` replaces the section "Quality against model size and bits" of BENCHMARKS.md.

  nice -n 19 env PYTHONPATH=. python benchmarks/scaling_quality.py --write   # about 3 hours
  PYTHONPATH=. python benchmarks/scaling_quality.py --quick                 # a minute or two
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.scaling_report import report  # noqa: E402  (the table, the plots, the findings)
from jaxcomp.train import device_setup, tasks  # noqa: E402

SIZES = {"32x2": 16, "64x2": 32, "128x2": 64}
"""The sizes of the study and each one's global batch (sequences of 64 characters)."""
QUICK_SIZES = {"16x1": 8, "32x2": 8}
BASELINE = "allreduce_adamw"
ENTRIES = ("allreduce_adamw", "allreduce_muon", "diloco_maxtext", "muloco", "sparseloco_covenant",
           "streaming_diloco_fp4", "desloc_kx32", "dion_r8", "demo", "powersgd_r4",
           "quantized_int8")
"""The study's entries (registry names; the baseline first). DiLoCo is MaxText's recipe (H = 36,
the paper's H = 500 is longer than these runs); DES-LOC runs the paper's ratios Ku = 3Kx,
Kv = 6Kx at Kx = 32 (``VARIANTS``), a period of DiLoCo's order (the paper's Kx = 256 would
average the parameters one to four times in a run here)."""
VARIANTS = {"desloc_kx32": ("desloc", {"param_sync_every": 32, "first_moment_sync_every": 96,
                                       "second_moment_sync_every": 192})}
QUICK_ENTRIES = ("allreduce_adamw", "muloco", "desloc_kx32")
SEEDS = 3
"""Seeds at the smallest size, to say what a gap of 1% means there."""
SEED_ENTRIES = ("allreduce_adamw", "diloco_maxtext", "muloco", "sparseloco_covenant")
"""The entries the further seeds run, and each size runs first: the baseline and the methods whose
gap the papers follow with size (the rest once, after them, to keep the study within ``HOURS`` of
a shared 2-core machine)."""
PRIORITY = SEED_ENTRIES + ("streaming_diloco_fp4",)
"""The entries each larger size runs first: ``SEED_ENTRIES`` and the other at ≥ 100× fewer bytes."""
HOURS = 4.0
"""No run starts later than this many hours after the study's first record (``--hours``)."""
EVALUATIONS = 20
ADAMW = dict(learning_rate=3e-3, b2=0.95, weight_decay=0.1)
MUON = 0.02
RESULTS = os.path.join(common.ROOT, "benchmarks", "scaling_quality.jsonl")


def schedule(peak: float, steps: int):
  return tasks.learning_rate_schedule(peak, steps, "cosine")


def optimizer(entry, steps: int):
  """The entry's optimizer for a run of ``steps`` steps: its recipe, the study's rates on a
  schedule."""
  import optax

  from jaxcomp.train import entries
  adamw = optax.adamw(schedule(ADAMW["learning_rate"], steps), b2=ADAMW["b2"],
                      weight_decay=ADAMW["weight_decay"])
  if entry.is_optimizer:  # its own rates, each on the schedule
    rates = {k: schedule(v, steps) for k, v in entry.settings.items()
             if k.endswith("learning_rate")}
    return entry.make("batch", steps, **rates)
  if entry.inner == "muon":
    return entry.optimizer(entries.muon(schedule(MUON, steps),
                                        schedule(ADAMW["learning_rate"], steps), 0.01),
                           steps=steps)
  return entry.optimizer(adamw, steps=steps)


def run_one(task, name: str, size: str, batch: int, seed: int, tokens_per_param: float,
            devices) -> dict:
  """Trains entry ``name`` once; its result record (the module docstring)."""
  import jax
  import numpy as np

  import jaxcomp
  from jaxcomp.train import registry, training_step

  entry = registry.REGISTRY[name]
  params0 = task.init(seed)
  params = sum(int(np.size(x)) for x in jax.tree.leaves(params0))
  context = task.model.context
  steps = max(round(tokens_per_param * params / (batch * context)), 1)
  mesh = training_step.make_mesh(devices)
  x0, y0 = task.batch(seed, 0, batch)
  # Bytes: each phase of the recipe's steady program, lowered (the requested wire dtypes).
  phases = entry.phases(steps)
  sent = 0.0
  for phase, end in zip(phases, [p.first_step for p in phases[1:]] + [steps]):
    program = registry.REGISTRY[phase.name]
    step = training_step.make_step(task, optimizer(program, steps), mesh)
    report = jaxcomp.comm_report(step.lower(*step.start(params0), x0, y0), stage="lowered",
                                 num_devices=len(devices))
    sent += program.bytes_per_step(report) * (end - phase.first_step)
  step = training_step.make_step(task, optimizer(entry, steps), mesh)
  state = step.start(params0)
  compiled = step.lower(*state, x0, y0).compile()
  start = time.perf_counter()
  every = max(steps // EVALUATIONS, 1)
  evals = [[0, task.evaluate(params0)[0]]]
  for t in range(steps):
    *state, loss = compiled(*state, *step.dp.shard(task.batch(seed, t, batch)))
    loss = float(np.mean(jax.device_get(loss)))  # blocks every step (XLA:CPU needs it)
    if (t + 1) % every == 0 or t + 1 == steps:
      evals.append([t + 1, task.evaluate(averaged(state[0], params0))[0]])
  return dict(entry=name, size=size, width=task.model.width, depth=task.model.depth, seed=seed,
              params=params, steps=steps, batch=batch, tokens=steps * batch * context,
              heldout_loss=evals[-1][1], evals=evals, bytes_per_step=sent / steps,
              bits_per_device=8 * sent, seconds=round(time.perf_counter() - start, 1),
              date=time.strftime("%Y-%m-%d %H:%M"), machine=common.machine())


def averaged(params, like):
  """The devices' parameters averaged, on the host, shaped as ``like``: a stacked leaf (one copy
  per device: local steps) is averaged, a replicated one read from the first device."""
  import jax
  import numpy as np

  def mean(x, ref):
    if x.shape == np.shape(ref):
      return np.asarray(x.addressable_shards[0].data)
    return np.mean([np.asarray(s.data) for s in x.addressable_shards], axis=0).reshape(
        np.shape(ref))
  return jax.tree.map(mean, params, like)


def read(path: str) -> list:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def with_baseline(record: dict, baseline: dict) -> dict:
  """``record`` with the baseline's loss and bits of the same size and seed, and its steps to the
  baseline's loss."""
  target = baseline["heldout_loss"]
  reached = [s for s, loss in record["evals"][1:] if loss <= target]
  return dict(record, allreduce_loss=target,
              allreduce_bits_per_device=baseline["bits_per_device"],
              steps_to_allreduce_loss=reached[0] if reached else None)


def run_order(sizes: dict, names: tuple, seeds: int) -> list:
  """The runs ``[(size, seed, entry)]`` in the order the study takes them: every entry at the
  smallest size, the further seeds there (``SEED_ENTRIES``), then the larger sizes, smallest first,
  each with ``PRIORITY`` first; the baseline first wherever it is."""
  first = [n for n in names if n in PRIORITY] + [n for n in names if n not in PRIORITY]
  shapes = tasks.CHARS_SIZES
  ordered = sorted(sizes, key=lambda s: (shapes[s]["width"], shapes[s]["depth"]))
  runs = [(ordered[0], 0, n) for n in names]
  runs += [(ordered[0], seed, n) for seed in range(1, seeds) for n in first if n in SEED_ENTRIES]
  return runs + [(size, 0, n) for size in ordered[1:] for n in first]


def study(args, sizes: dict, names: tuple) -> list:
  """Runs every (size, seed, entry) of ``run_order`` missing from ``args.results``, appending each
  record as it finishes, until ``args.hours`` after the first record; returns them all."""
  from jaxcomp.train import registry

  done = read(args.results)
  have = {(r["size"], r["seed"], r["entry"]) for r in done}
  began = (time.mktime(time.strptime(done[0]["date"], "%Y-%m-%d %H:%M")) - done[0]["seconds"]
           if done else time.time())
  devices = device_setup.setup_devices(8)
  import jax
  # The seeds of a size run the same programs: compiled once (minutes each on a busy machine),
  # then read back from JAX's persistent cache, which also serves a resumed study.
  jax.config.update("jax_compilation_cache_dir",
                    os.path.join(tempfile.gettempdir(), "jaxcomp_scaling_quality_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  variants = [registry.variant(n, *VARIANTS[n]) for n in names if n in VARIANTS]
  task_of = {}
  with registry.registered(variants):
    for size, seed, name in run_order(sizes, names, args.seeds):
      if (size, seed, name) in have:
        continue
      if time.time() > began + 3600 * args.hours:
        print(f"{args.hours:g} hours since the study began: {size} seed {seed} {name} and the "
              "runs after it left out (--hours)", flush=True)
        break
      task = task_of.setdefault(size, tasks.chars(size=size))
      record = run_one(task, name, size, sizes[size], seed, args.tokens_per_param, devices)
      base = next((r for r in done + [record] if (r["size"], r["seed"], r["entry"])
                   == (size, seed, BASELINE)), None)
      record = dict(with_baseline(record, base), command=common.command(
          "scaling_quality.py", args.argv))
      with open(args.results, "a") as f:
        f.write(json.dumps(record) + "\n")
      done.append(record)
      print(f"{size} seed {seed} {name}: held-out {record['heldout_loss']:.4f} "
            f"({record['heldout_loss'] / record['allreduce_loss'] - 1:+.2%}), "
            f"{record['bits_per_device'] / 8e6:.1f} MB sent, {record['seconds']:.0f} s",
            flush=True)
  return done



def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--results", default=None,
                 help=f"the results file, appended to (default {os.path.relpath(RESULTS)}; "
                      "--quick: a file in the temporary directory)")
  p.add_argument("--tokens-per-param", type=float, default=None,
                 help="training tokens per parameter at every size (default 10; quick 0.5)")
  p.add_argument("--seeds", type=int, default=None,
                 help=f"seeds at the smallest size (default {SEEDS}; quick 1)")
  p.add_argument("--sizes", default=None, metavar="SIZE:BATCH,...",
                 help="the sizes (tasks.CHARS_SIZES) and their global batches (default "
                      + ",".join(f"{s}:{b}" for s, b in SIZES.items()) + ")")
  p.add_argument("--hours", type=float, default=HOURS,
                 help=f"start no run later than this many hours after the study's first record "
                      f"(default {HOURS:g})")
  p.add_argument("--report", action="store_true",
                 help="train nothing: the table and plots of the results so far")
  args = common.parse(p, argv)
  sizes = QUICK_SIZES if args.quick else SIZES
  if args.sizes:
    try:
      sizes = {s: int(b) for s, b in (item.split(":") for item in args.sizes.split(","))}
    except ValueError:
      p.error(f"--sizes: expected SIZE:BATCH,... (e.g. 64x2:32); got {args.sizes!r}")
    unknown = [s for s in sizes if s not in tasks.CHARS_SIZES]
    if unknown:
      p.error(f"--sizes: unknown {', '.join(unknown)}; choose from {', '.join(tasks.CHARS_SIZES)}")
  names = QUICK_ENTRIES if args.quick else ENTRIES
  if args.compressors:
    names = tuple(n.strip() for n in args.compressors.split(","))
    if names[0] != BASELINE:
      p.error(f"--compressors: the first entry must be the baseline, {BASELINE}")
  args.tokens_per_param = args.tokens_per_param or (0.5 if args.quick else 10)
  args.seeds = args.seeds or (1 if args.quick else SEEDS)
  if args.results is None:
    args.results = (os.path.join(tempfile.mkdtemp(), "results.jsonl") if args.quick
                    else RESULTS)
  records = read(args.results) if args.report else study(args, sizes, names)
  body = report(records, names, os.path.dirname(args.results) if args.quick else
                os.path.join(common.ROOT, "benchmarks"))
  common.emit(args, "scaling_quality", "Quality against model size and bits",
              "scaling_quality.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
