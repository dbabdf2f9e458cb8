"""DDP's promises besides the hooks across two processes joined by jax.distributed on 127.0.0.1
(gloo): a different start stops the job naming the leaf, process 0's broadcast makes the replicas
identical, a process with fewer batches ends the job for all at the same step, BatchNorm statistics
follow the chosen policy (pmap, shard_map, data_parallel), and data_parallel's make_state starts
every process from process 0's state. Every job runs under a timeout, so a hang fails instead of
blocking."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 300  # seconds for a whole job; a hang in a collective would sit here instead of passing


def run_two(command, logs):
  """Runs ``command(i)`` (the arguments after the Python interpreter) for processes 0 and 1, each
  writing to ``logs[i]``, under the timeout; returns (exit codes, log texts)."""
  procs = [subprocess.Popen(
      [sys.executable, "-u", *command(i)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
      stdout=open(logs[i], "w"), stderr=subprocess.STDOUT) for i in range(2)]
  try:
    codes = [p.wait(timeout=TIMEOUT) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return codes, [log.read_text() for log in logs]


def run_worker(tmp_path, name):
  """Runs ``tests/workers/NAME.py`` as 2 processes x 2 CPU devices, asserts both exit 0; returns
  (each process's saved arrays, the log texts)."""
  port = free_port()
  outs = [tmp_path / f"p{i}.npz" for i in range(2)]
  logs = [tmp_path / f"p{i}.log" for i in range(2)]
  codes, text = run_two(lambda i: [
      str(ROOT / "tests" / "workers" / f"{name}.py"), "--coordinator", f"127.0.0.1:{port}",
      "--process-id", str(i), "--out", str(outs[i])], logs)
  assert codes == [0, 0], text[0][-3000:] + text[1][-3000:]
  return [np.load(out) for out in outs], text


def run_job(tmp_path, *extra):
  """Runs examples/multihost.py as 2 processes x 2 CPU devices; returns (exit codes, logs)."""
  port = free_port()
  return run_two(lambda i: [
      str(EXAMPLES / "multihost.py"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
      "--process-id", str(i), "--local-devices", "2", "--heartbeat-timeout", "10", *extra],
      [tmp_path / f"process{i}.log" for i in range(2)])


@pytest.mark.slow  # several processes
def test_a_different_start_stops_every_process_naming_the_leaf(tmp_path):
  codes, logs = run_job(tmp_path, "--steps", "2", "--perturb-start", "--no-broadcast")
  assert codes[0] != 0 and codes[1] != 0, logs
  for log in logs:  # both processes stop, with the same error, before any step
    assert ("ReplicaMismatchError: tree: leaf ['Dense_1']['bias'] (float32[32]) differs between "
            "processes: process 1's value is not process 0's") in log, log[-3000:]


@pytest.mark.slow  # several processes
def test_broadcast_start_and_uneven_inputs_end_together_with_identical_replicas(tmp_path):
  # The last process starts from other parameters and has 3 batches fewer than the 8 steps.
  out = tmp_path / "out.npz"
  codes, logs = run_job(tmp_path, "--steps", "8", "--perturb-start", "--short", "3", "--out",
                        str(out))
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  for i, log in enumerate(logs):
    assert f"process {i}/2: 2 local of 4 devices" in log
    assert "stopped after step 5 of 8, replicas identical" in log, log[-3000:]
  first, second = np.load(out), np.load(tmp_path / "out.process1.npz")
  assert len(first["losses"]) == 5
  for key in first.files:  # bit for bit, checked here without jaxcomp's fingerprints
    np.testing.assert_array_equal(second[key], first[key], err_msg=key)


@pytest.mark.slow
def test_batchnorm_statistics_follow_each_policy_across_two_processes():
  proc = subprocess.run([sys.executable, str(EXAMPLES / "batchnorm.py"), "--launch", "2"], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                        timeout=2 * TIMEOUT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = [line for line in proc.stdout.splitlines() if "BatchNorm_0 statistics" in line]
  assert len(lines) == 2 * 3 * 4, proc.stdout  # processes x mappings x policies
  for process in range(2):
    for mapping in ("pmap", "shard_map", "data_parallel"):
      for policy in ("local", "mean", "first", "mean every 3"):
        prefix = f"process {process}: {mapping:13s} {policy:12s} "
        line = next(l for l in lines if l.startswith(prefix))
        assert "after every step match NumPy" in line, line
        outcome = "differ" if policy == "local" else "identical"
        assert f"both layers' statistics {outcome} on the 4 devices" in line, line


@pytest.mark.slow  # several processes
def test_data_parallel_make_state_starts_every_process_from_process_0(tmp_path):
  """tests/workers/data_parallel_start.py: each process initialises from its own seed."""
  (first, second), text = run_worker(tmp_path, "data_parallel_start")
  for log in text:  # the loss form cannot replace the caller's parameters: it names the leaf
    assert "loss form refused: tree: leaf ['b'] (float32[]) differs between processes" in log, log
  assert not np.array_equal(first["start/w"], second["start/w"])  # the starts really differed
  for key in first.files:
    if key.startswith("start/"):
      continue
    # Bit for bit, on every local device of both processes (one row each).
    for got in (first[key], second[key]):
      assert got.shape[0] == 2, key
      np.testing.assert_array_equal(got, np.broadcast_to(first[key][0], got.shape), err_msg=key)
    np.testing.assert_array_equal(second[key], first[key], err_msg=key)
  for prefix in ("made", "local"):  # process 0's parameters, unchanged, on every device
    np.testing.assert_array_equal(first[f"{prefix}/params['w']"][0].reshape(6, 4), first["start/w"])
