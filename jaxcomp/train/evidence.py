"""Steps to target from evidence: each entry's measured steps-to-target ratio and final-loss gap at
every model size it was measured at, and what its paper reports at scale.

**Measured** (``measured.json``, ``jaxcomp.train.measured``), one ``Point`` per entry and size:

* ``steps_to_target``: runs of the main job (``python -m jaxcomp.train``) on its chars transformer
  (120,704 parameters): the steps each entry took to reach allreduce's final held-out loss over
  allreduce's, or a lower bound where it did not reach it (``not_in``);
* ``scaling``: the records of a scaling study (``benchmarks/scaling_quality.py``'s results, read in
  by ``python -m jaxcomp.train.measured --scaling FILE``), one per entry, size and seed, each with
  the model's ``params``, the ``tokens`` it trained on, its ``heldout_loss``, its baseline's
  (``allreduce_loss``) and the first evaluated step at which it reached the baseline's loss
  (``steps_to_allreduce_loss``, null where it did not): the steps ratio is that step over the
  baseline's own, the gap heldout_loss / allreduce_loss − 1; seeds of one size are averaged.

``trend`` says how the gap moves with size (per tenfold of parameters, from the smallest size to
the largest), and the planner ranks an entry by its steps ratio at the largest size measured
(``best``). **Papers** (``PAPERS``): what each algorithm's paper reports at its largest scale — the
model size, the tokens where the paper states them, and the gap to its baseline in the paper's
terms — cited, shown beside the measurements. The planner ranks no entry on a paper's figure alone:
a loss gap at equal tokens is not a number of steps, and no paper here reports one; an entry
without a measurement is "not measured", left out of the recommendation with the command that
measures it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

JOB_TOKENS_PER_STEP = 32 * 64
"""The main job's chars task by default: 32 sequences of 64 characters a step."""


@dataclasses.dataclass(frozen=True)
class Point:
  """An entry at one model size.

  Attributes:
    params: the model's parameters; tokens: what the baseline trained on to its final loss.
    steps_ratio: the entry's steps to the baseline's final held-out loss over the baseline's (a
      lower bound where ``bound``); None: diverged.
    gap: the entry's final held-out loss over the baseline's, minus 1 (None: not recorded).
    source: where it comes from (a ``Plan.sources`` tag, or the study's command and date).
    seeds: how many seeds are averaged.
  """
  params: int
  tokens: Optional[float]
  steps_ratio: Optional[float]
  bound: bool
  gap: Optional[float]
  source: str
  seeds: int = 1


@dataclasses.dataclass(frozen=True)
class Paper:
  """What an algorithm's paper reports at its largest scale: ``params`` (the model), ``tokens``
  (None: not stated here), ``result`` (the gap to its baseline, in the paper's terms) and
  ``cite``."""
  params: float
  tokens: Optional[float]
  result: str
  cite: str


_DILOCO = Paper(2.4e9, None, "scales better than data-parallel training with model size; when "
                "well-tuned it can beat data-parallel training even at small sizes (35M–2.4B)",
                "Charles et al. 2025, Scaling Laws for DiLoCo, arXiv 2503.09799")
PAPERS = {
    "powersgd": Paper(11.2e6, None, "test accuracy on par with SGD (ResNet-18 on CIFAR-10; an "
                      "LSTM on WikiText-2)", "Vogels et al. 2019, PowerSGD, NeurIPS, "
                      "arXiv 1905.13727"),
    "dgc": Paper(25.6e6, None, "270–600× compression without losing accuracy (ResNet-50 on "
                 "ImageNet, DeepSpeech, LSTM language models)", "Lin et al. 2018, Deep Gradient "
                 "Compression, ICLR, arXiv 1712.01887"),
    "onebit_adam": Paper(340e6, None, "the same convergence as Adam on BERT-Large pre-training, up "
                         "to 5× less communication", "Tang et al. 2021, 1-bit Adam, ICML, "
                         "arXiv 2102.02888"),
    "sign": Paper(11.2e6, None, "matches SGD's test accuracy with error feedback (ResNet-18 on "
                  "CIFAR)", "Karimireddy et al. 2019, Error Feedback Fixes SignSGD, ICML, "
                  "arXiv 1901.09847"),
    "diloco": _DILOCO,
    "local_sgd": _DILOCO,
    "streaming_diloco": Paper(1e9, None, "similar quality to data-parallel training at billion "
                              "scale (1B: 400× fewer bits at the same loss)",
                              "Douillard et al. 2025, Streaming DiLoCo, arXiv 2501.18512"),
    "sparseloco": Paper(512e6, None, "lower loss than DiLoCo for H of 15–250, over 97× less "
                        "traffic", "SparseLoCo, arXiv 2508.15706"),
    "chunked_topk": Paper(512e6, None, "SparseLoCo's exchange: lower loss than DiLoCo at over 97× "
                          "less traffic", "SparseLoCo, arXiv 2508.15706"),
    "dion": Paper(3e9, None, "2–3× AdamW's efficiency; rank ¼ nearly equivalent to full rank",
                  "Ahn et al. 2025, Dion, arXiv 2504.05295"),
    "demo": Paper(1e9, None, "comparable loss to AdamW with data-parallel training at up to 85× "
                  "less data per GPU (OLMo 300M and 1B)", "Peng et al. 2024, DeMo, "
                  "arXiv 2411.19870"),
}
"""Per algorithm (the start of a registry name), its paper's figures (the facts collected in the
project's REFERENCE.md from each paper's abstract and tables)."""


