"""phases: the labelled branches of a step (``switch``, ``cond``, ``when``), as ``comm_report``
reads them back: each phase's collectives apart, named after the transformation that owns them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxcomp
from jaxcomp._src import phases


def test_each_phase_is_reported_under_its_transformation_s_name_and_a_single_one_unswitched():
  """A phase is named by the transformation that makes it ("x.warmup"); the label carries the
  name and the share. A single phase runs without a switch, still labelled."""
  warm, steady = phases.Phase("x.warmup", 0.0), phases.Phase("x.steady", 1.0)
  only, sync = phases.Phase("inner.only", 1.0), phases.Phase("sync", 0.25)

  def step(x, count):
    y = phases.switch((count > 3).astype(jnp.int32), [warm, steady],
                      [lambda v: lax.psum(v, "d"), lambda v: lax.pmax(v, "d")], x)
    z = phases.switch(count, [only], [lambda v: lax.pmin(v, "d")], x)
    return y, z, phases.cond(count % 4 == 0, sync, lambda v: lax.psum(2 * v, "d"), lambda v: v, x)

  f = jax.pmap(step, axis_name="d", devices=jax.devices()[:4])
  x = jnp.arange(12.0).reshape(4, 3)
  for count, (y, z, w) in [(0, (x.sum(0), x.min(0), 2 * x.sum(0))), (5, (x.max(0), x.min(0), x))]:
    out = jax.block_until_ready(f(x, jnp.full(4, count, jnp.int32)))
    for got, expected in zip(out, (y, z, w)):
      np.testing.assert_array_equal(got, np.broadcast_to(expected, (4, 3)))
  assert phases.label(only) == "jaxcomp_phase[inner.only|1.0]"
  report = jaxcomp.comm_report(f, x, jnp.zeros(4, jnp.int32))
  assert set(report.phase_names) == {"x.warmup", "x.steady", "inner.only", "sync"}
  by_phase = {c.phase: c for c in report.collectives}
  assert by_phase["x.warmup"].in_conditional and by_phase["x.warmup"].share == 0.0
  assert not by_phase["inner.only"].in_conditional and by_phase["inner.only"].share == 1.0
  assert by_phase["sync"].in_conditional and by_phase["sync"].share == 0.25


def test_nested_phases_multiply_their_shares_and_parse_reads_them_outermost_first():
  outer, inner = phases.Phase("y.sync", 0.5), phases.Phase("y.half", 0.5)

  def step(x, n):
    return phases.cond(n > 0, outer,
                       lambda v: phases.cond(n > 1, inner, lambda u: lax.psum(u, "d"),
                                             lambda u: u, v),
                       lambda v: v, x)

  f = jax.pmap(step, axis_name="d", devices=jax.devices()[:4])
  x = jnp.arange(8.0).reshape(4, 2)
  for n, expected in [(0, x), (1, x), (2, jnp.broadcast_to(x.sum(0), (4, 2)))]:
    np.testing.assert_array_equal(jax.block_until_ready(f(x, jnp.full(4, n, jnp.int32))), expected)
  (collective,) = jaxcomp.comm_report(f, x, jnp.ones(4, jnp.int32)).collectives
  assert collective.phases == (("y.sync", 0.5), ("y.half", 0.5))
  assert collective.phase == "y.sync/y.half" and collective.share == 0.25
  # An op_name may repeat a label (XLA moving an instruction out of a nested computation): once.
  rare = phases.Phase("rare", 1e-5)
  op_name = f"jit(step)/{phases.label(outer)}/cond/{phases.label(rare)}/{phases.label(outer)}/add"
  assert phases.parse(op_name) == (("y.sync", 0.5), ("rare", 1e-5))
  assert phases.parse("jit(step)/jaxcomp_when/while/body/add") == ()


@pytest.mark.parametrize("stage", ["compiled", "lowered"])
def test_when_runs_its_branch_once_or_never_and_is_reported_as_a_conditional(stage):
  sync = phases.Phase("demo.sync", 0.5)
  f = jax.pmap(lambda x, n: phases.when(n > 0, sync, lambda v: lax.psum(v, "d") + 1, x),
               axis_name="d", devices=jax.devices()[:2])
  x = jnp.arange(6.0).reshape(2, 3)
  assert (f(x, jnp.zeros(2, jnp.int32)) == x).all()
  assert (f(x, jnp.ones(2, jnp.int32)) == x.sum(0) + 1).all()
  report = jaxcomp.comm_report(f, x, jnp.ones(2, jnp.int32), stage=stage)
  assert [(c.in_conditional, c.in_loop, c.phase, c.share) for c in report.collectives] == [
      (True, False, "demo.sync", 0.5)]


def test_when_sends_nothing_on_the_steps_it_skips_even_from_operands_it_leaves_as_they_are():
  """XLA hoists what a loop's body computes from values the loop leaves unchanged out of the loop,
  collectives included, where they would run on every step: ``when`` must keep its branch's
  all-reduces inside (they were hoisted, merged into one, before its operands passed a barrier
  with the loop's counter)."""
  sync = phases.Phase("demo.sync", 0.5)

  def send(received, pending):  # averages ``pending``, which it leaves as it is
    return lax.psum(pending, "d"), pending

  def step(n, received, pending):
    received, _ = phases.when(n == 0, sync, send, received, pending)
    return phases.when(n == 1, sync, send, received, 2 * pending)[0]

  f = jax.pmap(step, axis_name="d", devices=jax.devices()[:2])
  x, zeros, n = jnp.arange(6.0).reshape(2, 3), jnp.zeros((2, 3)), jnp.full(2, 2, jnp.int32)
  assert (f(n, zeros, x) == 0).all()
  assert (f(n - 2, zeros, x) == x.sum(0)).all()
  report = jaxcomp.comm_report(f, n, zeros, x)
  assert [(c.op, c.in_conditional, c.phase) for c in report.collectives] == [
      ("all-reduce", True, "demo.sync")] * 2


def test_when_updates_a_donated_state_in_place_where_cond_copies_it():
  """Why ``phases.when`` exists: a conditional's results have buffers of their own, so a donated
  state that its branch reads and rewrites around a collective (DiLoCo's outer step: the averaged
  drift, the momentum, θ) needs a second copy; a loop carries it in place."""
  sync = phases.Phase("demo.sync", 0.5)

  def outer_step(local, theta, momentum):
    drift = lax.pmean(theta - local, "d")
    momentum = 0.9 * momentum + drift
    theta = theta - (drift + 0.9 * momentum)
    return theta, theta, momentum

  by_cond = lambda n, *s: phases.cond(n > 0, sync, outer_step, lambda *o: o, *s)  # noqa: E731
  by_when = lambda n, *s: phases.when(n > 0, sync, outer_step, *s)  # noqa: E731
  state = jax.ShapeDtypeStruct((2, 1 << 18), jnp.float32)  # 1 MiB per device and array
  temp = {name: jax.pmap(fn, axis_name="d", devices=jax.devices()[:2], donate_argnums=(1, 2, 3))
          .lower(jax.ShapeDtypeStruct((2,), jnp.int32), state, state, state).compile()
          .memory_analysis().temp_size_in_bytes
          for name, fn in {"cond": by_cond, "when": by_when}.items()}
  assert temp["cond"] >= 2 << 20 > temp["when"] + (1 << 20) // 2

