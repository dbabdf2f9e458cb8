"""Every example in examples/ runs as a script and says what it promises."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SHOWCASES = {"train_linen_pmap.py": "jax.pmap", "train_nnx_pmap.py": "jax.pmap",
             "train_shard_map.py": "jax.shard_map", "batchnorm.py": "jax.pmap"}
"""Examples that show pmap or shard_map on purpose (batchnorm.py beside data_parallel)."""


def test_every_other_example_builds_its_step_with_data_parallel():
  for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(ROOT, "examples", name)) as f:
      source = f.read()
    if name in SHOWCASES:
      assert SHOWCASES[name] in source, name
    else:
      assert "data_parallel(" in source, f"{name} builds its step without jaxcomp.data_parallel"
      assert "jax.pmap(" not in source and "jax.shard_map" not in source, name


def run_example(name, *args):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def accuracy(stdout):
  return float(stdout.split("held-out accuracy ")[1].split()[0])


@pytest.mark.slow  # an end-to-end run of a script
@pytest.mark.parametrize("name", ["train_nnx_pmap.py", "train_linen_pmap.py"])
def test_pmap_examples_train_to_over_80_percent_accuracy_on_4_devices(name):
  out = run_example(name, "--steps", "60", "--devices", "4")
  assert "on 4 devices" in out
  assert accuracy(out) > 0.8


@pytest.mark.slow  # an end-to-end run of a script
def test_shard_map_example_has_no_hidden_all_reduce():
  out = run_example("train_shard_map.py", "--steps", "60", "--devices", "4")
  assert "P('batch',)" in out  # per-device state is sharded
  assert "without pcast, grad adds an all-reduce" in out  # the check ran (it asserts)
  assert accuracy(out) > 0.8


@pytest.mark.slow  # an end-to-end run of a script
def test_nnx_optimizer_example_trains_across_devices():
  out = run_example("train_nnx_optimizer.py", "--steps", "60", "--devices", "4")
  assert "per device: (4, 1, 64, 64) sharded P('batch', None, None, None)" in out
  assert "60 optimizer steps" in out  # the asserts on comm_report ran
  assert accuracy(out) > 0.8


@pytest.mark.slow  # an end-to-end run of a script
@pytest.mark.parametrize("mesh", [
    ["--devices", "4"], ["--devices", "8", "--model-axis", "2", "--axis-types", "auto"]])
def test_jit_example_sends_only_compressed_collectives_over_data(mesh):
  out = run_example("train_jit.py", "--steps", "60", *mesh)
  assert "over 'data':" in out  # the assert that no dense all-reduce crosses 'data' ran
  assert accuracy(out) > 0.8


@pytest.mark.slow  # an end-to-end run of a script
def test_checkpoint_resume_example_matches_the_uninterrupted_run():
  out = run_example("checkpoint_resume.py", "--steps", "14", "--devices", "4")
  assert "accumulator holds 1 micro-batch(es)" in out  # interrupted mid-accumulation (7 % 3)
  assert "resumed run equals the uninterrupted run, bit for bit" in out


@pytest.mark.slow  # an end-to-end run of a script
def test_batchnorm_example_follows_each_policy_under_data_parallel():
  out = run_example("batchnorm.py", "--devices", "4", "--mappings", "data_parallel")
  lines = [line for line in out.splitlines() if "BatchNorm_0 statistics" in line]
  assert len(lines) == 4, out
  for policy in ("local", "mean", "first", "mean every 3"):
    line = next(l for l in lines if l.startswith(f"process 0: data_parallel {policy:12s} "))
    assert "after every step match NumPy" in line, line  # the script also exits non-zero if not
    outcome = "differ" if policy == "local" else "identical"
    assert f"both layers' statistics {outcome} on the 4 devices" in line, line
