"""Jobs over a slow link: W training processes in a private, rate-limited network namespace.

``run_job`` starts W workers (``python -m jaxcomp.train.link_job --worker``), one CPU device each,
in a ``jaxcomp.train.namespaces.SlowLink``, joined by ``jax.distributed.initialize`` on 127.0.0.1
(gloo collectives). Their steps are the main job's (``jaxcomp.train.training_step.make_step``):
``jaxcomp.data_parallel`` over a mesh of the W workers' devices, each worker feeding its own rows
of the batch. For each rate in turn the workers set the link (rank 0 runs ``tc`` inside the
namespace), measure it, and time every program — a compressor's training step in the steady state
of one phase of its recipe (``registry.Phase``) — side by side: round after round, every program
runs a few steps in a rotating order, so that a busy machine slows them alike; the median over
rounds is reported. Optionally the workers then train whole runs of some compressors' recipes over
one of the links, timing the whole run (``check``): the sum of the per-phase step times over a
run's steps must match that total for time-to-accuracy figures built from per-phase step times to
hold.

Each worker computes with one thread (XLA's Eigen pool off), so that W workers share the cores
evenly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from jaxcomp.train import namespaces
from jaxcomp.train import runs as runs_lib

JAX_PORT = 12355
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


@dataclasses.dataclass
class Job:
  """What the workers of ``run_job`` do (JSON-able).

  Attributes:
    task, quick, seed, batch_size: the training task (``jaxcomp.train.tasks``) and its global batch.
    world: worker processes (one CPU device each).
    rates: links to time the programs over, in this order.
    programs: ``{key: [registry name, settings]}``: the steady-state programs to time.
    rounds: timed rounds (after one warm-up round).
    round_seconds: each program runs enough steps per round to take about this long (at most 20).
    check: ``{"rate": ..., "names": [...], "steps": N}``: afterwards, train each named compressor's
      recipe for N steps over that link and time the whole run; or None.
    extra: anything a worker started with ``extra_programs`` needs (``worker_main``).
  """
  task: str
  quick: bool
  seed: int
  batch_size: int
  world: int
  rates: list
  programs: dict
  rounds: int = 3
  round_seconds: float = 1.0
  check: Optional[dict] = None
  extra: Optional[dict] = None


def run_job(job: Job, worker: Optional[Sequence[str]] = None, timeout: float = 3600.0,
            log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
            ) -> dict:
  """Runs ``job`` on ``job.world`` workers in a private namespace and returns rank 0's results.

  Args:
    worker: the worker command (default ``python -m jaxcomp.train.link_job --worker``); it gets
      ``SPEC RANK OUT`` appended.
    timeout: seconds for the whole job.

  Raises:
    namespaces.LinkError: no slow link here.
    RuntimeError: a worker failed (with the end of its output).
  """
  worker = list(worker or [sys.executable, "-m", "jaxcomp.train.link_job", "--worker"])
  env = dict(os.environ, XLA_FLAGS=WORKER_XLA_FLAGS, OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  with tempfile.TemporaryDirectory(prefix="jaxcomp_link_") as folder, \
      namespaces.SlowLink(job.rates[0]) as link:
    spec, out = os.path.join(folder, "job.json"), os.path.join(folder, "result.json")
    with open(spec, "w") as f:
      json.dump(dataclasses.asdict(job), f)
    logs = [open(os.path.join(folder, f"worker{r}.log"), "w+") for r in range(job.world)]
    procs = [link.popen(worker + [spec, str(r), out], env=env, stdout=logs[r],
                        stderr=subprocess.STDOUT) for r in range(job.world)]
    deadline = time.monotonic() + timeout
    failed = None
    shown = 0
    while failed is None and any(p.poll() is None for p in procs):
      time.sleep(0.5)
      logs[0].flush()
      with open(logs[0].name) as f:
        lines = f.read().splitlines()
      for line in lines[shown:]:
        if line.startswith("[link]"):
          log(line)
      shown = len(lines)
      failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
      if time.monotonic() > deadline:
        failed = -1
    if failed is not None:
      tails = []
      for r, f in enumerate(logs):
        f.flush()
        with open(f.name) as g:
          text = g.read().strip().splitlines()
        tails.append(f"--- worker {r} (exit {procs[r].poll()}):\n" + "\n".join(text[-15:]))
      what = "timed out" if failed == -1 else f"worker {failed} failed"
      raise RuntimeError(f"slow-link job {what}\n" + "\n".join(tails))
    with open(out) as f:
      return json.load(f)


# ---------------------------------------------------------------------------------------- workers


class _Worker:
  """One worker process: jax.distributed over the namespace's loopback, one CPU device; its steps
  are the main job's (``training_step.make_step``: ``jaxcomp.data_parallel`` over a mesh of every
  worker's device)."""

  def __init__(self, job: Job, rank: int):
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{JAX_PORT}",
                               num_processes=job.world, process_id=rank,
                               heartbeat_timeout_seconds=120)
    from jaxcomp.train import tasks, training_step
    self.job, self.rank = job, rank
    self.task = tasks.get(job.task, quick=job.quick)
    self.mesh = training_step.make_mesh(jax.devices())
    self.rows = job.batch_size // job.world

  def say(self, text: str) -> None:
    if self.rank == 0:
      print(f"[link] {text}", flush=True)

  def barrier(self, name: str) -> None:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)

  def agree(self, values):
    """Rank 0's ``values`` (a list of ints) on every rank."""
    import numpy as np
    from jax.experimental import multihost_utils
    return [int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))]

  def local_batch(self, step: int) -> tuple:
    """This worker's rows of the step's global batch (numpy), as a data loader would hand them."""
    inputs, targets = self.task.batch(self.job.seed, step, self.job.batch_size)
    mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
    return inputs[mine], targets[mine]

  def next_step(self) -> int:
    """A fresh step number for a timed step: every timed step feeds a new batch, as training does
    (the input pipeline's cost is part of a step). All workers count alike."""
    self.steps_timed = getattr(self, "steps_timed", 0) + 1
    return self.steps_timed

  def compressor_step(self, name: str, steps: Optional[int] = None,
                      settings: Optional[dict] = None):
    """``(run, collectives)`` of one compressor's training step, its recipe for ``steps`` steps or
    its steady state with ``settings``: ``run(t)`` takes the step on the batch of step ``t`` and
    returns this worker's loss (numpy, so it has blocked until every worker finished the step);
    ``collectives`` are ``[op, bytes each worker contributes, share of steps it runs on]`` of the
    compiled step (``network.operands``)."""
    import numpy as np

    import jaxcomp
    from jaxcomp.train import network, registry, training_step

    entry = registry.REGISTRY[name]
    tx = self.task.optimizer(entry, steps=steps, **(settings or {}))
    step = training_step.make_step(self.task, tx, self.mesh)
    state = list(step.start(self.task.init(self.job.seed)))
    compiled = step.run.lower(*state, *step.dp.shard(self.local_batch(0))).compile()
    report = jaxcomp.comm_report(compiled, num_devices=self.job.world)
    collectives = [list(operand) for operand in network.operands(report)]

    def run(t):
      state[0], state[1], losses = compiled(*state, *step.dp.shard(self.local_batch(t)))
      return np.asarray(losses.addressable_data(0))[0]
    return run, collectives

  def jax_programs(self) -> tuple:
    """``({key: run(k)}, {key: collectives})``: each ``run(k)`` takes ``k`` steps on fresh batches,
    blocking."""
    runners, collectives = {}, {}
    for key, (name, settings) in self.job.programs.items():
      step, collectives[key] = self.compressor_step(name, settings=settings)

      def run(k, step=step):
        for _ in range(k):
          step(self.next_step())
      runners[key] = run
      self.say(f"compiled {key}")
    return runners, collectives

  def time_programs(self, runners: dict, periods: dict) -> dict:
    """``{key: [seconds per step, one per round]}``, programs interleaved round by round. A round
    of a program that synchronizes every ``periods[key]`` steps (a wrapper of the optimizer) is a
    whole number of periods, so its time per step is the average over inner and synchronizing
    steps, as in training."""
    keys = list(runners)
    first = {}
    for key in keys:  # warm-up: one step each (also sizes the steps per round)
      runners[key](1)
      start = time.perf_counter()
      runners[key](1)
      first[key] = time.perf_counter() - start
    counts = self.agree([whole_periods(min(20, max(1, round(self.job.round_seconds
                                                            / max(first[k], 1e-4)))),
                                       periods.get(k, 1)) for k in keys])
    times = {key: [] for key in keys}
    for r in range(self.job.rounds):
      for i in list(range(r % len(keys), len(keys))) + list(range(r % len(keys))):
        start = time.perf_counter()
        runners[keys[i]](counts[i])
        times[keys[i]].append((time.perf_counter() - start) / counts[i])
    return times

  def check_run(self, name: str, steps: int) -> dict:
    """Trains ``name``'s recipe for ``steps`` steps; the whole run is timed (batches included).
    ``losses``: each step's loss, the mean over the workers (gathered after the timed run)."""
    import numpy as np
    from jax.experimental import multihost_utils
    step, _ = self.compressor_step(name, steps=steps)
    self.barrier(f"check {name}")
    start = time.perf_counter()
    mine = [step(t) for t in range(steps)]
    total = time.perf_counter() - start
    losses = multihost_utils.process_allgather(np.asarray(mine, np.float32)).mean(axis=0)
    return {"seconds": total, "losses": [float(v) for v in losses]}

  def run(self, extra_programs: Optional[Callable] = None) -> dict:
    """Every link of the job in turn: set it, probe it, time the programs (and those of
    ``extra_programs(self)``: ``{key: run(k)}`` a benchmark times beside the jaxcomp steps); then
    the check runs."""
    import numpy as np
    runners, collectives = self.jax_programs()
    if extra_programs is not None:
      runners.update(extra_programs(self))
    links = {}
    for rate in self.job.rates:
      if self.rank == 0:
        namespaces.set_link(rate)
      self.barrier(f"link {rate}")
      measured = namespaces.probe() if self.rank == 0 else {}
      self.barrier(f"probed {rate}")
      self.say(f"link {rate}: " + (f"{measured['beta'] * 8e-6:.0f} Mbit/s, "
                                   f"α {measured['alpha'] * 1e6:.0f} µs" if measured else ""))
      times = self.time_programs(runners, {key: period(c) for key, c in collectives.items()})
      links[rate] = dict(measured, rounds=times,
                         seconds={k: float(np.median(v)) for k, v in times.items()})
      self.say(f"timed over {rate}: " + ", ".join(f"{k} {v:.3f}s"
                                                  for k, v in links[rate]["seconds"].items()))
    checks = {}
    if self.job.check:
      if self.rank == 0:
        namespaces.set_link(self.job.check["rate"])
      for name in self.job.check["names"]:
        checks[name] = self.check_run(name, self.job.check["steps"])
        self.say(f"check run {name} over {self.job.check['rate']}: "
                 f"{checks[name]['seconds']:.1f} s for {self.job.check['steps']} steps")
    return {"links": links, "collectives": collectives, "checks": checks}


