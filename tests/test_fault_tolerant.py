"""Fault-tolerant DiLoCo (``jaxcomp.train.fault_tolerant``), across processes x 2 CPU devices (slow
tier): a process killed during its inner steps and restarted rejoins at the next synchronization,
another one dies inside a synchronization, and every process's θ and outer state are bit-identical
after every synchronization; process 0's death ends the others with one line, and a restart on 2
processes resumes from the last synchronization's checkpoint, each process taking back its own
inner optimizer's state. And one synchronization's program on simulated devices against NumPy
(fast tier)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.train import fault_tolerant, fault_tolerant_checkpoints
import helpers
from helpers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "fault_tolerant.py"
PROCESSES, SYNC_EVERY, STEPS, KILL_AFTER, DIE_IN_SYNC_AT = 3, 5, 100, 10, 75
KILL_0_AFTER, RESUMED_STEPS = 20, 50  # process 0's death, and the step count of the job it ends
STREAMING_STEPS = 60
HANG_AT, HANG_STEPS = 15, 30  # a process hangs in the synchronization at HANG_AT of a shorter job
COLLECTIVE_TIMEOUT, VOTE_TIMEOUT = 20, 60  # seconds: the worker's, and train's default
DEADLINE = 240  # seconds for a whole job; it takes about a fifth of that


class Job:
  """Workers of one job on 127.0.0.1, their files in ``folder``; leaving the ``with`` block kills
  the ones still running, whatever happened."""

  def __init__(self, folder, processes, steps, *flags):
    self.folder, self.processes, self.steps, self.flags = folder, processes, steps, flags
    self.port, self.started, self.deadline = free_port(), [], time.time() + DEADLINE
    folder.mkdir(parents=True, exist_ok=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for p in self.started:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

  def start(self, i, *flags):
    """Process ``i``: stdout to process{i}.log, stderr to process{i}.err (appended on a restart)."""
    self.started.append(subprocess.Popen(
        [sys.executable, "-u", str(WORKER), "--coordinator", f"127.0.0.1:{self.port}",
         "--process-id", str(i), "--processes", str(self.processes), "--steps", str(self.steps),
         "--sync-every", str(SYNC_EVERY), "--step-seconds", "0.1",
         "--collective-timeout", str(COLLECTIVE_TIMEOUT),
         "--out", str(self.folder / f"process{i}.jsonl"), *self.flags, *flags],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=open(self.folder / f"process{i}.log", "a"),
        stderr=open(self.folder / f"process{i}.err", "a"), start_new_session=True))
    return self.started[-1]

  def records(self, i):
    """Process ``i``'s lines of JSON (one per synchronization that counted)."""
    path = self.folder / f"process{i}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def text(self, i, kind):
    path = self.folder / f"process{i}.{kind}"
    return path.read_text() if path.exists() else ""

  def logs(self):
    return "\n".join(f"--- process {i} {kind}\n" + self.text(i, kind)[-3000:]
                     for i in range(self.processes) for kind in ("log", "err"))

  def wait_for(self, condition, running):
    while not condition():
      assert time.time() < self.deadline and all(p.poll() is None for p in running), self.logs()
      time.sleep(0.02)

  def wait(self, process):
    return process.wait(timeout=max(1, self.deadline - time.time()))


def assert_bit_identical(by_process, steps):
  """Every process's copy of θ and the outer state after each synchronization is the same bits."""
  for step in steps:
    copies = {(r["theta"], r["outer"]) for rs in by_process for r in rs if r["step"] == step}
    assert len(copies) == 1, (step, copies)


