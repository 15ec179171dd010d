"""The two ends of the flat AmoebaNet layer sequence: stem and heads.

  AmoebaStem      images [b, H, W, c] -> NestedMap(prev=x, cur=x)
  AmoebaAuxHead   NestedMap(prev, cur, ...) -> the same plus aux_logits
  AmoebaHead      NestedMap(prev, cur, ...) -> features [b, dim] (or logits)

See `amoebanet_cells` for the state and the cells in between.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import convolutions
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import pooling
from lingvo_gpipe.models import amoebanet_cells

__all__ = ['AmoebaStem', 'AmoebaAuxHead', 'AmoebaHead']


class AmoebaStem(base_layer.BaseLayer):
  """Stem conv: images [b, H, W, c] -> NestedMap(prev=x, cur=x).

  x = BN(conv3x3(images)) with `filters` channels, VALID padding, stride 2
  (TF's ImageNet stem, followed by two reduction cells in the layer list)
  or 1 (its CIFAR stem).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 3, 'Image channels.')
    p.Define('filters', 32, 'Output channels.')
    p.Define('stride', 2, 'Stride: 2 (ImageNet stem) or 1 (CIFAR stem).')
    p.Define('bn_decay', 0.9997, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def _ConvParams(cls, p):
    return convolutions.Conv2DLayer.Params().Set(
      name='conv0',
      filter_shape=(3, 3, p.input_dim, p.filters),
      filter_stride=(p.stride, p.stride),
      padding_algorithm='VALID',
      activation='NONE',
      bias=False,
      batch_norm=True,
      bn_decay=p.bn_decay,
    )

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('conv0', self._ConvParams(self.params))

  def FProp(self, theta, images):
    """images [b, H, W, input_dim] -> NestedMap(prev, cur) [b, h, w, f]."""
    x = self.conv0.FProp(theta.conv0, images)
    return NestedMap(prev=x, cur=x)

  @classmethod
  def FPropMeta(cls, p, images):
    m = cls._ConvParams(p).cls.FPropMeta(cls._ConvParams(p), images)
    return meta.Meta(
      m.flops, NestedMap(prev=m.out_shapes[0], cur=m.out_shapes[0])
    )


class AmoebaAuxHead(base_layer.BaseLayer):
  """TF AmoebaNet's auxiliary classifier on state.cur; adds `aux_logits`.

  ReLU -> 5x5/3 avg pool (VALID) -> 1x1 conv (128 * aux_scaling) -> BN ->
  ReLU -> conv over the whole pooled map (768 * aux_scaling) -> BN -> ReLU ->
  FC (num_classes, with bias). NestedMap(prev, cur, ...) -> the same plus
  aux_logits [b, num_classes].
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Channels of state.cur.')
    p.Define('input_size', (0, 0), 'Height and width of state.cur.')
    p.Define('num_classes', 0, 'Number of classes.')
    p.Define('aux_scaling', 0.4, 'Scales the 128 and 768 filters (TF: 0.4).')
    p.Define('bn_decay', 0.9997, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def Children(cls, p):
    """[(name, Params)] of the children; checks the input size."""
    name = _shapes.LayerName(p)
    _shapes.CheckPositive(p, 'input_dim', 'num_classes')
    h, w = [int(d) for d in p.input_size]
    if h < 5 or w < 5:
      raise ValueError(
        f'{name}: the auxiliary head gets a {h}x{w} feature map but its '
        '5x5 average pool needs at least 5x5; use a larger image_size or '
        'use_aux_head = False.'
      )
    ph, pw = (h - 5) // 3 + 1, (w - 5) // 3 + 1
    c1, c2 = int(128 * p.aux_scaling), int(768 * p.aux_scaling)
    conv = convolutions.Conv2DLayer.Params().Set(
      activation='RELU',
      bias=False,
      batch_norm=True,
      bn_decay=p.bn_decay,
      padding_algorithm='VALID',
    )
    return [
      (
        'pool',
        pooling.PoolingLayer.Params().Set(
          window_shape=(5, 5),
          window_stride=(3, 3),
          pooling_type='AVG',
          padding_algorithm='VALID',
        ),
      ),
      ('proj', conv.Copy().Set(filter_shape=(1, 1, p.input_dim, c1))),
      ('conv', conv.Copy().Set(filter_shape=(ph, pw, c1, c2))),
      (
        'fc',
        linears.ProjectionLayer.Params().Set(
          input_dim=c2, output_dim=p.num_classes, activation='NONE'
        ),
      ),
    ]

  def __init__(self, params):
    super().__init__(params)
    for name, cp in self.Children(self.params):
      self.CreateChild(name, cp)

  def FProp(self, theta, state):
    """Adds aux_logits [b, num_classes] to the state."""
    amoebanet_cells.CheckState(self, state)
    x = tf.nn.relu(state.cur)
    x = self.pool.FProp(theta.pool, x)
    x = self.proj.FProp(theta.proj, x)
    x = self.conv.FProp(theta.conv, x)
    x = tf.reshape(x, [-1, x.shape[-1]])
    out = NestedMap(state)
    out.aux_logits = self.fc.FProp(theta.fc, x)
    return out

  @classmethod
  def FPropMeta(cls, p, state):
    amoebanet_cells.CheckState(p, state)
    shape = _shapes.ToShape(state.cur)
    flops = _shapes.NumElements(shape.as_list())
    for name, cp in cls.Children(p):
      cp = cp.Copy().Set(name=name)
      if name == 'fc':
        shape = tf.TensorShape([shape[0], shape[-1]])
      m = cp.cls.FPropMeta(cp, shape)
      flops += m.flops
      shape = m.out_shapes[0]
    out = NestedMap(state)
    out.aux_logits = shape
    return meta.Meta(flops, out)


class AmoebaHead(base_layer.BaseLayer):
  """ReLU -> global average pool -> dropout [-> FC logits].

  NestedMap(prev, cur [b, h, w, input_dim]) -> features [b, input_dim], or
  logits [b, num_classes] if num_classes > 0; with `aux_logits` in the
  state: NestedMap(features (or logits), aux_logits).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Channels of state.cur.')
    p.Define(
      'dropout_keep_prob',
      1.0,
      'Keep probability of the dropout on the pooled features.',
    )
    p.Define(
      'num_classes',
      0,
      '> 0: a final FC layer `logits` to this many classes; 0: the '
      'head returns features (a ClassifierTask softmax follows).',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim')
    self.CreateChild(
      'dropout',
      dropout.DropoutLayer.Params().Set(keep_prob=p.dropout_keep_prob),
    )
    if p.num_classes:
      self.CreateChild(
        'logits',
        linears.ProjectionLayer.Params().Set(
          input_dim=p.input_dim, output_dim=p.num_classes, activation='NONE'
        ),
      )

  def FProp(self, theta, state):
    """Features [b, input_dim] (or logits); see the class docstring."""
    p = self.params
    amoebanet_cells.CheckState(self, state)
    _shapes.CheckShape(
      self,
      'state.cur',
      state.cur.shape,
      [None, None, None, p.input_dim],
      f'state.cur must have {p.input_dim} channels.',
    )
    x = tf.reduce_mean(tf.nn.relu(state.cur), axis=[1, 2])
    x = self.dropout.FProp(theta.dropout, x)
    key = 'features'
    if p.num_classes:
      x = self.logits.FProp(theta.logits, x)
      key = 'logits'
    if 'aux_logits' in state:
      return NestedMap({key: x, 'aux_logits': state.aux_logits})
    return x

  @classmethod
  def FPropMeta(cls, p, state):
    amoebanet_cells.CheckState(p, state)
    dims = _shapes.CheckShape(
      p,
      'state.cur',
      state.cur,
      [None, None, None, p.input_dim],
      f'state.cur must have {p.input_dim} channels.',
    )
    flops = 2 * _shapes.NumElements(dims)
    out = tf.TensorShape([dims[0], p.input_dim])
    key = 'features'
    if p.num_classes:
      flops += 2 * _shapes.NumElements([dims[0]]) * p.input_dim * p.num_classes
      out = tf.TensorShape([dims[0], p.num_classes])
      key = 'logits'
    if 'aux_logits' in state:
      return meta.Meta(
        flops, NestedMap({key: out, 'aux_logits': state.aux_logits})
      )
    return meta.Meta(flops, out)
