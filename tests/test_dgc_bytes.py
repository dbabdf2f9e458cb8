"""What a DGC step sends (``comm_report``): k values and k indices per sparsified leaf, in the
value dtype, the dense mean in the warm-up's dense stages, coarse DGC's all-reduced chunks; and
its phases, one per density."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp._src import dgc_config

from helpers import pmapped_update, replicate

pytestmark = pytest.mark.numeric
W = 4


def _step_report(tx, params, world):
  state = replicate(tx.init(params), world)
  grads = jax.tree.map(lambda p: np.zeros((world,) + p.shape, p.dtype), params)
  return jaxcomp.comm_report(pmapped_update(tx, world), grads, state)


def _bytes(report, op, dtype):
  total = 0
  for c in report.collectives:
    if c.op == op:
      scale = c.payload_bytes / max(sum(math.prod(s) * np.dtype(_np(d)).itemsize
                                        for d, s in zip(c.dtypes, c.shapes)), 1)
      total += sum(math.prod(s) * np.dtype(_np(d)).itemsize * scale
                   for d, s in zip(c.dtypes, c.shapes) if d == dtype)
  return int(total)


def _np(hlo_dtype):
  return {"f32": np.float32, "f16": np.float16, "s32": np.int32, "pred": np.bool_}[hlo_dtype]


BYTES_PARAMS = {"w": np.zeros((256, 64), np.float32), "v": np.zeros((40, 50), np.float32),
                "b": np.zeros((64,), np.float32)}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_comm_report_dgc_sends_k_values_and_indices_per_leaf(world):
  ratio = 0.01
  report = _step_report(jaxcomp.dgc(ratio), BYTES_PARAMS, world)
  ks = [math.ceil(16384 * ratio), math.ceil(2000 * ratio)]
  assert _bytes(report, "all-gather", "f32") == sum(world * k * 4 for k in ks)
  assert _bytes(report, "all-gather", "s32") == sum(world * k * 4 for k in ks)
  assert _bytes(report, "all-reduce", "f32") == 64 * 4  # the 1-D leaf only
  assert _bytes(report, "all-reduce", "s32") == 0  # no non-finite flag: the values carry it
  # Without warm-up the step has one phase, the final density; nothing runs outside it.
  assert report.phase_names == ("dgc.density=0.01",)
  assert report.every_step.collectives == ()


def test_comm_report_dgc_sends_values_and_dense_leaves_in_float16_and_indices_in_int32():
  report = _step_report(jaxcomp.dgc(0.01, value_dtype=jnp.float16), BYTES_PARAMS, 4)
  ks = [164, 20]
  assert _bytes(report, "all-gather", "f16") == sum(4 * k * 2 for k in ks)
  assert _bytes(report, "all-gather", "s32") == sum(4 * k * 4 for k in ks)
  assert _bytes(report, "all-reduce", "f16") == 64 * 2


def test_comm_report_warmup_stages_are_phases_and_dense_ones_send_the_mean():
  # W = 8: 0.25 and 0.0625 send at least a dense all-reduce (8·0.0625·2 = 1), 0.015625 does not.
  tx = jaxcomp.dgc(0.001, warmup="paper", steps_per_epoch=10)
  report = _step_report(tx, {"w": np.zeros((256, 64), np.float32)}, 8)
  densities = jaxcomp.PAPER_WARMUP + (0.001,)
  assert report.phase_names == tuple(f"dgc.density={d:g}" for d in densities)
  for density in densities:
    phase = report.phase(f"dgc.density={density:g}")
    k = math.ceil(16384 * density)
    if density >= 0.0625:  # the dense mean of v
      assert _bytes(phase, "all-reduce", "f32") == 16384 * 4
      assert _bytes(phase, "all-gather", "f32") == 0
    else:
      assert _bytes(phase, "all-gather", "f32") == _bytes(phase, "all-gather", "s32") == 8 * k * 4
      assert _bytes(phase, "all-reduce", "f32") == 0
    assert _bytes(phase, "all-reduce", "s32") == 0  # no flag
  # Totals are per step of the steady state: the final density's exchange alone.
  assert report.payload_bytes == 2 * 8 * math.ceil(16384 * 0.001) * 4


@pytest.mark.parametrize("world", [2, 4, 8])
def test_comm_report_coarse_dgc_bytes_do_not_grow_with_world(world):
  report = _step_report(jaxcomp.coarse_dgc(0.05, chunk_size=256), BYTES_PARAMS, world)
  assert not any(c.op == "all-gather" for c in report.collectives)
  # w: 64 chunks -> 64 norms + 4 chunks; v: 8 chunks -> 8 norms + 1 chunk; b dense; no flag.
  expected = (64 + 4 * 256) * 4 + (8 + 256) * 4 + 64 * 4
  assert _bytes(report, "all-reduce", "f32") == expected
  assert report.payload_bytes == expected


def test_phases_are_the_densities_warm_up_first():
  # A density repeated, or equal to ratio, is one phase: the report counts each once.
  config = dgc_config.config(dgc_config.TopKExchange, 0.01,
                            warmup=((2, 0.25), (4, 0.01), (6, 0.25)))
  assert [(p.name, p.share, p.value) for p in config.phases()] == [
      ("dgc.density=0.25", 0.0, 0.25), ("dgc.density=0.01", 1.0, 0.01)]
  assert [int(config.phase_of(jnp.int32(c))) for c in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
