"""Lingvo's GPipe Transformer language model: the layer and its task.

`GPipeTransformerLm` is Lingvo's `lm.layers.GPipeTransformerLm`: a
`GPipeBatchMajorTransformerStack` of causally masked Transformer layers
(embeddings in the first cell, the softmax in the last), split at `splits`
and run over `num_micro_batches`. `CommonParams` takes Lingvo's arguments:

  p = GPipeTransformerLm.CommonParams(vocab_size=32000, model_dim=2048,
        hidden_dim=8192, num_heads=16, num_layers=32, splits=[8, 16, 24, 32],
        num_micro_batches=32)

`GPipeTransformerLmTask` trains it on fixed-shape batches
(`input.lm_input.LmTextInput`: ids, labels, paddings, weights [b, T]). Its
metrics are token-weighted means over the batch:

  loss             cross-entropy per predicted token (what is minimized)
  log_pplx         the same number (exp() is the perplexity)
  token_accuracy   argmax == label
  num_predictions  the predicted tokens of the batch
"""

import math

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import base_model
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.gpipe_layers import batch_major_gpipe
from lingvo_gpipe.layers import batch_major_attention

__all__ = ['GPipeTransformerLm', 'GPipeTransformerLmTask']


class GPipeTransformerLm(base_layer.BaseLayer):
  """A pipelined Transformer language model (Lingvo's GPipe LM layer)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Vocabulary size.')
    p.Define(
      'stack',
      batch_major_gpipe.GPipeBatchMajorTransformerStack.Params(),
      'The pipelined stack (its encoder layers are the LM layers).',
    )
    return p

  @classmethod
  def CommonParams(
    cls,
    vocab_size,
    model_dim,
    attention_hidden_dim=None,
    hidden_dim=1024,
    num_heads=8,
    num_layers=6,
    splits=1,
    num_micro_batches=1,
    micro_batch_size=None,
    num_shards=16,
    input_dropout_prob=0.0,
    residual_dropout_prob=0.1,
    atten_dropout_prob=0.0,
    relu_dropout_prob=0.0,
    softmax_max_alloc=None,
  ):
    """Params of an LM of `num_layers` causal Transformer layers, with
    Lingvo's arguments and defaults.

    `splits`: the number of cells or their end layer indices (the embedding
    is layer 0, LM layer i is layer i + 1). `num_shards` must divide
    `vocab_size`. `micro_batch_size` and `softmax_max_alloc` are Lingvo
    options this library does not have: set num_micro_batches instead of
    the first; for the second, more micro-batches shrink the softmax's
    activations the same way.
    """
    if micro_batch_size is not None:
      raise ValueError(
        f'GPipeTransformerLm: micro_batch_size = {micro_batch_size!r} is not '
        'supported; set num_micro_batches (the batch divided by it is the '
        'micro-batch size).'
      )
    if softmax_max_alloc:
      raise ValueError(
        f'GPipeTransformerLm: softmax_max_alloc = {softmax_max_alloc!r} '
        '(a chunked softmax) is not supported; leave it None and raise '
        'num_micro_batches to shrink the softmax activations per micro-batch.'
      )
    if vocab_size % num_shards:
      raise ValueError(
        f'GPipeTransformerLm: num_shards = {num_shards} does not divide '
        f'vocab_size = {vocab_size}; pick a divisor (e.g. 1).'
      )
    p = cls.Params().Set(name='transformerlm', vocab_size=vocab_size)
    s = p.stack
    s.Set(
      splits=splits,
      model_dim=model_dim,
      num_micro_batches=num_micro_batches,
      num_encoder_layers=num_layers,
      num_decoder_layers=0,
      batch_dim=0,
      packed_input=False,
    )
    s.emb_tpl.token_emb.Set(
      vocab_size=vocab_size,
      embedding_dim=model_dim,
      params_init=py_utils.WeightInit.Gaussian(1.0 / math.sqrt(model_dim)),
    )
    s.emb_tpl.position_emb.embedding_dim = model_dim
    s.emb_tpl.input_dropout_prob = input_dropout_prob
    layer = batch_major_attention.GPipeBatchMajorTransformerLayer.Params()
    layer.Set(
      has_aux_atten=False,
      mask_self_atten=True,
      input_dim=model_dim,
      output_dim=model_dim,
    )
    layer.tr_atten_tpl.Set(
      input_dim=model_dim,
      hidden_dim=attention_hidden_dim or model_dim,
      is_masked=True,
      num_heads=num_heads,
      residual_dropout_prob=residual_dropout_prob,
      atten_dropout_prob=atten_dropout_prob,
    )
    layer.tr_atten_tpl.atten_tpl.use_bias = False
    layer.tr_fflayer_tpl.Set(
      hidden_dim=hidden_dim,
      residual_dropout_prob=residual_dropout_prob,
      relu_dropout_prob=relu_dropout_prob,
    )
    s.encoder_tpl = layer
    s.softmax_tpl.Set(
      num_classes=vocab_size, input_dim=model_dim, num_shards=num_shards
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    stack = p.stack.Copy().Set(name=p.name)
    stack.state_dtype = p.fprop_dtype or p.dtype
    self.CreateChild('stack', stack)

  def FProp(self, theta, inputs, paddings, state0=None, labels=None):
    """Cross-entropy of next-token `labels` (NestedMap(class_ids,
    class_weights), [b, t]) given ids `inputs` and `paddings` [b, t].

    Returns:
      (NestedMap(per_example_xent [b, t], logits [b, t, V],
      per_example_argmax [b, t], total_xent, total_weight, avg_xent), {}):
      Lingvo's outputs (a Transformer has no recurrent state).
    """
    del state0
    if labels is None:
      raise ValueError(
        f'GPipeTransformerLm {self.path!r}: pass labels=NestedMap('
        'class_ids=..., class_weights=...), the next token of each position.'
      )
    xent, logits = self.stack.FProp(
      theta.stack,
      inputs,
      paddings,
      None,
      None,
      None,
      None,
      labels.class_ids,
      labels.class_weights,
    )
    weights = tf.cast(labels.class_weights, xent.dtype)
    total_xent = tf.reduce_sum(xent * weights)
    total_weight = tf.reduce_sum(weights)
    out = NestedMap(
      per_example_xent=xent,
      logits=logits,
      per_example_argmax=tf.argmax(logits, axis=-1, output_type=tf.int32),
      total_xent=total_xent,
      total_weight=total_weight,
      avg_xent=tf.math.divide_no_nan(total_xent, total_weight),
    )
    return out, {}


class GPipeTransformerLmTask(base_model.BaseTask):
  """Trains a `GPipeTransformerLm` on fixed-shape LM batches."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('lm', GPipeTransformerLm.Params(), 'The language model.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('lm', self.params.lm)

  def ComputePredictions(self, theta, input_batch):
    labels = NestedMap(
      class_ids=input_batch.labels, class_weights=input_batch.weights
    )
    out, _ = self.lm.FProp(
      theta.lm, input_batch.ids, input_batch.paddings, labels=labels
    )
    return out

  def ComputeLoss(self, theta, predictions, input_batch):
    del theta
    w = tf.cast(input_batch.weights, tf.float32)
    total = tf.reduce_sum(w)
    xent = tf.cast(predictions.per_example_xent, tf.float32)
    correct = tf.cast(
      tf.equal(predictions.per_example_argmax, input_batch.labels), tf.float32
    )
    avg = tf.math.divide_no_nan(tf.reduce_sum(xent * w), total)
    metrics = NestedMap(
      loss=(avg, total),
      log_pplx=(avg, total),
      token_accuracy=(
        tf.math.divide_no_nan(tf.reduce_sum(correct * w), total),
        total,
      ),
      num_predictions=(total, tf.constant(1.0)),
    )
    per_example = NestedMap(
      loss=tf.math.divide_no_nan(
        tf.reduce_sum(xent * w, axis=1), tf.reduce_sum(w, axis=1)
      )
    )
    return metrics, per_example
