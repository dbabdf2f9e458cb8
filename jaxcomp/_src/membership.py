"""Who takes part in each synchronization of a job that survives its processes' deaths, and on which
devices, on JAX's own coordination service (``jax.distributed``).

Every workaround for what JAX does not yet do (on CPU, or at all) is here, and only here. Checked
on jax 0.10.2 (CPU, gloo collectives, processes on 127.0.0.1):

* ``jax_enable_recoverability`` lets the other processes go on when one dies, and the service's
  ``get_live_nodes`` (what ``multihost_utils.live_devices`` is built on) is a barrier over the live
  processes that answers their incarnations (a restarted process has a new one).
* A collective over a device list that was in use when a process died fails for ever after, on
  every process: XLA:CPU keeps a gloo communicator (and its error) per device list for the life
  of the process, and the rendezvous keys stay in the service's store, so a restarted process gets
  ``ALREADY_EXISTS`` on them. So each *epoch* (a membership, until it changes or a round fails) runs
  its collectives on a device list never used before in the job: each process exposes K CPU
  devices and a round takes one of them per member. The lists run out (K^n of n members): this
  is the limit of the workaround, and the reason to drop it once JAX can rebuild communicators.
* Process 0 hosts the service; its death ends the job. So process 0 also decides: it plans every
  round (members, devices, the step) into each member's key in the store, and decides from the
  members' votes whether the round counts, so that every member takes the same decision.
* When the service is lost, the client aborts its process with a fatal log line and a C++ stack
  trace, within a second; its Python callback for that event (``missed_heartbeat_callback`` of
  the client factory) cannot be used: it is called with an ``absl::Status``, which has no Python
  type, and the process ends in ``std::bad_cast``. So ``Membership.one_line_on_service_loss``
  forks: the parent relays the stderr of the child, which runs the job, and puts one line of its
  own in place of that report.

The steps of a round, per process (the ``# n:`` comments point here):

1. the barrier: ``get_live_nodes`` over every process returns when each live one has called it
   (a dead one is dropped after the heartbeat timeout);
2. process 0 plans the round: the members are the live processes; the devices are the current
   epoch's, or a list never used if the membership changed or the last round failed; and, for
   each membership one death or one return away and for this one, the list it would get next
   (``Round.ahead``);
3. each member reads its plan (its key carries its incarnation and its count of rounds);
4. after its collectives each member votes; process 0 waits for the votes (up to ``vote_timeout``)
   and writes the decision: the round counts if every member voted yes.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import sys
import time
from typing import NamedTuple

import jax

from jaxcomp._src import jax_internals


SERVICE_LOST = b"the JAX distributed service detected fatal errors"  # the client's fatal log line
HOLD = 0.5  # seconds the parent holds a line of stderr: JAX's report comes faster than that


class Round(NamedTuple):
  """One synchronization attempt of ``Membership``, the same on every member.

  Attributes:
    number: the round's number in the job (every attempt counts).
    step: the job's step count, process 0's.
    members: the process ids taking part, sorted.
    devices: one device per member, in the members' order.
    ahead: ``(members, devices)`` of each membership one death or one return away from this
      one, and of this one again, on the devices process 0 would give it next: what a member can
      compile before it is needed.
    joining: the members that were not in the last round that counted (a restarted process is
      another incarnation): every member at the job's first round.
  """
  number: int
  step: int
  members: tuple
  devices: tuple
  ahead: tuple = ()
  joining: tuple = ()


class Membership:
  """The rounds of one process of a job that goes on when processes die and rejoin.

  Every process of the job makes one after ``jax.distributed.initialize`` (with
  ``jax_enable_recoverability``) and, at each synchronization, calls ``next_round``, runs its
  collectives over the round's devices, and calls ``agree``; if ``agree`` says no, the round's
  result is dropped everywhere and the process calls ``next_round`` again (the module docstring
  numbers the steps; ``jaxcomp.train.fault_tolerant`` is DiLoCo on it)::

    rounds = jaxcomp.Membership()
    while True:
      this_round = rounds.next_round(step)
      ok = run_the_collectives(this_round.devices)   # False if they failed
      if rounds.agree(this_round, ok):
        break

  Args:
    vote_timeout: seconds process 0 waits for a member's vote (longer than the collective timeout
      and a compilation of the synchronization).
    plan_timeout: seconds a member waits for its plan once the barrier has returned.
  """

  def __init__(self, vote_timeout: float = 60.0, plan_timeout: float = 120.0):
    self.client = jax_internals.distributed_client()
    if self.client is None:
      raise RuntimeError("Membership: jax.distributed is not initialized: call "
                         "jax.distributed.initialize(...) with jax_enable_recoverability first")
    self.me, self.processes = jax.process_index(), jax.process_count()
    self.vote_timeout_ms, self.plan_timeout_ms = int(vote_timeout * 1000), int(plan_timeout * 1000)
    self.rounds_read = 0
    # Process 0's: the next round's number, the lists used, the epoch, each incarnation's count,
    # the incarnations of the last round that counted.
    self.number, self.used, self.epoch, self.accepted, self.sent = 0, set(), None, False, {}
    self.counted = set()

  def next_round(self, step: int) -> Round:
    """Steps 1–3: blocks until the live processes meet.

    Args:
      step: the job's step count here (process 0's is the one every member is told).

    Returns:
      This process's ``Round``.

    Raises:
      RuntimeError: on process 0, when every list of devices for the live processes was used.
    """
    # 1: the barrier over every process; a dead one is dropped after the heartbeat timeout.
    live = self.client.get_live_nodes(list(range(self.processes)))
    if self.me == 0:
      self._plan(live, step)  # 2
    # 3: this incarnation's next plan.
    key = f"membership/plan/{self.me}/{live[self.me]}/{self.rounds_read}"
    plan = json.loads(self.client.blocking_key_value_get(key, self.plan_timeout_ms))
    self.rounds_read += 1
    return Round(plan["number"], plan["step"], tuple(plan["members"]),
                 _devices(plan["members"], plan["devices"]),
                 tuple((tuple(m), _devices(m, d)) for m, d in plan["ahead"]),
                 tuple(plan["joining"]))

  def agree(self, this_round: Round, ok: bool) -> bool:
    """Step 4: votes and waits for process 0's decision.

    Args:
      this_round: the round ``next_round`` returned.
      ok: whether this process's collectives of the round succeeded.

    Returns:
      Whether the round counts: True on every member, or False on every member.
    """
    self.client.key_value_set(f"membership/vote/{this_round.number}/{self.me}", "1" if ok else "0")
    decision = f"membership/decision/{this_round.number}"
    if self.me == 0:
      self.accepted = all(self._vote(this_round.number, p) for p in this_round.members)
      if self.accepted:  # the epoch's incarnations are the round's
        self.counted = set(self.epoch[0])
      self.client.key_value_set(decision, "1" if self.accepted else "0")
    return self.client.blocking_key_value_get(decision, self.plan_timeout_ms) == "1"

  def finish(self) -> None:
    """Leaves the job in order: the other processes disconnect, then process 0, which hosts the
    service, returns once none of them is connected (otherwise their disconnection fails)."""
    if self.me != 0:
      jax.distributed.shutdown()
      return
    while len(self.client.get_live_nodes(list(range(self.processes)))) > 1:
      time.sleep(0.1)

  @staticmethod
  def one_line_on_service_loss(message: str) -> None:
    """Forks. The child returns and runs the job, its stderr a pipe to the parent. The parent relays
    each line of it ``HOLD`` seconds late and ends as the child did, except when the child is
    aborted because the coordination service was lost: then it writes ``message`` in place of the
    lines it holds (JAX's report) and exits with status 1. The child dies with the parent.

    Call it before ``jax.distributed.initialize``, in the processes other than the service's
    (``jaxcomp.train.fault_tolerant.initialize`` does).
    """
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
      os.close(read)
      os.dup2(write, 2)
      os.close(write)
      if sys.platform.startswith("linux"):  # PR_SET_PDEATHSIG: end with the parent
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
      return
    os.close(write)
    signal.signal(signal.SIGTERM, lambda number, frame: os.kill(child, number))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches the child directly
    held, partial, out = [], b"", sys.stderr.buffer
    while True:
      ready, _, _ = select.select([read], [], [], 0.1)
      chunk = os.read(read, 65536) if ready else b""
      if ready and not chunk:  # the end of the pipe: the child has gone
        break
      *lines, partial = (partial + chunk).split(b"\n")
      held += [(time.monotonic(), line + b"\n") for line in lines]
      while held and held[0][0] < time.monotonic() - HOLD:
        out.write(held.pop(0)[1])
      out.flush()
    _, status = os.waitpid(child, 0)
    tail = b"".join(line for _, line in held) + partial
    if os.WIFSIGNALED(status) and SERVICE_LOST in tail:
      tail, status = message.encode() + b"\n", 1 << 8
    out.write(tail)
    out.flush()
    if os.WIFSIGNALED(status):  # end as the child did
      number = os.WTERMSIG(status)
      if number != signal.SIGKILL:
        signal.signal(number, signal.SIG_DFL)
      os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status))

  def _vote(self, number: int, process: int) -> bool:
    try:
      return self.client.blocking_key_value_get(
          f"membership/vote/{number}/{process}", self.vote_timeout_ms) == "1"
    except jax.errors.JaxRuntimeError:  # no vote in time: the member died or hangs
      return False

  def _fresh(self, members: tuple):
    """The first list of device indices (one per member) not yet used by ``members``; None if
    none is left."""
    return next((c for c in itertools.product(range(len(jax.local_devices())),
                                              repeat=len(members))
                 if (members, c) not in self.used), None)

  def _plan(self, live: dict, step: int) -> None:
    members = tuple(sorted(live))
    if not (self.accepted and self.epoch and self.epoch[0] == sorted(live.items())):
      fresh = self._fresh(members)
      if fresh is None:
        raise RuntimeError(
            f"Membership: every list of devices of processes {members} has been used; start "
            f"the processes with more CPU devices (jax_num_cpu_devices, now "
            f"{len(jax.local_devices())}) to survive more membership changes")
      self.used.add((members, fresh))
      self.epoch = (sorted(live.items()), fresh)
    # The memberships one death (of a process other than 0) or one return away, and this one
    # again (after a failed round, or a member's death and return).
    nearby = ([tuple(p for p in members if p != gone) for gone in members if gone != 0] +
              [tuple(sorted(members + (back,))) for back in range(self.processes)
               if back not in members] + [members])
    ahead = [(m, self._fresh(m)) for m in nearby]
    plan = {"number": self.number, "step": step, "members": members, "devices": self.epoch[1],
            "ahead": [(m, c) for m, c in ahead if c is not None],
            "joining": sorted(p for p, incarnation in live.items()
                              if (p, incarnation) not in self.counted)}
    for p, incarnation in live.items():
      count = self.sent.get((p, incarnation), 0)
      self.client.key_value_set(f"membership/plan/{p}/{incarnation}/{count}", json.dumps(plan))
      self.sent[p, incarnation] = count + 1
    self.number += 1


def _devices(members, indices) -> tuple:
  """The devices of a plan: for each member, its ``index``-th device (by id)."""
  by_id = {(d.process_index, d.id): d for d in jax.devices()}
  ids = {p: sorted(i for q, i in by_id if q == p) for p in members}
  return tuple(by_id[p, ids[p][k]] for p, k in zip(members, indices))
