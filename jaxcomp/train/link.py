"""A real slow link on one machine: W processes in a private network namespace, rate-limited loopback.

``SlowLink`` (root only) creates a network namespace of its own (``ip netns add``), raises its loopback's
MTU to 9000 (gloo's reads time out behind a rate limit at MTU 65536) and rate-limits it with a token
bucket filter (``tc qdisc ... tbf rate 100mbit burst 256kb limit 64mb``; the large ``limit`` keeps tbf
from dropping gloo's bursts). Processes started with ``SlowLink.popen`` live in that namespace and
talk over 127.0.0.1, so every byte they exchange passes the limited queue; nothing else on the machine
is touched. The namespace is removed on every exit path: the ``with`` block's end, an exception,
SIGINT / SIGTERM / SIGHUP (the handlers unwind, then re-deliver the signal), interpreter exit (atexit),
and — after a SIGKILL, which nothing can catch — the next ``SlowLink`` removes namespaces left by dead
processes. Workers get ``PR_SET_PDEATHSIG`` (``setpriv``), so they die with the process that started
them.

**One shared medium.** A loopback has one queue: the traffic of all W workers passes the same tbf, so
the link's rate is shared by all of them (a hub, not a switch). A ring all-reduce of N bytes puts
2(W−1)·N bytes through it in total — W times what one worker sends — so it takes W times as long as on
a switched network whose every port has that rate. ``benchmarks/network_model.py`` models it that
way (β/W per worker); all figures from this harness are for this shared medium.

**Latency.** ``latency_ms`` needs the ``netem`` qdisc (then ``netem delay`` sits above the tbf; on a
loopback each packet is delayed once, so a round trip gains 2× the delay). This machine's kernel has no
``netem`` (``tc`` answers "Specified qdisc kind is unknown"), and neither tbf nor htb delays packets, so
added latency cannot be emulated here: asking for it fails with that message. The latency the link
has is measured instead (``probe``: a TCP ping-pong inside the namespace) and fed to the α-β model.

Jobs: ``run_job`` starts W workers (``python -m jaxcomp.train.link --worker``), one CPU device each,
joined by ``jax.distributed.initialize`` on 127.0.0.1 (gloo collectives). Their steps are the main
job's (``jaxcomp.train.training_step.make_step``): ``jaxcomp.data_parallel`` over a mesh of the W workers'
devices, each worker feeding its own rows of the batch. For each rate in turn the workers set the
link (rank 0 runs ``tc`` inside the namespace), measure it, and time every program — a compressor's
training step in the steady state of one phase of its recipe (``registry.Phase``) —
side by side: round after round, every program runs a few steps in a rotating order, so that a busy
machine slows them alike; the median over rounds is reported. Optionally the workers then train whole
runs of some compressors' recipes over one of the links, timing the whole run (``check``): the sum of
the per-phase step times over a run's steps must match that total for time-to-accuracy figures built
from per-phase step times to hold.

Each worker computes with one thread (XLA's Eigen pool off), so that W workers share the cores evenly.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

AXIS = "batch"
PREFIX = "jaxcomp-"  # namespace names: jaxcomp-<pid of the creating process>-<random>
MTU = 9000
BURST = "256kb"  # tc's kb: kilobytes
BURST_BYTES = 256 * 1024
"""The token bucket's depth: bytes a rate-limited link passes at once before its rate applies (the
α-β model's ``burst``, ``jaxcomp.train.network.shared_medium_time``)."""
LIMIT = "64mb"
JAX_PORT, PROBE_PORT = 12355, 12357
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


class LinkError(RuntimeError):
  """A slow link cannot be made here; the message is one line saying why."""


def check_rate(rate: str) -> str:
  """``rate`` if it is ``none`` or a tc rate such as ``100mbit`` / ``1gbit`` / ``500kbit``.

  Raises:
    ValueError: anything else.
  """
  if rate == "none" or (isinstance(rate, str) and _RATE.match(rate)):
    return rate
  raise ValueError(f"rate must be 'none' or a number with kbit, mbit or gbit, e.g. 100mbit or 1gbit; "
                   f"got {rate!r}")


def rate_bits(rate: str) -> Optional[float]:
  """Bits per second of ``rate`` (None for ``none``)."""
  if check_rate(rate) == "none":
    return None
  number, unit = _RATE.match(rate).groups()
  return float(number) * _UNITS[unit]