def paper(name: str) -> Optional[Paper]:
  """The paper of registry entry ``name`` (the longest ``PAPERS`` key it starts with), or None."""
  keys = [k for k in PAPERS if name.startswith(k) or name.startswith("batched_" + k)
          or name.startswith("hook_" + k)]
  return PAPERS[max(keys, key=len)] if keys else None


def _params_of(model: str) -> Optional[int]:
  found = re.search(r"\(([\d,]+) parameters\)", model)
  return int(found.group(1).replace(",", "")) if found else None


def points(data: dict, name: str, sources: dict) -> list:
  """Entry ``name``'s ``Point``s, smallest model first: each size of the scaling study (seeds
  averaged) and the newest job run that trained it (tagged as in ``sources``: ``{tag: run}``)."""
  out = []
  for tag, run in sources.items():
    outcome = run.get("outcomes", {}).get(name)
    if outcome is None or not tag.startswith("J"):
      continue
    params = run.get("params") or _params_of(run["model"])
    tokens = run.get("tokens") or run["base_steps"] * JOB_TOKENS_PER_STEP
    losses = run.get("losses", {})
    gap = (losses[name] / losses["allreduce"] - 1 if name in losses and "allreduce" in losses
           else None)
    if outcome.get("diverged"):
      out.append(Point(params, tokens, None, False, gap, tag))
    elif "steps" in outcome:
      out.append(Point(params, tokens, outcome["steps"] / run["base_steps"], False, gap, tag))
    else:
      out.append(Point(params, tokens, outcome["not_in"] / run["base_steps"], True, gap, tag))
    break  # the newest run that trained it
  return sorted(out + _study(data.get("scaling", []), name), key=lambda p: p.params)


def _study(records: list, name: str) -> list:
  """The scaling study's ``Point``s of entry ``name``, one per size, seeds averaged."""
  baseline = {(r["size"], r["seed"]): r for r in records
              if r["entry"] == r.get("baseline", "allreduce_adamw")}
  by_size: dict = {}
  for r in records:
    base = baseline.get((r["size"], r["seed"]))
    if r["entry"] == name and base is not None:
      by_size.setdefault(r["size"], []).append((r, base))
  out = []
  for size, pairs in by_size.items():
    ratios, bound = [], False
    for r, base in pairs:
      reached, own = r["steps_to_allreduce_loss"], base["steps_to_allreduce_loss"] or base["steps"]
      ratios.append((reached or r["steps"]) / own)
      bound = bound or reached is None
    gaps = [r["heldout_loss"] / r["allreduce_loss"] - 1 for r, _ in pairs]
    r0 = pairs[0][0]
    out.append(Point(r0["params"], pairs[0][1]["tokens"], sum(ratios) / len(ratios), bound,
                     sum(gaps) / len(gaps), f"{r0.get('command', 'the scaling study')}, "
                     f"{r0.get('date', '')}".strip(", "), len(pairs)))
  return out


def trend(found: list) -> Optional[float]:
  """How the gap moves per tenfold of parameters, from the smallest size to the largest (None:
  fewer than two sizes with a gap)."""
  with_gap = [p for p in found if p.gap is not None]
  if len(with_gap) < 2 or with_gap[-1].params == with_gap[0].params:
    return None
  return ((with_gap[-1].gap - with_gap[0].gap)
          / math.log10(with_gap[-1].params / with_gap[0].params))


def best(found: list) -> Optional[Point]:
  """The point the planner ranks by: the largest size measured (None: none)."""
  return found[-1] if found else None
