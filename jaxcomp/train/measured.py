"""The measurements the planner projects from, dated, with the commands that took them.

``measured.json`` (shipped with the package) holds two kinds of figures, each with its command, its
date, the model and the devices it was measured on:

* ``step_time``: each registry entry's training step as a ratio to allreduce's, from
  ``benchmarks/step_time.py`` (BENCHMARKS.md, "Training step time against allreduce");
* ``steps_to_target``: runs of the main job (``python -m jaxcomp.train``), newest first: the steps
  each entry took to reach allreduce's final held-out loss, or the steps it ran without reaching
  it (``not_in``), or that it diverged.

Regenerate it from new runs (either input may be left out; the other section is kept)::

  PYTHONPATH=. python benchmarks/step_time.py --models mlp --devices 8 --repeats 8 \\
      --compressors all --out step_time.json        # or BENCHMARKS.md once written with --write
  python -m jaxcomp.train --compressors all --out job_out
  python -m jaxcomp.train.measured --step-time step_time.json --job job_out/results.json

``--job`` puts the run first among the ``steps_to_target`` runs (older runs stay behind it, for the
entries it did not train); ``--out`` writes elsewhere than the packaged file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from typing import Optional, Sequence

from jaxcomp.train.runs import Run, target_of

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured.json")
"""The packaged measurements."""


def load(path: Optional[str] = None) -> dict:
  """The measurements in ``path`` (default: the packaged ``measured.json``).

  Raises:
    FileNotFoundError: the file is missing (an installation without the package's data files).
  """
  path = path or PATH
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing: the planner's measurements ship in the source "
                            "tree (pip install -e .); python -m jaxcomp.train.measured writes it")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def step_ratio(data: dict, name: str) -> Optional[float]:
  """Entry ``name``'s measured step time over allreduce's, or None where it was not measured."""
  return data["step_time"]["ratios"].get(name)


def steps_to_target(data: dict, name: str) -> tuple:
  """``(run, outcome)`` of the newest run of the job that trained entry ``name``: ``outcome`` is
  ``{"steps": s}``, ``{"not_in": s}`` or ``{"diverged": True}``; ``(None, None)`` if none did."""
  for run in data["steps_to_target"]:
    if name in run["outcomes"]:
      return run, run["outcomes"][name]
  return None, None


def _date_of(path: str) -> str:
  return datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat()


def from_step_time(path: str) -> dict:
  """The ``step_time`` section from ``benchmarks/step_time.py``'s ``--out`` JSON (its first model
  and device count), or from BENCHMARKS.md's step-time section."""
  if path.endswith(".md"):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    section = text.split("<!-- BEGIN step_time -->")[1].split("<!-- END step_time -->")[0]
    command = re.search(r"^`(PYTHONPATH=\. python benchmarks/step_time\.py[^`]*)`", section,
                        re.M).group(1)
    machine, date = re.search(r"^(.+); (\d{4}-\d\d-\d\d)\.$", section, re.M).groups()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ")][1:]
    source = f"{os.path.basename(path)}, its step-time section"
  else:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
    command, machine, rows, date = out["command"], out["machine"], out["rows"], _date_of(path)
    source = f"{os.path.basename(path)} (step_time.py --out)"
  first = [r for r in rows if (r[0], r[5]) == (rows[0][0], rows[0][5])]
  return {"command": command, "date": date, "source": source, "model": first[0][0],
          "devices": f"{first[0][5]} simulated CPU devices" if "CPU" in machine and "×" not in
          machine else f"{first[0][5]} devices", "world": int(first[0][5]), "machine": machine,
          "global_batch": int(first[0][6]), "ratios": {r[1]: float(r[4]) for r in first}}


def from_job(path: str) -> dict:
  """A ``steps_to_target`` run from the main job's ``OUT/results.json`` (and the header line of the
  ``results.md`` beside it, which names the model)."""
  with open(path, encoding="utf-8") as f:
    out = json.load(f)
  runs = [Run(**r) for r in out["runs"]]
  base, target = target_of(runs)
  outcomes = {}
  for r in runs:
    reached = None if r.diverged else r.steps_to(target)
    outcomes[r.name] = ({"diverged": True} if r.diverged else
                        {"steps": reached} if reached is not None else {"not_in": len(r.losses)})
  model = f"the main job's {out['task']} task"
  md = os.path.join(os.path.dirname(path), "results.md")
  if os.path.exists(md):
    with open(md, encoding="utf-8") as f:
      header = f.read().split("\n\n")[1]
    found = re.match(r"task (\w+) \(([\d,]+) parameters\)", header)
    if found:
      model = f"{found.group(1)} transformer ({found.group(2)} parameters)" if found.group(
          1) == "chars" else f"{found.group(1)} ({found.group(2)} parameters)"
  return {"command": out["command"], "date": _date_of(path), "source": path, "model": model,
          "devices": f"{out['devices']} devices", "steps": out["steps"],
          "base_steps": base.steps_to(target) or base.steps, "target": round(target, 4),
          "step_ratios": {r.name: round(r.median_step_seconds / base.median_step_seconds, 3)
                          for r in runs},
          "outcomes": outcomes}


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxcomp.train.measured",
      description="Rewrites the planner's measurements (jaxcomp/train/measured.json) from a run of "
                  "benchmarks/step_time.py and/or of the main job.")
  parser.add_argument("--step-time", help="step_time.py's --out JSON, or BENCHMARKS.md")
  parser.add_argument("--job", help="the main job's OUT/results.json")
  parser.add_argument("--out", default=PATH, help="where to write (default: the packaged file)")
  args = parser.parse_args(argv)
  if not (args.step_time or args.job):
    parser.error("give --step-time, --job or both")
  data = load(args.out if os.path.exists(args.out) else PATH)
  if args.step_time:
    data["step_time"] = from_step_time(args.step_time)
  if args.job:
    data["steps_to_target"] = [from_job(args.job)] + data["steps_to_target"]
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1, ensure_ascii=False)
    f.write("\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
