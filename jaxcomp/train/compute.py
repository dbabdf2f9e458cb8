"""The compute the planner projects: each entry's update compiled at the model's layer shapes, the
model's own step, and the memory per device.

**The update** of registry entry ``name`` is what ``benchmarks/step_time.py`` runs after the
gradient: the entry's transformation (``Compressor.optimizer`` around ``optax.sgd(0.01)`` with the
entry's momentum), then ``optax.apply_updates``. ``update_costs`` compiles it for abstract
parameters (``jax.ShapeDtypeStruct``: nothing is allocated) inside ``jax.shard_map`` over one
device of this process's default backend (the axis is bound, of size 1, so every compressor
compresses and decodes as in training; its collectives move nothing, and the planner costs what
they send with the α-β model), and reads its kernels (``hlo_cost.kernels``).

Compiling a large model's update whole takes minutes (XLA's time grows faster than the number of
leaves), so the tree is cut into **shape groups**: the top-level entries of the parameters (below a
single top-level key, such as Flax's ``params``) whose leaves have the same paths below them and
the same shapes and dtypes — GPT-2's 12 blocks, Llama's layers, ResNet's repeated blocks — form a
group, compiled once as one entry and counted as many times as it repeats; every entry that does
not repeat goes into one more group. The update of the whole tree is costed as the sum of its
groups': exact for the work done per leaf, and for work over the concatenated gradient (8-bit
codes, 1-bit Adam) up to the kernels done once per update, which are counted once per group
instance instead (a few kernels each). The decode of what W devices gathered is compiled at W = 1:
on W devices it handles W contributions (DGC's values, DeMo's and chunked top-k's rows,
EF-SignSGD's signs), which this leaves out.

Each group's kernels are cached on disk (``cache_folder``, ``$JAXCOMP_PLAN_CACHE``) by the entry,
its settings, the group's shapes, a digest of jaxcomp's sources, the JAX version and the backend,
so that a second plan of the same model compiles nothing; the compiles run on a thread pool.

**The model's own step** (forward, backward: ``model_step``) is the user's measurement
(``--step-ms``) or an estimate: 3 × the forward FLOPs of ``shapes.Model``'s examples per device at
the device's bfloat16 peak × its ``sustained`` share.

**Memory per device** (``memory``): the parameters and the state of the entry's transformation
around Adam (``jax.eval_shape`` of its ``init``: exact, nothing allocated), as the planner's "Fully
sharded" table counts DDP's (12 bytes a parameter with plain Adam); the gradient, activations and
temporaries are not counted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import warnings
from typing import Callable, Optional, Sequence

from jaxcomp.train import hlo_cost, registry

AXIS = "batch"
LEARNING_RATE = 0.01
"""The rate of ``optax.sgd`` after each entry, as ``benchmarks/step_time.py`` runs it."""
VERSION = 5
"""Bumped when what is cached changes."""


def cache_folder() -> str:
  """Where the compiled groups' kernels are kept: ``$JAXCOMP_PLAN_CACHE``, else
  ``~/.cache/jaxcomp/plan`` (read at each call; empty it to recompile)."""
  return os.environ.get("JAXCOMP_PLAN_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxcomp", "plan")


def _top(tree):
  """The container whose entries are grouped: below single-key dicts (``{"params": ...}``)."""
  while isinstance(tree, dict) and len(tree) == 1 and isinstance(next(iter(tree.values())), dict):
    tree = next(iter(tree.values()))
  return tree


def _signature(node) -> str:
  import jax
  leaves = jax.tree_util.tree_leaves_with_path(node)
  return repr([(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves])


def groups(tree) -> list:
  """``[(group, count)]``: the shape groups of ``tree`` (module docstring), each a dict of one or
  more of its top-level entries, under their own keys; the counts times the groups' parameters add
  up to the tree's."""
  import jax
  top = _top(tree)
  if not isinstance(top, dict):
    if isinstance(top, (list, tuple)):
      top = {str(i): node for i, node in enumerate(top)}
    else:
      return [(tree, 1)]
  by_signature: dict = {}
  for key, node in top.items():
    if jax.tree.leaves(node):
      by_signature.setdefault(_signature(node), []).append(key)
  repeated = [(keys[0], len(keys)) for keys in by_signature.values() if len(keys) > 1]
  single = [keys[0] for keys in by_signature.values() if len(keys) == 1]
  out = [({key: top[key]}, count) for key, count in repeated]
  return out + ([({key: top[key] for key in single}, 1)] if single else [])


