"""Chaos: DiLoCo across 3 nodes over a slow link while processes are killed and restarted, jaxcomp's
fault-tolerant DiLoCo beside torchft's.

Every run is a job of 3 nodes, one process each, over links of ``--rate`` each way
(``jaxcomp.train.namespaces.Nodes``), on the chars transformer of ``benchmarks/torchft_diloco.py``
(the same initial parameters, inner AdamW after clipping, outer Nesterov SGD, H = 20; each process
trains its own 16 rows of the global batch of 48 of the job's step):

* jaxcomp: ``jaxcomp.train.fault_tolerant.train``, one process per node with 3 CPU devices (the
  synchronizations of successive memberships need device lists never used before);
* torch: ``torchft_diloco.py``'s port of the model in torchft 0.2.0's ``DiLoCo`` with a
  ``Lighthouse`` on node 0 (``min_replicas=2``: the survivors of a kill go on) and a ``Manager``
  per node; a restarted replica heals from a live peer through the Manager's checkpoint transport.

Each system runs the same job twice: without failures, and with failures on a schedule
(``schedule``: every ``--period`` seconds after the first synchronization of trained steps,
SIGKILL of a process other than process 0 — which hosts the coordination service, or the
Lighthouse — drawn from
``--seed``, restarted ``--down`` seconds later; the same schedule for both systems). A run ends
when the job reaches ``--steps`` inner steps (process 0 ends it). Reported per run (``report``):

* goodput: useful inner steps per second — the inner steps that entered a synchronization that
  counted, summed over the processes, over process 0's wall-clock from its first synchronization to
  its last — and its ratio to the failure-free run's;
* process 0's held-out loss after the last synchronization, beside the failure-free run's;
* the seconds from each kill to the next synchronization that counted on process 0;
* jaxcomp: a SHA-256 of θ and the outer state on every process after every synchronization, and
  whether all copies of each synchronization agree.

  PYTHONPATH=. python benchmarks/faults.py [--quick] [--write] [--runs 2] [--steps 2000]
      [--period 60] [--down 10] [--seed 0] [--rate 100mbit] [--systems jaxcomp,torchft]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import torchft_diloco  # noqa: E402
from jaxcomp.train import namespaces, nodes  # noqa: E402

PROCESSES, BATCH, SYNC_EVERY = 3, 48, torchft_diloco.SYNC_EVERY
DEVICES = 3  # jaxcomp's CPU devices per process: 3^n device lists of n members
HEARTBEAT, TIMEOUT = 5, 30  # seconds: a silent process is dropped; a collective waits
JAX_PORT = 29530
SYSTEMS = {"jaxcomp": "jaxcomp fault_tolerant DiLoCo", "torchft": "torchft DiLoCo"}


# -------------------------------------------------------------------- the schedule and the report


def schedule(seed: int, period: float, down: float, until: float, processes: int) -> list:
  """``[(kill at, process, restart at)]``, seconds after the first synchronization of trained
  steps (the programs compiled): a kill every
  ``period`` seconds before ``until``, of a process other than 0 drawn from ``seed``."""
  if not 0 < down < period:
    raise ValueError(f"down must be more than 0 and less than period ({period}); got {down}")
  rng = np.random.default_rng(seed)
  times = np.arange(period, until, period)
  return [(float(t), int(rng.integers(1, processes)), float(t + down)) for t in times]


def report(records: list, kills: list, sync_every: int) -> dict:
  """One run's figures from its processes' records (``records[i]``: process i's lines, every
  life's, in order: ``time``, ``step``, ``trained`` — whether its inner steps entered this
  synchronization — and optionally ``loss``, ``digest``, ``pid``) and ``kills`` (``[(time,
  process)]``)."""
  first = records[0]
  seconds = first[-1]["time"] - first[0]["time"]
  useful = sync_every * sum(r["trained"] for lines in records for r in lines)
  after = [next((r["time"] - at for r in first if r["time"] > at), None) for at, _ in kills]
  by_step = {}
  for lines in records:
    for r in lines:
      if "digest" in r:
        by_step.setdefault(r["step"], set()).add(r["digest"])
  return {"useful": useful, "seconds": seconds, "goodput": useful / seconds,
          "loss": next(r["loss"] for r in reversed(first) if r.get("loss") is not None),
          "kill_to_sync": after, "kills": len(kills),
          "rejoined": sorted({i for i, lines in enumerate(records)
                              if len({r.get("pid") for r in lines}) > 1}),
          "checked": len(by_step), "agree": all(len(d) == 1 for d in by_step.values())}


# ------------------------------------------------------------------------------- the processes


def _recorder(job: dict, rank: int):
  out = open(os.path.join(job["folder"], f"rank{rank}.jsonl"), "a")

  def write(**record):
    out.write(json.dumps(dict(dict(pid=os.getpid(), time=time.time()), **record)) + "\n")
    out.flush()
  return write


def jaxcomp_main(job: dict, rank: int) -> None:
  """One process of jaxcomp's job: ``fault_tolerant.train`` on the chars transformer."""
  import jax
  jax.config.update("jax_num_cpu_devices", DEVICES)
  jax.config.update("jax_platforms", "cpu")
  import optax

  from jaxcomp.train import fault_tolerant, tasks
  fault_tolerant.initialize(f"{job['addresses'][0]}:{JAX_PORT}", PROCESSES, rank,
                            heartbeat_timeout_seconds=HEARTBEAT,
                            collective_timeout_seconds=TIMEOUT)
  task, write, joined = tasks.get("chars", quick=job["quick"]), _recorder(job, rank), []

  def batch(step):
    return torchft_diloco.rows(task, job["seed"], step, BATCH, PROCESSES, rank)

  def on_sync(synced):
    now, last = time.time(), rank == 0 and synced.step >= job["steps"]
    write(time=now, step=synced.step, members=list(synced.members), trained=bool(joined),
          digest=fault_tolerant.digest((synced.theta, synced.outer_state)),
          loss=task.evaluate(synced.theta)[0] if last else None)
    joined.append(synced.step)

  inner = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(task.adamw_learning_rate, b2=0.99, weight_decay=0.1))
  # Process 0 sends θ: the others need its shapes only (a restart then skips the initializer).
  params = task.init(job["seed"]) if rank == 0 else jax.eval_shape(task.init, job["seed"])
  fault_tolerant.train(task.loss, params, batch, inner=inner,
                       sync_every=SYNC_EVERY, steps=job["steps"], on_sync=on_sync)


