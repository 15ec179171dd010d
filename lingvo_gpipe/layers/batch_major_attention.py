"""Lingvo's batch-major Transformer layers ([batch, time, dim]), Lingvo's math.

The layers of Lingvo's `batch_major_attention` that its GPipe language
model stacks, with Lingvo's Params, child names and computation, so that
Lingvo's weights load by path:

  MultiHeadedAttention    `query`, `key`, `value` projections to [b, t, n, h],
                          queries scaled per dimension (`per_dim_scale`:
                          softplus(x) / softplus(0) / sqrt(h)), dot-product
                          attention, the `post` projection back to [b, t, d].
  TransformerAttentionLayer  out = x + dropout(attention(LN(x), ...)): the
                          residual adds the unnormalized input by default
                          here (unlike the time-major layer).
  TransformerLayer        self-attention, [cross-attention], Lingvo's
                          feed-forward layer (`layers_with_attention`).
  GPipeBatchMajorTransformerLayer  the stack's layer: a 7-tuple in and out,
                          an optional output layer norm.

Packed inputs (segment masks) and the other attention variants are refused
at build with one line.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import attention
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import layers_with_attention
from lingvo_gpipe.layers import normalizations

__all__ = [
  'GPipeBatchMajorTransformerLayer',
  'MultiHeadedAttention',
  'PerDimScaleLayer',
  'TransformerAttentionLayer',
  'TransformerLayer',
]

_ONLY_UNPACKED = (False, 'give one sequence per row.')


class PerDimScaleLayer(base_layer.BaseLayer):
  """x * softplus(per_dim_scale) / softplus(0) / sqrt(dim)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Number of dims of the last axis.')
    return p

  def __init__(self, params):
    super().__init__(params)
    _shapes.CheckPositive(self.params, 'dim')
    self.CreateVariable(
      'per_dim_scale',
      py_utils.WeightParams(
        [self.params.dim], py_utils.WeightInit.Constant(0.0)
      ),
    )

  def FProp(self, theta, inputs):
    dim = self.params.dim
    zero = tf.constant(0.0, inputs.dtype)
    scale = tf.math.rsqrt(tf.cast(dim, inputs.dtype)) / tf.nn.softplus(zero)
    return inputs * (scale * tf.nn.softplus(theta.per_dim_scale))


