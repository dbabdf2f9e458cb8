"""``comm_report``: what a compiled step sends, read from the HLO XLA will run.

The report lists every collective in the compiled module — the ones jaxcomp asked for, the ones the
SPMD partitioner inserted and any all-reduce autodiff added — with its dtypes, shapes, group size and
bytes, and whether it sits in a loop body or a conditional branch. It is the proof that compression
reaches the wire.

Bytes are counted two ways, per device:

* ``payload_bytes``: the size of the buffer the collective works on — the reduced buffer for
  all-reduce, the gathered result (W contributions) for all-gather, the input for reduce-scatter and
  all-to-all, the moved buffer for collective-permute.
* ``ring_bytes``: what each device sends under the ring algorithm: 2(W−1)/W·N for all-reduce,
  (W−1)/W·N for all-gather (N its result), reduce-scatter and all-to-all (N their input), N for
  collective-permute.

XLA:CPU widens bf16 collectives to f32 when it compiles; ``stage="lowered"`` reads the HLO before
optimisation, which keeps the requested dtypes (and misses the partitioner's collectives).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Optional

import jax
import numpy as np

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(_COLLECTIVES) + r")(?P<start>-start)?\(")
# A computation's header: "name (params) -> result {" when compiled, "name {" before optimisation.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s+->\s+.*)?\{\s*$")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8\w*|c64|c128)\[(?P<dims>[\d,]*)\]")
_CALLEES = re.compile(
    r"\b(?P<kind>to_apply|calls|body|condition|true_computation|false_computation|"
    r"branch_computations)=(?P<names>\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective in the compiled step."""
  op: str
  name: str
  dtypes: tuple
  shapes: tuple
  group_size: int
  payload_bytes: int
  ring_bytes: float
  in_loop: bool
  in_conditional: bool
  replica_groups: tuple = ()  # the device (or replica) ids of each group, where the HLO names them


@dataclasses.dataclass(frozen=True)
class CommReport:
  """Every collective of a compiled step, with totals."""
  collectives: tuple

  @property
  def payload_bytes(self) -> int:
    return sum(c.payload_bytes for c in self.collectives)

  @property
  def ring_bytes(self) -> float:
    return sum(c.ring_bytes for c in self.collectives)

  def bytes_by_dtype(self) -> dict:
    """Payload bytes per dtype, e.g. ``{"f16": 2048, "f32": 40}``."""
    out: dict = {}
    for c in self.collectives:
      sizes = [math.prod(s) * _itemsize(d) for d, s in zip(c.dtypes, c.shapes)]
      scale = c.payload_bytes / max(sum(sizes), 1)
      for d, size in zip(c.dtypes, sizes):
        out[d] = out.get(d, 0) + int(size * scale)
    return out

  def by_axes(self, mesh) -> dict:
    """The collectives grouped by the ``mesh`` axes their replica groups span.

    On a mesh ``("slow", "fast")``, a mean over ``fast`` runs in groups whose devices differ only in
    their ``fast`` coordinate: it is filed under ``("fast",)``; one over both axes under
    ``("slow", "fast")``. Collectives whose groups the HLO does not name (pmap's) are filed under
    ``mesh.axis_names``.

    Returns:
      ``{tuple of axis names: CommReport}``, axes in the mesh's order.
    """
    coordinates = {int(d.id): index for index, d in np.ndenumerate(mesh.devices)}
    grouped: dict = {}
    for c in self.collectives:
      spanned = set()
      for group in c.replica_groups:
        points = np.array([coordinates[i] for i in group])
        spanned |= {a for a in range(points.shape[1]) if len(set(points[:, a])) > 1}
      key = (tuple(mesh.axis_names[a] for a in sorted(spanned)) if c.replica_groups
             else tuple(mesh.axis_names))
      grouped.setdefault(key, []).append(c)
    return {key: CommReport(tuple(cs)) for key, cs in grouped.items()}

  def __str__(self) -> str:
    header = f"{'op':<19}{'dtypes':<12}{'shapes':<30}{'W':>4}{'payload B':>13}{'ring B/dev':>13}  where"
    rows = [header, "-" * len(header)]
    for c in self.collectives:
      shapes = ",".join("x".join(map(str, s)) or "()" for s in c.shapes)
      where = "loop" if c.in_loop else "cond" if c.in_conditional else ""
      if c.in_loop and c.in_conditional:
        where = "loop+cond"
      rows.append(f"{c.op:<19}{','.join(sorted(set(c.dtypes))):<12}{shapes[:29]:<30}"
                  f"{c.group_size:>4}{c.payload_bytes:>13,}{c.ring_bytes:>13,.0f}  {where}")
    rows.append(f"{'total':<65}{self.payload_bytes:>13,}{self.ring_bytes:>13,.0f}")
    return "\n".join(rows)


