"""A registry entry (``jaxcomp.train.registry``): the record of one named compressor, how its
settings follow the length of a run (its ``Recipe``) and the stretches of a run each behaves like
(``Phase``); and the Muon optimizer the entries that need one are built with.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import optax

import jaxcomp

@dataclasses.dataclass(frozen=True)
class Compressor:
  """One named compressor.

  Attributes:
    name: the registry key.
    about: one line: what it sends, for tables and ``--help``.
    factory: ``factory(axis_name=..., **settings) -> GradientTransformation``.
    settings: the factory's settings in the steady state (compressing from the first step).
    recipe: the ``Recipe``: settings that replace the steady-state ones for a run of ``steps`` steps
      (warm-up phases), and those phases; or None.
    has_momentum: the compressor applies momentum itself (DGC's momentum correction), so the
      optimizer after it has none.
    momentum_free: its paper trains it with SGD without momentum (EF-SignSGD: error feedback
      already delays part of each step, and momentum on top of the delayed error overshoots).
    wire_dtype: the dtype it sends float32 gradients in, where it is not the gradient's own.
    is_mean: its output is the plain mean (up to the wire dtype's rounding).
    error_feedback: torch-style error feedback: output + new error = gradient + old error.
    is_optimizer: the entry is a whole optimizer that averages the gradient itself (1-bit Adam):
      its output is the parameter update, so nothing is chained after it.
    baseline: the entry is not a jaxcomp algorithm but the baseline a whole optimizer is measured
      against beside it: an optax optimizer after ``jaxcomp.allreduce`` (Muon for Dion, AdamW for
      DeMo). The registry-wide tests leave it out: their properties are jaxcomp's, not optax's.
    inner: the optimizer that follows it in the main job (``tasks.Task.optimizer``): ``"sgd"``,
      with ``sgd_momentum``, ``"adamw"`` (the inner optimizer of DiLoCo's paper), or ``"muon"``
      (``muon``: MuLoCo's).
    wraps_optimizer: the factory wraps the whole optimizer, ``factory(inner, axis_name=...,
      **settings)`` (local SGD, DiLoCo): its update needs ``params`` and returns ``jaxcomp.Assign``
      updates that set them; it communicates only after every ``settings["sync_every"]``-th step
      (``bytes_per_step`` amortises that), and the replicas are identical only right after such a
      step (``state.config.syncs_after(step)``), not in between.
    adam_inside: its algorithm averages the inner optimizer's Adam moments (DES-LOC), so it needs
      an Adam inside: ``plainest_inner`` gives it one where loops over every entry give the others
      SGD.
  """
  name: str
  about: str
  factory: Callable[..., optax.GradientTransformation]
  settings: dict = dataclasses.field(default_factory=dict)
  recipe: Optional[Recipe] = None
  has_momentum: bool = False
  momentum_free: bool = False
  wire_dtype: Optional[str] = None
  is_mean: bool = False
  error_feedback: bool = False
  is_optimizer: bool = False
  baseline: bool = False
  inner: str = "sgd"
  wraps_optimizer: bool = False
  adam_inside: bool = False

  def plainest_inner(self, learning_rate, momentum=None) -> optax.GradientTransformation:
    """The plainest inner optimizer it runs with, for the loops over every entry (the benchmarks'
    bytes, memory and step times): ``optax.sgd``, or ``optax.adam`` where ``adam_inside``."""
    if self.adam_inside:
      return optax.adam(learning_rate)
    return optax.sgd(learning_rate, momentum=momentum)

  @property
  def sgd_momentum(self) -> Optional[float]:
    """The momentum of the SGD that follows it in the main job: none after DGC (it has its own)
    and after EF-SignSGD (its paper's), 0.9 otherwise."""
    return None if self.has_momentum or self.momentum_free else 0.9

  def make(self, axis_name="batch", steps: Optional[int] = None, *,
           inner: Optional[optax.GradientTransformation] = None,
           **overrides) -> optax.GradientTransformation:
    """The transformation: the steady state, or the recipe for ``steps`` steps; ``overrides`` last.

    A wrapper of the optimizer needs the ``inner`` optimizer it wraps; a compressor takes none.
    """
    settings = dict(self.settings)
    if steps is not None and self.recipe is not None:
      settings.update(self.recipe(steps))
    settings.update(overrides)
    if self.wraps_optimizer != (inner is not None):
      raise TypeError(f"{self.name}: " + ("wraps the optimizer: pass inner=" if self.wraps_optimizer
                                          else "is a gradient compressor: it takes no inner="))
    if self.wraps_optimizer:
      return self.factory(inner, axis_name=axis_name, **settings)
    return self.factory(axis_name=axis_name, **settings)

  def optimizer(self, inner: optax.GradientTransformation, axis_name="batch",
                steps: Optional[int] = None, **overrides) -> optax.GradientTransformation:
    """The whole optimizer around ``inner``: the compressor chained before it, or the wrapper; an
    entry that is an optimizer itself (``is_optimizer``) ignores ``inner``."""
    if self.is_optimizer:
      return self.make(axis_name, steps, **overrides)
    if self.wraps_optimizer:
      return self.make(axis_name, steps, inner=inner, **overrides)
    return optax.chain(self.make(axis_name, steps, **overrides), inner)

  def bytes_per_step(self, report, kind: str = "ring_bytes") -> float:
    """What the steady state sends per step on average, from ``report`` (``jaxcomp.comm_report``
    of one step): the report's own steady-state total, which counts a labelled phase's collectives
    by its share (a wrapper's sync step once every ``sync_every`` steps, each half of alternating
    PowerSGD every other step, a warm-up not at all). ``kind``: ``"ring_bytes"`` or
    ``"payload_bytes"``."""
    return getattr(report, kind)

  def phases(self, steps: int) -> tuple:
    """The ``Phase``s of a run of ``steps`` steps under the recipe, first step first.

    The ``Recipe`` names them; without a recipe the run is one phase, the steady state.
    """
    if self.recipe is None:
      return (Phase(0, self.name, {}),)
    return tuple(Phase(first, name or self.name, settings)
                 for first, name, settings in self.recipe.phases(steps))


@dataclasses.dataclass(frozen=True)
class Phase:
  """From ``first_step`` on (until the next phase), a run's steps send and cost what the steady
  state of ``REGISTRY[name]``, with ``settings`` replacing its own, sends and costs."""
  first_step: int
  name: str
  settings: dict


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a compressor's settings follow the length of a run.

  Attributes:
    settings: ``settings(steps) -> dict``, what ``Compressor.make(steps=...)`` applies.
    phases: ``phases(steps) -> ((first_step, name, settings), ...)``: the steady-state program each
      stretch of the run behaves like; ``name`` None means the compressor's own.
  """
  settings: Callable[[int], dict]
  phases: Callable[[int], tuple]

  def __call__(self, steps: int) -> dict:
    return self.settings(steps)


def _muon_dimensions(params):
  """``optax.contrib.muon``'s dimension numbers for the leaves ``jaxcomp.dion`` takes for matrices
  (``jaxcomp.dion_fan_in``), None (its Adam) for the others: both optimizers split alike."""
  def numbers(path, leaf):
    fan_in = jaxcomp.dion_fan_in(jax.tree_util.keystr(path), leaf)
    return None if fan_in is None else optax.contrib.MuonDimensionNumbers(
        tuple(range(fan_in)), tuple(range(fan_in, leaf.ndim)))
  return jax.tree_util.tree_map_with_path(numbers, params)


def muon(learning_rate, adam_learning_rate, weight_decay) -> optax.GradientTransformation:
  """``optax.contrib.muon`` for the matrices Dion takes for matrices, AdamW (b2 0.95) for the rest:
  the ``allreduce_muon`` baseline's optimizer and MuLoCo's inner one (``Compressor.inner``
  ``"muon"``)."""
  return optax.contrib.muon(learning_rate, weight_decay=weight_decay, adam_b2=0.95,
                            adam_learning_rate=adam_learning_rate,
                            muon_weight_dimension_numbers=_muon_dimensions)