def unavailable_reason() -> Optional[str]:
  """Why no slow link can be made on this machine (one line), or None when it can."""
  if os.name != "posix" or not hasattr(os, "geteuid"):
    return "a slow link needs Linux network namespaces"
  if os.geteuid() != 0:
    return ("a slow link needs root (it creates a network namespace and rate-limits its loopback "
            "with tc); run as root")
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    return (f"a slow link needs the {' and '.join(missing)} command{'s' if len(missing) > 1 else ''} "
            "(iproute2: apt-get install iproute2)")
  return None


def qdisc_commands(rate: str, latency_ms: float = 0.0) -> list:
  """The ``tc`` argument lists that give ``lo`` this rate and added latency (none: no qdisc)."""
  commands = [["qdisc", "del", "dev", "lo", "root"]]  # may fail when there is none: ignored
  tbf = ["tbf", "rate", rate, "burst", BURST, "limit", LIMIT]
  if latency_ms > 0:
    commands.append(["qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay",
                     f"{latency_ms}ms"])
    if rate != "none":
      commands.append(["qdisc", "add", "dev", "lo", "parent", "1:", "handle", "2:"] + tbf)
  elif rate != "none":
    commands.append(["qdisc", "add", "dev", "lo", "root"] + tbf)
  return commands


def set_link(rate: str, latency_ms: float = 0.0, namespace: Optional[str] = None) -> None:
  """Applies ``rate`` (and latency) to ``lo`` of ``namespace`` (None: the current namespace)."""
  check_rate(rate)
  where = ["-n", namespace] if namespace else []
  for i, command in enumerate(qdisc_commands(rate, latency_ms)):
    done = subprocess.run(["tc"] + where + command, capture_output=True, text=True)
    if done.returncode and i:
      message = (done.stderr.strip() or done.stdout.strip()).splitlines()[0]
      if "netem" in command:
        raise LinkError(f"added latency needs the netem qdisc, which this kernel does not have (tc: "
                        f"{message}); latency cannot be emulated here, leave it out")
      raise LinkError(f"tc {' '.join(command)}: {message}")


# ------------------------------------------------------------------------------------- namespaces

_LIVE: dict = {}  # namespace name -> SlowLink, for the signal and exit handlers
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_installed = False


def _cleanup_all() -> None:
  for link in list(_LIVE.values()):
    link.close()


def _on_signal(signum, frame):
  _cleanup_all()
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)  # exit as the signal would have made us


def _install_handlers() -> None:
  global _installed
  if _installed:
    return
  atexit.register(_cleanup_all)
  if threading.current_thread() is threading.main_thread():
    for sig in _HANDLED:
      if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
        signal.signal(sig, _on_signal)
  _installed = True


def _remove_stale() -> None:
  """Deletes namespaces this harness made in processes that no longer exist (killed by SIGKILL)."""
  listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  for name in re.findall(rf"^({re.escape(PREFIX)}(\d+)-\w+)", listing, re.M):
    pid = int(name[1])
    if not os.path.exists(f"/proc/{pid}"):
      subprocess.run(["ip", "netns", "del", name[0]], capture_output=True)


