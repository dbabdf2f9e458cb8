"""``comm_report``: what a compiled step sends, read from the HLO XLA will run.

The report lists every collective in the compiled module — the ones jaxcomp asked for, the ones the
SPMD partitioner inserted and any all-reduce autodiff added — with its dtypes, shapes, group size
and bytes, whether it sits in a loop body or a conditional branch, and the phase it belongs to. It
is the proof that compression reaches the wire.

**Phases.** A step's warm-up (PowerSGD's ``start_iter``, DGC's density stages, 1-bit Adam's dense
Adam), the two halves of alternating PowerSGD and the synchronization of local SGD and DiLoCo are
branches that run on some steps only; jaxcomp labels them (``jaxcomp._src.phases``) and the label
reaches every collective inside. A collective's ``phases`` names the branches it sits in, outermost
first, each with its share of the steady state. The report's totals (``payload_bytes``,
``ring_bytes``, ``bytes_by_dtype``) are per step of the steady state, on average: every unlabelled
collective counts in full, a labelled one times the product of its shares — a warm-up's collectives
count 0, each half of alternating PowerSGD ½, a synchronization every H steps 1/H. ``phase(name)``
is the report of one step taken in a given phase (its own collectives and the unlabelled ones), e.g.
``report.phase("powersgd.warmup")``; ``phase_names`` lists them.

Bytes are counted two ways, per device:

* ``payload_bytes``: the size of the buffer the collective works on — the reduced buffer for
  all-reduce, the gathered result (W contributions) for all-gather, the input for reduce-scatter and
  all-to-all, the moved buffer for collective-permute.
* ``ring_bytes``: what each device sends under the ring algorithm: 2(W−1)/W·N for all-reduce,
  (W−1)/W·N for all-gather (N its result), reduce-scatter and all-to-all (N their input), N for
  collective-permute.

XLA:CPU widens bf16 collectives to f32 when it compiles; ``stage="lowered"`` reads the HLO before
optimisation, which keeps the requested dtypes (and misses the partitioner's collectives).

**Float16 sums on XLA:CPU.** XLA:CPU's all-reduce and reduce-scatter add float16 values one at a
time in software, so a step lowered for CPU runs each float16 sum over devices as an all-to-all, a
float16 sum of the received rows and, for an all-reduce, an all-gather (``axis.sum_in_rows``,
``axis.scatter_in_rows``: bit-identical, the same ring bytes). Those collectives carry a label
naming the collective they replace and its operand's shape (``axis.stands_for_label``); the report
counts them as that one collective — its op, shape, payload and ring bytes — with ``runs_as``
naming what runs instead (``print`` shows "run as all-to-all + all-gather"). So the totals and
``bytes_by_dtype`` are what the algorithm sends, as on a GPU, where the all-reduce itself runs; the
padding of the rows to a multiple of W values (fewer than W) is not counted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Optional

import jax
import numpy as np

from jaxcomp._src import axis, misuse
from jaxcomp._src import phases as phases_lib

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# What the collectives that ``axis`` replaces on XLA:CPU run as (``axis.sum_in_rows``,
# ``axis.scatter_in_rows``).
_RUNS_AS = {"all-reduce": ("all-to-all", "all-gather"), "reduce-scatter": ("all-to-all",)}
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
  phases: tuple = ()  # ((name, share), ...): the labelled branches it sits in, outermost first
  runs_as: tuple = ()  # what runs in its place: a float16 sum on XLA:CPU (the module docstring)

  @property
  def share(self) -> float:
    """The fraction of steady-state steps on which it runs: the product of its phases' shares."""
    return math.prod(share for _, share in self.phases)

  @property
  def phase(self) -> str:
    """Its phase path, ``"outer/inner"`` (``""``: every step)."""
    return "/".join(name for name, _ in self.phases)


