"""Two processes joined by jax.distributed (gloo CPU collectives) train like one process."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_two_processes_equal_one_process_on_the_same_four_devices():
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "examples", "multihost.py"), "--launch", "2", "--steps",
       "8"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
      timeout=900)
  out = proc.stdout
  assert "process 0/2: 2 local of 4 devices" in out and "process 1/2: 2 local of 4 devices" in out
  assert "process 0/1: 4 local of 4 devices" in out
  assert "2 processes x 2 devices vs 1 process x 4 devices: equal" in out, out + proc.stderr
  assert proc.returncode == 0
