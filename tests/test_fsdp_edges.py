"""``jaxcomp.fully_sharded`` at its edges: a layer gathered twice in one step (tied weights), the
non-finite guard, kernels split over a model axis that W·M does not divide, RNG keys and NNX
Variables among the parameters; and jaxcomp's sources free of deprecation warnings."""

import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp

LIBRARY = pathlib.Path(jaxcomp.__file__).parent  # what ``import jaxcomp`` compiles


def test_the_library_compiles_without_deprecation_warnings():
  """An invalid escape sequence in a docstring warns when the module is compiled (the cached
  bytecode hides it): the sources ``import jaxcomp`` reads, compiled afresh, warnings as errors."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    warnings.simplefilter("error", SyntaxWarning)
    for path in [LIBRARY / "__init__.py", *sorted((LIBRARY / "_src").glob("*.py"))]:
      compile(path.read_text(), str(path), "exec")


def test_nnx_variables_are_read_without_deprecated_value():
  """Flax 0.12 deprecates ``Variable.value``; jaxcomp reads a Variable's array without it."""
  from flax import nnx
  from jaxcomp._src import tree as tree_lib
  state = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    signature = tree_lib.TreeSignature.of(state)
  assert sorted(signature.shapes) == [(2,), (3, 2)]
