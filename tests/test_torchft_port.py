"""The torch side of ``benchmarks/torchft_diloco.py``: its port of the main job's chars transformer
computes the Flax model's logits from the same parameters, and its fragments hold every parameter
once."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import torchft_diloco  # noqa: E402
from jaxcomp.train import tasks  # noqa: E402


@pytest.mark.parametrize("quick", [True, False])
def test_the_torch_port_computes_the_flax_models_logits(quick):
  task = tasks.chars(quick=quick)
  shape = dict(tasks.CHARS_SIZES["small"])
  if quick:
    shape.update(context=32, width=32, depth=1, heads=4)
  params = task.init(0)
  model = torchft_diloco.char_transformer(params, shape)
  tokens = task.test_inputs[:4]
  want = np.asarray(task.model.apply({"params": params}, tokens))
  with torch.no_grad():
    got = model(torch.from_numpy(tokens.astype(np.int64))).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
  flax_count = sum(np.size(x) for x in __import__("jax").tree.leaves(params))
  assert sum(p.numel() for p in model.parameters()) == flax_count
  for count in (1, 2):
    held = [id(p) for f in model.fragments(count) for p in f.parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
