"""Lingvo's time-major Transformer layers, with Lingvo's Params and math.

`lingvo_gpipe.layers.transformer` holds the library's own (batch-major,
pre-layer-norm) blocks. This module computes what Lingvo's
`layers_with_attention` computes, on tensors shaped [time, batch, dim], with
Lingvo's child and variable names, so that Lingvo's weights load by path:

  MultiHeadedAttention     keys, queries projected (`source_proj`,
                           `query_proj` and biases), values the unprojected
                           contexts unless `enable_ctx_pre_proj`; each head
                           a dot-product attention whose queries are scaled
                           per dimension (`atten.per_dim_scale`, softplus,
                           1 at 0) and by 1/sqrt(head dim); the heads'
                           contexts concatenated, then `ctx_post_proj`.
  TransformerAttentionLayer  h = LN(x) + dropout(attention(LN(x), ...)):
                           with pre_layer_norm the residual adds the
                           normalized input, as Lingvo does (unless
                           add_unnormalized_input).
  TransformerFeedForwardLayer  h = x + w * dropout(FFN(LN(x))).
  TransformerLayer         self-attention, [cross-attention over aux_vecs],
                           feed-forward, [a final layer norm].

Lingvo Params that change the computation and are not implemented here are
refused when the layer is built, each with one line naming it and what to
do instead.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import normalizations

__all__ = [
  'DotProductAttention',
  'FeedForwardNet',
  'MultiHeadedAttention',
  'TransformerAttentionLayer',
  'TransformerFeedForwardLayer',
  'TransformerLayer',
]


def _LayerNormParams():
  """Lingvo's LayerNorm default: the scale is 1 + `scale`."""
  return normalizations.LayerNorm.Params().Set(direct_scale=False)


def _Dropout(keep_prob, tpl=None):
  tpl = tpl.Copy() if tpl is not None else dropout.DropoutLayer.Params()
  return tpl.Set(keep_prob=keep_prob)


class FeedForwardNet(base_layer.BaseLayer):
  """Projections in sequence (Lingvo's): children `fc[i]` (`fflayer_<i>`),
  each followed by `dropout[i]`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input.')
    p.Define('hidden_layer_dims', [], 'Output depth of each projection.')
    p.Define(
      'projection',
      linears.ProjectionLayer.Params(),
      'Params of each projection (input_dim, output_dim, activation set).',
    )
    p.Define(
      'activation',
      'RELU',
      'Activation of each projection: a name, or a list of one per layer.',
    )
    p.Define(
      'dropout',
      dropout.DropoutLayer.Params(),
      'Dropout after each projection: Params, or a list of one per layer.',
    )
    p.Define('batch_norm', False, 'Batch norm in every projection.')
    p.Define('has_bias', True, 'Whether the projections have biases.')
    return p

  @classmethod
  def _PerLayer(cls, p, name):
    n = len(p.hidden_layer_dims)
    v = p.Get(name)
    vs = list(v) if isinstance(v, (list, tuple)) else [v] * n
    if len(vs) != n:
      raise ValueError(
        f'{_shapes.LayerName(p)}: {name} has {len(vs)} entries for '
        f'{n} hidden_layer_dims; give one per layer.'
      )
    return vs

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim')
    acts = self._PerLayer(p, 'activation')
    drops = self._PerLayer(p, 'dropout')
    fcs, dps = [], []
    in_dim = p.input_dim
    for i, (out_dim, act) in enumerate(zip(p.hidden_layer_dims, acts)):
      fcs.append(
        p.projection.Copy().Set(
          name=f'fflayer_{i}',
          input_dim=in_dim,
          output_dim=out_dim,
          activation=act,
          batch_norm=p.batch_norm,
          has_bias=p.has_bias,
        )
      )
      dps.append(drops[i].Copy().Set(name=f'dropout_{i}'))
      in_dim = out_dim
    self.CreateChildren('fc', fcs)
    self.CreateChildren('dropout', dps)

  @property
  def output_dim(self):
    return self.params.hidden_layer_dims[-1]

  def FProp(self, theta, inputs, paddings=None):
    """inputs [..., input_dim]; paddings [..., 1] -> [..., last dim]."""
    h = inputs
    for i, fc in enumerate(self.fc):
      h = fc.FProp(theta.fc[i], h, paddings)
      h = self.dropout[i].FProp(theta.dropout[i], h)
    return h

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    dims = _shapes.Dims(inputs)
    n = _shapes.NumElements(dims[:-1])
    flops, in_dim = 0, p.input_dim
    for out_dim in p.hidden_layer_dims:
      flops += 2 * n * in_dim * out_dim
      in_dim = out_dim
    return meta.Meta(flops, tf.TensorShape(dims[:-1] + [in_dim]))


class DotProductAttention(base_layer.BaseLayer):
  """The inner attention of each head: holds `per_dim_scale` [hidden_dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Depth of the keys (of one head).')
    p.Define('query_dim', 0, 'Depth of the queries (of one head).')
    p.Define('hidden_dim', 0, 'Depth of the attention (of one head).')
    p.Define(
      'use_dim_scale',
      True,
      'Scale the queries per dimension by softplus(per_dim_scale) / '
      'softplus(0).',
    )
    p.Define('atten_dropout_prob', 0.0, 'Dropout of the attention probs.')
    p.Define(
      'atten_dropout_deterministic',
      False,
      "Lingvo's flag; dropout here is always deterministic.",
    )
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define('atten_logit_cap', None, 'Only None.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'packed_input': (False, 'give one sequence per row.'),
        'atten_logit_cap': (None, 'remove it: logits are not capped.'),
      },
    )
    if p.use_dim_scale:
      self.CreateVariable(
        'per_dim_scale',
        py_utils.WeightParams(
          [p.hidden_dim], py_utils.WeightInit.Constant(0.0)
        ),
      )

  def QueryScale(self, theta, dtype):
    """The per-dimension scale of the queries times 1/sqrt(hidden_dim)."""
    p = self.params
    scale = tf.math.rsqrt(tf.cast(p.hidden_dim, dtype))
    if not p.use_dim_scale:
      return scale
    zero = tf.constant(0.0, dtype)
    return scale * tf.nn.softplus(theta.per_dim_scale) / tf.nn.softplus(zero)


