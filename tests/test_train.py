"""The main job, ``python -m jaxcomp.train``: its table, files and command-line errors, and its
step — ``jaxcomp.data_parallel``'s, training as the pmap step did."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from helpers import replicate, rounding_tol
from jaxcomp import hooks
from jaxcomp._src.report import parse_hlo
from jaxcomp.train import cli, network, plots, registry, tasks, training_loop, training_step
from jaxcomp.train.runs import WINDOW, Run, modelled_to_target, table
from training import pmap_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 4


def _run(*args, timeout=600, env=None):
  env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
  return subprocess.run([sys.executable, "-m", "jaxcomp.train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def without_torch(tmp_path):
  """A PYTHONPATH on which ``import torch`` fails: what runs under it never needs torch."""
  blocker = tmp_path / "no_torch" / "torch"
  blocker.mkdir(parents=True)
  (blocker / "__init__.py").write_text("raise ImportError('jaxcomp imported torch')\n")
  return {"PYTHONPATH": os.pathsep.join([str(blocker.parent), ROOT])}


@pytest.mark.slow
def test_quick_run_prints_the_table_and_writes_its_files(tmp_path):
  out = tmp_path / "out"
  proc = _run("--quick", "--steps", "6", "--devices", "4", "--out", str(out))
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  header = lines.index(
      "| compressor | sent/step/device | compression | step time | steps to target "
      "| sent to target | to target, 1 Gbit/s (modelled) | to target, 10 Gbit/s (modelled) "
      "| to target, 100 Gbit/s (modelled) | held-out loss | accuracy |")
  rows = {line.split("|")[1].strip(): line.split("|")[2:-1]
          for line in lines[header + 2:] if line.startswith("|")}
  assert list(rows) == list(registry.JOB_DEFAULT)
  assert [c.strip() for c in rows["allreduce"][1:3]] == ["1.0x", "1.00x"]
  assert rows["bf16"][1].strip() == "2.0x"  # the requested wire dtype (XLA:CPU widens it)
  # allreduce reaches its own final held-out loss by the last step, at its own bytes and time.
  steps, ratio = rows["allreduce"][3].split()
  assert int(steps) <= 6 and ratio == "(1.00x)"
  assert rows["allreduce"][4].strip().endswith("(1.00x)")
  assert all(cell.strip().endswith(" s (1.00x)") for cell in rows["allreduce"][5:8])
  low, high = network.MEASURED_RATIOS
  assert f"was {low:.2f}–{high:.2f}" in proc.stdout  # the model's error on a real link
  assert "step" in proc.stderr  # the progress bar
  assert (out / "loss.png").stat().st_size > 0
  assert lines[-1].startswith(f"To project these measurements to your model, devices and link: "
                              f"{cli.PLAN_EXAMPLE}")  # the planner, named once, last
  assert "| compressor |" in (out / "results.md").read_text()
  results = json.loads((out / "results.json").read_text())
  assert results["devices"] == 4
  modelled = results["modelled_to_target"]
  assert [m["gbits"] for m in modelled] == [1, 10, 100]
  assert all(m["seconds"]["allreduce"] > 0 for m in modelled)
  for run in results["runs"]:
    assert 6 <= len(run["losses"]) <= 9  # --max-steps defaults to 1.5 x --steps
    assert run["evals"][0][0] == 0 and run["evals"][-1][0] == len(run["losses"])
  # Every compressor saw the same batches from the same start, so the first loss is the same: each
  # compressor's own compiled step computes it, to float32 rounding of the widest (256-long) sums.
  first = [run["losses"][0] for run in results["runs"]]
  np.testing.assert_allclose(first, first[0], **rounding_tol(4 * 64))


@pytest.mark.slow  # trains end to end
def test_digits_task_trains_without_torch(tmp_path, without_torch):
  proc = _run("--task", "digits", "--quick", "--steps", "3", "--devices", "2",
              "--compressors", "fp16,dgc,local_sgd_h8", "--out", str(tmp_path / "out"),
              env=without_torch)
  assert proc.returncode == 0, proc.stderr
  assert "| fp16 |" in proc.stdout and "| local_sgd_h8 |" in proc.stdout
  imported = subprocess.run(
      [sys.executable, "-c", "import jaxcomp, jaxcomp.hooks, jaxcomp.train.cli, "
       "jaxcomp.train.link_job, jaxcomp.train.tasks, jaxcomp.train.registry"],
      env=dict(os.environ, **without_torch),
      capture_output=True, text=True, timeout=120)
  assert imported.returncode == 0, imported.stderr


_LAPACK_THREADS = """
import sys
import jax
import threadpoolctl
from jaxcomp.train import device_setup
if sys.argv[1] != "unset":
  device_setup.simulate_cpu_devices(int(sys.argv[1]))
