"""The main job, ``python -m jaxcomp.train``: its table, files and command-line errors."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import rounding_tol
from jaxcomp.train import job, registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", "jaxcomp.train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_run_prints_the_table_and_writes_its_files(tmp_path):
  out = tmp_path / "out"
  proc = _run("--quick", "--steps", "6", "--devices", "4", "--out", str(out))
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  header = lines.index("| compressor | sent/step/device | compression | step time | loss | accuracy |")
  rows = {line.split("|")[1].strip(): line for line in lines[header + 2:] if line.startswith("|")}
  assert list(rows) == list(registry.DEFAULT)
  assert "| 1.0x | 1.00x |" in rows["allreduce"]
  assert "| 2.0x |" in rows["fp16"]
  assert "step" in proc.stderr  # the progress bar
  assert (out / "loss.png").stat().st_size > 0
  assert "| compressor |" in (out / "results.md").read_text()
  results = json.loads((out / "results.json").read_text())
  assert results["devices"] == 4
  for run in results["runs"]:
    assert len(run["losses"]) == 6
  # Every compressor saw the same batches from the same start, so the first loss is the same: each
  # compressor's own compiled step computes it, to float32 rounding of the widest (256-long) sums.
  first = [run["losses"][0] for run in results["runs"]]
  np.testing.assert_allclose(first, first[0], **rounding_tol(4 * 64))


def test_digits_task_trains(tmp_path):
  proc = _run("--task", "digits", "--quick", "--steps", "3", "--devices", "2",
              "--compressors", "fp16", "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert "| fp16 |" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--compressors", "allreduce,topk"], "unknown compressor 'topk'"),
    (["--steps", "0"], "--steps must be a positive number of steps; got 0"),
    (["--steps", "-3"], "--steps must be a positive number of steps; got -3"),
    (["--devices", "0"], "--devices must be a positive number of devices; got 0"),
    (["--devices", "64"], "--batch-size must be a positive multiple of --devices 64"),
    (["--task", "mnist"], "argument --task: invalid choice: 'mnist'"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    job.parse_args(args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err
  assert err.count("\n") == 1, err


def test_more_devices_than_available_is_one_line(capsys):
  available = len(jax.devices())  # JAX has started: --devices cannot raise the count any more
  assert job.main(["--devices", str(2 * available), "--batch-size", str(2 * available)]) == 2
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
  for option in ("--task", "--steps", "--devices", "--compressors", "--out", "--batch-size",
                 "--seed", "--quick"):
    assert option in text
  assert "standard library" in text and "8x8 digits" in text
