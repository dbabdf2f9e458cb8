"""The one registry of named compressors: the main job, the benchmarks and the tests all use it.

Names follow one scheme: the algorithm, then ``_r<rank>`` for a rank, then a variant
(``powersgd_r2``, ``batched_powersgd_r1``, ``dgc_exact_fp16``); ``hook_`` marks a ``comm_hook`` port of
the same algorithm. Each entry is data: the factory, its settings, and how the settings change with the
length of a run (its recipe)::

  entry = REGISTRY["powersgd_r2"]
  tx = entry.make("batch")              # steady state: compresses from the first step
  tx = entry.make("batch", steps=3000)  # the recipe for a 3000-step run (start_iter=300)

The recipes follow the papers and torch: PowerSGD runs the plain mean for the first 10% of the steps
(``start_iter``); DGC ramps its density up through the paper's warm-up densities over the first 10%.
A recipe also names its phases — which steps behave like which steady-state program — so that the
bytes and the wall-clock of a whole run can be added up phase by phase (``entry.phases(steps)``)::

  REGISTRY["powersgd_r2"].phases(3000)
  # (Phase(first_step=0, name='allreduce', settings={}),      the plain mean until start_iter
  #  Phase(first_step=300, name='powersgd_r2', settings={}))  then the steady state
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import optax

import jaxcomp
from jaxcomp import hooks

_WARMUP_FRACTION = 0.1  # of a run's steps: PowerSGD's start_iter, DGC's warm-up


@dataclasses.dataclass(frozen=True)
class Compressor:
  """One named compressor.

  Attributes:
    name: the registry key.
    about: one line: what it sends, for tables and ``--help``.
    factory: ``factory(axis_name=..., **settings) -> GradientTransformation``.
    settings: the factory's settings in the steady state (compressing from the first step).
    recipe: ``recipe(steps) -> settings`` that replace the steady-state ones for a run of ``steps``
      steps (warm-up phases), or None. A ``Recipe`` also knows its phases.
    has_momentum: the compressor applies momentum itself (DGC's momentum correction), so the
      optimizer after it has none.
    wire_dtype: the dtype it sends float32 gradients in, where it is not the gradient's own.
    is_mean: its output is the plain mean (up to the wire dtype's rounding).
    error_feedback: torch-style error feedback: output + new error = gradient + old error.
  """
  name: str
  about: str
  factory: Callable[..., optax.GradientTransformation]
  settings: dict = dataclasses.field(default_factory=dict)
  recipe: Optional[Callable[[int], dict]] = None
  has_momentum: bool = False
  wire_dtype: Optional[str] = None
  is_mean: bool = False
  error_feedback: bool = False

  def make(self, axis_name="batch", steps: Optional[int] = None,
           **overrides) -> optax.GradientTransformation:
    """The transformation: the steady state, or the recipe for ``steps`` steps; ``overrides`` last."""
    settings = dict(self.settings)
    if steps is not None and self.recipe is not None:
      settings.update(self.recipe(steps))
    settings.update(overrides)
    return self.factory(axis_name=axis_name, **settings)

  def phases(self, steps: int) -> tuple:
    """The ``Phase``s of a run of ``steps`` steps under the recipe, first step first.

    A ``Recipe`` names them; without a recipe the run is one phase, the steady state; a recipe that
    is a plain function is one phase too, its own program from step 0 (its warm-up steps are then
    costed as the whole program, which is all that is known of them).
    """
    if isinstance(self.recipe, Recipe):
      return tuple(Phase(first, name or self.name, settings)
                   for first, name, settings in self.recipe.phases(steps))
    if self.recipe is None:
      return (Phase(0, self.name, {}),)
    return (Phase(0, self.name, dict(self.recipe(steps))),)


@dataclasses.dataclass(frozen=True)
class Phase:
  """From ``first_step`` on (until the next phase), a run's steps send and cost what the steady state
  of ``REGISTRY[name]``, with ``settings`` replacing its own, sends and costs."""
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


def _warmup_steps(steps: int) -> int:
  return int(steps * _WARMUP_FRACTION)


# PowerSGD (and any compressor with torch's ``start_iter``): the plain mean, then compression. A
# start_iter step sends exactly what allreduce sends, so it is costed as allreduce's step.
_start_iter = Recipe(
    settings=lambda steps: {"start_iter": _warmup_steps(steps)},
    phases=lambda steps: (((0, "allreduce", {}),) if _warmup_steps(steps) else ())
    + ((_warmup_steps(steps), None, {}),))


def _dgc_stages(steps: int) -> tuple:
  """The paper's four warm-up densities, in equal stages over the first 10% of the run."""
  stage = max(_warmup_steps(steps) // len(jaxcomp.PAPER_WARMUP), 1)
  return tuple((stage * (i + 1), d) for i, d in enumerate(jaxcomp.PAPER_WARMUP))


def _dgc_phases(steps: int) -> tuple:
  """Each warm-up stage behaves like the steady state at its density (``ratio``; a stage too dense
  to pay off sends the dense mean, as the warm-up program does), then the steady state."""
  stages = _dgc_stages(steps)
  starts = (0,) + tuple(end for end, _ in stages[:-1])
  return (tuple((start, None, {"ratio": density, "warmup": None})
                for start, (_, density) in zip(starts, stages))
          + ((stages[-1][0], None, {}),))


# DGC (and coarse DGC, whose ratio counts chunks): the density ramps up through the warm-up stages.
_dgc_warmup = Recipe(settings=lambda steps: {"warmup": _dgc_stages(steps)}, phases=_dgc_phases)


def _hook(hook, make_state=None) -> Callable[..., optax.GradientTransformation]:
  """A factory for ``comm_hook(hook, make_state(**settings))`` with DDP's ``bucket_cap_mb``."""

  def factory(axis_name, bucket_cap_mb: float = 25.0, **settings):
    state = None if make_state is None else make_state(**settings)
    return jaxcomp.comm_hook(hook, state, axis_name=axis_name, bucket_cap_mb=bucket_cap_mb)

  return factory


def _powersgd(rank: int) -> Compressor:
  return Compressor(f"powersgd_r{rank}", f"layer-wise PowerSGD, rank {rank}, error feedback",
                    jaxcomp.powersgd, {"rank": rank, "start_iter": 0}, _start_iter,
                    error_feedback=True)


_ENTRIES = (
    Compressor("allreduce", "plain f32 mean, the baseline", jaxcomp.allreduce, is_mean=True),
    Compressor("fp16", "mean sent as float16", jaxcomp.fp16_compress, wire_dtype="float16",
               is_mean=True),
    Compressor("bf16", "mean sent as bfloat16 (XLA:CPU widens it to f32 on the wire)",
               jaxcomp.bf16_compress, wire_dtype="bfloat16", is_mean=True),
    _powersgd(1),
    _powersgd(2),
    _powersgd(4),
    Compressor("batched_powersgd_r1", "PowerSGD of the whole gradient as one square matrix, rank 1",
               jaxcomp.batched_powersgd, {"rank": 1, "start_iter": 0}, _start_iter,
               error_feedback=True),
    Compressor("dgc", "Deep Gradient Compression, top 0.1% of each matrix, momentum 0.9",
               jaxcomp.dgc, {"ratio": 0.001}, _dgc_warmup, has_momentum=True),
    Compressor("dgc_exact_fp16", "DGC with exact top-k and float16 values, top 0.1%",
               jaxcomp.dgc, {"ratio": 0.001, "selection": "exact", "value_dtype": "float16"},
               _dgc_warmup, has_momentum=True),
    Compressor("coarse_dgc", "coarse-grained DGC, the top 1% of 256-element chunks",
               jaxcomp.coarse_dgc, {"ratio": 0.01, "chunk_size": 256}, _dgc_warmup,
               has_momentum=True),
    Compressor("hook_fp16_allreduce", "comm_hook: fp16_compress_wrapper(allreduce_hook)",
               _hook(jaxcomp.fp16_compress_wrapper(hooks.allreduce_hook)), wire_dtype="float16",
               is_mean=True),
    Compressor("hook_powersgd_r2", "comm_hook: powersgd_hook, rank 2, per DDP bucket",
               _hook(hooks.powersgd_hook, hooks.powersgd_state), {"rank": 2, "start_iter": 0},
               _start_iter),
)

REGISTRY = {entry.name: entry for entry in _ENTRIES}
"""Every named compressor, by name."""

DEFAULT = ("allreduce", "fp16", "bf16", "powersgd_r1", "powersgd_r2", "powersgd_r4",
           "batched_powersgd_r1", "dgc", "coarse_dgc")
"""The compressors the main job and the benchmarks compare unless told otherwise."""