class SlowLink:
  """A private network namespace with a rate-limited loopback; a context manager.

  Example::

    with SlowLink("100mbit") as link:
      proc = link.popen([sys.executable, "-c", "..."])   # runs inside the namespace
      proc.wait()
    # the namespace and its processes are gone here

  Args:
    rate: ``"none"`` (plain loopback) or a tc rate, e.g. ``"100mbit"``, ``"1gbit"``.
    latency_ms: added one-way delay per packet (needs ``netem``; see the module docstring).

  Raises:
    LinkError: not root, ``ip``/``tc`` missing, or the kernel refused (the message says which).
  """

  def __init__(self, rate: str = "100mbit", latency_ms: float = 0.0):
    self.rate = check_rate(rate)
    if latency_ms < 0:
      raise ValueError(f"latency_ms must be >= 0; got {latency_ms}")
    self.latency_ms = float(latency_ms)
    self.name: Optional[str] = None
    self.processes: list = []

  def __enter__(self) -> "SlowLink":
    reason = unavailable_reason()
    if reason:
      raise LinkError(reason)
    _install_handlers()
    _remove_stale()
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
      raise LinkError(f"ip netns add failed: {made.stderr.strip().splitlines()[0]}")
    self.name = name
    _LIVE[name] = self
    try:
      up = subprocess.run(["ip", "-n", name, "link", "set", "lo", "mtu", str(MTU), "up"],
                          capture_output=True, text=True)
      if up.returncode:
        raise LinkError(f"ip link set lo up failed: {up.stderr.strip().splitlines()[0]}")
      set_link(self.rate, self.latency_ms, name)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts ``argv`` inside the namespace (it dies with this process)."""
    if self.name is None:
      raise RuntimeError("SlowLink.popen outside its with-block")
    # setpriv sets PR_SET_PDEATHSIG and execs argv: the worker is killed when this process dies
    # (a preexec_fn would fork a multithreaded JAX process unsafely).
    orphan_guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    proc = subprocess.Popen(["ip", "netns", "exec", self.name, *orphan_guard, *argv], **kwargs)
    self.processes.append(proc)
    return proc

  def close(self) -> None:
    """Kills the processes started here and deletes the namespace (idempotent)."""
    for proc in self.processes:
      if proc.poll() is None:
        proc.kill()
    for proc in self.processes:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    self.processes = []
    if self.name is not None:
      subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
      _LIVE.pop(self.name, None)
      self.name = None


# ------------------------------------------------------------------------------- link measurement


def probe(seconds: float = 1.5, port: int = PROBE_PORT) -> dict:
  """Measures the current namespace's loopback: one TCP stream's throughput (β, bytes/s) and half
  the round trip of a 1-byte ping-pong (α, s). Call it while nothing else uses the link."""
  server = socket.socket()
  server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  server.bind(("127.0.0.1", port))
  server.listen(1)
  received = {}

  def sink():
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(200):  # ping-pong
      conn.sendall(conn.recv(1))
    total, start = 0, None
    while True:
      data = conn.recv(1 << 20)
      if not data:
        break
      start = start or time.perf_counter()
      total += len(data)
    received["bytes"], received["seconds"] = total, time.perf_counter() - start
    conn.close()

  thread = threading.Thread(target=sink, daemon=True)
  thread.start()
  client = socket.create_connection(("127.0.0.1", port))
  client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  trips = []
  for _ in range(200):
    start = time.perf_counter()
    client.sendall(b"x")
    client.recv(1)
    trips.append(time.perf_counter() - start)
  chunk = b"\0" * (1 << 20)
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    client.sendall(chunk)
  client.close()
  thread.join(timeout=120)
  server.close()
  trips.sort()
  return {"alpha": trips[len(trips) // 2] / 2, "beta": received["bytes"] / received["seconds"]}


# ------------------------------------------------------------------------------------------ jobs


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
    worker: the worker command (default ``python -m jaxcomp.train.link --worker``); it gets
      ``SPEC RANK OUT`` appended.
    timeout: seconds for the whole job.

  Raises:
    LinkError: no slow link here. RuntimeError: a worker failed (with the end of its output).
  """
  worker = list(worker or [sys.executable, "-m", "jaxcomp.train.link", "--worker"])
  env = dict(os.environ, XLA_FLAGS=WORKER_XLA_FLAGS, OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  with tempfile.TemporaryDirectory(prefix="jaxcomp_link_") as folder, \
      SlowLink(job.rates[0]) as link:
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


def program_key(name: str, settings: dict) -> str:
  """A readable, unique key of a steady-state program: ``dgc[ratio=0.25,warmup=None]``."""
  if not settings:
    return name
  return name + "[" + ",".join(f"{k}={settings[k]!r}" for k in sorted(settings)) + "]"


class _Worker:
  """One worker process: jax.distributed over the namespace's loopback, one CPU device; its steps
  are the main job's (``training_step.make_step``: ``jaxcomp.data_parallel`` over a mesh of every worker's
  device)."""

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

  def compressor_step(self, name: str, steps: Optional[int] = None, settings: Optional[dict] = None):
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
        set_link(rate)
      self.barrier(f"link {rate}")
      measured = probe() if self.rank == 0 else {}
      self.barrier(f"probed {rate}")
      self.say(f"link {rate}: " + (f"{measured['beta'] * 8e-6:.0f} Mbit/s, α {measured['alpha'] * 1e6:.0f} µs"
                                   if measured else ""))
      times = self.time_programs(runners, {key: period(c) for key, c in collectives.items()})
      links[rate] = dict(measured, rounds=times,
                         seconds={k: float(np.median(v)) for k, v in times.items()})
      self.say(f"timed over {rate}: " + ", ".join(f"{k} {v:.3f}s"
                                                  for k, v in links[rate]["seconds"].items()))
    checks = {}
    if self.job.check:
      if self.rank == 0:
        set_link(self.job.check["rate"])
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


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", nargs=3, metavar=("SPEC", "RANK", "OUT"), required=True)
  sys.exit(worker_main(parser.parse_args().worker))