@pytest.mark.slow
def test_a_killed_process_rejoins_and_every_process_stays_bit_identical(tmp_path):
  """MuLoCo (Muon inside, a 2-bit exchange with error feedback): process 2 is killed during its
  inner steps and restarted; later, process 1 dies inside the synchronization at step
  DIE_IN_SYNC_AT. The job reaches its step count, every synchronization counts on the survivors,
  and every copy of θ and the outer state is the same bits. Every change of the members runs on
  the devices the round before it named ahead, whose program the members compiled meanwhile."""
  with Job(tmp_path, PROCESSES, STEPS, "--muloco") as job:
    first = [job.start(i, *(["--signal-in-sync", f"{DIE_IN_SYNC_AT}:SIGKILL"] if i == 1 else []))
             for i in range(PROCESSES)]
    # Kill process 2 right after a synchronization: during its inner steps.
    job.wait_for(lambda: any(r["step"] >= KILL_AFTER for r in job.records(2)), first)
    os.killpg(first[2].pid, signal.SIGKILL)
    killed = time.time()
    first[2].wait()
    killed_at = len(job.records(2))
    # Restart it once the survivors have synchronized without it.
    job.wait_for(lambda: any(r["members"] == [0, 1] for r in job.records(0)), first[:2])
    rejoined = job.start(2)
    for p in (first[0], rejoined):
      assert job.wait(p) == 0, job.logs()
    assert job.wait(first[1]) == -signal.SIGKILL, job.logs()
    by_process = [job.records(i) for i in range(PROCESSES)]
    died_in_sync = f"SIGKILL inside the synchronization at step {DIE_IN_SYNC_AT}" in job.text(
        1, "log")
    retried = "did not count; retrying" in job.text(0, "err")
    afresh = "process 2: its inner optimizer's state starts afresh" in job.text(2, "err")
    loaded = "process 2: its inner step loaded from its earlier life's binary" in job.text(2, "err")

  expected_steps = list(range(0, STEPS + 1, SYNC_EVERY))
  # Every synchronization counted on process 0, to the job's step count; process 1's last one was
  # the one before it died in.
  assert [r["step"] for r in by_process[0]] == expected_steps
  assert [r["step"] for r in by_process[1]] == list(range(0, DIE_IN_SYNC_AT, SYNC_EVERY))
  assert died_in_sync and retried and afresh and loaded, job.logs()
  # The survivors went on without process 2, took it back, then went on without process 1 from
  # the synchronization it died in.
  members = [tuple(r["members"]) for r in by_process[0]]
  assert (0, 1) in members, members
  assert members[expected_steps.index(DIE_IN_SYNC_AT) - 1] == (0, 1, 2), members
  assert members[expected_steps.index(DIE_IN_SYNC_AT):] == [(0, 2)] * (
      len(expected_steps) - expected_steps.index(DIE_IN_SYNC_AT)), members
  second_life = by_process[2][killed_at:]
  assert second_life and second_life[0]["pid"] != by_process[2][0]["pid"]
  assert tuple(second_life[0]["members"]) == (0, 1, 2) and second_life[-1]["step"] == STEPS
  # Bit-identical: every copy of θ and the outer state after each synchronization, the rejoined
  # process's first one included.
  assert_bit_identical(by_process, expected_steps)
  assert len({r["theta"] for r in by_process[0]}) == len(expected_steps)  # θ moved every time
  rounds = [json.loads(line) for line in (tmp_path / "process0.jsonl.rounds").read_text()
            .splitlines()]
  changes = [(before, after) for before, after in zip(rounds, rounds[1:])
             if after["members"] != before["members"]]
  assert len(changes) >= 3, rounds
  for before, after in changes:
    assert [after["members"], after["devices"]] in before["ahead"], (before, after)
  went_on = next(r["time"] for r in by_process[0] if r["members"] == [0, 1]) - killed
  back = second_life[0]["time"] - killed
  died = by_process[1][-1]["time"]
  after = by_process[0][expected_steps.index(DIE_IN_SYNC_AT)]["time"] - died
  print(f"members by synchronization: {members}; the survivors synchronized without process 2 "
        f"{went_on:.1f} s after the kill, and with it again {back:.1f} s after; the "
        f"synchronization process 1 died in counted {after:.1f} s after its previous one")


