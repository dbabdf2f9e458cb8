"""Deep Gradient Compression's settings: ``DGCConfig``, its two exchanges, the warm-up's stages.

``jaxcomp._src.dgc`` holds the algorithm (its numbered steps) and the public factories; this module
holds the configuration they build: which exchange (``TopKExchange`` for ``dgc``, ``ChunkExchange``
for ``coarse_dgc``), the momentum, the local clipping, the wire dtype, which leaves are sparsified,
and the density of each step (the warm-up's stages, one phase each, then ``ratio``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src import compressor, phases as phases_lib, validate

PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
"""The paper's warm-up densities, one per epoch, before the final ``ratio`` (0.001 in the paper)."""

_DENSITY_IS_STATIC = "fixes k, the number of coordinates sent; schedule the density with warmup=..."


@dataclasses.dataclass(frozen=True)
class TopKExchange(validate.Config):
  """``dgc``'s exchange: each device sends its own top coordinates; all-gather, scatter-add, ×1/W.

  Attributes:
    selection: ``"sampled"``, the reference's threshold estimated from a sample (at most k sent;
      ``lax.top_k`` of millions of elements costs more than the rest of the step), or ``"exact"``.
    sample_ratio: fraction of each leaf sampled for the threshold (at least 2/density samples).
    upper_bound: with more than ``upper_bound·k`` candidates, the exact top k among them are sent.
    lower_bound: with fewer than ``lower_bound·k`` candidates, the threshold is lowered by this
      factor, at most ``max_adaptation_iters`` times.
    seed: seeds the sampling offsets, drawn per step and per leaf path.
  """
  name = "dgc"

  selection: str = validate.setting("sampled", check=functools.partial(
      validate.choice, choices=("sampled", "exact")))
  sample_ratio: float = validate.setting(0.01, check=validate.density)
  upper_bound: float = validate.setting(1.3, check=functools.partial(validate.number, low=1))
  lower_bound: float = validate.setting(0.8, check=functools.partial(
      validate.number, low=0, high=1, low_open=True, high_open=True))
  max_adaptation_iters: int = validate.setting(10, check=validate.integer)
  seed: int = validate.setting(0, check=validate.integer)


@dataclasses.dataclass(frozen=True)
class ChunkExchange(validate.Config):
  """``coarse_dgc``'s exchange: all-reduce the chunks' L1 norms, then the mean of the same top
  chunks.

  Attributes:
    chunk_size: elements per chunk (the last is zero-padded); larger chunks cost fewer norms.
  """
  name = "coarse_dgc"

  chunk_size: int = validate.setting(256, check=functools.partial(
      validate.integer, minimum=1, static="fixes the chunks' shape"))


def _ndim_above_one(path: str, leaf) -> bool:
  del path
  return leaf.ndim > 1


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DGCConfig(compressor.MeanConfig):
  """DGC's settings, validated; a static pytree node kept in the state.

  Attributes:
    ratio: density after warm-up (``dgc``: of coordinates; ``coarse_dgc``: of chunks). The paper's
      0.1% loses no accuracy on ImageNet with momentum correction and warm-up.
    exchange: a ``TopKExchange`` (``dgc``) or a ``ChunkExchange`` (``coarse_dgc``).
    momentum: the momentum factor m, moved here from the optimizer so that delayed coordinates keep
      their momentum (the dense leaves' momentum too).
    nesterov: Nesterov momentum correction, ``u ← m·(u + g); v ← v + u + g``.
    momentum_masking: also zero ``u`` at the sent coordinates, so that stale momentum does not push
      them again.
    warmup: ``((end_step, density), ...)``, increasing ends: the density while ``count < end_step``,
      then ``ratio``; early training, where gradients change fastest, is delayed less.
    clip_norm: local gradient clipping: each device scales its whole gradient to L2 norm at most
      ``clip_norm · W^clip_exponent`` before accumulation (None: none, the reference's default).
    clip_exponent: the world-size exponent of the clipping threshold; the paper's N^(-1/2).
      ``momentum``, ``clip_norm`` and ``clip_exponent`` may be ``validate.TRACED`` (schedules).
    value_dtype: wire dtype of the values and dense means: None (the gradient's), float32, float16
      or bfloat16. Indices are int32.
    sparsify: ``sparsify(path, leaf) -> bool``, the leaf a ``jax.ShapeDtypeStruct``: which reduced
      leaves are sparsified; default ``leaf.ndim > 1`` (biases and norm scales are small).
  """
  NONFINITE = "own"  # 6: from the values (or norms) it sends anyway

  ratio: float = validate.setting(0.001, check=functools.partial(validate.density,
                                                                 static=_DENSITY_IS_STATIC))
  exchange: Union[TopKExchange, ChunkExchange] = validate.setting(
      TopKExchange(), check=lambda value, name: _exchange(value))
  momentum: Any = validate.setting(0.9, check=functools.partial(
      validate.number, low=0, high=1, high_open=True), traceable=True)
  nesterov: bool = validate.setting(False, check=validate.boolean)
  momentum_masking: bool = validate.setting(True, check=validate.boolean)
  warmup: tuple = validate.setting((), check=lambda value, name: warmup_stages(value))
  clip_norm: Any = validate.setting(None, check=validate.optional(functools.partial(
      validate.number, low=0, low_open=True)), traceable=True)
  clip_exponent: Any = validate.setting(-0.5, check=validate.number, traceable=True)
  value_dtype: Any = validate.setting(None, check=lambda value, name: _value_dtype(value))
  sparsify: Callable = validate.setting(_ndim_above_one, check=functools.partial(
      validate.function, signature="sparsify(path, leaf) -> bool"))

  @property
  def name(self) -> str:
    return self.exchange.name

  def check(self):
    if self.nesterov and isinstance(self.momentum, float) and not self.momentum:
      raise ValueError("nesterov=True needs a momentum > 0; got momentum=0")

  @property
  def densities(self) -> tuple:
    """The density of each stage: the warm-up's, then ``ratio``."""
    return tuple(d for _, d in self.warmup) + (self.ratio,)

  def phases(self) -> tuple:
    """One phase per density: the warm-up's (share 0), then ``ratio`` (share 1)."""
    warm = dict.fromkeys(d for d in self.densities[:-1] if d != self.ratio)
    return (tuple(phases_lib.Phase(f"{self.name}.density={d:g}", 0.0, d) for d in warm)
            + (phases_lib.Phase(f"{self.name}.density={self.ratio:g}", 1.0, self.ratio),))

  def phase_of(self, count) -> jax.Array:
    """The phase of the warm-up stage that ``count`` is in."""
    densities = [p.value for p in self.phases()]
    stage = sum((count >= end).astype(jnp.int32) for end, _ in self.warmup)
    return jnp.asarray([densities.index(d) for d in self.densities], jnp.int32)[stage]

  def unbucketable(self) -> Optional[str]:
    if self.clip_norm is not None:
      return ("local clipping (clip_norm) needs the whole gradient's norm, which a bucket does "
              "not see: clip without buckets (jaxcomp.dgc(..., clip_norm=...), no "
              "bucket_cap_mb), or drop clip_norm")
    return None


