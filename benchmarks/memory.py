"""Memory per compressor: state bytes and peak temporaries, as multiples of the gradient size.

For ResNet-18, ResNet-50 and GPT-2 small shaped gradients (shapes only), each compressor's ``update``
is compiled under ``jax.pmap`` over W = 8 simulated devices with the gradient and the state donated,
as in a training step, where the gradient is dead once the update has it and the new state may reuse
the old one's buffers (the update alone, not a ``jaxcomp.data_parallel`` step: a model's forward
and backward passes would add their temporaries to every compressor's and hide them). (Donating
the state alone misleads: JAX pairs donated inputs with outputs of the same shape in output order,
so the update — the first output — would take the error's or the momentum's buffer, and XLA would
copy the state before overwriting it.) Per device:

* state: the bytes of the compressor's state (``jax.eval_shape`` of ``init``);
* temporaries: ``temp_size_in_bytes`` of the compiled program's memory analysis — the peak of the
  buffers XLA allocates besides arguments and outputs;
* extra: state + temporaries − allreduce's temporaries, the memory a compressor costs over the plain
  mean (its gradient input and averaged output are the same as allreduce's).

All three are divided by the gradient's size (4 bytes per element). The state of each compressor here
is the state its algorithm must keep (PowerSGD's error, DGC's u and v), so issue 15's target, state
beyond that plus temporaries ≤ 1× the gradient, reads as temp / grad ≤ 1.

  PYTHONPATH=. python benchmarks/memory.py [--quick] [--write]
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

W = 8
jax.config.update("jax_num_cpu_devices", W)

from benchmarks import common  # noqa: E402


def nbytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(compressor, tree) -> tuple:
  """``(state bytes, temporary bytes)`` per device of one update on W devices, gradient and state
  donated."""
  tx = compressor.make(common.AXIS)
  state = jax.eval_shape(tx.init, tree)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=common.AXIS, devices=jax.devices()[:W],
                  donate_argnums=(0, 1))
  compiled = step.lower(common.stacked(tree, W), common.stacked(state, W)).compile()
  return nbytes(state), compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
  args = common.parse(common.parser(__doc__.split("\n\n")[0]), argv)
  compressor_list = common.compressors(args.compressors)
  if compressor_list[0].name != "allreduce":
    compressor_list = common.compressors("allreduce") + compressor_list
  rows = []
  for model, tree in common.models(args.quick).items():
    grad = nbytes(tree)
    base = None
    for c in compressor_list:
      state, temp = measure(c, tree)
      base = temp if base is None else base
      rows.append([model, c.name, common.human(state), common.human(temp),
                   f"{state / grad:.2f}", f"{temp / grad:.2f}",
                   f"{(state + temp - base) / grad:.2f}"])
      print(f"  {model} {c.name}: extra {rows[-1][-1]}× the gradient", file=sys.stderr, flush=True)
  table = common.markdown_table(
      ["model", "compressor", "state", "temporaries", "state / grad", "temp / grad",
       "extra / grad"], rows, "llrrrrr")
  body = (f"Per device, W = {W} (`jax.pmap`, gradient and state donated); grad = 4 bytes per "
          "element. extra = state + temporaries − allreduce's temporaries. Target (issue 15): state "
          "beyond the algorithm's plus temporaries ≤ 1, i.e. temp / grad ≤ 1.\n\n" + table)
  common.emit(args, "memory", "Memory: state and peak temporaries", "memory.py", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
