"""Reshaping layers: `FlattenLayer`.

`FlattenLayer` turns [batch, d1, ..., dn] into [batch, d1 * ... * dn], e.g.
images [b, 8, 8, 1] into features [b, 64] for fully-connected layers. It has
no variables, so it can sit anywhere in a pipeline's `layers`.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.layers import _shapes

__all__ = ['FlattenLayer']


class FlattenLayer(base_layer.BaseLayer):
  """[batch, d1, ..., dn] -> [batch, d1 * ... * dn]."""

  @classmethod
  def _OutDims(cls, who, dims):
    if dims is None or len(dims) < 1:
      raise ValueError(
        f'{_shapes.LayerName(who)}: inputs have shape {dims}; '
        'FlattenLayer needs at least a batch dimension.'
      )
    rest = dims[1:]
    if any(d is None for d in rest):
      return [dims[0], None]
    return [dims[0], int(np.prod(rest, dtype=np.int64))]

  def FProp(self, theta, inputs):
    """Flattens all dims after the first.

    Args:
      theta: unused (no variables).
      inputs: [batch, ...].

    Returns:
      `[batch, prod(...)]`.
    """
    del theta
    inputs = tf.convert_to_tensor(inputs)
    dims = inputs.shape.as_list() if inputs.shape.rank is not None else None
    out = self._OutDims(self, dims)
    if out[1] is None:
      return tf.reshape(inputs, [tf.shape(inputs)[0], -1])
    return tf.reshape(inputs, [-1 if out[0] is None else out[0], out[1]])

  @classmethod
  def FPropMeta(cls, p, inputs):
    dims = _shapes.Dims(inputs)
    return meta.Meta(0, tf.TensorShape(cls._OutDims(p, dims)))
