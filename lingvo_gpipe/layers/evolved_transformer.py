"""Lingvo's Evolved Transformer layers (So et al. 2019), time-major.

The Evolved Transformer layers of Lingvo's `layers_with_attention`, with
Lingvo's Params, child names and math, so that Lingvo's weights load by path
(the GLU is `linears.GluLayer`):

  EvolvedTransformerEncoderBranchedConvsLayer
                    LN; a wide ReLU branch (dense to 4d) beside a 3x1
                    convolution to d/2 (zero-padded to 4d); their sum, LN,
                    a 9x1 separable convolution back to d; the residual.
  EvolvedTransformerDecoderBranchedConvsLayer
                    LN; causal 11x1 (to 2d) and 7x1 (to d/2) separable
                    convolutions side by side; their sum, LN, a causal 7x1
                    separable convolution back to d; the residual.
  EvolvedTransformerEncoderLayer
                    GLU, the encoder's branched convolutions, then a
                    Transformer layer (feed-forward width 4d).
  EvolvedTransformerDecoderLayer
                    self-attention with twice the heads beside attention to
                    the encoder (summed with the input), the decoder's
                    branched convolutions, then a Transformer decoder layer
                    (feed-forward width 4d, swish).

The convolutions run batch-major over time ([batch, time, 1, channels]);
the layers take and return time-major tensors [time, batch, dim] as
Lingvo's do. Layer norms default to Lingvo's form (the scale is 1 +
`scale`, initialized to 0).
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import convolutions
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import layers_with_attention
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import normalizations

__all__ = [
  'EvolvedTransformerBaseLayer',
  'EvolvedTransformerDecoderBranchedConvsLayer',
  'EvolvedTransformerDecoderLayer',
  'EvolvedTransformerEncoderBranchedConvsLayer',
  'EvolvedTransformerEncoderLayer',
]


def _LayerNormParams():
  """Lingvo's LayerNorm default: the scale is 1 + `scale`."""
  return normalizations.LayerNorm.Params().Set(direct_scale=False)


def _PadLastDim(x, like):
  """Zero-pads the last dim of `x` up to that of `like`."""
  extra = tf.shape(like)[-1] - tf.shape(x)[-1]
  rank = x.shape.rank
  return tf.pad(x, [[0, 0]] * (rank - 1) + [[0, extra]])


def _ConvParams(tpl, name, filter_shape, activation):
  """A branch convolution as Lingvo sets it: stride 1, bias, no batch norm."""
  return tpl.Copy().Set(
    name=name,
    bias=True,
    batch_norm=False,
    activation=activation,
    filter_stride=(1, 1),
    filter_shape=filter_shape,
  )


def _Conv(layer, theta, x, paddings):
  """Convolves x [b, t, 1, c] (or [b, t, c]) with paddings [b, t] over time;
  the output paddings are dropped, as in Lingvo."""
  if x.shape.rank == 3:
    x = tf.expand_dims(x, 2)
  return layer.FProp(theta, x, paddings)[0]


