"""Wire bytes per step per compressor, from the compiled step, against the algorithm's minimum.

For ResNet-18, ResNet-50 and GPT-2 small shaped gradients (shapes only: nothing is allocated), each
compressor's ``update`` is compiled under ``jax.pmap`` over W = 8 simulated devices and
``jaxcomp.comm_report`` reads the bytes of every collective from the compiled HLO. The update
alone, not a training step (``jaxcomp.data_parallel`` builds one from a loss, which shape-only
models do not have): what a step sends besides its compressor is the step builder's doing, and
``tests/test_train.py`` checks that the main job's ``data_parallel`` step sends nothing else. The
minimum is computed here from the algorithm's definition, independently of jaxcomp:

* dense means: 4 bytes per element (2 for fp16 / bf16);
* PowerSGD: 4·r·(n + m) per compressed leaf (P and Q) and 4·n·m for the rest, with each leaf viewed as
  (prod(shape[:-1]), shape[-1]), r = min(n, m, rank), compressed iff (n + m)·r·2 < n·m;
* batched PowerSGD: 4·2·side·r, side = ceil(sqrt(total elements));
* alternating PowerSGD (epfml's variant): the uncompressed leaves and 4·r·m per compressed leaf on even
  steps, 4·r·n on odd ones; a step's bytes are the mean of the two (the compiled step holds both
  halves, one per branch of a conditional, and runs one of them);
* DGC: W·k·(4 value + 4 index bytes) per leaf with ndim > 1, k = ceil(numel·density), and 4·numel for
  the rest; coarse DGC: 4 bytes per chunk norm plus the chosen chunks, 4·numel for the rest;
* quantized (int8 / float8): the flat gradient of L elements padded to W shards of S, S = block·
  ceil(L / (W·block)); 1-byte codes through an all-to-all (payload W·S) and an all-gather (W·S),
  and one 4-byte scale per block through each: 2·W·S + 2·4·W·S/block;
* sign (EF-SignSGD): W·ceil(L/8) bytes of packed signs and W·4 per leaf of scales, all-gathered;
* 1-bit Adam (compressed stage): W shards of S = 8·ceil(L / (8·W)) signs, W·S/8 bytes through an
  all-to-all and an all-gather each, and one 4-byte scale per device through each: 2·W·S/8 + 2·4·W;
* chunked top-k (SparseLoCo's compressor, 64 of every 4,096 at 2 bits): per chunk of c elements
  (leaves cut into ceil(numel/4096) near-equal chunks) keeping k_c = ceil(64·c/4096), a row of
  ceil((k_c·l + k_c + ((c − 1) >> l) + 2·k_c) / 8) bytes (Elias–Fano positions, l = floor(log2(c /
  k_c)), and 2-bit codes) plus 4 bytes of bfloat16 centroids, all-gathered (W rows);
* Dion (``dion_r8``, ``dion_r4``): 4·r·(a + b) per matrix (a, b) whose factors are smaller than it,
  4 bytes per value of the rest (``_dion_min``); DeMo: W·k·(4 + 2) per tile (``_demo_min``); their
  baselines (``allreduce_muon``, ``allreduce_adamw``) the f32 mean, 4 bytes per value. None of the
  four sends a finiteness flag;
* stateful compressors add the 4-byte int32 all-reduce that checks that the gradient is finite on
  every device (their state must not absorb a NaN step);
* local SGD and DiLoCo (``registry.PERIODIC``) send once every H steps: the parameters (local SGD) or
  the pseudo-gradient (DiLoCo) in f32, or through their compressor by its formula above, divided by
  H — amortised bytes per step. Their compiled step holds the sync in a conditional branch, which
  ``Compressor.bytes_per_step`` divides by H. Streaming DiLoCo sends the same bytes over a period,
  a fragment at a time; through int8 ``quantized`` each piece (a fragment's leaves cut in τ blocks of
  rows) is padded on its own; SparseLoCo sends chunked top-k's bytes every 30 steps.

Payload bytes are those of ``comm_report``: the reduced buffer for all-reduce, the gathered result (W
contributions) for all-gather, the input for all-to-all. Under the ring algorithm an all-reduce sends
2·(W−1)/W of its payload per device and the others (W−1)/W, so the last column, what each device
sends against a float32 all-reduce, is the fair comparison between them. bf16 is read before
optimisation (``stage="lowered"``): XLA:CPU widens bf16 collectives to f32 when it compiles (GPUs keep
them narrow); the compiled figure is shown too. A float16 all-reduce (or reduce-scatter) runs on
XLA:CPU as an all-to-all (and an all-gather) that ``comm_report`` counts as the collective it
replaces, its bytes that collective's; "compiled collectives" names both.

  PYTHONPATH=. python benchmarks/bytes.py [--quick] [--write]
"""