def _digest(tensors) -> str:
  """A SHA-256 of torch tensors' bytes (``fault_tolerant.digest``'s, for torch)."""
  h = hashlib.sha256()
  for t in tensors:
    h.update(t.detach().contiguous().numpy().tobytes())
  return h.hexdigest()


def torchft_main(job: dict, rank: int) -> None:
  """One process of torchft's job: ``torchft_diloco.py``'s DiLoCo, training until the job's
  committed synchronizations reach its step count; a restarted one heals at its first."""
  import torch
  spec = dict(job, system="diloco", task="chars", batch_size=BATCH, processes=PROCESSES,
              timeout_seconds=TIMEOUT, heartbeat_timeout_ms=1000 * HEARTBEAT,
              join_timeout_ms=1000 * HEARTBEAT)
  task, model, loss_of, batch = torchft_diloco.build(spec)
  model, adamw, clip, diloco = torchft_diloco._setup(spec, rank, model)
  manager, write = spec["manager"], _recorder(job, rank)
  restarted = os.path.exists(os.path.join(job["folder"], f"rank{rank}.jsonl"))
  write(step=0, trained=False)  # the start of this life
  committed, local, trained = 0, 0, not restarted
  with diloco:
    while committed * SYNC_EVERY < job["steps"]:
      x, y = (torch.from_numpy(a.astype(np.int64))
              for a in batch(rank, committed * SYNC_EVERY + local))
      adamw.zero_grad()
      loss_of(model(x), y).backward()
      clip()
      adamw.step()  # DiLoCo's hook synchronizes after every SYNC_EVERY-th
      local += 1
      if local == SYNC_EVERY:
        local, before, committed = 0, committed, manager.current_step()
        if committed > before:
          now = time.time()
          last = rank == 0 and committed * SYNC_EVERY >= job["steps"]
          loss = None
          if last:
            with torch.no_grad():
              loss = float(loss_of(model(torch.from_numpy(task.test_inputs.astype(np.int64))),
                                   torch.from_numpy(task.test_targets.astype(np.int64))))
          write(time=now, step=committed * SYNC_EVERY, members=manager.num_participants(),
                trained=trained, loss=loss, digest=_digest(model.parameters()))
          trained = True
  os._exit(0)  # torchft's manager and lighthouse threads would keep the process