class EvolvedTransformerEncoderBranchedConvsLayer(base_layer.BaseLayer):
  """The Evolved Transformer encoder's branched convolutions ([b, t, d])."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('ln_tpl', _LayerNormParams(), 'Layer norm Params.')
    p.Define('input_dim', 0, 'Depth of the input and output.')
    p.Define('activation', 'RELU', 'Activation of both branches.')
    p.Define(
      'dropout_tpl', dropout.DropoutLayer.Params(), 'Dropout of each branch.'
    )
    p.Define('dense_tpl', linears.FCLayer.Params(), 'The wide dense branch.')
    p.Define(
      'conv_tpl', convolutions.Conv2DLayer.Params(), 'The 3x1 convolution.'
    )
    p.Define(
      'separable_conv_tpl',
      convolutions.SeparableConv2DLayer.Params(),
      'The 9x1 separable convolution.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim')
    d = p.input_dim
    self.CreateChild(
      'first_layer_norm',
      p.ln_tpl.Copy().Set(name='first_layer_norm', input_dim=d),
    )
    self.CreateChild(
      'second_layer_norm',
      p.ln_tpl.Copy().Set(name='second_layer_norm', input_dim=4 * d),
    )
    self.CreateChild(
      'dense_layer',
      p.dense_tpl.Copy().Set(
        name='dense_layer',
        input_dim=d,
        output_dim=4 * d,
        activation=p.activation,
      ),
    )
    self.CreateChild(
      'conv_layer',
      _ConvParams(p.conv_tpl, 'conv_layer', (3, 1, d, d // 2), p.activation),
    )
    self.CreateChild(
      'separable_conv_layer',
      _ConvParams(
        p.separable_conv_tpl, 'separable_conv_layer', (9, 1, 4 * d, d), 'NONE'
      ),
    )
    self.CreateChild('dropout', p.dropout_tpl.Copy())

  def FProp(self, theta, inputs, paddings):
    """inputs [b, t, d], paddings [b, t] -> [b, t, d]."""
    x = self.first_layer_norm.FProp(theta.first_layer_norm, inputs)
    left = self.dense_layer.FProp(
      theta.dense_layer, x, tf.expand_dims(paddings, -1)
    )
    left = self.dropout.FProp(theta.dropout, left)
    right = tf.squeeze(_Conv(self.conv_layer, theta.conv_layer, x, paddings), 2)
    right = _PadLastDim(self.dropout.FProp(theta.dropout, right), left)
    h = self.second_layer_norm.FProp(theta.second_layer_norm, left + right)
    h = _Conv(
      self.separable_conv_layer, theta.separable_conv_layer, h, paddings
    )
    h = _PadLastDim(tf.squeeze(h, 2), inputs)
    return self.dropout.FProp(theta.dropout, h) + inputs

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    dims = _shapes.Dims(inputs)
    n, d = _shapes.NumElements(dims[:-1]), p.input_dim
    flops = 2 * n * (4 * d * d + 3 * d * d // 2 + 9 * 4 * d + 4 * d * d)
    return meta.Meta(flops, tf.TensorShape(dims))


class EvolvedTransformerDecoderBranchedConvsLayer(base_layer.BaseLayer):
  """The Evolved Transformer decoder's causal branched convolutions."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('ln_tpl', _LayerNormParams(), 'Layer norm Params.')
    p.Define('input_dim', 0, 'Depth of the input and output.')
    p.Define('activation', 'RELU', 'Activation of the 11x1 branch.')
    p.Define(
      'dropout_tpl', dropout.DropoutLayer.Params(), 'Dropout of each branch.'
    )
    p.Define(
      'separable_conv_tpl',
      convolutions.SeparableConv2DLayer.Params().Set(causal_convolution=True),
      'The separable convolutions (causal).',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim')
    d = p.input_dim
    self.CreateChild(
      'first_layer_norm',
      p.ln_tpl.Copy().Set(name='first_layer_norm', input_dim=d),
    )
    self.CreateChild(
      'second_layer_norm',
      p.ln_tpl.Copy().Set(name='second_layer_norm', input_dim=2 * d),
    )
    for name, shape, act in (
      ('separable_conv_11x1_layer', (11, 1, d, 2 * d), p.activation),
      ('separable_conv_7x1_layer', (7, 1, d, d // 2), 'NONE'),
      ('separable_conv_7x1_layer_2', (7, 1, 2 * d, d), 'NONE'),
    ):
      self.CreateChild(
        name, _ConvParams(p.separable_conv_tpl, name, shape, act)
      )
    self.CreateChild('dropout', p.dropout_tpl.Copy())

  def FProp(self, theta, inputs, paddings):
    """inputs [b, t, d], paddings [b, t] -> [b, t, d]."""
    x = self.first_layer_norm.FProp(theta.first_layer_norm, inputs)
    left = _Conv(
      self.separable_conv_11x1_layer,
      theta.separable_conv_11x1_layer,
      x,
      paddings,
    )
    left = self.dropout.FProp(theta.dropout, left)
    right = _Conv(
      self.separable_conv_7x1_layer, theta.separable_conv_7x1_layer, x, paddings
    )
    right = _PadLastDim(self.dropout.FProp(theta.dropout, right), left)
    h = self.second_layer_norm.FProp(theta.second_layer_norm, left + right)
    h = _Conv(
      self.separable_conv_7x1_layer_2,
      theta.separable_conv_7x1_layer_2,
      h,
      paddings,
    )
    h = self.dropout.FProp(theta.dropout, h)
    return tf.squeeze(h, 2) + inputs

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    dims = _shapes.Dims(inputs)
    n, d = _shapes.NumElements(dims[:-1]), p.input_dim
    flops = 2 * n * (11 * d + 2 * d * d + 7 * d + d * d // 2)
    flops += 2 * n * (7 * 2 * d + 2 * d * d)
    return meta.Meta(flops, tf.TensorShape(dims))


class EvolvedTransformerBaseLayer(base_layer.BaseLayer):
  """Params shared by the Evolved Transformer encoder and decoder layers."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Depth of the input and output.')
    p.Define('has_aux_atten', False, 'Attend to the encoder output.')
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p, {'packed_input': (False, 'give one sequence per row.')}
    )
    _shapes.CheckPositive(p, 'source_dim')

  def _BranchedConvs(self, layer, theta, x, paddings):
    """Runs the batch-major `layer` on time-major x [t, b, d]."""
    h = layer.FProp(
      theta, tf.transpose(x, [1, 0, 2]), tf.transpose(paddings, [1, 0])
    )
    return tf.transpose(h, [1, 0, 2])

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    t, b, d = _shapes.Dims(inputs)
    flops = 40 * (t or 1) * (b or 1) * d * d + 4 * (t or 1) ** 2 * (b or 1) * d
    return meta.Meta(flops, tf.TensorShape(inputs))


def _TransformerParams(p):
  """The Evolved Transformer's last Transformer layer: feed-forward 4d."""
  tp = p.transformer_tpl.Copy().Set(
    name='transformer_layer',
    source_dim=p.source_dim,
    output_dim=p.source_dim,
    packed_input=p.packed_input,
  )
  tp.tr_fflayer_tpl.hidden_dim = 4 * p.source_dim
  return tp


class EvolvedTransformerEncoderLayer(EvolvedTransformerBaseLayer):
  """GLU, branched convolutions, Transformer layer (time-major)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('glu_tpl', linears.GluLayer.Params(), 'The GLU layer.')
    p.Define(
      'branched_convs_tpl',
      EvolvedTransformerEncoderBranchedConvsLayer.Params(),
      'The branched convolutions.',
    )
    p.Define(
      'transformer_tpl',
      layers_with_attention.TransformerLayer.Params(),
      'The Transformer layer (its feed-forward width is set to 4d).',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'has_aux_atten': (
          False,
          'the encoder attends to itself only: use '
          'EvolvedTransformerDecoderLayer to attend to an encoder.',
        )
      },
    )
    d = p.source_dim
    self.CreateChild(
      'glu_layer', p.glu_tpl.Copy().Set(name='glu_layer', input_dim=d)
    )
    self.CreateChild(
      'branched_convs_layer',
      p.branched_convs_tpl.Copy().Set(name='branched_convs_layer', input_dim=d),
    )
    self.CreateChild(
      'transformer_layer',
      _TransformerParams(p).Set(
        has_aux_atten=False,
        tr_aux_atten_tpl=None,
        mask_self_atten=False,
        is_decoder=False,
      ),
    )

  def FProp(
    self,
    theta,
    source_vecs,
    source_paddings,
    aux_vecs=None,
    aux_paddings=None,
    source_segment_id=None,
    aux_segment_id=None,
  ):
    """source_vecs [t, b, d], source_paddings [t, b] -> (out [t, b, d],
    the Transformer layer's attention probs)."""
    del aux_vecs, aux_paddings, source_segment_id, aux_segment_id
    h = self.glu_layer.FProp(theta.glu_layer, source_vecs, source_paddings)
    h = self._BranchedConvs(
      self.branched_convs_layer,
      theta.branched_convs_layer,
      h,
      source_paddings,
    )
    return self.transformer_layer.FProp(
      theta.transformer_layer, h, source_paddings
    )


class EvolvedTransformerDecoderLayer(EvolvedTransformerBaseLayer):
  """Double-headed self-attention beside encoder attention, causal branched
  convolutions, a Transformer decoder layer (time-major)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'tr_atten_tpl',
      layers_with_attention.TransformerAttentionLayer.Params().Set(
        num_attention_heads=8
      ),
      'Attention to the encoder (unless tr_aux_atten_tpl).',
    )
    p.Define(
      'tr_double_heads_atten_tpl',
      layers_with_attention.TransformerAttentionLayer.Params().Set(
        num_attention_heads=16
      ),
      'The self-attention with twice the heads.',
    )
    p.Define(
      'branched_convs_tpl',
      EvolvedTransformerDecoderBranchedConvsLayer.Params(),
      'The branched convolutions.',
    )
    p.Define(
      'transformer_tpl',
      layers_with_attention.TransformerLayer.Params(),
      'The Transformer layer (feed-forward width 4d, swish).',
    )
    p.Define(
      'tr_aux_atten_tpl', None, 'Attention to the encoder; None: tr_atten_tpl.'
    )
    p.Define('mask_self_atten', False, 'Causal self-attention.')
    p.has_aux_atten = True
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    d = p.source_dim
    self.CreateChild(
      'self_atten_double_heads',
      p.tr_double_heads_atten_tpl.Copy().Set(
        name='self_atten_double_heads',
        source_dim=d,
        is_masked=p.mask_self_atten,
        packed_input=p.packed_input,
      ),
    )
    if p.has_aux_atten:
      tpl = p.tr_aux_atten_tpl or p.tr_atten_tpl
      self.CreateChild(
        'attend_to_encoder',
        tpl.Copy().Set(
          name='attend_to_encoder', source_dim=d, packed_input=p.packed_input
        ),
      )
    self.CreateChild(
      'branched_convs',
      p.branched_convs_tpl.Copy().Set(name='branched_convs', input_dim=d),
    )
    tp = _TransformerParams(p).Set(
      tr_aux_atten_tpl=p.tr_aux_atten_tpl,
      has_aux_atten=p.has_aux_atten,
      mask_self_atten=p.mask_self_atten,
    )
    tp.tr_fflayer_tpl.activation = 'SWISH'
    self.CreateChild('transformer_layer', tp)

  def FProp(
    self,
    theta,
    source_vecs,
    source_paddings,
    aux_vecs=None,
    aux_paddings=None,
    source_segment_id=None,
    aux_segment_id=None,
  ):
    """source_vecs [t, b, d], source_paddings [t, b]; aux_* the encoder's
    output [s, b, d] and paddings [s, b]. Returns (out [t, b, d], the
    Transformer layer's last attention probs)."""
    del source_segment_id, aux_segment_id
    p = self.params
    if p.has_aux_atten and (aux_vecs is None or aux_paddings is None):
      raise ValueError(
        f'{self.path}: has_aux_atten needs aux_vecs and aux_paddings (the '
        'encoder output and its paddings).'
      )
    left, _ = self.self_atten_double_heads.FProp(
      theta.self_atten_double_heads, source_vecs, source_paddings
    )
    if p.has_aux_atten:
      right, _ = self.attend_to_encoder.FProp(
        theta.attend_to_encoder, source_vecs, aux_paddings, aux_vecs
      )
      h = left + right + source_vecs
    else:
      h = left + source_vecs
    h = self._BranchedConvs(
      self.branched_convs, theta.branched_convs, h, source_paddings
    )
    return self.transformer_layer.FProp(
      theta.transformer_layer, h, source_paddings, aux_vecs, aux_paddings
    )

  def ExtendStep(self, *args, **kwargs):
    """Lingvo's one-step decoding of this layer: not provided."""
    del args, kwargs
    raise NotImplementedError(
      f'{self.path}: ExtendStep (step-by-step decoding) of the Evolved '
      'Transformer is not provided; decode with FProp over the whole '
      'prefix (its self-attention and convolutions are causal).'
    )
