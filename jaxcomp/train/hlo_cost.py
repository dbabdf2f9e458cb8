"""What a compiled program does per device, kernel by kernel: FLOPs and bytes, read from its HLO.

``kernels(compiled.as_text())`` lists the kernels one run of an XLA-compiled program launches (each
instruction of the entry computation and of the computations it calls through control flow, a
fusion as one kernel), with:

* **FLOPs**: a dot 2·(output elements)·(contracted elements); a convolution 2·(output
  elements)·(kernel elements ÷ output features); every other instruction one per output element
  (a reduction one per input element); a fusion the sum over the instructions it fuses (in a loop
  fusion, at most one per output element each: it computes what its output needs);
* **bytes**: what the kernel reads and writes (``bytes_moved``): its operands and its output, with
  two refinements for what XLA does in place or computes in part — a loop fusion computes each
  output element once, so it reads at most as many elements of an operand as it writes (a fusion
  that computes one row of a larger expression reads that row); a dynamic-update-slice or a
  scatter writes only its update into its operand's buffer. ``benchmarks/step_profile.py`` counts
  the bytes of its traced steps with the same function;
* **dtype**: the operands' dtype of a dot or convolution (what sets its peak FLOP/s), else None;
* **weight**: how many times it runs per step of the steady state. A loop's body runs its known
  trip count (XLA's ``known_trip_count``; once where XLA does not know it, and ``unknown_trips``
  says so); jaxcomp's loop that runs a branch once or never (``phases.when``) runs it once when
  the branch is a labelled phase (its share decides), never when it is not (jaxcomp's only such
  branch restores the state after a non-finite step); a branch labelled as a phase by jaxcomp
  (``jaxcomp_phase[name|share]`` in its ``op_name``: a warm-up 0, a synchronization every H steps
  1/H, each half of alternating PowerSGD ½) runs its share; of a conditional whose branches carry
  no label, the costliest branch counts;
* **collective**: an all-reduce, all-gather, all-to-all, reduce-scatter or collective-permute:
  the planner costs these with the α-β model, not as a kernel;
* **fusable**: for an elementwise kernel that reads a matrix product's output element for element
  (``c₀·X + B·X`` after ``B·X``), or that only scales, converts or transposes one array for
  matrix products (``c₂·A`` before ``(c₂·A)·A``, ``Xᵀ``), the bytes it would not move fused into
  the product, as XLA's GPU and TPU compilers fold these into it (a GEMM's α·op(A)·op(B) + β·C, a
  Triton or output fusion) and XLA:CPU, whose program is read here, does not.

``devices.Device.seconds`` turns the list into time on a device (a roofline per kernel).
"""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple, Optional

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_DEFINITION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
                         r"(?P<op>[a-z][a-z0-9\-]*)\((?P<operands>[^)]*)\)(?P<rest>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_KIND = re.compile(r"\bkind=(k\w+)")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1,
                **{f"{k}{b}": b // 8 for k in "suf" for b in (8, 16, 32, 64)}}
_IN_PLACE = ("dynamic-update-slice", "scatter")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_TO_APPLY = re.compile(r"\bto_apply=%?([\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count[^0-9]*(\d+)')
_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"\bdim_labels=\w+_(\w+)->")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_PHASE = re.compile(r"jaxcomp_phase\[(?P<name>[^|\]]+)\|(?P<share>[0-9.e+-]+)\]")
_WHEN = "jaxcomp_when"  # jaxcomp's loop run once or never (a labelled phase inside decides)
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier")
_CONTROL = ("conditional", "while", "call")


class _Instruction(NamedTuple):
  opcode: str
  operands: list  # the names of its operands
  arrays: list  # (dtype, dims) of each array of its output (a tuple has several)
  calls: Optional[str]  # the computation a fusion calls
  fusion_kind: str
  root: bool
  rest: str  # the attributes after the operands


class Kernel(NamedTuple):
  """One kernel of a step: ``flops`` and ``bytes`` per run, the ``dtype`` of its matrix product
  (None: no dot or convolution), ``weight`` runs per steady-state step, whether it is a
  ``collective``, and ``fusable``: the bytes it would not move were it fused into a matrix product
  (``_fusable``), else 0."""
  flops: float
  bytes: float
  dtype: Optional[str]
  weight: float
  collective: bool = False
  fusable: float = 0.0


def _arrays(shape: str) -> list:
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY.findall(shape)]


def _elements(arrays: list) -> list:
  """``(count, bytes per element)`` of each array."""
  return [(math.prod(dims), _DTYPE_BYTES[dtype]) for dtype, dims in arrays]


def _nbytes(elements: list) -> int:
  return sum(count * size for count, size in elements)


