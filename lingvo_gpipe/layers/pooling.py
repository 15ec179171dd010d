"""Pooling over NHWC inputs: `PoolingLayer` and `GlobalPoolingLayer`."""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import convolutions

__all__ = ['PoolingLayer', 'GlobalPoolingLayer']

POOLING_TYPES = ('MAX', 'AVG')


def _CheckPoolingType(p):
  if p.pooling_type not in POOLING_TYPES:
    raise ValueError(
      f'{_shapes.LayerName(p)}: p.pooling_type = '
      f'{p.pooling_type!r}; use one of {POOLING_TYPES}.'
    )


def _CheckNHWC(who, shape):
  return _shapes.CheckShape(
    who,
    'inputs',
    shape,
    [None, None, None, None],
    'Pooling expects NHWC inputs [batch, height, width, channels].',
  )


class PoolingLayer(base_layer.BaseLayer):
  """Windowed max/avg pooling: [b, h, w, c] -> [b, h', w', c]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('window_shape', (2, 2), 'Window [height, width].')
    p.Define('window_stride', (2, 2), 'Stride [height, width].')
    p.Define('pooling_type', 'MAX', 'Pooling type: MAX or AVG.')
    p.Define('padding_algorithm', 'SAME', 'Padding: SAME or VALID.')
    return p

  @classmethod
  def _Validate(cls, p):
    name = _shapes.LayerName(p)
    for field in ('window_shape', 'window_stride'):
      v = list(p.Get(field))
      if len(v) != 2 or not all(isinstance(d, int) and d > 0 for d in v):
        raise ValueError(
          f'{name}: p.{field} = {p.Get(field)!r}; it must be '
          '2 positive ints [height, width].'
        )
    _CheckPoolingType(p)
    if p.padding_algorithm not in convolutions.PADDING_ALGORITHMS:
      raise ValueError(
        f'{name}: p.padding_algorithm = '
        f'{p.padding_algorithm!r}; use one of '
        f'{convolutions.PADDING_ALGORITHMS}.'
      )

  def __init__(self, params):
    super().__init__(params)
    self._Validate(self.params)

  @classmethod
  def _OutDims(cls, p, who, shape):
    dims = _CheckNHWC(who, shape)
    out_hw = [
      convolutions.ConvOutputSize(
        dims[1 + i],
        p.window_shape[i],
        p.window_stride[i],
        1,
        p.padding_algorithm,
      )
      for i in range(2)
    ]
    if any(d == 0 for d in out_hw):
      raise ValueError(
        f'{_shapes.LayerName(who)}: inputs {dims} are smaller than the '
        f'window {list(p.window_shape)} with VALID padding; use bigger '
        'inputs, a smaller window or padding_algorithm SAME.'
      )
    return [dims[0]] + out_hw + [dims[3]]

  def FProp(self, theta, inputs):
    """Pools `inputs` [b, h, w, c] -> [b, h', w', c]."""
    del theta  # No weights.
    p = self.params
    self._OutDims(p, self, inputs.shape)
    return tf.nn.pool(
      inputs,
      window_shape=list(p.window_shape),
      pooling_type=p.pooling_type,
      strides=list(p.window_stride),
      padding=p.padding_algorithm,
    )

  @classmethod
  def FPropMeta(cls, p, inputs):
    cls._Validate(p)
    out = cls._OutDims(p, p, inputs)
    window = p.window_shape[0] * p.window_shape[1]
    return meta.Meta(window * _shapes.NumElements(out), tf.TensorShape(out))


class GlobalPoolingLayer(base_layer.BaseLayer):
  """Max/avg pooling over height and width.

  [b, h, w, c] -> [b, 1, 1, c] (keepdims, Lingvo's output) or [b, c].
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('pooling_type', 'MAX', 'Pooling type: MAX or AVG.')
    p.Define(
      'keepdims', True, 'True: output [b, 1, 1, c] (as Lingvo); False: [b, c].'
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    _CheckPoolingType(self.params)

  def FProp(self, theta, inputs):
    """Pools `inputs` [b, h, w, c] over h and w."""
    del theta  # No weights.
    p = self.params
    _CheckNHWC(self, inputs.shape)
    fn = tf.reduce_max if p.pooling_type == 'MAX' else tf.reduce_mean
    return fn(inputs, axis=[1, 2], keepdims=p.keepdims)

  @classmethod
  def FPropMeta(cls, p, inputs):
    _CheckPoolingType(p)
    dims = _CheckNHWC(p, inputs)
    out = [dims[0], 1, 1, dims[3]] if p.keepdims else [dims[0], dims[3]]
    return meta.Meta(_shapes.NumElements(dims), tf.TensorShape(out))
