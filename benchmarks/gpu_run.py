"""``bash benchmarks/gpu.sh OUT_DIR [--dry-run]``: the benchmarks a lent GPU runs, in one command
that fits in 7 minutes, and their Markdown report ``OUT_DIR/gpu_report.md``.

The work runs in three processes ("lanes") at once, each calling the benchmark scripts' own
``main(argv)`` one after the other (one JAX start per lane; every section's standalone command is in
the report), each pinned to its own cores where the machine has 12 or more:

* ``gpu``: the environment and the API check (``gpu_env.py``), then everything timed on the GPU,
  one thing at a time, in the order of what its figures are worth: ``step_time.py`` on a
  ResNet-18-sized transformer (GPT-2 small's width, 2 blocks; every entry, in chunks of ``CHUNK``,
  each with its own allreduce, so that the deadline costs only the chunk it cuts; the report counts
  each compiled step's kernels), ``kernels.py``, ``step_time.py`` on the MLP (every registry
  entry), then ``quality.py`` on a 28.6M-parameter transformer;
* ``gpu-compile``: ``memory.py`` on the GPU (compile only: it times nothing), then on 8 CPU devices;
* ``cpu``: 8 simulated CPU devices (``JAX_PLATFORMS=cpu``) beside it, for the ratios' sake:
  ``step_time.py`` on the MLP (every entry) and on the transformer (a subset: on CPU a step of it
  takes seconds), ``kernels.py``.

Every ``step_time.py`` run saves its steps' compiled HLO (``--hlo-dir``), which ``gpu_schedule.py``
reads for the asynchronous collectives. The lanes end by a deadline (``--budget``, 420 s; a section
that could not finish in time is skipped, one cut short keeps the rows it wrote). The report
(``gpu_report.py``), ``gpu_results.json`` (every row) and ``gpu_log.txt`` (the lanes' output) are
written again each time a section ends, so a run cut off from outside still leaves every section
it finished; once the lanes are done this process writes them a last time.
``--dry-run`` runs the same code on a CPU machine in under a minute: tiny models (the quick MLP in
the transformer's place), two entries, one or two repeats, the "gpu" lane on one CPU device.

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

from benchmarks import gpu_report  # noqa: E402

BUDGET = 420
"""Seconds from start to the report (7 minutes: a lent machine's command may be given 8, less its
own start-up)."""
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
  # By value: the transformer's steps (and the kernels counted in them), the kernels, the MLP,
  # then quality (the longest section, and the one a CPU run can stand in for).
  gpu = [section("env", "gpu_env", ["--out", "{work}/env.json"], 5)]
  big = "mlp" if dry else "chars-768x2"  # the dry run's transformer: a model that compiles fast
  gpu += [step_time(f"st_gpu_big{k}", big, chunk, 20, "hlo_gpu_big", 40)
          for k, chunk in enumerate(chunks)]
  gpu += [section("kernels_gpu", "kernels", ["--platform", "{P}", "--devices", "{W}", "--repeats",
                                             "1" if dry else "20",
                                             "--out", "{work}/kernels_gpu.json"]
                  + (["--compressors", DRY_KERNELS] if dry else []), 20),
          step_time("st_gpu_mlp", "mlp", every, 30, "hlo_gpu_mlp", 30),
          section("quality", "quality", ["--devices", "{W}", "--size", "768x4", "--batch-size",
                                         "64", "--steps", "3" if dry else str(QUALITY_STEPS),
                                         "--max-steps", "3" if dry else str(QUALITY_STEPS),
                                         "--compressors", "allreduce" if dry else ",".join(QUALITY),
                                         "--out", "{work}/quality.json"], 150)]
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

  def save():  # whole or not at all: the parent reads it while the lane runs
    path = os.path.join(work, f"status_{name}.json")
    with open(path + ".part", "w") as f:
      json.dump(status, f, indent=1)
    os.replace(path + ".part", path)

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
      found = (gpu_report.read_json(os.path.join(work, "env.json"))
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


def _finished(work: str) -> int:
  """How many sections the lanes have finished so far (their ``status_<lane>.json``)."""
  count = 0
  for lane in ("gpu", "gpu-compile", "cpu"):
    status = gpu_report.read_json(os.path.join(work, f"status_{lane}.json")) or {}
    count += sum(s.get("status") not in (None, "running") for s in status.get("sections", []))
  return count


def wait_lanes(procs: dict, deadline: float, work: str, done: dict, progress=None) -> dict:
  """Waits for the lanes until ``deadline``, analysing the compiled steps as they are saved and
  calling ``progress(ended)`` each time a section ends; kills (by process group) the lanes still
  running then."""
  ended, finished = {}, 0
  while len(ended) < len(procs) and time.time() < deadline:
    for name, (proc, _) in procs.items():
      if name not in ended and proc.poll() is not None:
        ended[name] = proc.returncode
    analyse_new(work, done)
    now = _finished(work)
    if progress is not None and now > finished:
      finished = now
      try:
        progress(dict(ended))
      except Exception:  # noqa: BLE001  (a half-written file: the next section's call rewrites it)
        traceback.print_exc()
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

  def write(ended):  # the report of what has finished so far
    text = gpu_report.report(out_dir, work, args.dry_run, started, budget, ended, sys.executable,
                             done)
    gpu_report.collect_log(work, out_dir)
    return text

  ended = wait_lanes(procs, deadline, work, done, write)
  text = write(ended)
  shutil.rmtree(work, ignore_errors=True)
  print("\n".join(text.splitlines()[:12]))
  print(f"... wrote {os.path.join(out_dir, 'gpu_report.md')} in {time.time() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
