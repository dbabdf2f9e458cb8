"""Argument checks shared by every configuration: one small predicate per check, one exception
policy.

TypeError for a value of the wrong type, ValueError for a value of the right type that makes no
sense; every message names the argument, says what was expected and shows what came::

  rank must be a positive int; got 1.5 (float)
  ratio must be a number in (0, 1]; got 1.5

Hyperparameters that fix shapes (a rank, a density, a chunk count) are static: a traced value — from
``optax.inject_hyperparams``, say — is refused with a message that says why and what to do instead.
The few that may be arrays (a momentum, a clipping norm) are ``traceable``: a configuration holds
``TRACED`` in their place and the step receives the arrays (``split_traced``, ``with_traced``).

Every algorithm's configuration is a frozen dataclass derived from ``Config`` whose fields are
declared with ``setting``: the check of each, and whether it may be an array. ``Config`` runs the
checks once, when the factory builds the configuration, and refuses every static setting given as
an array in one message; a configuration adds what relates two settings in ``check``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, ClassVar, Optional, Sequence

import jax
import numpy as np


class _Traced:
  """The type of ``TRACED``."""

  def __repr__(self) -> str:
    return "TRACED"


TRACED = _Traced()
"""A configuration's value of a traceable hyperparameter that was given as an array: the
transformation holds the array and hands it to each step; the static configuration records only
this."""


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


def learning_rate(value, name: str = "learning_rate") -> Any:
  """A positive number, an optax schedule (a callable of the step count), ``TRACED`` or a scalar
  array (``optax.inject_hyperparams``)."""
  if callable(value):
    return value
  return traceable(value, lambda v: number(v, name, 0, low_open=True))


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


# ------------------------------------------------------------------------------ configurations


def setting(default: Any = dataclasses.MISSING, *, check: Callable[[Any, str], Any],
            traceable: bool = False) -> Any:
  """A field of a ``Config``: ``check(value, name)`` returns the value checked (or raises), and a
  ``traceable`` setting may be an array (a schedule under ``optax.inject_hyperparams``)."""
  return dataclasses.field(default=default, metadata={"check": check, "traceable": traceable})


def optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
  """``check`` for a setting that may also be None."""
  return lambda value, name: None if value is None else check(value, name)


class Config:
  """The base of every algorithm's configuration: a frozen dataclass of ``setting`` fields.

  ``__post_init__`` refuses the static settings given as arrays (all of them in one message:
  ``optax.inject_hyperparams`` turns every number into one), runs each setting's check (a
  traceable one given as an array is checked as its number would be, when it is concrete), then
  ``check`` for what relates two settings. ``name`` is the public name of the transformation, for
  messages and phase labels.
  """
  name: ClassVar[str] = "config"

  def __post_init__(self):
    fields = dataclasses.fields(self)
    taken = self.settings()
    taken_fields = [f for f in fields if f.name in taken]
    refuse_static_arrays(self.name, {f.name: getattr(self, f.name) for f in taken_fields},
                         [f.name for f in taken_fields if f.metadata.get("traceable")])
    for f in fields:
      if "check" not in f.metadata:
        continue
      value, check = getattr(self, f.name), f.metadata["check"]
      if f.metadata["traceable"]:
        value = traceable(value, lambda v, check=check, name=f.name: check(v, name))
      else:
        value = check(value, f.name)
      object.__setattr__(self, f.name, value)
    self.check()

  def check(self) -> None:
    """Checks what relates two settings (after each was checked); nothing by default."""

  def settings(self) -> tuple:
    """The names of the settings this configuration takes (its fields, by default): the public
    factory's arguments, which a message about them lists."""
    return tuple(f.name for f in dataclasses.fields(self))


def refuse_static_arrays(name: str, settings: dict, traceables) -> None:
  """Refuses the static ``settings`` given as arrays (``optax.inject_hyperparams`` makes an array of
  every number it is not told is static), all of them in one message, whose fix names every static
  number (those already Python numbers too, or copying it would drop them).

  Raises:
    TypeError: naming them, ``static_args`` to pass and the settings that may be scheduled.
  """
  static = [n for n, value in settings.items() if is_array(value) and n not in traceables]
  if not static:
    return
  numbers = [n for n, value in settings.items() if n not in traceables and (
      n in static or (isinstance(value, (int, float)) and not isinstance(value, bool)))]
  listed = ", ".join(repr(n) for n in numbers) + ("," if len(numbers) == 1 else "")
  raise TypeError(
      f"{name}: {', '.join(static)} "
      + ("is static (it fixes shapes or which program runs) and must be a Python value, not an "
         "array" if len(static) == 1 else
         "are static (they fix shapes or which program runs) and must be Python values, not "
         "arrays")
      + f". Under optax.inject_hyperparams pass static_args=({listed})"
      + (f"; only {', '.join(traceables)} may be scheduled" if traceables else ""))


def split_traced(config) -> tuple:
  """``(config with TRACED for every array, {name: array})``: the static configuration a state
  keeps (hashable, no arrays) and the arrays a step needs (``with_traced``)."""
  traced = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if is_array(getattr(config, f.name))}
  if not traced:
    return config, traced
  return dataclasses.replace(config, **{n: TRACED for n in traced}), traced


def with_traced(config, traced: dict):
  """The configuration a step computes with: ``traced``'s arrays in place of ``TRACED``."""
  return dataclasses.replace(config, **traced) if traced else config
