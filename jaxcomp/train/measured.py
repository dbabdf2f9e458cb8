"""The measurements the planner ranks by, dated, with the commands that took them.

``measured.json`` (shipped with the package) holds the steps to target (``jaxcomp.train.evidence``
reads them), each run with its command, its date, the model and the devices it was measured on:

* ``steps_to_target``: runs of the main job (``python -m jaxcomp.train``), newest first: the steps
  each entry took to reach allreduce's final held-out loss (``outcomes``: ``{"steps": s}``, or the
  steps it ran without reaching it, ``{"not_in": s}``, or ``{"diverged": true}``), with the model's
  ``params``, the ``tokens`` allreduce trained on to its final loss and, where recorded, each
  entry's final held-out loss (``losses``);
* ``scaling``: records of a scaling study, one per entry, model size and seed (the format of
  ``benchmarks/scaling_quality.py``'s results file, one JSON object a line): ``entry``, ``size``,
  ``seed``, ``params``, ``tokens``, ``steps``, ``heldout_loss``, ``allreduce_loss`` (the
  baseline's, same size and seed), ``steps_to_allreduce_loss`` (the first evaluated step at that
  loss or below, null if none), ``baseline`` (the baseline's entry; default
  ``allreduce_adamw``), ``date``, ``command``, ``machine``.

The planner's compute is not here: it compiles each entry's update at the user's shapes
(``jaxcomp.train.compute``). Regenerate the file from new runs (each input may be left out; the
other sections are kept)::

  python -m jaxcomp.train --compressors all --out job_out
  python -m jaxcomp.train.measured --job job_out/results.json
  python -m jaxcomp.train.measured --scaling benchmarks/scaling_quality.jsonl

``--job`` puts the run first among the ``steps_to_target`` runs (older runs stay behind it, for the
entries it did not train); ``--scaling`` replaces the ``scaling`` records; ``--out`` writes
elsewhere than the packaged file.
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

CHARS_CONTEXT = 64
"""Characters per sequence of the main job's chars task (``tasks.CHARS_SIZES["small"]``)."""
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


def steps_to_target(data: dict, name: str) -> tuple:
  """``(run, outcome)`` of the newest run of the job that trained entry ``name``: ``outcome`` is
  ``{"steps": s}``, ``{"not_in": s}`` or ``{"diverged": True}``; ``(None, None)`` if none did."""
  for run in data["steps_to_target"]:
    if name in run["outcomes"]:
      return run, run["outcomes"][name]
  return None, None


def _date_of(path: str) -> str:
  return datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat()


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
  base_steps = base.steps_to(target) or base.steps
  per_step = out["batch_size"] * (CHARS_CONTEXT if out["task"] == "chars" else 1)
  params = re.search(r"\(([\d,]+) parameters\)", model)
  return {"command": out["command"], "date": _date_of(path), "source": path, "model": model,
          "devices": f"{out['devices']} devices", "steps": out["steps"],
          "base_steps": base_steps, "target": round(target, 4),
          "params": int(params.group(1).replace(",", "")) if params else None,
          "tokens": base_steps * per_step,
          "losses": {r.name: round(r.final[0], 4) for r in runs},
          "outcomes": outcomes}


def from_scaling(path: str) -> list:
  """The ``scaling`` records from a scaling study's results file (one JSON object a line)."""
  keep = ("entry", "size", "seed", "params", "tokens", "steps", "heldout_loss", "allreduce_loss",
          "steps_to_allreduce_loss", "baseline", "date", "command", "machine")
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [{k: r[k] for k in keep if k in r} for r in records]


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxcomp.train.measured",
      description="Rewrites the planner's measurements (jaxcomp/train/measured.json) from a run of "
                  "the main job and/or a scaling study's results.")
  parser.add_argument("--job", help="the main job's OUT/results.json")
  parser.add_argument("--scaling", help="a scaling study's results file (JSON lines)")
  parser.add_argument("--out", default=PATH, help="where to write (default: the packaged file)")
  args = parser.parse_args(argv)
  if not (args.job or args.scaling):
    parser.error("give --job, --scaling or both")
  data = load(args.out if os.path.exists(args.out) else PATH)
  if args.scaling:
    data["scaling"] = from_scaling(args.scaling)
  if args.job:
    data["steps_to_target"] = [from_job(args.job)] + data["steps_to_target"]
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1, ensure_ascii=False)
    f.write("\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
