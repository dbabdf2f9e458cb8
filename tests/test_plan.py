"""The planner (``python -m jaxcomp.train --plan``): its byte counts against the compiled step,
its arithmetic against hand-computed cases, its presets, its measurements' sources, its command
line. The compute model: ``tests/test_plan_compute.py``; the recommendation, the evidence and bad
input: ``tests/test_plan_recommend.py``."""

import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from jaxcomp import comm_report
from jaxcomp.train import (cli, devices, measured, network, planner, registry, shapes, step_cost,
                           tasks, wire)
from jaxcomp.train.runs import Run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AXIS = "batch"


def _chars_shapes(**size):
  """The main job's transformer class (Flax attention's 3-D kernels, embeddings, norms): shapes."""
  model = tasks.CharTransformer(**size)
  tokens = jax.ShapeDtypeStruct((1, model.context), jnp.int32)
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


CHARS = _chars_shapes(**tasks.CHARS_SIZES["small"])  # the job's own: 120,704 parameters
TINY = _chars_shapes(vocab=32, context=8, width=16, depth=1, heads=2)  # 4,496: compiles fast


def _stacked(tree, n):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + tuple(x.shape), x.dtype), tree)


def _compiled_bytes_by_op(name, tree, world, **settings):
  """``{op: payload bytes per steady step}`` of entry ``name``'s update compiled under pmap over
  ``world`` devices (bf16 read before optimisation: XLA:CPU widens it), as benchmarks/bytes.py."""
  entry = registry.REGISTRY[name]
  inner = {"inner": entry.plainest_inner(0.1)} if entry.wraps_optimizer else {}
  tx = entry.make(AXIS, **inner, **settings)
  state = _stacked(jax.eval_shape(tx.init, tree), world)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS,
                  devices=jax.devices()[:world])
  grads = _stacked(tree, world)
  report = comm_report(step, grads, state, grads, num_devices=world,
                       stage="lowered" if name == "bf16" else "compiled")
  out = {}
  for c in report.collectives:
    out[c.op] = out.get(c.op, 0.0) + c.payload_bytes * c.share
  return out


def _check_bytes(name, tree, world, **settings):
  expected = _compiled_bytes_by_op(name, tree, world, **settings)
  counted = wire.bytes_by_op(wire.messages(name, tree, world, settings))
  assert counted == pytest.approx(expected, rel=1e-12), (name, world)


# Each one compile of the update (a second or two on an idle machine) on a small transformer of
# the job's class; the slow tier checks every entry on the job's own transformer, and
# benchmarks/bytes.py the same formulas at ResNet-18, ResNet-50 and GPT-2 small shapes.
@pytest.mark.parametrize("name", ["allreduce", "bf16", "powersgd_r4", "dgc_exact_fp16",
                                  "quantized_int8", "quantized_int2", "onebit_adam",
                                  "streaming_diloco_h20_p2", "muloco", "desloc", "dion_r4"])
def test_planner_bytes_equal_the_compiled_steps(name):
  _check_bytes(name, TINY, 8)


@pytest.mark.parametrize("name", ["dgc", "sign"])
def test_bytes_that_grow_with_w_are_counted_for_the_ws_given(name):
  _check_bytes(name, TINY, 4)


def test_hooks_bytes_per_ddp_bucket():
  # A small cap makes several buckets; one finiteness flag covers them all.
  assert len(wire.ddp_buckets(wire.leaves(TINY), 0.004)) > 2
  _check_bytes("hook_powersgd_r2", TINY, 8, bucket_cap_mb=0.004)


@pytest.mark.slow  # every entry, each a compile
@pytest.mark.parametrize("name", [n for n in registry.REGISTRY if wire.formula(n) is not None])
def test_every_entrys_bytes_equal_the_compiled_step_on_the_jobs_transformer(name):
  _check_bytes(name, CHARS, 8)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dgc_exact_fp16", "quantized_int8", "onebit_adam", "demo",
                                  "streaming_diloco_h100_p4_int8", "sparseloco_h30"])
def test_bytes_that_grow_with_w_on_the_jobs_transformer(name):
  _check_bytes(name, CHARS, 4)


