"""A user's own model for the planner: ``--model package.module:function`` or
``--model path/to/file.py:function``, a function of no arguments that returns the model's
parameters (a Flax Linen ``model.init(...)``, its ``["params"]``, or an NNX ``nnx.state(model,
nnx.Param)``). The function runs under ``jax.eval_shape``: its arrays are shapes, nothing is
allocated, so a 7B-parameter model's init costs nothing.

    def make_params():
      model = MyTransformer(...)
      return model.init(jax.random.key(0), jnp.zeros((1, 1024), jnp.int32))
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


class ModelError(ValueError):
  """The function named by ``--model`` could not give parameters; the message says why and what to
  do, in one line."""


def is_function(spec: str) -> bool:
  """Whether ``spec`` names a function (``module:function``) rather than a preset."""
  return ":" in spec


def _module(target: str):
  if target.endswith(".py"):
    if not os.path.isfile(target):
      raise ModelError(f"no such file: {target}; give path/to/file.py:function or "
                       "package.module:function")
    name = "_jaxcomp_plan_" + os.path.splitext(os.path.basename(target))[0]
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
  return importlib.import_module(target)


def load(spec: str) -> tuple:
  """``(parameter shapes, about)`` from ``spec``, ``module:function`` or ``file.py:function``.

  Raises:
    ModelError: the module or function is missing, the function raised or needs arguments, or it
      returned no floating-point arrays (one line each).
  """
  import jax
  target, _, name = spec.rpartition(":")
  if not target or not name:
    raise ModelError(f"{spec!r} is not module:function or file.py:function")
  try:
    module = _module(target)
  except ModelError:
    raise
  except Exception as e:  # noqa: BLE001 - whatever importing the user's module raised
    raise ModelError(f"importing {target} raised {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}; fix the module") from None
  function = getattr(module, name, None)
  if not callable(function):
    raise ModelError(f"{target} has no function {name}; name a function of no arguments that "
                     "returns the model's parameters")
  try:
    shapes = jax.eval_shape(function)
  except TypeError as e:
    raise ModelError(f"{name}() raised TypeError: {str(e).splitlines()[0]}; it must take no "
                     "arguments and return the model's parameters") from None
  except Exception as e:  # noqa: BLE001 - whatever the user's function raised
    raise ModelError(f"{name}() raised {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}; fix the function") from None
  if hasattr(shapes, "to_pure_dict"):  # an NNX State
    shapes = shapes.to_pure_dict()
  if isinstance(shapes, dict) and set(shapes) == {"params"}:
    shapes = shapes["params"]
  floating = [x for x in jax.tree.leaves(shapes)
              if hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
  if not floating:
    raise ModelError(f"{name}() returned no floating-point arrays; return the model's parameters")
  return shapes, f"{name} from {target}"
