"""The planner's answer (``recommend``): which way to train wins where, its reasons, the sharded
ways where DDP does not fit; the steps-to-target evidence (``evidence``, ``measured --scaling``);
a user's own model (``--model module:function``) and bad input, each one line naming the argument
and the fix."""

import json
import os
import subprocess
import sys

import pytest

from jaxcomp.train import cli, evidence, measured, planner, shapes, user_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = shapes.gpt2(width=64, depth=2, vocab=96, context=32)  # 71,296 parameters: compiles fast
CONTRASTED = ["allreduce", "bf16", "quantized_int8", "onebit_adam", "streaming_diloco_h20_p2",
              "powersgd_r4", "dgc_exact_fp16"]
"""The entries the main job's default run measured (J1), and so the ones that can be ranked."""


def test_a_slow_link_picks_a_compressor_and_a_fast_one_a_dense_mean():
  slow = planner.plan(TINY, devices=64, gbits=[0.01], step_ms=1.0, names=CONTRASTED[:4])
  rec = slow.recommendations[0.01]
  assert rec.winner.label == "onebit_adam" and rec.limit == "the link"  # 32x fewer bytes
  assert rec.ranking[0][1] < rec.ranking[1][1] and rec.runner_up.label == rec.ranking[1][0]
  assert rec.above is not None and rec.above[0] > 0.01  # a faster link changes the answer
  assert rec.measure is None  # measured at 120,704 parameters: not far below this model's 71,296
  fast = planner.plan(TINY, devices=8, gbits=[1e4], step_ms=1.0, names=CONTRASTED[:4])
  rec = fast.recommendations[1e4]
  assert rec.winner.label in ("allreduce", "bf16") and rec.limit == "compute"
  text = fast.text.split("\n")
  assert text[2].startswith(f"Recommendation at 10,000 Gbit/s per worker: **{rec.winner.label}**")
  assert "* Runner-up: " in fast.text and "* Limited by: compute." in fast.text


def test_the_evidence_decides_what_is_ranked():
  result = planner.plan(TINY, devices=64, gbits=[0.01], step_ms=1.0,
                        names=["powersgd_r4", "dion_r4"])
  rec = result.recommendations[0.01]
  ranked = [label for label, _ in rec.ranking]
  assert "dion_r4" not in ranked and ("dion_r4", "steps to target not measured") in rec.not_ranked
  assert "powersgd_r4" not in ranked  # it did not reach the target: a lower bound only
  thin = dict(rec.thin)
  assert "powersgd_r4" in thin and "it wins if it reaches it within" in thin["powersgd_r4"]
  assert "Could win, evidence too thin: powersgd_r4" in result.text
  assert rec.winner.label == "bf16"  # of the two that reached the target, the fewer bytes


def test_where_ddp_does_not_fit_the_exact_sharded_ways_are_ranked():
  result = planner.plan(TINY, devices=64, gbits=[10], step_ms=1.0, names=["onebit_adam"],
                        device_gib=1e-3)  # 1 MiB a device: DDP's 0.8 MiB of Adam state fits not
  rec = result.recommendations[10.0]
  assert rec.fits is False and rec.limit == "memory"
  assert rec.winner.label in ("ZeRO-1/2 exact", "FSDP exact")
  assert all(label not in ("allreduce", "bf16", "onebit_adam") for label, _ in rec.ranking)
  assert "DDP with Adam does not fit" in result.text


@pytest.mark.slow  # every contrasted entry's update compiled at GPT-2 small's shapes
def test_the_recommendation_for_gpt2_small_on_a_slow_and_a_fast_cluster():
  slow = planner.plan(model="gpt2-small", devices=64, gbits=[1], device="h100", names=CONTRASTED)
  winner = slow.recommendations[1.0].winner.label
  assert winner not in ("allreduce", "bf16", "fp16"), slow.text[:2000]  # compressed or low-comm
  fast = planner.plan(model="gpt2-small", devices=8, gbits=[400], device="h100",
                      names=CONTRASTED)
  assert fast.recommendations[400.0].winner.label in ("allreduce", "bf16"), fast.text[:2000]


