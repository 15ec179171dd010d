"""Batch-major multi-headed attention (Lingvo's `MultiHeadedAttention`).

Shapes: b = batch, t = query length, s = key length, d = input_dim,
n = num_heads, h = dim_per_head (hidden_dim = n * h).

  q = query_vec @ Wq  [b, t, n, h]     k = key_vec @ Wk    [b, s, n, h]
  v = value_vec @ Wv  [b, s, n, h]     probs = softmax(q k^T / sqrt(h))
  encoded = (probs @ v) @ Wpost        [b, t, d]

Masked positions (paddings, per-step paddings, causal) get a large negative
logit. Attention dropout is a stateless `DropoutLayer` child.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import dropout

__all__ = [
  'MultiHeadedProjectionLayer',
  'MultiHeadedAttention',
  'CausalPaddings',
]


def CausalPaddings(query_len, key_len, dtype=tf.float32):
  """[t, s] paddings: 1.0 where key j > query i (the future)."""
  if isinstance(query_len, int) and isinstance(key_len, int):
    # Lengths known when traced: one constant, not two ranges and a compare.
    future = np.arange(key_len)[np.newaxis, :] > np.arange(query_len)[:, None]
    return tf.constant(future.astype(dtype.as_numpy_dtype))
  i = tf.range(query_len)[:, tf.newaxis]
  j = tf.range(key_len)[tf.newaxis, :]
  return tf.cast(j > i, dtype)


def _Reshaped(x, shape):
  """`x` reshaped to `shape` (ints, and 'x' for each dim of x in order): a
  reshape to a constant shape where x's shape is known when traced."""
  dims = iter(py_utils.GetShape(x))
  return tf.reshape(x, [next(dims) if d == 'x' else d for d in shape])


