"""torch DDP beside jaxcomp over the slow link: the torch side of ``benchmarks/slow_link.py``.

The slow-link workers (``jaxcomp.train.link_job``) time jaxcomp's training steps; started through
this script (``python benchmarks/torch_ddp.py --worker SPEC RANK OUT``) they also time torch 2.13
``DistributedDataParallel`` steps of the same MLP — the JAX initial parameters, the same fresh batch
rows per step, SGD with momentum 0.9 after ``clip_grad_norm_(1)`` as the main job's optimizer — one
DDP model per hook, over a gloo group of their own inside the namespace, interleaved round by round
with the jaxcomp steps. The job names the jaxcomp programs to pair with torch in
``Job.extra["torch"]`` (keys of ``TORCH``).

``bucket_cap_mb=100`` gives one bucket: torch 2.13's ``powerSGD_hook`` hangs on gloo with several.
jaxcomp itself never imports torch; only this benchmark does.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jaxcomp.train import link_job  # noqa: E402

PORT = 12356  # the gloo group's rendezvous (besides link_job.JAX_PORT, namespaces.PROBE_PORT)
# jaxcomp program -> (label, hook, PowerSGD rank or None).
TORCH = {"allreduce": ("DDP all-reduce", None, None),
         "fp16": ("fp16_compress_hook", "fp16", None),
         "powersgd_r1": ("powerSGD_hook(rank=1)", "powersgd", 1),
         "powersgd_r4": ("powerSGD_hook(rank=4)", "powersgd", 4)}


def mlp(params):
  """The task's Flax MLP (``Dense_0`` … ``Dense_k``, ReLU between) as a torch ``Sequential`` with
  the same parameters (a Linear's weight is the transposed kernel)."""
  import torch
  layers = sorted(params)
  modules = []
  for i, layer in enumerate(layers):
    kernel = np.asarray(params[layer]["kernel"])
    linear = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
      linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
      linear.bias.copy_(torch.from_numpy(np.asarray(params[layer]["bias"])))
    modules += [linear] + ([torch.nn.ReLU()] if i < len(layers) - 1 else [])
  return torch.nn.Sequential(*modules)


def ddp(module, hook, rank):
  """``module`` under DDP with ``hook`` (None: DDP's all-reduce; "fp16"; "powersgd" of ``rank``)."""
  import torch
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
  model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=100)
  if hook == "fp16":
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
  elif hook == "powersgd":
    model.register_comm_hook(psgd.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=rank,
                                                start_powerSGD_iter=2), psgd.powerSGD_hook)
  return model


def programs(worker) -> dict:
  """``{"torch:NAME": run(k)}`` for every NAME in ``worker.job.extra["torch"]``: ``run(k)`` takes
  ``k`` DDP steps, each on this worker's rows of a fresh batch (``worker.next_step()``),
  blocking."""
  names = (worker.job.extra or {}).get("torch") or []
  if not names:
    return {}
  import torch
  import torch.distributed as dist

  torch.set_num_threads(1)
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=worker.rank,
                          world_size=worker.job.world)
  params = worker.task.init(worker.job.seed)
  runners = {}
  for name in names:
    _, hook, rank = TORCH[name]
    model = ddp(mlp(params), hook, rank)
    opt = torch.optim.SGD(model.parameters(), lr=worker.task.learning_rate, momentum=0.9)

    def run(k, model=model, opt=opt):
      for _ in range(k):
        inputs, targets = worker.local_batch(worker.next_step())
        x, y = torch.from_numpy(inputs), torch.from_numpy(targets.astype(np.int64))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP's hook averages the gradient here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
    runners[f"torch:{name}"] = run
  return runners


WORKER = [sys.executable, os.path.abspath(__file__), "--worker"]
"""The worker command for ``link_job.run_job``: a slow-link worker that also times torch DDP."""

if __name__ == "__main__":
  if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 5:
    sys.exit("usage: python benchmarks/torch_ddp.py --worker SPEC RANK OUT (started by "
             "jaxcomp.train.link_job.run_job; benchmarks/slow_link.py is the command to run)")
  sys.exit(link_job.worker_main(sys.argv[2:], extra_programs=programs))
