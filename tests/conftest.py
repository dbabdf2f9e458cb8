"""Tests run real multi-device programs on 8 simulated CPU devices.

``--max-test-seconds S`` fails the session if any test (setup, call and teardown together) took
longer than S seconds, naming them: the fast tier's per-test limit (``.ci/run``).

The fast tier (``-m "not slow"``, README's test command) spends most of its time compiling, so
where XLA_FLAGS is not set it compiles with LLVM's optimisations off
(``--xla_backend_optimization_level=0``): XLA's optimised HLO — its fusions, collectives and their
order — is the same, only the machine code differs (rounding, which the numeric tests' tolerances
absorb: CI's avx tier reruns them with the optimisations on). Each test process of that tier (and
of the avx tier) also keeps the programs it compiled in a folder of its own (JAX's persistent
cache, removed at the end), so that a program compiled again — the same step in another test, or
after ``jax.clear_caches`` — is read back, not compiled. The tier's 60 slowest tests took 260 s
in two workers, 189 s with the first, 161 s with both. The slow tier trains for many steps, which
such code runs 2–5× slower (``benchmarks/step_time.py --models chars``): it keeps XLA's defaults.
"""

import gc
import os
import shutil
import tempfile

import jax
import pytest

from jaxcomp.train import device_setup

device_setup.simulate_cpu_devices(8)
jax.config.update("jax_platforms", "cpu")

FAST_TIER_XLA_FLAGS = "--xla_backend_optimization_level=0"


def pytest_configure(config):
  # The planner's compiled updates (jaxcomp.train.compute) cached for the session, not the user's.
  plans = tempfile.mkdtemp(prefix="jaxcomp-test-plans-")
  config.add_cleanup(lambda: shutil.rmtree(plans, ignore_errors=True))
  os.environ["JAXCOMP_PLAN_CACHE"] = plans
  # Before any test starts XLA's CPU backend, which reads XLA_FLAGS once.
  fast_tier = config.option.markexpr == "not slow"
  if fast_tier and "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = FAST_TIER_XLA_FLAGS
  os.environ.setdefault("XLA_FLAGS", "")
  if config.option.markexpr.endswith("not slow"):  # the fast tier, and CI's avx rerun of it
    programs = tempfile.mkdtemp(prefix="jaxcomp-test-programs-")
    config.add_cleanup(lambda: shutil.rmtree(programs, ignore_errors=True))
    jax.config.update("jax_compilation_cache_dir", programs)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_durations: dict = {}


def pytest_addoption(parser):
  parser.addoption("--max-test-seconds", type=float, default=None,
                   help="fail the session if a test takes longer than this many seconds")


def pytest_runtest_logreport(report):
  _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
  limit = session.config.getoption("--max-test-seconds")
  over = sorted(((d, n) for n, d in _durations.items() if limit is not None and d > limit),
                reverse=True)
  if over:
    lines = "\n".join(f"  {d:6.1f} s  {n}" for d, n in over)
    session.config.get_terminal_writer().line(
        f"\n{len(over)} test(s) over the per-test limit of {limit:g} s:\n{lines}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _memory_mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux: no such limit to watch
    return 0


# Half of the kernel's default vm.max_map_count (65,530): room for a test's own programs.
MAX_MEMORY_MAPPINGS = 32_000


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Drops JAX's compiled programs after a test once the process maps many memory regions. XLA:CPU
  maps memory for every executable it keeps, and one process compiling the whole suite's thousands
  of programs reaches the kernel's limit on memory mappings (vm.max_map_count, 65,530 by default),
  where compiling segfaults (test_validate.py alone reached 25,000 mappings). Below the threshold,
  tests that compile the same program share it."""
  yield
  if _memory_mappings() > MAX_MEMORY_MAPPINGS:
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def world(request):
  """The number of devices the test's module runs on: its ``W``."""
  return request.module.W


@pytest.fixture
def batch_mesh(world):
  """A 1-D mesh of the first ``world`` devices, its axis 'batch' (the axis the tests' steps
  average over) of type Auto, for ``shard_map`` and ``data_parallel``."""
  return jax.make_mesh((world,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:world])