def test_an_entry_without_a_formula_or_a_program_says_so(monkeypatch):
  new = registry.Compressor("new_entry", "an entry added after the planner", lambda **kw: None)
  monkeypatch.setitem(registry.REGISTRY, "new_entry", new)
  assert wire.messages("new_entry", CHARS, 8) is None
  # A known algorithm with a setting the formula does not read is not guessed either.
  odd = registry.Compressor("odd_dgc", "DGC in buckets", registry.REGISTRY["dgc"].factory,
                            {"ratio": 0.01, "bucket_cap_mb": 1.0})
  monkeypatch.setitem(registry.REGISTRY, "odd_dgc", odd)
  assert wire.messages("odd_dgc", CHARS, 8) is None
  result = planner.plan(TINY, devices=8, gbits=[1], names=["allreduce", "new_entry"])
  row = result.row("new_entry")
  assert row.sent is None and row.update_ms is None and row.step_ms == {}
  assert "AttributeError" in row.compute_error  # None has no init: it did not compile
  assert "| new_entry | no formula | - | not compiled |" in result.text
  assert ("new_entry", "its update did not compile") in result.recommendations[1.0].not_ranked


def test_crossover_on_a_hand_computed_case():
  # W = 2, α = 0: an all-reduce of N bytes takes N/β (recursive doubling's one exchange). Allreduce:
  # 100 steps of 0.1 s + 4e8/β; the compressor: 120 steps of 0.15 s + 4e6/β, no overlap.
  # 10 + 4e10/β = 18 + 4.8e8/β at β = 4.94e9 B/s = 39.52 Gbit/s; below it the compressor wins.
  base = [(100, 0.1, [("all-reduce", 4e8, 1.0)], None)]
  mine = [(120, 0.15, [("all-reduce", 4e6, 1.0)], None)]
  kind, gbits = step_cost.crossover(mine, base, world=2, alpha=0.0)
  assert kind == "below" and gbits == pytest.approx(39.52, rel=1e-9)
  assert step_cost.seconds(mine, 2, 0.0, 39.52, 0.0) == pytest.approx(
      step_cost.seconds(base, 2, 0.0, 39.52, 0.0), rel=1e-9)
  # Slower compute and no fewer bytes: never; fewer bytes and no slower: always.
  assert step_cost.crossover([(100, 0.15, base[0][2], None)], base, 2, 0.0) == ("never", None)
  assert step_cost.crossover([(100, 0.1, mine[0][2], None)], base, 2, 0.0) == ("always", None)
  # The overlap credit: a dense mean hides behind the backward pass up to its length.
  ops = [("all-reduce", 4e8, 1.0)]
  beta = network.gbits_to_beta(39.52)
  assert step_cost.hidden(0.1, ops, 2, 0.0, beta, "backward", 0.05) == pytest.approx(0.05)
  assert step_cost.hidden(0.1, ops, 2, 0.0, beta * 100, "backward", 0.05) == pytest.approx(
      4e8 / (beta * 100))
  assert step_cost.hidden(0.1, ops, 2, 0.0, beta, None, 0.05) == 0.0
  # Streaming DiLoCo: each piece (share 1/H) hides behind one inner step.
  pieces = [("all-reduce", 4e8, 0.05), ("all-reduce", 4e6, 0.05)]
  assert step_cost.hidden(0.01, pieces, 2, 0.0, beta, "inner step", 0.0) == pytest.approx(
      0.05 * 0.01 + 0.05 * 4e6 / beta)


def test_the_projection_is_compute_plus_the_alpha_beta_model_less_the_overlap():
  # quantized_int8 has no warm-up: its time to target is steps ratio x its step over allreduce's.
  result = planner.plan(TINY, devices=64, gbits=[25], step_ms=0.5, device="h100",
                        names=["quantized_int8"])
  h100 = devices.get("h100")
  data = measured.load()
  run, outcome = measured.steps_to_target(data, "quantized_int8")
  beta = network.gbits_to_beta(25)

  def comm(name):
    return network.step_time(wire.operands(wire.messages(name, TINY, 64), 64), 64,
                             network.ALPHA, beta)

  int8, base = result.row("quantized_int8"), result.row("allreduce")
  assert int8.update_ms > base.update_ms > 0
  assert int8.overhead_ms == pytest.approx(int8.update_ms - base.update_ms)
  step = 0.5e-3 + int8.update_ms / 1e3 + comm("quantized_int8")
  assert int8.step_ms[25] == pytest.approx(1e3 * step, rel=1e-12)
  assert int8.step_credit_ms[25] == int8.step_ms[25]  # the 8-bit exchange hides nothing
  base_step = 0.5e-3 + base.update_ms / 1e3 + comm("allreduce")
  hidden = min(comm("allreduce"), step_cost.BACKWARD * 0.5e-3)
  assert base.step_credit_ms[25] == pytest.approx(1e3 * (base_step - hidden), rel=1e-12)
  ratio = outcome["steps"] / run["base_steps"]
  assert int8.to_target[25] == pytest.approx(ratio * step / base_step, rel=1e-12)
  assert int8.to_target_credit[25] == pytest.approx(ratio * step / (base_step - hidden),
                                                    rel=1e-12)
  # The ring column is the ring formula alone: 2(W-1)(α + N/(Wβ)) for allreduce's one buffer.
  n = 4 * sum(math.prod(s) for _, s in wire.leaves(TINY))
  assert base.comm_ms[25]["ring"] == pytest.approx(
      1e3 * 2 * 63 * (network.ALPHA + n / (64 * beta)), rel=1e-12)
  assert base.sent == pytest.approx(2 * 63 / 64 * n)
  assert result.device is h100 and result.device_gib == 80


