"""The built-in per-bucket hooks; ``jaxcomp.hooks`` documents them and how to write one.

The dense hooks are torch's ``default_hooks``, a line each. Every other hook runs its algorithm's
step through the compressor adapter (``compressor.run_hook``): the same step as the transformation,
on the bucket's parameters; its state factory takes the transformation's own keyword arguments (but
``axis_name``, which is the bucket's, and ``bucket_cap_mb``, which is ``comm_hook``'s).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxcomp._src import axis, chunked_topk, compressor, dgc, dgc_config, onebit_adam, powersgd
from jaxcomp._src import quantized, sign
from jaxcomp._src.buckets import GradBucket, Hook


def allreduce_hook(state, bucket: GradBucket):
  """Divides by the world size, then sums: the plain mean DDP runs without a hook."""
  return axis.mean(bucket.buffer, bucket.axis_name), state


def fp16_compress_hook(state, bucket: GradBucket):
  """Casts to float16, divides by W, sums in float16, casts back to the bucket's dtype."""
  return axis.mean(bucket.buffer, bucket.axis_name, jnp.float16), state


def bf16_compress_hook(state, bucket: GradBucket):
  """As ``fp16_compress_hook`` in bfloat16 (torch allows it only on NCCL; jaxcomp everywhere)."""
  return axis.mean(bucket.buffer, bucket.axis_name, jnp.bfloat16), state


def noop_hook(state, bucket: GradBucket):
  """The local bucket, without communicating: a baseline for hook overhead, not for training."""
  return bucket.buffer, state


def _cast_wrapper(hook: Hook, wire_dtype, name: str) -> Hook:

  def wrapped(state, bucket: GradBucket):
    reduced, state = hook(state, bucket.replace(buffer=bucket.buffer.astype(wire_dtype)))
    return reduced.astype(bucket.buffer.dtype), state

  wrapped.__name__ = f"{name}({getattr(hook, '__name__', 'hook')})"
  return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
  """Runs ``hook`` on the bucket cast to float16 and casts its result back (torch's wrapper).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> hook = jaxcomp.fp16_compress_wrapper(jaxcomp.hooks.powersgd_hook)
    >>> tx = jaxcomp.comm_hook(hook, jaxcomp.hooks.powersgd_state(1, start_iter=0))
    >>> grads = jnp.ones((8, 16, 16))  # a 16 × 16 gradient per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch"), grads, state)
    >>> report.bytes_by_dtype()  # P and Q of rank 1 in float16 (and the all-finite flag)
    {'s32': 4, 'f16': 64}
  """
  return _cast_wrapper(hook, jnp.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: Hook) -> Hook:
  """Runs ``hook`` on the bucket cast to bfloat16 and casts its result back (torch's wrapper).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> tx = jaxcomp.comm_hook(jaxcomp.bf16_compress_wrapper(jaxcomp.hooks.allreduce_hook))
    >>> grads = jnp.ones((8, 256))  # 1 KiB of float32 per device
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")
    >>> jaxcomp.comm_report(step, grads, stage="lowered").bytes_by_dtype(), step(grads).dtype
    ({'bf16': 512}, dtype('float32'))
  """
  return _cast_wrapper(hook, jnp.bfloat16, "bf16_compress_wrapper")


# ---------------------------------------------------------------------------------------- PowerSGD

def powersgd_hook(state, bucket: GradBucket):
  """Layer-wise PowerSGD on one bucket (torch's ``powerSGD_hook``): ``jaxcomp.powersgd``'s step on
  the bucket's parameters, each viewed as a matrix; state from ``powersgd_state``."""
  return compressor.run_hook(powersgd.step, state, bucket, "powersgd")


def batched_powersgd_hook(state, bucket: GradBucket):
  """Batched PowerSGD on one bucket (torch's ``batched_powerSGD_hook``, which raises in torch
  2.13): the bucket as one zero-padded square matrix; state from ``batched_powersgd_state``."""
  return compressor.run_hook(powersgd.step, state, bucket, "batched_powersgd")


def powersgd_state(rank: int = 1, **settings):
  """The per-bucket state of ``powersgd_hook``: pass it as ``comm_hook``'s ``state``::

    tx = jaxcomp.comm_hook(jaxcomp.hooks.powersgd_hook, jaxcomp.hooks.powersgd_state(rank=2))
    tx = jaxcomp.comm_hook(jaxcomp.fp16_compress_wrapper(jaxcomp.hooks.powersgd_hook),
                           jaxcomp.hooks.powersgd_state(rank=2))

  Each bucket gets a ``jaxcomp.PowerSGDState`` for its parameters, which carries these settings
  (torch keeps one ``PowerSGDState`` with per-bucket dictionaries instead). Under
  ``fp16_compress_wrapper`` the hook computes in float16 while the state keeps the bucket's own
  dtype, storing only float16 values there, as torch's float16 state does.

  Args:
    rank: as ``jaxcomp.powersgd``.
    **settings: the other settings of ``jaxcomp.powersgd`` (without ``axis_name`` and
      ``bucket_cap_mb``).

  Returns:
    A function ``bucket -> PowerSGDState``.
  """
  return compressor.hook_state("powersgd", compressor.config_of(
      powersgd.PowerSGDConfig, "powersgd", rank=rank, **settings), powersgd.init)


