"""Every named compressor of the registry (``jaxcomp.train.registry``), at the scale of the tests.

The cross-cutting tests (properties, faults, resume, bad input) run every registry entry on pytrees of
a few hundred elements. ``make(name)`` builds the entry with the recipe of a 30-step run — PowerSGD
compresses from step 3, so short runs cover both of its phases — and with the settings below, which
make tiny leaves behave as big ones do: PowerSGD rank 4 compresses them, DGC sparsifies them from the
first step (no warm-up: its dense stages are tested in test_dgc.py), hooks split them into several
buckets, and 1-bit Adam compresses from step 2 (so that 4 steps cover both of its stages) with a
learning rate for the tests' small regression.
"""

import functools

from jaxcomp.train.registry import REGISTRY

SMALL = {
    "powersgd_r4": {"min_compression_rate": 1.0},
    "dgc": {"ratio": 0.05, "warmup": None},
    "dgc_exact_fp16": {"ratio": 0.05, "warmup": None},
    "coarse_dgc": {"ratio": 0.25, "chunk_size": 8, "warmup": None},
    "hook_fp16_allreduce": {"bucket_cap_mb": 0.01},
    "hook_powersgd_r2": {"bucket_cap_mb": 0.001},
    "onebit_adam": {"learning_rate": 0.01, "freeze_steps": 2},
}

COMPRESSORS = {name: functools.partial(entry.make, steps=30, **SMALL.get(name, {}))
               for name, entry in REGISTRY.items()}

# The dtype each compressor puts on the wire for float32 gradients (None: the gradient's own).
WIRE_DTYPE = {name: entry.wire_dtype for name, entry in REGISTRY.items() if entry.wire_dtype}

# Compressors whose output is the plain mean (up to the wire dtype's rounding).
MEAN_COMPRESSORS = tuple(name for name, entry in REGISTRY.items() if entry.is_mean)

# Whole optimizers (their output is the update): nothing is chained after them.
OPTIMIZERS = tuple(name for name, entry in REGISTRY.items() if entry.is_optimizer)

# Compressors with torch-style error feedback: output + new error = gradient + old error, per device.
ERROR_FEEDBACK = tuple(name for name, entry in REGISTRY.items() if entry.error_feedback)
