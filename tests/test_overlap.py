"""Per-bucket collectives (``bucket_cap_mb``): in the compiled HLO each bucket's collectives depend
on that bucket's gradients only, so a scheduler may start them while the backward pass still
computes the gradients of earlier layers (DDP's reason for buckets).

The check reads the compiled HLO text: for every collective it follows the operands back to the
entry parameters, through fusions, tuples and the operands of the conditionals and loops that
contain it (conservatively: a value inside a conditional branch depends on every operand of the
conditional). XLA:CPU combines independent all-reduces into one (its ``cpu-all-reduce-combiner``
pass), which would tie the buckets together again on this backend; the programs are compiled without
that pass, as a GPU compiler keeps collectives above its combine threshold apart.
"""

import re

import jax
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src.buckets import bucket_assignment

from helpers import replicate

W = 4
_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(-start)?\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_CALLS = re.compile(r"\b(?:to_apply|calls|body|condition|true_computation|false_computation|"
                    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def _operands(rest: str) -> list:
  """The %names between the opcode's parentheses (the instruction's operands)."""
  start = rest.index("(", rest.index(" ") if " " in rest else 0)
  depth, end = 0, start
  for end in range(start, len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[end], 0)
    if depth == 0:
      break
  return re.findall(r"%([\w.\-]+)", rest[start:end])


def collective_dependencies(hlo: str) -> list:
  """``[(collective line, set of entry parameter numbers it depends on)]`` for a compiled module."""
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(2)
      computations[current] = {}
      entry = current if match.group(1) else entry
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      name, rest = match.groups()
      parameter = re.search(r"\bparameter\((\d+)\)", rest)
      callees = [c for group in _CALLS.findall(rest) for c in re.findall(r"[\w.\-]+", group)]
      computations[current][name] = (rest, None if parameter is None else int(parameter.group(1)),
                                     [] if parameter else _operands(rest), callees)
  callers = {}
  for comp, instructions in computations.items():
    for name, (_, _, _, callees) in instructions.items():
      for callee in callees:
        callers.setdefault(callee, []).append((comp, name))
  memo = {}

  def deps(comp, name):
    if (comp, name) in memo:
      return memo[(comp, name)]
    memo[(comp, name)] = set()  # cycles (loop bodies) end here
    _, parameter, operands, _ = computations[comp][name]
    if parameter is not None:
      if comp == entry:
        result = {parameter}
      else:  # every operand of every instruction that calls this computation
        result = set()
        for caller_comp, caller in callers.get(comp, []):
          for operand in computations[caller_comp][caller][2]:
            result |= deps(caller_comp, operand)
    else:
      result = set()
      for operand in operands:
        result |= deps(comp, operand)
    memo[(comp, name)] = result
    return result

  return [(rest, deps(comp, name)) for comp, instructions in computations.items()
          for name, (rest, _, _, _) in instructions.items() if _COLLECTIVE.search(rest)]


def layers():
  """Four Dense layers: with a 12 kB cap DDP's rule makes a bucket per layer, last layer first."""
  return {f"layer{i}": {"kernel": np.zeros((48, 64), np.float32), "bias": np.zeros(64, np.float32)}
          for i in range(4)}


def check(tx, params):
  """The bucket of each gradient leaf, and each collective's set of gradient leaves."""
  state = replicate(tx.init(params), W)
  grads = jax.tree.map(lambda p: np.zeros((W,) + p.shape, p.dtype), params)
  step = jax.pmap(tx.update, axis_name="batch", devices=jax.devices()[:W])
  hlo = step.lower(grads, state).compile(
      compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}).as_text()
  num_grads = len(jax.tree.leaves(params))  # the gradient leaves are the first entry parameters
  found = [(line, {p for p in ps if p < num_grads}) for line, ps in collective_dependencies(hlo)]
  return [(line, leaves) for line, leaves in found if "s32[]" not in line.split("all-")[0]]


def buckets_of(params, cap_mb):
  signature = jaxcomp.TreeSignature.of(params)
  return [set(b) for b in bucket_assignment(signature, cap_mb * 2**20, cap_mb * 2**20)]


CAP_MB = 12 / 1024  # 12 kB: each 48×64 kernel (12,288 B) closes a bucket


@pytest.mark.parametrize("make", [
    lambda cap: jaxcomp.powersgd(1, start_iter=10, bucket_cap_mb=cap),
    lambda cap: jaxcomp.powersgd(2, start_iter=0, alternating=True, bucket_cap_mb=cap),
    lambda cap: jaxcomp.dgc(0.05, warmup=((5, 0.25),), bucket_cap_mb=cap),
    lambda cap: jaxcomp.coarse_dgc(0.25, chunk_size=64, bucket_cap_mb=cap),
], ids=["powersgd", "powersgd_alternating", "dgc", "coarse_dgc"])
def test_each_bucket_collective_depends_on_its_own_gradients_only(make):
  params = layers()
  buckets = buckets_of(params, CAP_MB)
  assert len(buckets) >= 4
  found = check(make(CAP_MB), params)
  assert found, "no collectives found"
  touched = set()
  for line, leaves in found:
    owners = [i for i, b in enumerate(buckets) if leaves & b]
    assert len(owners) == 1 and leaves <= buckets[owners[0]], (line[:120], leaves, buckets)
    touched.add(owners[0])
  assert touched == set(range(len(buckets)))  # every bucket sends its own


def test_without_buckets_a_collective_needs_the_whole_gradient():
  """The check can fail: one packed collective per kind depends on every layer's gradient."""
  params = layers()
  found = check(jaxcomp.powersgd(1, start_iter=0), params)
  assert max(len(leaves) for _, leaves in found) == len(jax.tree.leaves(params))


def test_clip_norm_needs_the_whole_gradient():
  with pytest.raises(ValueError, match=r"bucket_cap_mb cannot be used here: local clipping "
                                       r"\(clip_norm\)"):
    jaxcomp.dgc(0.01, clip_norm=1.0, bucket_cap_mb=1.0)
