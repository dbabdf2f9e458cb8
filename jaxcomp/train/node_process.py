"""One process of the several-nodes job (``jaxcomp.train.nodes``): a node's devices, trained in
step with the other nodes' over the link.

``process_main`` joins the job (``join``: its own simulated CPU devices, ``jax.distributed`` with
the coordinator at node 0's address, gloo collectives over the node's link), measures the link
between nodes 0 and 1 (``probe``) and trains each entry in turn (``NodeProcess.train``). The
mesh is ``("replica", "data")``: one row of devices per process. Each entry's step is built by
``make_step``:

* a gradient compressor runs as ``jaxcomp.hierarchical``: exact reduce-scatter inside the node,
  the compressor over ``"replica"`` on each device's shard, all-gather inside the node
  (``data_parallel`` maps both axes); the dense means and ``quantized`` packed into one vector,
  the others (PowerSGD's matrices) leaf by leaf;
* DiLoCo and Streaming DiLoCo (the registry's ``_diloco`` entries) run over ``"replica"``, their
  inner step averaging the gradient over ``"data"`` and their pseudo-gradient averaged by
  ``jaxcomp.hierarchical`` (``data_parallel`` maps both axes): each device sends 1/F of it
  between nodes;
* another optimizer that owns the parameters (SparseLoCo, local SGD) or averages itself (1-bit
  Adam, Dion, DeMo) runs over ``"replica"`` with ``data_parallel`` mapping it alone: inside a node
  the batch is split over ``"data"`` and the partitioner averages the gradient exactly (XLA's
  all-reduce between the node's devices); each device of a node sends its whole exchange.

Every step is timed and blocks on the loss; process 0 evaluates on held-out data every few
steps, and all processes agree on whether to go on (``agree``). Before training, each entry's
step is timed over an unlimited link (``calibrate``): its compute, for the α-β model. Process 0
sets the links' rate and reads the bytes the nodes sent (``namespaces.set_nodes_rate``,
``nodes_sent``).

The pieces a survivor or rejoin mechanism would wrap are functions of their own: ``join``
(membership), ``NodeProcess.take_step`` (one step: a synchronization where the recipe has one),
``NodeProcess.agree`` (a decision every process shares).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from typing import Sequence

import numpy as np

from jaxcomp.train import namespaces

JAX_PORT = 12355
CALIBRATION_STEPS = 12


def join(job: dict, rank: int) -> None:
  """Joins the job as process ``rank``: ``job["devices_per_process"]`` simulated CPU devices, and
  ``jax.distributed`` with the coordinator at node 0 (gloo collectives)."""
  import jax
  from jaxcomp.train import device_setup
  jax.config.update("jax_platforms", "cpu")
  device_setup.simulate_cpu_devices(job["devices_per_process"])
  jax.distributed.initialize(coordinator_address=f"{job['addresses'][0]}:{JAX_PORT}",
                             num_processes=job["processes"], process_id=rank,
                             heartbeat_timeout_seconds=120)


def node_mesh(processes: int, per_process: int):
  """The ``("replica", "data")`` mesh: row r holds process r's devices."""
  import jax
  from jax.sharding import AxisType, Mesh
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.asarray(devices).reshape(processes, per_process), ("replica", "data"),
              axis_types=(AxisType.Auto,) * 2)


def make_step(task, entry, mesh, steps=None, **settings):
  """``(dp, tx)``: the entry's step on the node mesh (the module docstring says which form)."""
  import dataclasses

  import jaxcomp

  from jaxcomp.train import registry

  if registry.averages_hierarchically(entry):
    tx = task.optimizer(entry, steps, axis_name="replica", fast_axis="data", **settings)
    axes = ("replica", "data")
  elif entry.wraps_optimizer or entry.is_optimizer:
    tx = task.optimizer(entry, steps, axis_name="replica", **settings)
    axes = "replica"
  else:
    factory = entry.factory
    hierarchical = dataclasses.replace(entry, factory=lambda axis_name, **s: jaxcomp.hierarchical(
        factory(axis_name=axis_name, **s), fast_axis="data"))
    tx = task.optimizer(hierarchical, steps, axis_name="replica", **settings)
    axes = ("replica", "data")
  return jaxcomp.data_parallel(task.loss, mesh, axis_name=axes, tx=tx), tx


