"""Lingvo's GPipeEvolvedTransformerStack (`core.layers_with_gpipe`): Lingvo's
names, the same loss and gradients for 1 and 4 splits given the same
weights (`layers_with_gpipe_test.py` also checks 2 splits of the stack
these layers plug into), Lingvo's deterministic dropout Params, one-line
refusals."""

import re

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import layers_with_gpipe

VOCAB, DIM, T, B = 11, 8, 6, 4


def _Params(splits, num_micro_batches=2, **kwargs):
  p = layers_with_gpipe.GPipeEvolvedTransformerStack.Params().Set(
    name='stack',
    model_dim=DIM,
    num_encoder_layers=2,
    num_decoder_layers=2,
    splits=splits,
    num_micro_batches=num_micro_batches,
  )
  p.Set(**kwargs)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.source_dim = DIM
    tpl.transformer_tpl.tr_atten_tpl.num_attention_heads = 2
  p.decoder_tpl.tr_atten_tpl.num_attention_heads = 2
  p.decoder_tpl.tr_double_heads_atten_tpl.num_attention_heads = 4
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.embedding_dim = DIM
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  return p


def _Inputs():
  rng = np.random.RandomState(0)
  ids = [tf.constant(rng.randint(0, VOCAB, [T, B]), tf.int32) for _ in range(3)]
  src_pad = np.zeros([T, B], np.float32)
  src_pad[-2:, 1] = 1.0
  tgt_pad = np.zeros([T, B], np.float32)
  tgt_pad[-1:, 3] = 1.0
  return (
    ids[0],
    tf.constant(src_pad),
    ids[1],
    tf.constant(tgt_pad),
    None,
    None,
    ids[2],
    tf.constant(1.0 - tgt_pad),
  )


def _Unsplit(key):
  return re.sub(r'^cell_\d+\.', '', key)


def _Run(stack, weights=None):
  items = dict(stack.vars.FlattenItems())
  if weights is not None:
    for key, var in items.items():
      var.assign(weights[_Unsplit(key)])
  inputs = _Inputs()
  with tf.GradientTape() as tape:
    xent, logits = stack.FPropDefaultTheta(*inputs)
    loss = tf.reduce_sum(xent * inputs[-1])
  grads = tape.gradient(loss, items)
  return (
    float(loss),
    logits.numpy(),
    {_Unsplit(k): g.numpy() for k, g in grads.items() if g is not None},
    {_Unsplit(k): v.numpy() for k, v in items.items()},
  )


def testLingvoNames():
  stack = _Params([1, 4]).Instantiate()
  th = stack.theta
  assert th.cell_0.encoder_0.glu_layer.value_layer.w.shape == [DIM, DIM]
  convs = th.cell_1.decoder_1.branched_convs
  assert convs.separable_conv_11x1_layer.depthwise_conv.w.shape == [
    11,
    1,
    DIM,
    1,
  ]
  names = stack.VariablesByName()
  for name in (
    'stack/cell_1/encoder_1/branched_convs_layer/conv_layer/w',
    'stack/cell_1/decoder_0/self_atten_double_heads/atten_ln/scale',
    'stack/cell_1/decoder_0/attend_to_encoder/multihead_atten/query_proj',
    'stack/cell_1/decoder_1/transformer_layer/tr_fflayer/fflayer/fflayer_0/w',
  ):
    assert name in names, sorted(names)
  assert [e.params.name for e in stack.GetEncoders()] == [
    'encoder_0',
    'encoder_1',
  ]


def testGradientsEqualFor1And4Splits():
  ref_loss, ref_logits, ref_grads, weights = _Run(
    _Params(1, num_micro_batches=1).Instantiate()
  )
  for splits in ([1, 2, 3, 4],):
    stack = _Params(splits).Instantiate()
    loss, logits, grads, _ = _Run(stack, weights)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert sorted(grads) == sorted(ref_grads)
    big = max(float(np.max(np.abs(g))) for g in ref_grads.values())
    for key, g in ref_grads.items():
      scale = float(np.max(np.abs(g)))
      if max(scale, float(np.max(np.abs(grads[key])))) <= 1e-6 * big:
        assert key.endswith('source_proj_b'), key  # zero in exact arithmetic
        continue
      assert np.max(np.abs(grads[key] - g)) / scale < 1e-4, key


def testDeterministicDropoutWithMoreThanOneSplit():
  p = _Params(2)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.branched_convs_tpl.dropout_tpl.keep_prob = 0.8
  p.encoder_tpl.glu_tpl.dropout_tpl.keep_prob = 0.9
  stack = p.Instantiate()
  enc = stack.cells[0].encoder_0.params
  dec = stack.cells[1].decoder_0.params
  det = 'DeterministicDropoutLayer'
  assert enc.glu_tpl.dropout_tpl.cls.__name__ == det
  assert enc.branched_convs_tpl.dropout_tpl.cls.__name__ == det
  # Lingvo's switch drops these keep_probs (no dropout); here they stay.
  assert enc.glu_tpl.dropout_tpl.keep_prob == 0.9
  assert enc.branched_convs_tpl.dropout_tpl.keep_prob == 0.8
  assert dec.branched_convs_tpl.dropout_tpl.keep_prob == 0.8
  assert (
    enc.transformer_tpl.tr_fflayer_tpl.fflayer_tpl.dropout.cls.__name__ == (det)
  )
  assert dec.tr_double_heads_atten_tpl.residual_dropout_tpl.cls.__name__ == det
  assert dec.tr_atten_tpl.atten_tpl.atten_dropout_deterministic
  one = _Params(1, num_micro_batches=1).Instantiate()
  assert one.cells[0].encoder_0.params.glu_tpl.dropout_tpl.cls.__name__ == (
    'DropoutLayer'
  )


def testTransparentEncoderIsRefusedInOneLine():
  with pytest.raises(ValueError, match='is_transparent=True is not supported'):
    _Params(2, is_transparent=True).Instantiate()
