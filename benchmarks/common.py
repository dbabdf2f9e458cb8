"""What every benchmark script shares: model-shaped pytrees, the compressors, timing, BENCHMARKS.md.

* Shape pytrees (``jax.ShapeDtypeStruct`` leaves, nothing allocated) of ResNet-18, ResNet-50 and
  GPT-2 small, built from their published layer shapes in Flax layout by ``jaxcomp.train.shapes``
  (the planner's): Conv kernels ``(kh, kw, in, out)``, Dense kernels ``(in, out)``, BatchNorm /
  LayerNorm ``scale`` and ``bias``; ``torch_layout`` gives the same parameters in torch's layout
  (Conv ``(out, in, kh, kw)``, Linear ``(out, in)``).
* ``compressors``: the entries of ``jaxcomp.train.registry`` a benchmark compares.
* ``interleaved``: timings of several functions taken side by side (round-robin), so that a shared,
  busy machine slows them alike; ratios are taken per round, then the median.
* ``write_section``: replaces one script's section of BENCHMARKS.md (between markers), so the
  scripts do not overwrite each other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The planner's trees under the benchmarks' names (``dense``: for scaling.py's layers).
from jaxcomp.train.shapes import dense, mlp, resnet18, resnet50, tiny  # noqa: F401
from jaxcomp.train.shapes import gpt2 as gpt2_small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS_MD = os.path.join(ROOT, "BENCHMARKS.md")
AXIS = "batch"
F32 = jnp.float32

# -------------------------------------------------------------------------------- shape pytrees


def models(quick: bool) -> dict:
  """The shape pytrees a benchmark runs over, by name: the real ones, or small stand-ins."""
  if quick:
    return {"tiny": tiny()}
  return {"ResNet-18": resnet18(), "ResNet-50": resnet50(), "GPT-2 small": gpt2_small()}


def chars_transformer(size: str = "768x2") -> dict:
  """The parameters of ``jaxcomp.train.tasks``' chars transformer of ``size`` (``CHARS_SIZES``), as
  a shape pytree (``jax.eval_shape`` of its ``init``)."""
  from jaxcomp.train import tasks
  model = tasks.CharTransformer(**tasks.CHARS_SIZES[size])
  tokens = jax.ShapeDtypeStruct((1, model.context), jnp.int32)
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


SHAPE_MODELS = {"mlp": ("MLP 784-1024×3-10", mlp), "resnet18": ("ResNet-18", resnet18),
                "resnet50": ("ResNet-50", resnet50), "gpt2-small": ("GPT-2 small", gpt2_small),
                "chars-768x2": ("chars transformer 768 wide, 2 blocks", chars_transformer)}
"""The shape pytrees a benchmark can be asked for by name (``--models``)."""


def shape_models(names, quick: bool) -> dict:
  """``{label: shape pytree}`` for the comma-separated ``names`` of ``SHAPE_MODELS`` (None: the
  defaults of ``models``); quick: one small stand-in for each."""
  if not names:
    return models(quick)
  wanted = [n.strip() for n in names.split(",") if n.strip()]
  unknown = [n for n in wanted if n not in SHAPE_MODELS]
  if unknown:
    raise SystemExit(f"--models: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(SHAPE_MODELS)}")
  if quick:
    return {f"tiny ({n})": mlp((784, 64, 10)) if n == "mlp" else tiny() for n in wanted}
  return {SHAPE_MODELS[n][0]: SHAPE_MODELS[n][1]() for n in wanted}


def num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def torch_layout(tree) -> dict:
  """The same parameters in torch's layout: Conv (out, in, kh, kw), Linear (out, in)."""
  def flip(path, x):
    if x.ndim == 4:
      return jax.ShapeDtypeStruct((x.shape[3], x.shape[2], x.shape[0], x.shape[1]), F32)
    if x.ndim == 2 and "embedding" not in jax.tree_util.keystr(path):  # Embedding: same layout
      return jax.ShapeDtypeStruct((x.shape[1], x.shape[0]), F32)
    return x
  return jax.tree_util.tree_map_with_path(flip, tree)


def stacked(tree, n: int):
  """``tree``'s abstract leaves with a leading device axis of size ``n`` (pmap's layout)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + tuple(x.shape), x.dtype), tree)


def random_like(tree, seed: int = 0):
  """Concrete float32 normal values for an abstract pytree."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


