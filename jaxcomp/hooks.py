"""Per-bucket communication hooks for ``jaxcomp.comm_hook`` (torch's ``ddp_comm_hooks``).

A hook is ``hook(state, bucket) -> (reduced_buffer, new_state)``: it gets this device's flat,
undivided gradient bucket (a ``jaxcomp.GradBucket``) and returns the buffer every device uses.
Writing one is a few lines; this one rounds the bucket to 255 levels of a scale shared by all
devices (the levels are summed as int32, which cannot overflow; sending them as int8 would need an
all-gather instead).

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxcomp
  >>> def int8_hook(state, bucket):
  ...   scale = jaxcomp.axis.pmax(jnp.abs(bucket.buffer).max(), bucket.axis_name) / 127
  ...   q = jnp.round(bucket.buffer / jnp.maximum(scale, 1e-30)).astype(jnp.int32)
  ...   total = jaxcomp.axis.psum(q, bucket.axis_name)  # W * 127 fits easily in int32
  ...   n = jaxcomp.axis.axis_size(bucket.axis_name)
  ...   return (total * scale / n).astype(bucket.buffer.dtype), state
  >>> tx = optax.chain(jaxcomp.comm_hook(int8_hook), optax.sgd(0.1))
  >>> grads = jnp.arange(8.0).reshape(8, 1)  # device i's gradient is [i]: the mean is 3.5
  >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")
  >>> print(f"{float(step(grads)[0, 0]):.3f}")  # -0.1 × 3.5, to the int8 rounding
  -0.350

The stateful hooks (``powersgd_hook``, ``batched_powersgd_hook``, ``dgc_hook``, ``quantized_hook``,
``sign_hook``, ``onebit_adam_hook``, ``chunked_topk_hook``) take their per-bucket state from the
``*_state`` function beside them, and run the same code as the transformations.

References:
  PyTorch, ``torch/distributed/algorithms/ddp_comm_hooks/``.
"""

from jaxcomp._src.hooks import allreduce_hook
from jaxcomp._src.hooks import batched_powersgd_hook
from jaxcomp._src.hooks import batched_powersgd_state
from jaxcomp._src.hooks import bf16_compress_hook
from jaxcomp._src.hooks import bf16_compress_wrapper
from jaxcomp._src.hooks import chunked_topk_hook
from jaxcomp._src.hooks import chunked_topk_state
from jaxcomp._src.hooks import dgc_hook
from jaxcomp._src.hooks import dgc_state
from jaxcomp._src.hooks import fp16_compress_hook
from jaxcomp._src.hooks import fp16_compress_wrapper
from jaxcomp._src.hooks import noop_hook
from jaxcomp._src.hooks import onebit_adam_hook
from jaxcomp._src.hooks import onebit_adam_state
from jaxcomp._src.hooks import powersgd_hook
from jaxcomp._src.hooks import powersgd_state
from jaxcomp._src.hooks import quantized_hook
from jaxcomp._src.hooks import quantized_state
from jaxcomp._src.hooks import sign_hook
from jaxcomp._src.hooks import sign_state

__all__ = (
    "allreduce_hook",
    "batched_powersgd_hook",
    "batched_powersgd_state",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "chunked_topk_hook",
    "chunked_topk_state",
    "dgc_hook",
    "dgc_state",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "onebit_adam_hook",
    "onebit_adam_state",
    "powersgd_hook",
    "powersgd_state",
    "quantized_hook",
    "quantized_state",
    "sign_hook",
    "sign_state",
)
