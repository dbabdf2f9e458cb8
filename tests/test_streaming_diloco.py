"""``streaming_diloco``: the algorithm in NumPy step for step (fragments, staggering, delay, mixing,
outer Nesterov), its reduction to ``diloco``, what each step of a period sends, that the exchange
reads the state only, non-finite steps, an orbax resume in the middle of an exchange, and
``data_parallel`` against ``pmap``."""

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType

import jaxcomp
from helpers import assert_identical_across_devices, pmapped, replicate, rounding_tol
from training import pmap_step, run
from jaxcomp import StreamingDiLoCoConfig

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W, LR, MOMENTUM = 4, 0.05, 0.9
H, P = 6, 2  # fragment 0 begins after steps 2, 8, …; fragment 1 after 5, 11, … (torchft's offsets)
LAYERS = ("layer0", "layer1")  # fragment_layout's fragments here: each layer's bias and kernel


def init_params():
  rng = np.random.default_rng(0)
  return {"layer0": {"bias": np.zeros(3, np.float32),
                     "kernel": rng.normal(0, 0.5, (5, 3)).astype(np.float32)},
          "layer1": {"bias": np.zeros(4, np.float32),
                     "kernel": rng.normal(0, 0.5, (3, 4)).astype(np.float32)}}


def loss_fn(params, x, y):
  hidden = jnp.tanh(x @ params["layer0"]["kernel"] + params["layer0"]["bias"])
  return jnp.mean((hidden @ params["layer1"]["kernel"] + params["layer1"]["bias"] - y) ** 2)


def numpy_grad(params, x, y):
  hidden = np.tanh(x @ params["layer0"]["kernel"] + params["layer0"]["bias"])
  d_out = 2 * (hidden @ params["layer1"]["kernel"] + params["layer1"]["bias"] - y) / y.size
  d_pre = d_out @ params["layer1"]["kernel"].T * (1 - hidden**2)
  return {"layer0": {"bias": d_pre.sum(0), "kernel": x.T @ d_pre},
          "layer1": {"bias": d_out.sum(0), "kernel": hidden.T @ d_out}}


def batch(step):
  """Each device's own data at every step."""
  rng = np.random.default_rng(100 + step)
  return (rng.normal(size=(W, 6, 5)).astype(np.float32),
          rng.normal(size=(W, 6, 4)).astype(np.float32))


def make(delay=2, mix=0.5, compressor=None, inner=None, fragments=P):
  return jaxcomp.streaming_diloco(inner or optax.sgd(LR, momentum=MOMENTUM), sync_every=H,
                                  fragments=fragments, delay=delay, mix=mix,
                                  compressor=compressor)


def reference(steps, delay, mix, skip=(), outer_lr=0.7, outer_momentum=0.9):
  """Streaming DiLoCo in float64, from the paper and torchft's schedule: SGD with momentum on each
  device's own gradient (device d skips step t for (t, d) in ``skip``: its parameters and momentum
  stay); fragment p (the layer ``LAYERS[p]``) begins an exchange after the steps t ≥ o_p − 1 with
  (t + 1 − o_p) % H == 0, o_p = ⌊(p + 1)·H/P⌋, taking Δᵢ = θ_p − θᵢ_p; ``delay`` steps later its
  outer Nesterov step θ_p ← θ_p − η·(mean Δ + μ·m) with m ← μ·m + mean Δ lands, and every device
  mixes θᵢ_p ← mix·θ_p + (1 − mix)·θᵢ_p. Returns the parameters after every step (stacked over
  devices) and θ."""
  theta = jax.tree.map(np.float64, init_params())
  params = [jax.tree.map(np.copy, theta) for _ in range(W)]
  momenta = [jax.tree.map(np.zeros_like, theta) for _ in range(W)]
  outer_momentum_buffer = jax.tree.map(np.zeros_like, theta)
  pending = {}
  history, thetas = [], []
  for t in range(steps):
    x, y = batch(t)
    for i in range(W):
      if (t, i) in skip:
        continue
      g = numpy_grad(params[i], x[i].astype(np.float64), y[i])
      momenta[i] = jax.tree.map(lambda m, g: g + MOMENTUM * m, momenta[i], g)
      params[i] = jax.tree.map(lambda p, m: p - LR * m, params[i], momenta[i])
    for p, layer in enumerate(LAYERS):
      begin = (p + 1) * H // P - 1
      if t >= begin and (t - begin) % H == 0:
        pending[layer] = [jax.tree.map(np.subtract, theta[layer], params[i][layer])
                          for i in range(W)]
      if t >= begin + delay and (t - begin - delay) % H == 0:
        mean = jax.tree.map(lambda *d: np.mean(d, 0), *pending[layer])
        outer_momentum_buffer[layer] = jax.tree.map(lambda m, d: outer_momentum * m + d,
                                                    outer_momentum_buffer[layer], mean)
        theta[layer] = jax.tree.map(lambda th, d, m: th - outer_lr * (d + outer_momentum * m),
                                    theta[layer], mean, outer_momentum_buffer[layer])
        for i in range(W):
          params[i][layer] = jax.tree.map(lambda th, q: mix * th + (1 - mix) * q, theta[layer],
                                          params[i][layer])
    history.append(jax.tree.map(lambda *q: np.stack(q), *params))
    thetas.append(jax.tree.map(np.copy, theta))
  return history, thetas