# ---------------------------------------------------------------------------------- compressors


def compressors(names: Optional[str] = None, variants: Sequence = ()) -> list:
  """Registry entries to compare (``jaxcomp.train.registry``): its ``DEFAULT`` list, every entry
  (``"all"``), or the comma-separated ``names``, in that order; ``names`` may name the
  ``variants`` (``add_variant_option``), and must name each."""
  from jaxcomp.train.registry import DEFAULT, REGISTRY
  known = {**REGISTRY, **{v.name: v for v in variants}}
  if not names:
    wanted = list(DEFAULT)
  elif names.strip() == "all":
    wanted = list(known)
  else:
    wanted = [n.strip() for n in names.split(",") if n.strip()]
  unknown = [n for n in wanted if n not in known]
  if unknown:
    raise SystemExit(f"--compressors: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(known)}")
  unnamed = [v.name for v in variants if v.name not in wanted]
  if unnamed:
    raise SystemExit(f"--variant {unnamed[0]} is not in --compressors: name it there to measure it")
  return [known[n] for n in wanted]


# ------------------------------------------------------------------------------------- timing


def block(x):
  """Waits for every array in ``x`` (JAX or torch) and returns it."""
  return jax.block_until_ready(x)


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> dict:
  """Times each ``fns[name]()`` (which must block until its result is ready) round-robin.

  Returns:
    ``{name: list of seconds}``, one entry per round; every round runs every function once, in an
    order that rotates from round to round.
  """
  names = list(fns)
  for _ in range(warmup):
    for name in names:
      fns[name]()
  times = {name: [] for name in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      fns[name]()
      times[name].append(time.perf_counter() - start)
  return times


def ratio(times: dict, name: str, base: str) -> float:
  """Median over rounds of ``time(name) / time(base)``, both from the same round."""
  return float(np.median(np.asarray(times[name]) / np.asarray(times[base])))


def median(seconds) -> float:
  return float(np.median(seconds))


# ------------------------------------------------------------------------------ command line


def parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--quick", action="store_true",
                 help="small shapes and few repeats (CI); never rewrites BENCHMARKS.md")
  p.add_argument("--write", action="store_true",
                 help="replace this script's section of BENCHMARKS.md with the table")
  p.add_argument("--compressors", default=None,
                 help="comma-separated registry entries, or 'all' for every entry "
                      "(default: the registry's DEFAULT list)")
  return p


def add_variant_option(p: argparse.ArgumentParser) -> None:
  """``--variant``, as the main job's: an entry with other settings, measured under its own name
  (``parse`` reads it with ``registry.parse_variants``; pass them to ``compressors``)."""
  p.add_argument("--variant", action="append", default=[], metavar="NAME=ENTRY,KEY=VALUE,...",
                 help="an entry with other settings, measured as NAME where --compressors names "
                      "it (repeat for more): e.g. --variant dion_r16=dion_r8,rank=16; each VALUE "
                      "a Python literal, over the entry's own settings")


def add_device_options(p: argparse.ArgumentParser, default_devices: str = "8") -> None:
  """``--platform``, ``--devices`` and ``--out``: where a script runs, where it saves its rows."""
  p.add_argument("--platform", default=None,
                 help="the devices' platform, e.g. cpu or gpu (default: JAX's default backend)")
  p.add_argument("--devices", default=default_devices,
                 help=f"number of data-parallel devices (default {default_devices})")
  p.add_argument("--out", default=None,
                 help="also write the table's rows as JSON to this file (rewritten as rows come)")


def devices(count: int, platform: Optional[str] = None) -> list:
  """The first ``count`` devices of ``platform`` (default: JAX's default backend's)."""
  found = jax.devices(platform) if platform else jax.devices()
  if not 1 <= count <= len(found):
    raise SystemExit(f"--devices {count}: {len(found)} {found[0].platform} devices are available")
  return found[:count]


