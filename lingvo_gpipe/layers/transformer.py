"""Transformer blocks (pre-layer-norm), under Lingvo's names.

`TransformerAttentionLayer`: x + dropout(attention(layer_norm(x), ...)).
`TransformerFeedForwardLayer`: x + dropout(W2 relu(W1 layer_norm(x))).
`TransformerLayer`: self-attention, optional cross-attention over `aux_vecs`
(the encoder output in a decoder), then the feed-forward block.

Every block keeps its input's shape, so a stack of them is the best case of
a pipeline: identical cells, perfectly balanced.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import attention
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import normalizations

__all__ = [
  'TransformerAttentionLayer',
  'TransformerFeedForwardLayer',
  'TransformerLayer',
]


def _ZeroPaddings(x):
  return tf.zeros(py_utils.GetShape(x, 2), x.dtype)


class TransformerAttentionLayer(base_layer.BaseLayer):
  """Pre-LN residual multi-headed attention."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Model dimension.')
    p.Define('num_attention_heads', 8, 'Number of attention heads.')
    p.Define('is_masked', False, 'Causal self-attention (decoder).')
    p.Define('atten_dropout_prob', 0.0, 'Dropout of attention probabilities.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout before the residual add.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.source_dim <= 0:
      raise ValueError(f'{self.path}: source_dim={p.source_dim} must be > 0.')
    self.CreateChild(
      'layer_norm',
      normalizations.LayerNorm.Params().Set(input_dim=p.source_dim),
    )
    self.CreateChild(
      'atten',
      attention.MultiHeadedAttention.Params().Set(
        input_dim=p.source_dim,
        hidden_dim=p.source_dim,
        num_heads=p.num_attention_heads,
        causal=p.is_masked,
        atten_dropout_prob=p.atten_dropout_prob,
      ),
    )
    self.CreateChild(
      'residual_dropout',
      dropout.DropoutLayer.Params().Set(
        keep_prob=1.0 - p.residual_dropout_prob
      ),
    )

  def FProp(self, theta, query_vec, source_paddings=None, source_vecs=None):
    """Args: query_vec [b, t, d]; source_paddings [b, s]; source_vecs [b, s, d]
    (None: self-attention over query_vec). Returns [b, t, d]."""
    normed = self.layer_norm.FProp(theta.layer_norm, query_vec)
    src = normed if source_vecs is None else source_vecs
    if source_paddings is None:
      source_paddings = _ZeroPaddings(src)
    ctx, _ = self.atten.FProp(theta.atten, normed, src, src, source_paddings)
    return query_vec + self.residual_dropout.FProp(theta.residual_dropout, ctx)

  @classmethod
  def FPropMeta(cls, p, query_vec, source_paddings=None, source_vecs=None):
    q = tf.TensorShape(query_vec)
    src = q if source_vecs is None else tf.TensorShape(source_vecs)
    atten_p = attention.MultiHeadedAttention.Params().Set(
      input_dim=p.source_dim,
      hidden_dim=p.source_dim,
      num_heads=p.num_attention_heads,
    )
    m = attention.MultiHeadedAttention.FPropMeta(atten_p, q, src, src, src[:2])
    return meta.Meta(m.flops + 10 * q.num_elements(), q)


class TransformerFeedForwardLayer(base_layer.BaseLayer):
  """Pre-LN residual feed-forward block."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Model dimension.')
    p.Define('hidden_dim', 0, 'Feed-forward width.')
    p.Define('activation', 'RELU', 'Activation of the hidden layer.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout before the residual add.')
    p.Define('relu_dropout_prob', 0.0, 'Dropout after the activation.')
    p.Define(
      'fflayer_init_scale',
      1.0,
      "Scale of the feed-forward weights' initializer; deep models "
      'scale it down by the number of layers (GPipe paper).',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.input_dim <= 0 or p.hidden_dim <= 0:
      raise ValueError(
        f'{self.path}: input_dim={p.input_dim} and hidden_dim='
        f'{p.hidden_dim} must be > 0.'
      )
    init = py_utils.WeightInit.Xavier(p.fflayer_init_scale)
    self.CreateChild(
      'layer_norm', normalizations.LayerNorm.Params().Set(input_dim=p.input_dim)
    )
    self.CreateChild(
      'fflayer_1',
      linears.ProjectionLayer.Params().Set(
        input_dim=p.input_dim,
        output_dim=p.hidden_dim,
        activation=p.activation,
        params_init=init,
      ),
    )
    self.CreateChild(
      'relu_dropout',
      dropout.DropoutLayer.Params().Set(keep_prob=1.0 - p.relu_dropout_prob),
    )
    self.CreateChild(
      'fflayer_2',
      linears.ProjectionLayer.Params().Set(
        input_dim=p.hidden_dim,
        output_dim=p.input_dim,
        activation='NONE',
        params_init=init,
      ),
    )
    self.CreateChild(
      'residual_dropout',
      dropout.DropoutLayer.Params().Set(
        keep_prob=1.0 - p.residual_dropout_prob
      ),
    )

  def FProp(self, theta, inputs, paddings=None):
    """Args: inputs [b, t, d]; paddings ignored. Returns [b, t, d]."""
    del paddings
    h = self.layer_norm.FProp(theta.layer_norm, inputs)
    h = self.fflayer_1.FProp(theta.fflayer_1, h)
    h = self.relu_dropout.FProp(theta.relu_dropout, h)
    h = self.fflayer_2.FProp(theta.fflayer_2, h)
    return inputs + self.residual_dropout.FProp(theta.residual_dropout, h)

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    x = tf.TensorShape(inputs)
    n = x.num_elements() // p.input_dim
    flops = 4 * n * p.input_dim * p.hidden_dim + 12 * n * p.input_dim
    return meta.Meta(flops, x)


class TransformerLayer(base_layer.BaseLayer):
  """Self-attention [+ cross-attention] + feed-forward, pre-LN."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Model dimension.')
    p.Define('num_attention_heads', 8, 'Number of attention heads.')
    p.Define('hidden_dim', 0, 'Feed-forward width.')
    p.Define('has_aux_atten', False, 'Cross-attention over aux_vecs.')
    p.Define('mask_self_atten', False, 'Causal self-attention.')
    p.Define('atten_dropout_prob', 0.0, 'Attention-probability dropout.')
    p.Define('residual_dropout_prob', 0.0, 'Residual dropout.')
    p.Define('relu_dropout_prob', 0.0, 'Feed-forward hidden dropout.')
    p.Define('fflayer_init_scale', 1.0, 'Feed-forward init scale.')
    return p

  def _AttenParams(self, masked):
    p = self.params
    return TransformerAttentionLayer.Params().Set(
      source_dim=p.source_dim,
      num_attention_heads=p.num_attention_heads,
      is_masked=masked,
      atten_dropout_prob=p.atten_dropout_prob,
      residual_dropout_prob=p.residual_dropout_prob,
    )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild('self_atten', self._AttenParams(p.mask_self_atten))
    if p.has_aux_atten:
      self.CreateChild('aux_atten', self._AttenParams(False))
    self.CreateChild(
      'fflayer',
      TransformerFeedForwardLayer.Params().Set(
        input_dim=p.source_dim,
        hidden_dim=p.hidden_dim,
        residual_dropout_prob=p.residual_dropout_prob,
        relu_dropout_prob=p.relu_dropout_prob,
        fflayer_init_scale=p.fflayer_init_scale,
      ),
    )

  def FProp(
    self, theta, inputs, paddings=None, aux_vecs=None, aux_paddings=None
  ):
    """Args: inputs [b, t, d]; paddings [b, t]; aux_vecs [b, s, d];
    aux_paddings [b, s]. Returns [b, t, d]."""
    x = self.self_atten.FProp(theta.self_atten, inputs, paddings)
    if self.params.has_aux_atten:
      if aux_vecs is None:
        raise ValueError(
          f'{self.path}: has_aux_atten needs aux_vecs (the encoder output).'
        )
      x = self.aux_atten.FProp(theta.aux_atten, x, aux_paddings, aux_vecs)
    return self.fflayer.FProp(theta.fflayer, x)

  @classmethod
  def FPropMeta(
    cls, p, inputs, paddings=None, aux_vecs=None, aux_paddings=None
  ):
    x = tf.TensorShape(inputs)
    atten = TransformerAttentionLayer.Params().Set(
      source_dim=p.source_dim, num_attention_heads=p.num_attention_heads
    )
    flops = TransformerAttentionLayer.FPropMeta(atten, x).flops
    if p.has_aux_atten:
      flops += TransformerAttentionLayer.FPropMeta(
        atten, x, None, tf.TensorShape(aux_vecs)
      ).flops
    ff = TransformerFeedForwardLayer.Params().Set(
      input_dim=p.source_dim, hidden_dim=p.hidden_dim
    )
    flops += TransformerFeedForwardLayer.FPropMeta(ff, x).flops
    return meta.Meta(flops, x)