from __future__ import annotations

import collections
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from benchmarks import common  # noqa: E402
from jaxcomp.train.registry import DEFAULT, PERIODIC  # noqa: E402

W = 8
FLAG = 4  # the int32 finiteness all-reduce of stateful compressors


def _sizes(tree):
  return [tuple(x.shape) for x in jax.tree.leaves(tree)]


def _powersgd_min(tree, rank):
  total = 0
  for shape in _sizes(tree):
    n, m = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    r = min(n, m, rank)
    total += 4 * r * (n + m) if (n + m) * r * 2 < n * m else 4 * n * m
  return total + FLAG


def _alternating_min(tree, rank):
  """The mean of an even (Qs) and an odd (Ps) step."""
  total = 0.0
  for shape in _sizes(tree):
    n, m = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    r = min(n, m, rank)
    total += 4 * r * (n + m) / 2 if (n + m) * r * 2 < n * m else 4 * n * m
  return total + FLAG


def _batched_min(tree, rank):
  side = math.ceil(math.sqrt(sum(math.prod(s) for s in _sizes(tree))))
  return 4 * 2 * side * min(side, rank) + FLAG


def _dgc_min(tree, density):
  total = 0
  for shape in _sizes(tree):
    numel = math.prod(shape)
    sparse = W * math.ceil(numel * density) * (4 + 4)
    total += sparse if len(shape) > 1 and sparse < 4 * numel else 4 * numel
  return total + FLAG


