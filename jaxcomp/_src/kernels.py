"""Backend workarounds: where a computation is written for the compiler rather than for the reader.

Each function here computes what its one-line definition says, in a form that a backend (XLA:CPU, as
measured on this project's machines) runs much faster or in less memory than the obvious form; each
docstring gives the measurement that justifies it and the command that re-measures it. Algorithm
modules call these instead of spelling the trick out in their math.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import AxisType

from jaxcomp._src import axis

# ------------------------------------------------------------------------------------------ PowerSGD

# ---------------------------------------------------------------------------------------------- DGC

# ----------------------------------------------------------------------- quantized, sign, 1-bit Adam

def keeps_leaves() -> bool:
  """Whether a compressed exchange should handle each gradient leaf on its own (the leaf layout of
  ``exchange``, one collective per array) rather than as one flat vector of all leaves (one
  collective per dtype): where a mesh axis in scope is left to the SPMD partitioner (a 2-D
  ``jaxcomp.data_parallel`` mesh's model axis, a plain ``jit`` on a mesh), which may shard the leaves
  over it.

  Raveling a leaf sharded along any axis but its first, and concatenating sharded leaves (a flat
  vector, or the buffer that packs several arrays into one collective), gives an array whose
  sharding the partitioner cannot express: it moves the values across the mesh to build it.
  ``jaxcomp.quantized(8)`` under ``jaxcomp.data_parallel`` on a (data 4, model 2) mesh with the
  parameters sharded over model (``tests/test_quantized.py``'s 2-D test): FIGURES.
  """
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and any(kind != AxisType.Manual and size > 1 for kind, size in
                                zip(mesh.axis_types, mesh.axis_sizes))


def all_to_all(arrays: Sequence, axis_name) -> list:
  """``axis.all_to_all`` of every array (leading axis W): one collective per dtype, or one per
  array where ``keeps_leaves()``."""
  if keeps_leaves():
    return [axis.all_to_all(x, axis_name) for x in arrays]
  return axis.all_to_all_many(arrays, axis_name)


def all_gather(arrays: Sequence, axis_name) -> list:
  """``axis.all_gather`` of every array: one collective per dtype, or one per array where
  ``keeps_leaves()``."""
  if keeps_leaves():
    return [axis.all_gather(x, axis_name) for x in arrays]
  return axis.all_gather_many(arrays, axis_name)


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
