"""The environment of a ``gpu.sh`` run: versions, devices, and the public JAX APIs jaxcomp uses.

``check_apis()`` looks up every public JAX name (and keyword) the package relies on without starting
a backend, and returns one line per API that is missing or differs, in the form
``jax 0.11.2 lacks API jax.set_mesh: used in jaxcomp/_src/data_parallel.py, ...``; ``gpu.sh`` stops
its sections at such a line, so a lent device is not spent on tracebacks. The few private JAX
modules jaxcomp reads (each with a fallback for a JAX that moved them) are listed as notes, not
stops. ``smoke()`` then runs one ``jaxcomp.data_parallel`` step with ``jaxcomp.allreduce`` on the
default backend: an API that exists but behaves differently stops there, with its error's line.

  PYTHONPATH=. python benchmarks/gpu_env.py [--out env.json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (dotted name, keyword arguments it must take): every public JAX API the package and the
# benchmarks gpu.sh runs call (grep jaxcomp/ benchmarks/ for "jax." and "lax.").
APIS = (
    ("jax.shard_map", ("mesh", "in_specs", "out_specs", "axis_names", "check_vma")),
    ("jax.make_mesh", ("axis_types",)),
    ("jax.sharding.Mesh", ("axis_types",)),
    ("jax.sharding.AxisType.Auto", ()),
    ("jax.sharding.AxisType.Explicit", ()),
    ("jax.sharding.NamedSharding", ()),
    ("jax.sharding.PartitionSpec", ()),
    ("jax.sharding.get_abstract_mesh", ()),
    ("jax.sharding.use_abstract_mesh", ()),
    ("jax.sharding.reshard", ()),
    ("jax.set_mesh", ()),
    ("jax.typeof", ()),
    ("jax.lax.platform_dependent", ("default",)),
    ("jax.lax.pcast", ("to",)),
    ("jax.lax.psum", ()),
    ("jax.lax.pmean", ()),
    ("jax.lax.pmax", ()),
    ("jax.lax.psum_scatter", ("scatter_dimension", "tiled")),
    ("jax.lax.all_gather", ("axis", "tiled")),
    ("jax.lax.all_to_all", ()),
    ("jax.lax.axis_index", ()),
    ("jax.lax.axis_size", ()),
    ("jax.lax.top_k", ()),
    ("jax.lax.population_count", ()),
    ("jax.lax.optimization_barrier", ()),
    ("jax.lax.with_sharding_constraint", ()),
    ("jax.lax.bitcast_convert_type", ()),
    ("jax.lax.associative_scan", ()),
    ("jax.named_scope", ()),
    ("jax.pmap", ("axis_name", "devices", "donate_argnums")),
    ("jax.jit", ("donate_argnums",)),
    ("jax.eval_shape", ()),
    ("jax.make_jaxpr", ()),
    ("jax.make_array_from_callback", ()),
    ("jax.make_array_from_process_local_data", ()),
    ("jax.tree.map", ()),
    ("jax.tree.flatten", ()),
    ("jax.tree.unflatten", ()),
    ("jax.tree_util.register_static", ()),
    ("jax.tree_util.tree_flatten_with_path", ()),
    ("jax.tree_util.tree_map_with_path", ()),
    ("jax.tree_util.register_pytree_node_class", ()),
    ("jax.stages.Lowered", ()),
    ("jax.stages.Compiled", ()),
    ("jax.stages.Compiled.memory_analysis", ()),
    ("jax.stages.Compiled.as_text", ()),
    ("jax.stages.Lowered.as_text", ("dialect", "debug_info")),
    ("jax.core.Tracer", ()),
    ("jax.extend.core.Literal", ()),
    ("jax.clear_caches", ()),
    ("jax.block_until_ready", ()),
    ("jax.config.update", ()),
)
# Private modules read with a fallback (a note, not a stop): (module, attribute, who reads it).
PRIVATE = (
    ("jax._src.core", "unsafe_get_axis_names", "jax_internals.bound_axis_names"),
    ("jax._src.core", "trace_ctx", "jax_internals.trace_key"),
    ("jax._src.lax.parallel", "all_gather_invariant", "jax_internals.all_gather_invariant"),
    ("jax._src.source_info_util", "summarize", "jax_internals.source_line"),
)


def _resolve(dotted: str):
  """The object named ``dotted`` (importing the longest module prefix), or raises."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    for attribute in parts[cut:]:
      obj = getattr(obj, attribute)
    return obj
  raise ImportError(dotted)


def _users(name: str) -> list:
  """The files of jaxcomp/ that call ``name`` (by its last two parts, as the code spells it)."""
  short = ".".join(name.split(".")[-2:]).replace("jax.lax.", "lax.")
  found = []
  for folder, _, files in os.walk(os.path.join(ROOT, "jaxcomp")):
    for f in sorted(files):
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        with open(path, encoding="utf-8") as handle:
          if short in handle.read():
            found.append(os.path.relpath(path, ROOT))
  return found