def _exchange(value):
  if not isinstance(value, (TopKExchange, ChunkExchange)):
    raise TypeError(f"exchange must be a TopKExchange or a ChunkExchange; got {value!r}")
  return value


def _value_dtype(value):
  """None, or the dtype of the values on the wire: float32, float16 or bfloat16."""
  dtype = None if value is None else jnp.dtype(value)
  validate.choice(getattr(dtype, "name", None), "value_dtype",
                  (None, "float32", "float16", "bfloat16"))
  return dtype


def warmup_stages(warmup, steps_per_epoch: Optional[int] = None) -> tuple:
  """``warmup`` checked, as ``((end_step, density), ...)``: None, ``"paper"`` (``PAPER_WARMUP``, one
  epoch of ``steps_per_epoch`` steps each) or such a sequence."""
  if isinstance(warmup, str):
    validate.choice(warmup, "warmup", ("paper",))
    if steps_per_epoch is None:
      raise ValueError("steps_per_epoch must be given with warmup='paper' (one warm-up stage per "
                       "epoch); got None")
    steps = validate.integer(steps_per_epoch, "steps_per_epoch", 1)
    return tuple(((e + 1) * steps, d) for e, d in enumerate(PAPER_WARMUP))
  try:
    stages = tuple((end, density) for end, density in warmup or ())
  except (TypeError, ValueError):
    raise ValueError(f"warmup must be None, 'paper' or a sequence of (end_step, density) pairs; "
                     f"got {warmup!r}") from None
  for (end, density), previous in zip(stages, (0,) + tuple(e for e, _ in stages)):
    integer = isinstance(end, (int, np.integer)) and not isinstance(end, (bool, np.bool_))
    if not integer or end <= previous:
      raise ValueError("warmup: stage ends must be increasing positive ints (the first step after "
                       f"each stage); got {end!r} after {previous}")
    validate.density(density, "warmup density", static=_DENSITY_IS_STATIC)
  return tuple((int(end), float(density)) for end, density in stages)


def config(exchange: type, ratio: float, *, momentum=0.9, nesterov=False, momentum_masking=True,
           clip_norm=None, clip_exponent=-0.5, warmup=None, steps_per_epoch=None,
           value_dtype=None, sparsify=None, **exchange_settings) -> DGCConfig:
  """The ``DGCConfig`` of ``dgc``'s (``exchange=TopKExchange``) or ``coarse_dgc``'s
  (``ChunkExchange``) keyword arguments: the exchange's settings (None: its default) go to the
  exchange, ``warmup`` and ``steps_per_epoch`` make the stages. Every static one given as an
  array is refused in one message, the exchange's among them."""
  validate.refuse_static_arrays(exchange.name, dict(
      ratio=ratio, **exchange_settings, momentum=momentum, nesterov=nesterov,
      momentum_masking=momentum_masking, clip_norm=clip_norm, clip_exponent=clip_exponent,
      warmup=warmup, steps_per_epoch=steps_per_epoch, value_dtype=value_dtype,
      sparsify=sparsify), ("momentum", "clip_norm", "clip_exponent"))
  return DGCConfig(
      ratio, exchange(**{k: v for k, v in exchange_settings.items() if v is not None}),
      momentum=momentum, nesterov=nesterov, momentum_masking=momentum_masking,
      warmup=warmup_stages(warmup, steps_per_epoch), clip_norm=clip_norm,
      clip_exponent=clip_exponent, value_dtype=value_dtype, sparsify=sparsify or _ndim_above_one)