class MultiHeadedProjectionLayer(base_layer.BaseLayer):
  """Projects [b, t, d] -> [b, t, n, h], or back if is_output_projection.

  Variables: `w` [input_dim, num_heads, dim_per_head] and `b` ([num_heads,
  dim_per_head], or [input_dim] for the output projection).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Model dimension d.')
    p.Define('num_heads', 0, 'Number of heads n.')
    p.Define('dim_per_head', 0, 'Size of each head h.')
    p.Define(
      'is_output_projection',
      False,
      'True: [b, t, n, h] -> [b, t, d]; False: [b, t, d] -> [b, t, n, h].',
    )
    p.Define('use_bias', True, 'Whether to add a bias.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim', 'num_heads', 'dim_per_head')
    self.CreateVariable(
      'w', py_utils.WeightParams([p.input_dim, p.num_heads, p.dim_per_head])
    )
    if p.use_bias:
      shape = (
        [p.input_dim]
        if p.is_output_projection
        else [p.num_heads, p.dim_per_head]
      )
      self.CreateVariable(
        'b', py_utils.WeightParams(shape, py_utils.WeightInit.Constant(0.0))
      )

  def FProp(self, theta, inputs):
    """[b, t, d] -> [b, t, n, h] (or [b, t, n, h] -> [b, t, d])."""
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    if p.is_output_projection:
      _shapes.CheckShape(
        self,
        'inputs',
        inputs.shape,
        [None, None, p.num_heads, p.dim_per_head],
        'Expected [batch, time, num_heads, dim_per_head].',
      )
      out = tf.einsum('BTNH,DNH->BTD', inputs, theta.w)
    else:
      _shapes.CheckShape(
        self,
        'inputs',
        inputs.shape,
        [None, None, p.input_dim],
        f'Expected [batch, time, input_dim={p.input_dim}].',
      )
      out = tf.einsum('BTD,DNH->BTNH', inputs, theta.w)
    if p.use_bias:
      out += theta.b
    return out


class MultiHeadedAttention(base_layer.BaseLayer):
  """Multi-headed dot-product attention.

  Children: `query`, `key`, `value`, `post` (MultiHeadedProjectionLayer) and
  `atten_dropout` (DropoutLayer).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Model dimension d of query/key/value vectors.')
    p.Define('hidden_dim', 0, 'Total size of the heads, num_heads * h.')
    p.Define('num_heads', 1, 'Number of heads n.')
    p.Define(
      'dim_per_head',
      None,
      'Size h of each head; None: hidden_dim // num_heads.',
    )
    p.Define(
      'atten_dropout_prob',
      0.0,
      'Dropout probability of the attention probabilities.',
    )
    p.Define(
      'enable_query_scale',
      True,
      'Whether to scale the queries by 1 / sqrt(dim_per_head).',
    )
    p.Define('use_bias', True, 'Whether the projections have biases.')
    p.Define(
      'causal',
      False,
      "Default of FProp's `causal`: True masks keys after the query "
      'position (self-attention of a decoder).',
    )
    return p

  @classmethod
  def _DimPerHead(cls, p):
    return p.dim_per_head or p.hidden_dim // p.num_heads

  @classmethod
  def _Validate(cls, p):
    _shapes.CheckPositive(p, 'input_dim', 'hidden_dim', 'num_heads')
    if p.dim_per_head is None and p.hidden_dim % p.num_heads:
      raise ValueError(
        f'{_shapes.LayerName(p)}: hidden_dim = {p.hidden_dim} is not '
        f'divisible by num_heads = {p.num_heads}; change one of them or set '
        'dim_per_head.'
      )
    if not 0.0 <= p.atten_dropout_prob < 1.0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: p.atten_dropout_prob = '
        f'{p.atten_dropout_prob!r} must be in [0, 1).'
      )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    proj = MultiHeadedProjectionLayer.Params().Set(
      input_dim=p.input_dim,
      num_heads=p.num_heads,
      dim_per_head=self._DimPerHead(p),
      use_bias=p.use_bias,
    )
    self.CreateChild('query', proj)
    self.CreateChild('key', proj)
    self.CreateChild('value', proj)
    self.CreateChild('post', proj.Copy().Set(is_output_projection=True))
    self.CreateChild(
      'atten_dropout',
      dropout.DropoutLayer.Params().Set(keep_prob=1.0 - p.atten_dropout_prob),
    )

  def _CheckInputs(self, query_vec, key_vec, value_vec, paddings):
    d = self.params.input_dim
    q = _shapes.CheckShape(
      self,
      'query_vec',
      query_vec.shape,
      [None, None, d],
      f'Expected [batch, time, input_dim={d}].',
    )
    k = _shapes.CheckShape(
      self,
      'key_vec',
      key_vec.shape,
      [q[0], None, d],
      f'Expected [batch, src_time, input_dim={d}] with the batch of query_vec.',
    )
    _shapes.CheckShape(
      self,
      'value_vec',
      value_vec.shape,
      k,
      'value_vec must have the shape of key_vec.',
    )
    _shapes.CheckShape(
      self,
      'paddings',
      paddings.shape,
      k[:2],
      'paddings must be [batch, src_time] of key_vec.',
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
    causal=None,
  ):
    """Attends from queries to keys/values.

    Args:
      theta: NestedMap of the children's weights.
      query_vec: [b, t, d].
      key_vec: [b, s, d].
      value_vec: [b, s, d].
      paddings: [b, s], 1.0 = padded key.
      segment_mask: optional additive mask [b, 1, t, s] (Lingvo's).
      per_step_padding: optional [b, t, s], 1.0 = key hidden from that query.
      causal: True masks key j > query i; None: p.causal.

    Returns:
      (encoded [b, t, d], atten_probs [b, n, t, s]).
    """
    p = self.params
    if causal is None:
      causal = p.causal
    dtype = self.fprop_dtype
    query_vec, key_vec, value_vec = (
      _shapes.CastFloat(x, dtype) for x in (query_vec, key_vec, value_vec)
    )
    paddings = tf.cast(paddings, dtype)
    self._CheckInputs(query_vec, key_vec, value_vec, paddings)
    q = self.query.FProp(theta.query, query_vec)
    k = self.key.FProp(theta.key, key_vec)
    v = self.value.FProp(theta.value, value_vec)
    if p.enable_query_scale:
      q *= tf.cast(self._DimPerHead(p) ** -0.5, q.dtype)
    logits = tf.einsum('BTNH,BSNH->BNTS', q, k)
    if segment_mask is not None:
      logits += tf.cast(segment_mask, logits.dtype)
    mask = _Reshaped(paddings, ['x', 1, 1, 'x'])
    if per_step_padding is not None:
      _shapes.CheckShape(
        self,
        'per_step_padding',
        per_step_padding.shape,
        [query_vec.shape[0], query_vec.shape[1], key_vec.shape[1]],
        'per_step_padding must be [batch, time, src_time].',
      )
      mask = tf.maximum(
        mask, tf.cast(per_step_padding, dtype)[:, tf.newaxis, :, :]
      )
    if causal:
      causal_pad = CausalPaddings(
        py_utils.GetShape(q)[1], py_utils.GetShape(k)[1], dtype
      )
      mask = tf.maximum(mask, _Reshaped(causal_pad, [1, 1, 'x', 'x']))
    very_negative = tf.cast(-0.7 * logits.dtype.max, logits.dtype)
    logits = tf.where(mask > 0, very_negative, logits)
    probs = tf.nn.softmax(logits, axis=-1)
    dropped = self.atten_dropout.FProp(theta.atten_dropout, probs)
    context = tf.einsum('BNTS,BSNH->BTNH', dropped, v)
    encoded = self.post.FProp(theta.post, context)
    return encoded, probs

  @classmethod
  def FPropMeta(cls, p, query_vec, key_vec, value_vec, paddings, *unused):
    cls._Validate(p)
    d = p.input_dim
    q = _shapes.CheckShape(
      p,
      'query_vec',
      query_vec,
      [None, None, d],
      f'Expected [batch, time, input_dim={d}].',
    )
    k = _shapes.CheckShape(
      p,
      'key_vec',
      key_vec,
      [q[0], None, d],
      f'Expected [batch, src_time, input_dim={d}].',
    )
    _shapes.CheckShape(
      p, 'value_vec', value_vec, k, 'value_vec must have the shape of key_vec.'
    )
    _shapes.CheckShape(
      p,
      'paddings',
      paddings,
      k[:2],
      'paddings must be [batch, src_time] of key_vec.',
    )
    n, h = p.num_heads, cls._DimPerHead(p)
    bt = _shapes.NumElements(q[:2])
    bs = _shapes.NumElements(k[:2])
    bnts = bt * n * _shapes.NumElements(k[1:2])
    flops = (
      2 * bt * d * n * h * 2  # query and post projections
      + 2 * bs * d * n * h * 2  # key and value projections
      + 2 * bnts * h * 2  # logits and context
      + 6 * bnts
    )  # scale, mask, softmax
    return meta.Meta(
      flops, tf.TensorShape(q), tf.TensorShape([q[0], n, q[1], k[1]])
    )
