"""The devices a run trains on, asked of JAX before it starts its backends.

Small on purpose: the tests, the benchmarks, the docs and the notebooks set up their devices through
it without loading the main job (Flax, matplotlib, scikit-learn). JAX itself is imported where it is
used.
"""

from __future__ import annotations

import os


def simulate_cpu_devices(count: int) -> None:
  """Asks JAX for ``count`` CPU devices, before it starts, each calling LAPACK on one thread.

  XLA:CPU runs the devices' programs side by side on the machine's cores, and each calls LAPACK
  for its QR (PowerSGD above rank 2, Dion). jaxlib's LAPACK is SciPy's OpenBLAS, whose own thread
  pool per call then contends with the other devices: Dion at rank 16 on ``step_time.py``'s MLP
  took 5.4-7.5x allreduce's step on 8 devices with two OpenBLAS threads, 2.8x with one
  (BENCHMARKS.md, Dion).
  ``OPENBLAS_NUM_THREADS`` is read when that library loads (jaxlib loads it at the first LAPACK
  call), so it is set here, unless the environment sets it; a single device keeps the default.

  Raises:
    RuntimeError: JAX has started its backends already (JAX's own error).
  """
  import jax
  if count > 1:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
  jax.config.update("jax_num_cpu_devices", count)


def setup_devices(count: int) -> list:
  """Asks JAX for ``count`` CPU devices (``simulate_cpu_devices``, unless JAX has started) and
  returns the first ``count`` devices.

  Raises:
    RuntimeError: when fewer than ``count`` devices are available.
  """
  import jax
  try:
    simulate_cpu_devices(count)
  except RuntimeError:
    pass  # JAX has already started (a notebook, a test): use the devices it has.
  devices = jax.devices()
  if len(devices) < count:
    raise RuntimeError(f"--devices {count}: only {len(devices)} {devices[0].platform} devices are "
                       "available")
  return devices[:count]
