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
  ``jaxcomp.data_parallel`` mesh's model axis, a plain ``jit`` on a mesh), which may shard the
  leaves over it.

  Raveling a leaf sharded along any axis but its first, and concatenating sharded leaves (a flat
  vector, or the buffer that packs several arrays into one collective), gives an array whose
  sharding the partitioner cannot express: it moves the values across the mesh to build it.
  ``jaxcomp.quantized(8)`` under ``jaxcomp.data_parallel`` on a (data 4, model 2) Auto mesh, a
  6,404-byte gradient sharded over model (``tests/test_low_bit_training.py``'s mesh test), bytes
  per step: flat, 16,968 of float32 across model and 4,724 across both axes; leaf by leaf, 72 of
  scales and 2,000 of int8 codes across model, nothing across both (with the leaves packed into one
  collective per dtype, 5,047 of codes across model and 1,024 across both). sign_compress: 16,708
  and 8,192 bytes of float32, then none (48 of scales); 1-bit Adam: 16,960 and 2,228, then none.
  XLA replicates the operand of an all-to-all or all-gather over a manual axis across the others
  (an all-reduce's it keeps sharded), so the codes still cross model once. Re-measure with
  ``jaxcomp.comm_report(dp.step, ...).by_axes(mesh)`` as that test does.
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
  slowly that a ``sign_compress`` step took 133× allreduce's; as a ``(W,)·(W, …)`` tensordot it
  took 3.4× (and 9.05× the gradient in temporaries), as this running sum 1.15× (2.21×; the signs
  packed leaf by leaf). The owner's mean of ``jaxcomp.quantized(8)``, each row decoded as it is
  summed rather than all W first: 3.35× → 3.07× allreduce's step (10 rounds), the same
  temporaries. benchmarks/step_time.py --models mlp --devices 8 --repeats 15 --compressors
  allreduce,sign,quantized_int8; benchmarks/memory.py --quick.
  """
  total = [x / world for x in term(0)]
  for w in range(1, world):
    total = [t + x / world for t, x in zip(total, term(w))]
  return total