class MultiHeadedAttention(base_layer.BaseLayer):
  """Lingvo's batch-major multi-headed dot-product attention."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the query, key and value vectors.')
    p.Define('hidden_dim', 0, 'Depth of all heads together.')
    p.Define('num_heads', 1, 'Number of heads.')
    p.Define('dropout_tpl', dropout.DropoutLayer.Params(), 'Dropout Params.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout of the attention probs.')
    p.Define('enable_query_scale', True, 'Scale the queries.')
    p.Define(
      'enable_per_dim_scale',
      True,
      'With enable_query_scale: learned per-dim scale, else 1/sqrt(h).',
    )
    p.Define('use_bias', True, 'Biases on the projections.')
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define('enable_scaling_code_motion', False, 'Only False.')
    p.Define('atten_logit_cap', 0.0, 'Only 0 (no cap).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'packed_input': _ONLY_UNPACKED,
        'enable_scaling_code_motion': (False, 'remove it.'),
        'atten_logit_cap': (0.0, 'remove it: logits are not capped.'),
      },
    )
    _shapes.CheckPositive(p, 'input_dim', 'hidden_dim', 'num_heads')
    if p.hidden_dim % p.num_heads:
      raise ValueError(
        f'{_shapes.LayerName(p)}: hidden_dim={p.hidden_dim} is not a '
        f'multiple of num_heads={p.num_heads}; change one of them.'
      )
    h = p.hidden_dim // p.num_heads
    proj = attention.MultiHeadedProjectionLayer.Params().Set(
      input_dim=p.input_dim, num_heads=p.num_heads, dim_per_head=h
    )
    proj.use_bias = p.use_bias
    for name in ('key', 'query', 'value'):
      self.CreateChild(name, proj.Copy().Set(name=name))
    if p.enable_query_scale and p.enable_per_dim_scale:
      self.CreateChild(
        'per_dim_scale',
        PerDimScaleLayer.Params().Set(name='per_dim_scale', dim=h),
      )
    self.CreateChild(
      'atten_dropout',
      p.dropout_tpl.Copy().Set(
        name='atten_dropout', keep_prob=1.0 - p.atten_dropout_prob
      ),
    )
    self.CreateChild(
      'post', proj.Copy().Set(name='post', is_output_projection=True)
    )

  def FProp(
    self,
    theta,
    query_vec,
    key_vec,
    value_vec,
    paddings,
    segment_mask=None,
    per_step_padding=None,
  ):
    """query_vec [b, t, d], key/value_vec [b, s, d], paddings [b, s];
    per_step_padding [b, t, s] (1: masked). Returns ([b, t, d], probs
    [b, n, t, s])."""
    del segment_mask  # Only without packed inputs.
    p = self.params
    q = self.query.FProp(theta.query, query_vec)
    k = self.key.FProp(theta.key, key_vec)
    v = self.value.FProp(theta.value, value_vec)
    if p.enable_query_scale:
      if p.enable_per_dim_scale:
        q = self.per_dim_scale.FProp(theta.per_dim_scale, q)
      else:
        q *= (p.hidden_dim // p.num_heads) ** -0.5
    logits = tf.einsum('BTNH,BSNH->BNTS', q, k)
    pad = tf.cast(paddings, logits.dtype)[:, None, None, :] > 0.0
    if per_step_padding is not None:
      step = tf.cast(per_step_padding, logits.dtype)[:, None] > 0.0
      pad = tf.logical_or(pad, step)
    very_negative = tf.constant(-0.7 * logits.dtype.max, logits.dtype)
    probs = tf.nn.softmax(tf.where(pad, very_negative, logits), axis=-1)
    probs = self.atten_dropout.FProp(theta.atten_dropout, probs)
    ctx = tf.einsum('BNTS,BSNH->BTNH', probs, v)
    return self.post.FProp(theta.post, ctx), probs


class TransformerAttentionLayer(base_layer.BaseLayer):
  """Layer norm, attention, dropout and the residual add (batch-major)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input and output.')
    p.Define('hidden_dim', 0, 'Depth of the attention; 0: input_dim.')
    p.Define('num_heads', 8, 'Number of heads.')
    p.Define('is_masked', False, 'Causal self-attention.')
    p.Define(
      'ln_tpl',
      normalizations.LayerNorm.Params().Set(direct_scale=False),
      'Layer norm Params.',
    )
    p.Define('atten_tpl', MultiHeadedAttention.Params(), 'Attention Params.')
    p.Define('dropout_tpl', dropout.DropoutLayer.Params(), 'Dropout Params.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout of the attention probs.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout before the residual add.')
    p.Define(
      'add_unnormalized_input',
      True,
      'The residual adds the input before the layer norm.',
    )
    p.Define('add_skip_connection', True, 'Add the residual.')
    p.Define('pre_layer_norm', True, 'Layer norm before; False: after.')
    p.Define('primer_hybrid_norm', False, 'Only False.')
    p.Define('residual_droppath_prob', 0.0, 'Only 0.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'primer_hybrid_norm': (False, 'remove it.'),
        'residual_droppath_prob': (0.0, 'use residual_dropout_prob.'),
      },
    )
    _shapes.CheckPositive(p, 'input_dim')
    self.CreateChild(
      'atten',
      p.atten_tpl.Copy().Set(
        name='multihead_atten',
        input_dim=p.input_dim,
        hidden_dim=p.hidden_dim or p.input_dim,
        num_heads=p.num_heads,
        atten_dropout_prob=p.atten_dropout_prob,
      ),
    )
    if p.ln_tpl:
      self.CreateChild(
        'layer_norm',
        p.ln_tpl.Copy().Set(name='atten_ln', input_dim=p.input_dim),
      )
    self.CreateChild(
      'residual_dropout',
      p.dropout_tpl.Copy().Set(
        name='residual_dropout', keep_prob=1.0 - p.residual_dropout_prob
      ),
    )

  def FProp(
    self,
    theta,
    query_vec,
    source_vecs,
    paddings,
    per_step_padding_override=None,
    segment_mask=None,
  ):
    """query_vec [b, t, d]; source_vecs [b, s, d] (None: self-attention);
    paddings [b, s]. Returns ([b, t, d], probs)."""
    p = self.params
    b, t = py_utils.GetShape(query_vec, 2)
    unnormalized = query_vec
    if p.pre_layer_norm and p.ln_tpl:
      query_vec = self.layer_norm.FProp(theta.layer_norm, query_vec)
    if source_vecs is None:
      source_vecs = query_vec
    step = per_step_padding_override
    if step is None and p.is_masked:
      ones = tf.ones([t, t], query_vec.dtype)
      causal = 1.0 - tf.linalg.band_part(ones, -1, 0)
      step = tf.tile(causal[None], [b, 1, 1])
    ctx, probs = self.atten.FProp(
      theta.atten,
      query_vec,
      source_vecs,
      source_vecs,
      paddings,
      segment_mask=segment_mask,
      per_step_padding=step,
    )
    ctx = self.residual_dropout.FProp(theta.residual_dropout, ctx)
    if p.add_skip_connection:
      ctx += unnormalized if p.add_unnormalized_input else query_vec
    if not p.pre_layer_norm and p.ln_tpl:
      ctx = self.layer_norm.FProp(theta.layer_norm, ctx)
    return ctx, probs


