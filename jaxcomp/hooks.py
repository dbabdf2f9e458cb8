"""Per-bucket communication hooks for ``jaxcomp.comm_hook`` (torch's ``default_hooks``).

A hook is ``hook(state, bucket) -> (reduced_buffer, new_state)``: it gets this device's flat, undivided
gradient bucket (a ``jaxcomp.GradBucket``) and returns the buffer every device uses. Writing one is a
few lines; this one sends the bucket as int8 with a shared per-bucket scale::

    def int8_hook(state, bucket):
      scale = jaxcomp.axis.pmax(jnp.abs(bucket.buffer).max(), bucket.axis_name) / 127
      q = jnp.round(bucket.buffer / jnp.maximum(scale, 1e-30)).astype(jnp.int32)
      total = jaxcomp.axis.psum(q, bucket.axis_name)  # W * 127 fits easily in int32
      n = jaxcomp.axis.axis_size(bucket.axis_name)
      return (total * scale / n).astype(bucket.buffer.dtype), state

    tx = optax.chain(jaxcomp.comm_hook(int8_hook), optax.sgd(0.1))

References:
  PyTorch, ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp import axis
from jaxcomp.buckets import GradBucket, Hook


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
  """Returns the local bucket without communicating: a baseline for hook overhead, not for training."""
  return bucket.buffer, state


def _cast_wrapper(hook: Hook, wire_dtype, name: str) -> Hook:

  def wrapped(state, bucket: GradBucket):
    reduced, state = hook(state, bucket.replace(buffer=bucket.buffer.astype(wire_dtype)))
    return reduced.astype(bucket.buffer.dtype), state

  wrapped.__name__ = f"{name}({getattr(hook, '__name__', 'hook')})"
  return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
  """Runs ``hook`` on the bucket cast to float16 and casts its result back (torch's wrapper)."""
  return _cast_wrapper(hook, jnp.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: Hook) -> Hook:
  """Runs ``hook`` on the bucket cast to bfloat16 and casts its result back (torch's wrapper)."""
  return _cast_wrapper(hook, jnp.bfloat16, "bf16_compress_wrapper")
