"""Every named compressor of the registry (``jaxcomp.train.registry``), at the scale of the tests.

The cross-cutting tests (properties, faults, resume, bad input) run every registry entry on pytrees
of a few hundred elements. ``make(name)`` builds the entry with the recipe of a 30-step run —
PowerSGD compresses from step 3, so short runs cover both of its phases — and with the settings
below, which make tiny leaves behave as big ones do: PowerSGD rank 4 compresses them, DGC
sparsifies them from the first step (no warm-up: its dense stages are tested in
test_dgc_math.py), hooks split them into several buckets, and 1-bit Adam compresses from step 2
(so that 4 steps cover both of its stages) with a learning rate for the tests' small regression.
Local SGD averages every 2 steps after one step of gradient averaging (after steps 0, 1, 3, 5, …)
and DiLoCo every 4 (after steps 3, 7, …): 4 steps hold local steps and synchronizations of both,
both synchronize after step 99 of every hundred (where the reliability test compares replicas),
and neither after step 12 (where the resume test stops: mid-period).

Local SGD and DiLoCo wrap the optimizer (``WRAPPERS``): ``COMPRESSORS[name]`` builds them around
SGD (``INNER_LEARNING_RATE``); their update needs ``params`` and returns ``jaxcomp.Assign``
updates, and their replicas are identical right after a synchronization (``synced``), not in
between.
"""

import functools

import optax

from jaxcomp.train.registry import REGISTRY

SMALL = {
    "powersgd_r4": {"min_compression_rate": 1.0},
    "dgc": {"ratio": 0.05, "warmup": None},
    "dgc_exact_fp16": {"ratio": 0.05, "warmup": None},
    "coarse_dgc": {"ratio": 0.25, "chunk_size": 8, "warmup": None},
    "hook_fp16_allreduce": {"bucket_cap_mb": 0.01},
    "hook_powersgd_r2": {"bucket_cap_mb": 0.001},
    "onebit_adam": {"learning_rate": 0.01, "freeze_steps": 2},
    "dion_r8": {"rank": 2},  # compresses the tests' (6, 16) and (16, 3) matrices, as big ones
    "dion_r4": {"rank": 2},
    # one of every tile of the matrices' (3 × 4, 4 × 3); the vectors' tiles would send more than
    # their means: those are all-reduced
    "demo": {"chunk": 4, "k": 1},
    "local_sgd_h8": {"sync_every": 2, "start_iter": 1},
    "diloco_h20": {"sync_every": 4},
    "diloco_h20_fp16": {"sync_every": 4},
    "diloco_h20_powersgd_r2": {"sync_every": 4},
    "chunked_topk": {"k": 4, "chunk": 64},
    "sparseloco_h30": {"sync_every": 4, "k": 4, "chunk": 64},
    "streaming_diloco_h20_p2": {"sync_every": 6, "fragments": 2, "delay": 1, "mix": 1.0},
    "streaming_diloco_h100_p4_int8": {"sync_every": 6, "fragments": 2, "delay": 1, "mix": 1.0},
    # The papers' presets, their periods shortened as DiLoCo's above
    "diloco_paper": {"sync_every": 4},
    "diloco_maxtext": {"sync_every": 4},
    "intellect1": {"sync_every": 4},
    "muloco": {"sync_every": 4},
    "sparseloco_covenant": {"sync_every": 4, "k": 4, "chunk": 64},
    "streaming_diloco_fp4": {"sync_every": 6, "fragments": 2, "delay": 1, "mix": 1.0},
    "desloc": {"param_sync_every": 4, "first_moment_sync_every": 4, "second_moment_sync_every": 8},
}

# DES-LOC averages Adam's moments: the tests run it around Adam where the other wrappers run SGD,
# with an ε above the tests' gradients, so that its step follows the gradient (about 0.01·g) as
# theirs does: Adam's first step is the gradient's sign alone, the same on devices whose gradients
# share it, and a float16 parameter of 100 does not move by a step of 0.01.
ADAM_INSIDE = tuple(name for name, entry in REGISTRY.items() if entry.adam_inside)

# The wrappers of the whole optimizer (local SGD, DiLoCo); every other entry is a gradient
# compressor.
WRAPPERS = tuple(name for name, entry in REGISTRY.items() if entry.wraps_optimizer)

INNER_LEARNING_RATE = 0.1


def optimizer(name, inner, **overrides):
  """The whole optimizer around ``inner`` at the scale of the tests: the compressor chained before
  it, or the wrapper around it (around Adam for ``ADAM_INSIDE``)."""
  if name in ADAM_INSIDE:
    inner = optax.adam(1.0, eps=100.0)
  return REGISTRY[name].optimizer(inner, steps=30, **{**SMALL.get(name, {}), **overrides})


# The baselines of the whole optimizers (optax's Muon and AdamW after jaxcomp.allreduce) are
# optax's, not jaxcomp's: the properties tested here are not theirs to keep.
COMPRESSORS = {name: functools.partial(entry.make, steps=30, **SMALL.get(name, {}))
               for name, entry in REGISTRY.items()
               if not entry.wraps_optimizer and not entry.baseline}
COMPRESSORS.update({name: functools.partial(optimizer, name, optax.sgd(INNER_LEARNING_RATE))
                    for name in WRAPPERS})

# The papers' presets that are another entry's algorithm with other hyperparameters (a period, a
# learning rate, a codec that another entry's exchange or tests/test_quantized_low_bit.py runs): at
# the tests' scale each is that entry again. The registry-wide loop test (test_registry.py) runs
# every entry, these included; the other cross-cutting tests run ALGORITHMS, every entry but these.
PRESETS = ("diloco_maxtext", "diloco_paper", "intellect1", "sparseloco_covenant",
           "streaming_diloco_fp4")
ALGORITHMS = tuple(sorted(set(COMPRESSORS) - set(PRESETS)))


def synced(name, state, step) -> bool:
  """Whether every device holds the same parameters (a wrapper) or output (a compressor) after the
  update of step ``step`` (0-based) that started from ``state``."""
  return name not in WRAPPERS or bool(getattr(state, "syncs_after", state.config.syncs_after)(step))


def synced_leaves(name, state, step, num_leaves) -> list:
  """For each of the ``num_leaves`` parameter leaves, whether every device holds the same value
  after step ``step``: Streaming DiLoCo's fragments land at different steps, each identical
  everywhere right after its own landing (with ``mix=1``); everything else is ``synced`` as a
  whole."""
  layout = getattr(state, "layout", None)
  if name not in WRAPPERS or layout is None:
    return [synced(name, state, step)] * num_leaves
  landed = [bool(state.config.applies_after(p, step)) and state.config.mix == 1
            for p in range(len(layout))]
  flags = [False] * len(state.signature.shapes)
  for p, leaves in enumerate(layout):
    for i in leaves:
      flags[i] = landed[p]
  return flags


# The dtype each compressor puts on the wire for float32 gradients (None: the gradient's own).
WIRE_DTYPE = {name: entry.wire_dtype for name, entry in REGISTRY.items() if entry.wire_dtype}

# Compressors whose output is the plain mean (up to the wire dtype's rounding).
MEAN_COMPRESSORS = tuple(name for name, entry in REGISTRY.items() if entry.is_mean)

# Whole optimizers (their output is the update): nothing is chained after them.
OPTIMIZERS = tuple(name for name, entry in REGISTRY.items() if entry.is_optimizer)

# Compressors with torch-style error feedback: output + new error = gradient + old error, per
# device.
ERROR_FEEDBACK = tuple(name for name, entry in REGISTRY.items() if entry.error_feedback)
