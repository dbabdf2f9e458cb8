"""``benchmarks/scaling_quality.py``: its result records (the format the planner reads), resuming
entry by entry, and the report's arithmetic (gaps, the Pareto front, the trend's crossing)."""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import scaling_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"entry", "size", "width", "depth", "seed", "params", "steps", "batch", "tokens",
        "heldout_loss", "evals", "bytes_per_step", "bits_per_device", "allreduce_loss",
        "allreduce_bits_per_device", "steps_to_allreduce_loss", "seconds", "date", "machine",
        "command"}


def record(entry, size, params, loss, bits, seed=0, base=(2.0, 800.0)):
  return {"entry": entry, "size": size, "params": params, "seed": seed, "heldout_loss": loss,
          "bits_per_device": bits, "allreduce_loss": base[0], "allreduce_bits_per_device": base[1],
          "steps": 10, "steps_to_allreduce_loss": None}


def test_the_pareto_front_and_the_trend_of_a_gap():
  assert scaling_report.pareto([(8, 2.0), (1, 2.3), (2, 2.1), (4, 2.2), (16, 2.05)]) == [
      (1, 2.3), (2, 2.1), (8, 2.0)]
  # 4% at 1e4 parameters, 2% at 1e5: 1% half a decade on; a gap that grows never crosses.
  at, slope = scaling_report.crossing([1e4, 1e5], [0.04, 0.02])
  assert at == pytest.approx(10**5.5) and slope == pytest.approx(-0.02)
  assert scaling_report.crossing([1e4, 1e5], [0.02, 0.04])[0] is None


def test_the_findings_name_the_best_frugal_entry_and_the_familys_trend():
  records = [record("allreduce_adamw", "a", 1000, 2.0, 800.0),
             record("muloco", "a", 1000, 2.1, 4.0), record("diloco_maxtext", "a", 1000, 2.08, 80.0),
             record("allreduce_adamw", "b", 4000, 1.5, 800.0, base=(1.5, 800.0)),
             record("muloco", "b", 4000, 1.53, 4.0, base=(1.5, 800.0)),
             record("diloco_maxtext", "b", 4000, 1.5075, 80.0, base=(1.5, 800.0))]
  text = scaling_report.findings(records, ("allreduce_adamw", "muloco", "diloco_maxtext"))
  # diloco_maxtext sends 10x fewer bits: not a candidate; muloco (200x) is, at +2.00%.
  assert ("the best entry at ≥ 100× fewer bytes than allreduce is muloco (200× fewer), +2.00%"
          in text)
  assert "not within 1%" in text
  assert "diloco_maxtext: +4.00% → +0.50% from 1,000 to 4,000 parameters; it shrinks" in text
  assert "muloco: +5.00% → +2.00%" in text and "would reach 1% at about" in text


def test_the_seeds_spread_is_the_other_entries_and_stated_only_once_they_have_several_seeds():
  names = ("allreduce_adamw", "muloco")
  records = [record("allreduce_adamw", "a", 1000, 2.0, 800.0, seed=0),
             record("allreduce_adamw", "a", 1000, 2.02, 800.0, seed=1, base=(2.02, 800.0)),
             record("muloco", "a", 1000, 2.1, 4.0, seed=0)]
  assert "no other entry has run more than one seed yet" in scaling_report.findings(records, names)
  records.append(record("muloco", "a", 1000, 2.2220, 4.0, seed=1, base=(2.02, 800.0)))
  # muloco's gaps +5% and +10%: standard deviation 3.54%, and 1% is 0.3 of them.
  text = scaling_report.findings(records, names)
  assert "median over the entries run with several (1), 3.54%: a gap of 1% there is 0.3 of" in text


@pytest.mark.slow  # trains two tiny sizes end to end, twice
def test_a_quick_study_writes_its_records_and_resumes_where_it_stopped(tmp_path):
  results = tmp_path / "results.jsonl"
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)

  def study(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scaling_quality.py"),
                           "--quick", "--results", str(results), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)

  first = study("--compressors", "allreduce_adamw,muloco")
  assert first.returncode == 0, first.stdout + first.stderr
  records = [json.loads(line) for line in results.read_text().splitlines()]
  assert [(r["size"], r["entry"]) for r in records] == [
      ("16x1", "allreduce_adamw"), ("16x1", "muloco"), ("32x2", "allreduce_adamw"),
      ("32x2", "muloco")]
  for r in records:
    assert set(r) == KEYS
    assert r["tokens"] == r["steps"] * r["batch"] * 64 and r["evals"][-1][0] == r["steps"]
    assert r["heldout_loss"] == r["evals"][-1][1]
  base, muloco = records[2], records[3]
  assert base["allreduce_loss"] == base["heldout_loss"] and base["bits_per_device"] > 0
  assert base["steps_to_allreduce_loss"] == base["steps"]
  assert muloco["allreduce_bits_per_device"] / muloco["bits_per_device"] > 100  # 2 bits, H = 30
  assert "| muloco |" in first.stdout
  # A second run with one more entry trains only that one.
  again = study("--compressors", "allreduce_adamw,muloco,desloc_kx32")
  assert again.returncode == 0, again.stdout + again.stderr
  trained = [line for line in again.stdout.splitlines()
             if re.match(r"\d+x\d+ seed \d+ ", line)]  # "32x2 seed 0 desloc_kx32: ..."
  assert len(trained) == 2 and all("desloc_kx32" in line for line in trained)
  assert len(results.read_text().splitlines()) == 6