@dataclasses.dataclass(frozen=True)
class CommReport:
  """Every collective of a compiled step, with totals per step of the steady state."""
  collectives: tuple

  @property
  def payload_bytes(self) -> float:
    """Payload bytes per steady-state step (warm-up phases count 0, periodic ones their share)."""
    return _total(c.payload_bytes * c.share for c in self.collectives)

  @property
  def ring_bytes(self) -> float:
    """Ring-algorithm bytes each device sends per steady-state step."""
    return sum(c.ring_bytes * c.share for c in self.collectives)

  def bytes_by_dtype(self) -> dict:
    """Payload bytes per dtype per steady-state step, e.g. ``{"f16": 2048, "f32": 40}``."""
    out: dict = {}
    for c in self.collectives:
      sizes = [math.prod(s) * _itemsize(d) for d, s in zip(c.dtypes, c.shapes)]
      scale = c.payload_bytes / max(sum(sizes), 1)
      for d, size in zip(c.dtypes, sizes):
        out[d] = _total((out.get(d, 0), size * scale * c.share))
    return {d: b for d, b in out.items() if b}

  @property
  def phase_names(self) -> tuple:
    """Every labelled phase path in the step (``"diloco.sync/powersgd.compressed"`` for nested
    ones), each prefix of a path included, in order of first appearance."""
    names: list = []
    for c in self.collectives:
      for depth in range(1, len(c.phases) + 1):
        name = "/".join(n for n, _ in c.phases[:depth])
        if name not in names:
          names.append(name)
    return tuple(names)

  def phase(self, name: str) -> "CommReport":
    """What one step taken in phase ``name`` sends: the unlabelled collectives, and those of the
    phase and of the phases it is nested in, each once (a phase path, or its last part when that
    names one phase only).

    Raises:
      KeyError: no collective sits in a phase of that name (the message lists those that do).
    """
    paths = [p for p in self.phase_names if p == name or p.split("/")[-1] == name]
    if len(paths) != 1:
      raise KeyError(f"phase {name!r}: the step's phases with collectives are "
                     f"{', '.join(self.phase_names) or 'none'}" + (
                         "; give the whole path" if paths else ""))
    path = paths[0]
    return CommReport(tuple(dataclasses.replace(c, phases=()) for c in self.collectives
                            if not c.phase or path == c.phase or path.startswith(c.phase + "/")))

  @property
  def every_step(self) -> "CommReport":
    """The collectives outside every labelled phase: they run on every step."""
    return CommReport(tuple(c for c in self.collectives if not c.phases))

  def by_axes(self, mesh) -> dict:
    """The collectives grouped by the ``mesh`` axes their replica groups span.

    On a mesh ``("slow", "fast")``, a mean over ``fast`` runs in groups whose devices differ only in
    their ``fast`` coordinate: it is filed under ``("fast",)``; one over both axes under
    ``("slow", "fast")``. Collectives whose groups the HLO does not name (pmap's) are filed under
    ``mesh.axis_names``. The HLO names a device by its position in the program's devices, which
    are the mesh's in order (not by its id: in a job of several processes the second process's
    first device is 2048 on CPU): ``mesh`` must be the one the step was compiled for.

    Returns:
      ``{tuple of axis names: CommReport}``, axes in the mesh's order.
    """
    coordinates = dict(enumerate(index for index, _ in np.ndenumerate(mesh.devices)))
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
    header = (f"{'op':<19}{'dtypes':<12}{'shapes':<30}{'W':>4}{'payload B':>13}{'ring B/dev':>13}"
              "  phase (share of steady steps)")
    rows = [header, "-" * len(header)]
    for c in self.collectives:
      shapes = ",".join("x".join(map(str, s)) or "()" for s in c.shapes)
      where = f"{c.phase} ({c.share:g})" if c.phases else "every step"
      if c.in_loop:
        where += ", in a loop"
      if c.runs_as:
        where += ", run as " + " + ".join(c.runs_as)
      rows.append(f"{c.op:<19}{','.join(sorted(set(c.dtypes))):<12}{shapes[:29]:<30}"
                  f"{c.group_size:>4}{c.payload_bytes:>13,}{c.ring_bytes:>13,.0f}  {where}")
    for name in self.phase_names:
      phase = self.phase(name)
      rows.append(f"{'a step in ' + name:<65}{phase.payload_bytes:>13,.0f}"
                  f"{phase.ring_bytes:>13,.0f}")
    rows.append(f"{'total per steady-state step':<65}{self.payload_bytes:>13,.0f}"
                f"{self.ring_bytes:>13,.0f}")
    return "\n".join(rows)