def parse(hlo_text: str) -> dict:
  """``{computation: {instruction name: _Instruction}}`` of a compiled HLO module, the entry
  computation under the key ``"ENTRY"`` too."""
  computations, computation = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = computations.setdefault(header.group("name"), {})
      if line.startswith("ENTRY"):
        computations["ENTRY"] = computation
      continue
    m = _DEFINITION.match(line)
    if m and computation is not None:
      calls, kind = _CALLS.search(m.group("rest")), _KIND.search(m.group("rest"))
      computation[m.group("name")] = _Instruction(
          m.group("op"), _OPERAND.findall(m.group("operands")), _arrays(m.group("shape")),
          calls.group(1) if calls else None, kind.group(1) if kind else "", bool(m.group("root")),
          m.group("rest"))
  return computations


def _moved(i: _Instruction, computations: dict, shapes: dict) -> int:
  """The bytes instruction ``i`` reads and writes (the module docstring's refinements)."""
  operands = [shapes.get(o, []) for o in i.operands]
  root = i
  if i.calls in computations:  # a fusion: what its root does (through bitcasts)
    body = computations[i.calls]
    root = next((f for f in body.values() if f.root), i)
    while root.opcode == "bitcast" and root.operands and root.operands[0] in body:
      root = body[root.operands[0]]
  out = _elements(i.arrays)
  at = 1 if root.opcode == "dynamic-update-slice" else 2  # the update among its operands
  if root.opcode in _IN_PLACE and len(root.operands) > at:  # written into a buffer not read
    update = shapes.get(root.operands[at], [])
    written, sizes = _nbytes(update), [_nbytes(o) for o in operands]
    if _nbytes(out) in sizes:
      operands.pop(sizes.index(_nbytes(out)))
    limit = sum(count for count, _ in update)
  elif i.fusion_kind == "kLoop":  # one read of an operand's element per output element
    written, limit = _nbytes(out), sum(count for count, _ in out)
  else:
    written, limit = _nbytes(out), None
  return written + sum(
      _nbytes(o) if limit is None or len(o) != 1 else min(_nbytes(o), limit * o[0][1])
      for o in operands)


def _shapes(computations: dict) -> dict:
  return {name: _elements(i.arrays) for c in computations.values() for name, i in c.items()}


def bytes_moved(hlo_text: str) -> dict:
  """``{instruction name: bytes}`` each instruction of the module's computations (but fused ones)
  reads and writes when it runs (the module docstring)."""
  computations = parse(hlo_text)
  shapes = _shapes(computations)
  fused = {i.calls for c in computations.values() for i in c.values() if i.opcode == "fusion"}
  return {name: _moved(i, computations, shapes)
          for cname, c in computations.items() if cname not in fused and cname != "ENTRY"
          for name, i in c.items() if i.opcode not in _FREE and i.opcode not in _CONTROL}


def _flops(i: _Instruction, computations: dict, dims: dict) -> tuple:
  """``(FLOPs, dtype of its matrix product or None)`` of one run of ``i``."""
  out = sum(math.prod(d) for _, d in i.arrays)
  if i.opcode == "fusion" and i.calls in computations:
    total, dtype = 0.0, None
    cap = out if i.fusion_kind == "kLoop" else float("inf")  # each output element computed once
    for inner in computations[i.calls].values():
      if inner.opcode not in _FREE:
        flops, kind = _flops(inner, computations, dims)
        total, dtype = total + (flops if kind else min(flops, cap)), dtype or kind
    return total, dtype
  if i.opcode == "dot":
    lhs = dims.get(i.operands[0], [("f32", ())])[0]
    axes = _CONTRACTING.search(i.rest)
    contracted = math.prod(lhs[1][int(a)] for a in axes.group(1).split(",") if a) if axes else 1
    return 2.0 * out * contracted, lhs[0]
  if i.opcode == "convolution":
    rhs = dims.get(i.operands[1], [("f32", ())])[0]
    labels = _DIM_LABELS.search(i.rest)
    features = rhs[1][labels.group(1).index("o")] if labels else 1
    return 2.0 * out * math.prod(rhs[1]) / max(features, 1), rhs[0]
  if i.opcode == "reduce":
    return float(sum(math.prod(dims.get(o, [("f32", ())])[0][1]) for o in i.operands[:1])), None
  return float(out), None


_MATRIX = ("dot", "convolution")


def _has_matrix(i: _Instruction, computations: dict) -> bool:
  """Whether ``i`` is a dot or a convolution, or a fusion around one."""
  return i.opcode in _MATRIX or (i.opcode == "fusion" and any(
      j.opcode in _MATRIX for j in computations.get(i.calls, {}).values()))


