"""SparseLoCo: DiLoCo's periods, with a sparse 2-bit exchange whose error feedback replaces the
momentum.

Every device trains its replica for H steps of the inner optimizer (the paper: AdamW), as in DiLoCo;
then, per device and per reduced leaf, with θ the parameters of the last synchronization:

1. the pseudo-gradient Δᵢ = θ − θᵢ (DiLoCo's outer gradient);
2. the error feedback ``eᵢ ← β·eᵢ + Δᵢ``, which stands in for DiLoCo's outer momentum;
3. ``Δ̂ᵢ = Q(TopK(eᵢ))``: in each chunk the k largest-magnitude coordinates, their values in
   ``bits`` bits; ``eᵢ ← eᵢ − Δ̂ᵢ``;
4. ``θ ← θ − α·mean(Δ̂ᵢ)``: an outer SGD without momentum; every device restarts from the new θ.

Steps 2–3 and the mean of step 4 are ``jaxcomp.chunked_topk`` (its steps 1–7 say how the bytes are
coded and sent); steps 1 and 4, the periods, the ``Assign`` updates and the parameters kept per
device are ``jaxcomp.diloco``'s (its module docstring): ``sparseloco`` is DiLoCo's algorithm with
``outer_momentum=0`` and that compressor, under its own name, so it checkpoints (a
``jaxcomp.DiLoCoState``) and runs under ``data_parallel`` exactly as DiLoCo does, and its
synchronization is reported as the ``"sparseloco.sync"`` phase.

Written with Δᵢ = θᵢ − θ and θ ← θ + α·mean(Δ̂ᵢ) instead, it is the same algorithm: the selection
depends on magnitudes only and the quantizer is odd (``Q(−x) = −Q(x)``), so both give the same θ.

References:
  Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
  2025 (https://arxiv.org/abs/2508.15706), Algorithm 1.
  Lidin et al., "Covenant-72B: Pre-Training a 72B LLM with Trustless Peers Over-the-Internet", 2026
  (https://arxiv.org/abs/2603.08163): H = 30, 64 of every 4,096, β = 0.95, 2 bits.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from jaxcomp._src import axis, chunked_topk, diloco, local_steps


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SparseLoCoConfig(diloco.DiLoCoConfig):
  """DiLoCo's settings under SparseLoCo's name: its exchange is ``chunked_topk`` and its outer
  momentum 0 (the error feedback replaces it)."""
  name = "sparseloco"


def sparseloco(inner: optax.GradientTransformation, *, sync_every: int, k: int = 64,
               chunk: int = 4096, bits: int = 2, error_decay: float = 0.95,
               outer_learning_rate: float = 1.0,
               axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """SparseLoCo: ``sync_every`` local steps of ``inner``, then a sparse 2-bit outer step.

  The module docstring numbers the steps. After every ``sync_every``-th step each device adds its
  pseudo-gradient θ − θᵢ to its error feedback (decayed by ``error_decay``), sends the ``k`` largest
  of every ``chunk`` coordinates in ``bits`` bits (``jaxcomp.chunked_topk``), and every device sets
  θ ← θ − ``outer_learning_rate``·mean of what was sent.

  It is the whole optimizer, as ``jaxcomp.diloco`` (whose steps it runs): its update needs
  ``params`` and returns ``jaxcomp.Assign`` updates, so every device holds bitwise the same θ after
  each synchronization; under ``jaxcomp.data_parallel`` the parameters are kept per device
  (``make_params``). Chain nothing after it; put gradient processing into ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = jaxcomp.sparseloco(optax.adamw(1e-3), sync_every=30, k=2, chunk=64)
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> params = jnp.ones((64, 16))  # 4 KiB of float32
    >>> opt_state, params = dp.make_state(params), dp.make_params(params)
    >>> report = jaxcomp.comm_report(dp.step, params, opt_state, dp.shard(jnp.ones((16, 64))))
    >>> report.phase("sparseloco.sync").bytes_by_dtype()  # 112 B from each device, every 30 steps
    {'u8': 896}
    >>> round(report.payload_bytes, 2)  # per step, on average: 896 / 30
    29.87

  Args:
    inner: the optimizer each device runs between synchronizations (the paper: AdamW).
    sync_every: H, inner steps per synchronization. The paper finds SparseLoCo ahead of DiLoCo for
      H = 15, 30, 50 and 100; Covenant-72B uses 30.
    k: coordinates sent per chunk. ``k / chunk`` is the density: 1–3% in the paper, 64 of 4,096
      (1.56%) in Covenant-72B; lower sends less and leaves more in the error feedback for later.
    chunk: elements per chunk (4,096, Covenant-72B's chunk for vectors).
    bits: bits per sent value, 1 to 4; with the paper's 2 it still does better than DiLoCo
      sending float32.
    error_decay: β. The error feedback replaces DiLoCo's outer momentum, and β < 1 lets it forget,
      as a momentum does; Covenant-72B's 0.95.
    outer_learning_rate: α of θ ← θ − α·mean(Δ̂). 1 applies the mean of what was sent as it is (the
      momentum DiLoCo's α = 0.7 damps is gone).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A ``GradientTransformation`` with a ``jaxcomp.DiLoCoState`` (its ``compressor_state`` is the
    ``jaxcomp.ErrorFeedbackState`` holding the error feedback, per device), whose update requires
    ``params``.

  References:
    Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", 2025, Algorithm 1.
  """
  exchange = chunked_topk.chunked_topk(k, chunk=chunk, bits=bits, error_decay=error_decay,
                                       axis_name=axis_name)
  config = SparseLoCoConfig(inner=inner, sync_every=sync_every,
                            outer_learning_rate=outer_learning_rate, outer_momentum=0.0,
                            compressor=exchange)
  return local_steps.transformation(config, diloco.init, diloco.step, axis_name)