def _coarse_min(tree, density, chunk=256):
  total = 0
  for shape in _sizes(tree):
    numel = math.prod(shape)
    chunks = -(-numel // chunk)
    sparse = 4 * chunks + 4 * math.ceil(chunks * density) * chunk
    total += sparse if len(shape) > 1 and sparse < 4 * numel else 4 * numel
  return total + FLAG


def _quantized_min(tree, block=256):
  shard = block * math.ceil(common.num_params(tree) / (W * block))
  return 2 * W * shard + 2 * 4 * W * shard // block + FLAG


def _sign_min(tree):
  return W * math.ceil(common.num_params(tree) / 8) + W * 4 * len(_sizes(tree)) + FLAG


def _onebit_min(tree):
  shard = 8 * math.ceil(common.num_params(tree) / (8 * W))
  return 2 * W * shard // 8 + 2 * 4 * W + FLAG


def _chunked_topk_min(tree, k=64, chunk=4096, bits=2):
  """SparseLoCo's chunk rows (Elias–Fano positions, codes, bfloat16 centroids), all-gathered."""
  total = 0
  for shape in _sizes(tree):
    numel = math.prod(shape)
    rows = -(-numel // chunk)
    width = -(-numel // rows)
    kept = min(width, -(-k * width // chunk))
    low = max(int(math.log2(width / kept)), 0)
    row_bits = kept * low + kept + ((width - 1) >> low) + kept * bits
    total += rows * (-(-row_bits // 8) + 2 * 2 ** (bits - 1))
  return W * total + FLAG


def _dion_min(tree, rank):
  """Dion: per matrix (a, b), fan-in × fan-out, r = min(a, b, rank), 4·r·(a + b) for P and R if
  that is less than 4·a·b, else its mean gradient; 4 bytes per value of the other leaves (vectors,
  Flax's embeddings); no finiteness flag (it is read from the factors). A matrix is a leaf of two or
  more dimensions viewed as (prod(shape[:-1]), shape[-1]), Flax attention's 3-D query, key and value
  kernels as (in, heads·head_dim)."""
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name, shape = jax.tree_util.keystr(path), tuple(leaf.shape)
    if len(shape) < 2 or name.endswith("['embedding']"):
      total += 4 * math.prod(shape)
      continue
    cut = 1 if len(shape) == 3 and any(k in name for k in ("['query']", "['key']", "['value']")) \
        else len(shape) - 1
    a, b = math.prod(shape[:cut]), math.prod(shape[cut:])
    r = min(a, b, rank)
    total += 4 * r * (a + b) if r * (a + b) < a * b else 4 * a * b
  return total


def _demo_min(tree, chunk=64, k=32):
  """DeMo: per leaf as (a, b) = (prod(shape[:-1]), shape[-1]) (a vector (1, n)), tiles of h × w, h
  and w the largest divisors of a and b that are at most 64; from every device, min(32, h·w)
  float32 values and int16 positions per tile, all-gathered: W·tiles·k·(4 + 2)."""
  def divisor(n):
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)
  total = 0
  for shape in _sizes(tree):
    a, b = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    h, w = divisor(a), divisor(b)
    total += (a // h) * (b // w) * min(k, h * w) * (4 + 2)
  return W * total


def _streaming_quantized_min(tree, fragments, pieces):
  """Streaming DiLoCo's pieces through ``quantized`` int8, each padded on its own: fragments strided
  over the leaves of two or more dimensions (each other leaf with the next such leaf), every leaf
  of a fragment cut along its first axis into ``pieces`` near-equal blocks of rows."""
  shapes = _sizes(tree)
  units = [i for i, s in enumerate(shapes) if len(s) >= 2] or list(range(len(shapes)))
  owner = {unit: k % fragments for k, unit in enumerate(units)}
  total = 0
  for fragment in range(fragments):
    held = [i for i in range(len(shapes))
            if owner[i if i in owner else next((u for u in units if u > i), units[-1])] == fragment]
    for piece in range(pieces):
      numel = 0
      for i in held:
        rows = shapes[i][0] if shapes[i] else 1
        numel += ((piece + 1) * rows // pieces - piece * rows // pieces) * math.prod(shapes[i][1:])
      if numel:
        total += _quantized_min({"piece": jax.ShapeDtypeStruct((numel,), "float32")})
  return total


def minimum(name: str, tree) -> float:
  """The algorithm's bytes per step per device (payload), computed from its definition."""
  numel = common.num_params(tree)
  return {
      "local_sgd_h8": lambda: 4 * numel / 8,
      "diloco_h20": lambda: 4 * numel / 20,
      "diloco_h20_fp16": lambda: 2 * numel / 20,
      "diloco_h20_powersgd_r2": lambda: _powersgd_min(tree, 2) / 20,
      "allreduce": lambda: 4 * numel,
      "fp16": lambda: 2 * numel,
      "bf16": lambda: 2 * numel,
      "powersgd_r1": lambda: _powersgd_min(tree, 1),
      "powersgd_r2": lambda: _powersgd_min(tree, 2),
      "powersgd_r4": lambda: _powersgd_min(tree, 4),
      "batched_powersgd_r1": lambda: _batched_min(tree, 1),
      "powersgd_r1_alternating": lambda: _alternating_min(tree, 1),
      "dgc": lambda: _dgc_min(tree, 0.001),
      "coarse_dgc": lambda: _coarse_min(tree, 0.01),
      "quantized_int8": lambda: _quantized_min(tree),
      "quantized_fp8": lambda: _quantized_min(tree),
      "sign": lambda: _sign_min(tree),
      "onebit_adam": lambda: _onebit_min(tree),
      "chunked_topk": lambda: _chunked_topk_min(tree),
      "sparseloco_h30": lambda: _chunked_topk_min(tree) / 30,
      "streaming_diloco_h20_p2": lambda: 4 * numel / 20,
      "streaming_diloco_h100_p4_int8": lambda: _streaming_quantized_min(tree, 4, 2) / 100,
      "allreduce_muon": lambda: 4 * numel,
      "dion_r8": lambda: _dion_min(tree, 8),
      "dion_r4": lambda: _dion_min(tree, 4),
      "allreduce_adamw": lambda: 4 * numel,
      "demo": lambda: _demo_min(tree),
  }[name]()


def measure(compressor, tree):
  """``(compiled CommReport, lowered CommReport)`` of one update step on W devices."""
  inner = {"inner": optax.sgd(0.1)} if compressor.wraps_optimizer else {}
  tx = compressor.make(common.AXIS, **inner)
  state = common.stacked(jax.eval_shape(tx.init, tree), W)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=common.AXIS,
                  devices=jax.devices()[:W])
  grads = common.stacked(tree, W)
  from jaxcomp import comm_report
  return (comm_report(step, grads, state, grads, num_devices=W),
          comm_report(step, grads, state, grads, stage="lowered", num_devices=W))


def _compiled_op(collective) -> str:
  """The collective's op, and what runs in its place where that differs (float16 on XLA:CPU)."""
  if not collective.runs_as:
    return collective.op
  return f"{collective.op} (run as {' + '.join(collective.runs_as)})"


def _amount(num_bytes: float) -> str:
  """Bytes with thousands separators, one decimal where an amortised figure has a fraction."""
  return f"{num_bytes:,.0f}" if num_bytes == int(num_bytes) else f"{num_bytes:,.1f}"


def main(argv=None) -> int:
  args = common.parse(common.parser(__doc__.split("\n\n")[0]), argv)
  rows = []
  for model, tree in common.models(args.quick).items():
    numel = common.num_params(tree)
    for c in common.compressors(args.compressors or ",".join(DEFAULT + PERIODIC)):
      start = time.perf_counter()
      compiled, lowered = measure(c, tree)
      report = lowered if c.name == "bf16" else compiled
      compiled_bytes = c.bytes_per_step(compiled, "payload_bytes")
      sent = c.bytes_per_step(report, "payload_bytes")
      lo = minimum(c.name, tree)
      ops = ", ".join(f"{n}× {op}" for op, n in sorted(
          collections.Counter(_compiled_op(x) for x in compiled.collectives).items()))
      if c.wraps_optimizer:
        ops += f", once every {c.settings['sync_every']} steps"
      rows.append([model, f"{numel:,}", c.name, _amount(compiled_bytes), _amount(sent),
                   _amount(lo), f"{sent / lo:.2f}", f"{4 * numel / sent:.1f}×", ops,
                   f"{2 * (W - 1) / W * 4 * numel / c.bytes_per_step(report):.1f}×"])
      print(f"  {model} {c.name}: {_amount(sent)} B vs minimum {_amount(lo)} B "
            f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
  table = common.markdown_table(
      ["model", "params", "compressor", "compiled B", "sent B", "minimum B", "ratio",
       "vs f32", "compiled collectives", "ring vs f32"], rows, "lrlrrrrrlr")
  body = (f"W = {W} simulated devices (`jax.pmap`); bytes per device per step (payload: reduced "
          "buffer of an all-reduce, gathered result of an all-gather). \"sent\" is the compiled HLO's, "
          "except bf16: XLA:CPU widens bf16 collectives to f32 when compiling (\"compiled B\"), so its "
          "wire is read before optimisation. The minimum counts the 4-byte finiteness flag of the "
          "stateful compressors (see the script's docstring for each formula). An all-reduce "
          "moves its buffer twice under the ring algorithm, an all-gather or all-to-all once: "
          "\"ring vs f32\" compares what each device sends (`CommReport.ring_bytes`) with a "
          "float32 ring all-reduce's. Local SGD and DiLoCo send once every H steps: their bytes are "
          "amortised (sync bytes / H).\n\n" + table)
  common.emit(args, "bytes", "Wire bytes per step against the algorithm's minimum", "bytes.py",
              body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