def _inner(entry):
  import optax
  return optax.sgd(LEARNING_RATE, momentum=entry.sgd_momentum)


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""Only the optimized HLO is read, which LLVM's optimizations do not change (XLA's fusions,
layouts and collectives are decided before): without them a compile takes about 40% less."""


def program(fn: Callable, *args, least_share: float = 0.0) -> hlo_cost.Program:
  """The kernels of ``jax.jit(fn)`` compiled for the abstract ``args`` on this process's default
  device."""
  import jax
  lowered = jax.jit(fn).lower(*args)
  compiled = lowered.compile(FAST_COMPILE if jax.devices()[0].platform == "cpu" else None)
  return hlo_cost.kernels(compiled.as_text(), least_share)


def _update_program(name: str, tree, least_share: float) -> hlo_cost.Program:
  """The kernels of entry ``name``'s update (module docstring) for parameters shaped as ``tree``,
  compiled inside ``shard_map`` over one device."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import Mesh, PartitionSpec
  entry = registry.REGISTRY[name]
  tx = entry.optimizer(_inner(entry), AXIS)
  state = jax.eval_shape(tx.init, tree)

  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  mesh = Mesh(np.asarray(jax.devices()[:1]), (AXIS,))
  mapped = jax.shard_map(update, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                         check_vma=False)
  return program(mapped, tree, state, tree, least_share=least_share)


@dataclasses.dataclass
class UpdateCost:
  """One entry's update at the model's shapes.

  Attributes:
    name: the registry entry.
    summary: its kernels per step (``hlo_cost.summary`` rows), the groups' times their counts;
      None where it could not be compiled.
    error: why not, else None.
    unknown_trips: loops whose trip count XLA did not know (each counted once).
    compiled, cached: the groups compiled now and those read from the cache.
  """
  name: str
  summary: Optional[list] = None
  error: Optional[str] = None
  unknown_trips: int = 0
  compiled: int = 0
  cached: int = 0


@functools.lru_cache(maxsize=None)
def code_version() -> str:
  """A digest of jaxcomp's sources and the registry: a change to an algorithm recompiles."""
  import jaxcomp
  root = os.path.dirname(jaxcomp.__file__)
  digest = hashlib.sha256()
  for folder in (root, os.path.join(root, "_src")):
    for name in sorted(os.listdir(folder)):
      if name.endswith(".py"):
        with open(os.path.join(folder, name), "rb") as f:
          digest.update(name.encode() + f.read())
  with open(registry.__file__, "rb") as f:
    digest.update(f.read())
  return digest.hexdigest()[:16]