def _fusable(i: _Instruction, computation: dict, consumers: dict, computations: dict,
             shapes: dict) -> float:
  """The bytes an elementwise kernel ``i`` would not move fused into a matrix product: as its
  epilogue (it reads the product's output element for element: two passes over that output) or
  its prologue (its one array operand scaled, converted or transposed for products that are its
  only readers: two passes over its output)."""
  if _has_matrix(i, computations) or (i.opcode == "fusion" and i.fusion_kind != "kLoop"):
    return 0.0
  count = sum(math.prod(d) for _, d in i.arrays)
  for name in i.operands:
    producer = computation.get(name)
    while producer is not None and producer.opcode == "bitcast" and producer.operands:
      producer = computation.get(producer.operands[0])
    if producer is not None and _has_matrix(producer, computations):
      out = shapes.get(name, [])
      if sum(c for c, _ in out) == count:
        return 2.0 * _nbytes(out)
  arrays = [o for o in i.operands if sum(c for c, _ in shapes.get(o, [])) > 1]
  readers = consumers.get(id(i), [])
  if (len(arrays) == 1 and sum(c for c, _ in shapes.get(arrays[0], [])) == count and readers
      and all(_has_matrix(r, computations) for r in readers)):
    return 2.0 * _nbytes(_elements(i.arrays))
  return 0.0


def _share(op_name: str, least: float) -> float:
  """The product of the shares of the jaxcomp phases an instruction sits in (1 outside any); 0
  where one of them is below ``least``."""
  labels = dict.fromkeys((m.group("name"), float(m.group("share")))
                         for m in _PHASE.finditer(op_name))
  return math.prod(share if share >= least else 0.0 for _, share in labels)


class Program(NamedTuple):
  """A compiled program's ``kernels`` and the loops whose trip count XLA did not know
  (``unknown_trips``: each counted as running once)."""
  kernels: list
  unknown_trips: int


def kernels(hlo_text: str, least_share: float = 0.0) -> Program:
  """The kernels of one steady-state run of a compiled HLO module (the module docstring), on
  average over the steps; with ``least_share``, the phases taken on a smaller share of the steps
  count 0 (``0.5``: a typical step, which a synchronization every H steps is not)."""
  computations = parse(hlo_text)
  shapes = _shapes(computations)
  dims = {name: i.arrays for c in computations.values() for name, i in c.items()}
  unknown = 0

  def walk(name: str, weight: float) -> list:
    nonlocal unknown
    out = []
    computation = computations.get(name, {})
    consumers: dict = {}
    for j in computation.values():
      for o in j.operands:
        if o in computation:
          consumers.setdefault(id(computation[o]), []).append(j)
    for i in computation.values():
      if i.opcode in _FREE:
        continue
      op_name = _OP_NAME.search(i.rest)
      op_name = op_name.group("op_name") if op_name else ""
      if i.opcode == "while":
        trips, body = _TRIPS.search(i.rest), _BODY.search(i.rest)
        if body is None:
          continue
        count = int(trips.group(1)) if trips else 1
        if _WHEN in op_name:  # runs once if its phase is taken; unlabelled, on a non-finite step
          own = set(_PHASE.findall(op_name))
          labelled = any(set(_PHASE.findall(j.rest)) - own
                         for j in computations.get(body.group(1), {}).values())
          count = 1 if labelled else 0
        elif trips is None:
          unknown += 1
        out += walk(body.group(1), weight * count)
      elif i.opcode == "conditional":
        found = _BRANCHES.search(i.rest)
        names = ([b.strip().lstrip("%") for b in found.group(1).split(",")] if found
                 else _TRUE_FALSE.findall(i.rest))
        branches = [walk(b, weight) for b in names]
        if any(_PHASE.search(j.rest) for b in names for j in computations.get(b, {}).values()):
          out += [k for b in branches for k in b]
        elif branches:
          out += max(branches, key=lambda b: sum(k.bytes * k.weight for k in b))
      elif i.opcode == "call":
        target = _TO_APPLY.search(i.rest)
        out += walk(target.group(1), weight) if target else []
      else:
        base = i.opcode[:-len("-start")] if i.opcode.endswith("-start") else i.opcode
        if base.endswith("-done"):
          continue
        flops, dtype = _flops(i, computations, dims)
        out.append(Kernel(flops, float(_moved(i, computations, shapes)), dtype,
                          weight * _share(op_name, least_share), base in COLLECTIVES,
                          _fusable(i, computation, consumers, computations, shapes)))
    return out

  return Program(walk("ENTRY", 1.0), unknown)


def summary(program: Program, scale: float = 1.0) -> list:
  """The kernels with the same FLOPs, bytes, dtype, collective flag and fusable bytes merged,
  their weights added (and multiplied by ``scale``): ``[[flops, bytes, dtype, weight, collective,
  fusable], ...]``, the form ``compute`` caches and ``devices.Device.seconds`` takes."""
  merged = collections.Counter()
  for k in program.kernels:
    if k.weight:
      merged[k.flops, k.bytes, k.dtype, k.collective, k.fusable] += k.weight * scale
  return [[f, b, d, w, c, e] for (f, b, d, c, e), w in merged.items()]