jax.numpy.linalg.qr(jax.numpy.ones((4, 3)))  # loads jaxlib's LAPACK
print([p["num_threads"] for p in threadpoolctl.threadpool_info() if "scipy.libs" in p["filepath"]])
"""


def _lapack_threads(count: str, preset=None) -> str:
  """The thread counts of SciPy's OpenBLAS in a fresh process after ``simulate_cpu_devices(count)``
  (``"unset"``: not called), with ``OPENBLAS_NUM_THREADS`` removed or set to ``preset``."""
  env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  if preset is not None:
    env["OPENBLAS_NUM_THREADS"] = preset
  proc = subprocess.run([sys.executable, "-c", _LAPACK_THREADS, count], env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout.strip()


def test_simulate_cpu_devices_runs_lapack_on_one_thread():
  assert _lapack_threads("4") == "[1]"  # simulated devices: one LAPACK thread per call
  # The environment's setting wins (OpenBLAS caps it at the machine's cores).
  assert _lapack_threads("4", preset="2") == _lapack_threads("unset", preset="2")
  assert _lapack_threads("1") == _lapack_threads("unset")  # one device: OpenBLAS's own default


@pytest.fixture(scope="module")
def digits():
  return tasks.get("digits", quick=True)


def _step(task, name, tx=None, **settings):
  """The main job's step of registry entry ``name`` on W devices (``tx``: another optimizer)."""
  entry = registry.REGISTRY[name]
  return training_step.make_step(task, tx or task.optimizer(entry, **settings),
                                 training_step.make_mesh(jax.devices()[:W]))


@pytest.mark.parametrize("name", ["allreduce", "fp16", "powersgd_r1", "onebit_adam", "local_sgd_h8",
                                  "diloco_h20_fp16", "dgc", "coarse_dgc"])
