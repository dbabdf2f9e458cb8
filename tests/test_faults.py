"""The chaos harness (``benchmarks/faults.py``): its schedule and report arithmetic (fast), and its
jaxcomp side on a tiny schedule, one kill and one restart over 3 nodes' rate-limited links (slow;
needs root and ``ip`` / ``tc``, as the other link tests)."""

import argparse
import os
import subprocess

import pytest

from benchmarks import faults
from jaxcomp.train import namespaces

REASON = namespaces.unavailable_reason()


def test_the_schedule_is_seeded_and_the_report_counts_the_steps_that_entered_a_sync():
  plan = faults.schedule(3, period=60, down=10, until=200, processes=3)
  assert plan == faults.schedule(3, period=60, down=10, until=200, processes=3)
  assert [(at, back) for at, _, back in plan] == [(60, 70), (120, 130), (180, 190)]
  assert {rank for _, rank, _ in faults.schedule(0, 1, 0.5, 200, 3)} == {1, 2}
  with pytest.raises(ValueError, match="down must be"):
    faults.schedule(0, period=10, down=10, until=100, processes=3)

  def line(t, step, trained, pid, digest="a", loss=None):
    return {"time": t, "step": step, "trained": trained, "pid": pid, "digest": digest,
            "loss": loss}
  # Process 2 dies after step 20, comes back at step 40 (untrained there) and trains on.
  records = [[line(0, 0, False, 1), line(2, 20, True, 1), line(5, 40, True, 1),
              line(8, 60, True, 1, loss=2.5)],
             [line(0, 0, False, 2), line(2, 20, True, 2), line(5, 40, True, 2),
              line(8, 60, True, 2)],
             [line(0, 0, False, 3), line(2, 20, True, 3), line(5, 40, False, 4),
              line(8, 60, True, 4)]]
  got = faults.report(records, kills=[(3.0, 2)], sync_every=20)
  assert got["useful"] == 20 * 8 and got["seconds"] == 8 and got["goodput"] == 20
  assert got["kill_to_sync"] == [2.0] and got["loss"] == 2.5 and got["rejoined"] == [2]
  assert got["agree"] and got["checked"] == 4
  records[1][2]["digest"] = "b"
  assert not faults.report(records, [], 20)["agree"]
  free = dict(got, goodput=20.0, loss=2.5)
  cells = faults.row("jaxcomp", 1, free, dict(got, goodput=15.0, loss=2.6, agree=True))
  assert cells[5] == "75% (missed)" and cells[8] == "+4.00% (missed)" and cells[2] == "1 (2)"


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
def test_jaxcomps_side_survives_a_kill_takes_the_process_back_and_stays_bit_identical():
  """One kill 2 s into the training and a restart 1.5 s later: every synchronization's copies
  of θ and the outer state hash the same on every process, the killed one came back, and the
  goodput is the useful steps measured over the seconds measured, at most every step of every
  process. Nothing is left behind."""
  args = argparse.Namespace(rate="100mbit", quick=True, steps=360, timeout=150, logs=None)
  plan = faults.schedule(0, period=2, down=1.5, until=3, processes=faults.PROCESSES)
  assert len(plan) == 1
  before = set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                              text=True).stdout.split())
  got = faults.run("jaxcomp", args, plan)
  after = set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                             text=True).stdout.split())
  assert not {n for n in after - before if n.startswith(namespaces.PREFIX)}
  assert got["kills"] == 1 and got["rejoined"] == [plan[0][1]], got
  assert got["agree"] and got["checked"] == args.steps // faults.SYNC_EVERY + 1, got
  assert got["kill_to_sync"][0] is not None and got["kill_to_sync"][0] > 0
  assert 0 < got["useful"] <= faults.PROCESSES * args.steps
  assert got["goodput"] == pytest.approx(got["useful"] / got["seconds"])
  assert 0 < got["useful"] / (faults.PROCESSES * args.steps) <= 1
  print(f"{got} (pid {os.getpid()})")
