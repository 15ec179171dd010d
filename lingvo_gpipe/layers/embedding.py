"""`SimpleEmbeddingLayer`: an embedding table looked up with `tf.gather`;
`PositionalEmbeddingLayer`: sinusoidal position embeddings.

The table `wm` is [vocab_size, embedding_dim]. With `shared_weight_name`, the
table is created as `WeightParams(shared_name=...)`, so a
`softmax.SimpleFullSoftmax` with the same `shared_weight_name` (and
`use_num_classes_major_weight=True`, i.e. its weight is [num_classes,
input_dim]) under the same root layer uses the very same variable: the
embedding and the softmax are tied, and the gradients of both uses add up.
"""

import math

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes

__all__ = ['PositionalEmbeddingLayer', 'SimpleEmbeddingLayer']


class SimpleEmbeddingLayer(base_layer.BaseLayer):
  """Embedding lookup: ids [batch, time] (int) -> [batch, time, dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of rows of the table (ids in [0, V)).')
    p.Define('embedding_dim', 0, 'Width of each embedding.')
    p.Define(
      'scale_sqrt_depth',
      False,
      'If True, multiply the embeddings by sqrt(embedding_dim).',
    )
    p.Define(
      'shared_weight_name',
      None,
      'If set, the table is shared (tied) with every layer under the '
      'same root that creates a weight with this shared name, e.g. a '
      'SimpleFullSoftmax.',
    )
    return p

  @classmethod
  def _Validate(cls, p):
    _shapes.CheckPositive(p, 'vocab_size', 'embedding_dim')

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self.CreateVariable(
      'wm',
      py_utils.WeightParams(
        [p.vocab_size, p.embedding_dim], shared_name=p.shared_weight_name
      ),
    )

  def EmbLookup(self, theta, ids):
    """Looks up `ids` (any shape, integer) -> [..., embedding_dim]."""
    p = self.params
    ids = tf.convert_to_tensor(ids)
    if not ids.dtype.is_integer:
      raise TypeError(
        f'{_shapes.LayerName(self)}: ids have dtype {ids.dtype.name}; they '
        'must be integers (e.g. int32). Cast them with tf.cast(ids, '
        'tf.int32) if they hold whole numbers.'
      )
    out = tf.gather(theta.wm, ids)
    if p.scale_sqrt_depth:
      out *= tf.cast(p.embedding_dim**0.5, out.dtype)
    return out

  def FProp(self, theta, ids):
    """Embeds `ids`.

    Args:
      theta: NestedMap(wm [vocab_size, embedding_dim]).
      ids: int [batch, time] (any rank works).

    Returns:
      [batch, time, embedding_dim].
    """
    return self.EmbLookup(theta, ids)

  @classmethod
  def FPropMeta(cls, p, ids):
    cls._Validate(p)
    dims = _shapes.Dims(ids)
    out = dims + [p.embedding_dim]
    flops = _shapes.NumElements(out) if p.scale_sqrt_depth else 0
    return meta.Meta(flops, tf.TensorShape(out))


class PositionalEmbeddingLayer(base_layer.BaseLayer):
  """Sinusoidal position embeddings (Vaswani et al.), Lingvo's layer.

  Position t, channel i < d/2: sin(t * r_i); channel d/2 + i: cos(t * r_i),
  with r_i = min_timescale * exp(-i * log(max/min) / max(1, d/2 - 1)); an odd
  embedding_dim gets a zero last channel. No weights.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('min_timescale', 1, 'The shortest period (in positions).')
    p.Define('max_timescale', 10000, 'The longest period (in positions).')
    p.Define('embedding_dim', 0, 'Width of each embedding.')
    p.Define(
      'trainable_scaling',
      False,
      "Lingvo's learned scale of the signal; only False here.",
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'embedding_dim', 'min_timescale', 'max_timescale')
    base_layer.RejectUnsupportedParams(
      p,
      {
        'trainable_scaling': (
          False,
          'remove it: the sinusoids are added unscaled.',
        )
      },
    )

  def FPropWithPosition(self, theta, positions):
    """positions [batch, time] (numbers) -> [batch, time, embedding_dim]."""
    del theta
    p = self.params
    dtype = self.fprop_dtype
    half = p.embedding_dim // 2
    increment = math.log(float(p.max_timescale) / p.min_timescale) / max(
      1.0, half - 1.0
    )
    inv = p.min_timescale * tf.exp(tf.range(half, dtype=dtype) * -increment)
    scaled = tf.expand_dims(tf.cast(positions, dtype), 2) * tf.reshape(
      inv, [1, 1, -1]
    )
    signal = tf.concat([tf.sin(scaled), tf.cos(scaled)], axis=2)
    if p.embedding_dim % 2:
      signal = tf.pad(signal, [[0, 0], [0, 0], [0, 1]])
    return signal

  def FProp(self, theta, seq_length):
    """[seq_length, embedding_dim] for positions 0 .. seq_length - 1."""
    positions = tf.reshape(tf.range(seq_length), [1, -1])
    out = self.FPropWithPosition(theta, positions)
    return tf.reshape(out, [seq_length, self.params.embedding_dim])

  @classmethod
  def FPropMeta(cls, p, seq_length):
    return meta.Meta(0, tf.TensorShape([None, p.embedding_dim]))
