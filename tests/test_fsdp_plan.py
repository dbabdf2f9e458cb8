"""The planner's "Fully sharded" table (``jaxcomp.train.fsdp_plan``): its byte formulas
(``wire.fsdp_messages``, ``wire.zero_messages``) equal to the compiled ``fully_sharded`` and
``sharded_optimizer`` steps' ``comm_report`` at W = 4 and 8, its memory figures equal to the state
each device holds and to the hand formulas at GPT-2 small's shapes, ``--device-gib``'s marks, bad
values refused by ``plan`` (the command line's: ``tests/test_train.py``), and the command printing
the table."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomp
from jaxcomp.train import cli, fsdp_plan, network, planner, shapes, wire

EXCHANGES = {"allreduce": jaxcomp.allreduce, "bf16_compress": jaxcomp.bf16_compress,
             "quantized_int8": lambda: jaxcomp.quantized(8)}


def small_params():
  """Two dense layers and a 0-d scale: a layer of 602 (W = 4) or 301 (W = 8) values a device,
  three 256-value scale blocks or two; leaf sizes no W divides; a bias of 5 values, sharded at
  W = 4 and replicated at W = 8; the 0-d leaf replicated."""
  rng = np.random.default_rng(0)
  return {"dense0": {"w": rng.normal(size=(64, 37)).astype(np.float32),
                     "b": np.zeros(37, np.float32)},
          "dense1": {"w": rng.normal(size=(37, 5)).astype(np.float32),
                     "b": np.zeros(5, np.float32)},
          "scale": np.float32(1.0)}


def loss_fn(p, x, y):
  first = jaxcomp.gather_layer(p["dense0"])
  hidden = jnp.tanh(x @ first["w"] + first["b"])
  second = jaxcomp.gather_layer(p["dense1"])
  out = (hidden @ second["w"] + second["b"]) * jaxcomp.gather_layer(p["scale"])
  return jnp.mean((out - y) ** 2)


def mesh_1d(n):
  return jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def batch():
  rng = np.random.default_rng(1)
  return rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(16, 5)).astype(np.float32)


def by_op(report) -> dict:
  out = {}
  for c in report.collectives:
    out[c.op] = out.get(c.op, 0.0) + c.payload_bytes * c.share
  return out


# One compile each (about a second). bfloat16 is read before optimisation: XLA:CPU widens it.
@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("gather, exchange", [(None, "allreduce"), ("bfloat16", "bf16_compress"),
                                              ("int8", "quantized_int8"),
                                              ("float8_e4m3fn", "quantized_int8")])
def test_fsdp_bytes_equal_the_compiled_step(gather, exchange, world):
  params = small_params()
  fs = jaxcomp.fully_sharded(loss_fn, mesh_1d(world), EXCHANGES[exchange](), optax.adam(1e-3),
                             gather_dtype=gather)
  report = jaxcomp.comm_report(fs.step, fs.make_state(params), *fs.shard(batch()),
                               stage="lowered" if gather == "bfloat16" else "compiled")
  sent = wire.fsdp_messages(params, world, gather, exchange)
  assert wire.bytes_by_op(sent) == by_op(report)  # op by op, to the byte
  assert wire.ring_bytes(sent, world) == pytest.approx(report.ring_bytes, rel=1e-12)
  # The layer of 64x37 + 37 values sends W x its shards (592 + 10 at W = 4) per gather.
  rows = -(-64 * 37 // world) - (-37 // world)
  width = {None: 4, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1}[gather]
  assert sent[0] == wire.Message("all-gather", width * world * rows)


def test_int8_without_error_feedback_sends_the_same_bytes():
  params = small_params()
  fs = jaxcomp.fully_sharded(loss_fn, mesh_1d(8), jaxcomp.quantized(8, error_feedback=False),
                             optax.adam(1e-3), gather_dtype="int8")
  report = jaxcomp.comm_report(fs.step, fs.make_state(params), *fs.shard(batch()))
  assert wire.bytes_by_op(wire.fsdp_messages(params, 8, "int8", "quantized_int8")) == by_op(report)


@pytest.mark.parametrize("world", [4, 8])
def test_zero_bytes_equal_the_compiled_step(world):
  params = small_params()

  def plain_loss(p, x, y):
    hidden = jnp.tanh(x @ p["dense0"]["w"] + p["dense0"]["b"])
    return jnp.mean(((hidden @ p["dense1"]["w"] + p["dense1"]["b"]) * p["scale"] - y) ** 2)

  dp = jaxcomp.data_parallel(plain_loss, mesh_1d(world),
                             tx=jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adam(1e-3)))
  report = jaxcomp.comm_report(dp.step, params, dp.make_state(params), *dp.shard(batch()))
  assert wire.bytes_by_op(wire.zero_messages(params, world)) == by_op(report)


def per_device_bytes(tree) -> int:
  """Float32 bytes of a stacked per-device state on one device (Adam's int32 count left out)."""
  return sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in jax.tree.leaves(tree)
             if x.dtype == jnp.float32)


@pytest.mark.parametrize("world", [4, 8])
def test_fsdp_memory_is_the_state_each_device_holds(world):
  params = small_params()
  for exchange, feedback in (("allreduce", False), ("quantized_int8", True),
                             ("quantized_int8", False)):
    made = (jaxcomp.quantized(8, error_feedback=feedback) if exchange == "quantized_int8"
            else EXCHANGES[exchange]())
    fs = jaxcomp.fully_sharded(loss_fn, mesh_1d(world), made, optax.adam(1e-3))
    state = fs.make_state(params)
    held, kept = fsdp_plan.memory(params, world, "fsdp", exchange, feedback)
    assert held == per_device_bytes((state.params, state.inner))
    counts = sum(4 for x in jax.tree.leaves(state.exchange) if x.dtype == jnp.int32)
    assert kept == per_device_bytes(state.exchange) + counts
  # By hand at W = 4: 12 bytes x (592 + 10 + 47 + 2 shards, the 0-d scale whole); the error
  # feedback 4 x (2,368 + 37 + 185 + 5) and two layers' counts.
  if world == 4:
    assert fsdp_plan.memory(params, 4, "fsdp") == (12 * 652, 0)
    assert fsdp_plan.memory(params, 4, "fsdp", "quantized_int8", True) == (12 * 652,
                                                                          4 * 2595 + 8)


