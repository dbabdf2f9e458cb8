"""The planner (``python -m jaxcomp.train --plan``): its byte counts against the compiled step,
its arithmetic against hand-computed cases, its presets, its measurements' sources, its command
line."""

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
from jaxcomp.train import cli, measured, network, planner, registry, shapes, tasks, wire
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


def test_an_entry_without_a_formula_is_not_computed_and_says_so(monkeypatch):
  new = registry.Compressor("new_entry", "an entry added after the planner", lambda **kw: None)
  monkeypatch.setitem(registry.REGISTRY, "new_entry", new)
  assert wire.messages("new_entry", CHARS, 8) is None
  # A known algorithm with a setting the formula does not read is not guessed either.
  odd = registry.Compressor("odd_dgc", "DGC in buckets", registry.REGISTRY["dgc"].factory,
                            {"ratio": 0.01, "bucket_cap_mb": 1.0})
  monkeypatch.setitem(registry.REGISTRY, "odd_dgc", odd)
  assert wire.messages("odd_dgc", CHARS, 8) is None
  result = planner.plan(CHARS, devices=8, gbits=[1], names=["allreduce", "new_entry"])
  row = {r.name: r for r in result.rows}["new_entry"]
  assert row.sent is None and row.step_ms == {}
  assert "| new_entry | not computed without compiling | - | not measured |" in result.text


def test_crossover_on_a_hand_computed_case():
  # W = 2, α = 0: an all-reduce of N bytes takes N/β (recursive doubling's one exchange). Allreduce:
  # 100 steps of 0.1 s + 4e8/β; the compressor: 1.2 x the steps, a step 1.5 x as long, 4e6 bytes.
  # 10 + 4e10/β = 18 + 4.8e8/β at β = 4.94e9 B/s = 39.52 Gbit/s; below it the compressor wins.
  base = [(100, 1.0, [("all-reduce", 4e8, 1.0)])]
  mine = [(120, 1.5, [("all-reduce", 4e6, 1.0)])]
  kind, gbits = planner.crossover(mine, base, 0.1, world=2, alpha=0.0)
  assert kind == "below" and gbits == pytest.approx(39.52, rel=1e-9)
  assert planner.seconds(mine, 0.1, 2, 0.0, 39.52) == pytest.approx(
      planner.seconds(base, 0.1, 2, 0.0, 39.52), rel=1e-9)
  # Slower compute and no fewer bytes: never; fewer bytes and no slower: always.
  assert planner.crossover([(100, 1.5, base[0][2])], base, 0.1, 2, 0.0) == ("never", None)
  assert planner.crossover([(100, 1.0, mine[0][2])], base, 0.1, 2, 0.0) == ("always", None)


def test_the_projection_is_compute_times_ratio_plus_the_alpha_beta_model():
  # quantized_int8 has no warm-up: its time to target is steps ratio x its step over allreduce's.
  result = planner.plan(model="gpt2-small", devices=64, gbits=[25], step_ms=100.0)
  rows = {r.name: r for r in result.rows}
  data = measured.load()
  run, outcome = measured.steps_to_target(data, "quantized_int8")
  tree = shapes.gpt2()
  beta = network.gbits_to_beta(25)

  def comm(name):
    return sum(s * network.comm_time([(op, b)], 64, network.ALPHA, beta)
               for op, b, s in wire.operands(wire.messages(name, tree, 64), 64))

  ratio = data["step_time"]["ratios"]["quantized_int8"]
  step = 0.1 * ratio + comm("quantized_int8")
  assert rows["quantized_int8"].step_ms[25] == pytest.approx(1e3 * step, rel=1e-12)
  assert rows["quantized_int8"].overhead_ms == pytest.approx(100 * (ratio - 1), rel=1e-12)
  assert rows["quantized_int8"].to_target[25] == pytest.approx(
      outcome["steps"] / run["base_steps"] * step / (0.1 + comm("allreduce")), rel=1e-12)
  # The ring column is the ring formula alone: 2(W-1)(α + N/(Wβ)) for allreduce's one buffer.
  n = 4 * 124_439_808
  assert rows["allreduce"].comm_ms[25]["ring"] == pytest.approx(
      1e3 * 2 * 63 * (network.ALPHA + n / (64 * beta)), rel=1e-12)
  assert rows["allreduce"].comm_ms[25]["doubling"] == pytest.approx(  # ⌈log2 64⌉ (α + N/β)
      1e3 * 6 * (network.ALPHA + n / beta), rel=1e-12)
  assert rows["allreduce"].sent == pytest.approx(2 * 63 / 64 * n)
  # At the per-step crossover the projected steps take as long as allreduce's.
  kind, g = rows["powersgd_r4"].crossover_step
  assert kind == "below"
  at = planner.plan(model="gpt2-small", devices=64, gbits=[g], step_ms=100.0,
                    names=["powersgd_r4"])
  at_rows = {r.name: r for r in at.rows}
  assert at_rows["powersgd_r4"].step_ms[g] == pytest.approx(at_rows["allreduce"].step_ms[g],
                                                            rel=1e-6)


def test_entries_without_measurements_say_not_measured():
  data = measured.load()
  names = ["dion_r8", "demo"]  # as if their step had not been measured
  data["step_time"]["ratios"] = {n: r for n, r in data["step_time"]["ratios"].items()
                                 if n not in names}
  result = planner.plan(model="gpt2-small", devices=64, gbits=[25], data=data)
  rows = {r.name: r for r in result.rows}
  assert list(rows) == list(registry.REGISTRY)  # every entry, in the registry's order
  assert rows["dion_r4"].step_ratio is not None
  for name in names:
    assert rows[name].step_ratio is None and rows[name].step_ms == {}
    assert f"| {name} | " in result.text and "not measured" in result.text
    assert rows[name].sent is not None  # their bytes are known all the same


