"""2D convolutions on NHWC inputs [batch, height, width, channels].

`Conv2DLayer`, `DepthwiseConv2DLayer` and `SeparableConv2DLayer` (Lingvo
names): conv -> bias -> batch norm -> activation. Height is the time axis of
Lingvo's speech models; optional `paddings` [batch, height] (1.0 = padded)
zero padded inputs and outputs, and make FProp return (outputs,
out_paddings) as Lingvo does. Without paddings FProp returns the outputs
only, so convolutions chain directly in a `SequentialLayer` or pipeline.

`causal_convolution` (Lingvo's) makes output step t depend on input steps
<= t only: the inputs are padded with (kernel height - 1) * dilation zero
steps in front and convolved VALID, so the output keeps the SAME length.
"""

import math

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import activations
from lingvo_gpipe.layers import normalizations

__all__ = [
  'Conv2DLayer',
  'DepthwiseConv2DLayer',
  'SeparableConv2DLayer',
  'ConvOutputSize',
]

PADDING_ALGORITHMS = ('SAME', 'VALID')


def ConvOutputSize(size, kernel, stride, dilation, padding_algorithm):
  """Output length of a convolution/pooling along one axis (None stays None).

  SAME: ceil(size / stride); VALID: ceil((size - (kernel - 1) * dilation) /
  stride).
  """
  if size is None:
    return None
  if padding_algorithm == 'SAME':
    return int(math.ceil(size / stride))
  effective = (kernel - 1) * dilation + 1
  return max(0, (size - effective) // stride + 1)


def ConvOutputPaddings(paddings, kernel, stride, dilation, padding_algorithm):
  """Paddings [batch, height] of the outputs of a conv along the height."""
  if padding_algorithm == 'SAME':
    return paddings[:, ::stride]
  # Output i covers inputs [i * stride, i * stride + (kernel - 1) * dilation]:
  # it is padded when its last input is.
  return paddings[:, (kernel - 1) * dilation :: stride]


class _BaseConv2D(base_layer.BaseLayer):
  """Shared params and FProp of the convolution layers."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'filter_shape',
      (0, 0, 0, 0),
      'Filter shape [height, width, in_channels, out_channels] '
      '(depthwise: [height, width, in_channels, channel_multiplier]).',
    )
    p.Define('filter_stride', (1, 1), 'Strides [height, width].')
    p.Define(
      'dilation_rate',
      (1, 1),
      'Dilation [height, width]; > 1 requires filter_stride (1, 1).',
    )
    p.Define('padding_algorithm', 'SAME', 'Padding: SAME or VALID.')
    p.Define(
      'causal_convolution',
      False,
      'Output step t depends only on input steps <= t (height = time); '
      'the output is as long as with SAME padding.',
    )
    p.Define('activation', 'RELU', 'Activation applied last, by Lingvo name.')
    p.Define('bias', False, 'Whether to add a bias `b` [output channels].')
    p.Define(
      'batch_norm',
      False,
      'Whether to batch-normalize the conv outputs before the '
      'activation (a BatchNormLayer child `bn`).',
    )
    p.Define('bn_decay', 0.999, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def OutputChannels(cls, p):
    return p.filter_shape[-1]

  @classmethod
  def WeightShape(cls, p):
    """Shape of the filter variable `w`."""
    return list(p.filter_shape)

  @classmethod
  def _Validate(cls, p):
    name = _shapes.LayerName(p)
    fs, st, dil = (
      list(p.filter_shape),
      list(p.filter_stride),
      list(p.dilation_rate),
    )
    if len(fs) != 4 or not all(isinstance(d, int) and d > 0 for d in fs):
      raise ValueError(
        f'{name}: p.filter_shape = {p.filter_shape!r}; it must '
        'be 4 positive ints [height, width, in, out].'
      )
    for field, v in (('filter_stride', st), ('dilation_rate', dil)):
      if len(v) != 2 or not all(isinstance(d, int) and d > 0 for d in v):
        raise ValueError(
          f'{name}: p.{field} = {v!r}; it must be 2 positive '
          'ints [height, width].'
        )
    if any(d > 1 for d in dil) and any(s > 1 for s in st):
      raise ValueError(
        f'{name}: dilation_rate {dil} and filter_stride {st} '
        'are both > 1; TensorFlow supports one or the other: '
        'set one of them to (1, 1).'
      )
    if p.padding_algorithm not in PADDING_ALGORITHMS:
      raise ValueError(
        f'{name}: p.padding_algorithm = '
        f'{p.padding_algorithm!r}; use one of '
        f'{PADDING_ALGORITHMS}.'
      )
    if p.causal_convolution:
      if p.padding_algorithm != 'SAME':
        raise ValueError(
          f'{name}: causal_convolution pads the past itself and keeps the '
          f'SAME length; p.padding_algorithm={p.padding_algorithm!r} '
          "conflicts with it: leave it 'SAME'."
        )
      if st[1] > 1 and fs[1] > 1:
        raise ValueError(
          f'{name}: causal_convolution supports a width stride > 1 only '
          f'with a filter width of 1; filter_shape={p.filter_shape!r}, '
          f'filter_stride={p.filter_stride!r}.'
        )
    activations.CheckActivation(p)

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self.CreateVariable('w', py_utils.WeightParams(self.WeightShape(p)))
    out_c = self.OutputChannels(p)
    if p.bias:
      self.CreateVariable(
        'b', py_utils.WeightParams([out_c], py_utils.WeightInit.Constant(0.0))
      )
    if p.batch_norm:
      self.CreateChild(
        'bn',
        normalizations.BatchNormLayer.Params().Set(dim=out_c, decay=p.bn_decay),
      )

  def _Conv(self, theta, inputs):
    raise NotImplementedError(type(self).__name__)

  def _PadForCausal(self, inputs):
    """(inputs, padding algorithm) of the convolution op: causal inputs get
    the past's zero steps in front (and Lingvo's width padding), VALID."""
    p = self.params
    if not p.causal_convolution:
      return inputs, p.padding_algorithm
    front = (p.filter_shape[0] - 1) * p.dilation_rate[0]
    width = (p.filter_shape[1] - 1) * p.dilation_rate[1]
    left = max(0, width - 1) // 2
    paddings = [[0, 0], [front, 0], [left, width - left], [0, 0]]
    return tf.pad(inputs, paddings), 'VALID'

  @classmethod
  def _OutShape(cls, p, dims):
    """Output dims for input dims [b, h, w, c]; checks the channels."""
    _shapes.CheckShape(
      p,
      'inputs',
      dims,
      [None, None, None, p.filter_shape[2]],
      f'Inputs must be NHWC [batch, height, width, {p.filter_shape[2]}] '
      '(channels = filter_shape[2]); fix p.filter_shape or the inputs.',
    )
    dims = _shapes.Dims(dims)
    out_hw = [
      ConvOutputSize(
        dims[1 + i],
        p.filter_shape[i],
        p.filter_stride[i],
        p.dilation_rate[i],
        p.padding_algorithm,
      )
      for i in range(2)
    ]
    if any(d == 0 for d in out_hw):
      raise ValueError(
        f'{_shapes.LayerName(p)}: inputs {dims} are smaller than the '
        f'filter {list(p.filter_shape[:2])} (dilation '
        f'{list(p.dilation_rate)}) with VALID padding, so the output is '
        'empty; use bigger inputs or padding_algorithm SAME.'
      )
    return [dims[0]] + out_hw + [cls.OutputChannels(p)]

  def FProp(self, theta, inputs, paddings=None):
    """Convolves `inputs`.

    Args:
      theta: NestedMap(w, b?, bn?).
      inputs: [batch, height, width, in_channels].
      paddings: optional [batch, height], 1.0 = padded.

    Returns:
      outputs [batch, out_height, out_width, out_channels]; with `paddings`,
      the pair (outputs, out_paddings [batch, out_height]).
    """
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    self._OutShape(p, inputs.shape)
    out_paddings = None
    if paddings is not None:
      _shapes.CheckShape(
        self,
        'paddings',
        paddings.shape,
        inputs.shape.as_list()[:2],
        'Paddings must be [batch, height] of the inputs.',
      )
      paddings = tf.cast(paddings, inputs.dtype)
      inputs *= 1.0 - paddings[:, :, tf.newaxis, tf.newaxis]
      out_paddings = ConvOutputPaddings(
        paddings,
        p.filter_shape[0],
        p.filter_stride[0],
        p.dilation_rate[0],
        p.padding_algorithm,
      )
    out = self._Conv(theta, inputs)
    if p.bias:
      out = tf.nn.bias_add(out, theta.b)
    if p.batch_norm:
      bn_paddings = (
        None
        if out_paddings is None
        else out_paddings[:, :, tf.newaxis, tf.newaxis]
      )
      out = self.bn.FProp(theta.bn, out, bn_paddings)
    out = activations.GetFn(p.activation)(out)
    if out_paddings is None:
      return out
    out *= 1.0 - out_paddings[:, :, tf.newaxis, tf.newaxis]
    return out, out_paddings

  @classmethod
  def _MacsPerOutput(cls, p):
    raise NotImplementedError(cls.__name__)

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    cls._Validate(p)
    out = cls._OutShape(p, inputs)
    n_out = _shapes.NumElements(out)
    flops = 2 * cls._MacsPerOutput(p) * n_out
    if p.bias:
      flops += n_out
    if p.batch_norm:
      flops += 8 * n_out
    flops += activations.FlopsPerElement(p.activation) * n_out
    out_shape = tf.TensorShape(out)
    if paddings is None:
      return meta.Meta(flops, out_shape)
    return meta.Meta(flops, out_shape, tf.TensorShape(out[:2]))


class Conv2DLayer(_BaseConv2D):
  """Convolution, filter `w` [h, w, in, out]: NHWC in -> NHWC [.., out]."""

  def _Conv(self, theta, inputs):
    p = self.params
    inputs, padding = self._PadForCausal(inputs)
    return tf.nn.conv2d(
      inputs,
      theta.w,
      strides=list(p.filter_stride),
      padding=padding,
      dilations=list(p.dilation_rate),
    )

  @classmethod
  def _MacsPerOutput(cls, p):
    h, w, c_in, _ = p.filter_shape
    return h * w * c_in


class DepthwiseConv2DLayer(_BaseConv2D):
  """Depthwise convolution, filter `w` [h, w, in, multiplier].

  Output channels: in * multiplier.
  """

  @classmethod
  def OutputChannels(cls, p):
    return p.filter_shape[2] * p.filter_shape[3]

  def _Conv(self, theta, inputs):
    p = self.params
    inputs, padding = self._PadForCausal(inputs)
    return tf.nn.depthwise_conv2d(
      inputs,
      theta.w,
      strides=[1] + list(p.filter_stride) + [1],
      padding=padding,
      dilations=list(p.dilation_rate),
    )

  @classmethod
  def _MacsPerOutput(cls, p):
    return p.filter_shape[0] * p.filter_shape[1]


class SeparableConv2DLayer(Conv2DLayer):
  """Depthwise conv (child `depthwise_conv`) then a 1x1 pointwise conv.

  `filter_shape` [h, w, in, out] describes the whole layer: the depthwise
  filter is [h, w, in, depth_multiplier] (strided, dilated, no activation)
  and the pointwise filter `w` is [1, 1, in * depth_multiplier, out], followed
  by this layer's bias, batch norm and activation.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('depth_multiplier', 1, 'Channel multiplier of the depthwise conv.')
    p.Define(
      'depthwise_tpl',
      DepthwiseConv2DLayer.Params().Set(activation='NONE'),
      'Params of the depthwise child; its filter_shape, stride, '
      'dilation and padding are set from this layer.',
    )
    return p

  @classmethod
  def _DepthwiseParams(cls, p):
    h, w, c_in, _ = p.filter_shape
    return p.depthwise_tpl.Copy().Set(
      name='depthwise_conv',
      filter_shape=(h, w, c_in, p.depth_multiplier),
      filter_stride=tuple(p.filter_stride),
      dilation_rate=tuple(p.dilation_rate),
      padding_algorithm=p.padding_algorithm,
      causal_convolution=p.causal_convolution,
    )

  @classmethod
  def WeightShape(cls, p):
    return [1, 1, p.filter_shape[2] * p.depth_multiplier, p.filter_shape[3]]

  @classmethod
  def _Validate(cls, p):
    super()._Validate(p)
    _shapes.CheckPositive(p, 'depth_multiplier')

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('depthwise_conv', self._DepthwiseParams(self.params))

  def _Conv(self, theta, inputs):
    depthwise = self.depthwise_conv.FProp(theta.depthwise_conv, inputs)
    return tf.nn.conv2d(depthwise, theta.w, strides=[1, 1], padding='VALID')

  @classmethod
  def _MacsPerOutput(cls, p):
    return p.filter_shape[2] * p.depth_multiplier

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    cls._Validate(p)
    dw = cls._DepthwiseParams(p)
    dw_meta = dw.cls.FPropMeta(dw, inputs)
    pw = super().FPropMeta(p, inputs, paddings)
    return meta.Meta(dw_meta.flops + pw.flops, *pw.out_shapes)
