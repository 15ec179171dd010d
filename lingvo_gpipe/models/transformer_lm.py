"""A pipelined Transformer language model whose last cell computes the loss.

The model of the GPipe paper's Table 1 (Transformer-L): a token embedding,
L Transformer layers and a softmax over the vocabulary, untied. As a flat
layer list for `PipeliningLayer(layers=...)`:

  LmInput        (ids [b, t], labels [b, t]) -> (x [b, t, d], labels)
  LmBlock x L    (x, labels) -> (TransformerLayer(x), labels)
  LmLoss         (x, labels) -> per-example loss [b]

The labels ride along with the activations, so the last cell computes each
micro-batch's loss itself: the pipeline's output is one number per example
instead of logits [b, t, vocab], and the softmax's activations are
micro-batched and re-materialized like every other layer's. The training
loss is the mean of the pipeline's output.

    layers = transformer_lm.LayerParams(num_layers=12, model_dim=128,
                                        hidden_dim=512, num_heads=2,
                                        vocab_size=2048)
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='lm', layers=layers, num_stages=4, num_micro_batches=16,
        balance_by='params').Instantiate()
    loss = tf.reduce_mean(pipe(ids, labels))
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.layers import embedding
from lingvo_gpipe.layers import softmax
from lingvo_gpipe.layers import transformer

__all__ = ['LmInput', 'LmBlock', 'LmLoss', 'LayerParams']


class LmInput(base_layer.BaseLayer):
  """Embeds the token ids and passes the labels on."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Vocabulary size.')
    p.Define('model_dim', 0, 'Embedding (model) dimension.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild(
      'emb',
      embedding.SimpleEmbeddingLayer.Params().Set(
        vocab_size=p.vocab_size,
        embedding_dim=p.model_dim,
        scale_sqrt_depth=True,
      ),
    )

  def FProp(self, theta, ids, labels):
    return self.emb.FProp(theta.emb, ids), labels

  @classmethod
  def FPropMeta(cls, p, ids, labels):
    ids = tf.TensorShape(ids)
    out = ids.concatenate([p.model_dim])
    return meta.Meta(out.num_elements(), out, tf.TensorShape(labels))


class LmBlock(base_layer.BaseLayer):
  """A Transformer layer (causal self-attention) that passes the labels on."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('model_dim', 0, 'Model dimension.')
    p.Define('hidden_dim', 0, 'Feed-forward width.')
    p.Define('num_heads', 1, 'Attention heads.')
    return p

  @classmethod
  def _LayerParams(cls, p):
    return transformer.TransformerLayer.Params().Set(
      source_dim=p.model_dim,
      hidden_dim=p.hidden_dim,
      num_attention_heads=p.num_heads,
      mask_self_atten=True,
    )

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('layer', self._LayerParams(self.params))

  def FProp(self, theta, x, labels):
    return self.layer.FProp(theta.layer, x), labels

  @classmethod
  def FPropMeta(cls, p, x, labels):
    m = transformer.TransformerLayer.FPropMeta(cls._LayerParams(p), x)
    return meta.Meta(m.flops, tf.TensorShape(x), tf.TensorShape(labels))


class LmLoss(base_layer.BaseLayer):
  """Softmax over the vocabulary: per-example mean cross-entropy [b]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Vocabulary size.')
    p.Define('model_dim', 0, 'Input dimension.')
    return p

  @classmethod
  def _SoftmaxParams(cls, p):
    return softmax.SimpleFullSoftmax.Params().Set(
      input_dim=p.model_dim, num_classes=p.vocab_size
    )

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('softmax', self._SoftmaxParams(self.params))

  def FProp(self, theta, x, labels):
    out = self.softmax.XentLoss(theta.softmax, x, class_ids=labels)
    return tf.reduce_mean(out.per_example_xent, axis=-1)

  @classmethod
  def FPropMeta(cls, p, x, labels):
    x = tf.TensorShape(x)
    rows = x.num_elements() // p.model_dim
    flops = 2 * rows * p.model_dim * p.vocab_size + 5 * rows * p.vocab_size
    return meta.Meta(flops, x[:1])


def LayerParams(num_layers, model_dim, hidden_dim, num_heads, vocab_size):
  """[LmInput, LmBlock x num_layers, LmLoss] Params, named for checkpoints."""
  layers = [
    LmInput.Params().Set(
      name='input', vocab_size=vocab_size, model_dim=model_dim
    )
  ]
  layers += [
    LmBlock.Params().Set(
      name=f'layer_{i:03d}',
      model_dim=model_dim,
      hidden_dim=hidden_dim,
      num_heads=num_heads,
    )
    for i in range(num_layers)
  ]
  layers.append(
    LmLoss.Params().Set(name='loss', vocab_size=vocab_size, model_dim=model_dim)
  )
  return layers
