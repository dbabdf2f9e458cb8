"""Several nodes over a slow link: ``python -m jaxcomp.train --processes N --link RATE``.

The job trains the main job's task the way a cluster of N nodes does: N processes, one per node,
each with its own simulated CPU devices (``--devices`` / N), joined by ``jax.distributed`` (gloo)
over a real rate-limited network — a network namespace per node, joined through a switch by links
of RATE in each direction (``jaxcomp.train.namespaces.Nodes``): a node's devices talk among
themselves over their own loopback, at memory speed, and to other nodes at RATE. The mesh is
``("replica", "data")``: the slow axis between the processes, the fast one inside each
(``jaxcomp.train.node_process``, which also says how each entry's step is built).

Entries run one after the other, allreduce first: its held-out loss after ``--steps`` is the
target, and every other entry trains its recipe for ``--steps`` steps, then on until it reaches the
target or ``--max-steps``. For each, the job reports:

* the wall-clock to the target, MEASURED: the sum of the timed steps until the held-out loss first
  reaches it (evaluations not included; an entry that never reaches it: its whole run);
* beside it the α-β model's prediction for the same steps (``link_seconds``): each step's compute
  (the entry's step timed over an unlimited link) plus the collectives over ``"replica"`` (read
  from the compiled step, ``jaxcomp.comm_report(...).by_axes(mesh)``) through the node's link at
  the measured β and α, each node's F devices sending their groups' traffic through its one link,
  the token bucket passing its first ``namespaces.BURST_BYTES`` of each step at once;
* the bytes that crossed the links, read from the nodes' counters (TCP/IP headers and the
  coordination service's messages included), beside what the compiled steps send.

The launcher's parts are functions of their own, so that a mechanism that survives a lost node or
lets one rejoin can wrap them: ``start_processes`` (one process per node), ``watch`` (waits,
ends the job when any process fails), ``launch`` (both, inside the namespaces, which are removed
on every exit path: the end, an error, a failed or killed process, Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import numpy as np

from jaxcomp.train import namespaces, runs, units

DEFAULT_NAMES = ("allreduce", "quantized_int8", "diloco_h20", "streaming_diloco_h20_p2",
                 "sparseloco_h30")
QUICK_NAMES = ("allreduce", "diloco_h20")
LINK_OPS = {"all-reduce": (lambda n, r: 2 * (r - 1) / r * n, lambda r: 2 * (r - 1)),
            "all-gather": (lambda c, r: (r - 1) * c, lambda r: r - 1),
            "all-to-all": (lambda n, r: (r - 1) / r * n, lambda r: r - 1)}
"""Per collective over the nodes (R of them): the bytes one device sends through its node's link
(gloo's ring algorithms; an all-gather's operand is one device's contribution) and the messages it
waits for, one after the other."""


@dataclasses.dataclass
class NodeJob:
  """What the processes of ``launch`` do (JSON-able).

  Attributes:
    task, quick, seed, batch_size: the training task (``jaxcomp.train.tasks``) and its global batch.
    processes: N, one per node; devices_per_process: F, each process's simulated CPU devices.
    rate: each node's link (``namespaces.check_rate``).
    names: the registry entries, allreduce first.
    steps, max_steps, evaluations: each entry's recipe length, how far one goes on to reach the
      target, and the held-out evaluations over ``steps``.
    target: the held-out loss the entries train to (None: allreduce's after ``steps``, which
      then runs first).
    addresses, namespaces: the nodes' (filled in by ``launch``).
  """
  task: str
  quick: bool
  seed: int
  batch_size: int
  processes: int
  devices_per_process: int
  rate: str
  names: list
  steps: int
  max_steps: int
  evaluations: int = 20
  target: Optional[float] = None
  addresses: list = dataclasses.field(default_factory=list)
  namespaces: list = dataclasses.field(default_factory=list)


PROCESS = (sys.executable, "-m", "jaxcomp.train.node_process")
"""The command of a process of the job; it gets ``SPEC RANK OUT`` appended."""


def start_process(nodes: namespaces.Nodes, rank: int, spec: str, out: str, folder: str,
                  command: Sequence[str] = PROCESS, **popen) -> subprocess.Popen:
  """Process ``rank`` of the job in ``spec`` started in node ``rank``'s namespace (``command SPEC
  rank OUT``), its output appended to ``folder/process<rank>.log`` (a restarted process's after
  its first life's); ``popen``: more of ``subprocess.Popen``'s arguments."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.pop("XLA_FLAGS", None)
  return nodes.popen(rank, [*command, spec, str(rank), out], env=env,
                     stdout=open(os.path.join(folder, f"process{rank}.log"), "a"),
                     stderr=subprocess.STDOUT, **popen)


def start_processes(nodes: namespaces.Nodes, spec: str, out: str, folder: str,
                    command: Sequence[str] = PROCESS) -> tuple:
  """``(processes, logs)``: process r of the job in ``spec`` started in node r's namespace
  (``start_process``), its output in ``folder/process<r>.log``."""
  procs = [start_process(nodes, r, spec, out, folder, command) for r in range(nodes.count)]
  return procs, [os.path.join(folder, f"process{r}.log") for r in range(nodes.count)]


def watch(procs: Sequence[subprocess.Popen], logs: Sequence[str], timeout: float,
          log: Callable[[str], None]) -> None:
  """Waits for every process to end, passing process 0's ``[nodes]`` lines to ``log``.

  Raises:
    RuntimeError: a process ended with a failure (or was killed), or ``timeout`` seconds passed;
      the message holds the end of every process's output.
  """
  deadline, shown, failed = time.monotonic() + timeout, 0, None
  while failed is None and any(p.poll() is None for p in procs):
    time.sleep(0.5)
    with open(logs[0]) as f:
      lines = f.read().splitlines()
    for line in lines[shown:]:
      if line.startswith("[nodes]"):
        log(line[len("[nodes] "):])
    shown = len(lines)
    failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
    if failed is None and time.monotonic() > deadline:
      failed = -1
  if failed is not None:
    tails = []
    for r, path in enumerate(logs):
      with open(path) as f:
        text = [line for line in f.read().splitlines() if not line.startswith(("[Gloo]", "W0"))]
      tails.append(f"--- process {r} (exit {procs[r].poll()}):\n" + "\n".join(text[-12:]))
    what = "timed out" if failed == -1 else (
        f"process {failed} {'was killed' if procs[failed].poll() < 0 else 'failed'} (exit "
        f"{procs[failed].poll()})")
    raise RuntimeError(f"the several-nodes job {what}; every process was ended and the "
                       "namespaces removed\n" + "\n".join(tails))


def launch(job, timeout: float = 7200.0,
           log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
           command: Sequence[str] = PROCESS) -> dict:
  """Runs ``job`` (a ``NodeJob``, or another dataclass with ``processes``, ``rate``,
  ``addresses`` and ``namespaces`` for another ``command``) on ``job.processes`` nodes over links
  of ``job.rate`` and returns process 0's results (``node_process.process_main``), with
  ``link_bytes``: what every node sent over its link in all.

  Raises:
    namespaces.LinkError: no such links can be made here (one line: why).
    RuntimeError: a process failed, was killed, or the job timed out (``watch``).
  """
  with tempfile.TemporaryDirectory(prefix="jaxcomp_nodes_") as folder, \
      namespaces.Nodes(job.processes, job.rate) as nodes:
    job = dataclasses.replace(job, addresses=[nodes.address(i) for i in range(job.processes)],
                              namespaces=list(nodes.names))
    spec, out = os.path.join(folder, "job.json"), os.path.join(folder, "result.json")
    with open(spec, "w") as f:
      json.dump(dataclasses.asdict(job), f)
    procs, logs = start_processes(nodes, spec, out, folder, command)
    watch(procs, logs, timeout, log)
    with open(out) as f:
      return dict(json.load(f), link_bytes=sum(nodes.sent()))


# ------------------------------------------------------------------------------------ the model


def link_seconds(collectives: Sequence, nodes: int, per_node: int, alpha: float, beta: float,
                 overhead: float = 0.0, burst: float = 0.0) -> float:
  """Seconds per step, on average, that a step's collectives spend on the links between nodes.

  ``collectives``: ``[axes, op, bytes, share, operands]`` of the step
  (``node_process.collectives``); those whose axes hold ``"replica"`` cross the links, each device
  of a node sending its group's share (``LINK_OPS``) and ``overhead`` bytes per operand through the
  node's one link of β bytes/s, waiting α per message; the collectives of a share of steps pass
  their first ``burst`` bytes at once.
  """
  by_share, latency = {}, 0.0
  for axes, op, nbytes, share, operands in collectives:
    if "replica" not in axes:
      continue  # inside a node: part of the compute
    if op not in LINK_OPS:
      raise ValueError(f"the model has no formula for {op} between nodes")
    sent, messages = LINK_OPS[op]
    by_share[share] = (by_share.get(share, 0.0)
                       + per_node * (sent(nbytes, nodes) + operands * overhead))
    latency += share * operands * messages(nodes) * alpha
  return latency + sum(share * max(moved - burst, 0.0) / beta for share, moved in by_share.items())


def link_bytes(collectives: Sequence, nodes: int, per_node: int, overhead: float = 0.0) -> float:
  """Bytes all nodes send over their links per step, on average (``link_seconds``' count)."""
  return nodes * per_node * sum(share * (LINK_OPS[op][0](nbytes, nodes) + operands * overhead)
                                for axes, op, nbytes, share, operands in collectives
                                if "replica" in axes)


# ------------------------------------------------------------------------------------ the table


def as_run(result: dict) -> runs.Run:
  """A ``runs.Run`` of one entry's result (its held-out loss, steps to target)."""
  phases = [(p["first_step"], key) for key, p in result["phases"].items()]
  run = runs.Run(result["name"], result["steps"], sorted(phases), {}, 0.0, "")
  run.losses, run.step_seconds = result["losses"], result["step_seconds"]
  run.evals = [tuple(e) for e in result["evals"]]
  return run


def modelled(result: dict, run: runs.Run, steps: int, job: NodeJob, link: dict,
             overhead: float) -> tuple:
  """``(seconds, bytes)`` the model predicts for the first ``steps`` steps of ``result``."""
  compute = result["compute_seconds"]
  burst = min(namespaces.BURST_BYTES, compute * link["beta"])
  nodes, per_node = job.processes, job.devices_per_process
  seconds = {key: compute + link_seconds(p["collectives"], nodes, per_node, link["alpha"],
                                         link["beta"], overhead, burst)
             for key, p in result["phases"].items()}
  sent = {key: link_bytes(p["collectives"], nodes, per_node, overhead)
          for key, p in result["phases"].items()}
  return run.seconds_to(steps, seconds), run.seconds_to(steps, sent)


def table(result: dict, job: NodeJob) -> tuple:
  """``(Markdown table, the worst modelled / measured wall-clock, the target)``."""
  link = result["probe"][job.rate]
  results = result["runs"]
  all_runs = [as_run(r) for r in results]
  base, target = runs.target_of(all_runs)
  rows, ratios = [], []
  for r, run in zip(results, all_runs):
    reached = None if run.diverged else run.steps_to(target)
    steps = reached or len(run.step_seconds)
    measured = float(np.sum(run.step_seconds[:steps]))
    predicted, _ = modelled(r, run, steps, job, link, result["overhead"])
    _, predicted_bytes = modelled(r, run, len(run.step_seconds), job, link, result["overhead"])
    ratios.append(predicted / measured)
    loss, accuracy = run.final
    rows.append([
        run.name, f"{reached}" if reached else f"not in {len(run.step_seconds)}",
        f"{measured:.1f} s" + ("" if reached else " (whole run)"), f"{predicted:.1f} s",
        f"{predicted / measured:.2f}", f"{1e3 * r['compute_seconds']:.0f} ms",
        f"{units.human_bytes(r['link_bytes'])} ({units.human_bytes(predicted_bytes)})",
        f"{loss:.3f}" + (" (diverged)" if run.diverged else ""), f"{100 * accuracy:.1f}%"])
  header = ["entry", "steps to target", "wall-clock to target (measured)", "modelled",
            "modelled / measured", "compute / step", "over the links (modelled)",
            "held-out loss", "accuracy"]
  lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  worst = max(ratios, key=lambda x: abs(x - 1), default=1.0)
  return "\n".join(lines), worst, target


def main(args, argv: Optional[Sequence[str]] = None) -> int:
  """``python -m jaxcomp.train --processes N --link RATE``: the job, its table, ``OUT/results.md``
  and ``OUT/results.json``."""
  reason = namespaces.unavailable_reason()
  if reason:
    print(f"python -m jaxcomp.train: error: --processes: {reason}", file=sys.stderr)
    return 2
  job = NodeJob(task=args.task, quick=args.quick, seed=args.seed, batch_size=args.batch_size,
                processes=args.processes, devices_per_process=args.devices // args.processes,
                rate=args.link, names=list(args.compressors), steps=args.steps,
                max_steps=args.max_steps)
  header = (f"task {args.task}{' (quick)' if args.quick else ''}, {job.processes} nodes x "
            f"{job.devices_per_process} CPU devices, one process each, links of {job.rate} "
            f"each way; global batch {job.batch_size}, {job.steps} steps (up to "
            f"{job.max_steps} to reach the target), seed {job.seed}")
  print(header, flush=True)
  began = time.perf_counter()
  try:
    result = launch(job)
  except (namespaces.LinkError, RuntimeError) as e:
    print(f"python -m jaxcomp.train: error: {e}", file=sys.stderr)
    return 1
  text, worst, target = table(result, job)
  link = result["probe"][job.rate]
  note = (f"({time.perf_counter() - began:.0f} s. Link between nodes 0 and 1 measured at "
          f"{8e-6 * link['beta']:.0f} Mbit/s, α {1e6 * link['alpha']:.0f} µs (unlimited: "
          f"{8e-6 * result['probe']['none']['beta']:.0f} Mbit/s). Target: allreduce's held-out "
          f"loss after {job.steps} steps, {target:.3f}. Wall-clock: the timed steps, evaluations "
          "left out. Modelled: each step's compute (its median over an unlimited link) plus its "
          "collectives over replica through the α-β model of the node links, with "
          f"{result['overhead']:.0f} B of gloo and TCP/IP messages per operand of an all-reduce "
          f"(measured); worst modelled / measured {worst:.2f}. Over the links: the nodes' transmit "
          "counters for the whole run (in brackets: the model's count of the compiled steps' "
          "collectives).)")
  print(text)
  print(note)
  runs.write_results(args.out, argv, header, text, note, {"job": dataclasses.asdict(job), **result})
  print(f"wrote {args.out}/results.md, results.json")
  return 0