def check_apis() -> tuple:
  """``(stops, notes)``: a line per public API missing or missing a keyword, and a line per private
  module attribute that moved (jaxcomp falls back there). Starts no backend."""
  import jax
  stops, notes = [], []
  for name, keywords in APIS:
    try:
      obj = _resolve(name)
    except (ImportError, AttributeError):
      users = _users(name)
      stops.append(f"jax {jax.__version__} lacks API {name}: used in "
                   f"{', '.join(users[:4]) or 'the benchmarks'}")
      continue
    if keywords:
      try:
        parameters = inspect.signature(obj).parameters
      except (TypeError, ValueError):
        continue  # a C++ function: its keywords cannot be read, the smoke test calls it
      takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
      missing = [k for k in keywords if k not in parameters and not takes_any]
      if missing:
        signature = f"{name.split('.')[-1]}{inspect.signature(obj)}"
        named = ", ".join(k + "=" for k in missing)
        stops.append(f"jax {jax.__version__} lacks API {name}({named}): its signature is "
                     f"{signature[:200]}")
  for module, attribute, reader in PRIVATE:
    try:
      getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
      notes.append(f"private {module}.{attribute} is gone in jax {jax.__version__}: "
                   f"jaxcomp's {reader} uses its fallback")
  return stops, notes


def smoke() -> str:
  """Runs one ``jaxcomp.data_parallel`` step (``jaxcomp.allreduce``, SGD) of a tiny linear model on
  the default backend's first device; returns "" or the line of the error."""
  try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxcomp
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    loss = lambda p, x, y: jnp.mean((x @ p["w"] - y) ** 2)  # noqa: E731
    tx = optax.chain(jaxcomp.allreduce(axis_name="batch"), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(loss, mesh, axis_name="batch", tx=tx, donate=True)
    params = {"w": np.zeros((4, 1), np.float32)}
    opt_state = dp.make_state(params)
    x, y = dp.shard((np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)))
    _, _, losses = dp.step(dp.make_params(params), opt_state, x, y)
    if not np.isfinite(np.asarray(losses)).all():
      return "jaxcomp.data_parallel's smoke step returned a non-finite loss"
    return ""
  except Exception as e:  # noqa: BLE001  (any error is the finding)
    import jax
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return (f"jax {jax.__version__}: jaxcomp.data_parallel's smoke step fails with "
            f"{type(e).__name__}: {first}")


def versions() -> dict:
  """Python and the packages' versions, and the devices of every backend."""
  import jax
  import jaxlib
  out = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "machine": f"{platform.machine()}, {os.cpu_count()} cores",
         "default_backend": jax.default_backend()}
  for package in ("flax", "optax", "chex", "numpy", "torch"):
    try:
      out[package] = importlib.import_module(package).__version__
    except Exception:  # noqa: BLE001
      out[package] = "not installed"
  try:
    from importlib import metadata
    out["plugins"] = sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                            if (d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda")))
  except Exception:  # noqa: BLE001
    out["plugins"] = []
  devices = {}
  for backend in ("gpu", "cpu"):
    try:
      found = jax.devices(backend)
    except RuntimeError:
      continue
    kinds = sorted({d.device_kind for d in found})
    devices[backend] = {"count": len(found), "kinds": kinds}
  out["devices"] = devices
  return out


def run(out_path=None, with_smoke: bool = True) -> dict:
  """Everything above as one dict (also written as JSON to ``out_path``)."""
  start = time.perf_counter()
  stops, notes = check_apis()
  env = versions()
  env.update(stops=stops, notes=notes)
  if with_smoke and not stops:
    failure = smoke()
    if failure:
      env["stops"] = [failure]
  env["seconds"] = round(time.perf_counter() - start, 1)
  if out_path:
    with open(out_path, "w") as f:
      json.dump(env, f, indent=1)
  return env


def markdown(env: dict) -> str:
  """The report's environment section."""
  devices = "; ".join(f"{b}: {d['count']} × {', '.join(d['kinds'])}"
                      for b, d in env.get("devices", {}).items())
  lines = [f"* Python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}"
           + (f" ({', '.join(env['plugins'])})" if env.get("plugins") else "")
           + f"; flax {env['flax']}, optax {env['optax']}, chex {env['chex']}, numpy "
           f"{env['numpy']}, torch {env['torch']}",
           f"* {env['machine']}; default backend {env['default_backend']}; devices: {devices}"]
  if env["stops"]:
    lines += [f"* **STOP**: {line}" for line in env["stops"]]
  else:
    lines.append(f"* every public JAX API jaxcomp uses is there ({len(APIS)} checked, keywords "
                 "included), and one `jaxcomp.data_parallel` step ran on the default backend")
  lines += [f"* note: {line}" for line in env["notes"]]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="write the findings as JSON to this file")
  args = p.parse_args(argv)
  env = run(args.out)
  print(markdown(env))
  for line in env["stops"]:
    print(line, file=sys.stderr)
  return 1 if env["stops"] else 0


if __name__ == "__main__":
  sys.exit(main())
