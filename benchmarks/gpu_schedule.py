"""Whether XLA scheduled a step's collectives asynchronously, and how much of each overlaps the
backward pass: read from the compiled HLO text of each ``jaxcomp.data_parallel`` step that
``step_time.py --hlo-dir`` saved.

A compiled module is scheduled: each computation lists its instructions in the order they run. On
XLA:GPU a collective is usually split into a start and a done (``all-reduce-start`` /
``all-reduce-done``, ``all-gather-start``, ``collective-permute-start``, or an ``async-start`` /
``async-done`` wrapping an all-to-all or a reduce-scatter); what is scheduled between the two runs
while the collective is in flight. XLA marks a pair it chose not to overlap (``"is_sync":true`` in
its backend config). XLA:CPU runs every collective synchronously (no pairs). For each collective:

* ``window``: the instructions scheduled between its start and its done (0 for a synchronous one),
  not counting bookkeeping (parameters, constants, tuples, get-tuple-element, bitcasts);
* ``backward in window``: those of them that belong to the backward pass (their ``op_name``, the
  JAX name scope, is ``transpose(jvp(...))`` outside any ``jaxcomp.`` scope:
  ``step_profile.phase_of``) — the overlap with the backward pass, in instructions;
* ``backward after start``: the backward-pass instructions of the entry computation scheduled after
  the collective's start (for a collective inside a conditional or a loop, after the instruction
  that calls it): what the collective could still overlap, had XLA left it in flight.

Per step it reports the collectives (by op), how many are asynchronous (and how many of those XLA
marked synchronous), the widest window, the backward instructions inside any window / all of them,
those after the first start, and the share of the collectives' payload bytes
(``jaxcomp.comm_report``'s parser) whose window holds backward-pass work. Instructions are counted,
not timed: a fusion counts 1 whatever its size. ``kernels`` counts the step's kernels as compiled:
every instruction of the entry computation and of the loops' and conditionals' computations it
runs, but bookkeeping, control flow and the done of an asynchronous pair (a loop's body once,
every branch of a conditional: ``step_profile.py`` counts what a step executed).

  PYTHONPATH=. python benchmarks/gpu_schedule.py HLO_DIR [--out schedule.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
               "replica-id", "after-all", "add-dependency", "opt-barrier"}
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.*?\s(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|"
                     r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def parse(text: str) -> tuple:
  """``(computations, entry)``: ``{name: [instruction dict, ...]}`` in schedule order, and the
  entry computation's name. An instruction: name, op, first operand, op_name, called computations,
  is_sync."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group("name")
      computations[current] = []
      if header.group("entry"):
        entry = current
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      rest = m.group("rest")
      operand = re.match(r"\s*%?([\w.\-]+)", rest)
      op_name = _OP_NAME.search(line)
      called = [n for group in _CALLED.findall(line)
                for n in re.findall(r"[\w.\-]+", group.replace("%", ""))]
      computations[current].append({
          "name": m.group("name"), "op": m.group("op"),
          "operand": operand.group(1) if operand else "",
          "op_name": op_name.group("op_name") if op_name else "", "called": called,
          "is_sync": '"is_sync":true' in line.replace(" ", "")})
  return computations, entry


def _collective_of(instruction, computations) -> str:
  """The collective an instruction starts or runs ("" if none): its op, or for an ``async-start``
  the collective inside the computation it wraps."""
  op = instruction["op"]
  base = op[:-len("-start")] if op.endswith("-start") else op
  if base in COLLECTIVES:
    return base
  if op == "async-start":
    for called in instruction["called"]:
      for inner in computations.get(called, []):
        if inner["op"] in COLLECTIVES:
          return inner["op"]
  return ""


def _fill_op_names(computations) -> None:
  """A fusion without an ``op_name`` takes the last one inside the computation it calls (as
  ``step_profile.instructions`` does)."""
  last = {name: next((i["op_name"] for i in reversed(body) if i["op_name"]), "")
          for name, body in computations.items()}
  for body in computations.values():
    for i in body:
      if not i["op_name"] and i["called"]:
        i["op_name"] = next((last[c] for c in i["called"] if last.get(c)), "")


def _is_backward(instruction) -> bool:
  from benchmarks import step_profile  # noqa: PLC0415  (imports JAX: only when analysing)
  phase = step_profile.phase_of(instruction["op"], instruction["op_name"])
  return "transpose(" in instruction["op_name"] and phase == "forward+backward"


def kernels(computations: dict, entry: str) -> int:
  """The kernels of a compiled step (the module docstring), from ``parse``'s computations."""
  def count(name, seen):
    total = 0
    for i in computations.get(name, []):
      if i["op"] in ("while", "conditional", "call"):
        total += sum(count(c, seen | {c}) for c in i["called"] if c not in seen)
      elif i["op"] not in BOOKKEEPING and not i["op"].endswith("-done"):
        total += 1
    return total
  return count(entry, {entry})