def test_the_jobs_step_is_data_parallel_and_sends_only_the_compressors_collectives(digits, name):
  step = _step(digits, name)
  params, opt_state = step.start(digits.init(0))
  text = step.lower(params, opt_state, *digits.batch(0, 0, 8 * W)).compile().as_text()
  assert text.startswith("HloModule jit_global_step"), text[:80]  # data_parallel's global step
  report = parse_hlo(text, W)
  dense = 4 * sum(np.size(x) for x in jax.tree.leaves(digits.init(0)))
  every_step = [c for c in report.collectives if not c.in_conditional]
  if registry.REGISTRY[name].wraps_optimizer:  # sends on sync steps only, in a conditional
    assert report.collectives and not every_step, report
  whole = [c for c in every_step if c.payload_bytes >= dense]
  if name == "allreduce":  # its own float32 mean, once: no second one added by autodiff
    assert [(c.op, set(c.dtypes)) for c in whole] == [("all-reduce", {"f32"})], report
  else:
    assert not whole, report  # a compressed step: nothing as big as the float32 gradient
  if name == "fp16":
    assert report.bytes_by_dtype() == {"f16": dense // 2}


def test_the_jobs_step_donates_nothing_on_cpu(digits):
  # XLA:CPU's in-process all-reduce segfaulted on the donated step (make_step says when).
  step = _step(digits, "powersgd_r1")
  text = step.lower(*step.start(digits.init(0)), *digits.batch(0, 0, 8 * W)).as_text()
  assert "buffer_donor" not in text and "aliasing_output" not in text


def test_the_jobs_step_refuses_a_transformation_that_does_not_average(digits):
  # Under pmap the replicas would drift apart silently; data_parallel names the first parameter.
  step = _step(digits, "allreduce", tx=optax.chain(jaxcomp.comm_hook(hooks.noop_hook),
                                                  optax.sgd(0.1)))
  params, opt_state = step.start(digits.init(0))
  with pytest.raises(ValueError, match=r"params\['Dense_0'\]\['bias'\] differs from device to "
                                       "device after the step"):
    step.lower(params, opt_state, *digits.batch(0, 0, 8 * W))


def _pmap_losses(task, tx, batches):
  """The main job's step before data_parallel: jax.pmap, replicated parameters and state."""
  step = pmap_step(task.loss, tx, W)
  params, opt_state = replicate(task.init(0), W), replicate(tx.init(task.init(0)), W)
  losses = []
  for inputs, targets in batches:
    params, opt_state, loss = step(params, opt_state, inputs.reshape(W, -1, *inputs.shape[1:]),
                                   targets.reshape(W, -1))
    losses.append(np.asarray(loss))  # blocks
  return np.stack(losses), jax.tree.map(lambda x: np.asarray(x[0]), params)


@pytest.mark.slow  # trains end to end
@pytest.mark.numeric
@pytest.mark.parametrize("name", ["powersgd_r1", "dgc", "onebit_adam", "local_sgd_h8",
                                  "diloco_h20_powersgd_r2"])
def test_the_jobs_step_trains_as_the_pmap_step_did(digits, name):
  steps = 24  # every recipe's warm-up phases, local SGD's syncs (every 8 steps) and DiLoCo's (20)
  entry = registry.REGISTRY[name]
  batches = [digits.batch(0, t, 8 * W) for t in range(steps)]
  step = _step(digits, name, steps=steps)
  params, opt_state = step.start(digits.init(0))
  losses = []
  for batch in batches:
    params, opt_state, loss = step.run(params, opt_state, *step.dp.shard(batch))
    losses.append(np.asarray(loss))  # blocks every step
  ref_losses, ref_params = _pmap_losses(digits, digits.optimizer(entry, steps=steps), batches)
  tol = rounding_tol(64 * steps)  # two programs: float32 rounding of 64-long sums, step after step
  np.testing.assert_allclose(np.stack(losses), ref_losses, **tol)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol),
               training_step.first_copy(params, digits.init(0)), ref_params)