def _itemsize(dtype: str) -> int:
  if dtype == "pred":
    return 1
  return max(int(re.sub(r"\D", "", dtype.split("e")[0]) or 8) // 8, 1)


def _replica_groups(line: str) -> tuple:
  """The ids of each replica group: ``{{0,1},{2,3}}``, or the iota form ``[G,S]<=[dims]T(perm)``."""
  match = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)+)\}", line)
  if match:
    return tuple(tuple(int(x) for x in re.findall(r"\d+", g))
                 for g in re.findall(r"\{([^}]*)\}", match.group(1)))
  match = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if match:
    dims = [int(x) for x in match.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if match.group(4):
      ids = ids.transpose([int(x) for x in match.group(4).split(",")])
    return tuple(tuple(int(x) for x in row)
                 for row in ids.reshape(int(match.group(1)), int(match.group(2))))
  return ()


def _group_size(line: str, default: int) -> int:
  groups = _replica_groups(line)
  if groups:
    return len(groups[0])
  match = re.search(r"source_target_pairs=\{(.*?)\}\s*[,}]", line)
  if match:
    return len(set(re.findall(r"\d+", match.group(1))))
  return default


def _collective(op: str, name: str, line: str, shape_text: str, is_start: bool, default_group: int,
                in_loop: bool, in_conditional: bool) -> Collective:
  arrays = [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
            for m in _ARRAY.finditer(shape_text)]
  if is_start and op in ("all-gather", "reduce-scatter", "collective-permute") and len(arrays) > 1:
    arrays = arrays[len(arrays) // 2:]  # async start: (operands, results [, scratch]) -> results
  group = _group_size(line, default_group)
  result_bytes = sum(math.prod(s) * _itemsize(d) for d, s in arrays)
  payload = result_bytes * group if op == "reduce-scatter" else result_bytes
  share = (group - 1) / group
  ring = {"all-reduce": 2 * share, "collective-permute": 1.0}.get(op, share) * payload
  if op == "collective-permute" and group <= 1:
    ring = 0.0
  return Collective(op, name, tuple(d for d, _ in arrays), tuple(s for _, s in arrays), group,
                    payload, ring, in_loop, in_conditional, _replica_groups(line))


def parse_hlo(text: str, default_group: int) -> CommReport:
  """Reads the collectives of an HLO module's text (optimised or not)."""
  parents: dict = {}  # computation -> [(caller computation, edge kind)]
  found = []  # (computation, op, name, line, shape, is_start)
  current = None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group("name")
      continue
    for callee in _CALLEES.finditer(line):
      for name in re.findall(r"[\w.\-]+", callee.group("names").replace("%", "")):
        parents.setdefault(name, []).append((current, callee.group("kind")))
    match = _INSTRUCTION.match(line)
    if match:
      found.append((current, match.group("op"), match.group("name"), line, match.group("shape"),
                    bool(match.group("start"))))

  def ancestry(computation, seen=()):
    kinds = set()
    for caller, kind in parents.get(computation, []):
      if caller not in seen:
        kinds.add(kind)
        kinds |= ancestry(caller, seen + (computation,))
    return kinds

  collectives = []
  for computation, op, name, line, shape, is_start in found:
    kinds = ancestry(computation)
    collectives.append(_collective(
        op, name, line, shape, is_start, default_group,
        in_loop=bool(kinds & {"body", "condition"}),
        in_conditional=bool(kinds & {"true_computation", "false_computation",
                                     "branch_computations"})))
  return CommReport(tuple(collectives))


def comm_report(fn: Callable, *args, stage: str = "compiled",
                num_devices: Optional[int] = None, **kwargs) -> CommReport:
  """Compiles ``fn(*args, **kwargs)`` and lists every collective it runs.

  Args:
    fn: a ``jax.jit`` / ``jax.pmap`` function, or a plain function (it is jitted), e.g. a training
      step built with ``jax.shard_map``.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    stage: ``"compiled"`` (the HLO XLA runs) or ``"lowered"`` (before optimisation: requested dtypes,
      no partitioner collectives).
    num_devices: group size for collectives over all devices that name no groups; default all devices.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    A ``CommReport``; ``print`` it for a table.
  """
  if stage not in ("compiled", "lowered"):
    raise ValueError(f"stage must be 'compiled' or 'lowered'; got {stage!r}")
  lower = fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower
  lowered = lower(*args, **kwargs)
  text = lowered.compile().as_text() if stage == "compiled" else lowered.as_text(dialect="hlo")
  return parse_hlo(text, num_devices or jax.device_count())
