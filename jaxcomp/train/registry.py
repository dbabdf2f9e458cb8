"""The one registry of named compressors: the main job, the benchmarks and the tests all use it.

Names follow one scheme: the algorithm, then ``_r<rank>`` for a rank or ``_h<H>`` for a sync period,
then a variant (``powersgd_r2``, ``batched_powersgd_r1``, ``dgc_exact_fp16``, ``diloco_h20_fp16``);
``hook_`` marks a ``comm_hook`` port of the same algorithm. Each entry is data: the factory, its
settings, and how the settings change with the length of a run (its recipe)::

  entry = REGISTRY["powersgd_r2"]
  tx = entry.make("batch")              # steady state: compresses from the first step
  tx = entry.make("batch", steps=3000)  # the recipe for a 3000-step run (start_iter=300)

The recipes follow the papers and torch: PowerSGD runs the plain mean for the first 10% of the steps
(``start_iter``); DGC ramps its density up through the paper's warm-up densities over the first 10%;
1-bit Adam runs dense Adam for the first 20% (``freeze_steps``; DeepSpeed advises 15–25%);
post-local SGD averages gradients for the first 10%. 8-bit quantization and EF-SignSGD need no
warm-up; EF-SignSGD's paper trains it with SGD without momentum (``momentum_free``). Local SGD,
DiLoCo, Streaming DiLoCo and SparseLoCo run AdamW inside (``inner="adamw"``), as DiLoCo's and
SparseLoCo's papers do: in the main job's default run (``python -m jaxcomp.train``) it took
Streaming DiLoCo H=20 P=2's held-out loss from 2.391 (SGD with momentum inside) to 2.217, reaching
allreduce's in 1.46x its steps (``benchmarks/quality.py`` measures every entry as registered).

Not every entry is a gradient compressor: ``onebit_adam``, ``dion_r8``, ``dion_r4``, ``demo`` and
``demo_k8`` are whole optimizers (``is_optimizer``), and local SGD and DiLoCo wrap the whole
optimizer (``wraps_optimizer``). ``allreduce_muon`` and ``allreduce_adamw`` are the baselines of
Dion and DeMo (``baseline``): optax's Muon and AdamW after ``jaxcomp.allreduce``, whole optimizers
too.
The papers' own recipes (``diloco_paper``, ``diloco_maxtext``, ``intellect1``,
``streaming_diloco_fp4``, ``sparseloco_covenant``, ``muloco`` with Muon inside, ``desloc``) are
entries too, named by their source (``jaxcomp.train.papers``: each factory cites its table); the
records themselves (``Compressor``, ``Recipe``, ``Phase``) are ``jaxcomp.train.entries``'.
``entry.optimizer(inner)`` builds any of the three kinds around an inner optimizer: the compressor
chained before it, the wrapper around it, or the optimizer alone. ``variant(name, base, settings)``
is an entry with other settings, in ``REGISTRY`` while ``registered`` (the main job's
``--variant``).

A recipe also names its phases — which steps behave like which steady-state program — so that the
bytes and the wall-clock of a whole run can be added up phase by phase (``entry.phases(steps)``)::

  REGISTRY["powersgd_r2"].phases(3000)
  # (Phase(first_step=0, name='allreduce', settings={}),      the plain mean until start_iter
  #  Phase(first_step=300, name='powersgd_r2', settings={}))  then the steady state
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
from typing import Callable, Iterator, Sequence

import optax

import jaxcomp
from jaxcomp import hooks
from jaxcomp.train import entries, papers
# The registry's records, by its name:
from jaxcomp.train.entries import Compressor, Phase, Recipe  # noqa: F401

_WARMUP_FRACTION = 0.1  # of a run's steps: PowerSGD's start_iter, DGC's warm-up
_FREEZE_FRACTION = 0.2  # of a run's steps: 1-bit Adam's dense warm-up (DeepSpeed advises 15–25%)


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


def _freeze_steps(steps: int) -> int:
  return max(int(steps * _FREEZE_FRACTION), 1)


# 1-bit Adam's warm-up: dense Adam for the first 20% of the steps (DeepSpeed: 15–25%); a dense step
# sends the gradient's f32 mean, as allreduce's step does.
_freeze = Recipe(settings=lambda steps: {"freeze_steps": _freeze_steps(steps)},
                 phases=lambda steps: ((0, "allreduce", {}), (_freeze_steps(steps), None, {})))


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
    # epfml's variant: its error is the local one (M - P̂·Q_localᵀ), so output + error equals
    # gradient + old error only on average over the devices, not per device (error_feedback=False).
    Compressor("powersgd_r1_alternating",
               "PowerSGD rank 1, half a power iteration per step: one all-reduce (epfml's variant)",
               jaxcomp.powersgd, {"rank": 1, "start_iter": 0, "alternating": True}, _start_iter),
    Compressor("quantized_int8", "int8 codes, a scale per 256, all-to-all + all-gather, "
               "error feedback", jaxcomp.quantized, {"bits": 8}, wire_dtype="int8"),
    Compressor("quantized_fp8", "float8_e4m3fn codes, a scale per 256, all-to-all + all-gather, "
               "error feedback", jaxcomp.quantized, {"bits": "fp8"}, wire_dtype="float8_e4m3fn"),
    Compressor("quantized_int4", "4-bit integer codes (-7..7), a scale per 256, 2 a byte, "
               "all-to-all + all-gather, error feedback", jaxcomp.quantized, {"bits": 4},
               wire_dtype="uint8"),
    Compressor("quantized_int2", "2-bit ternary codes (-1, 0, 1), a scale per 256, 4 a byte, "
               "all-to-all + all-gather, error feedback", jaxcomp.quantized, {"bits": 2},
               wire_dtype="uint8"),
    Compressor("sign", "EF-SignSGD: sign bits 8 per byte and a scale per leaf, all-gathered",
               jaxcomp.sign_compress, wire_dtype="uint8", momentum_free=True),
    Compressor("chunked_topk", "top 64 of every 4,096 of the error feedback in 2 bits, Elias-Fano "
               "positions, one u8 all-gather", jaxcomp.chunked_topk, {"k": 64, "chunk": 4096},
               wire_dtype="uint8"),
    Compressor("onebit_adam", "1-bit Adam (an optimizer, lr 1e-3): dense Adam for 20% of the "
               "steps, then sign bits of the momentum", jaxcomp.onebit_adam,
               {"learning_rate": 1e-3, "freeze_steps": 0}, _freeze, wire_dtype="uint8",
               is_optimizer=True),
)


def _after_allreduce(optimizer: Callable) -> Callable[..., optax.GradientTransformation]:
  """A baseline: ``optax.chain(jaxcomp.allreduce(), optimizer(**settings))``."""

  def factory(axis_name, **settings):
    return optax.chain(jaxcomp.allreduce(axis_name=axis_name), optimizer(**settings))

  return factory


# Whole optimizers of the Muon era that communicate less, and the baselines they are measured
# against: Dion against Muon (both with AdamW for the embeddings and vectors), DeMo against AdamW.
# Their rates are the best of short runs on the chars transformer (400 steps, 8 devices, constant
# rates): Muon 0.02 (0.05: worse), Dion 0.02 (0.01, 0.05, 0.1: worse) with mu 0.8 (0.9, 0.95:
# worse), DeMo 3e-3 (3e-4, 1e-3, 6e-3, 1e-2: worse).
_ENTRIES += (
    Compressor("allreduce_muon", "optax.contrib.muon (lr 0.02, AdamW 3e-3 for the rest) after the "
               "f32 mean: Dion's baseline", _after_allreduce(entries.muon),
               {"learning_rate": 0.02, "adam_learning_rate": 3e-3, "weight_decay": 0.01},
               is_optimizer=True, baseline=True),
    Compressor("dion_r8", "Dion (an optimizer, lr 0.02, mu 0.8, AdamW 3e-3 for the rest): rank-8 "
               "factors of each matrix, r(m + n) values", jaxcomp.dion,
               {"learning_rate": 0.02, "rank": 8, "mu": 0.8, "scalar_learning_rate": 3e-3},
               is_optimizer=True),
    Compressor("dion_r4", "Dion as dion_r8, rank 4", jaxcomp.dion,
               {"learning_rate": 0.02, "rank": 4, "mu": 0.8, "scalar_learning_rate": 3e-3},
               is_optimizer=True),
    Compressor("allreduce_adamw", "optax.adamw (lr 3e-3, b2 0.95, weight decay 0.1) after the f32 "
               "mean: DeMo's baseline", _after_allreduce(optax.adamw),
               {"learning_rate": 3e-3, "b2": 0.95, "weight_decay": 0.1}, is_optimizer=True,
               baseline=True),
    Compressor("demo", "DeMo (an optimizer, lr 3e-3): top 32 of each 64 x 64 tile's DCT of the "
               "momentum, int16 positions, all-gathered", jaxcomp.demo, {"learning_rate": 3e-3},
               is_optimizer=True),
    Compressor("demo_k8", "DeMo as demo, top 8 of each tile", jaxcomp.demo,
               {"learning_rate": 3e-3, "k": 8}, is_optimizer=True),
)



def _diloco(compressor=None, wrapper=jaxcomp.diloco,
            **compressor_settings) -> Callable[..., optax.GradientTransformation]:
  """A factory for ``wrapper(inner, ...)`` (``diloco`` or ``streaming_diloco``) whose
  pseudo-gradient goes through ``compressor`` on the same axis.

  With ``fast_axis`` (the several-nodes job's ``"data"``, the devices of a node), the inner step
  averages the gradient over it and the pseudo-gradient, the same on a node's devices, is averaged
  by ``jaxcomp.hierarchical``: each device sends 1/F of it between nodes, not all of it (elementwise
  codecs packed into one vector, PowerSGD's matrices kept)."""

  def factory(inner, axis_name, fast_axis=None, **settings):
    on_axis = None if compressor is None else compressor(axis_name=axis_name, **compressor_settings)
    if fast_axis is not None:
      inner = optax.chain(jaxcomp.allreduce(axis_name=fast_axis), inner)
      on_axis = jaxcomp.hierarchical(on_axis or jaxcomp.allreduce(axis_name=axis_name),
                                     fast_axis=fast_axis)
    return wrapper(inner, compressor=on_axis, axis_name=axis_name, **settings)

  return factory


def averages_hierarchically(entry: Compressor) -> bool:
  """Whether ``entry``'s factory takes ``fast_axis`` (``_diloco``'s)."""
  return "fast_axis" in inspect.signature(entry.factory).parameters


_ENTRIES += (
    Compressor("local_sgd_h8", "post-local SGD: parameters averaged every 8 steps, f32",
               jaxcomp.local_sgd, {"sync_every": 8}, _start_iter, inner="adamw",
               wraps_optimizer=True),
    Compressor("diloco_h20", "DiLoCo: 20 local steps, outer Nesterov on the f32 mean drift",
               _diloco(), {"sync_every": 20}, inner="adamw", wraps_optimizer=True),
    Compressor("diloco_h20_fp16", "DiLoCo, H=20, pseudo-gradient sent as float16",
               _diloco(jaxcomp.fp16_compress), {"sync_every": 20}, inner="adamw",
               wraps_optimizer=True),
    # Without error feedback: the outer momentum already carries what one outer step leaves out,
    # and error feedback's late release of it, amplified by that momentum, made the held-out loss
    # far worse on the chars task (tests/test_diloco_training.py measures this entry).
    Compressor("diloco_h20_powersgd_r2", "DiLoCo, H=20, pseudo-gradient through PowerSGD rank 2",
               _diloco(jaxcomp.powersgd, rank=2, start_iter=0, error_feedback=False),
               {"sync_every": 20}, inner="adamw", wraps_optimizer=True),
    Compressor("streaming_diloco_h20_p2",
               "Streaming DiLoCo: 2 strided fragments at staggered offsets, H=20, each exchange "
               "overlapping 1 step, mixed half, f32",
               _diloco(wrapper=jaxcomp.streaming_diloco),
               {"sync_every": 20, "fragments": 2, "delay": 1}, inner="adamw", wraps_optimizer=True),
    Compressor("streaming_diloco_h100_p4_int8",
               "Streaming DiLoCo: 4 fragments, H=100, each sent in 2 pieces over 2 steps as int8 "
               "codes", _diloco(jaxcomp.quantized, wrapper=jaxcomp.streaming_diloco, bits=8,
                                error_feedback=False),
               {"sync_every": 100, "fragments": 4, "delay": 2}, inner="adamw",
               wraps_optimizer=True),
    Compressor("sparseloco_h30", "SparseLoCo: 30 local steps, top 64 of every 4,096 of the decayed "
               "error feedback in 2 bits", jaxcomp.sparseloco, {"sync_every": 30},
               inner="adamw", wraps_optimizer=True),
)

_ENTRIES += papers.ENTRIES  # the papers' own recipes, named by their source

REGISTRY = {entry.name: entry for entry in _ENTRIES}
"""Every named compressor, by name."""

DEFAULT = ("allreduce", "fp16", "bf16", "powersgd_r1", "powersgd_r2", "powersgd_r4",
           "batched_powersgd_r1", "powersgd_r1_alternating", "dgc", "coarse_dgc", "quantized_int8",
           "quantized_fp8", "sign", "onebit_adam")
"""The compressors the benchmarks compare unless told otherwise."""

JOB_DEFAULT = ("allreduce", "bf16", "powersgd_r4", "dgc_exact_fp16", "quantized_int8",
               "onebit_adam", "streaming_diloco_h20_p2")
"""The main job's default run (``python -m jaxcomp.train --compressors all`` runs every entry): the
baseline, a 16-bit mean, 8-bit quantization, 1-bit Adam, and the best PowerSGD, DGC and DiLoCo
entries by the job's own table (chars, 400 steps, 8 devices; none of the three reached allreduce's
held-out loss 2.069 in 600 steps, so the lowest held-out loss decided): PowerSGD rank 4 2.228
(rank 2 2.389, rank 1 2.464, alternating 2.739, batched 4.886), DGC with exact top-k and float16
values 2.414 (DGC 2.427, coarse 2.816), Streaming DiLoCo H=20 in 2 fragments 2.394 (DiLoCo H=20
2.449, its float16 2.441 and PowerSGD 2.693 variants, Streaming DiLoCo H=100 int8 2.473,
SparseLoCo 2.516)."""


PERIODIC = tuple(name for name, entry in REGISTRY.items() if entry.wraps_optimizer)
"""Local SGD and DiLoCo: they wrap the optimizer and communicate once every H steps. The bytes
benchmark compares them with ``DEFAULT``; the per-step benchmarks compare gradient compressors
only (``--compressors`` picks any entry)."""


def variant(name: str, base: str, settings: dict) -> Compressor:
  """``REGISTRY[base]`` with ``settings`` over its own, named ``name``: other settings of an entry,
  which the main job (``--variant``) trains and tabulates beside the others while ``registered``.

  Raises:
    ValueError: ``base`` is not an entry, ``name`` is one, the entry's recipe sets one of the
      ``settings`` for the run's length, or the factory refuses them (its own message).
  """
  if base not in REGISTRY:
    raise ValueError(f"unknown registry entry {base!r}; choose from {', '.join(REGISTRY)}")
  if name in REGISTRY:
    raise ValueError(f"{name!r} is a registry entry's name; give the variant a name of its own")
  entry = REGISTRY[base]
  fitted = sorted(set(entry.recipe(1000)) & set(settings)) if entry.recipe else []
  if fitted:
    raise ValueError(f"{base}'s recipe sets {', '.join(fitted)} for the run's length; a variant "
                     "cannot change it")
  changed = ", ".join(f"{key}={value!r}" for key, value in settings.items())
  entry = dataclasses.replace(entry, name=name, settings={**entry.settings, **settings},
                              about=f"{entry.about}; {changed}" if changed else entry.about)
  try:  # the factory checks the settings now, not after the other entries' runs
    entry.optimizer(optax.identity())
  except (TypeError, ValueError) as e:
    raise ValueError(f"{base}: {e}") from None
  return entry


def parse_variants(texts: Sequence[str]) -> list:
  """The ``variant`` of each ``"NAME=ENTRY,KEY=VALUE,..."`` (``--variant`` of the main job and of
  the benchmarks), each VALUE a Python literal (``16``, ``0.95``, ``None``, ``'adamw'``) or else the
  text itself.

  Raises:
    ValueError: a text not of that form or refused by ``variant`` (the message starts with the
      text), or a NAME given twice.
  """
  variants = []
  for text in texts:
    try:
      variants.append(_parse_variant(text))
    except ValueError as e:
      raise ValueError(f"{text}: {e}") from None
  names = [v.name for v in variants]
  twice = [n for n in names if names.count(n) > 1]
  if twice:
    raise ValueError(f"names {twice[0]} twice: give each variant a name of its own")
  return variants


def _parse_variant(text: str) -> Compressor:
  """``parse_variants`` of one text."""
  head, *pairs = [part.strip() for part in text.split(",")]
  name, _, base = head.partition("=")
  if not (name.strip() and base.strip()) or not all("=" in pair for pair in pairs):
    raise ValueError(f"expected NAME=ENTRY,KEY=VALUE,... (e.g. dion_r16=dion_r8,rank=16); got "
                     f"{text!r}")
  settings = {}
  for pair in pairs:
    key, _, value = pair.partition("=")
    try:
      settings[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      settings[key.strip()] = value.strip()
  return variant(name.strip(), base.strip(), settings)


@contextlib.contextmanager
def registered(entries: Sequence[Compressor]) -> Iterator[None]:
  """``entries`` in ``REGISTRY`` while the block runs (the job, the benchmarks and the recipes'
  phases look entries up by name), then removed; an entry equal to the registry's own is left.

  Raises:
    ValueError: an entry has a registry entry's name and differs from it.
  """
  added = []
  try:
    for entry in entries:
      if entry.name not in REGISTRY:
        REGISTRY[entry.name] = entry
        added.append(entry.name)
      elif REGISTRY[entry.name] != entry:
        raise ValueError(f"{entry.name!r} is a registry entry's name and the entry differs from it")
    yield
  finally:
    for name in added:
      del REGISTRY[name]
