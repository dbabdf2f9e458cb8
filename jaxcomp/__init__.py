"""jaxcomp: gradient compression for JAX data parallelism, as optax transformations.

A jaxcomp transformation is the cross-device gradient mean: put it first in ``optax.chain`` where
data-parallel code would call ``lax.pmean``. The implementation lives in ``jaxcomp._src`` (private);
the public names are re-exported here, one per line, and in the namespaces ``jaxcomp.axis`` (for hook
writers) and ``jaxcomp.hooks`` (per-bucket hooks). ``python -m jaxcomp.train`` is the main job.
"""

from jaxcomp import axis
from jaxcomp import hooks
from jaxcomp._src.accumulate import AccumulateState
from jaxcomp._src.accumulate import accumulate
from jaxcomp._src.axis import UnboundAxisError
from jaxcomp._src.buckets import CommHookState
from jaxcomp._src.buckets import GradBucket
from jaxcomp._src.buckets import comm_hook
from jaxcomp._src.dense import DenseState
from jaxcomp._src.dense import allreduce
from jaxcomp._src.dense import bf16_compress
from jaxcomp._src.dense import fp16_compress
from jaxcomp._src.dgc import PAPER_WARMUP
from jaxcomp._src.dgc import ChunkExchange
from jaxcomp._src.dgc import DGCConfig
from jaxcomp._src.dgc import DGCState
from jaxcomp._src.dgc import TopKExchange
from jaxcomp._src.dgc import coarse_dgc
from jaxcomp._src.dgc import dgc
from jaxcomp._src.diloco import DiLoCoConfig
from jaxcomp._src.diloco import DiLoCoState
from jaxcomp._src.diloco import diloco
from jaxcomp._src.hooks import bf16_compress_wrapper
from jaxcomp._src.hooks import fp16_compress_wrapper
from jaxcomp._src.local_sgd import LocalSGDConfig
from jaxcomp._src.local_sgd import LocalSGDState
from jaxcomp._src.local_sgd import local_sgd
from jaxcomp._src.local_steps import Assign
from jaxcomp._src.powersgd import PowerSGDConfig
from jaxcomp._src.powersgd import PowerSGDState
from jaxcomp._src.powersgd import batched_powersgd
from jaxcomp._src.powersgd import powersgd
from jaxcomp._src.powersgd import powersgd_stats
from jaxcomp._src.report import Collective
from jaxcomp._src.report import CommReport
from jaxcomp._src.report import comm_report
from jaxcomp._src.sharding import state_partition_specs
from jaxcomp._src.tree import TreeSignature

__version__ = "0.1.0"

__all__ = (
    "AccumulateState",
    "Assign",
    "ChunkExchange",
    "Collective",
    "CommHookState",
    "CommReport",
    "DGCConfig",
    "DGCState",
    "DenseState",
    "DiLoCoConfig",
    "DiLoCoState",
    "GradBucket",
    "LocalSGDConfig",
    "LocalSGDState",
    "PAPER_WARMUP",
    "PowerSGDConfig",
    "PowerSGDState",
    "TopKExchange",
    "TreeSignature",
    "UnboundAxisError",
    "accumulate",
    "allreduce",
    "axis",
    "batched_powersgd",
    "bf16_compress",
    "bf16_compress_wrapper",
    "coarse_dgc",
    "comm_hook",
    "comm_report",
    "dgc",
    "diloco",
    "fp16_compress",
    "fp16_compress_wrapper",
    "hooks",
    "local_sgd",
    "powersgd",
    "powersgd_stats",
    "state_partition_specs",
)