def _key(name: str, group, least_share: float) -> str:
  import jax
  entry = registry.REGISTRY[name]
  device = jax.devices()[0]
  text = json.dumps([VERSION, code_version(), jax.__version__, device.platform,
                     device.device_kind, name, repr(sorted(entry.settings.items())),
                     entry.sgd_momentum, least_share, _signature(group)])
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read(key: str, cache: Optional[str]) -> Optional[dict]:
  if cache is None:
    return None
  try:
    with open(os.path.join(cache, key + ".json"), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _write(key: str, cache: Optional[str], value: dict) -> None:
  if cache is None:
    return
  try:
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, key + ".json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(value, f)
    os.replace(path + ".tmp", path)
  except OSError:
    pass  # a cache that cannot be written only costs the next plan its compiles


def update_costs(names: Sequence[str], tree, *, least_share: float = 0.0, cache=True,
                 workers: Optional[int] = None) -> dict:
  """``{name: UpdateCost}`` of the entries ``names`` for parameters shaped as ``tree``: every
  shape group of the tree compiled once per entry (or read from ``cache``: True the
  ``cache_folder()``, a folder, or None for none), on ``workers`` threads (default: the CPUs)."""
  cache = cache_folder() if cache is True else cache or None
  parts = groups(tree)
  jobs = [(name, index, group) for name in names for index, (group, _) in enumerate(parts)]
  found = {}

  def run(job):
    name, index, group = job
    key = _key(name, group, least_share)
    value = _read(key, cache)
    if value is not None:
      return job, value, True
    try:
      compiled = _update_program(name, group, least_share)
      value = {"summary": hlo_cost.summary(compiled), "unknown_trips": compiled.unknown_trips}
    except Exception as e:  # noqa: BLE001 - an entry that cannot compile is reported, not fatal
      return job, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, False
    _write(key, cache, value)
    return job, value, False

  # A group is not the model: what jaxcomp warns of for a group alone (more fragments than its
  # leaves) is not a property of the model, so the compiles' warnings are not shown.
  with warnings.catch_warnings(), concurrent.futures.ThreadPoolExecutor(
      workers or os.cpu_count() or 1) as pool:
    warnings.simplefilter("ignore")
    for (name, index, _), value, hit in pool.map(run, jobs):
      found[name, index] = (value, hit)
  out = {}
  for name in names:
    cost = UpdateCost(name, summary=[])
    for index, (_, count) in enumerate(parts):
      value, hit = found[name, index]
      if "error" in value:
        cost.summary, cost.error = None, value["error"]
        break
      cost.summary += [[f, b, d, w * count, c, e] for f, b, d, w, c, e in value["summary"]]
      cost.unknown_trips += value["unknown_trips"]
      cost.cached, cost.compiled = cost.cached + hit, cost.compiled + (not hit)
    out[name] = cost
  return out


def model_step(model, params: int, device) -> tuple:
  """``(seconds, note)``: the estimate of the model's step per device (module docstring) for a
  ``shapes.Model`` of ``params`` parameters on ``device`` (``devices.Device``)."""
  flops = 3 * model.flops_per_example(params) * model.examples
  rate = device.matmul["bf16"] * device.sustained
  per = ("2 per parameter per token" if model.unit == "tokens"
         else f"{model.flops_per_example(params) / 1e9:g} GFLOP per image")
  share = (f"{100 * device.sustained:.0f}% of its bf16 peak" if device.sustained < 1
           else "its measured float32 rate")
  seconds = flops / rate
  return seconds, (f"{1e3 * seconds:.3g} ms, ESTIMATED: 3 × forward FLOPs ({per}) × "
                   f"{model.examples:,} {model.unit} per device on {device.about} at "
                   f"{rate / 1e12:,.4g} TFLOP/s ({share}); --step-ms (step_ms=) gives your "
                   "measured step, forward + backward + optimizer without communication")


def memory(name: str, tree) -> int:
  """Bytes per device of entry ``name`` with Adam (module docstring): the parameters and the
  transformation's state, from ``jax.eval_shape`` (nothing allocated)."""
  import jax
  import optax
  entry = registry.REGISTRY[name]
  tx = entry.optimizer(optax.adam(1e-3), AXIS)
  state = jax.eval_shape(tx.init, tree)
  size = lambda t: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(t))
  return size(tree) + size(state)


def timed(fn: Callable, *args, **kwargs) -> tuple:
  """``(fn(*args, **kwargs), seconds)``."""
  start = time.perf_counter()
  return fn(*args, **kwargs), time.perf_counter() - start