@pytest.mark.slow
def test_streaming_diloco_survives_a_kill_and_the_restarted_process_receives_every_fragment(
    tmp_path):
  """Streaming DiLoCo, 2 fragments (a synchronization every 5 steps, each fragment's every 10):
  process 2 is killed during its inner steps and restarted. Every copy of θ and the outer states
  is the same bits after every synchronization, the rejoined process's first one included; a
  synchronization without a process joining moves only its own fragment of θ, each in turn."""
  with Job(tmp_path, PROCESSES, STREAMING_STEPS, "--fragments", "2", "--sync-every", "10") as job:
    first = [job.start(i) for i in range(PROCESSES)]
    job.wait_for(lambda: any(r["step"] >= KILL_AFTER for r in job.records(2)), first)
    os.killpg(first[2].pid, signal.SIGKILL)
    first[2].wait()
    killed_at = len(job.records(2))
    job.wait_for(lambda: any(r["members"] == [0, 1] for r in job.records(0)), first[:2])
    rejoined = job.start(2)
    for p in (first[0], first[1], rejoined):
      assert job.wait(p) == 0, job.logs()
    by_process = [job.records(i) for i in range(PROCESSES)]
    rounds = [json.loads(line) for line in (tmp_path / "process0.jsonl.rounds").read_text()
              .splitlines()]

  expected_steps = list(range(0, STREAMING_STEPS + 1, 5))
  assert [r["step"] for r in by_process[0]] == expected_steps
  assert_bit_identical(by_process, expected_steps)
  second_life = by_process[2][killed_at:]
  assert second_life and second_life[0]["pid"] != by_process[2][0]["pid"]
  assert second_life[0]["pieces"] == next(r for r in by_process[0]
                                          if r["step"] == second_life[0]["step"])["pieces"]
  assert [r["fragment"] for r in by_process[0][1:]] == [(s // 5 - 1) % 2
                                                        for s in expected_steps[1:]]
  joined_at = {r["step"] for r, plan in zip(by_process[0], counted(rounds)) if plan["joining"]}
  assert len(joined_at) == 2, joined_at  # the job's start and process 2's return
  for before, after in zip(by_process[0], by_process[0][1:]):
    moved = [a != b for a, b in zip(before["pieces"], after["pieces"])]
    if after["step"] not in joined_at:
      assert moved == [q == after["fragment"] for q in range(2)], (before, after)


def counted(rounds):
  """Process 0's rounds that counted: the last of each step's (a failed one is retried)."""
  return list({r["step"]: r for r in rounds}.values())


@pytest.mark.slow
def test_process_0s_death_ends_the_job_in_one_line_and_2_processes_resume_from_its_checkpoint(
    tmp_path):
  """3 processes write a checkpoint at every synchronization (process 0, with orbax); process 0 is
  killed; the others end within a minute, each with one line on stderr. The same job restarted on
  2 processes resumes from the newest checkpoint: the same step, θ and outer state bit for bit
  (so the same held-out loss), and trains on to its step count."""
  flags = ("--checkpoint-dir", str(tmp_path / "checkpoints"))
  with Job(tmp_path / "on3", PROCESSES, RESUMED_STEPS, *flags) as on3:
    first = [on3.start(i) for i in range(PROCESSES)]
    on3.wait_for(lambda: any(r["step"] >= KILL_0_AFTER for r in on3.records(0)), first)
    time.sleep(0.2)  # into the inner steps: the synchronization's checkpoints written
    os.killpg(first[0].pid, signal.SIGKILL)
    killed = time.time()
    for p in first[1:]:
      assert p.wait(timeout=60) == 1, on3.logs()
    ended = time.time() - killed
    before = on3.records(0)
    for i in range(1, PROCESSES):
      assert on3.text(i, "err").strip().splitlines() == [
          f"jaxcomp.train.fault_tolerant: process {i} stops: {fault_tolerant.LOST}; the job "
          f"cannot go on without process 0: restart every process, and "
          f"train(checkpoint_dir=...) resumes from the last synchronization's checkpoint"], \
          on3.logs()
  with Job(tmp_path / "on2", 2, RESUMED_STEPS, *flags) as on2:
    resumed = [on2.start(i) for i in range(2)]
    for p in resumed:
      assert on2.wait(p) == 0, on2.logs()
    after = [on2.records(i) for i in range(2)]
    assert "resuming from the checkpoint of step" in on2.text(0, "err"), on2.logs()
    inner_restored = [f"process {i}: its inner optimizer's state restored from step" in
                      on2.text(i, "err") for i in range(2)]

  # The newest checkpoint is the last synchronization's, or the one before where process 0 died
  # while writing it.
  start = after[0][0]["step"]
  assert start in (before[-1]["step"], before[-1]["step"] - SYNC_EVERY), (start, before)
  checkpointed = next(r for r in before if r["step"] == start)
  assert {k: after[0][0][k] for k in ("theta", "outer", "loss")} == {
      k: checkpointed[k] for k in ("theta", "outer", "loss")}
  assert after[0][0]["members"] == [0, 1]
  assert inner_restored == [True, True]  # processes 0 and 1 take back their own inner states
  for i in range(2):
    assert [r["step"] for r in after[i]] == list(range(start, RESUMED_STEPS + 1, SYNC_EVERY))
  assert [(r["theta"], r["outer"]) for r in after[0]] == [
      (r["theta"], r["outer"]) for r in after[1]]
  print(f"the others ended {ended:.1f} s after process 0's death; held-out loss by "
        f"synchronization: {[round(r['loss'], 4) for r in before]} before, "
        f"{[round(r['loss'], 4) for r in after[0]]} after the restart on 2")


@pytest.mark.slow
def test_a_process_that_hangs_inside_a_synchronization_is_timed_out_and_left_behind(tmp_path):
  """Process 1 stops (SIGSTOP) as its round of the synchronization at HANG_AT begins: its
  connections stay open, so only the collective timeout ends the others' wait. The round is
  retried over processes 0 and 2, bit-identical, and they reach the job's step count."""
  with Job(tmp_path, PROCESSES, HANG_STEPS) as job:
    started = [job.start(i, *(["--signal-in-sync", f"{HANG_AT}:SIGSTOP"] if i == 1 else []))
               for i in range(PROCESSES)]
    for i in (0, 2):
      assert job.wait(started[i]) == 0, job.logs()
    hung = started[1].poll() is None  # stopped, until leaving the block kills it
    by_process = [job.records(i) for i in range(PROCESSES)]
    failed = [line for line in job.text(0, "err").splitlines() if "failed:" in line]

  steps = list(range(0, HANG_STEPS + 1, SYNC_EVERY))
  at = steps.index(HANG_AT)
  assert hung and failed, failed
  assert [r["step"] for r in by_process[0]] == [r["step"] for r in by_process[2]] == steps
  assert [r["step"] for r in by_process[1]] == steps[:at]
  assert [tuple(r["members"]) for r in by_process[0]] == [(0, 1, 2)] * at + [(0, 2)] * (
      len(steps) - at)
  assert_bit_identical(by_process, steps)
  waited = by_process[0][at]["time"] - by_process[0][at - 1]["time"]
  assert COLLECTIVE_TIMEOUT <= waited < VOTE_TIMEOUT, waited
  print(f"the synchronization process 1 hung in counted {waited:.1f} s after the one before it; "
        f"process 0's round failed with: {failed[0][:200]}")


def test_process_0_is_refused_shapes_for_the_initial_parameters():
  """Process 0 sends θ, so it needs values; the others may pass shapes (the slow tests' do)."""
  with pytest.raises(TypeError, match=r"params: process 0 sends θ .* got a shape"):
    fault_tolerant._value(jax.ShapeDtypeStruct((2, 3), np.float32))


def sync_program(compressor, like, **outer):
  """One synchronization's program on 3 simulated devices (``outer``: DiLoCo's outer settings)
  and its compressor's initial state stacked for them."""
  config = jaxcomp.DiLoCoConfig(inner=optax.sgd(0.1), sync_every=2, compressor=compressor, **outer)
  devices = tuple(jax.devices()[:3])
  with jax.set_mesh(jax.sharding.Mesh(np.asarray(devices), ("replica",))):
    state = optax.EmptyState() if compressor is None else compressor.init(like)
  return config, fault_tolerant._sync_program(config, devices), jax.tree.map(
      lambda x: np.stack([np.asarray(x)] * 3), state)


def same_bits_on_every_device(tree):
  for leaf in jax.tree.leaves(tree):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert all(s.view(np.int32).tolist() == shards[0].view(np.int32).tolist() for s in shards)


@pytest.mark.numeric
@pytest.mark.parametrize("compressor", [None, jaxcomp.allreduce(axis_name="replica")],
                         ids=["exact", "through_a_compressor"])
def test_a_synchronization_averages_over_the_members_that_trained_and_sends_theta_bit_for_bit(
    compressor):
  """One synchronization's program on 3 simulated devices, one per member: member 0 is the source,
  member 2 joins with a stale θ and momentum (weight 0). θ is NumPy DiLoCo's outer step on the
  mean of members 0 and 1 (exactly, or through a compressor's mean over all three of the shares
  scaled by 3 / 2), the same bits on every device; with nobody trained, every device gets the
  source's θ and momentum bit for bit (a -0.0 included)."""
  rng = np.random.default_rng(0)
  theta = {"w": rng.normal(size=(3, 5)).astype(np.float32)}
  theta["w"][0, 0] = -0.0
  momentum = {"w": rng.normal(size=(3, 5)).astype(np.float32)}
  local = [{"w": theta["w"] + rng.normal(size=(3, 5)).astype(np.float32)} for _ in range(2)]
  config, program, compressor_state = sync_program(compressor, theta)
  outer_state = config.outer_optimizer().init(theta)
  outer_state = (outer_state[0]._replace(trace=momentum),) + tuple(outer_state[1:])
  stale_theta, stale_state = jax.tree.map(np.ones_like, (theta, outer_state))

  def run(weights):
    rows = [(theta, outer_state, local[0], weights[0], True),
            (theta, outer_state, local[1], weights[1], False),
            (stale_theta, stale_state, stale_theta, weights[2], False)]
    new_theta, new_state, _ = program(*jax.tree.map(
        lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows), compressor_state)
    same_bits_on_every_device((new_theta, new_state))
    return np.asarray(new_theta["w"]), np.asarray(new_state[0].trace["w"])

  new_theta, _ = run([1.0, 1.0, 0.0])
  delta = (2 * theta["w"] - local[0]["w"] - local[1]["w"]) / 2
  expected = theta["w"] - 0.7 * (delta + 0.9 * (0.9 * momentum["w"] + delta))
  np.testing.assert_allclose(new_theta, expected, **helpers.rounding_tol(8))
  kept_theta, kept_momentum = run([0.0, 0.0, 0.0])
  assert kept_theta.view(np.int32).tolist() == theta["w"].view(np.int32).tolist()
  assert kept_momentum.view(np.int32).tolist() == momentum["w"].view(np.int32).tolist()


@pytest.mark.parametrize("way", ["muloco", "sparseloco"])
def test_a_compressed_exchange_gives_every_member_the_same_theta_and_each_its_own_error(way):
  """MuLoCo's exchange (2 bits, a decaying error) and SparseLoCo's (the 2 largest of every 64
  values, in 2 bits, no outer momentum): θ the same bits on every member, each member keeps its
  own error feedback; MuLoCo's θ is within the codes' error of the exact step, SparseLoCo's moves
  only where a member sent a value."""
  rng = np.random.default_rng(1)
  theta = {"w": rng.normal(size=(4, 64)).astype(np.float32)}
  local = [{"w": theta["w"] + rng.normal(size=(4, 64)).astype(np.float32)} for _ in range(3)]
  if way == "muloco":
    compressor, outer = jaxcomp.quantized(2, error_decay=0.9, axis_name="replica"), {}
  else:
    compressor = jaxcomp.chunked_topk(2, chunk=64, error_decay=0.95, axis_name="replica")
    outer = dict(outer_momentum=0.0, outer_learning_rate=1.0)
  config, program, compressor_state = sync_program(compressor, theta, **outer)
  _, exact_program, _ = sync_program(None, theta)
  outer_state = config.outer_optimizer().init(theta)
  rows = [(theta, outer_state, local[i], 1.0, i == 0) for i in range(3)]
  stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows)
  new_theta, _, new_state = program(*stacked, compressor_state)
  same_bits_on_every_device(new_theta)
  moved = np.asarray(new_theta["w"]) != theta["w"]
  if way == "muloco":
    want, _, _ = exact_program(*stacked, optax.EmptyState())
    # Ternary codes of a scale per 256 values (their largest): each value within half of it, and
    # the outer step multiplies the mean's error by 0.7 × (1 + 0.9).
    bound = 0.7 * 1.9 * 0.5 * max(np.abs(theta["w"] - x["w"]).max() for x in local) * 1.01
    assert np.abs(np.asarray(new_theta["w"]) - np.asarray(want["w"])).max() <= bound
    error = np.asarray(new_state.worker_error["w"])
  else:  # 4 chunks of 64, 2 values each, from each of 3 members
    assert 0 < moved.sum() <= 3 * 2 * 4
    error = np.asarray(new_state.error["w"])
  assert len({error[i].tobytes() for i in range(3)}) == 3 and np.abs(error).max() > 0


