"""Tests of lingvo_gpipe.layers.embedding, including tying with a softmax."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.layers import embedding
from lingvo_gpipe.layers import softmax


def _Emb(**kwargs):
  return embedding.SimpleEmbeddingLayer.Params().Set(
    name='emb', vocab_size=7, embedding_dim=4, **kwargs
  )


def testLookupMatchesNumpy():
  p = _Emb()
  layer = p.Instantiate()
  ids = np.array([[0, 3, 6], [2, 2, 1]], np.int32)
  out = layer.FProp(layer.theta, tf.constant(ids))
  np.testing.assert_allclose(out.numpy(), layer.vars.wm.numpy()[ids])
  m = p.cls.FPropMeta(p, tf.TensorSpec([2, 3], tf.int32))
  assert m.out_shapes == (out.shape,)
  assert layer.vars.wm.name == 'emb/wm:0'


def testScaleSqrtDepth():
  layer = _Emb(scale_sqrt_depth=True).Instantiate()
  out = layer.FProp(layer.theta, tf.constant([[1]]))
  np.testing.assert_allclose(
    out.numpy()[0, 0], layer.vars.wm.numpy()[1] * 2.0, rtol=1e-6
  )


def testFloatIdsAreRejected():
  layer = _Emb().Instantiate()
  with pytest.raises(TypeError, match="SimpleEmbeddingLayer 'emb'.*float32"):
    layer.FProp(layer.theta, tf.constant([[1.0, 2.0]]))


class _TiedModel(base_layer.BaseLayer):
  """Embedding and softmax sharing one weight [vocab, dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab', 6, 'Vocabulary size.')
    p.Define('dim', 4, 'Model dim.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild(
      'emb',
      embedding.SimpleEmbeddingLayer.Params().Set(
        vocab_size=p.vocab, embedding_dim=p.dim, shared_weight_name='tied'
      ),
    )
    self.CreateChild(
      'softmax',
      softmax.SimpleFullSoftmax.Params().Set(
        input_dim=p.dim,
        num_classes=p.vocab,
        shared_weight_name='tied',
        use_num_classes_major_weight=True,
        has_bias=False,
      ),
    )

  def FProp(self, theta, ids, labels):
    x = tf.tanh(self.emb.FProp(theta.emb, ids))
    return self.softmax.FProp(theta.softmax, x, class_ids=labels).avg_xent


def testTiedEmbeddingAndSoftmaxShareOneVariable():
  model = _TiedModel.Params().Set(name='lm').Instantiate()
  assert model.emb.vars.wm is model.softmax.vars.weight_0
  assert list(model.VariablesByName()) == ['lm/emb/wm']
  assert len(model.trainable_variables) == 1


def testTiedGradientIsTheSumOfBothUses():
  model = _TiedModel.Params().Set(name='lm').Instantiate()
  ids = tf.constant([[1, 2, 5], [0, 3, 3]])
  labels = tf.constant([[2, 5, 0], [3, 3, 1]])
  var = model.emb.vars.wm
  with tf.GradientTape() as tape:
    loss = model.FProp(model.theta, ids, labels)
  grad = tape.gradient(loss, var)
  # Reference: one tensor used as the table and as the softmax weight.
  w = tf.constant(var.numpy())
  with tf.GradientTape() as ref_tape:
    ref_tape.watch(w)
    logits = tf.matmul(tf.tanh(tf.gather(w, ids)), w, transpose_b=True)
    ref = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits
      )
    )
  np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-6)
  np.testing.assert_allclose(
    tf.convert_to_tensor(grad).numpy(),
    ref_tape.gradient(ref, w).numpy(),
    rtol=1e-5,
    atol=1e-7,
  )


def testTyingNeedsClassMajorLayout():
  p = softmax.SimpleFullSoftmax.Params().Set(
    name='sm', input_dim=4, num_classes=6, shared_weight_name='tied'
  )
  with pytest.raises(ValueError, match="'sm'.*use_num_classes_major_weight"):
    p.Instantiate()