class MultiHeadedAttention(base_layer.BaseLayer):
  """Lingvo's multi-headed attention on [time, batch, dim] tensors."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Depth of the keys (source vectors).')
    p.Define('query_dim', 0, 'Depth of the queries.')
    p.Define('context_dim', 0, 'Depth of the values (source contexts).')
    p.Define('hidden_dim', 0, 'Depth of the projected keys and queries.')
    p.Define('num_attention_heads', 2, 'Number of heads.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout of the attention probs.')
    p.Define(
      'atten_dropout_deterministic',
      False,
      "Lingvo's flag; dropout here is always deterministic.",
    )
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define(
      'use_source_vec_as_attention_value',
      True,
      'The projected keys are also the values.',
    )
    p.Define('enable_source_proj', True, 'Project the keys.')
    p.Define('enable_query_proj', True, 'Project the queries.')
    p.Define(
      'inner_atten_params',
      DotProductAttention.Params(),
      'Params of the per-head attention (child `atten`, `inner_att`).',
    )
    p.Define('enable_ctx_pre_proj', False, 'Project the values (`ctx_proj`).')
    p.Define(
      'enable_ctx_post_proj',
      False,
      'Project the concatenated contexts (`ctx_post_proj`).',
    )
    p.Define('ctx_post_proj_dim', 0, 'Output depth of ctx_post_proj.')
    p.Define('num_post_proj', 1, 'Only 1.')
    p.Define(
      'proj_init',
      'default',
      "Initializer of the projections: 'default' (params_init, biases "
      "0) or 'uniform' (U(+-sqrt(1/fan_in)).",
    )
    p.Define('attention_head_prob_index', -1, 'Only -1 (the mean of heads).')
    p.Define('use_bias', True, 'Biases on the projections.')
    p.Define('enable_per_dim_scale', True, 'Per-dimension query scale.')
    p.params_init = py_utils.WeightInit.Xavier(1.0)
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    name = _shapes.LayerName(p)
    base_layer.RejectUnsupportedParams(
      p,
      {
        'packed_input': (False, 'give one sequence per row.'),
        'num_post_proj': (1, 'use one post projection.'),
        'attention_head_prob_index': (
          -1,
          'remove it: the probs returned are the mean over the heads.',
        ),
      },
    )
    if p.hidden_dim % p.num_attention_heads:
      raise ValueError(
        f'{name}: hidden_dim={p.hidden_dim} is not a multiple of '
        f'num_attention_heads={p.num_attention_heads}; change one of them.'
      )
    if p.proj_init not in ('default', 'uniform'):
      raise ValueError(
        f"{name}: proj_init={p.proj_init!r}; use 'default' or 'uniform'."
      )
    dh = p.hidden_dim // p.num_attention_heads
    self.CreateChild(
      'atten',
      p.inner_atten_params.Copy().Set(
        name=p.inner_atten_params.name or 'inner_att',
        source_dim=dh,
        query_dim=dh,
        hidden_dim=dh,
        atten_dropout_prob=p.atten_dropout_prob,
        use_dim_scale=p.enable_per_dim_scale,
      ),
    )
    self.CreateChild(
      'atten_dropout', _Dropout(1.0 - p.atten_dropout_prob).Set(name='dropout')
    )

    def Proj(var, in_dim, out_dim):
      init = None
      if p.proj_init == 'uniform':
        init = py_utils.WeightInit.Uniform((1.0 / in_dim) ** 0.5)
      self.CreateVariable(var, py_utils.WeightParams([in_dim, out_dim], init))
      if p.use_bias:
        b_init = init or py_utils.WeightInit.Constant(0.0)
        if p.proj_init == 'uniform':
          b_init = py_utils.WeightInit.Uniform((1.0 / out_dim) ** 0.5)
        self.CreateVariable(
          var + '_b', py_utils.WeightParams([out_dim], b_init)
        )

    if p.enable_source_proj:
      Proj('source_proj', p.source_dim, p.hidden_dim)
    if p.enable_query_proj:
      Proj('query_proj', p.query_dim, p.hidden_dim)
    if p.enable_ctx_pre_proj and not p.use_source_vec_as_attention_value:
      Proj('ctx_proj', p.context_dim, p.hidden_dim)
    if p.enable_ctx_post_proj:
      Proj('ctx_post_proj', p.hidden_dim, p.ctx_post_proj_dim)

  def _Project(self, theta, var, x):
    x = linears.ProjectLastDim(x, theta[var])
    if self.params.use_bias:
      x += theta[var + '_b']
    return x

  def _Heads(self, x):
    """[t, b, d] -> [t, b, heads, d / heads]."""
    n = self.params.num_attention_heads
    t, b, d = py_utils.GetShape(x, 3)
    return tf.reshape(x, [t, b, n, d // n])

  def FProp(
    self,
    theta,
    query_vec,
    source_vecs,
    source_contexts,
    source_paddings,
    per_step_padding=None,
  ):
    """Attends from each query to the source.

    Args:
      theta: this layer's weights.
      query_vec: [tq, b, query_dim].
      source_vecs: [ts, b, source_dim] (the keys).
      source_contexts: [ts, b, context_dim] (the values, unless the keys are).
      source_paddings: [ts, b], 1 where padded.
      per_step_padding: optional [tq, ts] or [tq, b, ts], 1 where query t may
        not see source position s (a causal mask).

    Returns:
      (context [tq, b, out_dim], probs [tq, b, ts] averaged over the heads).
    """
    p = self.params
    dtype = query_vec.dtype
    keys = source_vecs
    if p.enable_source_proj:
      keys = self._Project(theta, 'source_proj', keys)
    if p.use_source_vec_as_attention_value:
      values = keys
    elif p.enable_ctx_pre_proj:
      values = self._Project(theta, 'ctx_proj', source_contexts)
    else:
      values = source_contexts
    queries = query_vec
    if p.enable_query_proj:
      queries = self._Project(theta, 'query_proj', queries)
    keys, values, queries = map(self._Heads, (keys, values, queries))
    queries *= self.atten.QueryScale(theta.atten, dtype)
    logits = tf.einsum('tbnh,sbnh->bnts', queries, keys)
    pad = tf.transpose(tf.cast(source_paddings, dtype))[:, None, None, :]
    if per_step_padding is not None:
      step = tf.cast(per_step_padding, dtype)
      if step.shape.rank == 2:
        step = step[None, None]
      else:
        step = tf.transpose(step, [1, 0, 2])[:, None]
      pad += step
    very_negative = tf.constant(-0.7 * dtype.max, dtype)
    logits = tf.where(pad > 0.0, very_negative, logits)
    probs = tf.nn.softmax(logits, axis=-1)
    probs = self.atten_dropout.FProp(theta.atten_dropout, probs)
    ctx = tf.einsum('bnts,sbnh->tbnh', probs, values)
    tq, b = py_utils.GetShape(query_vec, 2)
    ctx = tf.reshape(ctx, [tq, b, -1])
    if p.enable_ctx_post_proj:
      ctx = self._Project(theta, 'ctx_post_proj', ctx)
    return ctx, tf.transpose(tf.reduce_mean(probs, axis=1), [1, 0, 2])


def _CausalPadding(p, tq, dtype):
  """[tq, tq], 1 where query t may not see position s."""
  ones = tf.ones([tq, tq], dtype)
  if p.mask_type == 'future':
    return 1.0 - tf.linalg.band_part(ones, -1, 0)
  if p.mask_type == 'eye':
    return tf.eye(tq, dtype=dtype)
  span = tf.minimum(p.mask_ngram_order - 1, tq - 1)
  return 1.0 - tf.linalg.band_part(ones, span, 0)


class TransformerAttentionLayer(base_layer.BaseLayer):
  """Layer norm, multi-headed attention, dropout and the residual add."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Depth of the input and output.')
    p.Define('context_dim', 0, 'Depth of the values; 0: source_dim.')
    p.Define('atten_hidden_dim', 0, 'Depth of the attention; 0: source_dim.')
    p.Define('num_attention_heads', 8, 'Number of heads.')
    p.Define('is_masked', False, 'Mask the self-attention (mask_type).')
    p.Define('mask_ngram_order', 0, "With mask_type 'ngram': N - 1 kept.")
    p.Define(
      'mask_type',
      'future',
      "With is_masked: 'future' (causal), 'eye' (not itself) or 'ngram'.",
    )
    p.Define('ln_tpl', _LayerNormParams(), 'Layer norm Params.')
    p.Define(
      'atten_tpl',
      MultiHeadedAttention.Params().Set(
        use_source_vec_as_attention_value=False, enable_ctx_post_proj=True
      ),
      'Multi-headed attention Params.',
    )
    p.Define('atten_dropout_prob', 0.0, 'Dropout of the attention probs.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout before the residual add.')
    p.Define(
      'residual_dropout_tpl',
      dropout.DropoutLayer.Params(),
      'Residual dropout Params (keep_prob set from residual_dropout_prob).',
    )
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define(
      'add_unnormalized_input',
      False,
      'Add the input before the layer norm in the residual (Lingvo adds '
      'the normalized one by default).',
    )
    p.Define('residual_function', None, 'Only None (a plain add).')
    p.Define(
      'pre_layer_norm',
      True,
      'Layer norm before the attention; False: after the residual add.',
    )
    p.Define('memory_augmentation', False, 'Only False.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'packed_input': (False, 'give one sequence per row.'),
        'residual_function': (None, 'remove it: the residual is a sum.'),
        'memory_augmentation': (False, 'remove it.'),
      },
    )
    _shapes.CheckPositive(p, 'source_dim')
    if p.mask_type not in ('future', 'eye', 'ngram'):
      raise ValueError(
        f"{_shapes.LayerName(p)}: mask_type={p.mask_type!r}; use 'future', "
        "'eye' or 'ngram'."
      )
    hidden = p.atten_hidden_dim or p.source_dim
    context = p.context_dim or p.source_dim
    self.CreateChild(
      'atten',
      p.atten_tpl.Copy().Set(
        name='multihead_atten',
        source_dim=p.source_dim,
        query_dim=p.source_dim,
        hidden_dim=hidden,
        context_dim=context,
        ctx_post_proj_dim=p.source_dim,
        num_attention_heads=p.num_attention_heads,
        atten_dropout_prob=p.atten_dropout_prob,
        packed_input=p.packed_input,
      ),
    )
    self.CreateChild(
      'layer_norm', p.ln_tpl.Copy().Set(name='atten_ln', input_dim=p.source_dim)
    )
    self.CreateChild(
      'residual_dropout',
      _Dropout(1.0 - p.residual_dropout_prob, p.residual_dropout_tpl).Set(
        name='residual_dropout'
      ),
    )

  def FProp(
    self,
    theta,
    query_vec,
    source_paddings,
    source_vecs=None,
    query_segment_id=None,
    source_segment_id=None,
    context_vecs=None,
  ):
    """query_vec [tq, b, d]; source_paddings [ts, b]; source_vecs [ts, b, d]
    (None: self-attention). Returns (out [tq, b, d], probs [tq, b, ts])."""
    del query_segment_id, source_segment_id  # Only without packed inputs.
    p = self.params
    unnormalized = query_vec
    if p.pre_layer_norm:
      query_vec = self.layer_norm.FProp(theta.layer_norm, query_vec)
    if source_vecs is None:
      source_vecs = query_vec
    if context_vecs is None:
      context_vecs = source_vecs
    step_padding = None
    if p.is_masked:
      tq = py_utils.GetShape(query_vec)[0]
      step_padding = _CausalPadding(p, tq, query_vec.dtype)
    ctx, probs = self.atten.FProp(
      theta.atten,
      query_vec,
      source_vecs,
      context_vecs,
      source_paddings,
      step_padding,
    )
    ctx = self.residual_dropout.FProp(theta.residual_dropout, ctx)
    h = (unnormalized if p.add_unnormalized_input else query_vec) + ctx
    if not p.pre_layer_norm:
      h = self.layer_norm.FProp(theta.layer_norm, h)
    return h, probs