def test_steps_to_target_from_a_scaling_study(tmp_path):
  def record(entry, size, params, loss, base_loss, reached, seed=0):
    return {"entry": entry, "size": size, "seed": seed, "params": params, "tokens": 20 * params,
            "steps": 100, "heldout_loss": loss, "allreduce_loss": base_loss,
            "steps_to_allreduce_loss": reached, "date": "2026-12-01", "command": "study"}
  lines = [record("allreduce_adamw", "s", 1e5, 2.0, 2.0, 100),
           record("allreduce_adamw", "s", 1e5, 2.2, 2.2, 90, seed=1),
           record("allreduce_adamw", "m", 1e6, 1.8, 1.8, 100),
           record("diloco_h20", "s", 1e5, 2.1, 2.0, None),
           record("diloco_h20", "s", 1e5, 2.2, 2.2, 90, seed=1),
           record("diloco_h20", "m", 1e6, 1.818, 1.8, 110)]
  path = tmp_path / "study.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in lines))
  out = tmp_path / "measured.json"
  assert measured.main(["--scaling", str(path), "--out", str(out)]) == 0
  data = json.loads(out.read_text())
  found = evidence.points(data, "diloco_h20", {})
  assert [p.params for p in found] == [1e5, 1e6]
  small, large = found
  assert small.seeds == 2 and small.bound  # seed 0 did not reach it: (100/100 + 90/90) / 2
  assert small.steps_ratio == pytest.approx(1.0) and small.gap == pytest.approx(0.025)
  assert large.steps_ratio == pytest.approx(1.1) and large.gap == pytest.approx(0.01)
  assert evidence.trend(found) == pytest.approx(-0.015)  # the gap shrinks by 1.5 points per 10x
  assert evidence.best(found) is large
  assert evidence.paper("diloco_h20").cite.startswith("Charles et al. 2025")
  assert evidence.paper("allreduce") is None


@pytest.mark.slow  # the CLI on a Flax model's function, its updates compiled
def test_a_flax_models_function_gives_the_same_report_as_its_parameters(tmp_path):
  spec = "examples/plan_a_model.py:make_params"
  shapes_, about = user_model.load(os.path.join(ROOT, spec))
  names = ["allreduce", "bf16", "onebit_adam"]
  direct = planner.plan(shapes_, devices=64, gbits=[1], names=names, about=about)
  proc = subprocess.run([sys.executable, "-m", "jaxcomp.train", "--plan", "--model", spec,
                         "--devices", "64", "--gbits", "1", "--compressors", ",".join(names),
                         "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
  assert proc.returncode == 0, proc.stderr
  tables = lambda text: text.split("\nCompute:")[1].split("\nWhere each")[0]  # noqa: E731
  assert tables(proc.stdout).split(") and timed")[1] == tables(direct.text).split(
      ") and timed")[1]
  assert proc.stdout.startswith("Plan for make_params from examples/plan_a_model.py: 3,257,856")


def _plan_error(capsys, args):
  code = cli.main(["--plan", "--devices", "8", "--gbits", "1", "--compressors", "allreduce"]
                  + args)
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1, err
  return err


def test_a_model_function_that_fails_gives_one_line(capsys, tmp_path):
  (tmp_path / "models.py").write_text(
      "def boom():\n  raise RuntimeError('no weights here')\n\n"
      "def needs(width):\n  return width\n\ndef ints():\n  return {'n': 3}\n")
  path = tmp_path / "models.py"
  err = _plan_error(capsys, ["--model", f"{path}:boom"])
  assert "--model" in err and "boom() raised RuntimeError: no weights here; fix the function" in err
  err = _plan_error(capsys, ["--model", f"{path}:needs"])
  assert "it must take no arguments and return the model's parameters" in err
  err = _plan_error(capsys, ["--model", f"{path}:missing"])
  assert "has no function missing; name a function of no arguments" in err
  err = _plan_error(capsys, ["--model", f"{path}:ints"])
  assert "returned no floating-point arrays" in err
  err = _plan_error(capsys, ["--model", f"{tmp_path}/nowhere.py:make_params"])
  assert "no such file" in err


def test_an_out_folder_that_cannot_be_written_gives_one_line(capsys, tmp_path):
  (tmp_path / "a_file").write_text("")
  with pytest.raises(SystemExit) as exit_info:
    cli.parse_args(["--plan", "--model", "gpt2-small", "--out", str(tmp_path / "a_file" / "x")])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.count("\n") == 1
  assert "--out" in err and "cannot write there" in err and "give a folder you can write" in err