def test_entries_without_measurements_say_not_measured():
  result = planner.plan(TINY, devices=64, gbits=[25], names=["dion_r4"])
  row = result.row("dion_r4")
  assert row.points == [] and row.steps_ratio is None and row.to_target == {}
  assert row.sent is not None and row.update_ms is not None  # bytes and compute are known
  assert "| dion_r4 | not measured |" in result.text  # the evidence table
  assert ("dion_r4", "steps to target not measured") in result.recommendations[25.0].not_ranked


def test_the_plan_of_a_flax_models_parameters():
  result = planner.plan(TINY, devices=16, gbits=(1, 100), step_ms=2.5, device="a100",
                        names=["quantized_int8"], about="the chars transformer")
  assert [r.name for r in result.rows] == ["allreduce", "bf16", "quantized_int8"]
  assert result.params == 4_496 and result.world == 16
  assert "2.5 ms, your measurement (--step-ms)" in result.text
  assert result.text.count("per worker (α-β model, W = 16") == 2  # a table per link speed
  assert result.text.startswith("Plan for the chars transformer: 4,496 parameters")
  assert "NVIDIA A100" in result.text.split("\n")[0]
  fig = result.figure()
  assert [ax.get_xscale() for ax in fig.axes[:2]] == ["log", "log"]


def test_presets_have_their_published_parameter_counts():
  counts = {name: sum(math.prod(x.shape) for x in jax.tree.leaves(m.build()))
            for name, m in shapes.MODELS.items()}
  assert counts == {"resnet50": 25_557_032, "gpt2-small": 124_439_808,
                    "gpt2-medium": 354_823_168, "llama3.2-1b": 1_235_814_400,
                    "llama2-7b": 6_738_415_616}
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(
      shapes.MODELS["llama2-7b"].build()))  # shapes only: nothing allocated
  tree, about = shapes.transformer(350_000_000)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  assert abs(n - 350e6) / 350e6 < 0.02 and "about 350,000,000 parameters" in about


def test_the_presets_are_the_benchmarks_shapes():
  common = pytest.importorskip("benchmarks.common")
  pairs = ((shapes.resnet50(), common.resnet50()), (shapes.gpt2(), common.gpt2_small()))
  for mine, theirs in pairs:
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    assert jax.tree.leaves(mine) == jax.tree.leaves(theirs)


def test_every_measurement_is_dated_and_says_where_it_comes_from():
  data = measured.load()
  assert "step_time" not in data  # the compute comes from compiled programs, not CPU ratios
  for source in data["steps_to_target"]:
    assert {"command", "date", "source", "model", "devices", "params", "tokens"} <= set(source)
    assert len(source["date"].split("-")) == 3
  assert isinstance(data["scaling"], list)


def test_a_runs_results_become_a_steps_to_target_source(tmp_path):
  evals = [(0, 3.0, 0.0)] + [(t, 3.0 - 0.1 * t, 0.1) for t in range(1, 9)]
  fast = Run("allreduce", 8, [(0, "a")], {"a": 1.0}, 1.0, "", losses=[1.0] * 8,
             evals=evals, step_seconds=[1.0] * 8)
  slow = Run("bf16", 8, [(0, "a")], {"a": 1.0}, 1.0, "", losses=[1.0] * 8,
             evals=[(0, 3.0, 0.0)] + [(t, 3.0 - 0.05 * t, 0.1) for t in range(1, 9)],
             step_seconds=[2.0] * 8)
  out = {"command": "python -m jaxcomp.train --quick", "task": "chars", "steps": 8, "devices": 2,
         "batch_size": 32, "runs": [vars(fast), vars(slow)]}
  (tmp_path / "results.json").write_text(json.dumps(out))
  (tmp_path / "results.md").write_text("`cmd`\n\ntask chars (120,704 parameters), 8 steps\n")
  run = measured.from_job(str(tmp_path / "results.json"))
  assert run["outcomes"] == {"allreduce": {"steps": 8}, "bf16": {"not_in": 8}}
  assert run["model"] == "chars transformer (120,704 parameters)" and run["base_steps"] == 8
  assert (run["params"], run["tokens"]) == (120_704, 8 * 32 * 64)
  assert run["losses"] == {"allreduce": round(fast.final[0], 4), "bf16": round(slow.final[0], 4)}
  data = measured.load()
  data["steps_to_target"].insert(0, run)
  result = planner.plan(TINY, devices=8, gbits=[1], data=data, names=[])
  row = result.row("bf16")
  assert row.steps_bound and row.steps_ratio == 1.0 and row.steps_source == "J1"
  assert row.points[-1].gap == pytest.approx(run["losses"]["bf16"] / run["losses"]["allreduce"] - 1)


