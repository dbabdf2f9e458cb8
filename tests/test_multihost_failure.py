"""A 2-process jax.distributed job: a killed process stops the other with a clear error in bounded
time, and a restart from the last checkpoint reproduces the uninterrupted run exactly."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multihost.py"
HEARTBEAT = 5  # seconds; jax.distributed's default is 100
STEPS = 30


def start_job(tmp_path, name, *extra):
  port = free_port()
  procs = []
  for i in range(2):
    log = open(tmp_path / f"{name}{i}.log", "w")
    procs.append(subprocess.Popen(
        [sys.executable, "-u", str(EXAMPLE), "--steps", str(STEPS), "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--local-devices", "2",
         "--heartbeat-timeout", str(HEARTBEAT), "--out", str(tmp_path / f"{name}.npz"), *extra],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT))
  return procs


def finish(procs, timeout=600):
  try:
    return [p.wait(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def latest_checkpoint(folder):
  steps = [int(p.name) for p in folder.glob("*") if p.name.isdigit()]
  return max(steps, default=0)


@pytest.mark.slow
def test_killed_process_stops_the_job_and_a_restart_reproduces_the_uninterrupted_run(tmp_path):
  assert finish(start_job(tmp_path, "full")) == [0, 0]

  ckpt = tmp_path / "ckpt"
  procs = start_job(tmp_path, "interrupted", "--checkpoint-dir", str(ckpt))
  try:
    deadline = time.time() + 300
    while latest_checkpoint(ckpt) < 5:
      assert time.time() < deadline and procs[0].poll() is None, "the job never reached step 5"
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    code = procs[0].wait(timeout=HEARTBEAT + 60)
    stopped_after = time.time() - killed_at
  finally:
    finish(procs, timeout=1)
  log = (tmp_path / "interrupted0.log").read_text()
  assert code != 0, log
  assert "another task died" in log or "heartbeat" in log.lower(), log[-3000:]
  assert stopped_after < HEARTBEAT + 30, f"survivor took {stopped_after:.0f} s to stop"
  saved = latest_checkpoint(ckpt)
  print(f"survivor stopped {stopped_after:.1f} s after the kill; restarting from step {saved}")
  assert 5 <= saved < STEPS

  assert finish(start_job(tmp_path, "resumed", "--checkpoint-dir", str(ckpt))) == [0, 0]
  assert f"resumed from the checkpoint of step {saved}" in (tmp_path / "resumed0.log").read_text()
  full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
  assert int(resumed["first_step"]) == saved
  np.testing.assert_array_equal(resumed["losses"], full["losses"][saved:])
  for key in full.files:
    if key not in ("losses", "first_step"):
      np.testing.assert_array_equal(resumed[key], full[key], err_msg=key)