def test_the_tables_memory_at_gpt2_small_is_the_hand_formula():
  result = planner.plan(model="gpt2-small", devices=64, gbits=[25], names=[])
  rows = {r.label: r for r in result.fsdp}
  assert list(rows) == [v[0] for v in fsdp_plan.VARIANTS]
  sizes = [math.prod(x.shape) for x in jax.tree.leaves(shapes.gpt2())]
  n = sum(sizes)
  assert n == 124_439_808 and min(sizes) >= 64  # no leaf replicated at W = 64
  shards = sum(-(-s // 64) for s in sizes)
  assert rows["DDP (allreduce)"].state == 12 * n
  assert rows["ZeRO-1/2 exact"].state == 4 * n + 8 * shards
  counts = 4 * 15  # quantized(8)'s step count per layer: wte, wpe, 12 blocks, ln_f
  feedback = 4 * n + counts  # and its error feedback: the whole float32 gradient
  assert {label: (row.state, row.exchange_state) for label, row in rows.items()
          if label.startswith("FSDP")} == {
              "FSDP exact": (12 * shards, 0), "FSDP bf16 both ways": (12 * shards, 0),
              "FSDP int8 both ways": (12 * shards, feedback),
              "FSDP int8 both ways, no error feedback": (12 * shards, counts),
              "FSDP fp8 gather, int8 scatter": (12 * shards, feedback)}
  # Bytes: the exact gather and scatter move what DDP's all-reduce moves, but for padding.
  ddp, exact = rows["DDP (allreduce)"], rows["FSDP exact"]
  assert exact.sent == pytest.approx(2 * 63 / 64 * 4 * 64 * shards)
  assert ddp.sent == pytest.approx(2 * 63 / 64 * 4 * n)
  assert rows["FSDP bf16 both ways"].vs_bf16 == 1.0 and exact.vs_bf16 == pytest.approx(2.0)
  # A reduce-scatter costed as the all-gather it mirrors: ZeRO-1/2's pair of N bytes by ring takes
  # what a ring all-reduce of N takes, 2(W-1)(α + N/(Wβ)).
  beta, big = network.gbits_to_beta(25), 4 * 64 * shards
  assert rows["ZeRO-1/2 exact"].comm_ms[25]["ring"] == pytest.approx(
      1e3 * 2 * 63 * (network.ALPHA + big / (64 * beta)), rel=1e-12)
  assert "| FSDP exact | 22.3 MiB | 0 | yes | 980.0 MB | 2.00x |" in result.text  # of 80 GiB


def test_device_gib_marks_what_fits():
  result = planner.plan(model="gpt2-small", devices=64, gbits=[25], names=[], device_gib=0.4)
  fits = {r.label: r.fits for r in result.fsdp}
  # DDP 1.39 GiB; ZeRO-1/2 489.5 MiB; FSDP 22.3 MiB, plus 474.7 MiB of error feedback with int8.
  assert fits == {"DDP (allreduce)": False, "ZeRO-1/2 exact": False, "FSDP exact": True,
                  "FSDP bf16 both ways": True, "FSDP int8 both ways": False,
                  "FSDP int8 both ways, no error feedback": True,
                  "FSDP fp8 gather, int8 scatter": False}
  assert "| fits 0.4 GiB |" in result.text
  default = planner.plan(model="gpt2-small", devices=64, gbits=[25], names=[])  # the H100's
  assert default.device_gib == 80 and all(r.fits for r in default.fsdp)


def test_bad_device_gib_is_refused():
  with pytest.raises(ValueError, match="device_gib must be a positive number of GiB"):
    planner.plan(model="gpt2-small", devices=8, gbits=[25], names=[], device_gib=0)
  with pytest.raises(TypeError, match="device_gib must be a number of GiB per device"):
    planner.plan(model="gpt2-small", devices=8, gbits=[25], names=[], device_gib="80")




def test_the_plan_command_prints_the_fully_sharded_table(capsys, tmp_path):
  argv = ["--plan", "--model", "gpt2-small", "--devices", "64", "--gbits", "25,100",
          "--compressors", "allreduce", "--device-gib", "0.4", "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  table = out[out.index("Fully sharded (ZeRO-3 / FSDP"):].splitlines()
  assert "W = 64" in table[0]
  assert table[2].startswith("| way to train (Adam) | params + Adam / device | exchange state / "
                             "device | fits 0.4 GiB | sent/step/device | vs FSDP bf16 | comm/step "
                             "at 25 Gbit/s, ring / tree | comm/step at 100 Gbit/s, ring / tree |")
  for label, *_ in fsdp_plan.VARIANTS:
    assert sum(line.startswith(f"| {label} |") for line in table) == 1, label
  assert "| FSDP int8 both ways | 22.3 MiB | 474.7 MiB | no | 248.8 MB | 0.51x |" in out
  assert "| FSDP exact | 22.3 MiB | 0 | yes | 980.0 MB | 2.00x |" in out
  assert out.count("not measured | not measured |") == 6  # all but DDP, the baseline
  assert "Fully sharded (ZeRO-3 / FSDP" in (tmp_path / "plan.md").read_text()
