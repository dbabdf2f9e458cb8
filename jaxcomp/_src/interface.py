"""The interface every jaxcomp transformation declares: ``Transformation``.

A jaxcomp transformation is an optax ``GradientTransformation`` (``init``, ``update``) that also
says what it is — its name, the axis it averages over, whether it is a whole optimizer that sets the
parameters, and its reduce-scatter — so that the wrappers and optimizers that take one
(``jaxcomp.sharded_optimizer``, ``jaxcomp.diloco``'s ``compressor``) read a declared attribute, not
a function's internals. The compressor adapter (``compressor.py``) and ``comm_hook`` make them.
"""

from __future__ import annotations

from typing import Callable, Optional

import optax

from jaxcomp._src import axis, shards, validate
from jaxcomp._src import tree as tree_lib


class Transformation(optax.GradientTransformation):
  """A jaxcomp transformation: optax's ``init`` and ``update``, and what the protocol declares.

  It is an ``optax.GradientTransformation``: chain it, wrap it, hand it to ``nnx.Optimizer``. Every
  public jaxcomp factory of an algorithm returns one, and ``comm_hook`` does too.

  Attributes:
    init: ``init(params) -> state``.
    update: ``update(updates, state, params=None) -> (updates, state)``.
    name: the public name (``"powersgd"``).
    axis_name: the mapped axis it averages over.
    output: what its update returns (``OUTPUTS``): ``"gradient"``, the cross-device mean of the
      gradient (a compressor), or a direction computed from it (``scale_by_onebit_adam``), the
      same on every device, for an optimizer chained after it; ``"update"``, the parameter update
      of a whole optimizer that averages the gradient itself (``onebit_adam``): only guards may
      follow it in an ``optax.chain``; ``"assign"``, ``jaxcomp.Assign`` updates that set the
      parameters (``local_sgd``, ``diloco``, ``streaming_diloco``, ``sparseloco``), whose update
      needs them: nothing may follow it.
    scatter: for a ``"gradient"``, ``scatter(updates, state) -> (shards, state)``: this device's
      shard of each leaf's mean (the reduce-scatter of ``jaxcomp.sharded_optimizer``); None for
      the others.
    scatter_init: ``scatter_init(params) -> state``: the state for ``scatter`` alone, without what
      only ``update`` uses (``quantized``'s server error, a whole gradient per device); ``init``
      where ``update`` and ``scatter`` use the same state.
  """

  def __new__(cls, init: Callable, update: Callable, *, name: str, axis_name: axis.AxisName,
              output: str = "gradient", scatter: Optional[Callable] = None,
              scatter_init: Optional[Callable] = None):
    validate.choice(output, "output", OUTPUTS)
    self = super().__new__(cls, init, update)
    self.__dict__.update(name=name, axis_name=axis_name, output=output, scatter=scatter,
                         scatter_init=scatter_init or init)
    return self

  @property
  def owns_params(self) -> bool:
    """Whether its updates set the parameters (``output == "assign"``)."""
    return self.output == "assign"

  def __repr__(self) -> str:
    return f"jaxcomp.Transformation({self.name}, axis_name={self.axis_name!r})"


def own_shard_of(update: Callable, axis_name: axis.AxisName) -> Callable:
  """A mean's ``scatter`` from its ``update``: the whole mean, of which this device keeps its
  shard (``shards.own``)."""
  def scatter(updates, state):
    means, state = update(updates, state)
    return tree_lib.map_reduced(lambda m: shards.own(m, axis_name), means), state
  return scatter


OUTPUTS = ("gradient", "update", "assign")


def is_mean(value) -> bool:
  """Whether ``value`` is a jaxcomp transformation whose output is the cross-device mean of the
  gradient (or a direction computed from it), for an optimizer to follow."""
  return isinstance(value, Transformation) and value.output == "gradient"


def mean(value, name: str, example: str) -> Transformation:
  """``value`` if it is a jaxcomp transformation whose output is the cross-device mean.

  Raises:
    TypeError: it is not a jaxcomp transformation, or it is a whole optimizer that sets the
      parameters; the message names ``name`` and shows ``example``.
  """
  if is_mean(value):
    return value
  if isinstance(value, Transformation):
    got = (f"jaxcomp.{value.name}, a whole optimizer that sets the parameters (its update is "
           "jaxcomp.Assign, not a mean)" if value.owns_params else
           f"jaxcomp.{value.name}, a whole optimizer whose output is the parameter update, not a "
           "mean")
  elif isinstance(value, optax.GradientTransformation):
    got = (f"an optax transformation that is not a jaxcomp compressor ({_describe(value)}): an "
           "optimizer belongs in inner, or after the compressor in optax.chain")
  else:
    got = f"{value!r} ({type(value).__name__})"
  raise TypeError(f"{name} must be a jaxcomp compressor, the cross-device mean (e.g. {example}); "
                  f"got {got}")


def _describe(transformation) -> str:
  """A transformation by the qualified name of its update function (its repr can be pages long)."""
  update = getattr(transformation, "update", None)
  name = getattr(update, "__qualname__", None)
  where = getattr(update, "__module__", None)
  return f"update {where}.{name}" if name else type(transformation).__name__