# ------------------------------------------------------------------------------------ the runs


def run(system: str, args, plan: list, log=lambda line: None) -> dict:
  """One job of ``system`` over the nodes' links with ``plan`` (``schedule``'s; [] for none);
  returns its ``report`` with the kills done. Every process is ended and the namespaces removed
  on every exit path."""
  with tempfile.TemporaryDirectory(prefix="jaxcomp_faults_") as folder, \
      namespaces.Nodes(PROCESSES, args.rate) as links:
    job = {"system": system, "quick": args.quick, "seed": 0, "steps": args.steps,
           "folder": folder, "addresses": [links.address(i) for i in range(PROCESSES)],
           "namespaces": list(links.names)}
    spec = os.path.join(folder, "job.json")
    with open(spec, "w") as f:
      json.dump(job, f)
    command = [sys.executable, os.path.abspath(__file__), "--process", system]

    def start(rank):
      return nodes.start_process(links, rank, spec, "-", folder, command, start_new_session=True)

    def records(rank):
      path = os.path.join(folder, f"rank{rank}.jsonl")
      if not os.path.exists(path):
        return []
      with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]

    procs = [start(r) for r in range(PROCESSES)]
    events = sorted([(at, "kill", r) for at, r, _ in plan] + [(b, "start", r) for _, r, b in plan])
    kills, down, origin, deadline = [], set(), None, time.time() + args.timeout
    try:
      while procs[0].poll() is None:
        time.sleep(0.1)
        if origin is None:
          origin = next((r["time"] for r in records(0) if r["step"] >= SYNC_EVERY), None)
        while origin is not None and events and time.time() - origin >= events[0][0]:
          _, what, rank = events.pop(0)
          if what == "kill" and procs[rank].poll() is None:
            os.killpg(procs[rank].pid, signal.SIGKILL)
            procs[rank].wait()
            kills.append((time.time(), rank))
            down.add(rank)
            log(f"killed process {rank}")
          elif what == "start" and rank in down:
            procs[rank] = start(rank)
            down.discard(rank)
            log(f"restarted process {rank}")
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in down]
        if failed or time.time() > deadline:
          raise RuntimeError(f"{system}: process {failed} failed, or the run timed out\n"
                             + _tails(folder))
      if procs[0].returncode != 0:
        raise RuntimeError(f"{system}: process 0 ended with {procs[0].returncode}\n"
                           + _tails(folder))
      for p in procs[1:]:  # they end with process 0's last synchronization
        try:
          p.wait(timeout=15)
        except subprocess.TimeoutExpired:  # killed below
          pass
      return dict(report([records(r) for r in range(PROCESSES)], kills, SYNC_EVERY),
                  planned=len(plan))
    finally:
      for p in procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
      if args.logs:
        kept = os.path.join(args.logs, f"{system}-{len(plan) and 'chaos' or 'free'}-{os.getpid()}"
                            f"-{int(time.time())}")
        shutil.copytree(folder, kept, ignore=shutil.ignore_patterns("job.json"))


def _tails(folder: str) -> str:
  out = []
  for r in range(PROCESSES):
    with open(os.path.join(folder, f"process{r}.log")) as f:
      lines = [line for line in f.read().splitlines() if not line.startswith(("[Gloo]", "W0"))]
    out.append(f"--- process {r}:\n" + "\n".join(lines[-15:]))
  return "\n".join(out)


def row(system: str, number: int, free: dict, chaos: dict) -> list:
  """A table row: one system's failure-free and chaos runs of run ``number``."""
  ratio = chaos["goodput"] / free["goodput"]
  gap = (chaos["loss"] - free["loss"]) / free["loss"]
  recoveries = ", ".join("-" if s is None else f"{s:.1f}" for s in chaos["kill_to_sync"])
  agree = (f"yes, {chaos['checked']} + {free['checked']} syncs" if chaos["agree"]
           and free["agree"] else "NO")
  back = ", ".join(str(r) for r in chaos["rejoined"]) or "none"
  return [SYSTEMS[system], number, f"{chaos['kills']} ({back})",
          f"{free['goodput']:.1f}", f"{chaos['goodput']:.1f}",
          f"{100 * ratio:.0f}% ({'met' if ratio >= 0.8 else 'missed'})",
          f"{free['loss']:.4f}", f"{chaos['loss']:.4f}",
          f"{100 * gap:+.2f}% ({'met' if abs(gap) <= 0.02 else 'missed'})", recoveries, agree]


