"""jaxcomp: gradient compression for JAX data parallelism, as optax transformations.

A jaxcomp transformation is the cross-device gradient mean: put it first in ``optax.chain`` where
data-parallel code would call ``lax.pmean``. The implementation lives in ``jaxcomp._src`` (private);
the public names are re-exported here, one per line, and in the namespaces ``jaxcomp.axis`` (for
hook writers) and ``jaxcomp.hooks`` (per-bucket hooks). ``python -m jaxcomp.train`` is the main job.
"""

from jaxcomp import axis
from jaxcomp import hooks
from jaxcomp._src.accumulate import AccumulateState
from jaxcomp._src.accumulate import accumulate
from jaxcomp._src.axis import UnboundAxisError
from jaxcomp._src.buckets import CommHookState
from jaxcomp._src.buckets import GradBucket
from jaxcomp._src.buckets import comm_hook
from jaxcomp._src.compressor import ErrorFeedbackState
from jaxcomp._src.chunked_topk import ChunkedTopKConfig
from jaxcomp._src.chunked_topk import chunked_topk
from jaxcomp._src.data_parallel import data_parallel
from jaxcomp._src.dense import DenseState
from jaxcomp._src.dense import allreduce
from jaxcomp._src.dense import bf16_compress
from jaxcomp._src.dense import fp16_compress
from jaxcomp._src.demo import DeMoConfig
from jaxcomp._src.demo import DeMoState
from jaxcomp._src.demo import demo
from jaxcomp._src.desloc import DesLocConfig
from jaxcomp._src.desloc import DesLocState
from jaxcomp._src.desloc import desloc
from jaxcomp._src.dgc import DGCState
from jaxcomp._src.dgc import coarse_dgc
from jaxcomp._src.dgc import dgc
from jaxcomp._src.dgc_config import PAPER_WARMUP
from jaxcomp._src.dgc_config import ChunkExchange
from jaxcomp._src.dgc_config import DGCConfig
from jaxcomp._src.dgc_config import TopKExchange
from jaxcomp._src.diloco import DiLoCoConfig
from jaxcomp._src.diloco import DiLoCoState
from jaxcomp._src.diloco import diloco
from jaxcomp._src.dion import DionConfig
from jaxcomp._src.dion import DionState
from jaxcomp._src.dion import dion
from jaxcomp._src.dion import dion_fan_in
from jaxcomp._src.distributed import ReplicaMismatchError
from jaxcomp._src.distributed import all_have_data
from jaxcomp._src.distributed import broadcast_replicated
from jaxcomp._src.distributed import check_replicated
from jaxcomp._src.distributed import sync_buffers
from jaxcomp._src.guard import SkipIfNonfiniteState
from jaxcomp._src.guard import skip_if_nonfinite
from jaxcomp._src.fsdp import Layer
from jaxcomp._src.fsdp import call_layer
from jaxcomp._src.fsdp import gather_layer
from jaxcomp._src.fsdp_step import FullySharded
from jaxcomp._src.fsdp_step import FullyShardedState
from jaxcomp._src.fsdp_step import fully_sharded
from jaxcomp._src.hierarchical import HierarchicalState
from jaxcomp._src.hierarchical import hierarchical
from jaxcomp._src.hooks import bf16_compress_wrapper
from jaxcomp._src.hooks import fp16_compress_wrapper
from jaxcomp._src.interface import Transformation
from jaxcomp._src.local_sgd import LocalSGDConfig
from jaxcomp._src.local_sgd import LocalSGDState
from jaxcomp._src.local_sgd import local_sgd
from jaxcomp._src.local_steps import Assign
from jaxcomp._src.membership import Membership
from jaxcomp._src.misuse import check
from jaxcomp._src.onebit_adam import OneBitAdamConfig
from jaxcomp._src.onebit_adam import OneBitAdamState
from jaxcomp._src.onebit_adam import onebit_adam
from jaxcomp._src.onebit_adam import scale_by_onebit_adam
from jaxcomp._src.placement import DataParallel
from jaxcomp._src.powersgd import PowerSGDConfig
from jaxcomp._src.powersgd import PowerSGDState
from jaxcomp._src.powersgd import batched_powersgd
from jaxcomp._src.powersgd import powersgd
from jaxcomp._src.powersgd import powersgd_stats
from jaxcomp._src.quantized import QuantizedConfig
from jaxcomp._src.quantized import QuantizedState
from jaxcomp._src.quantized import quantized
from jaxcomp._src.report import Collective
from jaxcomp._src.report import CommReport
from jaxcomp._src.report import comm_report
from jaxcomp._src.sharding import PerDevice
from jaxcomp._src.sharding import per_device_mask
from jaxcomp._src.sharding import state_partition_specs
from jaxcomp._src.sign import SignConfig
from jaxcomp._src.sign import sign_compress
from jaxcomp._src.sparseloco import sparseloco
from jaxcomp._src.streaming_diloco import StreamingDiLoCoConfig
from jaxcomp._src.streaming_diloco import StreamingDiLoCoState
from jaxcomp._src.streaming_diloco import fragment_layout
from jaxcomp._src.streaming_diloco import streaming_diloco
from jaxcomp._src.tree import TreeSignature
from jaxcomp._src.zero import ShardedOptimizerState
from jaxcomp._src.zero import sharded_clip_by_global_norm
from jaxcomp._src.zero import sharded_optimizer

