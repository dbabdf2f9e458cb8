"""DiLoCo and Streaming DiLoCo over a real slow link: jaxcomp beside torchft 0.2.0, and allreduce of
both, trained to allreduce's held-out loss.

Every run is a job of 2 nodes over links of ``--rate`` each way (``jaxcomp.train.namespaces.Nodes``:
a network namespace per node, joined through a switch by links limited with tc tbf), one process
per node, on the main job's task (the chars transformer, global batch 32, the same batch rows per
step everywhere):

* jaxcomp: ``python -m jaxcomp.train``'s several-nodes job (``jaxcomp.train.nodes``), one
  simulated CPU device per process by default, as torch's one process per node
  (``--devices-per-process``), on the mesh ``("replica", "data")``: ``allreduce`` (the exact mean,
  ``jaxcomp.hierarchical``: reduce-scatter inside a node, one all-reduce between nodes,
  all-gather), ``diloco_h20`` and ``streaming_diloco_h20_p2`` over ``"replica"``, the partitioner
  averaging inside a node;
* torch 2.13 (``char_transformer``: the same model with the same initial parameters) in one
  process per node, its threads the machine's cores shared out between the processes:
  ``DistributedDataParallel`` over gloo (``bucket_cap_mb=100``), and torchft's
  ``DiLoCo`` — one fragment, and two (Streaming DiLoCo) — with a ``Lighthouse`` on node 0, a
  ``Manager`` (``use_async_quorum=False``) and ``ProcessGroupGloo`` per node, unquantized (its
  quantized exchange needs triton, GPU only).

The same optimizers on both sides: allreduce runs the main job's SGD (lr 0.3, momentum 0.9) after
``clip_by_global_norm(1)``; DiLoCo's inner optimizer is AdamW (lr 3e-3, β2 0.99, weight decay 0.1)
after ``clip_by_global_norm(1)`` on each process's own gradient, the outer one SGD (lr 0.7, Nesterov
momentum 0.9), H = 20; Streaming DiLoCo: 2 fragments, an exchange overlapping 1 step
(``fragment_sync_delay=1``), mixed half and half (``fragment_update_alpha=0.5``). torchft's
fragments are modules (the first block with the embeddings, the second with the head), jaxcomp's
are strided whole leaves: the fragments differ, their count and schedule do not.

Per run: the wall-clock until the held-out loss (the mean of the last 5 evaluations, of process 0's
parameters) first reaches the target — jaxcomp allreduce's after ``--steps`` — summing the timed
steps (evaluations left out); the held-out loss after ``--steps``; the bytes that crossed the links
(the nodes' transmit counters, whole run); the peak memory of a process (its largest resident set).
Runs go on past ``--steps`` until they reach the target or ``--max-steps``. Everything runs
``--runs`` times (default 2), alternating the systems, and both runs are tabled.

  PYTHONPATH=. python benchmarks/torchft_diloco.py [--quick] [--write] [--rate 100mbit]
      [--steps 400] [--runs 2] [--devices-per-process 1]
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import socket
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jaxcomp.train import namespaces, nodes  # noqa: E402

JAX = {"allreduce": "allreduce", "diloco": "diloco_h20", "streaming": "streaming_diloco_h20_p2"}
TORCH = {"allreduce": "DDP all-reduce", "diloco": "torchft DiLoCo",
         "streaming": "torchft Streaming DiLoCo"}
SYNC_EVERY, FRAGMENTS, DELAY, MIX = 20, 2, 1, 0.5  # the registry's streaming_diloco_h20_p2
PORTS = {"gloo": 29500, "store": 29501, "lighthouse": 29510, "manager": 29520}


# ------------------------------------------------------------------------------- the torch model


def char_transformer(params, shape: dict):
  """The task's Flax ``CharTransformer`` in torch, with ``params`` (Flax's) as its parameters:
  pre-LayerNorm blocks (ε 1e-6), causal multi-head attention (query, key and value kernels
  ``(width, heads, head_dim)``), a tanh-GELU MLP; ``position`` in a module of its own, so that a
  fragment can hold it."""
  import torch
  from torch import nn
  from torch.nn import functional

  width, heads = shape["width"], shape["heads"]

  def linear(kernel, bias):
    kernel, bias = np.asarray(kernel), np.asarray(bias)
    layer = nn.Linear(kernel.shape[0], int(np.prod(kernel.shape[1:])))
    with torch.no_grad():
      layer.weight.copy_(torch.from_numpy(kernel.reshape(kernel.shape[0], -1).T.copy()))
      layer.bias.copy_(torch.from_numpy(bias.reshape(-1).copy()))
    return layer

  def norm(p):
    layer = nn.LayerNorm(width, eps=1e-6)
    with torch.no_grad():
      layer.weight.copy_(torch.from_numpy(np.array(p["scale"])))
      layer.bias.copy_(torch.from_numpy(np.array(p["bias"])))
    return layer

  class Block(nn.Module):
    def __init__(self, i):
      super().__init__()
      attention = params[f"MultiHeadDotProductAttention_{i}"]
      self.norm1, self.norm2 = norm(params[f"LayerNorm_{2 * i}"]), norm(
          params[f"LayerNorm_{2 * i + 1}"])
      self.qkv = nn.ModuleList([linear(attention[k]["kernel"], attention[k]["bias"])
                                for k in ("query", "key", "value")])
      out = attention["out"]
      self.out = linear(np.asarray(out["kernel"]).reshape(width, width), out["bias"])
      # Flax creates the outer Dense first: Dense_{2i} is width x 4 -> width.
      self.up = linear(params[f"Dense_{2 * i + 1}"]["kernel"], params[f"Dense_{2 * i + 1}"]["bias"])
      self.down = linear(params[f"Dense_{2 * i}"]["kernel"], params[f"Dense_{2 * i}"]["bias"])

    def forward(self, x):
      batch, length, _ = x.shape
      h = self.norm1(x)
      q, k, v = (f(h).view(batch, length, heads, -1).transpose(1, 2) for f in self.qkv)
      attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
      return x + self.down(functional.gelu(self.up(self.norm2(x)), approximate="tanh"))

  class Position(nn.Module):
    def __init__(self):
      super().__init__()
      self.position = nn.Parameter(torch.from_numpy(np.asarray(params["position"]).copy()))
      self.embed = nn.Embedding.from_pretrained(
          torch.from_numpy(np.asarray(params["Embed_0"]["embedding"]).copy()), freeze=False)

    def forward(self, tokens):
      return self.embed(tokens) + self.position[:tokens.shape[-1]]

  class Model(nn.Module):
    def __init__(self):
      super().__init__()
      self.inputs = Position()
      self.blocks = nn.ModuleList([Block(i) for i in range(shape["depth"])])
      self.norm = norm(params[f"LayerNorm_{2 * shape['depth']}"])
      last = params[f"Dense_{2 * shape['depth']}"]
      self.head = linear(last["kernel"], last["bias"])

    def forward(self, tokens):
      x = self.inputs(tokens)
      for block in self.blocks:
        x = block(x)
      return self.head(self.norm(x))

    def fragments(self, count: int) -> list:
      """``count`` modules that hold every parameter: consecutive blocks, the embeddings with
      the first, the head with the last."""
      parts = [[self.inputs]] + [[] for _ in range(count - 1)]
      for i, block in enumerate(self.blocks):
        parts[i * count // len(self.blocks)].append(block)
      parts[-1] += [self.norm, self.head]
      return [nn.ModuleList(part) for part in parts]

  return Model()


# --------------------------------------------------------------------------- a torch process


@dataclasses.dataclass
class TorchJob:
  """What a torch process trains (``process_main``); ``nodes.launch`` fills in the nodes."""
  system: str
  task: str
  quick: bool
  seed: int
  batch_size: int
  steps: int
  max_steps: int
  target: Optional[float]
  folder: str
  processes: int = 2
  rate: str = "100mbit"
  evaluations: int = 20
  timeout_seconds: int = 600
  heartbeat_timeout_ms: Optional[int] = None  # None: torchft's Lighthouse's default
  join_timeout_ms: Optional[int] = None
  addresses: list = dataclasses.field(default_factory=list)
  namespaces: list = dataclasses.field(default_factory=list)


def _decided(folder: str, step: int, rank: int, go: Optional[bool] = None) -> bool:
  """Process 0's decision at ``step`` to go on, shared through a file (both processes are on this
  machine, so the decision does not cross the link)."""
  path = os.path.join(folder, f"go-{step}")
  if rank == 0:
    with open(path + ".tmp", "w") as f:
      f.write("1" if go else "0")
    os.replace(path + ".tmp", path)
    return bool(go)
  while not os.path.exists(path):
    time.sleep(0.01)
  with open(path) as f:
    return f.read() == "1"


def _setup(job: dict, rank: int, model):
  """``(optimizer step, context)`` of the job's system: DDP's SGD, or torchft's DiLoCo around
  AdamW (each clipping the gradient to norm 1 first)."""
  import contextlib
  from datetime import timedelta

  import torch
  me, first = job["addresses"][rank], job["addresses"][0]
  clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
  if job["system"] == "allreduce":
    torch.distributed.init_process_group("gloo", init_method=f"tcp://{first}:{PORTS['gloo']}",
                                         rank=rank, world_size=job["processes"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
    sgd = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    return ddp, sgd, clip, contextlib.nullcontext()
  from torchft.checkpointing.http_transport import HTTPTransport
  from torchft.coordination import LighthouseServer
  from torchft.local_sgd import DiLoCo
  from torchft.manager import Manager
  from torchft.process_group import ProcessGroupGloo
  from torch.distributed import TCPStore
  if rank == 0:
    job["lighthouse"] = LighthouseServer(bind=f"[::]:{PORTS['lighthouse']}", min_replicas=2,
                                         heartbeat_timeout_ms=job["heartbeat_timeout_ms"],
                                         join_timeout_ms=job["join_timeout_ms"])
  job["store"] = TCPStore(me, PORTS["store"], is_master=True, wait_for_workers=False)
  adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
  timeout = timedelta(seconds=job["timeout_seconds"])

  class NodeTransport(HTTPTransport):
    """torchft's checkpoint transport (a healing replica fetches the state from a live peer over
    HTTP) at the node's address: the nodes share this machine's host name, which each node's
    hosts file resolves to its own address."""

    def address(self) -> str:
      return super().address().replace(f"//{socket.gethostname()}:", f"//{me}:", 1)

  job["manager"] = manager = Manager(
                    pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2,
                    use_async_quorum=False, load_state_dict=None, state_dict=None,
                    replica_id=f"node{rank}", store_addr=me, store_port=PORTS["store"], rank=0,
                    world_size=1, lighthouse_addr=f"http://{first}:{PORTS['lighthouse']}",
                    port=PORTS["manager"], hostname=me, timeout=timeout, quorum_timeout=timeout,
                    checkpoint_transport=NodeTransport(timeout=timeout, num_chunks=0),
                    init_sync=False)  # every replica starts from the same parameters
  count = FRAGMENTS if job["system"] == "streaming" else 1
  fragments = model.fragments(count)
  outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
           for f in fragments]
  diloco = DiLoCo(manager, fragments, adamw, outer, sync_every=SYNC_EVERY,
                  fragment_sync_delay=DELAY if count > 1 else 0,
                  fragment_update_alpha=1 - MIX if count > 1 else 0.0)
  return model, adamw, clip, diloco


def build(job: dict) -> tuple:
  """``(task, model, loss_of, batch)`` of a torch process of ``job``: the task, its model in torch
  with the task's initial parameters, the loss of logits against targets, and ``batch(rank,
  step)``: process ``rank``'s rows of the global batch of ``step`` (numpy inputs, targets)."""
  import torch

  from jaxcomp.train import tasks
  # The machine's cores shared out: more threads than cores make torch's OpenMP spin (a step of
  # the quick model took 5-13 ms on one thread, 120-190 ms on two of a busy 2-core machine).
  torch.set_num_threads(max(1, (os.cpu_count() or 1) // job["processes"]))
  task = tasks.get(job["task"], quick=job["quick"])
  shape = dict(tasks.CHARS_SIZES["small"])
  if job["quick"]:
    shape.update(context=32, width=32, depth=1, heads=4)
  model = char_transformer(task.init(job["seed"]), shape)
  loss_of = lambda logits, y: torch.nn.functional.cross_entropy(  # noqa: E731
      logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

  def batch(rank: int, step: int) -> tuple:
    return rows(task, job["seed"], step, job["batch_size"], job["processes"], rank)
  return task, model, loss_of, batch


def rows(task, seed: int, step: int, batch_size: int, processes: int, rank: int) -> tuple:
  """Process ``rank``'s rows of ``task``'s global batch of ``step`` (numpy inputs, targets)."""
  inputs, targets = task.batch(seed, step, batch_size)
  share = batch_size // processes
  return inputs[rank * share:(rank + 1) * share], targets[rank * share:(rank + 1) * share]


def process_main(argv) -> int:
  """``SPEC RANK OUT``: one torch process of the job in SPEC; process 0 writes its results."""
  import torch

  spec, rank, out = argv
  rank = int(rank)
  with open(spec) as f:
    job = json.load(f)
  task, model, loss_of, batch = build(job)
  forward, optimizer, clip, context = _setup(job, rank, model)
  test = torch.from_numpy(task.test_inputs.astype(np.int64))
  test_targets = torch.from_numpy(task.test_targets.astype(np.int64))
  every = max(job["steps"] // job["evaluations"], 1)
  seconds, evals, t, going = [], [], 0, True
  with torch.no_grad():
    evals.append((0, float(loss_of(model(test), test_targets))))
  sent = sum(namespaces.nodes_sent(job["namespaces"])) if rank == 0 else 0
  with context:
    while going:
      x, y = (torch.from_numpy(a.astype(np.int64)) for a in batch(rank, t))
      began = time.perf_counter()
      optimizer.zero_grad()
      loss_of(forward(x), y).backward()
      clip()
      optimizer.step()
      seconds.append(time.perf_counter() - began)
      t += 1
      if t % every == 0 or t == job["steps"]:
        go = None
        if rank == 0:
          with torch.no_grad():
            evals.append((t, float(loss_of(model(test), test_targets))))
          held = float(np.mean([e[1] for e in evals[1:][-5:]]))
          reached = job["target"] is not None and held <= job["target"]
          go = t < job["steps"] or (not reached and t < job["max_steps"]
                                    and job["target"] is not None)
        going = _decided(job["folder"], t, rank, go)
  sent = sum(namespaces.nodes_sent(job["namespaces"])) - sent if rank == 0 else 0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  with open(f"{out}.{rank}", "w") as f:
    json.dump({"peak": peak}, f)
  if rank == 0:
    while not os.path.exists(f"{out}.1"):
      time.sleep(0.05)
    with open(f"{out}.1") as f:
      peaks = [peak, json.load(f)["peak"]]
    with open(out, "w") as f:
      json.dump({"step_seconds": seconds, "evals": evals, "peak_bytes": peaks,
                 "loop_bytes": sent}, f)
  os._exit(0)  # torchft's manager and lighthouse threads would keep the process


# ------------------------------------------------------------------------------------ the runs


def _held_out(evals, step: int) -> float:
  """The held-out loss at ``step``: the mean of the last 5 evaluations up to it."""
  done = [e[1] for e in evals[1:] if e[0] <= step] or [evals[0][1]]
  return float(np.mean(done[-5:]))


def summary(label: str, steps_seconds: list, evals: list, link: float, peaks: list,
            steps: int, target: float) -> dict:
  """One row's numbers: wall-clock and steps to ``target``, the held-out loss after ``steps``."""
  reached = next((e[0] for e in evals[1:] if _held_out(evals, e[0]) <= target), None)
  median = float(np.median(steps_seconds[2:] or steps_seconds))
  to_target = float(np.sum(steps_seconds[:reached])) if reached else None
  return {"system": label, "reached": reached, "steps_run": len(steps_seconds),
          "to_target": to_target, "median_step": median,
          "beyond_median": to_target - reached * median if reached else None,
          "loss": _held_out(evals, steps), "link": link, "peak": max(peaks)}


def where_the_time_goes(rows: list) -> str:
  """For each jaxcomp row beside its torch row: the difference in wall-clock to target, split into
  the steps at their median (the compute of a step) and the time above it (the exchanges and
  whatever else makes a step slower than the median)."""
  lines = []
  for ours, theirs in zip(rows[::2], rows[1::2]):
    if ours["to_target"] is None or theirs["to_target"] is None:
      continue
    at_median = (ours["reached"] * ours["median_step"]
                 - theirs["reached"] * theirs["median_step"])
    difference = ours["to_target"] - theirs["to_target"]
    lines.append(f"{ours['system']}: {ours['to_target'] / theirs['to_target']:.2f}x "
                 f"{theirs['system']}'s wall-clock to target ({difference:+.1f} s: "
                 f"{at_median:+.1f} s in the steps at their median, "
                 f"{ours['beyond_median'] - theirs['beyond_median']:+.1f} s above it)")
  return "; ".join(lines) + "."


def run_jaxcomp(system: str, args, target: Optional[float]) -> dict:
  """``system`` (``JAX``) as the several-nodes job; the job's own probe traffic left out."""
  job = nodes.NodeJob(task="chars", quick=args.quick, seed=0, batch_size=32, processes=2,
                      devices_per_process=args.devices_per_process, rate=args.rate,
                      names=[JAX[system]],
                      steps=args.steps, max_steps=args.max_steps, target=target)
  result = nodes.launch(job, log=lambda line: print(f"  jaxcomp {line}", file=sys.stderr))
  run = result["runs"][0]
  evals = [(e[0], e[1]) for e in run["evals"]]
  return dict(seconds=run["step_seconds"], evals=evals, link=run["link_bytes"],
              peaks=result["peak_bytes"])


def run_torch(system: str, args, target: float) -> dict:
  """``system`` in torch (DDP, or torchft's DiLoCo) as 2 processes over the nodes' links."""
  import tempfile
  with tempfile.TemporaryDirectory(prefix="jaxcomp_torchft_") as folder:
    job = TorchJob(system=system, task="chars", quick=args.quick, seed=0, batch_size=32,
                   steps=args.steps, max_steps=args.max_steps, target=target, folder=folder,
                   rate=args.rate)
    result = nodes.launch(job, command=[sys.executable, os.path.abspath(__file__), "--process"],
                          log=lambda line: None)
  return dict(seconds=result["step_seconds"], evals=result["evals"],
              link=result["loop_bytes"], peaks=result["peak_bytes"])


def table(rows: list, steps: int) -> str:
  from benchmarks import common
  cells = [[r["system"], f"{r['reached']}" if r["reached"] else f"not in {r['steps_run']}",
            f"{r['to_target']:.1f} s" if r["to_target"] else "-",
            f"{1e3 * r['median_step']:.0f} ms",
            f"{r['beyond_median']:.1f} s" if r["to_target"] else "-",
            f"{r['loss']:.3f}", common.human(r["link"]), common.human(r["peak"])] for r in rows]
  return common.markdown_table(["system", "steps to target", "wall-clock to target",
                                "median step", "above the median, to target",
                                f"held-out loss after {steps} steps",
                                "over the links", "peak memory / process"], cells)


def main(argv=None) -> int:
  from benchmarks import common
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--rate", default="100mbit", help="each node's link, each way")
  p.add_argument("--steps", type=int, default=None, help="recipe length (default 400; quick 20)")
  p.add_argument("--max-steps", type=int, default=None,
                 help="how far a run goes on to reach the target (default 3 x --steps)")
  p.add_argument("--runs", type=int, default=None, help="repetitions (default 2; quick 1)")
  p.add_argument("--devices-per-process", type=int, default=1,
                 help="jaxcomp's simulated CPU devices per process (1: one per node, as torch's "
                      "one process per node)")
  args = common.parse(p, argv)
  args.steps = args.steps or (20 if args.quick else 400)
  args.max_steps = args.max_steps or 3 * args.steps
  runs = args.runs or (1 if args.quick else 2)
  reason = namespaces.unavailable_reason()
  if reason:
    print(f"torchft_diloco.py: error: {reason}", file=sys.stderr)
    return 2
  started, tables = time.perf_counter(), []
  for r in range(runs):
    rows, target = [], None
    for system in JAX:
      for side, run in (("jaxcomp", run_jaxcomp), ("torch", run_torch)):
        label = f"jaxcomp {JAX[system]}" if side == "jaxcomp" else TORCH[system]
        print(f"run {r + 1}: {label}", file=sys.stderr, flush=True)
        got = run(system, args, target)
        if target is None:
          target = _held_out(got["evals"], args.steps)
        rows.append(summary(label, got["seconds"], got["evals"], got["link"], got["peaks"],
                            args.steps, target))
    tables.append(f"**Run {r + 1}** (target: jaxcomp allreduce's held-out loss after "
                  f"{args.steps} steps, {target:.3f}):\n\n" + table(rows, args.steps)
                  + "\n\n" + where_the_time_goes(rows))
  body = "\n\n".join([
      f"The chars transformer, 2 nodes (one process each) over links of {args.rate} each way "
      "(a network namespace per node, tc tbf), global batch 32; jaxcomp with "
      f"{args.devices_per_process} simulated CPU device(s) per process, torch with one process "
      "per node, each process's threads the machine's cores shared out; "
      f"{time.perf_counter() - started:.0f} s in all. Wall-clock to target: the timed steps "
      "until the held-out loss (mean of the last 5 evaluations) first reaches the target, "
      "evaluations left out; above the median, to target: that wall-clock less the steps to "
      "target at the median step, the time the exchanges add (and any step slower than the "
      "median); over the links: the nodes' transmit counters during training.",
      *tables])
  common.emit(args, "several_nodes", "Several nodes over a slow link (against torchft)",
              "torchft_diloco.py", body)
  return 0


if __name__ == "__main__":
  if sys.argv[1:2] == ["--process"]:
    process_main(sys.argv[2:])
  sys.exit(main())