class NodeProcess:
  """A process of the job, joined: its task, mesh and share of every batch."""

  def __init__(self, job: dict, rank: int):
    from jaxcomp.train import tasks
    self.job, self.rank = job, rank
    self.task = tasks.get(job["task"], quick=job["quick"])
    self.mesh = node_mesh(job["processes"], job["devices_per_process"])
    self.rows = job["batch_size"] // job["processes"]
    self.params0 = self.task.init(job["seed"])

  def say(self, text: str) -> None:
    if self.rank == 0:
      print(f"[nodes] {text}", flush=True)

  def barrier(self, name: str) -> None:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)

  def agree(self, values: Sequence[int]) -> list:
    """Process 0's ``values`` (ints) on every process."""
    from jax.experimental import multihost_utils
    return [int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))]

  def set_rate(self, rate: str) -> None:
    """Process 0 sets every link's rate; every process waits for it."""
    if self.rank == 0:
      namespaces.set_nodes_rate(self.job["namespaces"], rate)
    self.barrier(f"rate {rate}")

  def sent(self) -> int:
    """Bytes all nodes have sent over their links so far (process 0; others 0)."""
    return sum(namespaces.nodes_sent(self.job["namespaces"])) if self.rank == 0 else 0

  def batch(self, step: int) -> tuple:
    """This process's rows of the step's global batch, placed over its devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    inputs, targets = self.task.batch(self.job["seed"], step, self.job["batch_size"])
    mine = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
    sharding = NamedSharding(self.mesh, PartitionSpec(("replica", "data")))
    return tuple(jax.make_array_from_process_local_data(sharding, np.asarray(x[mine]))
                 for x in (inputs, targets))

  def probe(self) -> dict:
    """The link between nodes 0 and 1, unlimited and at the job's rate: ``{rate: {"alpha": s,
    "beta": bytes/s}}`` (process 0's)."""
    found = {}
    for rate in ("none", self.job["rate"]):
      self.set_rate(rate)
      received, thread = {}, None
      if self.rank == 1:
        server = namespaces.listen(self.job["addresses"][1])
        thread = threading.Thread(target=namespaces.sink, args=(server, received))
        thread.start()
      self.barrier(f"probe {rate}")
      if self.rank == 0:
        found[rate] = {"alpha": namespaces.source(self.job["addresses"][1], seconds=1.0)}
      if thread is not None:
        thread.join()
      from jax.experimental import multihost_utils
      measured = received.get("bytes", 0) / received.get("seconds", 1)
      beta = multihost_utils.process_allgather(np.asarray(measured, np.float64))[1]
      found.setdefault(rate, {})["beta"] = float(beta)
    return found

  def overhead(self) -> float:
    """Bytes a device sends over the link per operand of an all-reduce between nodes, beyond the
    operand's own: XLA:CPU runs one gloo all-reduce per operand of a combined (tuple) all-reduce,
    each with messages of its own. Measured with tuples of 1 and 17 operands of 8 values."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec
    sent = []
    for count in (1, 17):
      program = jax.jit(jax.shard_map(
          lambda x, k=count: sum(jax.lax.psum([x + i for i in range(k)], "replica")),
          mesh=self.mesh, in_specs=PartitionSpec(("replica", "data")),
          out_specs=PartitionSpec(("replica", "data"))))
      x = self.batch(0)[1][:, :8].astype(jnp.float32)
      program(x).block_until_ready()
      self.barrier(f"overhead {count}")
      before = self.sent()
      for _ in range(10):
        program(x).block_until_ready()
      self.barrier(f"overhead {count} done")
      sent.append((self.sent() - before) / 10)
    return max(sent[1] - sent[0], 0.0) / (16 * self.mesh.size)

  def take_step(self, compiled, state: list, t: int) -> float:
    """Step ``t`` (a synchronization between nodes where the recipe has one there); ``state``
    (params, opt_state) is replaced; returns this process's mean loss (blocks)."""
    state[0], state[1], losses = compiled(*state, *self.batch(t))
    return float(np.mean([np.asarray(s.data) for s in losses.addressable_shards]))

  def calibrate(self, compiled, start: tuple) -> float:
    """The median step over an unlimited link, from ``start`` (the steps are then discarded)."""
    self.set_rate("none")
    state, times = list(start), []
    for t in range(CALIBRATION_STEPS):
      began = time.perf_counter()
      self.take_step(compiled, state, t)
      times.append(time.perf_counter() - began)
    self.set_rate(self.job["rate"])
    return float(np.median(times[1:]))

  def train(self, name: str, target) -> dict:
    """Trains entry ``name`` over the link: its recipe for the job's steps, then on until the
    held-out loss reaches ``target`` (None: no further) or ``max_steps``."""
    import jaxcomp
    from jaxcomp.train import registry, runs
    from jaxcomp.train.training_step import first_copy
    entry = registry.REGISTRY[name]
    steps = self.job["steps"]
    dp, _ = make_step(self.task, entry, self.mesh, steps)
    start = (dp.make_params(self.params0), dp.make_state(self.params0))
    compiled = dp.step.lower(*start, *self.batch(0)).compile()
    # What crosses the link: the collectives over replica, per phase of the recipe.
    phases = {}
    for phase in entry.phases(steps):
      program = compiled
      if len(entry.phases(steps)) > 1:
        steady, _ = make_step(self.task, registry.REGISTRY[phase.name], self.mesh,
                              **phase.settings)
        program = steady.step.lower(steady.make_params(self.params0),
                                    steady.make_state(self.params0), *self.batch(0)).compile()
      report = jaxcomp.comm_report(program, num_devices=self.mesh.size)
      phases[runs.program_key(phase.name, phase.settings)] = {
          "first_step": phase.first_step, "collectives": collectives(report, self.mesh)}
    compute = self.calibrate(compiled, start)
    self.say(f"{name}: compiled; a step over an unlimited link {1e3 * compute:.0f} ms")
    every = max(steps // self.job["evaluations"], 1)
    state, losses, seconds, evals = list(start), [], [], [(0,) + self.task.evaluate(self.params0)]
    self.barrier(f"train {name}")
    sent = self.sent()
    t, going = 0, True
    while going:
      began = time.perf_counter()
      losses.append(self.take_step(compiled, state, t))
      seconds.append(time.perf_counter() - began)
      t += 1
      if t % every == 0 or t == steps:
        go = 1
        if self.rank == 0:
          evals.append((t,) + self.task.evaluate(first_copy(state[0], self.params0)))
          reached = target is not None and _held_out(evals) <= target
          go = int(t < steps or (not reached and t < self.job["max_steps"] and target is not None))
        going = bool(self.agree([go])[0])
    sent = self.sent() - sent
    self.say(f"{name}: {t} steps in {sum(seconds):.1f} s, {sent / 1e6:.2f} MB over the link")
    return {"name": name, "steps": steps, "losses": losses, "step_seconds": seconds,
            "evals": evals, "compute_seconds": compute, "link_bytes": sent, "phases": phases}


def collectives(report, mesh) -> list:
  """``[axes, op, bytes, share, operands]`` of each collective of ``report`` (a compiled step's
  ``jaxcomp.comm_report``): the mesh axes its groups span, its bytes as the α-β formulas take them
  (``network.operands``: an all-gather's contribution of one device), the share of steps it runs
  on and how many arrays it carries."""
  from jaxcomp.train import network
  return [[list(axes), op, nbytes, share, len(c.shapes)]
          for axes, part in report.by_axes(mesh).items()
          for c, (op, nbytes, share) in zip(part.collectives, network.operands(part))]


def _held_out(evals: list) -> float:
  """The held-out loss after the last evaluation: the mean of the last ``runs.WINDOW``."""
  from jaxcomp.train.runs import WINDOW
  return float(np.mean([e[1] for e in evals[1:][-WINDOW:]]))


def process_main(argv: Sequence[str]) -> int:
  """``SPEC RANK OUT``: one process of the job in SPEC (JSON); process 0 writes the results to
  OUT."""
  spec, rank, out = argv
  with open(spec) as f:
    job = json.load(f)
  rank = int(rank)
  join(job, rank)
  process = NodeProcess(job, rank)
  process.say("joined")
  result = {"probe": process.probe(), "overhead": process.overhead(), "runs": []}
  process.say("link measured")
  target = job["target"]
  for name in job["names"]:
    run = process.train(name, target)
    if name == "allreduce" and job["target"] is None:
      target = _held_out(run["evals"])
    result["runs"].append(run)
  from jax.experimental import multihost_utils
  peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  result["peak_bytes"] = [1024 * int(v) for v in
                          multihost_utils.process_allgather(np.int32(peak_kib))]
  process.barrier("done")
  if rank == 0:
    with open(out, "w") as f:
      json.dump(result, f)
  import jax
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
  sys.exit(process_main(sys.argv[1:]))
