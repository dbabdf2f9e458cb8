"""Backend workarounds: where a computation is written for the compiler rather than for the reader.

Each function here computes what its one-line definition says, in a form that a backend (XLA:CPU, as
measured on this project's machines) runs much faster or in less memory than the obvious form; each
docstring gives the measurement that justifies it and the command that re-measures it. Algorithm
modules call these instead of spelling the trick out in their math.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import AxisType

# ------------------------------------------------------------------------------------------ PowerSGD

# ---------------------------------------------------------------------------------------------- DGC

# ----------------------------------------------------------------------- quantized, sign, 1-bit Adam

def keeps_leaves() -> bool:
  """Whether a compressed exchange should lay out each gradient leaf on its own
  (``exchange.leaf_layout``) rather than all of them as one flat vector: where a mesh axis in scope
  is left to the SPMD partitioner (a 2-D ``jaxcomp.data_parallel`` mesh's model axis, a plain
  ``jit`` on a mesh), which may shard the leaves over it.

  Raveling a leaf sharded along any axis but its first, and concatenating sharded leaves, gives a
  vector whose sharding the partitioner cannot express: it moves the float32 values across the mesh
  to build it. ``jaxcomp.quantized(8)`` under ``jaxcomp.data_parallel`` on a (data 4, model 2) mesh,
  parameters sharded over model (``tests/test_quantized.py``'s 2-D test): flat, 984 B crossed model
  and 276 B of float32 collective-permutes crossed both axes per step, for a 292 B gradient; leaf by
  leaf, only codes and scales cross either axis.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and any(kind != AxisType.Manual and size > 1 for kind, size in
                                zip(mesh.axis_types, mesh.axis_sizes))


def device_mean(term: Callable[[int], list], world: int) -> list:
  """The mean over devices w = 0, …, W−1 of the arrays ``term(w)``: each ÷W (no overflow), summed
  in device order, unrolled.

  Written as a running sum of W terms, XLA fuses the whole mean into one pass over the W devices'
  (compressed) inputs. The obvious forms materialize all W terms in float32 first — W times the
  gradient's size per device — and XLA:CPU reduced the broadcast product over the device axis so
  slowly that a ``sign_compress`` step took 133× allreduce's (``(W,)·(W, …)`` tensordot: 2.71×;
  benchmarks/step_time.py --models mlp --devices 8 --compressors allreduce,sign).
  """
  total = [x / world for x in term(0)]
  for w in range(1, world):
    total = [t + x / world for t, x in zip(total, term(w))]
  return total