def write_out(path: Optional[str], script: str, argv: Optional[Sequence[str]], header: list,
              rows: list, complete: bool, **extra) -> None:
  """Writes a script's rows as JSON to ``path`` (if given), atomically: the command (``script``
  with ``argv``, as ``command``), the machine, the header, the rows so far and whether the run has
  finished."""
  if not path:
    return
  data = dict(script=script, command=command(script, argv), machine=machine(), header=header,
              rows=rows, complete=complete, **extra)
  with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=1)
  os.replace(path + ".tmp", path)


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
  """``p.parse_args(argv)``, checked; ``args.argv`` keeps ``argv`` for the command the script
  records (``command``, ``emit``)."""
  args = p.parse_args(argv)
  args.argv = None if argv is None else list(argv)
  if args.quick and args.write:
    p.error("--quick runs are for CI: they do not write BENCHMARKS.md (drop --write)")
  if getattr(args, "variant", None):
    from jaxcomp.train import registry
    if args.write:
      p.error("--write records the registry's entries in BENCHMARKS.md: drop --variant or --write")
    try:
      args.variant = registry.parse_variants(args.variant)
    except ValueError as e:
      p.error(f"--variant {e}")
  return args


def command(script: str, argv: Optional[Sequence[str]]) -> str:
  """The command line that runs ``script`` with ``argv``, the arguments its ``main(argv)`` was
  given (None: this process's own, as ``argparse`` takes them)."""
  argv = sys.argv[1:] if argv is None else argv
  return " ".join(["PYTHONPATH=. python", f"benchmarks/{script}"] + [shlex.quote(a) for a in argv])


def machine() -> str:
  import jaxlib
  accelerators = [d for d in jax.devices() if d.platform != "cpu"]
  device = (f"{len(accelerators)} × {accelerators[0].device_kind}, " if accelerators else "")
  return (f"{device}{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs), "
          f"jax {jax.__version__} / jaxlib {jaxlib.__version__}")


def human(num_bytes: float) -> str:
  """Bytes as B / kB / MB / GB (powers of 10)."""
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(num_bytes) >= size:
      return f"{num_bytes / size:.1f} {unit}"
  return f"{num_bytes:.0f} B"


def markdown_table(header: list, rows: list, align: Optional[str] = None) -> str:
  """A Markdown table; ``align`` has one of 'l'/'r' per column (default: first left, rest right)."""
  align = align or "l" + "r" * (len(header) - 1)
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


SECTIONS = ("bytes", "compute_vs_torch", "step_time", "memory", "kernels", "scaling",
            "network_model", "slow_link", "several_nodes", "quality", "plan_check",
            "scaling_quality", "faults")

_HEADER = """# jaxcomp benchmarks

Each section below is written by one script in `benchmarks/` (the command is given with it) and
replaced when that script runs again with `--write`. CI runs every script with `--quick` (small
shapes, no timing assertions; `tests/test_benchmarks.py`). Timings come from a CPU shared with other
jobs, so only ratios measured side by side (interleaved repeats, median of per-round ratios) are
reported as results; absolute times are shown for scale only.
"""


def write_section(key: str, title: str, cmd: str, body: str, path: str = BENCHMARKS_MD) -> None:
  """Replaces the section ``key`` of BENCHMARKS.md (created with every section if missing)."""
  if key not in SECTIONS:
    raise ValueError(f"key must be one of {SECTIONS}; got {key!r}")
  begin, end = f"<!-- BEGIN {key} -->", f"<!-- END {key} -->"
  if os.path.exists(path):
    with open(path) as f:
      text = f.read()
  else:
    text = _HEADER + "".join(f"\n<!-- BEGIN {k} -->\n<!-- END {k} -->\n" for k in SECTIONS)
  section = (f"{begin}\n## {title}\n\n`{cmd}`\n\n{machine()}; "
             f"{time.strftime('%Y-%m-%d')}.\n\n{body.strip()}\n{end}")
  pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
  if pattern.search(text):
    text = pattern.sub(lambda _: section, text)
  else:
    text = text.rstrip() + "\n\n" + section + "\n"
  with open(path, "w") as f:
    f.write(text)
  print(f"wrote section {key!r} of {os.path.relpath(path, ROOT)}")


def emit(args, key: str, title: str, script: str, body: str) -> None:
  """Prints the section, and writes it to BENCHMARKS.md when ``--write`` was given."""
  print(f"## {title}\n\n{body.strip()}\n", flush=True)
  if args.write:
    write_section(key, title, command(script, args.argv), body)