@functools.lru_cache(maxsize=2)
def compiled_step(tx):
  """The pmapped step of ``tx`` on this file's regression (``training.pmap_step``, a per-device
  value added to the gradient), compiled once per test."""
  return pmap_step(loss_fn, tx, W, poisoned=True, returns=None)


def pmap_run(tx, steps, poison_at=(), params=None, state=None, first=0):
  """``steps`` pmapped steps from step ``first`` (``training.run``; ``poison_at``: its ``(step,
  device, value)`` triples). Returns the parameters and the state after every step."""
  params = replicate(init_params(), W) if params is None else params
  state = replicate(tx.init(init_params()), W) if state is None else state
  return run(compiled_step(tx), params, state, steps, first, poison_at, W,
             batch=lambda t, n: batch(t))[2]


def identical(tree) -> bool:
  return all(np.array_equal(np.asarray(x)[d], np.asarray(x)[0])
             for x in jax.tree.leaves(tree) for d in range(1, W))


# ------------------------------------------------------------------------------- the algorithm


@pytest.mark.parametrize("delay, mix, poison", [
    (2, 0.5, None),
    (2, 1.0, ((3, 1, np.nan),)),  # device 1's gradient at step 3, during fragment 0's exchange
    (0, 0.5, None),
])
def test_matches_numpy_over_two_periods_and_each_fragment_lands_alike_on_every_device(
    delay, mix, poison):
  steps = 2 * H + delay  # two outer steps of each fragment
  tx = make(delay, mix)
  expected, thetas = reference(steps, delay, mix, skip={(3, 1)} if poison else ())
  config = tx.init(init_params()).config
  history = pmap_run(tx, steps, poison or ())
  for t, ((got, state), want, theta) in enumerate(zip(history, expected, thetas)):
    # float32 against float64: a few roundings per step, compounded by the momenta.
    chex.assert_trees_all_close(got, want, **rounding_tol(4 * (t + 1)))
    assert_identical_across_devices(state.outer_params)  # θ: the same everywhere, always
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], state.outer_params),
                                tuple(jax.tree.leaves(theta)), **rounding_tol(4 * (t + 1)))
    for p, layer in enumerate(LAYERS):
      # Right after its outer step a fragment is bitwise the same on every device if the
      # synchronized value replaces the local one; mixed, or between outer steps, it differs.
      assert identical(got[layer]) == bool(config.applies_after(p, t) and mix == 1), (t, layer)
  if poison:  # device 1 kept its parameters at step 3, in the middle of an exchange
    (before, _), (hit, _) = history[2], history[3]
    for b, h in zip(jax.tree.leaves(before), jax.tree.leaves(hit)):
      np.testing.assert_array_equal(np.asarray(h)[1], np.asarray(b)[1])
      assert not np.array_equal(np.asarray(h)[0], np.asarray(b)[0])