@pytest.mark.slow  # every entry's update compiled at GPT-2 small's shapes (a cache makes it fast)
def test_the_plan_command_for_gpt2_small(tmp_path):
  command = [sys.executable, "-m", "jaxcomp.train", "--plan", "--model", "gpt2-small",
             "--devices", "64", "--gbits", "25", "--device", "h100", "--out", str(tmp_path)]
  start = time.perf_counter()
  proc = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=1800)
  cold = time.perf_counter() - start
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("Plan for GPT-2 small (") and "124,439,808 parameters" in lines[0]
  assert lines[2].startswith("Recommendation at 25 Gbit/s per worker: **")
  for name in registry.REGISTRY:
    assert sum(line.startswith(f"| {name} |") for line in lines) == 3, name  # in three tables
  assert "| allreduce | 980.0 MB | 1.0x |" in proc.stdout
  assert "from a CPU" not in proc.stdout and "[S]" not in proc.stdout
  assert (tmp_path / "plan.png").stat().st_size > 0
  assert (tmp_path / "plan.md").read_text().startswith(
      "`python -m jaxcomp.train --plan --model gpt2-small --devices 64 --gbits 25 --device h100")
  start = time.perf_counter()  # again, its compiles cached
  again = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and again.stdout.split("\nCompute:")[0] == proc.stdout.split(
      "\nCompute:")[0]
  assert time.perf_counter() - start < 60, cold  # the goal is under 60 s with the compiles: cold


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt2-small"], "--model is an option of --plan"),
    (["--step-ms", "20"], "--step-ms is an option of --plan"),
    (["--device", "h100"], "--device is an option of --plan"),
    (["--plan"], "--plan needs --model (resnet50, gpt2-small, gpt2-medium, llama3.2-1b, "
                 "llama2-7b, or module:function) or --params N"),
    (["--plan", "--model", "gpt2-small", "--params", "1e9"], "or --params N, not both"),
    (["--plan", "--model", "gpt3"], "--model: unknown model 'gpt3'; choose from resnet50"),
    (["--plan", "--params", "many"], "--params: a parameter count from 1e+07 to 1e13"),
    (["--plan", "--params", "1000"], "--params: a parameter count from 1e+07 to 1e13"),
    (["--plan", "--model", "gpt2-small", "--step-ms", "0"],
     "--step-ms must be a positive number of milliseconds; got 0"),
    (["--plan", "--model", "gpt2-small", "--devices", "1"],
     "--devices must be at least 2 for --plan; got 1"),
    (["--plan", "--model", "gpt2-small", "--gbits", "0"], "--gbits: link speeds must be positive"),
    (["--plan", "--model", "gpt2-small", "--device-gib", "-1"],
     "--device-gib must be a positive number of GiB per device (e.g. 80); got -1"),
    (["--plan", "--model", "gpt2-small", "--device", "h1000"],
     "--device: unknown device 'h1000'; choose from h100, h200, a100, b200, tpu-v5e, tpu-v5p, "
     "this-cpu"),
    (["--plan", "--model", "gpt2-small", "--steps", "10"], "--steps does not apply to --plan"),
    (["--plan", "--model", "gpt2-small", "--link", "1gbit"], "--link does not apply to --plan"),
    (["--plan", "--model", "gpt2-small", "--from-run", "/no/such/results.json"],
     "--from-run: no such file: /no/such/results.json"),
    (["--plan", "--model", "gpt2-small", "--compressors", "topk"], "unknown compressor 'topk'"),
])
def test_bad_plan_arguments_give_one_line_and_exit_2(capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    cli.parse_args(args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err
  assert err.count("\n") == 1, err


def test_plan_arguments():
  args = cli.parse_args(["--plan", "--params", "1.3B", "--devices", "128", "--gbits", "10,100"])
  assert (args.params, args.devices, args.gbits) == (1_300_000_000, 128, (10.0, 100.0))
  assert args.compressors == list(registry.REGISTRY)  # every entry unless told
  assert args.device == "h100"  # the default accelerator
  assert cli.parse_count("350M") == 350_000_000 and cli.parse_count("124,439,808") == 124_439_808
