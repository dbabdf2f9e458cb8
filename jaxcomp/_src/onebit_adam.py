"""1-bit Adam: Adam whose momentum crosses the wire as signs once its variance is frozen.

Adam's update is not linear in the gradient, so error feedback cannot compress it directly; but its
variance settles early in training. 1-bit Adam therefore runs plain Adam on the dense mean gradient
for ``freeze_steps`` steps (the warm-up), then freezes the variance and exchanges only the momentum,
1-bit compressed with error feedback on the worker and on the server — momentum SGD preconditioned
by the frozen variance, which is linear in the gradient again. ``scale_by_onebit_adam`` returns the
direction (as ``optax.scale_by_adam``); ``onebit_adam`` scales it by the learning rate, the whole
optimizer (nothing is chained after it); ``jaxcomp.hooks.onebit_adam_hook`` is the same step on a
``comm_hook`` bucket, returning the direction for a momentum-free ``optax.sgd``.

The steps, per device, W devices, at step t = 0, 1, ... (the ``# n:`` comments below point here;
"Alg. 1" is the paper's Algorithm 1, "exchange n" the numbered list of ``jaxcomp._src.exchange``):

1. Warm-up (phase "warmup", t < ``freeze_steps``): the dense mean gradient ``ḡ`` (÷W, then a
   float32 all-reduce); ``m ← b1·m + (1 − b1)·ḡ``, ``v ← b2·v + (1 − b2)·ḡ²`` (Alg. 1 line 1, Adam).
   The state keeps ``√v``, updated as ``r·√(b2·(√v/r)² + (1 − b2)·(ḡ/r)²)`` with ``r = max(√v,
   |ḡ|)``: the same value, but ``ḡ²`` of a gradient above 1.8e19 would overflow float32.
2. Compression (phase "compressed", t ≥ ``freeze_steps``): ``m ← b1·m + (1 − b1)·g`` with this
   device's own gradient (Alg. 1 line 5); ``v`` stays frozen.
3. The momentum of all reduced leaves, in float32, goes through the two-phase exchange with the sign
   codec (its rows: ``exchange.layout``): worker ``p = m + δ``, scale ``‖p‖₁/L`` (the mean
   magnitude), signs packed 8 per byte, ``δ ← p − scale·sign(p)`` (Alg. 1 line 6); ``all_to_all`` of
   signs and scales; the owner averages the scaled signs of its row, adds its server error ``δ̄``,
   re-compresses with its own scale and ``δ̄ ← mean − scale·sign(mean)`` (line 9); ``all_gather``
   of signs and scales (line 10). Every
   device sets ``m`` to the result (line 12), so ``m`` is identical on every device — except where
   the frozen variance is exactly 0 (a gradient that was 0 throughout the warm-up, such as an
   always-blank input pixel's weights): a sign cannot say 0, and ``±scale / eps`` there would throw
   the parameter away, so ``m`` is 0 there. DeepSpeed asks the user for this mask
   (``exp_avg_mask``); here it is the variance's own.
4. The direction ``m̂ / (√v̂ + eps)`` with ``m̂ = m / (1 − b1^(t+1))`` and ``v̂ = v / (1 −
   b2^min(t+1, freeze_steps))`` (Adam's bias correction, the variance's frozen with it); with
   ``bias_correction=False`` ``m̂ = m``, ``v̂ = v``, DeepSpeed's formula. ``freeze_steps=0`` has no
   variance: the direction is ``m̂`` (1-bit compressed momentum SGD).
5. ``onebit_adam`` returns ``−learning_rate(t) · direction``, t the steps taken (a schedule is
   called with it, as ``optax.scale_by_learning_rate`` calls one with its count).
6. Non-finite gradients (the policy of ``jaxcomp._src.finite``), from what the step all-reduced or
   gathered anyway: the warm-up's dense mean, or the exchange's scales (exchange 7). Where they
   are not finite, m, √v and both errors keep their old values and every direction is NaN.

Bytes per device in the compression stage (payload, ``comm_report``): 2·W·S/8 for the signs (W rows
of S ≥ L/W values, S a multiple of 8) and 2·4·W for the scales, no flag (6) — about 1/32 of a
float32 all-reduce's ring bytes. The warm-up sends the dense float32 mean.

Differences from DeepSpeed's ``OnebitAdam``. The scale of a sign vector is its mean magnitude
``‖p‖₁/L`` (EF-SignSGD's), not DeepSpeed's ``‖p‖₂/√L``: with the mean magnitude
``‖p − scale·sign(p)‖ ≤ ‖p‖``, so the errors stay bounded; with DeepSpeed's the error of a sparse
``p`` can be √2 times ``p``, and on the digits MLP (whose always-blank pixels make the momentum
sparse) the worker error grew without bound and training diverged 35 steps after the freeze, where
the mean magnitude trains to Adam's accuracy (``tests/test_low_bit_training.py``). The others do not
change the algorithm: the bias correction is on by default (so that with ``freeze_steps`` beyond
the run this is ``optax.adam`` exactly; off, DeepSpeed's formula); the zero padding that makes the
vector divisible into rows is left out of
the scales and carries no error (DeepSpeed pads to a multiple of 8·W and lets the padding count in
the norm and accumulate error); the errors are saved with the state, so a resumed run continues
exactly (DeepSpeed resets them when it loads a checkpoint).

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication Efficient
  Large-Scale Training with Adam's Convergence Speed", ICML 2021 (https://arxiv.org/abs/2102.02888),
  Algorithm 1.
  DeepSpeed ``deepspeed/runtime/fp16/onebit/adam.py`` (``OnebitAdam``, ``freeze_step``) and
  ``deepspeed/runtime/comm/nccl.py`` (``compressed_allreduce`` with ``worker_error`` and
  ``server_error``); the DeepSpeed tutorial's advice: ``freeze_step`` 15–25% of the steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, compressor, exchange, finite, sign, validate
from jaxcomp._src import phases as phases_lib
from jaxcomp._src import tree as tree_lib

def _decay(value, name: str) -> float:
  """A decay rate in [0, 1)."""
  return validate.number(value, name, 0, 1, high_open=True)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class OneBitAdamConfig(compressor.MeanConfig):
  """1-bit Adam's settings, validated; a static node in the state.

  Attributes:
    freeze_steps: steps of plain Adam on the dense mean before the variance is frozen and the
      momentum compressed. The variance must have settled by then: DeepSpeed advises 15–25% of the
      run. 0 compresses from the first step with no variance at all (momentum SGD).
    b1: the momentum's decay (Adam's β1); the compressed quantity, so its averaging also smooths
      the compression error. It may be scheduled (``optax.inject_hyperparams``), as may ``b2`` and
      ``eps``.
    b2: the variance's decay (Adam's β2).
    eps: added to √v̂; keeps the step bounded where the frozen variance is tiny.
    bias_correction: Adam's bias correction of m and v (the variance's frozen at ``freeze_steps``);
      off is DeepSpeed's update, which is larger early on and after a short warm-up.
    learning_rate: ``onebit_adam``'s: a positive number, an optax schedule of the step count, or an
      array (``optax.inject_hyperparams``); None for ``scale_by_onebit_adam``, which returns the
      direction.
  """
  NONFINITE = "own"  # 6: from the exchange's scales, or the warm-up's dense mean

  freeze_steps: int = validate.setting(check=functools.partial(
      validate.integer, minimum=0, static="decides when the compressed stage starts"))
  b1: Any = validate.setting(0.9, check=_decay, traceable=True)
  b2: Any = validate.setting(0.999, check=_decay, traceable=True)
  eps: Any = validate.setting(1e-8, check=functools.partial(validate.number, low=0),
                              traceable=True)
  bias_correction: bool = validate.setting(True, check=validate.boolean)
  learning_rate: Any = validate.setting(None, check=validate.optional(validate.learning_rate),
                                        traceable=True)

  @property
  def name(self) -> str:
    return "scale_by_onebit_adam" if self.learning_rate is None else "onebit_adam"

  @property
  def output(self) -> str:
    """The direction for an optimizer to follow, or (with a learning rate) the update."""
    return "gradient" if self.learning_rate is None else "update"

  def phases(self) -> tuple:
    """Dense Adam ("warmup", absent when ``freeze_steps`` is 0), then "compressed"."""
    return ((phases_lib.Phase(f"{self.name}.warmup", 0.0, "warmup"),) if self.freeze_steps
            else ()) + (phases_lib.Phase(f"{self.name}.compressed", 1.0, "compressed"),)

  def phase_of(self, count) -> jax.Array:
    return (count >= self.freeze_steps).astype(jnp.int32)


class OneBitAdamState(NamedTuple):
  """State of ``scale_by_onebit_adam`` (and of ``jaxcomp.hooks.onebit_adam_hook``).

  Attributes:
    count: steps taken (non-finite steps are not counted).
    mu: the momentum m, the params' structure, float32 for each reduced leaf
      (``optax.MaskedNode()`` elsewhere); identical on every device.
    nu_root: the root of the variance, √v, likewise; frozen from ``freeze_steps`` on (a root, so
      that squares of large gradients cannot overflow it).
    worker_error: this device's compression error δ, likewise; per device.
    server_error: the server error δ̄ of the row this device owns, likewise (zero outside its row);
      per device.
    config: the static settings.
    signature: the gradient pytree's structure, shapes and dtypes.
  """
  count: jax.Array
  mu: Any
  nu_root: Any
  worker_error: Any
  server_error: Any
  config: OneBitAdamConfig
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("worker_error", "server_error")  # see jaxcomp.sharding


def init(config: OneBitAdamConfig, signature: tree_lib.TreeSignature) -> OneBitAdamState:
  """Zero moments and errors for gradients of ``signature``."""
  zeros = signature.place([jnp.zeros(s.shape, jnp.float32) for s in signature.reduced_structs()])
  return OneBitAdamState(jnp.zeros([], jnp.int32), zeros, zeros, zeros, zeros, config, signature)


def _root_mean_square_update(b2, root: jax.Array, g: jax.Array) -> jax.Array:
  """1: ``√(b2·root² + (1 − b2)·g²)`` computed relative to ``max(root, |g|)``: no overflow."""
  top = jnp.maximum(root, jnp.abs(g))
  safe = jnp.where(top > 0, top, 1.0)
  return top * jnp.sqrt(b2 * jnp.square(root / safe) + (1 - b2) * jnp.square(g / safe))


def _one_minus_power(b, t: jax.Array) -> jax.Array:
  """4: Adam's bias correction ``1 − bᵗ`` (t ≥ 1) as ``−expm1(t·log b)``: ``1 − 0.999ᵗ`` computed as
  written loses 3e-5 of its value to cancellation in float32 at t = 2. A Python ``b``'s logarithm
  is taken in float64."""
  if validate.is_array(b):
    log_b = jnp.log(b.astype(jnp.float32))
  else:
    log_b = jnp.float32(math.log(b) if b > 0 else -math.inf)
  return -jnp.expm1(t * log_b)


def step(config: OneBitAdamConfig, state: OneBitAdamState, leaves: list, axis_name,
         phase: phases_lib.Phase, params: Optional[list] = None) -> tuple:
  """Steps 1–6 (5 with a learning rate) on the reduced leaves: ``(directions, new state,
  finite)``; ``params`` is not used (1-bit Adam has no weight decay)."""
  del params
  signature = state.signature
  old_mu, old_root = signature.pick(state.mu), signature.pick(state.nu_root)
  errors = signature.pick(state.worker_error), signature.pick(state.server_error)
  grads = [g.astype(jnp.float32) for g in leaves]
  if not grads:
    return [], state, jnp.array(True)
  root = old_root
  if phase.value == "warmup":
    mean = [axis.mean(g, axis_name) for g in grads]  # 1: plain Adam on the dense mean
    ok = finite.reduced_finite(mean)  # 6
    mu = [config.b1 * m + (1 - config.b1) * g for m, g in zip(old_mu, mean)]
    root = finite.keep_if_finite(ok, [_root_mean_square_update(config.b2, r, g)
                                      for r, g in zip(old_root, mean)], old_root)
  else:
    # 2: the local momentum; 3: exchanged 1-bit with worker and server error (6: kept).
    local = [config.b1 * m + (1 - config.b1) * g for m, g in zip(old_mu, grads)]
    mu, *errors, ok = exchange.compressed_mean(sign.sign_codec(), local, *errors, axis_name)
    if config.freeze_steps:  # 3: no momentum where the frozen variance is 0
      mu = [jnp.where(r > 0, m, 0.0) for m, r in zip(mu, root)]
  mu = finite.keep_if_finite(ok, mu, old_mu)  # 6: kept where not finite (in place)
  # 4: the direction m̂ / (√v̂ + eps), v̂ frozen with v.
  t = (state.count + 1).astype(jnp.float32)
  directions = mu
  if config.bias_correction:
    directions = [m / _one_minus_power(config.b1, t) for m in mu]
  if config.freeze_steps:
    correction = (_one_minus_power(config.b2, jnp.minimum(t, config.freeze_steps))
                  if config.bias_correction else 1.0)
    directions = [m / (r / jnp.sqrt(correction) + config.eps) for m, r in zip(directions, root)]
  if config.learning_rate is not None:  # 5: the update, −learning_rate(t) · direction
    rate = config.learning_rate
    rate = rate(state.count) if callable(rate) else rate
    directions = [-jnp.asarray(rate, jnp.float32) * d for d in directions]
  new_state = state._replace(mu=signature.place(mu), nu_root=signature.place(root),
                             worker_error=signature.place(errors[0]),
                             server_error=signature.place(errors[1]))
  directions = finite.nan_unless_finite(ok, directions)  # 6: NaN everywhere where not finite
  return [d.astype(g.dtype) for d, g in zip(directions, leaves)], new_state, ok


def scale_by_onebit_adam(*, freeze_steps: int, axis_name: axis.AxisName = "batch",
                         b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         bias_correction: bool = True,
                         bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """1-bit Adam's direction ``m̂ / (√v̂ + eps)``, averaged over the devices, without learning rate.

  Plain Adam on the dense mean gradient for ``freeze_steps`` steps; then the variance is frozen and
  only the momentum is exchanged, as signs (1 bit per value) with one scale per row, with error
  feedback on the worker and on the server (the module docstring numbers the steps). It averages
  the gradient itself, as ``optax.scale_by_adam`` after ``jaxcomp.allreduce`` would; follow it with
  the learning rate (``optax.scale_by_learning_rate``, or ``jaxcomp.onebit_adam`` for both). On a
  step whose gradient is non-finite on any device the state is kept and the direction is NaN.

  Example:
    >>> import jax, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.scale_by_onebit_adam(freeze_steps=1),
    ...                  optax.scale_by_learning_rate(1e-3))
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 32, 32))}  # 4 KiB per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch"), grads, state)
    >>> report.phase("scale_by_onebit_adam.warmup").payload_bytes, report.payload_bytes
    (4096, 320)

  Args:
    freeze_steps: steps of dense Adam before compression (DeepSpeed's ``freeze_step``; 15–25% of the
      run is its advice); 0 compresses from the first step without a variance (momentum SGD).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    b1, b2, eps: Adam's; they may be arrays (``optax.inject_hyperparams``).
    bias_correction: Adam's bias correction (off: DeepSpeed's update).
    bucket_cap_mb: None, or DDP's bucket cap in MiB: one state and one exchange per bucket.

  Returns:
    A ``GradientTransformation`` with a ``OneBitAdamState``; its directions are identical on every
    device, in the gradients' dtypes.

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
    Speed", ICML 2021, Algorithm 1; DeepSpeed ``OnebitAdam`` / ``compressed_allreduce``.
  """
  config = OneBitAdamConfig(freeze_steps=freeze_steps, b1=b1, b2=b2, eps=eps,
                            bias_correction=bias_correction)
  return compressor.transformation(config, init, step, axis_name, bucket_cap_mb=bucket_cap_mb)


def onebit_adam(learning_rate, *, freeze_steps: int, axis_name: axis.AxisName = "batch",
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                bias_correction: bool = True,
                bucket_cap_mb: Optional[float] = None) -> optax.GradientTransformation:
  """DeepSpeed's 1-bit Adam as an optax optimizer: it averages the gradient itself.

  ``scale_by_onebit_adam``'s direction scaled by the learning rate, as ``optax.adam`` is
  ``scale_by_adam`` chained with it (step 5). Use it in place of
  ``optax.chain(jaxcomp.allreduce(), optax.adam(lr))``, with nothing chained after it but a
  guard::

    tx = optax.chain(jaxcomp.onebit_adam(1e-3, freeze_steps=2000),
                     optax.apply_if_finite(optax.identity(), 10))

  Example:
    >>> import jax, optax, jaxcomp
    >>> tx = jaxcomp.onebit_adam(1e-3, freeze_steps=1)  # one step of dense Adam, then 1 bit
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 32, 32))}  # one per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> step = jax.pmap(tx.update, axis_name="batch")
    >>> for _ in range(2):
    ...   updates, state = step(grads, state)
    ...   print(bool((updates["w"] == updates["w"][0]).all()))  # the same on every device
    True
    True

  Args:
    learning_rate: a positive number or an optax schedule of the step count (called with the
      steps taken, as ``optax.scale_by_schedule`` calls one with its count; a non-finite step is
      not counted); an array under ``optax.inject_hyperparams``.
    freeze_steps: steps of dense Adam before compression (DeepSpeed's ``freeze_step``; 15–25% of the
      run is its advice); 0 compresses from the first step without a variance (momentum SGD).
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).
    b1, b2, eps: Adam's.
    bias_correction: Adam's bias correction (off: DeepSpeed's update).
    bucket_cap_mb: None, or DDP's bucket cap in MiB: one state and one exchange per bucket.

  Returns:
    A ``jaxcomp.Transformation`` whose updates are ``−learning_rate · m̂ / (√v̂ + eps)``,
    identical on every device, in the gradients' dtypes; its state is a ``OneBitAdamState``.

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
    Speed", ICML 2021, Algorithm 1; DeepSpeed ``OnebitAdam`` / ``compressed_allreduce``.
  """
  config = OneBitAdamConfig(freeze_steps=freeze_steps, b1=b1, b2=b2, eps=eps,
                            bias_correction=bias_correction, learning_rate=learning_rate)
  return compressor.transformation(config, init, step, axis_name, bucket_cap_mb=bucket_cap_mb)
