"""Tests run real multi-device programs on 8 simulated CPU devices."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test. XLA:CPU maps memory for every executable it
  keeps, and one process compiling the whole suite's thousands of programs reaches the kernel's limit
  on memory mappings (vm.max_map_count, 65,530 by default), where compiling segfaults; kept per module
  instead, test_bad_input.py alone reached 25,000 mappings."""
  yield
  jax.clear_caches()
  gc.collect()
