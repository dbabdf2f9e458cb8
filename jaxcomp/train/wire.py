"""What each registry entry sends per step, from the algorithm's definition, at any layer shapes.

For a parameter pytree (arrays or ``jax.ShapeDtypeStruct`` leaves: nothing is allocated or
compiled) and W devices, ``messages(name, tree, world)`` lists the collectives one steady-state step
of registry entry ``name`` sends: each ``Message`` an op, its payload in bytes as
``jaxcomp.comm_report`` counts it (the reduced buffer of an all-reduce, the gathered result of an
all-gather, the input of an all-to-all) and the share of steps it runs on (a sync every H steps:
1/H). The planner (``jaxcomp.train.planner``) and ``benchmarks/bytes.py`` share these formulas, and
the tests hold their totals, op by op, equal to the compiled step's ``comm_report``
(``tests/test_plan.py``; ``benchmarks/bytes.py`` at ResNet-18, ResNet-50 and GPT-2 small shapes).
The formulas are written from each algorithm's definition and use none of jaxcomp's code, so that
the tests check the one against the other.

Gradients are float32 (4 bytes a value). Per entry (r a rank, L the reduced values, W devices):

* dense means: 4 bytes a value (2 for fp16 / bf16); ``comm_hook`` ports: a message a DDP bucket;
* PowerSGD: each leaf viewed as (n, m) = (prod(shape[:-1]), shape[-1]), r = min(n, m, rank),
  compressed iff (n + m)·r·2 < n·m: one all-reduce of the Ps (4·n·r each) with the uncompressed
  leaves (4·n·m), one of the Qs (4·m·r); the alternating variant sends the Qs on even steps and the
  Ps on odd ones, the uncompressed leaves on both; batched: 4·side·r twice, side = ceil(sqrt(L));
  the hook port adds one 4-byte finiteness flag a step;
* DGC: per leaf of two or more dimensions, k = ceil(numel·density), the all-gather of W·k values and
  W·k int32 indices if that is less than the leaf's dense mean, else the dense mean; float16 values
  halve the values and the dense means; coarse DGC: 4 bytes per chunk norm plus the chosen chunks;
  no finiteness flag (the values and the norms carry it);
* 8-, 4- and 2-bit codes: the exchange's W rows (``_rows``: a leaf of a multiple of 256·W values
  as it is, the others packed and padded to 256·W), b-bit codes and a 4-byte scale per 256 values
  each through an all-to-all and an all-gather; 1-bit Adam: rows of a multiple of 8·W signs, and a
  4-byte scale per device; EF-SignSGD: W·ceil(L/8) bytes of signs, W·4 per leaf of scales;
* chunked top-k (SparseLoCo's exchange): per chunk of c values (leaves cut in ceil(numel/4096)
  near-equal chunks) keeping k_c = ceil(64·c/4096), a row of Elias–Fano positions and 2-bit codes
  plus 4 bytes of centroids, all-gathered (no finiteness flag: the centroids carry it);
* Dion: per matrix (a, b) (Flax's 3-D query/key/value kernels as (in, heads·head_dim), other
  kernels (prod(shape[:-1]), shape[-1]); not the embeddings) 4·r·(a + b) — P with the dense mean of
  the other leaves, R alone — where that is less than 4·a·b; DeMo: per leaf as (a, b), tiles of the
  largest divisors of a and b up to 64, W·tiles·32·(4 + 2) bytes all-gathered (values, int16
  positions);
* local SGD, DiLoCo, SparseLoCo: the sync step's messages (the parameters or the pseudo-gradient,
  through their compressor) with share 1/H; Streaming DiLoCo: one message per fragment and piece
  (fragments strided over the leaves of two or more dimensions, each cut in τ pieces of rows), each
  padded on its own through int8 or E3M0; DES-LOC: 4·L bytes all-reduced every Kx, Ku, Kv steps.

For the planner's "Fully sharded" table: ``fsdp_messages`` (``jaxcomp.fully_sharded``, per layer
a gather of the parameters' shards and a reduce-scatter of the gradient's) and ``zero_messages``
(``jaxcomp.sharded_optimizer``), held to the compiled steps by ``tests/test_fsdp_plan.py``. An
entry without a formula gets None (``benchmarks/bytes.py --compressors NAME`` measures it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import numpy as np

import jaxcomp
from jaxcomp.train import registry

F32 = 4  # bytes of a float32 gradient value
FLAG = 4  # an int32 finiteness all-reduce: comm_hook's, an FSDP int8 reduce-scatter's
_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Message:
  """One collective of a step: ``op`` ('all-reduce', 'all-gather' or 'all-to-all'), its ``payload``
  bytes as ``comm_report`` counts them, and the ``share`` of steady-state steps it runs on."""
  op: str
  payload: float
  share: float = 1.0


def leaves(tree) -> list:
  """``[(path, shape)]`` of the leaves a compressor reduces: floating point, at least one value."""
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = tuple(int(d) for d in np.shape(leaf))
    if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and math.prod(shape) > 0:
      out.append((jax.tree_util.keystr(path), shape))
  return out


def _numel(items) -> int:
  return sum(math.prod(shape) for _, shape in items)


def _matrix(shape) -> tuple:
  """PowerSGD's and DeMo's (n, m) view of a Flax leaf: (prod(shape[:-1]), shape[-1])."""
  return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def _op(op: str) -> Callable:
  """``fn(payload, share=1) -> [Message]``: one ``op`` message, or none for no bytes."""
  return lambda payload, share=1.0: [Message(op, payload, share)] if payload else []


_ar, _ag, _a2a = _op("all-reduce"), _op("all-gather"), _op("all-to-all")


def _dense(value_bytes: int) -> Callable:
  def dense(items, world, settings):
    return _ar(value_bytes * _numel(items))
  return dense


def ddp_buckets(items, cap_mb: float, value_bytes: int = F32) -> list:
  """DDP's bucket rule (``comm_hook``, torch after its rebuild): the leaves in reverse order, a
  bucket closed as soon as its bytes reach the cap. A list of buckets, each a list of
  ``(path, shape)``."""
  buckets, current, size = [], [], 0
  for item in reversed(items):
    current.append(item)
    size += value_bytes * math.prod(item[1])
    if size >= cap_mb * _MIB:
      buckets.append(current)
      current, size = [], 0
  return buckets + ([current] if current else [])


def _powersgd_parts(items, rank: int) -> tuple:
  """(bytes of the Ps, of the Qs, of the uncompressed leaves) of layer-wise PowerSGD."""
  ps = qs = rest = 0
  for _, shape in items:
    n, m = _matrix(shape)
    r = min(n, m, rank)
    if (n + m) * r * 2 < n * m:
      ps, qs = ps + F32 * n * r, qs + F32 * m * r
    else:
      rest += F32 * n * m
  return ps, qs, rest


def _powersgd(items, world, settings):
  ps, qs, rest = _powersgd_parts(items, settings.get("rank", 1))
  if settings.get("alternating", False):  # Qs on even steps, Ps on odd ones; the rest on both
    return _ar(qs + rest, 0.5) + _ar(ps + rest, 0.5)
  return _ar(ps + rest) + _ar(qs)


def _batched_powersgd(items, world, settings):
  side = math.ceil(math.sqrt(_numel(items)))
  half = F32 * side * min(side, settings.get("rank", 1))
  return _ar(half) + _ar(half)


def _dgc(items, world, settings):
  """Values and int32 indices all-gathered per sparsified leaf; the dense means all-reduced."""
  density = settings.get("ratio", 0.001)
  value = np.dtype(settings.get("value_dtype") or "float32").itemsize
  dense = values = indices = 0
  for _, shape in items:
    numel = math.prod(shape)
    k = math.ceil(numel * density)
    if len(shape) > 1 and world * k * (value + 4) < numel * value:
      values, indices = values + world * k * value, indices + world * k * 4
    else:
      dense += numel * value
  return _ar(dense) + _ag(indices) + _ag(values)


def _coarse_dgc(items, world, settings):
  """The chunks' float32 L1 norms all-reduced, then the chosen chunks with the dense means."""
  density, chunk = settings.get("ratio", 0.01), settings.get("chunk_size", 256)
  norms = rest = 0
  for _, shape in items:
    numel = math.prod(shape)
    chunks = -(-numel // chunk)
    chosen = math.ceil(chunks * density) * chunk * F32
    if len(shape) > 1 and chunks * F32 + chosen < numel * F32:
      norms, rest = norms + chunks * F32, rest + chosen
    else:
      rest += numel * F32
  return _ar(norms) + _ar(rest)


def _rows(items, world, granule) -> int:
  """The values in the two-phase exchange's W rows (``exchange.row_layout``): a leaf of a multiple
  of W·granule values as it is, the others packed into W rows of S, S a multiple of granule."""
  sizes = [math.prod(shape) for _, shape in items]
  rest = sum(n for n in sizes if n % (world * granule))
  return sum(sizes) - rest + world * granule * math.ceil(rest / (world * granule))


def _quantized(items, world, settings, block=256, share=1.0):
  """b-bit codes and a float32 scale per block: an all-to-all and an all-gather of each."""
  if not _numel(items):
    return []
  values = _rows(items, world, block)
  codes = values * {4: 4, "e2m1": 4, "e3m0": 4, 2: 2}.get(settings.get("bits", 8), 8) // 8
  scales = F32 * values // block
  return (_a2a(scales, share) + _a2a(codes, share) + _ag(scales, share) + _ag(codes, share))


def _sign(items, world, settings):
  return _ag(world * math.ceil(_numel(items) / 8)) + _ag(world * F32 * len(items))


def _onebit_adam(items, world, settings):
  signs = _rows(items, world, 8) // 8
  return _a2a(signs) + _a2a(F32 * world) + _ag(signs) + _ag(F32 * world)


def _chunked_topk_bytes(items, world, k=64, chunk=4096, bits=2) -> int:
  """The gathered chunk rows: Elias–Fano positions, ``bits``-bit codes, bfloat16 centroids."""
  total = 0
  for _, shape in items:
    numel = math.prod(shape)
    rows = -(-numel // chunk)
    width = -(-numel // rows)
    kept = min(width, -(-k * width // chunk))
    low = max(int(math.log2(width / kept)), 0)
    row_bits = kept * low + kept + ((width - 1) >> low) + kept * bits
    total += rows * (-(-row_bits // 8) + 2 * 2 ** (bits - 1))
  return world * total


def _chunked_topk(items, world, settings, share=1.0):
  sent = _chunked_topk_bytes(items, world, settings.get("k", 64), settings.get("chunk", 4096),
                             settings.get("bits", 2))
  return _ag(sent, share)


_ATTENTION = ("['query']", "['key']", "['value']")


def _dion(items, world, settings):
  """P (with the dense mean of the other leaves) and R all-reduced, per matrix 4·r·(a + b)."""
  rank = settings["rank"]
  ps = rs = rest = 0
  for path, shape in items:
    if len(shape) < 2 or path.endswith("['embedding']"):
      rest += F32 * math.prod(shape)
      continue
    cut = 1 if len(shape) == 3 and any(key in path for key in _ATTENTION) else len(shape) - 1
    a, b = math.prod(shape[:cut]), math.prod(shape[cut:])
    r = min(a, b, rank)
    if r * (a + b) < a * b:
      ps, rs = ps + F32 * r * a, rs + F32 * r * b
    else:
      rest += F32 * a * b
  return _ar(ps + rest) + _ar(rs)


def _demo(items, world, settings):
  """Per tile, k float32 values and k int16 positions from every device, all-gathered; a leaf whose
  tiles would send at least its dense mean (W·tiles·k·6 ≥ 8·a·b) is all-reduced instead."""
  chunk, k = settings.get("chunk", 64), settings.get("k", 32)

  def divisor(n):
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)

  kept = dense = 0
  for _, shape in items:
    a, b = _matrix(shape)
    h, w = divisor(a), divisor(b)
    sent = (a // h) * (b // w) * min(k, h * w)
    if world * sent * (2 + F32) >= 2 * F32 * a * b:
      dense += F32 * a * b
    else:
      kept += sent
  return _ag(world * kept * 2) + _ag(world * kept * F32) + _ar(dense)


def _periodic(inner: Callable) -> Callable:
  """A wrapper that syncs every ``sync_every`` steps through ``inner``'s messages."""
  def sync(items, world, settings):
    share = 1 / settings["sync_every"]
    return [dataclasses.replace(m, share=m.share * share) for m in inner(items, world, {})]
  return sync


def _fragments(items, fragments: int, pieces: int) -> list:
  """Streaming DiLoCo's pieces: ``[[(path, shape)], ...]`` per fragment and piece. Fragments are
  strided over the leaves of two or more dimensions (each other leaf goes with the next such leaf,
  or the last), and every leaf of a fragment is cut along its first axis in ``pieces`` blocks."""
  shapes = [shape for _, shape in items]
  units = [i for i, s in enumerate(shapes) if len(s) >= 2] or list(range(len(shapes)))
  owner = {unit: k % fragments for k, unit in enumerate(units)}
  out = []
  for fragment in range(fragments):
    held = [i for i in range(len(shapes))
            if owner[i if i in owner else next((u for u in units if u > i), units[-1])] == fragment]
    for piece in range(pieces):
      cut = []
      for i in held:
        rows = shapes[i][0] if shapes[i] else 1
        count = (piece + 1) * rows // pieces - piece * rows // pieces
        if count:
          cut.append((items[i][0], (count,) + tuple(shapes[i][1:])))
      out.append(cut)
  return out


def _streaming(bits=None) -> Callable:
  """Streaming DiLoCo's pieces: float32 means, or each through ``quantized(bits)`` on its own."""
  def streaming(items, world, settings):
    share = 1 / settings["sync_every"]
    out = []
    for piece in _fragments(items, settings.get("fragments", 1), settings.get("delay", 1)):
      if bits:  # each piece through quantized, padded on its own
        out += _quantized(piece, world, {"bits": bits}, share=share)
      else:
        out += _ar(F32 * _numel(piece), share)
    return out
  return streaming


def _desloc(items, world, settings):
  """The float32 means of the parameters, the first and the second moment, each on its period."""
  return [m for k in ("param_sync_every", "first_moment_sync_every", "second_moment_sync_every")
          for m in _ar(F32 * _numel(items), 1 / settings[k])]


def _hook_fp16(items, world, settings):
  return [m for bucket in ddp_buckets(items, settings.get("bucket_cap_mb", 25.0))
          for m in _ar(2 * _numel(bucket))]


def _hook_powersgd(items, world, settings):
  out = _ar(FLAG)  # one finiteness flag for all the buckets
  for bucket in ddp_buckets(items, settings.get("bucket_cap_mb", 25.0)):
    out += _powersgd(bucket, world, {"rank": settings.get("rank", 1)})
  return out


# The settings each formula reads, and those that do not change what is sent (rates, momenta,
# decays, the phases' timing, how DGC selects); an entry with any other setting is not computed (its
# formula would be a guess).
_NO_BYTES = {"start_iter", "freeze_steps", "warmup", "steps_per_epoch", "learning_rate",
             "scalar_learning_rate", "adam_learning_rate", "outer_learning_rate", "mu", "momentum",
             "outer_momentum", "nesterov", "momentum_masking", "b1", "b2", "eps", "epsilon",
             "bias_correction", "decay", "weight_decay", "scalar_weight_decay", "scalar_optimizer",
             "clip_norm", "clip_exponent", "selection", "sample_ratio", "upper_bound",
             "lower_bound", "max_adaptation_iters", "seed", "warm_start"}
_BY_FACTORY = {
    jaxcomp.allreduce: (_dense(F32), set()),
    jaxcomp.fp16_compress: (_dense(2), set()),
    jaxcomp.bf16_compress: (_dense(2), set()),
    jaxcomp.powersgd: (_powersgd, {"rank", "alternating"}),
    jaxcomp.batched_powersgd: (_batched_powersgd, {"rank"}),
    jaxcomp.dgc: (_dgc, {"ratio", "value_dtype"}),
    jaxcomp.coarse_dgc: (_coarse_dgc, {"ratio", "chunk_size"}),
    jaxcomp.quantized: (_quantized, {"bits"}),
    jaxcomp.sign_compress: (_sign, set()),
    jaxcomp.onebit_adam: (_onebit_adam, set()),
    jaxcomp.chunked_topk: (_chunked_topk, {"k", "chunk", "bits"}),
    jaxcomp.dion: (_dion, {"rank"}),
    jaxcomp.demo: (_demo, {"chunk", "k"}),
    jaxcomp.local_sgd: (_periodic(_dense(F32)), {"sync_every"}),
    jaxcomp.sparseloco: (lambda items, world, s: _chunked_topk(items, world, {},
                                                               1 / s["sync_every"]),
                         {"sync_every"}),
}
# Entries whose factory is a closure of the registry (a hook port, a baseline, a DiLoCo with its
# compressor): by name, each formula the one of what the closure builds.
_BY_NAME = {
    "hook_fp16_allreduce": (_hook_fp16, {"bucket_cap_mb"}),
    "hook_powersgd_r2": (_hook_powersgd, {"rank", "bucket_cap_mb"}),
    "allreduce_muon": (_dense(F32), {"adam_learning_rate", "weight_decay"}),
    "allreduce_adamw": (_dense(F32), {"b2", "weight_decay"}),
    "diloco_h20": (_periodic(_dense(F32)), {"sync_every"}),
    "diloco_h20_fp16": (_periodic(_dense(2)), {"sync_every"}),
    "diloco_h20_powersgd_r2": (
        _periodic(lambda items, world, s: _powersgd(items, world, {"rank": 2})), {"sync_every"}),
    "streaming_diloco_h20_p2": (_streaming(), {"sync_every", "fragments", "delay"}),
    "streaming_diloco_h100_p4_int8": (_streaming(8), {"sync_every", "fragments", "delay"}),
    "diloco_paper": (_periodic(_dense(F32)), {"sync_every"}),
    "diloco_maxtext": (_periodic(_dense(F32)), {"sync_every"}),
    "intellect1": (_periodic(lambda items, world, s: _quantized(items, world, {})), {"sync_every"}),
    "streaming_diloco_fp4": (_streaming("e3m0"), {"sync_every", "fragments", "delay"}),
    "sparseloco_covenant": (_BY_FACTORY[jaxcomp.sparseloco][0], {"sync_every"}),
    "muloco": (_periodic(lambda i, w, _: _quantized(i, w, {"bits": 2})), {"sync_every"}),
    "desloc": (_desloc, {"param_sync_every", "first_moment_sync_every",
                         "second_moment_sync_every"}),
}


def formula(name: str) -> Optional[Callable]:
  """``fn(items, world, settings) -> [Message]`` for registry entry ``name``, or None where this
  module has none for it (a new entry, or settings it does not read)."""
  entry = registry.REGISTRY[name]
  found = _BY_NAME.get(name) or _BY_FACTORY.get(entry.factory)
  if found is None or set(entry.settings) - found[1] - _NO_BYTES:
    return None
  return found[0]


def messages(name: str, tree, world: int, settings: Optional[dict] = None) -> Optional[list]:
  """The ``Message``s of one steady-state step of registry entry ``name`` on ``world`` devices for a
  gradient shaped like ``tree``; ``settings`` replace the entry's (a warm-up phase's). None where
  the bytes cannot be computed without compiling (``formula``)."""
  fn = formula(name)
  if fn is None:
    return None
  merged = {**registry.REGISTRY[name].settings, **(settings or {})}
  return fn(leaves(tree), world, merged)  # None where the settings are not the formula's


def payload_bytes(sent) -> float:
  """Payload bytes per step on average (``CommReport.payload_bytes``): each message by its share."""
  return sum(m.payload * m.share for m in sent)


def ring_bytes(sent, world: int) -> float:
  """What each device sends per step under the ring algorithm (``CommReport.ring_bytes``):
  2(W−1)/W of an all-reduce's payload, (W−1)/W of the others'."""
  if world <= 1:
    return 0.0
  return sum((2 if m.op == "all-reduce" else 1) * (world - 1) / world * m.payload * m.share
             for m in sent)


def bytes_by_op(sent) -> dict:
  """``{op: payload bytes per step}``."""
  out: dict = {}
  for m in sent:
    out[m.op] = out.get(m.op, 0.0) + m.payload * m.share
  return out


def operands(sent, world: int) -> list:
  """``[(op, bytes, share)]`` as the α-β model takes them (``network.operands``): an all-gather's
  per-worker contribution, a reduce-scatter as the all-gather it mirrors (its input's 1/W from
  each worker), the others' payload."""
  return [("all-gather" if m.op == "reduce-scatter" else m.op,
           m.payload / (world if m.op in ("all-gather", "reduce-scatter") else 1), m.share)
          for m in sent]


# -------------------------------------------------------------------------- fully sharded (FSDP)

FSDP_GATHERS = {None: F32, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1}
"""``jaxcomp.fully_sharded``'s gather dtypes: bytes a value (8-bit: codes, plus the scales)."""
FSDP_SCATTERS = {"allreduce": F32, "bf16_compress": 2, "quantized_int8": 1}
"""Its exchanges that reduce-scatter natively, by name: bytes a value on the wire."""
_BLOCK = 256  # values per float32 scale of the 8-bit codes (``jaxcomp.quantized``'s block)


def fsdp_layers(tree) -> list:
  """The layers ``jaxcomp.fully_sharded`` gathers at ``layer_depth=1``: each entry of the
  top-level container (the whole tree if it is a leaf), as ``[(path, shape)]`` of its
  floating-point leaves, in the parameters' leaf order."""
  top = jax.tree.flatten(tree, is_leaf=lambda node: node is not tree)[0]
  if top == [tree]:
    return [leaves(tree)]
  return [found for node in top if (found := leaves(node))]


def fsdp_messages(tree, world: int, gather_dtype: Optional[str] = None,
                  exchange: str = "allreduce") -> list:
  """The ``Message``\\ s of one step of ``jaxcomp.fully_sharded`` (``layer_depth=1``, no
  ``jax.checkpoint``: each layer gathered once) on ``world`` devices, per layer: a leaf of n
  values is sharded, S = ⌈n/W⌉ values per device (flat layout, zero-padded to W·S), unless it is
  0-d or n < W (replicated: its gradient's exact float32 mean, an all-reduce of 4·n bytes). With R
  the sum of a layer's S:

  * gather (``gather_dtype``): an all-gather of W·R values, 4 bytes each (None), 2 (bfloat16), or 1
    (int8 / float8_e4m3fn codes) plus an all-gather of W·⌈R/256⌉ float32 scales;
  * scatter (``exchange``): a reduce-scatter of W·R values, 4 bytes each (allreduce) or 2
    (bf16_compress); quantized_int8: an all-to-all of W·R int8 codes and one of W·⌈R/256⌉ float32
    scales, and a 4-byte finiteness all-reduce.

  Args:
    tree: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    world: W.
    gather_dtype: a key of ``FSDP_GATHERS``.
    exchange: a key of ``FSDP_SCATTERS``.

  Returns:
    A list of ``Message``\\ s, ops 'all-gather', 'reduce-scatter' (its payload the input, as
    ``comm_report`` counts it), 'all-to-all' and 'all-reduce'.
  """
  if gather_dtype not in FSDP_GATHERS or exchange not in FSDP_SCATTERS:
    raise ValueError(f"fully sharded: gather_dtype must be one of {list(FSDP_GATHERS)} and "
                     f"exchange one of {list(FSDP_SCATTERS)}; got {gather_dtype!r}, {exchange!r}")
  out = []
  for layer in fsdp_layers(tree):
    rows = sum(-(-math.prod(s) // world) for _, s in layer if s and math.prod(s) >= world)
    whole = sum(math.prod(s) for _, s in layer if not s or math.prod(s) < world)
    scales = F32 * world * -(-rows // _BLOCK)
    out += _ag(FSDP_GATHERS[gather_dtype] * world * rows)
    if gather_dtype in ("int8", "float8_e4m3fn") and rows:
      out += _ag(scales)
    if exchange == "quantized_int8":
      out += _a2a(world * rows) + (_a2a(scales) + _ar(FLAG) if rows else [])
    elif rows:
      out.append(Message("reduce-scatter", FSDP_SCATTERS[exchange] * world * rows))
    out += _ar(F32 * whole)
  return out


def zero_messages(tree, world: int) -> list:
  """The ``Message``\\ s of one step of ``jaxcomp.sharded_optimizer(jaxcomp.allreduce(), ...)``
  (ZeRO-1/2, exact gather) on ``world`` devices: every leaf sharded, S = ⌈n/W⌉ values per device
  (a 0-d leaf one), a float32 reduce-scatter of the gradient and a float32 all-gather of the
  update, W·ΣS values each."""
  sent = F32 * world * sum(-(-max(math.prod(s), 1) // world) for _, s in leaves(tree))
  return [Message("reduce-scatter", sent), Message("all-gather", sent)]