class TransformerFeedForwardLayer(base_layer.BaseLayer):
  """Layer norm, a two-layer feed-forward net, dropout, the residual add."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input.')
    p.Define('output_dim', 0, 'Only 0 or input_dim (no residual projection).')
    p.Define('hidden_dim', 0, 'Depth of the hidden layer.')
    p.Define('num_tasks', 0, 'Only 0.')
    p.Define('ln_tpl', _LayerNormParams(), 'Layer norm Params.')
    p.Define('activation', 'RELU', 'Activation of the hidden layer.')
    p.Define('residual_weight', 1.0, 'out = x + residual_weight * FFN(...).')
    p.Define(
      'fflayer_tpl',
      FeedForwardNet.Params().Set(activation=['RELU', 'NONE']),
      'Feed-forward net Params.',
    )
    p.Define('residual_dropout_prob', 0.0, 'Dropout before the residual add.')
    p.Define(
      'residual_dropout_tpl',
      dropout.DropoutLayer.Params(),
      'Residual dropout Params (keep_prob set from residual_dropout_prob).',
    )
    p.Define('relu_dropout_prob', 0.0, 'Dropout of the hidden layer.')
    p.Define('add_skip_connection', True, 'Add the input to the output.')
    p.Define('pre_layer_norm', True, 'Layer norm before; False: after.')
    p.Define('primer_hybrid_norm', False, 'Only False.')
    p.Define('residual_droppath_prob', 0.0, 'Only 0.')
    p.Define('memory_augmentation', False, 'Only False.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'num_tasks': (0, 'remove it: one feed-forward net for all tasks.'),
        'primer_hybrid_norm': (False, 'remove it.'),
        'residual_droppath_prob': (0.0, 'use residual_dropout_prob.'),
        'memory_augmentation': (False, 'remove it.'),
      },
    )
    _shapes.CheckPositive(p, 'input_dim', 'hidden_dim')
    if p.output_dim not in (0, p.input_dim):
      raise ValueError(
        f'{_shapes.LayerName(p)}: output_dim={p.output_dim} differs from '
        f'input_dim={p.input_dim}, which needs a residual projection that is '
        'not supported; set output_dim to 0.'
      )
    drop = p.fflayer_tpl.dropout
    drop = drop[0] if isinstance(drop, (list, tuple)) else drop
    self.CreateChild(
      'fflayer',
      p.fflayer_tpl.Copy().Set(
        name='fflayer',
        input_dim=p.input_dim,
        activation=[p.activation, 'NONE'],
        hidden_layer_dims=[p.hidden_dim, p.input_dim],
        dropout=[
          _Dropout(1.0 - p.relu_dropout_prob, drop),
          _Dropout(1.0, drop),
        ],
      ),
    )
    self.CreateChild(
      'layer_norm',
      p.ln_tpl.Copy().Set(name='fflayer_ln', input_dim=p.input_dim),
    )
    self.CreateChild(
      'residual_dropout',
      _Dropout(1.0 - p.residual_dropout_prob, p.residual_dropout_tpl).Set(
        name='residual_dropout'
      ),
    )

  def FProp(self, theta, inputs, paddings=None):
    """inputs [t, b, d]; paddings [t, b] -> [t, b, d]."""
    p = self.params
    x = inputs
    if p.pre_layer_norm:
      x = self.layer_norm.FProp(theta.layer_norm, inputs)
    if paddings is not None:
      paddings = tf.expand_dims(paddings, -1)
    h = self.fflayer.FProp(theta.fflayer, x, paddings)
    h = self.residual_dropout.FProp(theta.residual_dropout, h)
    if p.add_skip_connection:
      h = inputs + h * p.residual_weight
    if not p.pre_layer_norm:
      h = self.layer_norm.FProp(theta.layer_norm, h)
    return h


class TransformerLayer(base_layer.BaseLayer):
  """Self-attention, optional cross-attention, feed-forward (Lingvo's)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('source_dim', 0, 'Depth of the input and output.')
    p.Define('output_dim', 0, 'Only 0 or source_dim.')
    p.Define(
      'tr_atten_tpl',
      TransformerAttentionLayer.Params().Set(num_attention_heads=8),
      'Attention layer Params.',
    )
    p.Define('tr_post_ln_tpl', None, 'Optional layer norm at the end.')
    p.Define(
      'tr_fflayer_tpl',
      TransformerFeedForwardLayer.Params().Set(hidden_dim=2048),
      'Feed-forward layer Params.',
    )
    p.Define('has_aux_atten', False, 'Cross-attention over aux_vecs.')
    p.Define(
      'tr_aux_atten_tpl', None, 'Cross-attention Params; None: tr_atten_tpl.'
    )
    p.Define('mask_self_atten', False, 'Causal self-attention.')
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define('is_decoder', False, 'Deprecated: has_aux_atten and masked.')
    p.Define('num_aux_atten_post_proj', 1, 'Only 1.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    base_layer.RejectUnsupportedParams(
      p,
      {
        'packed_input': (False, 'give one sequence per row.'),
        'num_aux_atten_post_proj': (1, 'use one post projection.'),
      },
    )
    _shapes.CheckPositive(p, 'source_dim')
    aux = p.has_aux_atten or p.is_decoder
    masked = p.mask_self_atten or p.is_decoder
    self.CreateChild(
      'self_atten',
      p.tr_atten_tpl.Copy().Set(
        name='multihead_self_atten', source_dim=p.source_dim, is_masked=masked
      ),
    )
    if aux:
      tpl = p.tr_aux_atten_tpl or p.tr_atten_tpl
      self.CreateChild(
        'atten',
        tpl.Copy().Set(name='multihead_atten', source_dim=p.source_dim),
      )
    self.CreateChild(
      'fflayer',
      p.tr_fflayer_tpl.Copy().Set(
        name='tr_fflayer', input_dim=p.source_dim, output_dim=p.output_dim
      ),
    )
    if p.tr_post_ln_tpl:
      self.CreateChild(
        'layer_norm',
        p.tr_post_ln_tpl.Copy().Set(
          name='tr_post_layer_norm', input_dim=p.source_dim
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
    """source_vecs [t, b, d], source_paddings [t, b]; aux_* the encoder's.
    Returns (out [t, b, d], the last attention's probs)."""
    p = self.params
    h, probs = self.self_atten.FProp(
      theta.self_atten, source_vecs, source_paddings
    )
    if p.has_aux_atten or p.is_decoder:
      if aux_vecs is None or aux_paddings is None:
        raise ValueError(
          f'{self.path}: has_aux_atten needs aux_vecs and aux_paddings (the '
          'encoder output and its paddings).'
        )
      h, probs = self.atten.FProp(theta.atten, h, aux_paddings, aux_vecs)
    h = self.fflayer.FProp(theta.fflayer, h, source_paddings)
    if p.tr_post_ln_tpl:
      h = self.layer_norm.FProp(theta.layer_norm, h)
    return h, probs
