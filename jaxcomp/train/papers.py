"""The papers' own recipes as registry entries (``jaxcomp.train.registry``), named by their source.

Each factory below builds the optimizer its paper (or production configuration) trains with, around
the ``inner`` optimizer the main job passes (AdamW, or Muon for MuLoCo: ``Compressor.inner``), and
its docstring cites where the settings come from. The defaults of the factories are those settings;
the entries repeat the ones that set what is sent (``sync_every``, the codes), so that
``jaxcomp.train.wire`` computes their bytes. Their periods are those of runs of tens of thousands of
steps: ``benchmarks/scaling_quality.py`` says which it shortens for runs of hundreds.

Where a paper's exchange differs from jaxcomp's, the entry uses jaxcomp's and says so: the 8-, 4-
and 2-bit exchanges are ``jaxcomp.quantized``'s (a float32 scale per 256 values, an all-to-all and
an all-gather), not the papers' per-tensor codebooks.
"""

from __future__ import annotations

import optax

import jaxcomp
from jaxcomp.train.entries import Compressor


def diloco_paper(inner: optax.GradientTransformation, *, axis_name="batch", sync_every: int = 500,
                 outer_learning_rate: float = 0.7,
                 outer_momentum: float = 0.9) -> optax.GradientTransformation:
  """DiLoCo as its paper trains it: 8 workers, H = 500 inner AdamW steps, the float32 mean of the
  pseudo-gradients, outer SGD with Nesterov momentum 0.9 and learning rate 0.7.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023
    (https://arxiv.org/abs/2311.08105): Algorithm 1; the settings of its main-results table (8
    workers, H = 500: "500 times less" communication) and of its outer-optimizer ablation (Nesterov,
    lr 0.7).
  """
  return jaxcomp.diloco(inner, sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                        outer_momentum=outer_momentum, axis_name=axis_name)


def diloco_maxtext(inner: optax.GradientTransformation, *, axis_name="batch", sync_every: int = 36,
                   outer_learning_rate: float = 0.3,
                   outer_momentum: float = 0.9) -> optax.GradientTransformation:
  """DiLoCo as MaxText configures it: H = 36, outer Nesterov learning rate 0.3, momentum 0.9, the
  float32 mean.

  References:
    AI-Hypercomputer/maxtext, the configuration's ``DilocoParams`` (``configs/types.py``):
    ``diloco_sync_period`` 36, ``diloco_outer_lr`` 0.3, ``diloco_outer_momentum`` 0.9.
  """
  return jaxcomp.diloco(inner, sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                        outer_momentum=outer_momentum, axis_name=axis_name)


def intellect1(inner: optax.GradientTransformation, *, axis_name="batch", sync_every: int = 100,
               outer_learning_rate: float = 0.7,
               outer_momentum: float = 0.9) -> optax.GradientTransformation:
  """INTELLECT-1's DiLoCo: H = 100, the pseudo-gradient averaged in 8 bits without error feedback,
  outer Nesterov 0.7 / 0.9: "a 400× reduction in communication bandwidth" (100 × 32/8).

  References:
    Jaghouar et al., "INTELLECT-1 Technical Report", 2024 (https://arxiv.org/abs/2412.01152): §3
    and its table of training settings (100 inner steps, int8 all-reduce, OpenDiLoCo's outer
    optimizer). Its int8 codes are those of a ±6σ codebook; here ``jaxcomp.quantized(8)``'s.
  """
  exchange = jaxcomp.quantized(8, error_feedback=False, axis_name=axis_name)
  return jaxcomp.diloco(inner, sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                        outer_momentum=outer_momentum, compressor=exchange, axis_name=axis_name)


def streaming_diloco_fp4(inner: optax.GradientTransformation, *, axis_name="batch",
                         sync_every: int = 100, fragments: int = 4, delay: int = 1,
                         mix: float = 0.5) -> optax.GradientTransformation:
  """Streaming DiLoCo with 4-bit outer gradients: H = 100, strided fragments, each exchange
  overlapping τ = 1 inner step, mixed half (α = 0.5), the pseudo-gradients sent as float4 E3M0
  codes (``jaxcomp.quantized("e3m0")``, no error feedback), outer Nesterov 0.7 / 0.9.

  References:
    Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
    Lunch", 2025 (https://arxiv.org/abs/2501.18512): its tables of the three changes (fragments,
    overlap with α = 0.5, and the outer gradients' precision, where E3M0 4-bit floats lose nothing
    against float32), H = 100.
  """
  exchange = jaxcomp.quantized("e3m0", error_feedback=False, axis_name=axis_name)
  return jaxcomp.streaming_diloco(inner, sync_every=sync_every, fragments=fragments, delay=delay,
                                  mix=mix, compressor=exchange, axis_name=axis_name)