def analyse(text: str, world: int) -> dict:
  """The schedule of one compiled step's collectives (the module docstring)."""
  from jaxcomp._src import report  # noqa: PLC0415
  computations, entry = parse(text)
  _fill_op_names(computations)
  payload = {c.name: c.payload_bytes for c in report.parse_hlo(text, world).collectives}
  callers = collections.defaultdict(list)  # computation -> [(caller computation, index)]
  for name, body in computations.items():
    for index, i in enumerate(body):
      for called in i["called"]:
        callers[called].append((name, index))

  def entry_index(computation, index, seen=()):
    """The index in the entry computation of the instruction that (transitively) runs this one."""
    if computation == entry:
      return index
    for caller, at in callers.get(computation, []):
      if caller not in seen:
        found = entry_index(caller, at, seen + (computation,))
        if found is not None:
          return found
    return None

  body = computations.get(entry, [])
  backward = [k for k, i in enumerate(body) if _is_backward(i)]
  wrapped = {c for instructions in computations.values() for i in instructions
             if i["op"] == "async-start" for c in i["called"]}
  found = []
  for name, instructions in computations.items():
    if name in wrapped:
      continue  # the collective inside an async-start: counted at its start
    done_of = {i["operand"]: k for k, i in enumerate(instructions) if i["op"].endswith("-done")}
    for k, i in enumerate(instructions):
      op = _collective_of(i, computations)
      if not op:
        continue
      is_async = i["op"].endswith("-start")
      end = done_of.get(i["name"], k) if is_async else k
      window = [w for w in instructions[k + 1:end] if w["op"] not in BOOKKEEPING]
      position = entry_index(name, k)
      inner = next((w["name"] for c in i["called"] for w in computations.get(c, [])
                    if w["op"] in COLLECTIVES), None)
      found.append({
          "op": op, "name": i["name"], "computation": "entry" if name == entry else name,
          "async": is_async, "marked_sync": is_async and i["is_sync"],
          "window": len(window), "backward_in_window": sum(_is_backward(w) for w in window),
          "backward_window_ids": [f"{name}/{w['name']}" for w in window if _is_backward(w)],
          "backward_after_start": (sum(b > position for b in backward)
                                   if position is not None else None),
          "payload_bytes": payload.get(i["name"], payload.get(inner, 0))})
  in_windows = {n for c in found for n in c.pop("backward_window_ids")}
  starts = [c["backward_after_start"] for c in found if c["backward_after_start"] is not None]
  total_bytes = sum(c["payload_bytes"] for c in found)
  overlapped = sum(c["payload_bytes"] for c in found if c["backward_in_window"])
  return {"collectives": found, "backward": len(backward),
          "count": collections.Counter(c["op"] for c in found),
          "async": sum(c["async"] for c in found),
          "marked_sync": sum(c["marked_sync"] for c in found),
          "widest_window": max((c["window"] for c in found), default=0),
          "backward_in_windows": len(in_windows),
          "backward_after_first_start": max(starts, default=0),
          "bytes": total_bytes, "bytes_overlapping_backward": overlapped,
          "kernels": kernels(computations, entry)}


def analyse_file(path: str) -> dict:
  """The record of one ``<model>__W<n>__<entry>.hlo`` file (``step_time.py --hlo-dir``)."""
  model, world, entry = os.path.basename(path)[:-len(".hlo")].split("__")
  with open(path) as handle:
    result = analyse(handle.read(), int(world[1:]))
  result["count"] = dict(result["count"])
  return {"model": model, "world": int(world[1:]), "entry": entry, **result}


def analyse_dir(folder: str, done: dict = None) -> list:
  """One record per ``.hlo`` file in ``folder``, in the order of the files' modification times (the
  order they were compiled); ``done``: ``{path: record}`` already analysed (updated)."""
  done = {} if done is None else done
  files = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".hlo")),
                 key=os.path.getmtime)
  for path in files:
    if path not in done:
      done[path] = analyse_file(path)
  return [done[path] for path in files]


SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


def each(collectives: list, most: int = 6) -> str:
  """Each collective in schedule order: ``AR 14/9`` (14 instructions in its window, 9 of them the
  backward pass's), ``AR sync`` (no window, or one XLA marked synchronous)."""
  cells = [f"{SHORT[c['op']]} " + (f"{c['window']}/{c['backward_in_window']}"
                                   if c["async"] and not c["marked_sync"] else "sync")
           for c in collectives]
  return ", ".join(cells[:most]) + (f", +{len(cells) - most}" if len(cells) > most else "")


def rows(records: list) -> list:
  """The Markdown rows of ``records`` (one per step)."""
  out = []
  for r in records:
    ops = ", ".join(op + (f" ×{n}" if n > 1 else "") for op, n in r["count"].items()) or "none"
    share = r["bytes_overlapping_backward"] / r["bytes"] if r["bytes"] else 0.0
    out.append([r["entry"], ops, f"{r['async']} of {sum(r['count'].values())}"
                + (f" ({r['marked_sync']} marked sync)" if r["marked_sync"] else ""),
                str(r["widest_window"]), f"{r['backward_in_windows']} / {r['backward']}",
                f"{r['backward_after_first_start']} / {r['backward']}", f"{share:.0%}",
                str(r.get("kernels", "—")), each(r["collectives"])])
  return out


HEADER = ["entry", "collectives", "async (start/done)", "widest window (instr.)",
          "backward instr. in windows / all", "backward instr. after first start / all",
          "bytes overlapping backward", "kernels", "each: window / backward in it"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("hlo_dir", help="the folder step_time.py --hlo-dir wrote")
  p.add_argument("--out", default=None, help="write the records as JSON to this file")
  args = p.parse_args(argv)
  records = analyse_dir(args.hlo_dir)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(records, f, indent=1)
  from benchmarks import common  # noqa: PLC0415
  for (model, world), group in itertools_groupby(records):
    print(f"\n{model}, W = {world}:\n\n" + common.markdown_table(HEADER, rows(group)))
  return 0


def itertools_groupby(records: list) -> list:
  """``[((model, world), records)]`` in first-seen order."""
  groups: dict = {}
  for r in records:
    groups.setdefault((r["model"], r["world"]), []).append(r)
  return list(groups.items())


if __name__ == "__main__":
  sys.exit(main())
