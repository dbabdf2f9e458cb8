"""Fault-tolerant DiLoCo (``jaxcomp.train.fault_tolerant``): across 3 processes x 2 CPU devices, a
process killed during its inner steps and restarted rejoins at the next synchronization, and every
process's θ and outer state are bit-identical after every synchronization (slow tier); and one
synchronization's program on simulated devices against NumPy (fast tier)."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.train import fault_tolerant
import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "fault_tolerant.py"
PROCESSES, SYNC_EVERY, STEPS, KILL_AFTER = 3, 5, 150, 10
DEADLINE = 240  # seconds for the whole job; it takes about a third of that


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def records(path):
  """The worker's lines of JSON (one per synchronization that counted)."""
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_killed_process_rejoins_and_every_process_stays_bit_identical(tmp_path):
  port, started = free_port(), []

  def start(i):
    log = open(tmp_path / f"process{i}.log", "a")
    started.append(subprocess.Popen(
        [sys.executable, "-u", str(WORKER), "--coordinator", f"127.0.0.1:{port}",
         "--process-id", str(i), "--processes", str(PROCESSES), "--steps", str(STEPS),
         "--sync-every", str(SYNC_EVERY), "--step-seconds", "0.1",
         "--out", str(tmp_path / f"process{i}.jsonl")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True))
    return started[-1]

  def logs():
    return "\n".join(f"--- process {i}\n" + (tmp_path / f"process{i}.log").read_text()[-3000:]
                     for i in range(PROCESSES))

  deadline = time.time() + DEADLINE
  try:
    first = [start(i) for i in range(PROCESSES)]
    # Kill process 2 right after a synchronization: during its inner steps.
    while not any(r["step"] >= KILL_AFTER for r in records(tmp_path / "process2.jsonl")):
      assert time.time() < deadline and all(p.poll() is None for p in first), logs()
      time.sleep(0.02)
    os.killpg(first[2].pid, signal.SIGKILL)
    killed = time.time()
    first[2].wait()
    killed_at = len(records(tmp_path / "process2.jsonl"))
    # Restart it once the survivors have synchronized without it.
    while not any(r["members"] == [0, 1] for r in records(tmp_path / "process0.jsonl")):
      assert time.time() < deadline and all(p.poll() is None for p in first[:2]), logs()
      time.sleep(0.02)
    rejoined = start(2)
    for p in first[:2] + [rejoined]:
      assert p.wait(timeout=max(1, deadline - time.time())) == 0, logs()
  finally:
    for p in started:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

  by_process = [records(tmp_path / f"process{i}.jsonl") for i in range(PROCESSES)]
  expected_steps = list(range(0, STEPS + 1, SYNC_EVERY))
  for survivor in by_process[:2]:  # every synchronization counted, to the job's step count
    assert [r["step"] for r in survivor] == expected_steps
  # The survivors went on without process 2, then took it back.
  members = [tuple(r["members"]) for r in by_process[0]]
  assert (0, 1) in members, members
  assert members[-1] == (0, 1, 2), members
  second_life = by_process[2][killed_at:]
  assert second_life and second_life[0]["pid"] != by_process[2][0]["pid"]
  assert tuple(second_life[0]["members"]) == (0, 1, 2) and second_life[-1]["step"] == STEPS
  # Bit-identical: every copy of θ and the outer state after each synchronization, the rejoined
  # process's first one included.
  for step in expected_steps:
    copies = {(r["theta"], r["outer"]) for rs in by_process for r in rs if r["step"] == step}
    assert len(copies) == 1, (step, copies)
  assert len({r["theta"] for r in by_process[0]}) == len(expected_steps)  # θ moved every time
  went_on = next(r["time"] for r in by_process[0] if r["members"] == [0, 1]) - killed
  back = second_life[0]["time"] - killed
  print(f"members by synchronization: {members}; the survivors synchronized without process 2 "
        f"{went_on:.1f} s after the kill, and with it again {back:.1f} s after")


@pytest.mark.numeric
def test_a_synchronization_averages_over_the_members_that_trained_and_sends_theta_bit_for_bit():
  """One synchronization's program on 3 simulated devices, one per member: member 0 is the source,
  member 2 joins with a stale θ and momentum (weight 0). θ is NumPy DiLoCo's outer step on the
  mean of members 0 and 1, the same bits on every device; with nobody trained, every device gets
  the source's θ and momentum bit for bit (a -0.0 included)."""
  rng = np.random.default_rng(0)
  theta = {"w": rng.normal(size=(3, 5)).astype(np.float32)}
  theta["w"][0, 0] = -0.0
  momentum = {"w": rng.normal(size=(3, 5)).astype(np.float32)}
  local = [{"w": theta["w"] + rng.normal(size=(3, 5)).astype(np.float32)} for _ in range(2)]
  config = jaxcomp.DiLoCoConfig(inner=optax.sgd(0.1), sync_every=2)
  outer_state = config.outer_optimizer().init(theta)
  outer_state = (outer_state[0]._replace(trace=momentum),) + tuple(outer_state[1:])
  stale_theta, stale_state = jax.tree.map(np.ones_like, (theta, outer_state))
  program = fault_tolerant._sync_program(config, tuple(jax.devices()[:3]))

  def run(weights):
    rows = [(theta, outer_state, local[0], weights[0], True),
            (theta, outer_state, local[1], weights[1], False),
            (stale_theta, stale_state, stale_theta, weights[2], False)]
    new_theta, new_state = program(*jax.tree.map(
        lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows))
    for leaf in jax.tree.leaves((new_theta, new_state)):  # the same bits on every device
      shards = [np.asarray(s.data) for s in leaf.addressable_shards]
      assert all(s.view(np.int32).tolist() == shards[0].view(np.int32).tolist() for s in shards)
    return np.asarray(new_theta["w"]), np.asarray(new_state[0].trace["w"])

  new_theta, _ = run([1.0, 1.0, 0.0])
  delta = (2 * theta["w"] - local[0]["w"] - local[1]["w"]) / 2
  expected = theta["w"] - 0.7 * (delta + 0.9 * (0.9 * momentum["w"] + delta))
  np.testing.assert_allclose(new_theta, expected, **helpers.rounding_tol(8))
  kept_theta, kept_momentum = run([0.0, 0.0, 0.0])
  assert kept_theta.view(np.int32).tolist() == theta["w"].view(np.int32).tolist()
  assert kept_momentum.view(np.int32).tolist() == momentum["w"].view(np.int32).tolist()
