"""Compression compute against torch's DDP hooks, on the same gradients, in the same run.

jaxcomp: one jitted ``update`` of the compressor on one device (``axis_name=None``, world size 1),
its state threaded from call to call (not donated: the same gradient is fed every call, and
donating the state alone would hand the update output an error buffer, see ``memory.py``). torch
2.13: the hook on one bucket holding the whole gradient (the same values, in torch's layout: Conv
``(out, in, kh, kw)``, Linear ``(out, in)``), on a 1-process gloo group, waited on (``fut.wait()``),
decompression callback included. Settings are the same on both sides: ``fp16_compress_hook`` against
``jaxcomp.fp16_compress``; ``powerSGD_hook`` (rank r, min_compression_rate 2, error feedback, warm
start, compressing from the timed steps on) against ``jaxcomp.powersgd(r, start_iter=0)``, whose
default Flax matrix view of a Flax kernel is the transpose of torch's view of the torch kernel, so
both compress the same matrices.

DGC selection: for every leaf with ndim > 1, the k = ceil(numel·0.001) largest |v|, jaxcomp's
sampled threshold selection (``jaxcomp.dgc``'s, the one the compressor runs) and ``lax.top_k``
against ``torch.topk`` on the same vectors.

Calls alternate round-robin (jaxcomp, torch, jaxcomp, ...) and the ratio is the median of per-round
ratios, so both sides see the same machine load.

  PYTHONPATH=. python benchmarks/compute_vs_torch.py [--quick] [--write]
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp._src import topk  # noqa: E402

DENSITY = 0.001


class Bucket:
  """The part of ``torch.distributed.GradBucket`` the hooks use (it has no Python constructor)."""

  def __init__(self, tensors):
    import torch
    self._shapes = [t.shape for t in tensors]
    self._buffer = torch.cat([t.reshape(-1) for t in tensors])

  def index(self):
    return 0

  def is_last(self):
    return True

  def buffer(self):
    return self._buffer

  def set_buffer(self, buffer):
    self._buffer = buffer

  def gradients(self):
    out, offset = [], 0
    for shape in self._shapes:
      size = math.prod(shape)
      out.append(self._buffer[offset:offset + size].view(shape))
      offset += size
    return out

  def parameters(self):
    return self.gradients()


def init_torch():
  import torch.distributed as dist
  if not dist.is_initialized():
    path = os.path.join(tempfile.mkdtemp(prefix="jaxcomp_bench_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def gradients(tree, seed=0):
  """The same normal values as a Flax-layout numpy pytree and as torch-layout tensors."""
  import torch
  rng = np.random.default_rng(seed)
  flax_leaves, torch_leaves = [], []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    g = rng.standard_normal(x.shape, np.float32)
    flax_leaves.append(g)
    if g.ndim == 4:
      g = g.transpose(3, 2, 0, 1)
    elif g.ndim == 2 and "embedding" not in jax.tree_util.keystr(path):
      g = g.T
    torch_leaves.append(torch.from_numpy(np.ascontiguousarray(g)))
  return jax.tree.unflatten(jax.tree.structure(tree), flax_leaves), torch_leaves


def jax_runner(tx, grads):
  """A function running one jitted, state-threaded ``tx.update`` and blocking on it."""
  grads = jax.device_put(grads)
  holder = [jax.jit(tx.init)(grads)]
  update = jax.jit(lambda g, s: tx.update(g, s))

  def run():
    out, holder[0] = update(grads, holder[0])
    jax.block_until_ready((out, holder[0]))
  return run


def torch_runner(hook, state, tensors):
  bucket = Bucket(tensors)

  def run():
    hook(state, bucket).wait()
  return run


def compressor_rows(model, tree, repeats, names):
  import torch  # noqa: F401
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

  grads, tensors = gradients(tree)
  pairs = []
  if "fp16" in names:
    pairs.append(("fp16", "fp16_compress_hook", jax_runner(
        common.compressors("fp16")[0].make(None), grads),
        torch_runner(default_hooks.fp16_compress_hook, None, tensors)))
  for rank in (1, 4):
    name = f"powersgd_r{rank}"
    if name not in names:
      continue
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
        min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
    run_torch = torch_runner(powerSGD_hook.powerSGD_hook, state, [t.clone() for t in tensors])
    run_torch()
    run_torch()  # torch's first start_powerSGD_iter = 2 steps are plain all-reduce
    pairs.append((name, f"powerSGD_hook(rank={rank})",
                  jax_runner(common.compressors(name)[0].make(None), grads), run_torch))
  rows = []
  for name, torch_name, run_jax, run_torch in pairs:
    times = common.interleaved({"jax": run_jax, "torch": run_torch}, repeats)
    rows.append([model, name, torch_name, f"{1e3 * common.median(times['jax']):.1f}",
                 f"{1e3 * common.median(times['torch']):.1f}",
                 f"{common.ratio(times, 'jax', 'torch'):.2f}"])
    print(f"  {model} {name}: {rows[-1][-1]}", file=sys.stderr, flush=True)
  return rows


def selection_rows(model, tree, repeats):
  """Top-k of |v| per leaf with ndim > 1: jaxcomp's sampled selection, lax.top_k, torch.topk."""
  import torch
  grads, _ = gradients(tree, seed=1)
  vectors = [jnp.asarray(g.ravel()) for g in jax.tree.leaves(grads) if g.ndim > 1]
  plans = [topk.sampling_plan(v.size, DENSITY) for v in vectors]
  torch_vectors = [torch.from_numpy(np.asarray(v)) for v in vectors]

  @jax.jit
  def sampled(vs):
    keys = jax.random.split(jax.random.key(0), len(vs))
    return [topk.sampled_topk(v, p, k)[0] for v, p, k in zip(vs, plans, keys)]

  @jax.jit
  def exact(vs):
    return [topk.exact_topk(jnp.abs(v), p.k) for v, p in zip(vs, plans)]

  def run_torch():
    return [torch.topk(v.abs(), p.k).indices for v, p in zip(torch_vectors, plans)]

  times = common.interleaved({"sampled": lambda: jax.block_until_ready(sampled(vectors)),
                              "exact": lambda: jax.block_until_ready(exact(vectors)),
                              "torch": run_torch}, repeats)
  numel = sum(v.size for v in vectors)
  rows = []
  for name, label in (("sampled", "dgc selection (sampled)"), ("exact", "lax.top_k")):
    rows.append([model, label, "torch.topk", f"{1e3 * common.median(times[name]):.1f}",
                 f"{1e3 * common.median(times['torch']):.1f}",
                 f"{common.ratio(times, name, 'torch'):.2f}"])
    print(f"  {model} {label} ({len(vectors)} leaves, {numel:,} values): {rows[-1][-1]}",
          file=sys.stderr, flush=True)
  return rows


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15, quick 3)")
  args = common.parse(p, argv)
  repeats = args.repeats or (3 if args.quick else 15)
  init_torch()
  names = {c.name for c in common.compressors(args.compressors)}
  models = common.models(args.quick)
  if not args.quick:
    models.pop("GPT-2 small")  # one 124M-element bucket: minutes of torch time per configuration
  rows = []
  for model, tree in models.items():
    rows += compressor_rows(model, tree, repeats, names)
    if "dgc" in names:
      rows += selection_rows(model, tree, repeats)
  import torch
  table = common.markdown_table(
      ["model", "jaxcomp", "torch 2.13", "jaxcomp ms", "torch ms", "jaxcomp / torch"], rows,
      "lllrrr")
  body = (f"One device, one bucket holding the whole gradient; torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads on a 1-process gloo group. The ratio is the median "
          f"of {repeats} interleaved per-round ratios (target: ≤ 0.5); the ms columns are medians, "
          "for scale only (shared machine). torch's `batched_powerSGD_hook` raises at its first "
          "compressed step in torch 2.13, so batched PowerSGD has no torch counterpart.\n\n"
          + table)
  common.emit(args, "compute_vs_torch", "Compression compute against torch's hooks",
              "compute_vs_torch.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
