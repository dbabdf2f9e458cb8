"""The planner's compute, checked: each registry entry's step ratio predicted from its compiled
program and this machine's device model, against the step ratio measured on the same machine.

For each model (``step_time.py``'s MLP and the main job's chars transformer, one device, its global
batch), the **prediction** is what ``python -m jaxcomp.train --plan --device this-cpu`` computes:
the model's forward and backward (``jax.value_and_grad`` of its loss) and each entry's update
(``jaxcomp.train.compute``: the entry's transformation, ``optax.sgd``, the parameters' update,
compiled per shape group for abstract parameters) turned into seconds by the roofline of this CPU
(``jaxcomp.train.devices.measure_this_cpu``), the step ratio being (forward and backward + the
entry's update) / (forward and backward + allreduce's). A typical step is predicted (phases taken
on fewer than half of the steps left out): the **measurement** is ``step_time.py``'s median over
interleaved rounds, which for local SGD and DiLoCo is a local step.

One device: the planner costs what the collectives send with the α-β model, and on simulated
devices a collective is a memory copy among threads that share the cores, so one device isolates
the compute the planner predicts (every compressor still compresses and decodes, at W = 1).

``--gpu-section`` also predicts the MLP's ratios on the ``h200`` preset and sets them beside the
GPU step ratios in BENCHMARKS.md's "GPU" section (measured on an H200 by ``gpu.sh``, dated
there). ``--platform gpu --device h100`` runs both sides on a lent GPU.

  nice -n 19 env PYTHONPATH=. python benchmarks/plan_check.py --write [--models mlp,chars]
      [--compressors all] [--repeats 10] [--gpu-section]
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import step_time  # noqa: E402  (configures the simulated devices first)

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp.train import compute, devices, hlo_cost  # noqa: E402

WITHIN = 0.30
"""The check: predicted / measured within ±30%."""


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def predicted(task, params, batch, names, device) -> tuple:
  """``({name: predicted step ratio}, model seconds, {name: update seconds or None})``."""
  model = compute.program(jax.value_and_grad(task.loss), abstract(params),
                          *abstract(tuple(batch)))
  model_s = device.seconds(hlo_cost.summary(model))
  costs = compute.update_costs(names, abstract(params), least_share=0.5)
  update = {n: None if c.summary is None else device.seconds(c.summary) for n, c in costs.items()}
  base = model_s + update["allreduce"]
  return ({n: None if s is None else (model_s + s) / base for n, s in update.items()}, model_s,
          update)


def measured(task, params, batch, compressor_list, repeats, platform) -> tuple:
  """``({name: step ratio}, allreduce's median step in seconds)``: ``step_time.py``'s measurement
  on one device."""
  runners = step_time.step_runners(task, compressor_list, batch, common.devices(1, platform),
                                   params=params)
  times = common.interleaved(runners, repeats, warmup=2)
  return ({c.name: common.ratio(times, c.name, "allreduce") for c in compressor_list},
          common.median(times["allreduce"]))


def gpu_section(path: str = common.BENCHMARKS_MD) -> dict:
  """``{name: GPU step / allreduce}`` from BENCHMARKS.md's "GPU" section's MLP table."""
  with open(path, encoding="utf-8") as f:
    text = f.read().split("\n## GPU\n", 1)[-1]
  rows = re.findall(r"^\| (\w+) \| [\d.]+ \| ([\d.]+) \|", text, re.M)
  return {name: float(ratio) for name, ratio in rows}


def _row(model, name, guess, seen) -> list:
  if guess is None:
    return [model, name, "not compiled", f"{seen:.2f}", "-", "-"]
  quotient = guess / seen
  return [model, name, f"{guess:.2f}", f"{seen:.2f}", f"{quotient:.2f}",
          "yes" if abs(quotient - 1) <= WITHIN else "**no**"]


def main(argv=None) -> int:
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--models", default="mlp,chars", help="from mlp, chars (default both)")
  p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 10, quick 2)")
  p.add_argument("--platform", default=None, help="where to measure (default: JAX's default)")
  p.add_argument("--device", default="this-cpu",
                 help="the device model of the prediction (default this-cpu)")
  p.add_argument("--gpu-section", action="store_true",
                 help="also predict the MLP on the h200 preset against BENCHMARKS.md's GPU "
                      "section")
  args = common.parse(p, argv)
  repeats = args.repeats or (2 if args.quick else 10)
  compressor_list = common.compressors(args.compressors or "all")
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  names = [c.name for c in compressor_list]
  model_device = devices.get(args.device)
  rows, within, total, notes = [], 0, 0, []
  for key in [m.strip() for m in args.models.split(",") if m.strip()]:
    (label, (task, batch_size)), = step_time.model_tasks(args.quick, [key]).items()
    params = task.init(0)
    batch = task.batch(0, 0, batch_size(1))
    guess, model_s, update = predicted(task, params, batch, names, model_device)
    seen, base_s = measured(task, params, batch, compressor_list, repeats, args.platform)
    notes.append(f"{label}: allreduce's step {1e3 * (model_s + update['allreduce']):.3g} ms "
                 f"predicted (forward and backward {1e3 * model_s:.3g} ms, the update "
                 f"{1e3 * update['allreduce']:.3g} ms), {1e3 * base_s:.3g} ms measured")
    for name in names:
      rows.append(_row(label, name, guess[name], seen[name]))
      if guess[name] is not None:
        total += 1
        within += abs(guess[name] / seen[name] - 1) <= WITHIN
      print(f"  {label} {name}: {rows[-1][2]} / {rows[-1][3]}", file=sys.stderr, flush=True)
  header = ["model", "entry", "predicted step ratio", "measured", "predicted / measured",
            f"within ±{100 * WITHIN:.0f}%"]
  body = (f"One device; the prediction on {model_device.describe()}; the measurement the median "
          f"of {repeats} interleaved per-round ratios (`benchmarks/step_time.py`'s). "
          f"**{within} of {total} within ±{100 * WITHIN:.0f}% ({100 * within / max(total, 1):.0f}"
          "%).** " + "; ".join(notes) + ".\n\n" + common.markdown_table(header, rows, "llrrrr"))
  if args.gpu_section:
    body += "\n\n" + _gpu_rows(names, args)
  common.emit(args, "plan_check", "Planner: predicted against measured step ratios",
              "plan_check.py", body)
  return 0


def _gpu_rows(names, args) -> str:
  """The MLP's ratios predicted on the h200 preset beside the GPU section's."""
  device = devices.get("h200")
  (label, (task, batch_size)), = step_time.model_tasks(args.quick, ["mlp"]).items()
  params = task.init(0)
  guess, model_s, update = predicted(task, params, task.batch(0, 0, batch_size(1)), names, device)
  seen = gpu_section()
  rows = [_row(label, n, guess[n], seen[n]) for n in names if n in seen]
  hits = sum(r[-1] == "yes" for r in rows)
  return (f"Against BENCHMARKS.md's \"GPU\" section (one H200, measured there, dated there), "
          f"predicted on {device.describe()}: {hits} of {len(rows)} within "
          f"±{100 * WITHIN:.0f}%; forward and backward {1e3 * model_s:.3g} ms predicted, "
          f"allreduce's update {1e3 * update['allreduce']:.3g} ms.\n\n"
          + common.markdown_table(["model", "entry", "predicted step ratio", "measured on the "
                                   "H200", "predicted / measured", f"within ±{100 * WITHIN:.0f}%"],
                                  rows, "llrrrr"))


if __name__ == "__main__":
  sys.exit(main())
