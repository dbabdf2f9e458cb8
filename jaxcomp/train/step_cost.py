"""The projected time of a step and of a run: the step's compute plus its communication under the
α-β model (``jaxcomp.train.network``), less what an overlap hides where it is credited; and the link
speed at which two projections take as long."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from jaxcomp.train import network

SPEEDS = (1e-3, 1e5)
"""The link speeds (Gbit/s) a crossover is looked for in."""
BACKWARD = 2 / 3
"""The backward pass's share of the model's step: 2 of its 3 × forward FLOPs."""


def step_seconds(compute_s: float, ops: Sequence, world: int, alpha: float, gbits: float,
                 kind: Optional[str], backward_s: float, credit: bool = True) -> float:
  """One step: ``compute_s`` and the communication of ``ops`` (``[(op, bytes, share)]``) at
  ``gbits``, less what the overlap ``kind`` hides when ``credit``."""
  beta = network.gbits_to_beta(gbits)
  comm = network.step_time(ops, world, alpha, beta)
  return compute_s + comm - (hidden(compute_s, ops, world, alpha, beta, kind, backward_s)
                             if credit else 0.0)


def hidden(compute_s: float, ops: Sequence, world: int, alpha: float, beta: float,
           kind: Optional[str], backward_s: float) -> float:
  """Seconds of communication per step the overlap ``kind`` hides (module docstring)."""
  if kind == "backward":
    return min(network.step_time(ops, world, alpha, beta), backward_s)
  if kind == "inner step":
    return sum(share * min(network.comm_time([(op, b)], world, alpha, beta), compute_s)
               for op, b, share in ops)
  return 0.0


def seconds(programs: Sequence, world: int, alpha: float, gbits: float, backward_s: float,
            credit: bool = True) -> float:
  """Seconds of ``programs`` (``[(steps, compute seconds, operands, overlap kind)]``), summed."""
  return sum(n * step_seconds(c, ops, world, alpha, gbits, kind, backward_s, credit)
             for n, c, ops, kind in programs)


def crossover(programs: Sequence, base: Sequence, world: int, alpha: float = network.ALPHA,
              backward_s: float = 0.0, credit: bool = True) -> tuple:
  """Where ``programs`` take as long as ``base``: ``("below", g)`` when they are faster below
  ``g`` Gbit/s and slower above, ``("above", g)`` the other way, ``("always", None)`` /
  ``("never", None)`` when faster / not faster throughout ``SPEEDS``."""
  def gap(log_g):
    g = 10.0**log_g
    return (seconds(programs, world, alpha, g, backward_s, credit)
            - seconds(base, world, alpha, g, backward_s, credit))
  grid = np.linspace(math.log10(SPEEDS[0]), math.log10(SPEEDS[1]), 161)
  signs = [gap(x) < 0 for x in grid]
  if all(signs):
    return ("always", None)
  if not any(signs):
    return ("never", None)
  i = next(i for i in range(len(grid) - 1) if signs[i] != signs[i + 1])
  low, high = grid[i], grid[i + 1]
  for _ in range(60):  # bisection in log speed
    mid = (low + high) / 2
    if (gap(mid) < 0) == signs[i]:
      low = mid
    else:
      high = mid
  return ("below" if signs[i] else "above", 10.0 ** ((low + high) / 2))
