"""Runs torch's real ``powerSGD_hook`` on two Gloo processes and saves what it did as a golden file.

    python tests/golden/make_powersgd_golden.py            # writes tests/golden/powersgd_torch.npz

Two processes (ranks 0 and 1, world size 2) meet on 127.0.0.1 and wrap a module in DDP with the hook
registered. The module's loss is ``sum(p * g)`` over its parameters, so each rank's gradient is
exactly the tensor ``g`` this file draws for that rank and step (``gradients``). For every
configuration (rank 1, 2 and 4 — 4 takes the QR path — with and without error feedback and warm
start) it records, for ``STEPS`` steps across ``START_ITER``: the reduced gradients, each rank's
error after each compressed step, the raw random Q torch drew at each step where it drew one (the
hook is wrapped to compute it from a copy of torch's RNG, the way the hook does, before calling it),
and ``compression_stats()``. It also records that ``batched_powerSGD_hook`` raises at its first
compressed step.

Arrays are laid out torch's way (Linear weight (out, in), conv (out, in, kh, kw)); jaxcomp
reproduces them with ``matrix_view="torch"`` (tests/test_powersgd_torch.py). This module imports
torch only inside the functions that run it, so the test can read its constants without torch.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

WORLD = 2
START_ITER = 2
STEPS = 5
# name -> torch-layout shape. At rank 4, w1 and w2 are compressed with QR, conv (6 x 18) is sent
# dense and w3 (3 x 20, effective rank 3) too; at ranks 1 and 2 they are Gram–Schmidt matrices.
SHAPES = {
    "conv": (6, 2, 3, 3),
    "w1": (18, 16),
    "b1": (18,),
    "w2": (16, 20),
    "b2": (16,),
    "w3": (3, 20),
}
CONFIGS = tuple((rank, error_feedback, warm_start) for rank in (1, 2, 4)
                for error_feedback in (True, False) for warm_start in (True, False))
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "powersgd_torch.npz")


def gradients(config: int, step: int, rank: int) -> dict:
  """The gradient of ``rank`` at ``step`` of configuration ``config``: float32, name -> array."""
  rng = np.random.default_rng([1234, config, step, rank])
  return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def flat(arrays: dict) -> np.ndarray:
  """The arrays of ``SHAPES``' names concatenated, raveled, in ``SHAPES`` order."""
  return np.concatenate([np.ravel(arrays[name]) for name in SHAPES])


def _worker(rank: int, port: int, out: str) -> None:
  import copy
  from collections import defaultdict

  import torch
  import torch.distributed as dist
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
  from torch.nn.parallel import DistributedDataParallel

  torch.set_num_threads(1)
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=WORLD)

  class GradModel(torch.nn.Module):
    """loss = Σ sum(p · g): the gradient of p is g exactly."""

    def __init__(self):
      super().__init__()
      self.params = torch.nn.ParameterDict(
          {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in SHAPES.items()})

    def forward(self, grads):
      return sum((self.params[name] * grads[name]).sum() for name in SHAPES)

  def torch_initial_qs(state, bucket, names):
    """The raw Qs torch's hook is about to draw, computed as it does from a copy of its RNG."""
    seed = copy.deepcopy(state.rng).randint(1_000_000_000)
    by_shape = defaultdict(list)
    for name, tensor in zip(names, bucket.gradients()):
      n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
      r = min(n, m, state.matrix_approximation_rank)
      if psgd._should_compress(n, m, r, state.min_compression_rate)[0]:
        by_shape[(n, m)].append((name, m, r))
    qs = {}
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(seed)
      for group in by_shape.values():
        for name, m, r in group:
          qs[name] = torch.randn(1, m, r, dtype=tensor.dtype)[0].numpy()
    return qs

  saved = {}
  for c, (r, error_feedback, warm_start) in enumerate(CONFIGS):
    model = GradModel()
    names_of = {id(p): name for name, p in model.params.items()}
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                               start_powerSGD_iter=START_ITER, use_error_feedback=error_feedback,
                               warm_start=warm_start, random_seed=0)
    seen = {}

    def hook(state, bucket, seen=seen, c=c, names_of=names_of):
      names = [names_of[id(p)] for p in bucket.parameters()]
      seen["names"] = names
      if state.iter >= state.start_powerSGD_iter and (
          not state.warm_start or bucket.index() not in state.p_memory_dict):
        for name, q in torch_initial_qs(state, bucket, names).items():
          saved[f"c{c}_q{state.iter}_{name}"] = q
      return psgd.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    outputs, errors = [], []
    for step in range(STEPS):
      grads = {k: torch.from_numpy(v) for k, v in gradients(c, step, rank).items()}
      for p in model.parameters():
        p.grad = None
      ddp(grads).backward()
      outputs.append(flat({name: p.grad.numpy() for name, p in model.params.items()}))
      if error_feedback and step >= START_ITER:
        buffer = state.error_dict[0].numpy()
        offsets = np.cumsum([0] + [int(np.prod(SHAPES[name])) for name in seen["names"]])
        errors.append(flat({name: buffer[offsets[i]:offsets[i + 1]].reshape(SHAPES[name])
                            for i, name in enumerate(seen["names"])}))
    saved[f"c{c}_out"] = np.stack(outputs)
    if error_feedback:
      saved[f"c{c}_err"] = np.stack(errors)
    saved[f"c{c}_stats"] = np.asarray(state.compression_stats(), np.float64)

  # torch 2.13's batched hook passes a 2-D Q to an orthogonalizer that asserts 3-D.
  model = GradModel()
  ddp = DistributedDataParallel(model, bucket_cap_mb=25)
  ddp.register_comm_hook(psgd.PowerSGDState(process_group=None, start_powerSGD_iter=START_ITER),
                         psgd.batched_powerSGD_hook)
  raised = ""
  for step in range(START_ITER + 1):
    grads = {k: torch.from_numpy(v) for k, v in gradients(0, step, rank).items()}
    try:
      ddp(grads).backward()
    except AssertionError as error:
      raised = f"AssertionError at step {step}: {error!r}"
      break
  saved["batched_raised"] = np.asarray(raised)
  saved["torch_version"] = np.asarray(torch.__version__)
  np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
  dist.destroy_process_group()


def run_torch(path: str, timeout: float = 600) -> None:
  """Runs the two torch processes and writes their merged results to ``path`` (an .npz)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
  with tempfile.TemporaryDirectory() as out:
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(rank),
                               "--port", str(port), "--out", out], env=env)
             for rank in range(WORLD)]
    try:
      codes = [p.wait(timeout=timeout) for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    if any(codes):
      raise RuntimeError(f"torch workers exited with {codes}")
    ranks = [dict(np.load(os.path.join(out, f"rank{rank}.npz"))) for rank in range(WORLD)]
  merged = {}
  for key, value in ranks[0].items():
    if key.endswith("_err"):
      merged[key] = np.stack([r[key] for r in ranks])  # (rank, compressed step, flat)
    else:
      for other in ranks[1:]:  # outputs, Qs and stats are the same on every rank
        np.testing.assert_array_equal(other[key], value, err_msg=key)
      merged[key] = value
  np.savez_compressed(path, **merged)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--out", default=GOLDEN, help="the .npz to write (the worker's directory)")
  args = parser.parse_args()
  if args.worker is None:
    run_torch(args.out)
    print(f"wrote {args.out}")
  else:
    _worker(args.worker, args.port, args.out)