def test_inner_states_keep_the_newest_files_and_refuse_another_optimizers_state(tmp_path):
  """A process's inner states round-trip bit for bit, the newest ``KEEP`` stay, a step never
  written restores as None, and a state of other shapes is refused, naming the file."""
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
  adam = optax.adamw(1e-3)
  state = adam.update(params, adam.init(params), params)[1]
  states = fault_tolerant_checkpoints.InnerStates(str(tmp_path))
  for step in range(0, 25, 5):
    states.save(step, state)
  states.close()
  assert states.steps() == [10, 15, 20]
  restored = states.restore(20, adam.init(params))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
  assert states.restore(5, adam.init(params)) is None
  with pytest.raises(ValueError, match="another inner optimizer's state"):
    states.restore(20, optax.sgd(0.1, momentum=0.9).init(params))


def test_fragments_split_the_parameters_in_turn_and_refuse_a_count_that_does_not_fit():
  """Streaming DiLoCo's fragments: whole leaves (each bias with its kernel), pieces and whole
  inverse of each other, each fragment due in turn; a count that does not divide the period or
  leaves a fragment empty is refused, naming ``fragments``."""
  params = {"a": {"b": np.zeros(3, np.float32), "w": np.ones((2, 3), np.float32)},
            "z": {"b": np.zeros(4, np.float32), "w": np.ones((3, 4), np.float32)}}
  parts = fault_tolerant.Fragments.of(params, 2, sync_every=10)
  assert parts.layout == ((0, 1), (2, 3))
  pieces = parts.pieces(params)
  assert [[x.shape for x in piece] for piece in pieces] == [[(3,), (2, 3)], [(4,), (3, 4)]]
  jax.tree.map(np.testing.assert_array_equal, parts.whole(pieces), params)
  assert [parts.due(step, 5) for step in (5, 10, 15, 20)] == [0, 1, 0, 1]
  for count, sync_every in ((3, 10), (3, 9), (0, 10)):
    with pytest.raises(ValueError, match="fragments"):
      fault_tolerant.Fragments.of(params, count, sync_every=sync_every)
