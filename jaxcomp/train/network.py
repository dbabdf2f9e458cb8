"""The α-β model: how long a step's collectives take on W workers, from the bytes they move.

Time of one collective at W workers with latency α per message and bandwidth β (bytes/s) per
worker's link, on a switched network (Thakur, Rabenseifner, Gropp 2005), taking the faster of the
ring and recursive doubling, as collective libraries choose:

* all-reduce of N bytes: min(2(W−1)·(α + N/(W·β)), ⌈log2 W⌉·(α + N/β));
* all-gather of c bytes per worker: min((W−1)·(α + c/β), ⌈log2 W⌉·α + (W−1)·c/β);
* all-to-all of N bytes per worker (pairwise exchange, N/W to each other worker):
  (W−1)·(α + N/(W·β)).

On ONE SHARED MEDIUM (a rate-limited loopback, a hub: every worker's traffic passes one queue of
rate β; ``benchmarks/slow_link.py`` measures such a link), gloo's ring algorithms put W workers'
chunks through the queue at each of their steps, so each worker gets β/W (``shared_medium_time``;
a token bucket's ``burst`` bytes pass at once on each step):

* all-reduce of N bytes: 2(W−1)·(α + N/β);
* all-gather of c bytes per worker: (W−1)·(α + W·c/β);
* all-to-all of N bytes per worker: (W−1)·(α + N/β).

``operands(report)`` reads the ``(op, bytes, share)`` the formulas take from a
``jaxcomp.comm_report`` of one step; ``step_time`` adds up a step's collectives, each weighted by
the share of steps it runs on (a synchronization every H steps counts 1/H). The main job (``python
-m jaxcomp.train``) and ``benchmarks/network_model.py`` use these formulas;
``benchmarks/slow_link.py`` checks the shared-medium form against a real rate-limited link
(``MEASURED_RATIOS``).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

ALPHA = 5e-6
"""Latency per message per link (seconds) unless told otherwise: a few µs, as in a datacenter."""

MEASURED_RATIOS = (1.01, 1.47)
"""The model's predicted / measured step time over a real link, lowest and highest: the
shared-medium form (with the token bucket's burst) against 24 step times (12 programs at 1 Gbit/s
and 100 Mbit/s, W = 4, a 3.6M-parameter MLP, an idle machine) measured by
``benchmarks/slow_link.py`` (BENCHMARKS.md, its ``slow_link`` section: 20 of the 24 within ±25%).
The model never predicts less than was measured; the highest, DGC's 1.42–1.47, are steps measured
faster over the limited links than over the unlimited one, which the compute it is given (the
unlimited link's step) cannot explain: 4 single-threaded workers share 2 cores, all computing at
once over the unlimited link, staggered by the waits of a limited one. The switched form has not
been measured on a real network."""


ALGORITHMS = ("best", "ring", "doubling")
"""What the formulas' ``algorithm`` picks: the faster of the two (as collective libraries choose),
the ring alone, or recursive doubling alone (the tree-shaped one: ⌈log2 W⌉ messages)."""


def _pick(ring: float, doubling: float, algorithm: str) -> float:
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
  return {"best": min(ring, doubling), "ring": ring, "doubling": doubling}[algorithm]


def allreduce_time(nbytes: float, world: int, alpha: float, beta: float,
                   algorithm: str = "best") -> float:
  """Seconds to all-reduce ``nbytes`` on ``world`` workers: the faster of ring and doubling, or
  the one ``algorithm`` names."""
  if world <= 1:
    return 0.0
  ring = 2 * (world - 1) * (alpha + nbytes / (world * beta))
  doubling = math.ceil(math.log2(world)) * (alpha + nbytes / beta)
  return _pick(ring, doubling, algorithm)


def allgather_time(contribution: float, world: int, alpha: float, beta: float,
                   algorithm: str = "best") -> float:
  """Seconds to all-gather ``contribution`` bytes from each of ``world`` workers."""
  if world <= 1:
    return 0.0
  ring = (world - 1) * (alpha + contribution / beta)
  doubling = math.ceil(math.log2(world)) * alpha + (world - 1) * contribution / beta
  return _pick(ring, doubling, algorithm)


def alltoall_time(nbytes: float, world: int, alpha: float, beta: float,
                  algorithm: str = "best") -> float:
  """Seconds for an all-to-all of ``nbytes`` per worker (``nbytes / world`` to each worker): one
  formula (pairwise exchange) whatever ``algorithm`` says."""
  if world <= 1:
    return 0.0
  _pick(0.0, 0.0, algorithm)
  return (world - 1) * (alpha + nbytes / (world * beta))


_SWITCHED = {"all-reduce": allreduce_time, "all-gather": allgather_time,
             "all-to-all": alltoall_time}


def _formula(formulas: dict, op: str):
  if op not in formulas:
    raise ValueError(f"the model has no formula for {op}")
  return formulas[op]


def comm_time(collectives: Iterable[Sequence], world: int, alpha: float, beta: float,
              algorithm: str = "best") -> float:
  """Seconds for ``(op, bytes)`` collectives on a switched network: all-reduce bytes N, all-gather
  bytes per worker, all-to-all bytes N per worker."""
  return sum(_formula(_SWITCHED, op)(nbytes, world, alpha, beta, algorithm)
             for op, nbytes in collectives)


def shared_medium_time(collectives: Iterable[Sequence], world: int, alpha: float,
                       beta: float, burst: float = 0.0) -> float:
  """Seconds of communication per step, on average, for ``(op, bytes, share)`` collectives (as
  ``step_time``'s) on one medium of rate ``beta`` bytes/s shared by all ``world`` workers, with
  gloo's ring algorithms: every ring step moves one chunk per worker through the same queue.

  ``burst``: bytes the medium passes at once before its rate applies, on every step — a token
  bucket's depth (``tc ... tbf burst``), refilled while the workers compute between steps (the
  caller checks that the compute is long enough: ``burst / beta`` seconds). The collectives that run
  on the same steps (the same share) pass their first ``burst`` bytes free of the rate limit, so a
  step that moves little more than the bucket holds takes little longer than on the unlimited link.
  """
  if world <= 1:
    return 0.0
  messages = {"all-reduce": 2 * (world - 1), "all-gather": world - 1, "all-to-all": world - 1}
  through = {"all-reduce": lambda n: 2 * (world - 1) * n,  # bytes through the one queue
             "all-gather": lambda c: (world - 1) * world * c,
             "all-to-all": lambda n: (world - 1) * n}
  by_share = {}
  for op, nbytes, share in collectives:
    by_share[share] = by_share.get(share, 0.0) + _formula(through, op)(nbytes)
  latency = sum(share * messages[op] * alpha for op, _, share in collectives)
  return latency + sum(share * max(moved - burst, 0.0) / beta for share, moved in by_share.items())


def operands(report) -> list:
  """``[(op, bytes, share)]`` of a ``jaxcomp.comm_report``: each collective's bytes as the formulas
  take them (an all-gather's per-worker contribution, the buffer of the others) and the share of
  steady-state steps it runs on."""
  return [(c.op, c.payload_bytes / (c.group_size if c.op == "all-gather" else 1), c.share)
          for c in report.collectives]


def step_time(collectives: Iterable[Sequence], world: int, alpha: float, beta: float,
              algorithm: str = "best") -> float:
  """Seconds of communication per step, on average, for ``(op, bytes, share)`` collectives
  (``operands``) on a switched network: each collective's time times its share; ``algorithm`` as
  ``ALGORITHMS``."""
  return sum(share * comm_time([(op, nbytes)], world, alpha, beta, algorithm)
             for op, nbytes, share in collectives)


def gbits_to_beta(gbits: float) -> float:
  """Bytes per second of a link of ``gbits`` Gbit/s."""
  return gbits * 1e9 / 8
