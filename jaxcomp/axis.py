"""Named-axis helpers for writing communication hooks and compressors.

Each is the ``jax.lax`` collective over ``axis_name`` inside ``pmap`` / ``shard_map``, a world of
size 1 where no named axis is bound at all, and an ``UnboundAxisError`` where other axes are bound
but not this one. ``bucket.axis_name`` is the one to pass in a hook::

  def int8_hook(state, bucket):
    scale = jaxcomp.axis.pmax(jnp.abs(bucket.buffer).max(), bucket.axis_name) / 127
    ...
"""

from jaxcomp._src.axis import UnboundAxisError
from jaxcomp._src.axis import all_gather
from jaxcomp._src.axis import all_gather_many
from jaxcomp._src.axis import all_to_all
from jaxcomp._src.axis import all_to_all_many
from jaxcomp._src.axis import axis_index
from jaxcomp._src.axis import axis_size
from jaxcomp._src.jax_internals import bound_axis_names
from jaxcomp._src.axis import mean
from jaxcomp._src.axis import pmax
from jaxcomp._src.axis import psum
from jaxcomp._src.axis import psum_many
from jaxcomp._src.finite import all_finite

__all__ = (
    "UnboundAxisError",
    "all_finite",
    "all_gather",
    "all_gather_many",
    "all_to_all",
    "all_to_all_many",
    "axis_index",
    "axis_size",
    "bound_axis_names",
    "mean",
    "pmax",
    "psum",
    "psum_many",
)