__version__ = "0.1.0"

__all__ = (
    "AccumulateState",
    "Assign",
    "ChunkExchange",
    "ChunkedTopKConfig",
    "Collective",
    "CommHookState",
    "CommReport",
    "DGCConfig",
    "DGCState",
    "DataParallel",
    "DeMoConfig",
    "DeMoState",
    "DenseState",
    "DesLocConfig",
    "DesLocState",
    "DiLoCoConfig",
    "DiLoCoState",
    "DionConfig",
    "DionState",
    "ErrorFeedbackState",
    "FullySharded",
    "FullyShardedState",
    "GradBucket",
    "HierarchicalState",
    "Layer",
    "LocalSGDConfig",
    "LocalSGDState",
    "Membership",
    "OneBitAdamConfig",
    "OneBitAdamState",
    "PAPER_WARMUP",
    "PerDevice",
    "PowerSGDConfig",
    "PowerSGDState",
    "QuantizedConfig",
    "QuantizedState",
    "ReplicaMismatchError",
    "SignConfig",
    "ShardedOptimizerState",
    "SkipIfNonfiniteState",
    "StreamingDiLoCoConfig",
    "StreamingDiLoCoState",
    "TopKExchange",
    "Transformation",
    "TreeSignature",
    "UnboundAxisError",
    "accumulate",
    "all_have_data",
    "allreduce",
    "axis",
    "batched_powersgd",
    "bf16_compress",
    "bf16_compress_wrapper",
    "broadcast_replicated",
    "check",
    "check_replicated",
    "chunked_topk",
    "coarse_dgc",
    "comm_hook",
    "comm_report",
    "data_parallel",
    "demo",
    "desloc",
    "dgc",
    "diloco",
    "dion",
    "dion_fan_in",
    "fp16_compress",
    "fp16_compress_wrapper",
    "fragment_layout",
    "fully_sharded",
    "call_layer",
    "gather_layer",
    "hierarchical",
    "hooks",
    "local_sgd",
    "onebit_adam",
    "per_device_mask",
    "powersgd",
    "powersgd_stats",
    "quantized",
    "scale_by_onebit_adam",
    "sharded_clip_by_global_norm",
    "sharded_optimizer",
    "sign_compress",
    "skip_if_nonfinite",
    "sparseloco",
    "state_partition_specs",
    "streaming_diloco",
    "sync_buffers",
)