def _total(values) -> float:
  """A sum that stays an int when every term is a whole number (bytes of unlabelled collectives)."""
  total = sum(values)
  return int(total) if float(total).is_integer() else total


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
                in_loop: bool, in_conditional: bool) -> Optional[Collective]:
  """The collective of one HLO instruction; a float16 sum's all-to-all on XLA:CPU as the all-reduce
  or reduce-scatter it replaces, and None for its all-gather (``_RUNS_AS``)."""
  arrays = [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
            for m in _ARRAY.finditer(shape_text)]
  if is_start and op in ("all-gather", "reduce-scatter", "collective-permute") and len(arrays) > 1:
    arrays = arrays[len(arrays) // 2:]  # async start: (operands, results [, scratch]) -> results
  op_name = re.search(r'op_name="([^"]*)"', line)
  op_name = op_name.group(1) if op_name else ""
  group = _group_size(line, default_group)
  runs_as = ()
  replaced = axis.stands_for(op_name)
  if replaced and op in ("all-to-all", "all-gather"):
    if op == "all-gather":
      return None  # counted with the all-to-all
    op, shape = replaced
    runs_as = _RUNS_AS[op]
    arrays = [(arrays[0][0], shape if op == "all-reduce" else shape[1:])]  # the result's
  result_bytes = sum(math.prod(s) * _itemsize(d) for d, s in arrays)
  payload = result_bytes * group if op == "reduce-scatter" else result_bytes
  share = (group - 1) / group
  ring = {"all-reduce": 2 * share, "collective-permute": 1.0}.get(op, share) * payload
  if op == "collective-permute" and group <= 1:
    ring = 0.0
  return Collective(op, name, tuple(d for d, _ in arrays), tuple(s for _, s in arrays), group,
                    payload, ring, in_loop, in_conditional, _replica_groups(line),
                    phases_lib.parse(op_name), runs_as)


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
      kind = callee.group("kind")
      if kind in ("body", "condition") and phases_lib.WHEN in line:
        kind = "branch_computations"  # ``phases.when``: a loop that runs its body once or never
      for name in re.findall(r"[\w.\-]+", callee.group("names").replace("%", "")):
        parents.setdefault(name, []).append((current, kind))
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
  return CommReport(tuple(c for c in collectives if c is not None))


def comm_report(fn: Callable, *args, stage: str = "compiled",
                num_devices: Optional[int] = None, **kwargs) -> CommReport:
  """Compiles ``fn(*args, **kwargs)`` and lists every collective it runs.

  Args:
    fn: a ``jax.jit`` / ``jax.pmap`` function, or a plain function (it is jitted), e.g. a training
      step built with ``jax.shard_map``; or a step already lowered (``jax.stages.Lowered``, then
      no arguments) or compiled (``jax.stages.Compiled``, read as it is).
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    stage: ``"compiled"`` (the HLO XLA runs) or ``"lowered"`` (before optimisation: requested
      dtypes, no partitioner collectives).
    num_devices: group size for collectives over all devices that name no groups; default all
      devices.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    A ``CommReport``; ``print`` it for a table.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))
    >>> step = jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")
    >>> report = jaxcomp.comm_report(step, jax.ShapeDtypeStruct((8, 1000), jnp.float32))
    >>> [c.op for c in report.collectives], report.payload_bytes  # 1,000 float32 per device
    (['all-reduce'], 4000)
  """
  if stage not in ("compiled", "lowered"):
    raise ValueError(f"stage must be 'compiled' or 'lowered'; got {stage!r}")
  if isinstance(fn, jax.stages.Compiled):
    if stage != "compiled":
      raise ValueError("a compiled step holds the compiled HLO only: pass its Lowered stage "
                       "(fn.lower(*args)) for stage='lowered'")
    text = fn.as_text()
  else:
    if isinstance(fn, jax.stages.Lowered):
      lowered = fn
    else:
      if not getattr(fn, "checks_itself", False):  # jaxcomp's steps check themselves (OnMesh)
        misuse.check(fn, *args, **kwargs)
      lowered = (fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower)(*args, **kwargs)
    text = (lowered.compile().as_text() if stage == "compiled"
            else lowered.as_text(dialect="hlo", debug_info=True))
  return parse_hlo(text, num_devices or jax.device_count())
