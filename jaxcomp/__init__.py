"""jaxcomp: gradient compression for JAX data parallelism, as optax transformations.

A jaxcomp transformation is the cross-device gradient mean: put it first in ``optax.chain`` where
data-parallel code would call ``lax.pmean``.
"""

from jaxcomp import axis, hooks
from jaxcomp.accumulate import AccumulateState, accumulate
from jaxcomp.buckets import CommHookState, GradBucket, TreeSignature, comm_hook
from jaxcomp.dense import DenseState, allreduce, bf16_compress, fp16_compress
from jaxcomp.dgc import DGCState, coarse_dgc, dgc
from jaxcomp.hooks import bf16_compress_wrapper, fp16_compress_wrapper
from jaxcomp.powersgd import (BatchedPowerSGDState, PowerSGDState, batched_powersgd, powersgd,
                              powersgd_stats)
from jaxcomp.report import Collective, CommReport, comm_report
from jaxcomp.sharding import state_partition_specs

__version__ = "0.1.0"

__all__ = [
    "Collective", "CommHookState", "CommReport", "DenseState", "GradBucket", "TreeSignature",
    "allreduce", "axis", "bf16_compress", "bf16_compress_wrapper", "comm_hook", "comm_report",
    "fp16_compress", "fp16_compress_wrapper", "hooks",
    "AccumulateState", "accumulate", "state_partition_specs",
    "DGCState", "coarse_dgc", "dgc",
    "BatchedPowerSGDState", "PowerSGDState", "batched_powersgd", "powersgd", "powersgd_stats",
]
