"""The Markdown report of ``bash benchmarks/gpu.sh OUT_DIR`` (``gpu_run.py`` runs the lanes).

From the files the lanes leave in the work folder — each lane's ``status_<lane>.json``, each
section's rows (``<id>.json``) and printed output (``<id>.md``), the compiled steps' HLO — it writes
``OUT_DIR/gpu_report.md`` (the environment, step time and memory of every registry entry, the
collectives' schedule, the kernels, quality), ``gpu_results.json`` (every row) and ``gpu_log.txt``
(the lanes' output).
"""

from __future__ import annotations

import json
import os
import subprocess
import time


def read_json(path: str):
  """The JSON in ``path``, or None where there is no such file (a section that did not write it)."""
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
        state = ("running when this report was written, or cut short at the deadline (the rows "
                 "it had written are kept)")
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
  """Writes ``gpu_report.md`` and ``gpu_results.json`` to ``out_dir`` from the lanes' files in
  ``work`` (``ended``: each lane's exit status; ``done``: the HLO files already analysed) and
  returns the report's text."""
  statuses = {lane: read_json(os.path.join(work, f"status_{lane}.json")) or {"sections": []}
              for lane in ("gpu", "gpu-compile", "cpu")}
  status = [s for lane in statuses.values() for s in lane["sections"]]
  results = {s["id"]: read_json(os.path.join(work, s["id"] + ".json")) for s in status}
  results = {k: v for k, v in results.items() if v}
  env = read_json(os.path.join(work, "env.json"))
  try:
    from jaxcomp.train import registry  # noqa: PLC0415
    names = list(registry.REGISTRY)
  except Exception:  # noqa: BLE001
    names = []
  from benchmarks import common, gpu_env  # noqa: PLC0415
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT,
                          capture_output=True, text=True).stdout.strip() or "unknown"
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=common.ROOT,
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
             "the MLP (allreduce alone elsewhere) and one repeat, so that the script cannot rot. "
             "No figure below means anything.", ""]
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


def collect_log(work: str, out_dir: str) -> None:
  """Writes the lanes' output to ``out_dir/gpu_log.txt`` (the last 2 MB of each)."""
  with open(os.path.join(out_dir, "gpu_log.txt"), "w") as out:
    for name in ("gpu", "gpu-compile", "cpu"):
      path = os.path.join(work, f"lane_{name}.log")
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          text = f.read()
        out.write(f"===== lane {name} =====\n{text[-2_000_000:]}\n")