def sparseloco_covenant(inner: optax.GradientTransformation, *, axis_name="batch",
                        sync_every: int = 30, k: int = 64, chunk: int = 4096, bits: int = 2,
                        error_decay: float = 0.95) -> optax.GradientTransformation:
  """SparseLoCo as Covenant-72B trained it: H = 30, the top 64 of every 4,096 coordinates of the
  error feedback (decay 0.95) in 2 bits, outer learning rate 1 without momentum.

  References:
    Lidin et al., "Covenant-72B: Pre-Training a 72B LLM with Trustless Peers Over-the-Internet",
    2026 (https://arxiv.org/abs/2603.08163): its table of SparseLoCo settings. Sarfi et al.,
    "Communication Efficient LLM Pre-training with SparseLoCo", 2025, Algorithm 1.
  """
  return jaxcomp.sparseloco(inner, sync_every=sync_every, k=k, chunk=chunk, bits=bits,
                            error_decay=error_decay, outer_learning_rate=1.0, axis_name=axis_name)


def muloco(inner: optax.GradientTransformation, *, axis_name="batch", sync_every: int = 30,
           bits=2, error_decay: float = 0.9, outer_learning_rate: float = 0.8,
           outer_momentum: float = 0.9) -> optax.GradientTransformation:
  """MuLoCo: DiLoCo with Muon inside (``inner``: the main job passes ``entries.muon``) and the
  pseudo-gradient sent in 2 bits with a decaying error accumulator: H = 30, e ← 0.9·e + Δ, outer
  Nesterov learning rate 0.8, momentum 0.9 — ``jaxcomp.diloco(inner,
  compressor=jaxcomp.quantized(2, error_decay=0.9))``, no factory of its own needed.

  References:
    Thérien, Huang, Rish, Belilovsky, "MuLoCo: Muon is a practical inner optimizer for DiLoCo",
    2025 (https://arxiv.org/abs/2505.23725): Figure 1 (K = 8, H = 30, 2 bits with error feedback)
    and its table of compression results; the settings above are those of its released
    configuration (facebookresearch/MuLoCo, ``2x_4gpu_muloco_quantized_outer.py``). Its 2-bit codes
    are 4 bins of a per-tensor ±6σ codebook; here ``jaxcomp.quantized(2)``'s ternary levels of a
    scale per 256 values.
  """
  exchange = jaxcomp.quantized(bits, error_decay=error_decay, axis_name=axis_name)
  return jaxcomp.diloco(inner, sync_every=sync_every, outer_learning_rate=outer_learning_rate,
                        outer_momentum=outer_momentum, compressor=exchange, axis_name=axis_name)


def desloc(inner: optax.GradientTransformation, *, axis_name="batch", param_sync_every: int = 256,
           first_moment_sync_every: int = 768,
           second_moment_sync_every: int = 1536) -> optax.GradientTransformation:
  """DES-LOC at its paper's headline: the parameters averaged every Kx = 256 steps, Adam's first
  moment every Ku = 3·Kx, its second every Kv = 6·Kx: 1.5/256 of the parameters per step, 170×
  less than data-parallel training (``jaxcomp.desloc``).

  References:
    Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation
    Models", ICLR 2026 (https://arxiv.org/abs/2505.22549): the abstract's 170× and 2× figures, and
    its table of recommended periods (Ku = 3Kx, Kv = 6Kx).
  """
  return jaxcomp.desloc(inner, param_sync_every=param_sync_every,
                        first_moment_sync_every=first_moment_sync_every,
                        second_moment_sync_every=second_moment_sync_every, axis_name=axis_name)


ENTRIES = (
    Compressor("diloco_paper", "DiLoCo's paper: H=500, outer Nesterov 0.7 / 0.9, f32 mean",
               diloco_paper, {"sync_every": 500}, inner="adamw", wraps_optimizer=True),
    Compressor("diloco_maxtext", "DiLoCo as MaxText sets it: H=36, outer Nesterov 0.3 / 0.9, f32",
               diloco_maxtext, {"sync_every": 36}, inner="adamw", wraps_optimizer=True),
    Compressor("intellect1", "INTELLECT-1: DiLoCo H=100, int8 pseudo-gradient, no error feedback",
               intellect1, {"sync_every": 100}, inner="adamw", wraps_optimizer=True),
    Compressor("streaming_diloco_fp4", "Streaming DiLoCo: H=100, 4 fragments, overlap 1, mix 0.5, "
               "float4 E3M0 pseudo-gradient", streaming_diloco_fp4,
               {"sync_every": 100, "fragments": 4, "delay": 1}, inner="adamw",
               wraps_optimizer=True),
    Compressor("sparseloco_covenant", "SparseLoCo as Covenant-72B: H=30, top 64 of 4,096 in 2 "
               "bits, error decay 0.95", sparseloco_covenant, {"sync_every": 30}, inner="adamw",
               wraps_optimizer=True),
    Compressor("muloco", "MuLoCo: Muon inside DiLoCo H=30, 2-bit pseudo-gradient, error decay 0.9, "
               "outer Nesterov 0.8 / 0.9", muloco, {"sync_every": 30}, inner="muon",
               wraps_optimizer=True),
    Compressor("desloc", "DES-LOC: local AdamW; parameters averaged every 256 steps, first moment "
               "every 768, second every 1,536", desloc,
               {"param_sync_every": 256, "first_moment_sync_every": 768,
                "second_moment_sync_every": 1536}, inner="adamw", wraps_optimizer=True,
               adam_inside=True),
)
"""The papers' presets, in the registry after the entries of jaxcomp's own settings."""