class TransformerLayer(base_layer.BaseLayer):
  """Self-attention, [cross-attention], feed-forward (batch-major)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input.')
    p.Define('output_dim', 0, 'Only 0 or input_dim.')
    p.Define('num_heads', None, 'Heads of the attentions (if set).')
    p.Define('has_aux_atten', False, 'Cross-attention over aux_vec.')
    p.Define('mask_self_atten', False, 'Causal self-attention.')
    p.Define(
      'tr_atten_tpl', TransformerAttentionLayer.Params(), 'Attention Params.'
    )
    p.Define(
      'tr_self_atten_tpl', None, 'Self-attention Params; None: tr_atten_tpl.'
    )
    p.Define(
      'tr_fflayer_tpl',
      layers_with_attention.TransformerFeedForwardLayer.Params().Set(
        hidden_dim=2048
      ),
      'Feed-forward layer Params.',
    )
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(p, {'packed_input': _ONLY_UNPACKED})
    _shapes.CheckPositive(p, 'input_dim')

    def Atten(tpl, name, masked):
      ap = tpl.Copy().Set(name=name, input_dim=p.input_dim, is_masked=masked)
      if p.num_heads:
        ap.num_heads = p.num_heads
      return ap

    self_tpl = p.tr_self_atten_tpl or p.tr_atten_tpl
    self.CreateChild(
      'self_atten',
      Atten(self_tpl, 'multihead_self_atten', p.mask_self_atten),
    )
    if p.has_aux_atten:
      self.CreateChild(
        'cross_atten', Atten(p.tr_atten_tpl, 'multihead_cross_atten', False)
      )
    self.CreateChild(
      'fflayer',
      p.tr_fflayer_tpl.Copy().Set(
        name='tr_fflayer', input_dim=p.input_dim, output_dim=p.output_dim
      ),
    )

  def FProp(
    self,
    theta,
    query_vec,
    paddings,
    aux_vec=None,
    aux_paddings=None,
    per_step_padding_override=None,
    segment_mask=None,
    aux_segment_mask=None,
  ):
    """query_vec [b, t, d], paddings [b, t]; aux_* the encoder's."""
    p = self.params
    h, probs = self.self_atten.FProp(
      theta.self_atten, query_vec, None, paddings, per_step_padding_override
    )
    if p.has_aux_atten:
      h, probs = self.cross_atten.FProp(
        theta.cross_atten, h, aux_vec, aux_paddings
      )
    h = self.fflayer.FProp(theta.fflayer, h, paddings)
    return h, probs


class GPipeBatchMajorTransformerLayer(TransformerLayer):
  """The layer of `GPipeBatchMajorTransformerStack`: the 7-tuple in and out

  (source_vecs, source_paddings, target_vecs, target_paddings,
   encoder_self_atten_segment_mask, decoder_self_atten_segment_mask,
   decoder_cross_atten_segment_mask)
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'ln_tpl',
      normalizations.LayerNorm.Params().Set(direct_scale=False),
      'Params of the output layer norm.',
    )
    p.Define('output_layer_norm', False, 'Layer-normalize the output.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.output_layer_norm:
      self.CreateChild(
        'layer_norm',
        p.ln_tpl.Copy().Set(name='output_ln', input_dim=p.input_dim),
      )

  @classmethod
  def SetupDeterministicDropout(cls, params):
    """Lingvo's switch of every dropout to DeterministicDropoutLayer."""
    det = dropout.DeterministicDropoutLayer.Params()
    params.tr_atten_tpl.dropout_tpl = det.Copy()
    params.tr_atten_tpl.atten_tpl.dropout_tpl = det.Copy()
    params.tr_fflayer_tpl.residual_dropout_tpl = det.Copy()
    params.tr_fflayer_tpl.fflayer_tpl.dropout = det.Copy()
    return params

  def FProp(
    self,
    theta,
    source_vecs,
    source_paddings,
    target_vecs,
    target_paddings,
    encoder_self_atten_segment_mask,
    decoder_self_atten_segment_mask,
    decoder_cross_atten_segment_mask,
  ):
    p = self.params
    masks = (
      encoder_self_atten_segment_mask,
      decoder_self_atten_segment_mask,
      decoder_cross_atten_segment_mask,
    )
    if p.has_aux_atten:
      h, _ = super().FProp(
        theta, target_vecs, target_paddings, source_vecs, source_paddings
      )
      h = tf.ensure_shape(h, target_vecs.shape)
      if p.output_layer_norm:
        h = self.layer_norm.FProp(theta.layer_norm, h)
      return (source_vecs, source_paddings, h, target_paddings) + masks
    h, _ = super().FProp(theta, source_vecs, source_paddings)
    h = tf.ensure_shape(h, source_vecs.shape)
    if p.output_layer_norm:
      h = self.layer_norm.FProp(theta.layer_norm, h)
    return (h, source_paddings, target_vecs, target_paddings) + masks

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    inputs = tf.TensorShape(inputs)
    b, t, d = inputs.as_list()
    flops = 5 * (t or 1) * (t or 1) * (b or 1) * (d or 1)
    args = [None if a is None else tf.TensorShape(a) for a in args]
    return meta.Meta(flops, inputs, *args)
