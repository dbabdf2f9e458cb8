"""Every jaxcomp compressor the cross-cutting tests (properties, faults, resume) run, by name."""

import jaxcomp
from jaxcomp import hooks

COMPRESSORS = {
    "allreduce": lambda **kw: jaxcomp.allreduce(**kw),
    "fp16": lambda **kw: jaxcomp.fp16_compress(**kw),
    "bf16": lambda **kw: jaxcomp.bf16_compress(**kw),
    "hook_fp16_wrapped_allreduce": lambda **kw: jaxcomp.comm_hook(
        jaxcomp.fp16_compress_wrapper(hooks.allreduce_hook), bucket_cap_mb=0.01, **kw),
}

# The dtype each compressor puts on the wire for float32 gradients (None: the gradient's own).
WIRE_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "hook_fp16_wrapped_allreduce": "float16"}
