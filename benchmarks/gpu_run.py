"""``bash benchmarks/gpu.sh OUT_DIR [--dry-run]``: the benchmarks a lent GPU runs, in one command that
fits in 8 minutes, and their Markdown report ``OUT_DIR/gpu_report.md``.

The work runs in three processes ("lanes") at once, each calling the benchmark scripts' own
``main(argv)`` one after the other (one JAX start per lane; every section's standalone command is in
the report), each pinned to its own cores where the machine has 12 or more:

* ``gpu``: the environment and the API check (``gpu_env.py``), then everything timed on the GPU,
  one thing at a time: ``step_time.py`` on the MLP (every registry entry), ``quality.py`` on a
  28.6M-parameter transformer, ``kernels.py``, and ``step_time.py`` on a ResNet-18-sized
  transformer (GPT-2 small's width, 2 blocks; every entry, in chunks of ``CHUNK``, each with its own
  allreduce, so that the deadline costs only the chunk it cuts);
* ``gpu-compile``: ``memory.py`` on the GPU (compile only: it times nothing), then on 8 CPU devices;
* ``cpu``: 8 simulated CPU devices (``JAX_PLATFORMS=cpu``) beside it, for the ratios' sake:
  ``step_time.py`` on the MLP (every entry) and on the transformer (a subset: on CPU a step of it
  takes seconds), ``kernels.py``.

Every ``step_time.py`` run saves its steps' compiled HLO (``--hlo-dir``), which ``gpu_schedule.py``
reads for the asynchronous collectives. The lanes end by a deadline (``--budget``, 450 s; a section
that could not finish in time is skipped, one cut short keeps the rows it wrote); this process then
writes the report, ``gpu_results.json`` (every row) and ``gpu_log.txt`` (the lanes' output).
``--dry-run`` runs the same code on a CPU machine in under a minute: tiny models, two entries, one
or two repeats, the "gpu" lane on one CPU device.

  bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BUDGET = 450
"""Seconds from start to the report (8 minutes less a margin for the machine's own start-up)."""
DRY_BUDGET = 55
RESERVE = 20
"""Seconds kept after the lanes' deadline for the schedule analysis and the report."""
QUALITY = ("allreduce", "bf16", "powersgd_r4", "dgc", "quantized_int8", "sparseloco_h30",
           "streaming_diloco_h100_p4_int8")
"""The entries of the quality run on the 28.6M transformer: the baseline and the papers' methods."""
QUALITY_STEPS = 600
"""One H100 step of the 28.6M transformer (global batch 64 × 128 characters, about 1.4 TFLOP with
the backward pass) takes about 10 ms: 7 entries × 600 steps ≈ 60 s of training, beside their
compilation and the bytes read for 8 devices."""
CPU_TRANSFORMER = ("allreduce", "bf16", "powersgd_r1", "powersgd_r4", "dgc", "quantized_int8",
                   "sparseloco_h30")
"""The entries the CPU lane times on the transformer (a step of it takes seconds on 8 CPU
devices): the quality run's, and PowerSGD rank 1 of the step-time goals."""
CHUNK = 10
"""Registry entries per GPU step_time run on the transformer: each run compiles its entries, then
times them; one cut short by the deadline loses only its own."""
DRY = "allreduce,powersgd_r1"
"""The dry run's entries on the MLP; on the transformer and in the quality run, allreduce alone (a
compressor's step is one more compilation, which the MLP's already exercise)."""
DRY_KERNELS = "fp16"


def _registry_names() -> list:
  from jaxcomp.train import registry  # noqa: PLC0415  (imports JAX, on the CPU here)
  return list(registry.REGISTRY)


def plan(dry: bool) -> dict:
  """``{lane: {"env": {...}, "sections": [section, ...]}}``; a section: ``id``, ``script`` (a
  module of benchmarks/), ``argv`` (``{P}``: the lane's platform, ``{W}``: its device count,
  ``{work}``: the work folder), ``min_s`` (seconds it needs to be worth starting)."""
  quick = ["--quick"] if dry else []
  every = DRY if dry else "all"

  def section(id_, script, argv, min_s):
    return {"id": id_, "script": script, "argv": (quick if script != "gpu_env" else []) + argv,
            "min_s": 2 if dry else min_s}

  def step_time(id_, model, compressors, repeats, hlo, min_s):
    return section(id_, "step_time", ["--platform", "{P}", "--devices", "{W}", "--models", model,
                                      "--compressors", compressors, "--repeats",
                                      str(1 if dry else repeats), "--hlo-dir", "{work}/" + hlo,
                                      "--out", "{work}/" + id_ + ".json"], min_s)

  if dry:
    chunks = ["allreduce"]
  else:
    try:
      names = [n for n in _registry_names() if n != "allreduce"]
      chunks = [",".join(names[i:i + CHUNK]) for i in range(0, len(names), CHUNK)]
    except Exception:  # noqa: BLE001  (the lanes' import of the package says why)
      chunks = ["all"]
  gpu = [section("env", "gpu_env", ["--out", "{work}/env.json"], 5),
         step_time("st_gpu_mlp", "mlp", every, 30, "hlo_gpu_mlp", 30),
         section("quality", "quality", ["--devices", "{W}", "--size", "768x4", "--batch-size", "64",
                                        "--steps", "3" if dry else str(QUALITY_STEPS),
                                        "--max-steps", "3" if dry else str(QUALITY_STEPS),
                                        "--compressors", "allreduce" if dry else ",".join(QUALITY),
                                        "--out", "{work}/quality.json"], 150),
         section("kernels_gpu", "kernels", ["--platform", "{P}", "--devices", "{W}", "--repeats",
                                            "1" if dry else "20",
                                            "--out", "{work}/kernels_gpu.json"]
                 + (["--compressors", DRY_KERNELS] if dry else []), 20)]
  gpu += [step_time(f"st_gpu_big{k}", "chars-768x2", chunk, 20, "hlo_gpu_big", 40)
          for k, chunk in enumerate(chunks)]
  memory = lambda id_, platform, world: section(  # noqa: E731
      id_, "memory", ["--platform", platform, "--devices", world, "--models", "mlp,chars-768x2",
                      "--compressors", every, "--no-sharded", "--out", "{work}/" + id_ + ".json"],
      20)
  compile_only = [memory("mem_gpu", "{P}", "{W}"), memory("mem_cpu", "cpu", "8")]
  cpu = [step_time("st_cpu_mlp", "mlp", every, 10, "hlo_cpu_mlp", 30),
         section("kernels_cpu", "kernels", ["--platform", "cpu", "--devices", "8", "--repeats",
                                            "1" if dry else "10", "--out",
                                            "{work}/kernels_cpu.json"]
                 + (["--compressors", DRY_KERNELS] if dry else []), 20),
         step_time("st_cpu_big", "chars-768x2",
                   "allreduce" if dry else ",".join(CPU_TRANSFORMER), 3, "hlo_cpu_big", 40)]
  # The dry run: one CPU device stands for the one GPU.
  accelerator = {"platform": "cpu", "world": 1} if dry else {"platform": "gpu", "world": None}
  return {"gpu": {"env": {}, "sections": gpu, **accelerator},
          "gpu-compile": {"env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                          "sections": compile_only, **accelerator},
          "cpu": {"env": {"JAX_PLATFORMS": "cpu"}, "sections": cpu, "platform": "cpu",
                  "world": 8}}


def command(section: dict, lane: dict, platform: str, world: int, work: str) -> tuple:
  """``(argv, standalone command line)`` of a section, its placeholders filled in."""
  argv = [a.replace("{P}", platform).replace("{W}", str(world)).replace("{work}", work)
          for a in section["argv"]]
  env = "".join(f"{k}={v} " for k, v in lane["env"].items())
  shown = " ".join(a.replace(work, "$WORK") if a.startswith(work) else shlex.quote(a)
                   for a in argv)
  return argv, f"{env}PYTHONPATH=. python benchmarks/{section['script']}.py {shown}"


# ---------------------------------------------------------------------------------------- lanes


def run_lane(name: str, work: str, deadline: float, cores) -> int:
  """Runs one lane's sections in this process, by ``deadline`` (a ``time.time()``), writing
  ``status_<lane>.json`` after each."""
  _pin(cores)
  with open(os.path.join(work, "plan.json")) as f:
    lane = json.load(f)[name]
  from benchmarks import gpu_env  # noqa: PLC0415
  import jax  # noqa: PLC0415
  status = {"lane": name, "cores": list(cores or []), "sections": []}

  def save():
    with open(os.path.join(work, f"status_{name}.json"), "w") as f:
      json.dump(status, f, indent=1)

  stops, _ = gpu_env.check_apis()
  modules = {}
  for script in dict.fromkeys(s["script"] for s in lane["sections"]):
    try:  # each configures JAX's CPU devices as it is imported: all of them before JAX starts
      modules[script] = importlib.import_module(f"benchmarks.{script}")
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      stops.append(f"jax {jax.__version__}: importing benchmarks/{script}.py fails with "
                   f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
  platform = lane["platform"]
  world = 0
  if not stops:
    try:
      world = lane["world"] or len(jax.devices(platform))
    except Exception as e:  # noqa: BLE001  (RuntimeError in jax 0.10: no such backend)
      stops = [f"no {platform} device: jax.devices({platform!r}) fails ({str(e).splitlines()[0]}); "
               f"the default backend is {jax.default_backend()} (on a machine without a GPU, "
               "run gpu.sh with --dry-run)"]
  status["stops"] = stops
  for section in lane["sections"]:
    argv, line = command(section, lane, platform, world, work)
    record = {"id": section["id"], "script": section["script"], "command": line, "argv": argv}
    status["sections"].append(record)
    if stops and section["id"] != "env":
      record.update(status="not run", why=stops[0])
      continue
    if time.time() + section["min_s"] > deadline:
      record.update(status="skipped", why=f"the budget: {deadline - time.time():.0f} s were left, "
                                           f"it needs at least {section['min_s']}")
      save()
      continue
    start = time.time()
    record["status"] = "running"
    save()
    print(f"[{name}] {line}", file=sys.stderr, flush=True)
    try:
      with open(os.path.join(work, section["id"] + ".md"), "w") as out, \
          contextlib.redirect_stdout(out):
        code = modules[section["script"]].main(argv)
      record["status"] = "ok" if not code else f"exit {code}"
    except SystemExit as e:
      record["status"] = f"exit {e.code}"
    except Exception as e:  # noqa: BLE001  (the report says which section failed and why)
      traceback.print_exc()
      record.update(status="failed", why=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    record["seconds"] = round(time.time() - start, 1)
    print(f"[{name}] {section['id']}: {record['status']} in {record['seconds']} s", file=sys.stderr,
          flush=True)
    if section["id"] == "env":
      why = record.get("why", record["status"])
      found = (_load(os.path.join(work, "env.json"))
               or {"stops": [f"the environment check failed: {why}"]})["stops"]
      stops = list(dict.fromkeys(found + stops))
      status["stops"] = stops
    jax.clear_caches()
    gc.collect()
    save()
  save()
  return 0


def _pin(cores) -> None:
  """Runs this process on ``cores`` (if given and possible)."""
  if cores:
    try:
      os.sched_setaffinity(0, cores)
    except OSError as e:
      print(f"could not pin to cores {cores}: {e}", file=sys.stderr)


def _cores() -> dict:
  """Each lane's cores: the GPU's timings 6, the compile-only lane 2, the simulated CPU devices the
  rest (8 on the lent machines' 16); None everywhere (no pinning) with fewer than 12."""
  try:
    free = sorted(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    free = []
  if len(free) < 12:
    return {"gpu": None, "gpu-compile": None, "cpu": None}
  return {"gpu": free[:6], "gpu-compile": free[6:8], "cpu": free[8:]}


def start_lanes(work: str, lanes: dict, deadline: float, python: str) -> dict:
  cores = _cores()
  procs = {}
  for name, lane in lanes.items():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", **lane["env"])
    if name != "cpu":
      env.pop("JAX_PLATFORMS", None)
    argv = [python, os.path.abspath(__file__), "--lane", name, "--work", work,
            "--deadline", str(deadline)]
    if cores[name]:
      argv += ["--cores", ",".join(map(str, cores[name]))]
    log = open(os.path.join(work, f"lane_{name}.log"), "w")
    procs[name] = (subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True), log)
  return procs


HLO_DIRS = ("hlo_gpu_mlp", "hlo_gpu_big", "hlo_cpu_mlp", "hlo_cpu_big")


def analyse_new(work: str, done: dict) -> None:
  """Analyses the compiled steps saved since the last call (``gpu_schedule.analyse_dir``)."""
  from benchmarks import gpu_schedule  # noqa: PLC0415
  for folder in HLO_DIRS:
    path = os.path.join(work, folder)
    if os.path.isdir(path):
      try:
        gpu_schedule.analyse_dir(path, done)
      except Exception:  # noqa: BLE001  (the report's own pass says what failed)
        pass


def wait_lanes(procs: dict, deadline: float, work: str, done: dict) -> dict:
  """Waits for the lanes until ``deadline``, analysing the compiled steps as they are saved; kills
  (by process group) the lanes still running then."""
  ended = {}
  while len(ended) < len(procs) and time.time() < deadline:
    for name, (proc, _) in procs.items():
      if name not in ended and proc.poll() is not None:
        ended[name] = proc.returncode
    analyse_new(work, done)
    time.sleep(0.5)
  for name, (proc, log) in procs.items():
    if name not in ended:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ended[name] = "killed at the deadline"
      else:
        ended[name] = proc.returncode
    log.close()
  return ended


# --------------------------------------------------------------------------------------- report


def _load(path: str):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _fmt_cmd(line: str) -> str:
  return f"`{line}`"


def _section_lines(status: dict, ids) -> list:
  """The commands (and states) of the sections ``ids``, for under a table."""
  out = []
  for s in status:
    if s["id"] in ids:
      state = s.get("status", "?")
      if state == "running":
        state = "cut short at the deadline (the rows it had written are kept)"
      why = f": {s['why']}" if s.get("why") else ""
      note = "" if state == "ok" else f" — **{state}**{why}"
      took = f" ({s['seconds']} s)" if "seconds" in s else ""
      out.append(f"* {_fmt_cmd(s['command'])}{took}{note}")
  return out


def _rows_by(data, model_key=None) -> dict:
  """``{entry: row}`` of a step_time / memory JSON (its rows of ``model_key`` only)."""
  if not data:
    return {}
  keys = data.get("keys") or [None] * len(data["rows"])
  return {row[1]: row for row, key in zip(data["rows"], keys)
          if model_key is None or key == model_key}


def _step_and_memory(results: dict, status: list, names: list) -> str:
  from benchmarks import common  # noqa: PLC0415
  parts = []
  for key, label in (("mlp", "MLP 784-1024×3-10 (2,913,290 parameters; step_time.py's)"),
                     ("chars-768x2", "transformer: chars, 768 wide (GPT-2 small's), 2 blocks, "
                                     "context 128 (14.5M parameters, ResNet-18-sized)")):
    gpu_ids = (["st_gpu_mlp"] if key == "mlp" else
               [s["id"] for s in status if s["id"].startswith("st_gpu_big")])
    gpu = {}
    for i in gpu_ids:
      for entry, row in _rows_by(results.get(i)).items():
        gpu.setdefault(entry, row)
    cpu = _rows_by(results.get("st_cpu_mlp" if key == "mlp" else "st_cpu_big"))
    mem_gpu, mem_cpu = (_rows_by(results.get(i), key) for i in ("mem_gpu", "mem_cpu"))
    rows = []
    for entry in names:
      if not any(entry in t for t in (gpu, cpu, mem_gpu, mem_cpu)):
        continue
      get = lambda t, k: t[entry][k] if entry in t else "—"  # noqa: E731
      rows.append([entry, get(gpu, 3), get(gpu, 4), get(cpu, 4), get(mem_gpu, 4),
                   get(mem_gpu, 5), get(mem_cpu, 5)])
    some = next((r for r in (gpu or cpu).values()), None)
    size = f" {some[0]}, global batch {some[6]}" if some else " nothing"
    ids = gpu_ids + ["st_cpu_mlp" if key == "mlp" else "st_cpu_big", "mem_gpu", "mem_cpu"]
    chunks = (" The GPU rows come from chunks of entries, each timed against its own allreduce."
              if len(gpu_ids) > 1 else "")
    parts.append(f"### {label}\n\nMeasured on{size}.{chunks}\n\n" + (common.markdown_table(
        ["entry", "GPU step ms", "GPU step / allreduce", "CPU×8 step / allreduce",
         "GPU state / grad", "GPU temp / grad", "CPU×8 temp / grad"], rows)
        if rows else "No rows.") + "\n\n" + "\n".join(_section_lines(status, ids)))
  return "\n\n".join(parts)


def _schedule(work: str, status: list, done: dict) -> tuple:
  """The schedule tables (markdown) and the records, from every ``hlo_*`` folder (``done``: the
  files already analysed)."""
  from benchmarks import common, gpu_schedule  # noqa: PLC0415
  parts, records = [], {}
  for folder, title, ids in (("hlo_gpu_mlp", "GPU, MLP", ["st_gpu_mlp"]),  # HLO_DIRS
                             ("hlo_gpu_big", "GPU, transformer",
                              [s["id"] for s in status if s["id"].startswith("st_gpu_big")]),
                             ("hlo_cpu_mlp", "8 CPU devices, MLP", ["st_cpu_mlp"]),
                             ("hlo_cpu_big", "8 CPU devices, transformer", ["st_cpu_big"])):
    path = os.path.join(work, folder)
    if not os.path.isdir(path):
      continue
    try:
      found = gpu_schedule.analyse_dir(path, done)
    except Exception as e:  # noqa: BLE001
      parts.append(f"### {title}\n\nThe analysis failed: {type(e).__name__}: {e}")
      continue
    records[folder] = found
    if not found:
      continue
    world = found[0]["world"]
    total = sum(sum(r["count"].values()) for r in found)
    pairs = sum(r["async"] for r in found)
    summary = (f"W = {world}: {total} collectives in {len(found)} steps, {pairs} of them "
               "scheduled as asynchronous start/done pairs"
               + (f", {sum(r['marked_sync'] for r in found)} of those marked synchronous by XLA"
                  if pairs else "") + ".")
    table = common.markdown_table(gpu_schedule.HEADER, gpu_schedule.rows(found))
    parts.append(f"### {title}\n\n{summary}\n\n{table}\n\nHLO saved by:\n"
                 + "\n".join(_section_lines(status, ids))
                 + "\n* analysed with `PYTHONPATH=. python benchmarks/gpu_schedule.py "
                 f"$WORK/{folder}`")
  return "\n\n".join(parts), records


def _kernels(results: dict, status: list) -> str:
  from benchmarks import common  # noqa: PLC0415
  gpu, cpu = results.get("kernels_gpu"), results.get("kernels_cpu")
  cpu_rows = {(r[0], r[1]): r for r in (cpu or {}).get("rows", [])}
  rows = []
  for r in (gpu or {}).get("rows", []):
    c = cpu_rows.pop((r[0], r[1]), None)
    rows.append([r[0], r[1], r[2], r[3], r[4], c[4] if c else "—", r[5], r[7]])
  rows += [[c[0], c[1], "—", "—", "—", c[4], "—", "—"] for c in cpu_rows.values()]
  table = (common.markdown_table(
      ["kernel", "update of", "GPU kernel ms", "GPU obvious ms", "GPU obvious / kernel",
       "CPU×8 obvious / kernel", "GPU temp / grad", "GPU same output"], rows, "llrrrrrl")
      if rows else "No rows.")
  return (table + "\n\nA ratio above 1: the kernel is faster than the obvious form it replaces. "
          "Kernels that exist for XLA:CPU alone are picked by `lax.platform_dependent`: on the GPU "
          "both columns may run the same program.\n\n"
          + "\n".join(_section_lines(status, ["kernels_gpu", "kernels_cpu"])))


def _quality(results: dict, status: list, work: str) -> str:
  from benchmarks import common  # noqa: PLC0415
  q = results.get("quality")
  lines = "\n".join(_section_lines(status, ["quality"]))
  if not q:
    return "Not measured.\n\n" + lines
  body = ""
  path = os.path.join(work, "quality.md")
  if os.path.exists(path):
    with open(path) as f:
      text = f.read()
    body = text.split("\n\n", 2)[1] if text.count("\n\n") >= 2 else ""
  return ((body or f"{q['steps']} steps, {q['params']:,} parameters, {q['world']}.") + "\n\n"
          + common.markdown_table(q["header"], q["rows"]) + "\n\n" + lines)


def report(out_dir: str, work: str, dry: bool, started: float, budget: float, ended: dict,
           python: str, done: dict) -> str:
  statuses = {lane: _load(os.path.join(work, f"status_{lane}.json")) or {"sections": []}
              for lane in ("gpu", "gpu-compile", "cpu")}
  status = [s for lane in statuses.values() for s in lane["sections"]]
  results = {s["id"]: _load(os.path.join(work, s["id"] + ".json")) for s in status}
  results = {k: v for k, v in results.items() if v}
  env = _load(os.path.join(work, "env.json"))
  try:
    from jaxcomp.train import registry  # noqa: PLC0415
    names = list(registry.REGISTRY)
  except Exception:  # noqa: BLE001
    names = []
  from benchmarks import gpu_env  # noqa: PLC0415
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
  stops = (env or {}).get("stops") or next((s["stops"] for s in statuses.values()
                                            if s.get("stops")), [])
  head = [f"# jaxcomp on {'a CPU (DRY RUN)' if dry else 'a GPU'}: `gpu.sh` report", "",
          f"`bash benchmarks/gpu.sh {os.path.basename(out_dir.rstrip('/')) or out_dir}"
          f"{' --dry-run' if dry else ''}` at commit {commit}"
          f"{' (with uncommitted changes)' if dirty else ''}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}: {time.time() - started:.0f} s in all "
          f"(budget {budget:.0f} s).", ""]
  if dry:
    head += ["**Dry run**: the same code on CPU devices with tiny models, two registry entries on "
             "the MLP (allreduce alone elsewhere) and one repeat, so that the script cannot rot. No "
             "figure below means anything.", ""]
  if stops:
    head += [f"**STOP: {line}**" for line in stops] + [""]
  lanes = "; ".join(f"{lane}: {ended.get(lane, '?')}" for lane in statuses)
  body = ["## 1. Environment", "",
          gpu_env.markdown(env) if env else "The environment check did not finish.", "",
          f"Lanes (exit status): {lanes}. `{python}`.", "",
          "## 2. Step time and memory, every registry entry", "",
          "GPU: W = the GPU count, the step of `jaxcomp.data_parallel` as the main job builds it "
          "(`step_time.py`: forward, backward, the compressor, SGD; median of interleaved rounds, "
          "each entry's step / allreduce's in the same round); CPU×8: the same on 8 simulated CPU "
          "devices for the ratio's sake. Memory: `memory.py`, one update compiled with the "
          "gradient and state donated (state and temporaries per device, ÷ the gradient's "
          "bytes). — : not measured (a CPU subset, or the budget: see the commands).", "",
          _step_and_memory(results, status, names), ""]
  schedule, records = _schedule(work, status, done)
  body += ["## 3. Are the collectives asynchronous, and do they overlap the backward pass?", "",
           gpu_schedule_doc(), "", schedule or "No compiled step was saved.", "",
           "## 4. Kernels against their obvious forms (`kernels.py`)", "",
           _kernels(results, status), "",
           f"## 5. Quality on a {'tiny' if dry else '28.6M-parameter'} transformer "
           "(`quality.py`)", "", _quality(results, status, work), "",
           "## Sections", "", "Every section, in its lane's order:", ""]
  body += [f"* {lane}: " + ", ".join(f"{s['id']} {s.get('status', '?')}"
                                     + (f" {s['seconds']} s" if "seconds" in s else "")
                                     for s in statuses[lane]["sections"])
           for lane in statuses]
  text = "\n".join(head + body) + "\n"
  with open(os.path.join(out_dir, "gpu_report.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out_dir, "gpu_results.json"), "w") as f:
    json.dump({"env": env, "status": statuses, "results": results, "schedule": records,
               "ended": ended}, f, indent=1, default=str)
  return text


def gpu_schedule_doc() -> str:
  return ("Read from the compiled HLO text of each step (`gpu_schedule.py`; a compiled module "
          "lists each computation's instructions in the order they run). *async*: the "
          "collectives XLA split into a start and a done (`all-reduce-start`/`-done`, "
          "`all-gather-start`, `collective-permute-start`, `async-start` around an all-to-all or a "
          "reduce-scatter), and how many of those it marked synchronous (`is_sync`). *window*: the "
          "instructions scheduled between a start and its done, bookkeeping (tuples, bitcasts, "
          "parameters) not counted; *backward in windows*: the backward pass's instructions "
          "(`transpose(jvp(...))` outside any `jaxcomp.` scope) inside any window — what overlaps "
          "the collectives, in instructions, not time; *after first start*: the backward "
          "instructions the schedule puts after the first collective's start (what a collective "
          "could still overlap); *bytes overlapping backward*: the share of the collectives' "
          "payload bytes whose window holds backward work; *each*: every collective in schedule "
          "order (AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, CP "
          "collective-permute) as instructions in its window / backward ones among them, or sync. "
          "At W = 1 XLA may remove collectives over a one-device group. $WORK: the run's "
          "temporary folder.")


def _collect_log(work: str, out_dir: str) -> None:
  with open(os.path.join(out_dir, "gpu_log.txt"), "w") as out:
    for name in ("gpu", "gpu-compile", "cpu"):
      path = os.path.join(work, f"lane_{name}.log")
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          text = f.read()
        out.write(f"===== lane {name} =====\n{text[-2_000_000:]}\n")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out_dir", nargs="?", help="the folder for gpu_report.md and its raw files")
  p.add_argument("--dry-run", action="store_true",
                 help="the same code on this machine's CPU: tiny models, under a minute")
  p.add_argument("--budget", type=float, default=None,
                 help=f"seconds until the report (default {BUDGET}, dry run {DRY_BUDGET})")
  p.add_argument("--lane", help=argparse.SUPPRESS)
  p.add_argument("--work", help=argparse.SUPPRESS)
  p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
  p.add_argument("--cores", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.lane:
    cores = [int(c) for c in args.cores.split(",")] if args.cores else None
    return run_lane(args.lane, args.work, args.deadline, cores)
  if not args.out_dir:
    p.error("give the output folder: bash benchmarks/gpu.sh OUT_DIR [--dry-run]")
  started = time.time()
  budget = args.budget or (DRY_BUDGET if args.dry_run else BUDGET)
  out_dir = os.path.abspath(args.out_dir)
  os.makedirs(out_dir, exist_ok=True)
  work = tempfile.mkdtemp(prefix="jaxcomp_gpu_")
  os.environ["JAX_PLATFORMS"] = "cpu"  # this process: the registry's names and the HLO text only
  lanes = plan(args.dry_run)
  with open(os.path.join(work, "plan.json"), "w") as f:
    json.dump(lanes, f, indent=1)
  reserve = 6 if args.dry_run else RESERVE
  deadline = started + budget - reserve
  procs = start_lanes(work, lanes, deadline, sys.executable)
  _pin(_cores()["gpu-compile"])  # reading the HLO meanwhile: beside the lane that times nothing
  done = {}
  ended = wait_lanes(procs, deadline, work, done)
  text = report(out_dir, work, args.dry_run, started, budget, ended, sys.executable, done)
  _collect_log(work, out_dir)
  shutil.rmtree(work, ignore_errors=True)
  print("\n".join(text.splitlines()[:12]))
  print(f"... wrote {os.path.join(out_dir, 'gpu_report.md')} in {time.time() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