HEADER = ["system", "run", "kills (processes back)", "goodput, no failures (steps/s)",
          "goodput, with failures", "ratio (goal ≥ 80%)", "held-out loss, no failures",
          "with failures", "difference (goal within 2%)", "kill → next sync (s)",
          "hashes agree at every sync"]


def main(argv=None) -> int:
  from benchmarks import common
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--rate", default="100mbit", help="each node's link, each way")
  p.add_argument("--steps", type=int, default=None, help="the job's inner steps (2000; quick 300)")
  p.add_argument("--runs", type=int, default=None, help="repetitions (default 2; quick 1)")
  p.add_argument("--period", type=float, default=None, help="seconds between kills (60; quick 8)")
  p.add_argument("--down", type=float, default=None, help="seconds a process is down (10; quick 3)")
  p.add_argument("--kills", type=int, default=None, help="at most this many kills per run")
  p.add_argument("--seed", type=int, default=0, help="draws the killed processes")
  p.add_argument("--systems", default="jaxcomp,torchft", help="comma-separated: jaxcomp, torchft")
  p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
  p.add_argument("--logs", default=None, help="a folder to keep every run's process logs in")
  args = common.parse(p, argv)
  args.steps = args.steps or (300 if args.quick else 2000)
  args.period = args.period or (8 if args.quick else 60)
  args.down = args.down or (3 if args.quick else 10)
  runs, systems = args.runs or (1 if args.quick else 2), args.systems.split(",")
  reason = namespaces.unavailable_reason()
  if reason:
    print(f"faults.py: error: {reason}", file=sys.stderr)
    return 2
  plan = schedule(args.seed, args.period, args.down, args.timeout, PROCESSES)[:args.kills]
  started, rows, results = time.perf_counter(), [], []
  for number in range(1, runs + 1):
    for system in systems:
      got = {}
      for kind, kills in (("free", []), ("chaos", plan)):
        print(f"run {number}: {system}, {kind}", file=sys.stderr, flush=True)
        try:
          got[kind] = run(system, args, kills, lambda line: print(f"  {line}", file=sys.stderr))
        except RuntimeError as e:
          print(f"  {system} {kind} failed: {e}", file=sys.stderr)
          got[kind] = None
      results.append({"run": number, "system": system, **got})
      if got["free"] and got["chaos"]:
        rows.append(row(system, number, got["free"], got["chaos"]))
      else:
        rows.append([SYSTEMS[system], number] + ["did not finish (see the log)"] + [""] * 8)
      print(json.dumps(results[-1]), file=sys.stderr, flush=True)
  body = (f"{PROCESSES} nodes (one process each) over links of {args.rate} each way (a network "
          f"namespace per node, tc tbf), the chars transformer, {args.steps} inner steps per run "
          f"(H = {SYNC_EVERY}, 16 rows per process and step); with failures: every "
          f"{args.period:.0f} s after the first synchronization of trained steps, SIGKILL of "
          f"process 1 or 2 (drawn from seed {args.seed}, the same for both systems), restarted "
          f"{args.down:.0f} s later. "
          f"Timeouts: heartbeat {HEARTBEAT} s, collectives {TIMEOUT} s, both systems. "
          f"{time.perf_counter() - started:.0f} s in all, every run niced, while other jobs "
          "shared the machine's 2 cores: when a process is down, the others get its share of the "
          "cores, which lifts their steps per second. Goodput: inner steps that entered a "
          "synchronization that counted, summed over the processes, per second of process 0's "
          "wall-clock from its first synchronization to its last. Hashes: SHA-256 of every "
          "process's copy after every synchronization that counted (jaxcomp: θ and the outer "
          "state; torchft: the model's parameters), compared per synchronization, both runs; a "
          "process back: one with records from a second life.\n\n"
          + common.markdown_table(HEADER, rows))
  common.emit(args, "faults", "Surviving failures (against torchft)", "faults.py", body)
  return 0


if __name__ == "__main__":
  if sys.argv[1:2] == ["--process"]:
    with open(sys.argv[3]) as f:
      spec = json.load(f)
    (jaxcomp_main if sys.argv[2] == "jaxcomp" else torchft_main)(spec, int(sys.argv[4]))
    sys.exit(0)
  sys.exit(main())
