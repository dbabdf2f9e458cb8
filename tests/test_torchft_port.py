"""The torch side of ``benchmarks/torchft_diloco.py``: its port of the main job's chars transformer
computes the Flax model's logits from the same parameters, and its fragments hold every parameter
once; and its table's split of a difference in wall-clock to target."""

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


def test_a_difference_to_target_is_split_into_steps_at_the_median_and_the_time_above_it():
  evals = [(0, 3.0), (10, 2.0), (20, 1.0)]  # held out: 2.0 at step 10, 1.5 at step 20
  ours = torchft_diloco.summary("jaxcomp diloco", [0.1] * 18 + [0.5, 0.5], evals, 10, [1], 20, 1.5)
  theirs = torchft_diloco.summary("torchft DiLoCo", [0.08] * 20, evals, 10, [1], 20, 1.5)
  assert (ours["reached"], theirs["reached"]) == (20, 20)
  np.testing.assert_allclose([ours["to_target"], ours["beyond_median"], theirs["beyond_median"]],
                             [2.8, 0.8, 0.0], atol=1e-9)
  text = torchft_diloco.where_the_time_goes([ours, theirs])
  assert text == ("jaxcomp diloco: 1.75x torchft DiLoCo's wall-clock to target (+1.2 s: +0.4 s in "
                  "the steps at their median, +0.8 s above it).")