def period(collectives: Sequence[Sequence]) -> int:
  """Steps between the synchronizations of a program's ``[op, bytes, share]`` collectives: 1 for
  a program whose collectives run on every step, H for one that synchronizes every H steps."""
  shares = [share for _, _, share in collectives if 0 < share < 1]
  return max((round(1 / share) for share in shares), default=1)


def whole_periods(steps: int, every: int) -> int:
  """``steps`` rounded up to a whole number of periods of ``every`` steps."""
  return -(-steps // every) * every


def worker_main(argv: Sequence[str], extra_programs: Optional[Callable] = None) -> int:
  """``SPEC RANK OUT``: runs one worker of the job in SPEC; rank 0 writes the results to OUT.

  ``extra_programs(worker) -> {key: run(k)}``: programs a benchmark times beside the jaxcomp steps,
  round by round over every link (``benchmarks/torch_ddp.py``'s torch DDP steps); each ``run(k)``
  takes ``k`` steps, blocking.
  """
  spec, rank, out = argv
  with open(spec) as f:
    job = Job(**json.load(f))
  worker = _Worker(job, int(rank))
  result = worker.run(extra_programs)
  worker.barrier("done")
  if worker.rank == 0:
    with open(out, "w") as f:
      json.dump(result, f)
  import jax
  jax.distributed.shutdown()
  return 0


def time_runs(task_name: str, runs: Sequence, *, rate: str, quick: bool, seed: int,
              batch_size: int, world: int) -> dict:
  """Times every phase program of the job's ``runs`` (``jaxcomp.train.runs.Run``) over a slow link
  on ``world`` processes and stores the seconds per step in each run's ``link_seconds``; returns
  the link job's result."""
  programs = runs_lib.phase_programs({r.name: r.steps for r in runs})
  result = run_job(Job(task=task_name, quick=quick, seed=seed, batch_size=batch_size, world=world,
                       rates=[rate], programs=programs))
  seconds = result["links"][rate]["seconds"]
  for r in runs:
    r.link_seconds = {key: seconds[key] for _, key in r.phases}
  return result


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", nargs=3, metavar=("SPEC", "RANK", "OUT"), required=True)
  sys.exit(worker_main(parser.parse_args().worker))