@pytest.mark.parametrize("compressor", [None, "powersgd"])
def test_one_fragment_without_delay_and_mixing_is_diloco_bit_for_bit(compressor):
  make_compressor = lambda: (None if compressor is None else  # noqa: E731
                             jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0))
  inner = optax.adam(0.01)
  streaming = make(delay=0, mix=1.0, compressor=make_compressor(), inner=inner, fragments=1)
  plain = jaxcomp.diloco(inner, sync_every=H, compressor=make_compressor())
  for (got, state), (want, plain_state) in zip(pmap_run(streaming, 2 * H),
                                               pmap_run(plain, 2 * H)):
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal(state.outer_params, plain_state.outer_params)
  if compressor:  # PowerSGD's error feedback persists across outer steps, as in diloco
    chex.assert_trees_all_equal(state.compressor_states[0][0], plain_state.compressor_state)
    assert max(np.abs(e).max() for e in jax.tree.leaves(plain_state.compressor_state.error)) > 0


def test_full_rank_powersgd_on_row_pieces_is_the_exact_mean():
  """A piece holds rows of each leaf; PowerSGD of full rank on those blocks is their mean."""
  full_rank = jaxcomp.powersgd(8, start_iter=0, min_compression_rate=0.0)
  exact = pmap_run(make(), 2 * H)
  for (got, _), (want, _) in zip(pmap_run(make(compressor=full_rank), 2 * H), exact):
    chex.assert_trees_all_close(got, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ what it sends

EQUAL_LEAVES = {f"w{k}": np.ones((64, 64), np.float32) for k in range(8)}  # P = 4: 2 per fragment


def report(tx, params):
  step = pmapped(lambda p, s, g: tx.update(g, s, p), W)
  return jaxcomp.comm_report(step, replicate(params, W), replicate(tx.init(params), W),
                             replicate(params, W), num_devices=W)


def bytes_per_step(tx, params, rep) -> list:
  """What each step of one steady-state period sends (ring bytes per device), phase by phase."""
  config = tx.init(params).config
  period = range(config.sync_every, 2 * config.sync_every)
  names = set(rep.phase_names)
  sent = []
  for t in period:
    total = 0.0
    for p in range(config.fragments):
      piece = int(config.piece_sent_in(p, t))
      name = (f"streaming_diloco.fragment{p}.piece{piece}" if piece >= 0 else
              f"streaming_diloco.fragment{p}" if config.applies_after(p, t) else None)
      if name in names:
        total += rep.phase(name).ring_bytes
    sent.append(total)
  return sent


def test_each_step_of_a_period_sends_at_most_a_pth_of_dilocos_sync():
  """DiLoCo sends all parameters in one step of every H; Streaming DiLoCo sends one fragment
  (τ = 0) or one piece of one (τ = 2) on the steps of its staggered exchanges, the same bytes per
  period, and nothing that runs on every step."""
  sync_every, fragments = 16, 4
  diloco = report(jaxcomp.diloco(optax.sgd(LR), sync_every=sync_every), EQUAL_LEAVES)
  whole = diloco.phase("diloco.sync").ring_bytes
  print(f"\ndiloco: {whole:,.0f} B in one step of {sync_every}")
  for delay, compressor in ((0, None), (2, None), (2, jaxcomp.quantized(8, error_feedback=False))):
    tx = jaxcomp.streaming_diloco(optax.sgd(LR), sync_every=sync_every, fragments=fragments,
                                  delay=delay, compressor=compressor)
    rep = report(tx, EQUAL_LEAVES)
    sent = bytes_per_step(tx, EQUAL_LEAVES, rep)
    print(f"streaming, P={fragments}, τ={delay}, {'int8' if compressor else 'f32'}: "
          + " ".join(f"{b:,.0f}" for b in sent))
    assert not rep.every_step.collectives  # all traffic sits in the exchanges' phases
    assert max(sent) <= 1.1 * whole / fragments
    assert sum(sent) == pytest.approx(rep.ring_bytes * sync_every)  # the report amortises alike
    assert sum(b > 0 for b in sent) == fragments * max(delay, 1)
    if compressor is None:  # the pieces partition the parameters: DiLoCo's bytes per period
      assert max(sent) == pytest.approx(whole / fragments / max(delay, 1))
      assert rep.ring_bytes == pytest.approx(diloco.ring_bytes)
    else:  # 8-bit codes and a scale per 256 both ways: under a third of the float32 piece
      assert max(sent) < whole / fragments / delay / 3


def _holds_collective(eqn) -> bool:
  names = ("psum", "all_gather", "all_to_all", "reduce_scatter", "ppermute")
  if any(n in eqn.primitive.name for n in names):
    return True
  return any(_holds_collective(inner) for sub in jax.extend.core.jaxprs_in_params(eqn.params)
             for inner in sub.eqns)


def _collectives_read_the_gradient(tx) -> list:
  """For each top-level equation of ``tx.update`` that holds a collective: whether any of its
  inputs is computed from the gradient (a branch runs after everything its operands need)."""
  params = init_params()
  jaxpr = jax.make_jaxpr(tx.update, axis_env=[("batch", W)])(params, tx.init(params), params)
  from_gradient = set(jaxpr.jaxpr.invars[:len(jax.tree.leaves(params))])
  reads = []
  for eqn in jaxpr.jaxpr.eqns:
    inputs = {v for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
    if inputs & from_gradient:
      from_gradient |= set(eqn.outvars)
    if _holds_collective(eqn):
      reads.append(bool(inputs & from_gradient))
  return reads


def test_with_delay_every_collective_reads_the_state_only():
  """With τ > 0 a piece's exchange needs nothing this step computes, so XLA may run it alongside
  the forward and backward pass; without delay the exchange waits for the inner step."""
  reads = _collectives_read_the_gradient(make(delay=2, compressor=jaxcomp.quantized(8)))
  assert len(reads) == 2 * P and not any(reads)  # one exchange per piece of each fragment
  assert _collectives_read_the_gradient(make(delay=0)) == [True] * P


# -------------------------------------------------------------------- non-finite, resume, mesh


def test_a_non_finite_outer_step_keeps_theta_and_its_momentum():
  """As DiLoCo: if a fragment's new θ is not finite (the mean overflowed), θ and the outer state are
  kept, and the devices mix the kept θ into their parameters."""
  tx = make(delay=2, mix=0.5)
  params, state = pmap_run(tx, 4)[-1]  # fragment 0 began after step 2 and lands after step 4
  received = list(state.received)
  received[0] = jax.tree.map(lambda x: np.full_like(x, np.inf), received[0])
  ((hit, kept),) = pmap_run(tx, 1, params=params, state=state._replace(received=tuple(received)),
                            first=4)
  ((clean, landed),) = pmap_run(tx, 1, params=params, state=state, first=4)
  chex.assert_trees_all_equal(kept.outer_params, state.outer_params)
  chex.assert_trees_all_equal(kept.outer_states, state.outer_states)
  assert not np.array_equal(landed.outer_params[1], state.outer_params[1])  # it would have moved
  # Both mixed the same local parameters: θᵢ = 2·(½·θ + ½·θᵢ) − θ, with the kept or the new θ.
  for k, leaf in enumerate(("bias", "kernel")):
    local_hit = 2 * np.asarray(hit["layer0"][leaf]) - np.asarray(kept.outer_params[k])
    local_clean = 2 * np.asarray(clean["layer0"][leaf]) - np.asarray(landed.outer_params[k])
    np.testing.assert_allclose(local_hit, local_clean, **rounding_tol(4, scale=2.0))
  assert not identical(hit["layer0"])


def test_orbax_resume_in_the_middle_of_an_exchange_is_bit_identical(tmp_path):
  tx = make(delay=2, compressor=jaxcomp.quantized(8), inner=optax.adam(0.01))
  full_params, full_state = pmap_run(tx, 2 * H)[-1]
  params, state = pmap_run(tx, 4)[-1]  # fragment 0's first piece has arrived, its second has not
  assert np.abs(np.asarray(jax.tree.leaves(state.pending[0])[0])).max() > 0
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", jax.device_get({"params": params, "state": state}))
  checkpointer.wait_until_finished()
  target = jax.tree.map(jnp.zeros_like, {"params": params, "state": state})
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  params, state = pmap_run(tx, 2 * H - 4, params=restored["params"], state=restored["state"],
                           first=4)[-1]
  chex.assert_trees_all_equal(params, full_params)
  chex.assert_trees_all_equal(state, full_state)


def test_data_parallel_loss_form_keeps_the_parameters_per_device_and_matches_pmap():
  tx = make(delay=2, mix=1.0)
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:W])
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  params, opt_state = dp.make_params(init_params()), dp.make_state(init_params())
  config = opt_state.config
  for t, (want, _) in enumerate(pmap_run(tx, 2 * H)):
    x, y = batch(t)
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x.reshape(-1, 5),
                                                                    y.reshape(-1, 4))))
    jax.block_until_ready(loss)
    assert tuple(params["layer0"]["kernel"].sharding.spec)[:1] == ("batch",)
    # Two compiled programs: equal to float32 rounding.
    chex.assert_trees_all_close(params, want, **rounding_tol(4 * (t + 1)))
    for p, layer in enumerate(LAYERS):
      assert identical(params[layer]) == bool(config.applies_after(p, t)), (t, layer)


