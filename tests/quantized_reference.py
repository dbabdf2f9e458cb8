"""The NumPy reference of ``jaxcomp.quantized``'s two-phase exchange, written from its definition
(the module docstring of ``jaxcomp._src.quantized``): blocks of ``block_size`` values,
``scale = max|x| · (1/Q)``, codes rounded to the nearest (half to even for int8, float8's own
rounding for fp8, the nearest level of a table with ties to the even index), the owner's mean of
the W dequantized copies (each ÷W, summed in device order) plus its server error, re-quantized and
gathered; a table's codes as sign–magnitude fields packed into bytes, least significant first."""

import jax
import ml_dtypes
import numpy as np

from jaxcomp._src import exchange
from jaxcomp._src import quantized as quantized_lib

TABLES = {4: (0, 1, 2, 3, 4, 5, 6, 7), 2: (0, 1), "e2m1": (0, 0.5, 1, 1.5, 2, 3, 4, 6),
          "e3m0": (0, 1, 2, 4, 8, 16, 32, 64)}
"""The narrow codes' magnitudes (E2M1: the OCP MX element's; E3M0: 0 and the powers of two)."""
LEVELS = {8: 127, "fp8": 448, **{bits: levels[-1] for bits, levels in TABLES.items()}}
WIDTH = {8: 8, "fp8": 8, 4: 4, "e2m1": 4, "e3m0": 4, 2: 2}


def table_fields(y, bits):
  """Sign–magnitude fields of ``y`` (|y| ≤ Q): the nearest level's index, ties to the even one."""
  levels = np.asarray(TABLES[bits], np.float64)
  distance = np.abs(np.abs(y)[..., None].astype(np.float64) - levels)
  nearest = distance.min(-1, keepdims=True)
  candidates = np.where(distance == nearest, np.arange(len(levels)), len(levels))
  even = np.where(candidates % 2 == 0, candidates, len(levels)).min(-1)
  index = np.where(even < len(levels), even, candidates.min(-1))
  negative = (y < 0) & (index > 0)
  return (index | negative.astype(np.int64) << (WIDTH[bits] - 1)).astype(np.uint8)


def table_values(fields, bits):
  b = WIDTH[bits]
  magnitude = np.asarray(TABLES[bits], np.float32)[fields & ((1 << (b - 1)) - 1)]
  return np.where(fields >> (b - 1) == 1, -magnitude, magnitude)


def pack(fields, bits):
  """The fields of each row as bytes, ``8 / width`` to a byte, least significant first."""
  b = WIDTH[bits]
  bits_ = (fields[..., None] >> np.arange(b)) & 1
  return np.packbits(bits_.reshape(fields.shape[:-1] + (-1,)).astype(np.uint8), axis=-1,
                     bitorder="little")


def ref_quantize(x, block, bits):
  """Codes (as sent: packed for a table), scales and dequantized values of each row of ``x``."""
  rows, length = x.shape
  blocks = x.reshape(rows, length // block, block)
  levels = np.float32(LEVELS[bits])
  scales = np.abs(blocks).max(-1) * np.float32(1 / LEVELS[bits])
  safe = np.where(scales > 0, scales, np.float32(1))[..., None]
  y = np.where(scales[..., None] > 0, np.clip(blocks / safe, -levels, levels), np.float32(0))
  if bits in TABLES:
    fields = table_fields(y, bits)
    decoded = table_values(fields, bits) * scales[..., None]
    return pack(fields.reshape(rows, length), bits), scales, decoded.reshape(rows, length)
  codes = np.round(y).astype(np.int8) if bits == 8 else y.astype(np.float32).astype(
      ml_dtypes.float8_e4m3fn)
  decoded = codes.astype(np.float32) * scales[..., None]
  return codes.reshape(rows, length), scales, decoded.reshape(rows, length)


def ref_step(xs, worker, server, block, bits, decay=1.0):
  """One two-phase average of the rows of ``xs`` (one per device) with both errors, the worker
  error decayed by ``decay`` first (p = x + β·e).

  Returns ``(mean, new worker errors, new server errors, phase-1 encodings, phase-2 encodings)``;
  server errors are in the vector's coordinates, each device's non-zero on its own shard only.
  """
  world, length = xs.shape
  shard = max(-(-length // (world * block)), 1) * block
  p = (xs + np.float32(decay) * worker).astype(np.float32)
  padded = np.zeros((world, world * shard), np.float32)
  padded[:, :length] = p
  phase1 = [ref_quantize(padded[d].reshape(world, shard), block, bits) for d in range(world)]
  new_worker = p - np.stack([decoded.reshape(-1)[:length] for _, _, decoded in phase1])
  mean_out = np.zeros(world * shard, np.float32)
  new_server = np.zeros_like(server)
  phase2 = []
  for owner in range(world):
    mean = np.zeros(shard, np.float32)
    for d in range(world):
      mean = mean + phase1[d][2][owner] / np.float32(world)
    lo, hi = owner * shard, min((owner + 1) * shard, length)
    valid = max(hi - lo, 0)
    mean[:valid] += server[owner, lo:hi]
    mean[valid:] = 0
    codes, scales, decoded = ref_quantize(mean[None], block, bits)
    phase2.append((codes, scales))
    new_server[owner, lo:hi] = (mean - decoded[0])[:valid]
    mean_out[owner * shard:(owner + 1) * shard] = decoded[0]
  return mean_out[:length], new_worker, new_server, phase1, phase2


def recorded_exchange(config, world):
  """The exchange under pmap over ``world`` devices, also returning every encoding it sends
  (phase 1, phase 2)."""
  codec = quantized_lib.block_codec(config)

  def run(x, worker, server):
    sent = []

    def encode(rows, count, key):
      payload, decoded = codec.encode(rows, count, key)
      sent.append(payload)
      return payload, decoded

    (mean,), (worker,), (server,), _ = exchange.compressed_mean(
        codec._replace(encode=encode), [x], [worker], [server], "batch")
    return mean, worker, server, sent

  return jax.pmap(run, axis_name="batch", devices=jax.devices()[:world])


def gradients(world, rng, steps, length):
  """Per step and device, values whose magnitude changes by orders from block to block."""
  magnitude = 10.0 ** rng.uniform(-3, 3, size=(1, 1, length))
  return (rng.standard_normal((steps, world, length)) * magnitude).astype(np.float32)