def test_the_plan_of_a_flax_models_parameters():
  result = planner.plan(CHARS, devices=16, gbits=(1, 100), step_ms=2.5,
                        names=["powersgd_r4", "dion_r4"], about="the chars transformer")
  assert [r.name for r in result.rows] == ["allreduce", "bf16", "powersgd_r4", "dion_r4"]
  assert result.params == 120_704 and result.world == 16
  assert "2.5 ms, your measurement (--step-ms)" in result.text
  assert result.text.count("per worker (α-β model, W = 16") == 2  # a table per link speed
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
  result = planner.plan(tree, devices=8, gbits=[1], names=[], about=about)
  assert result.text.startswith(f"Plan for {about}: {n:,} parameters")


def test_the_presets_are_the_benchmarks_shapes():
  common = pytest.importorskip("benchmarks.common")
  pairs = ((shapes.resnet50(), common.resnet50()), (shapes.gpt2(), common.gpt2_small()))
  for mine, theirs in pairs:
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    assert jax.tree.leaves(mine) == jax.tree.leaves(theirs)


def test_every_measurement_is_dated_and_says_where_it_comes_from():
  data = measured.load()
  for source in [data["step_time"]] + data["steps_to_target"]:
    assert {"command", "date", "source", "model", "devices"} <= set(source), source
    assert len(source["date"].split("-")) == 3
  # The step ratios are BENCHMARKS.md's table: rerunning it there means regenerating the file
  # (python -m jaxcomp.train.measured --step-time BENCHMARKS.md).
  ratios = measured.from_step_time(os.path.join(ROOT, "BENCHMARKS.md"))["ratios"]
  assert data["step_time"]["ratios"] == ratios


def test_a_runs_results_become_a_steps_to_target_source(tmp_path):
  evals = [(0, 3.0, 0.0)] + [(t, 3.0 - 0.1 * t, 0.1) for t in range(1, 9)]
  fast = Run("allreduce", 8, [(0, "a")], {"a": 1.0}, 1.0, "", losses=[1.0] * 8,
             evals=evals, step_seconds=[1.0] * 8)
  slow = Run("bf16", 8, [(0, "a")], {"a": 1.0}, 1.0, "", losses=[1.0] * 8,
             evals=[(0, 3.0, 0.0)] + [(t, 3.0 - 0.05 * t, 0.1) for t in range(1, 9)],
             step_seconds=[2.0] * 8)
  out = {"command": "python -m jaxcomp.train --quick", "task": "chars", "steps": 8, "devices": 2,
         "runs": [vars(fast), vars(slow)]}
  (tmp_path / "results.json").write_text(json.dumps(out))
  (tmp_path / "results.md").write_text("`cmd`\n\ntask chars (120,704 parameters), 8 steps\n")
  run = measured.from_job(str(tmp_path / "results.json"))
  assert run["outcomes"] == {"allreduce": {"steps": 8}, "bf16": {"not_in": 8}}
  assert run["step_ratios"] == {"allreduce": 1.0, "bf16": 2.0}
  assert run["model"] == "chars transformer (120,704 parameters)" and run["base_steps"] == 8
  data = measured.load()
  data["steps_to_target"].insert(0, run)
  row = {r.name: r for r in planner.plan(CHARS, devices=8, gbits=[1], data=data).rows}["bf16"]
  assert row.steps_bound and row.steps_ratio == 1.0 and row.steps_source == "J1"


def test_the_plan_command_runs_in_seconds(tmp_path):
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "jaxcomp.train", "--plan", "--model", "gpt2-small",
                         "--devices", "64", "--gbits", "25", "--out", str(tmp_path)], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                        timeout=120)
  took = time.perf_counter() - start
  assert proc.returncode == 0, proc.stderr
  assert took < 60  # the goal, on CPU; a few seconds here
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("Plan for GPT-2 small (") and "124,439,808 parameters" in lines[0]
  assert "W = 64 data-parallel devices, links of 25 Gbit/s per worker" in lines[0]
  for name in registry.REGISTRY:
    assert sum(line.startswith(f"| {name} |") for line in lines) == 2, name  # in both tables
  assert "| allreduce | 980.0 MB | 1.0x | 1.00 |" in proc.stdout
  assert (tmp_path / "plan.png").stat().st_size > 0
  assert (tmp_path / "plan.md").read_text().startswith(
      "`python -m jaxcomp.train --plan --model gpt2-small --devices 64 --gbits 25")


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt2-small"], "--model is an option of --plan"),
    (["--step-ms", "20"], "--step-ms is an option of --plan"),
    (["--plan"], "--plan needs --model (resnet50, gpt2-small, gpt2-medium, llama3.2-1b, "
                 "llama2-7b) or --params N"),
    (["--plan", "--model", "gpt2-small", "--params", "1e9"], "or --params N, not both"),
    (["--plan", "--model", "gpt3"], "argument --model: invalid choice: 'gpt3'"),
    (["--plan", "--params", "many"], "--params: a parameter count from 1e+07 to 1e13"),
    (["--plan", "--params", "1000"], "--params: a parameter count from 1e+07 to 1e13"),
    (["--plan", "--model", "gpt2-small", "--step-ms", "0"],
     "--step-ms must be a positive number of milliseconds; got 0"),
    (["--plan", "--model", "gpt2-small", "--devices", "1"],
     "--devices must be at least 2 for --plan; got 1"),
    (["--plan", "--model", "gpt2-small", "--gbits", "0"], "--gbits: link speeds must be positive"),
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
  assert cli.parse_count("350M") == 350_000_000 and cli.parse_count("124,439,808") == 124_439_808
