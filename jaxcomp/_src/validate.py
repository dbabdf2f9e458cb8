"""Argument checks shared by every configuration: one small predicate per check, one exception policy.

TypeError for a value of the wrong type, ValueError for a value of the right type that makes no sense;
every message names the argument, says what was expected and shows what came::

  rank must be a positive int; got 1.5 (float)
  ratio must be a number in (0, 1]; got 1.5

Hyperparameters that fix shapes (a rank, a density, a chunk count) are static: a traced value — from
``optax.inject_hyperparams``, say — is refused with a message that says why and what to do instead.
The few that may be arrays (a momentum, a clipping norm) are ``traceable``: a configuration holds
``TRACED`` in their place and the step receives the arrays (``jaxcomp._src.compressor``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np


class _Traced:
  """The type of ``TRACED``."""

  def __repr__(self) -> str:
    return "TRACED"


TRACED = _Traced()
"""A configuration's value of a traceable hyperparameter that was given as an array: the
transformation holds the array and hands it to each step; the static configuration records only this."""


def is_array(value) -> bool:
  """True for JAX and NumPy arrays and tracers: what ``optax.inject_hyperparams`` passes."""
  return isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer))


def traceable(value, check: Callable[[Any], Any]) -> Any:
  """``check(value)`` for a Python value; ``TRACED`` and arrays are returned as they are (a scalar
  array that is concrete is checked as its number would be; a tracer cannot be)."""
  if value is TRACED:
    return value
  if is_array(value):
    if np.ndim(value) != 0:
      raise ValueError(f"a traced hyperparameter must be a scalar; got an array of shape "
                       f"{np.shape(value)}")
    if not isinstance(value, jax.core.Tracer):
      check(float(value))
    return value
  return check(value)


def _got(value) -> str:
  return f"got {value!r} ({type(value).__name__})"


def _refuse_traced(value, name: str, static: Optional[str]) -> None:
  if is_array(value):
    why = f": it {static}" if static else ""
    raise TypeError(f"{name} is static{why}; give a Python number, not an array "
                    f"(got {type(value).__name__}). Under optax.inject_hyperparams list it in "
                    f"static_args=({name!r},).")


def integer(value, name: str, minimum: int = 0, static: Optional[str] = None) -> int:
  """An int (not a bool) ≥ ``minimum``."""
  what = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
  _refuse_traced(value, name, static)
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be {what}; {_got(value)}")
  if value < minimum:
    raise ValueError(f"{name} must be {what}; got {value!r}")
  return int(value)


def boolean(value, name: str) -> bool:
  """A bool (Python's or NumPy's)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool; {_got(value)}")
  return bool(value)


def number(value, name: str, low: float = -math.inf, high: float = math.inf, *,
           low_open: bool = False, high_open: bool = False,
           static: Optional[str] = None) -> float:
  """A finite real number (not a bool) in the interval from ``low`` to ``high``."""
  if low == -math.inf and high == math.inf:
    what = "a finite number"
  elif high == math.inf:
    what = f"a finite number {'>' if low_open else '>='} {low:g}"
  else:
    what = (f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")
  _refuse_traced(value, name, static)
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be {what}; {_got(value)}")
  inside = (math.isfinite(value) and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high))
  if not inside:
    raise ValueError(f"{name} must be {what}; got {value!r}")
  return float(value)


def density(value, name: str, static: Optional[str] = None) -> float:
  """A fraction in (0, 1]."""
  return number(value, name, 0, 1, low_open=True, static=static)


def choice(value, name: str, choices: Sequence) -> Any:
  """One of ``choices``."""
  if value not in choices:
    names = [repr(c) for c in choices]
    options = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    raise ValueError(f"{name} must be {options}; got {value!r}")
  return value


def function(value, name: str, signature: str) -> Callable:
  """A callable; ``signature`` says how it is called, for the message."""
  if not callable(value):
    raise TypeError(f"{name} must be callable as {signature}; {_got(value)}")
  return value


def transformation(value, name: str, example: str):
  """An ``optax.GradientTransformation``; ``example`` shows one, for the message."""
  import optax  # noqa: PLC0415 (the only check that needs it)
  if not isinstance(value, optax.GradientTransformation):
    raise TypeError(f"{name} must be an optax.GradientTransformation, e.g. {example}; "
                    f"{_got(value)}")
  return value
