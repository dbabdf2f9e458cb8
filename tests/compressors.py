"""Every jaxcomp compressor the cross-cutting tests (properties, faults, resume) run, by name.

PowerSGD starts compressing at step 3 here, so that short runs cover both of its phases.
"""

import jax.numpy as jnp

import jaxcomp
from jaxcomp import hooks

COMPRESSORS = {
    "allreduce": lambda **kw: jaxcomp.allreduce(**kw),
    "fp16": lambda **kw: jaxcomp.fp16_compress(**kw),
    "bf16": lambda **kw: jaxcomp.bf16_compress(**kw),
    "hook_fp16_wrapped_allreduce": lambda **kw: jaxcomp.comm_hook(
        jaxcomp.fp16_compress_wrapper(hooks.allreduce_hook), bucket_cap_mb=0.01, **kw),
    "powersgd_r1": lambda **kw: jaxcomp.powersgd(1, start_iter=3, **kw),
    "powersgd_r4": lambda **kw: jaxcomp.powersgd(4, start_iter=3, min_compression_rate=1.0, **kw),
    "batched_powersgd": lambda **kw: jaxcomp.batched_powersgd(2, start_iter=3, **kw),
    "hook_powersgd": lambda **kw: jaxcomp.comm_hook(
        hooks.powersgd_hook, hooks.powersgd_state(2, start_iter=3), bucket_cap_mb=0.001, **kw),
    "dgc": lambda **kw: jaxcomp.dgc(0.05, **kw),
    "dgc_exact_fp16": lambda **kw: jaxcomp.dgc(0.05, selection="exact", value_dtype=jnp.float16,
                                               **kw),
    "coarse_dgc": lambda **kw: jaxcomp.coarse_dgc(0.25, chunk_size=8, **kw),
}

# The dtype each compressor puts on the wire for float32 gradients (None: the gradient's own).
WIRE_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "hook_fp16_wrapped_allreduce": "float16"}

# Compressors whose output is the plain mean (up to the wire dtype's rounding).
MEAN_COMPRESSORS = ("allreduce", "fp16", "bf16", "hook_fp16_wrapped_allreduce")

# Compressors with torch-style error feedback: output + new error = gradient + old error, per device.
ERROR_FEEDBACK = ("powersgd_r1", "powersgd_r4", "batched_powersgd")
