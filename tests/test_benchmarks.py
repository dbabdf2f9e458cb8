"""The benchmark scripts in quick mode (so they cannot rot), and the pieces they are built from.

Each script runs in its own process with ``--quick`` (small shapes, few repeats); the tests check
that it prints its table with a row per compressor, that the wire bytes equal the algorithm's
minimum exactly, and that a quick run leaves BENCHMARKS.md alone. No timing is asserted.
"""

import os
import subprocess
import sys

import pytest

from benchmarks import common
from jaxcomp.train import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = [c.name for c in common.compressors()]


def run_script(name, *args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  before = _read(common.BENCHMARKS_MD)
  script = os.path.join(ROOT, "benchmarks", name)
  result = subprocess.run([sys.executable, script, "--quick", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert _read(common.BENCHMARKS_MD) == before, f"{name} --quick changed BENCHMARKS.md"
  return result.stdout


def _read(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return f.read()


def table_rows(text):
  """The data rows of the first Markdown table in ``text``, as lists of cells."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("|"))
  end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
  rows = [line.strip().strip("|").split("|") for line in lines[start:end]]
  return [[c.strip() for c in r] for r in rows[2:]]


def test_the_benchmarks_compare_the_registry_default():
  assert ALL == list(registry.DEFAULT)


def test_all_is_every_registry_entry():
  assert [c.name for c in common.compressors("all")] == list(registry.REGISTRY)


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_bytes_equal_the_algorithms_minimum():
  rows = table_rows(run_script("bytes.py"))
  assert sorted(r[2] for r in rows) == sorted(ALL + list(registry.PERIODIC))
  for row in rows:
    assert row[6] == "1.00", row
    assert row[4] == row[5], row  # exactly the minimum, not just to two decimals


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_bytes_of_the_8_bit_and_1_bit_compressors_equal_their_minimum():
  names = ["quantized_int8", "quantized_fp8", "sign", "onebit_adam"]
  rows = table_rows(run_script("bytes.py", "--compressors", ",".join(names)))
  assert [r[2] for r in rows] == names
  for row in rows:
    assert row[4] == row[5] and row[6] == "1.00", row
    assert "all-reduce" not in row[8]  # no finiteness flag: it is read from the scales they send


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_compute_against_torch():
  pytest.importorskip("torch")
  rows = table_rows(run_script("compute_vs_torch.py"))
  assert [r[1] for r in rows] == ["fp16", "powersgd_r1", "powersgd_r4",
                                  "dgc selection (sampled)", "lax.top_k"]
  assert all(float(r[5]) > 0 for r in rows)


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_step_time():
  # A subset: each compressor compiles a whole 8-device training step (bytes.py and memory.py
  # compile every compressor's update).
  names = ["allreduce", "powersgd_r1", "dgc"]
  rows = table_rows(run_script("step_time.py", "--compressors", ",".join(names)))
  assert [r[1] for r in rows] == names
  assert rows[0][4] == "1.00"


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_step_time_of_the_wrappers_of_the_optimizer():
  names = ["allreduce", "local_sgd_h8", "streaming_diloco_h20_p2"]
  rows = table_rows(run_script("step_time.py", "--compressors", ",".join(names)))
  assert [r[1] for r in rows] == names


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_step_time_in_a_plain_pmap_loop():
  names = ["allreduce", "powersgd_r1", "onebit_adam", "diloco_h20"]
  out = run_script("step_time.py", "--compressors", ",".join(names), "--loop", "pmap")
  rows = table_rows(out)
  assert [r[1] for r in rows] == names and rows[0][4] == "1.00"
  assert "a plain `jax.pmap` loop, nothing donated" in out


def test_a_variant_is_measured_under_its_own_name_with_its_settings():
  rows = table_rows(run_script("memory.py", "--no-sharded", "--variant",
                               "dion_r16=dion_r8,rank=16", "--compressors", "dion_r8,dion_r16"))
  assert [r[1] for r in rows] == ["allreduce", "dion_r8", "dion_r16"]
  by_name = {r[1]: r for r in rows}
  assert float(by_name["dion_r16"][4]) > float(by_name["dion_r8"][4])  # twice the P and Q columns
  p = common.parser("a benchmark")
  common.add_variant_option(p)
  args = common.parse(p, ["--variant", "dion_r16=dion_r8,rank=16", "--compressors", "dion_r16"])
  assert common.compressors(args.compressors, args.variant)[0].settings["rank"] == 16
  assert "dion_r16" not in registry.REGISTRY
  with pytest.raises(SystemExit, match="--variant dion_r16 is not in --compressors"):
    common.compressors("dion_r8", args.variant)
  with pytest.raises(SystemExit):  # argparse's exit: the message goes to stderr
    common.parse(p, ["--variant", "d=dion_r8,rank=16", "--compressors", "d", "--write"])


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_memory_of_every_registry_entry():
  rows = table_rows(run_script("memory.py", "--compressors", "all"))
  assert [r[1] for r in rows] == list(registry.REGISTRY)
  by_name = {r[1]: r for r in rows}
  assert float(by_name["diloco_h20"][4]) >= 1.0  # DiLoCo keeps the parameters it averages


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_memory():
  rows = table_rows(run_script("memory.py"))
  assert [r[1] for r in rows] == ALL
  by_name = {r[1]: r for r in rows}
  assert by_name["allreduce"][4] == "0.00" and by_name["allreduce"][6] == "0.00"
  # Error feedback keeps one gradient-sized buffer per device; DGC keeps u and v.
  assert float(by_name["powersgd_r1"][4]) >= 1.0
  assert float(by_name["dgc"][4]) >= 1.9


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_scaling():
  rows = table_rows(run_script("scaling.py"))
  assert len(rows) == 2 and all(len(r) == 1 + len(ALL) for r in rows)


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_network_model():
  names = ["allreduce", "powersgd_r1", "dgc"]
  out = run_script("network_model.py", "--compressors", ",".join(names))
  rows = table_rows(out.split("Estimated step time")[1])
  assert len(rows) == 3 * 8  # 1, 10, 100 Gbit/s × W = 8 … 1024


@pytest.mark.slow
def test_slow_link_time_to_accuracy_against_torch():
  from jaxcomp.train import namespaces
  reason = namespaces.unavailable_reason()
  if reason:
    pytest.skip(f"no network namespaces here: {reason}")
  out = run_script("slow_link.py")
  goals = table_rows(out.split("**Goals**")[1])
  assert any("α-β model" in r[0] for r in goals)
  rows = table_rows(out.split("**Time to target.**")[1])
  assert [r[0] for r in rows] == ["allreduce", "fp16", "powersgd_r1"]
  assert rows[0][4].endswith("(1.00×)")  # allreduce's own wall-clock to its own target
  model = table_rows(out.split("**α-β model")[1])
  assert {r[0] for r in model} == {"allreduce", "fp16", "powersgd_r1"}
  assert all(float(r[-1]) > 0 for r in model)
  checks = table_rows(out.split("**End-to-end check**")[1])
  assert [r[0] for r in checks] == ["powersgd_r1", "fp16"]
  if "**Against torch" in out:
    torch_rows = table_rows(out.split("**Against torch")[1])
    assert {r[0] for r in torch_rows} == {"allreduce", "fp16", "powersgd_r1"}
    assert all(float(r[-1]) > 0 for r in torch_rows)


def test_alpha_beta_formulas():
  model = pytest.importorskip("benchmarks.network_model")
  beta, n = 1e9, 1e8
  # Bandwidth-bound all-reduce: the ring's 2(W−1)/W·N/β.
  assert model.allreduce_time(n, 8, 0.0, beta) == pytest.approx(2 * 7 / 8 * n / beta)
  # Latency-bound: recursive doubling's log2(W)·α beats the ring's 2(W−1)·α.
  assert model.allreduce_time(4, 1024, 1e-5, beta) == pytest.approx(10 * (1e-5 + 4 / beta))
  assert model.allgather_time(100, 4, 0.0, beta) == pytest.approx(3 * 100 / beta)
  # All-to-all: N/W to each of the W−1 others; on one medium every round moves W chunks of N/W.
  assert model.alltoall_time(800, 8, 1e-5, beta) == pytest.approx(7 * (1e-5 + 100 / beta))
  assert model.shared_medium_time([("all-to-all", 800, 1.0)], 8, 0.0, beta) == pytest.approx(
      7 * 800 / beta)
  # A reduce-scatter-style step's all-gather shrinks with W: each worker contributes a 1/W shard.
  shards = {"q": [("all-to-all", 800), ("all-gather", 100), ("all-reduce", 4)]}
  assert model.collectives_at("q", shards, 16) == [("all-to-all", 800), ("all-gather", 50),
                                                   ("all-reduce", 4)]
  assert model.allreduce_time(n, 1, 1.0, beta) == 0.0
  # One shared medium: the ring's 2(W−1) steps each move W chunks of N/W through one queue.
  assert model.shared_medium_time([("all-reduce", n, 1.0)], 4, 0.0, beta) == pytest.approx(
      6 * n / beta)
  assert model.shared_medium_time([("all-gather", 100, 1.0)], 4, 1e-5, beta) == pytest.approx(
      3 * (1e-5 + 400 / beta))
  assert model.shared_medium_time([("all-reduce", n, 1.0)], 1, 1.0, beta) == 0.0
  # A synchronization every 20 steps costs a twentieth of its time per step, on average.
  assert model.shared_medium_time([("all-reduce", n, 0.05)], 4, 1e-5, beta) == pytest.approx(
      0.05 * 6 * (1e-5 + n / beta))
  # A token bucket passes its first `burst` bytes of a step at once: the rate applies to the rest,
  # and a step that moves less than the bucket holds pays only the latency.
  assert model.shared_medium_time([("all-reduce", n, 1.0)], 4, 1e-5, beta,
                                   burst=n) == pytest.approx(6 * 1e-5 + 5 * n / beta)
  assert model.shared_medium_time([("all-gather", 100, 1.0), ("all-reduce", 4, 1.0)], 4, 1e-5, beta,
                                  burst=2000) == pytest.approx(9 * 1e-5)
  # ... on every step it runs on: a synchronization every 20 steps gets the whole bucket.
  assert model.shared_medium_time([("all-reduce", n, 0.05), ("all-reduce", n, 1.0)], 4, 0.0, beta,
                                  burst=n) == pytest.approx(1.05 * 5 * n / beta)
  # DGC sends the dense mean once W·density·2 >= 1, as jaxcomp.dgc does.
  measured = {"allreduce": [("all-reduce", 40)], "dgc": [("all-gather", 8), ("all-reduce", 4)]}
  assert model.collectives_at("dgc", measured, 256) == measured["dgc"]
  assert model.collectives_at("dgc", measured, 512) == [("all-reduce", 40), ("all-reduce", 4)]


def test_shape_pytrees_have_the_published_sizes():
  assert common.num_params(common.resnet18()) == 11_689_512
  assert common.num_params(common.resnet50()) == 25_557_032
  assert common.num_params(common.gpt2_small()) == 124_439_808
  resnet = common.resnet18()
  assert resnet["conv_init"]["kernel"].shape == (7, 7, 3, 64)  # Flax (kh, kw, in, out)
  assert resnet["fc"]["kernel"].shape == (512, 1000)  # Flax Dense (in, out)
  torch_resnet = common.torch_layout(resnet)
  assert torch_resnet["conv_init"]["kernel"].shape == (64, 3, 7, 7)
  assert torch_resnet["fc"]["kernel"].shape == (1000, 512)
  gpt = common.torch_layout(common.gpt2_small())
  assert gpt["wte"]["embedding"].shape == (50257, 768)  # embeddings keep their layout


def test_write_section_replaces_only_its_own_section(tmp_path):
  path = str(tmp_path / "BENCHMARKS.md")
  common.write_section("bytes", "Bytes", "cmd one", "first body", path)
  common.write_section("memory", "Memory", "cmd two", "memory body", path)
  common.write_section("bytes", "Bytes", "cmd three", "second body", path)
  text = _read(path)
  assert "second body" in text and "first body" not in text and "cmd three" in text
  assert "memory body" in text and text.count("<!-- BEGIN bytes -->") == 1
  assert text.index("BEGIN bytes") < text.index("BEGIN memory")  # the sections keep their order
  with pytest.raises(ValueError, match="key must be one of"):
    common.write_section("nope", "x", "y", "z", path)


def test_interleaved_ratio_is_per_round():
  calls = []
  times = common.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                             repeats=4, warmup=1)
  assert len(times["a"]) == len(times["b"]) == 4 and calls.count("a") == 5
  assert calls[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # the order rotates
  assert common.ratio({"x": [2.0, 9.0, 4.0], "y": [1.0, 3.0, 1.0]}, "x", "y") == 3.0


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_quality_on_a_transformer():
  # Few steps of the quick transformer, two entries: the columns are computed against allreduce.
  rows = {r[0]: r for r in table_rows(run_script("quality.py", "--compressors", "allreduce,fp16"))}
  assert list(rows) == ["allreduce", "fp16"]
  assert rows["allreduce"][2] == "1.000" and rows["allreduce"][5] == "1.0x"
  assert rows["allreduce"][3].endswith("(1.00x)")  # it reaches its own final loss
  assert float(rows["fp16"][2]) == pytest.approx(1.0, abs=0.01)
  assert rows["fp16"][5] == "2.0x"


def test_step_profile_assigns_instructions_to_phases():
  from benchmarks import step_profile
  phase = step_profile.phase_of
  assert phase("fusion", "jit(s)/shard_map/transpose(jvp())/dot_general") == "forward+backward"
  assert phase("fusion", "jit(s)/shard_map/jaxcomp.update/jaxcomp.encode/mul") == "encode"
  assert phase("fusion", "jit(s)/jaxcomp.update/cond/jaxcomp.decode/add") == "decode/mean"
  assert phase("add", "jit(s)/shard_map/jaxcomp.update/sub") == "compressor, rest"
  assert phase("fusion", "jit(s)/profile.optimizer/jaxcomp.update/mul") == "compressor, rest"
  assert phase("all-to-all", "jit(s)/jaxcomp.update/jaxcomp.encode/all_to_all") == "collectives"
  assert phase("all-gather-start", "") == "collectives"
  assert phase("conditional", "jit(s)/jaxcomp.update/cond") is None
  assert phase("copy", "") == "other"


def test_step_profile_counts_the_bytes_each_instruction_moves():
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415

  from benchmarks import step_profile  # noqa: PLC0415
  x = jnp.ones((8, 4096), jnp.float32)

  def moved(fn, *args, **jit):
    text = jax.jit(fn, **jit).lower(*args).compile().as_text()
    ops = step_profile.instructions(text)
    return {name: (ops[name][0], b) for name, b in step_profile.bytes_moved(text).items()}

  # A reduction reads all it is given.
  (op, b), = [v for v in moved(lambda x: x.sum(1), x).values() if v[0] in ("fusion", "reduce")]
  assert b == x.size * 4 + 8 * 4
  # A loop fusion computing one row of a larger expression reads that row (8 of them here).
  rows = moved(lambda x: [(x * 2)[i].astype(jnp.int8) for i in range(8)], x)
  assert sorted(b for op, b in rows.values() if op == "fusion") == [4096 * 4 + 4096] * 8
  # An update in place (donated) writes its update and reads what it is made of, not the buffer.
  updates = moved(lambda x, y, i: lax.dynamic_update_slice(x, y * 3, (i, 0)), x,
                  jnp.ones((1, 4096), jnp.float32), 3, donate_argnums=0)
  assert [b for op, b in updates.values()] == [2 * 4096 * 4 + 4]  # y read, its row written, i


@pytest.mark.slow  # a process of its own that imports JAX (3-8 s): no place in the fast tier
def test_step_profile_builds_the_steps_of_another_tree(tmp_path):
  # STEP_PROFILE_TREE (here links to this tree) builds the steps; this script's hlo_cost counts.
  for name in ("jaxcomp", "benchmarks"):
    os.symlink(os.path.join(ROOT, name), tmp_path / name)
  code = "import jaxcomp, step_profile as s; print(jaxcomp.__file__, s.step_time.__file__, " \
         "s.hlo_cost.__file__)"
  env = dict(os.environ, STEP_PROFILE_TREE=str(tmp_path), PYTHONPATH=f"{ROOT}/benchmarks")
  result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  library, step_time, counting = result.stdout.split()
  assert (library.startswith(str(tmp_path)) and step_time.startswith(str(tmp_path))
          and counting == os.path.join(ROOT, "jaxcomp", "train", "hlo_cost.py")), result.stdout


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_step_profile():
  out = run_script("step_profile.py", "--compressors", "quantized_int8", "--top", "3")
  assert "jaxcomp.error_feedback/" in out.split("move most of each entry's own passes")[1], out
  rows = {r[0]: r[1:] for r in table_rows(out)}
  assert out.splitlines()[next(i for i, l in enumerate(out.splitlines()) if l.startswith("|"))] \
      .split("|")[2:4] == [" allreduce ", " quantized_int8 "]
  for phase in ("forward+backward", "collectives", "encode", "error feedback", "rows layout",
                "optimizer"):
    assert float(rows[phase][1].split()[0]) > 0, (phase, out)
  # int8 reads whether the gradient is finite from the scales it sends: no gate of its own.
  assert "non-finite gate" not in rows or float(rows["non-finite gate"][1].split()[0]) == 0, out
  assert rows["step / allreduce"][0] == "1.00"
  # The bytes moved: the mean's all-reduce reads the gradient and writes the sum; int8's
  # collectives move codes (a quarter of float32 each way, and the scales); error feedback reads
  # and writes the errors, a pass each at least (3.16 when measured, the rows now a reshape of
  # the leaves where they can be).
  passes = {r[0]: r[1:] for r in table_rows(out.split("Bytes moved per device", 1)[1])}
  assert float(passes["collectives"][0]) == pytest.approx(2.0, abs=0.01), out
  assert 0.5 < float(passes["collectives"][1]) < 1.0, out
  assert float(passes["error feedback"][1]) >= 2.0, out
  assert passes["forward+backward"][0] == passes["forward+backward"][1], out  # the same model
  totals = ("sum of the phases", "step (wall clock)", "step / allreduce")
  for column in range(2):
    phases = [float(cells[column].split()[0]) for name, cells in rows.items() if name not in totals]
    total, wall = float(rows["sum of the phases"][column]), float(rows["step (wall clock)"][column])
    assert sum(phases) == pytest.approx(total, rel=0.01), out  # rounding of each cell only
    assert 0 < total <= 1.1 * wall, out  # a device's ops fit in its step: nothing counted twice
  # The kernels: whole numbers (a step runs the same instructions on every device), the
  # compressor's own among them.
  kernels = {r[0]: r[1:] for r in table_rows(out.split("Kernels run per device", 1)[1])}
  assert int(kernels["the compressor's own"][1]) > int(kernels["the compressor's own"][0]) > 0
  assert int(kernels["sum"][1]) == sum(int(c[1]) for name, c in kernels.items()
                                       if name not in ("sum", "the compressor's own")), out


@pytest.mark.slow  # an end-to-end run of a script
def test_step_profile_leaf_sweep():
  out, top = run_script("step_profile.py", "--compressors", "powersgd_r4", "--layers", "2,4",
                        "--top", "2").split("The op_names with most")
  assert {r[0] for r in table_rows(top)} == {"allreduce", "powersgd_r4"}, top
  rows = {r[0]: r[1:] for r in table_rows(out)}
  assert list(rows) == ["allreduce", "powersgd_r4"]
  own = {name: [int(cell.split()[0]) for cell in cells[:2]] for name, cells in rows.items()}
  assert all(0 < a <= b for a, b in own.values()), out  # more leaves, no fewer kernels
  assert float(rows["powersgd_r4"][2]) == pytest.approx(own["powersgd_r4"][1]
                                                        / own["powersgd_r4"][0], abs=0.01)


def test_gpu_sh_dry_run(tmp_path):
  # The lent-GPU run's own code (benchmarks/gpu.sh) on this CPU: tiny models, a 34 s budget, so
  # that it fits the fast tier's per-test limit (a section the budget leaves out says so).
  env = dict(os.environ, PYTHON=sys.executable)
  for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
    env.pop(name, None)
  before = _read(common.BENCHMARKS_MD)
  out = tmp_path / "out"
  result = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), str(out),
                           "--dry-run", "--budget", "34"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  assert _read(common.BENCHMARKS_MD) == before
  assert sorted(os.listdir(out)) == ["gpu_log.txt", "gpu_report.md", "gpu_results.json"]
  report = (out / "gpu_report.md").read_text()
  for heading in ("## 1. Environment", "## 2. Step time and memory", "## 3. Are the collectives",
                  "## 4. Kernels", "## 5. Quality"):
    assert heading in report, report
  assert "DRY RUN" in report and "STOP" not in report, report
  assert "every public JAX API jaxcomp uses is there" in report
  lanes = __import__("json").loads((out / "gpu_results.json").read_text())["status"]
  states = {s["id"]: s["status"] for lane in lanes.values() for s in lane["sections"]}
  # The first sections of each lane run whatever the machine's load; none may fail.
  for first in ("env", "st_gpu_big0", "mem_gpu", "st_cpu_mlp"):
    assert states[first] == "ok", (first, states, (out / "gpu_log.txt").read_text()[-3000:])
  assert all(s in ("ok", "skipped", "running") for s in states.values()), states
  rows = table_rows(report.split("### MLP")[1])
  assert [r[0] for r in rows] == ["allreduce", "powersgd_r1"]
  assert rows[0][3] == "1.00", rows  # step / allreduce on CPU×8
  rows = table_rows(report.split("### transformer")[1])  # the GPU lane's first timed section
  assert rows[0][0] == "allreduce" and rows[0][2] == "1.00", rows
  assert "`PYTHONPATH=. python benchmarks/step_time.py --quick --platform cpu --devices 1" in report


def test_gpu_run_writes_the_report_each_time_a_section_ends(tmp_path):
  import json  # noqa: PLC0415
  import time  # noqa: PLC0415

  from benchmarks import gpu_run
  (tmp_path / "status_gpu.json").write_text(json.dumps({"sections": [{"status": "ok"}]}))
  lane = subprocess.Popen(["sleep", "1"], start_new_session=True)
  with open(os.devnull, "w") as log:
    calls = []
    ended = gpu_run.wait_lanes({"gpu": (lane, log)}, time.time() + 30, str(tmp_path), {},
                               calls.append)
  assert ended == {"gpu": 0} and len(calls) == 1  # once for the one section ended


def test_gpu_schedule_reads_async_collectives():
  from benchmarks import gpu_schedule
  def fusion(name, op_name):  # one instruction a line, as XLA prints them
    return (f"  %{name} = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%add, "
            f'metadata={{op_name="jit(s)/{op_name}"}}')

  hlo = "\n".join([
      "HloModule m, is_scheduled=true", "",
      "%add (a: f32[], b: f32[]) -> f32[] {", "  %a = f32[] parameter(0)",
      "  %b = f32[] parameter(1)", "  ROOT %s = f32[] add(%a, %b)", "}", "",
      "%async_computation (p: f32[8]) -> f32[8] {", "  %p = f32[8]{0} parameter(0)",
      "  ROOT %all-to-all.1 = f32[8]{0} all-to-all(%p), channel_id=2, replica_groups={{0,1}}, "
      "dimensions={0}", "}", "",
      "ENTRY %main (x: f32[8]) -> f32[8] {", "  %x = f32[8]{0} parameter(0)",
      fusion("f1", "transpose(jvp())/mul"),
      "  %ars = f32[8]{0} all-reduce-start(%f1), channel_id=1, replica_groups={{0,1}}, "
      "to_apply=%add",
      fusion("f2", "transpose(jvp())/dot"), fusion("f3", "jaxcomp.update/mul"),
      "  %ard = f32[8]{0} all-reduce-done(%ars)",
      "  %as = ((f32[8]{0}), f32[8]{0}) async-start(%ard), calls=%async_computation, "
      'backend_config={"is_sync":true}',
      "  %ad = f32[8]{0} async-done(%as)",
      "  %ag = f32[16]{0} all-gather(%ad), channel_id=3, replica_groups={{0,1}}, dimensions={0}",
      fusion("f4", "transpose(jvp())/mul"), "  ROOT %r = f32[8]{0} add(%f4, %f2)", "}", ""])
  result = gpu_schedule.analyse(hlo, 2)
  by_name = {c["name"]: c for c in result["collectives"]}
  assert result["count"] == {"all-reduce": 1, "all-to-all": 1, "all-gather": 1}
  assert result["async"] == 2 and result["marked_sync"] == 1 and result["backward"] == 3
  assert by_name["ars"]["window"] == 2 and by_name["ars"]["backward_in_window"] == 1
  assert by_name["ars"]["backward_after_start"] == 2  # f2 and f4 come after the start
  assert by_name["as"]["op"] == "all-to-all" and by_name["as"]["payload_bytes"] == 32
  assert not by_name["ag"]["async"] and by_name["ag"]["window"] == 0
  assert by_name["ag"]["backward_after_start"] == 1
  assert result["bytes_overlapping_backward"] == 32  # the all-reduce's only
  assert result["kernels"] == 8  # the four fusions, the add, three collectives (a pair counts once)
  row, = gpu_schedule.rows([dict(result, entry="x")])
  assert row[2] == "2 of 3 (1 marked sync)" and row[-1] == "AR 2/1, A2A sync, AG sync"


def test_gpu_env_names_what_is_missing(monkeypatch):
  import jax

  from benchmarks import gpu_env
  assert gpu_env.check_apis()[0] == []  # every API the package uses is in this JAX
  monkeypatch.setattr(gpu_env, "APIS", (("jax.set_mesh_v2", ()), ("jax.lax.pcast", ("into",))))
  stops, _ = gpu_env.check_apis()
  assert stops[0] == f"jax {jax.__version__} lacks API jax.set_mesh_v2: used in the benchmarks"
  assert stops[1].startswith(f"jax {jax.__version__} lacks API jax.lax.pcast(into=): its signature")


def test_dgc_study_variants_change_only_what_they_name():
  import jax
  import numpy as np
  import optax

  from benchmarks import dgc_study
  from jaxcomp.train import tasks
  # The paper's four warm-up densities over the first 25% of 1,000 steps, in stages of 62 steps.
  recipe = dgc_study.warmup_recipe(0.25)
  assert recipe(1000)["warmup"] == ((62, 0.25), (124, 0.0625), (186, 0.015625), (248, 0.004))
  assert [first for first, _, _ in recipe.phases(1000)] == [0, 62, 124, 186, 248]
  assert dgc_study.warmup_recipe(0) is None
  names = ["allreduce", "dgc", "dgc_unclipped", "dgc_1pct"]
  with registry.registered([dgc_study.VARIANTS[n].entry(n) for n in names]):
    one = registry.REGISTRY["dgc_1pct"]
    assert one.settings == {"ratio": 0.01} and one.recipe is registry.REGISTRY["dgc"].recipe
    # The job's clip_by_global_norm(1) after DGC shrinks an update of norm 100 to the learning
    # rate; the unclipped variant's task leaves it out.
    task = dgc_study.study_task(tasks.chars(quick=True), names)
    grads = {"w": np.full((8, 4, 4), 100.0, np.float32)}  # one per device
    for name, clipped in (("dgc", True), ("dgc_unclipped", False)):
      tx = task.optimizer(registry.REGISTRY[name])  # the steady state at the constant rate
      state = jax.pmap(tx.init, axis_name="batch")(grads)
      updates, _ = jax.pmap(tx.update, axis_name="batch")(grads, state)
      norm = float(optax.global_norm(updates["w"][0]))
      assert (norm <= task.learning_rate * 1.001) == clipped, (name, norm)
  assert "dgc_1pct" not in registry.REGISTRY and "dgc_unclipped" not in registry.REGISTRY