@pytest.mark.parametrize("args, message", [
    (["--compressors", "allreduce,topk"], "unknown compressor 'topk'"),
    (["--steps", "0"], "--steps must be a positive number of steps; got 0"),
    (["--steps", "-3"], "--steps must be a positive number of steps; got -3"),
    (["--devices", "0"], "--devices must be a positive number of devices; got 0"),
    (["--devices", "64"], "--batch-size must be a positive multiple of --devices 64"),
    (["--task", "cifar"], "argument --task: invalid choice: 'cifar'"),
    (["--link", "fast"], "--link: rate must be 'none' or a number with kbit, mbit or gbit"),
    (["--steps", "10", "--max-steps", "5"], "--max-steps must be at least --steps 10; got 5"),
    (["--gbits", "fast"], "--gbits: link speeds must be positive numbers of Gbit/s"),
    (["--gbits", "1,0"], "--gbits: link speeds must be positive numbers of Gbit/s"),
    (["--gbits", "1,nan"], "--gbits: link speeds must be positive numbers of Gbit/s"),
    (["--gbits", "10,10"], "--gbits: a link speed is given twice: '10,10'"),
    (["--plan", "--model", "gpt2-small", "--device-gib", "0"],
     "--device-gib must be a positive number of GiB per device (e.g. 80); got 0"),
    (["--plan", "--model", "gpt2-small", "--device-gib", "-8"],
     "--device-gib must be a positive number of GiB per device (e.g. 80); got -8"),
    (["--plan", "--model", "gpt2-small", "--device-gib", "inf"],
     "--device-gib must be a positive number of GiB per device (e.g. 80); got inf"),
    (["--plan", "--model", "gpt2-small", "--device-gib", "lots"],
     "argument --device-gib: invalid float value: 'lots'"),
    (["--device-gib", "80"], "--device-gib is an option of --plan"),
    (["--variant", "dion_r16"], "--variant dion_r16: expected NAME=ENTRY,KEY=VALUE,..."),
    (["--variant", "d=dion_r9,rank=16"], "--variant d=dion_r9,rank=16: unknown registry entry "
                                         "'dion_r9'"),
    (["--variant", "dion_r4=dion_r8"], "'dion_r4' is a registry entry's name; give the variant a "
                                       "name of its own"),
    (["--variant", "d=dion_r8,rnk=16", "--compressors", "d"],
     "--variant d=dion_r8,rnk=16: dion_r8: dion() got an unexpected keyword argument 'rnk'"),
    (["--variant", "d=dion_r8,rank=0", "--compressors", "d"],
     "--variant d=dion_r8,rank=0: dion_r8: rank must be a positive int; got 0"),
    (["--variant", "p=powersgd_r2,start_iter=0", "--compressors", "p"],
     "powersgd_r2's recipe sets start_iter for the run's length; a variant cannot change it"),
    (["--variant", "d=dion_r8,rank=16"], "--variant d is not in --compressors: name it there"),
    (["--variant", "d=dion_r8,rank=16", "--variant", "d=dion_r8,rank=2", "--compressors", "d"],
     "--variant names d twice: give each variant a name of its own"),
    (["--variant", "d=dion_r8,rank=16", "--compressors", "d", "--link", "1gbit"],
     "--variant does not apply to --link"),
    (["--plan", "--model", "gpt2-small", "--variant", "d=dion_r8"],
     "--variant does not apply to --plan"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    cli.parse_args(args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err
  assert err.count("\n") == 1, err


def test_more_devices_than_available_is_one_line(capsys):
  available = len(jax.devices())  # JAX has started: --devices cannot raise the count any more
  assert cli.main(["--devices", str(2 * available), "--batch-size", str(2 * available)]) == 2
  err = capsys.readouterr().err
  assert err == (f"python -m jaxcomp.train: error: --devices {2 * available}: only {available} cpu "
                 "devices are available\n")


def test_bad_arguments_from_the_command_line_are_not_tracebacks():
  proc = _run("--steps", "0")
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "python -m jaxcomp.train: error: --steps must be a positive number of steps; got 0"]


def test_help_explains_each_option():
  text = _run("--help").stdout
  for option in ("--task", "--steps", "--max-steps", "--devices", "--compressors", "--gbits",
                 "--out", "--batch-size", "--seed", "--quick", "--link", "--plan", "--model",
                 "--params", "--step-ms", "--from-run", "--variant"):
    assert option in text
  assert "standard library" in text and "8x8 digits" in text


def test_a_variant_trains_with_its_settings_under_its_own_name_and_leaves_the_registry(tmp_path):
  out = tmp_path / "out"
  assert cli.main(["--task", "digits", "--quick", "--steps", "2", "--devices", "2",
                   "--variant", "powersgd_r3=powersgd_r1,rank=3", "--compressors",
                   "allreduce,powersgd_r1,powersgd_r3", "--out", str(out)]) == 0
  assert "powersgd_r3" not in registry.REGISTRY
  results = json.loads((out / "results.json").read_text())
  sent = {run["name"]: run["bytes_per_step"] for run in results["runs"]}
  assert list(sent) == ["allreduce", "powersgd_r1", "powersgd_r3"]
  # Rank 3 sends three P and three Q columns per matrix where rank 1 sends one of each; the
  # vectors travel dense in both.
  matrices = [leaf.shape for leaf in jax.tree.leaves(tasks.get("digits", quick=True).init(0))
              if leaf.ndim == 2]
  columns = sum(m + n for m, n in matrices)
  assert sent["powersgd_r3"] - sent["powersgd_r1"] == (3 - 1) * 4 * columns  # ring bytes, W = 2
  assert "--variant powersgd_r3=powersgd_r1,rank=3" in (out / "results.md").read_text()


def test_registered_entries_leave_the_registry_when_the_block_fails():
  entry = registry.variant("dion_r16", "dion_r8", {"rank": 16})
  assert entry.settings == {**registry.REGISTRY["dion_r8"].settings, "rank": 16}
  assert entry.about.endswith("; rank=16") and not entry.is_mean and entry.is_optimizer
  with pytest.raises(RuntimeError):
    with registry.registered([entry, registry.REGISTRY["allreduce"]]):
      assert registry.REGISTRY["dion_r16"] is entry
      raise RuntimeError
  assert "dion_r16" not in registry.REGISTRY and "allreduce" in registry.REGISTRY
  other = registry.variant("x", "dion_r8", {})
  with pytest.raises(ValueError,
                     match="'dion_r8' is a registry entry's name and the entry differs"):
    with registry.registered([dataclasses.replace(other, name="dion_r8", settings={"rank": 2})]):
      pass
  assert registry.REGISTRY["dion_r8"].settings["rank"] == 8


def test_recipes_name_their_phases():
  assert registry.REGISTRY["allreduce"].phases(300) == (registry.Phase(0, "allreduce", {}),)
  # PowerSGD: plain-mean steps (allreduce's program) until start_iter = 10% of the run.
  assert registry.REGISTRY["powersgd_r2"].phases(300) == (
      registry.Phase(0, "allreduce", {}), registry.Phase(30, "powersgd_r2", {}))
  assert registry.REGISTRY["powersgd_r2"].make("batch", steps=300) is not None
  # DGC: the paper's warm-up densities in four equal stages over the first 10%, then the steady
  # state.
  dgc = registry.REGISTRY["dgc"].phases(400)
  assert [p.first_step for p in dgc] == [0, 10, 20, 30, 40]
  assert [p.settings.get("ratio") for p in dgc] == [0.25, 0.0625, 0.015625, 0.004, None]
  assert registry.REGISTRY["dgc"].recipe(400) == {
      "warmup": ((10, 0.25), (20, 0.0625), (30, 0.015625), (40, 0.004))}
  # Too short for a warm-up: one phase.
  assert registry.REGISTRY["powersgd_r1"].phases(5) == (registry.Phase(0, "powersgd_r1", {}),)


def _fake_run(name="x", phases=((0, "a"), (3, "b")), evals=((0, 2.0, 0.1),), steps=6):
  return Run(name, steps, list(phases), {"a": 100.0, "b": 1.0}, 1.0, "",
             losses=[1.0] * steps, evals=list(evals), link_seconds={"a": 2.0, "b": 0.5})


def test_bytes_and_wall_clock_add_up_phase_by_phase():
  run = _fake_run()
  assert run.phase_at(0) == run.phase_at(2) == "a" and run.phase_at(3) == "b"
  assert run.bytes_to(5) == 3 * 100.0 + 2 * 1.0
  assert run.link_seconds_to(5) == 3 * 2.0 + 2 * 0.5


def test_held_out_loss_is_a_window_mean_and_reaching_the_target():
  evals = [(0, 3.0, 0.0)] + [(s, 3.0 - 0.1 * s, 0.1 * s) for s in range(1, 21)]
  run = _fake_run(evals=evals, steps=20)
  window = [3.0 - 0.1 * s for s in range(21 - WINDOW, 21)]
  assert run.final[0] == pytest.approx(sum(window) / WINDOW)
  assert run.held_out(1) == pytest.approx((2.9, 0.1))  # only one evaluation yet
  target = run.final[0]
  # One step earlier the window's mean is 0.1 higher.
  assert run.steps_to(target) == 20 and run.steps_to(target + 0.11) == 19
  assert run.steps_to(0.0) is None
  assert not run.diverged
  assert _fake_run(evals=[(0, 2.0, 0.1), (6, 2.5, 0.1)]).diverged  # ended above where it started
  assert _fake_run(evals=[(0, 2.0, 0.1), (6, float("nan"), 0.1)]).diverged


def test_a_stretched_run_trains_every_entry_but_allreduce_for_longer(digits):
  devices = jax.devices()[:2]
  runs = training_loop.train(digits, ["allreduce", "powersgd_r1"], steps=10, devices=devices,
                             batch_size=32, seed=0, progress=False, stretch=2)
  allreduce, powersgd = runs
  assert (allreduce.steps, powersgd.steps) == (10, 20)
  assert len(allreduce.losses) == 10 and len(powersgd.losses) >= 20
  assert powersgd.evals[-1][0] >= 20  # evaluated after its own last step
  # The recipe is the one for 20 steps: PowerSGD's plain-mean warm-up is a tenth of them.
  assert [p[0] for p in powersgd.phases] == [0, 2]
  with pytest.raises(ValueError, match="stretch must be at least 1"):
    training_loop.train(digits, ["allreduce"], steps=4, devices=devices, batch_size=32, seed=0,
                        progress=False, stretch=0.5)


def test_the_default_run_is_job_default_and_all_is_every_entry():
  default = cli.parse_args([])
  assert default.compressors == list(registry.JOB_DEFAULT)
  assert default.gbits == (1.0, 10.0, 100.0)
  assert cli.parse_args(["--compressors", "all"]).compressors == list(registry.REGISTRY)
  assert cli.parse_args(["--gbits", "0.1,2.5"]).gbits == (0.1, 2.5)


def _timed_run(name="allreduce"):
  """A run of 7 steps in two phases whose step times, collectives and evaluations are known: the
  held-out loss falls at every step, so it first reaches its own final value at step 7."""
  evals = [(0, 3.0, 0.0)] + [(t, 3.0 - 0.1 * t, 0.1) for t in range(1, 8)]
  return Run(name, 7, [(0, "a"), (3, "b")], {"a": 4e5, "b": 1e3}, 1e3, "",
             {"a": [("all-reduce", 4e5, 1.0)],
              "b": [("all-gather", 1e3, 0.5), ("all-to-all", 8e3, 1.0)]},
             losses=[1.0] * 7, evals=evals,
             step_seconds=[9.0, 9.0, 0.2, 0.1, 0.1, 0.3, 0.1])  # two compiling steps


def test_modelled_time_is_the_measured_step_plus_the_alpha_beta_formulas():
  run, world, alpha, beta = _timed_run(), 8, network.ALPHA, 1e9 / 8  # 1 Gbit/s
  # Compute: the median step of each phase, the first two steps (compilation) left out.
  assert run.compute_seconds == {"a": 0.2, "b": 0.1}
  # Phase a: an all-reduce of N bytes, the ring's 2(W-1)(α + N/(Wβ)) or doubling's
  # log2(W)(α + N/β), whichever is faster. Phase b: half the steps all-gather c bytes from each
  # worker ((W-1)(α + c/β) or log2(W)α + (W-1)c/β), every step all-to-alls N (W-1)(α + N/(Wβ)).
  a = 0.2 + min(2 * 7 * (alpha + 4e5 / (8 * beta)), 3 * (alpha + 4e5 / beta))
  b = 0.1 + 0.5 * min(7 * (alpha + 1e3 / beta), 3 * alpha + 7 * 1e3 / beta) + 7 * (
      alpha + 8e3 / (8 * beta))
  assert run.modelled_seconds(1, world) == pytest.approx({"a": a, "b": b}, rel=1e-12)
  assert run.steps_to(run.final[0]) == 7  # steps 0-2 in phase a, 3-6 in phase b
  modelled = modelled_to_target([run], world, [1, 100])
  assert modelled[1] == pytest.approx({"allreduce": 3 * a + 4 * b}, rel=1e-12)
  text = table([run], world, [1, 100])
  assert "| to target, 1 Gbit/s (modelled) | to target, 100 Gbit/s (modelled) |" in text
  assert f"| {3 * a + 4 * b:#.3g} s (1.00x) |" in text


def test_the_network_model_benchmark_uses_the_jobs_formulas():
  model = pytest.importorskip("benchmarks.network_model")
  for name in ("allreduce_time", "allgather_time", "alltoall_time", "comm_time",
               "shared_medium_time"):
    assert getattr(model, name) is getattr(network, name)


def test_the_models_measured_error_is_the_slow_link_benchmarks():
  with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
    section = f.read().split("**α-β model against the measurement**")[1].split("\n\n")[1]
  ratios = [float(line.split("|")[-2]) for line in section.splitlines()[2:]]  # predicted / measured
  assert (min(ratios), max(ratios)) == network.MEASURED_RATIOS


def test_the_plot_tells_every_line_apart_and_shows_measured_points_only():
  styles = plots.line_styles(len(registry.REGISTRY))
  assert len({(s["color"], s["marker"], s["linestyle"]) for s in styles}) == len(styles)
  assert len({s["color"] for s in plots.line_styles(len(registry.JOB_DEFAULT))}) == len(
      registry.JOB_DEFAULT)
  runs = [_timed_run(), _timed_run("diverging")]
  runs[1].evals = [(0, 3.0, 0.0)] + [(t, 3.0 + 10 * t, 0.1) for t in range(1, 8)]
  low, high = plots.loss_limits(runs, runs[0].final[0])
  assert low < min(runs[0].held_out(t)[0] for t in range(1, 8)) and high < 4.0  # not 73
  fig = plots.figure(runs, "t", world=8, gbits=(1, 10))
  bytes_axis = fig.axes[1]
  sent = np.concatenate([line.get_xdata() for line in bytes_axis.get_lines()[:2]])
  assert sent.min() == 4e5 / 1e6  # the first evaluation's cumulative MB: no point at zero bytes
  assert bytes_axis.get_xlim()[0] > sent.min() / 2
  assert fig.axes[2].get_title() == "modelled: W = 8, 1 Gbit/s per worker"


def test_link_needs_ip_and_tc_and_says_so_in_one_line(tmp_path):
  (tmp_path / "python").symlink_to(sys.executable)
  env = dict(os.environ, PYTHONPATH=ROOT, PATH=str(tmp_path))
  proc = subprocess.run([sys.executable, "-m", "jaxcomp.train", "--quick", "--link", "100mbit"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("python -m jaxcomp.train: error: --link 100mbit: "
                                                 "a slow link needs ")


@pytest.mark.slow
def test_quick_run_over_a_slow_link(tmp_path):
  from jaxcomp.train import namespaces
  reason = namespaces.unavailable_reason()
  if reason:
    pytest.skip(f"no network namespaces here: {reason}")

  def listed():
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return {n for n in names if n.startswith(namespaces.PREFIX)}

  before = listed()  # another job's namespaces on this machine are not this run's
  proc = _run("--quick", "--steps", "6", "--devices", "2", "--compressors", "allreduce,powersgd_r1",
              "--link", "100mbit", "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  header = next(line for line in lines if line.startswith("| compressor |"))
  assert "| step over link | wall-clock to target |" in header
  columns = [c.strip() for c in header.split("|")[1:-1]]
  rows = {cells[0]: dict(zip(columns, cells)) for cells in (
      [c.strip() for c in line.split("|")[1:-1]]
      for line in lines[lines.index(header) + 2:] if line.startswith("|"))}
  assert list(rows) == ["allreduce", "powersgd_r1"]
  assert rows["allreduce"]["step over link"].endswith("s")
  assert rows["allreduce"]["wall-clock to target"].endswith("(1.00x)")
  assert any(line.startswith("step times over a 100mbit link: 2 processes in a network namespace")
             for line in lines)
  assert listed() <= before, "the run left its network namespaces behind"