@pytest.mark.parametrize("delay, compressor", [(0, "fp16"), (2, "int8")])
def test_any_pytree_scalars_mixed_dtypes_and_leaves_not_reduced(delay, compressor):
  """A 0-d leaf travels whole or as one row; float16 and bfloat16 keep their dtypes; integer and
  zero-size leaves are in no fragment and stay as they were."""
  params = {"a": np.float32(0.5), "b": np.ones(2, np.float16), "c": np.ones((3, 3), np.float32),
            "d": np.arange(2, dtype=np.int32), "e": np.zeros((0,), np.float32),
            "f": np.ones((4, 2), jnp.bfloat16)}
  tx = jaxcomp.streaming_diloco(
      optax.sgd(0.01), sync_every=6, fragments=2, delay=delay, mix=1.0,
      compressor=jaxcomp.fp16_compress() if compressor == "fp16" else jaxcomp.quantized(8))
  config = tx.init(params).config
  assert tx.init(params).layout == ((0, 1, 2), (5,))  # a, b with the kernel after them, c; f

  def step(params, state, x):
    grads = {k: (v * x).astype(v.dtype) if k != "d" else v for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  pstep = pmapped(step, W)
  params_w, state = replicate(params, W), replicate(tx.init(params), W)
  for t in range(8):
    params_w, state = jax.block_until_ready(pstep(params_w, state, np.arange(1.0, W + 1)))
    for key, value in params_w.items():
      assert value.dtype == np.asarray(params[key]).dtype and value.shape == (W,) + np.shape(
          params[key])
      assert np.isfinite(np.asarray(value, np.float32)).all()
    np.testing.assert_array_equal(params_w["d"], np.stack([params["d"]] * W))
    if config.applies_after(0, t):
      assert identical({k: params_w[k] for k in "abc"}) and not identical(params_w["f"]), t


# ------------------------------------------------------------------------ settings and layout


def test_fragments_are_strided_by_layer_with_each_bias_beside_its_kernel():
  params = {f"Dense_{k}": {"bias": np.zeros(4, np.float32), "kernel": np.zeros((4, 4), np.float32)}
            for k in range(5)}
  params["LayerNorm_0"] = {"bias": np.zeros(4, np.float32), "scale": np.ones(4, np.float32)}
  params["step"] = np.zeros((), np.int32)  # not reduced: in no fragment
  signature = jaxcomp.TreeSignature.of(params)
  # Leaves: Dense_0..4 (bias, kernel) = 0..9, LayerNorm_0 (bias, scale) = 10, 11, step = 12; the
  # norm follows the last kernel (no kernel after it).
  assert jaxcomp.fragment_layout(signature, 2) == ((0, 1, 4, 5, 8, 9, 10, 11), (2, 3, 6, 7))
  assert jaxcomp.fragment_layout(signature, 5)[4] == (8, 9, 10, 11)
  assert jaxcomp.fragment_layout(signature, 6)[5] == ()  # more fragments than kernels
  vectors = jaxcomp.TreeSignature.of([np.zeros(3, np.float32)] * 3)
  assert jaxcomp.fragment_layout(vectors, 2) == ((0, 2), (1,))


def test_schedule_follows_torchfts_offsets():
  config = StreamingDiLoCoConfig(optax.sgd(0.1), sync_every=10, fragments=3, delay=2)
  # Fragment p begins after steps ⌊(p + 1)·10/3⌋ − 1 + 10k: 2, 5, 9; lands 2 steps later.
  begins = [[t for t in range(30) if config.starts_after(p, t)] for p in range(3)]
  assert begins == [[2, 12, 22], [5, 15, 25], [9, 19, 29]]
  lands = [[t for t in range(30) if config.applies_after(p, t)] for p in range(3)]
  assert lands == [[4, 14, 24], [7, 17, 27], [11, 21]]
  assert [int(config.piece_sent_in(2, t)) for t in range(9, 13)] == [-1, 0, 1, -1]
  assert [int(config.piece_sent_in(2, t)) for t in range(0, 2)] == [-1, -1]  # nothing began yet
  assert not any(config.syncs_after(t) for t in range(30))
  # The state knows the pytree: every device agrees on all parameters only where one fragment holds
  # them all and its outer step replaces the local values.
  one_layer = {"b": np.zeros(3, np.float32), "w": np.zeros((3, 3), np.float32)}
  state = lambda params, mix: jaxcomp.streaming_diloco(  # noqa: E731
      optax.sgd(LR), sync_every=6, fragments=2, delay=1, mix=mix).init(params)
  with pytest.warns(UserWarning, match=r"fragments=2 but the parameters have only 1 leaves to deal "
                                     r".*fragment 1 holds nothing.*Use fragments=1 or fewer"):
    state(one_layer, 1.0)  # one kernel: the second fragment holds nothing
  single = lambda mix: jaxcomp.streaming_diloco(  # noqa: E731
      optax.sgd(LR), sync_every=6, fragments=1, delay=1, mix=mix).init(one_layer)
  assert [t for t in range(12) if single(1.0).syncs_after(t)] == [6]
  assert not any(single(0.5).syncs_after(t) for t in range(12))
  assert not any(state(init_params(), 1.0).syncs_after(t) for t in range(12))
  assert state({"step": np.int32(0)}, 0.5).syncs_after(0)


@pytest.mark.parametrize("settings, error, message", [
    (dict(fragments=7), ValueError, r"fragments must be at most sync_every \(6\).*got 7"),
    (dict(fragments=0), ValueError, r"fragments must be a positive int; got 0"),
    (dict(fragments=2.0), TypeError, r"fragments must be a positive int; got 2.0 \(float\)"),
    (dict(fragments=2, delay=3), ValueError,
     r"delay must be less than sync_every // fragments = 3.*got 3. Lower delay, or raise"),
    (dict(delay=-1), ValueError, r"delay must be a non-negative int; got -1"),
    (dict(mix=0.0), ValueError, r"mix must be a number in \(0, 1\]; got 0.0"),
    (dict(mix="half"), TypeError, r"mix must be a number in \(0, 1\]; got 'half' \(str\)"),
    (dict(fragments=np.int32(2) + jnp.zeros([], jnp.int32)), TypeError,
     r"fragments is static.*static_args=\(.*'fragments'.*\)"),
])
def test_bad_settings_are_refused_with_the_fix(settings, error, message):
  with pytest.raises(error, match=message):
    jaxcomp.streaming_diloco(optax.sgd(LR), sync_every=H, **{"fragments": 1, **settings})
