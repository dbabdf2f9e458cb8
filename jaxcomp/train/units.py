"""How the main job and the planner write sizes and times for people."""

from __future__ import annotations


def human_bytes(b: float) -> str:
  """``b`` bytes in GB, MB or kB (powers of 1,000) with one decimal, or in whole bytes."""
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if b >= size:
      return f"{b / size:.1f} {unit}"
  return f"{b:.0f} B"


def human_ms(ms: float) -> str:
  """``ms`` milliseconds: whole from 100 ms, three significant digits down to 0.01 ms, below that
  in µs."""
  return f"{ms:.0f} ms" if ms >= 100 else f"{ms:#.3g} ms" if ms >= 0.01 else f"{1e3 * ms:.1f} µs"