def batched_powersgd_state(rank: int = 1, **settings):
  """The per-bucket state of ``batched_powersgd_hook``: each bucket is one zero-padded square
  matrix.

  Args:
    rank: as ``jaxcomp.batched_powersgd``.
    **settings: its other settings (without ``axis_name``).

  Returns:
    A function ``bucket -> PowerSGDState``.
  """
  return compressor.hook_state("batched_powersgd", compressor.config_of(
      powersgd.PowerSGDConfig, "batched_powersgd", rank=rank, batched=True, **settings),
      powersgd.init)


# ---------------------------------------------------------------------------------------- DGC

def dgc_hook(state, bucket: GradBucket):
  """Deep Gradient Compression on one bucket, each parameter treated as ``jaxcomp.dgc`` treats a
  leaf; state from ``dgc_state``."""
  return compressor.run_hook(dgc.step, state, bucket, "dgc")


def dgc_state(ratio: float = 0.001, **settings):
  """The per-bucket state of ``dgc_hook``: pass it as ``comm_hook``'s ``state``::

    tx = jaxcomp.comm_hook(jaxcomp.hooks.dgc_hook, jaxcomp.hooks.dgc_state(0.001, momentum=0.9))

  Args:
    ratio: as ``jaxcomp.dgc``.
    **settings: its other settings (without ``axis_name`` and ``bucket_cap_mb``; not
      ``clip_norm``: local clipping needs the whole gradient's norm, which a bucket does not see).

  Returns:
    A function ``bucket -> jaxcomp.DGCState``.
  """
  return compressor.hook_state("dgc", compressor.config_of(
      functools.partial(dgc_config.config, dgc_config.TopKExchange), "dgc", ratio=ratio,
      **settings), dgc.init)


def quantized_hook(state, bucket: GradBucket):
  """8-bit averaging of one bucket (``jaxcomp.quantized``'s step); state from
  ``quantized_state``."""
  return compressor.run_hook(quantized.step, state, bucket, "quantized")


def sign_hook(state, bucket: GradBucket):
  """EF-SignSGD's scaled-sign mean of one bucket, a scale per parameter
  (``jaxcomp.sign_compress``'s step); state from ``sign_state``."""
  return compressor.run_hook(sign.step, state, bucket, "sign", made_by="sign_compress")


def onebit_adam_hook(state, bucket: GradBucket):
  """1-bit Adam on one bucket: returns the direction ``m̂ / (√v̂ + eps)`` for a momentum-free
  ``optax.sgd`` (``jaxcomp.scale_by_onebit_adam``'s step); state from ``onebit_adam_state``."""
  return compressor.run_hook(onebit_adam.step, state, bucket, "onebit_adam",
                             made_by="scale_by_onebit_adam")


def quantized_state(bits=8, **settings):
  """The per-bucket state of ``quantized_hook``: pass it as ``comm_hook``'s ``state``::

    tx = jaxcomp.comm_hook(jaxcomp.hooks.quantized_hook, jaxcomp.hooks.quantized_state(8))

  Args:
    bits: as ``jaxcomp.quantized``.
    **settings: its other settings (without ``axis_name``).

  Returns:
    A function ``bucket -> jaxcomp.QuantizedState``.
  """
  return compressor.hook_state("quantized", compressor.config_of(
      quantized.QuantizedConfig, "quantized", bits=bits, **settings), quantized.init)


def sign_state(**settings):
  """The per-bucket state of ``sign_hook`` (one scale per parameter): ``comm_hook``'s ``state``.

  Args:
    **settings: as ``jaxcomp.sign_compress`` (without ``axis_name``).

  Returns:
    A function ``bucket -> jaxcomp.ErrorFeedbackState``.
  """
  return compressor.hook_state("sign", compressor.config_of(sign.SignConfig, "sign", **settings),
                               sign.init)


def onebit_adam_state(**settings):
  """The per-bucket state of ``onebit_adam_hook``: pass it as ``comm_hook``'s ``state``::

    tx = optax.chain(jaxcomp.comm_hook(jaxcomp.hooks.onebit_adam_hook,
                                       jaxcomp.hooks.onebit_adam_state(freeze_steps=2000)),
                     optax.sgd(1e-3))

  Args:
    **settings: as ``jaxcomp.scale_by_onebit_adam`` (without ``axis_name``): the hook returns 1-bit
      Adam's direction, which a momentum-free SGD turns into the update.

  Returns:
    A function ``bucket -> jaxcomp.OneBitAdamState``.
  """
  return compressor.hook_state("onebit_adam", compressor.config_of(
      onebit_adam.OneBitAdamConfig, "onebit_adam", **settings), onebit_adam.init)


# ------------------------------------------------------------------------------------ chunked top-k

def chunked_topk_hook(state, bucket: GradBucket):
  """SparseLoCo's exchange on one bucket (``jaxcomp.chunked_topk``'s step); state from
  ``chunked_topk_state``."""
  return compressor.run_hook(chunked_topk.step, state, bucket, "chunked_topk")


def chunked_topk_state(k: int = 64, **settings):
  """The per-bucket state of ``chunked_topk_hook``: pass it as ``comm_hook``'s ``state``.

  Args:
    k: as ``jaxcomp.chunked_topk``.
    **settings: its other settings (without ``axis_name`` and ``bucket_cap_mb``).

  Returns:
    A function ``bucket -> jaxcomp.ErrorFeedbackState``.
  """
  return compressor.hook_state("chunked_topk", compressor.config_of(
      chunked_topk.ChunkedTopKConfig, "chunked_topk", k=k, **settings), chunked_topk.init)
