"""Lingvo's GPipeBatchMajorTransformerStack: Lingvo's names, the same loss
and gradients for 1, 2 and 4 splits, packed inputs refused in one line."""

import re

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import layers_with_gpipe

VOCAB, DIM, B, T = 11, 8, 4, 5


def _Params(splits, num_micro_batches=2, **kwargs):
  p = layers_with_gpipe.GPipeBatchMajorTransformerStack.Params().Set(
    name='stack',
    model_dim=DIM,
    num_encoder_layers=2,
    num_decoder_layers=2,
    splits=splits,
    num_micro_batches=num_micro_batches,
    packed_input=False,
  )
  p.Set(**kwargs)
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.Set(input_dim=DIM, num_heads=2)
    tpl.tr_fflayer_tpl.hidden_dim = 16
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.embedding_dim = DIM
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  return p


def _Inputs():
  rng = np.random.RandomState(3)
  ids = [tf.constant(rng.randint(0, VOCAB, [B, T]), tf.int32) for _ in range(3)]
  pad = np.zeros([B, T], np.float32)
  pad[1, -2:] = 1.0
  pad = tf.constant(pad)
  return ids[0], pad, ids[1], pad, None, None, ids[2], 1.0 - pad


def _Run(stack, weights=None):
  items = dict(stack.vars.FlattenItems())
  if weights is not None:
    for key, var in items.items():
      var.assign(weights[re.sub(r'^cell_\d+\.', '', key)])
  with tf.GradientTape() as tape:
    xent, _ = stack.FPropDefaultTheta(*_Inputs())
    loss = tf.reduce_sum(xent)
  grads = tape.gradient(loss, items)
  strip = lambda k: re.sub(r'^cell_\d+\.', '', k)  # noqa: E731
  return (
    float(loss),
    {strip(k): g.numpy() for k, g in grads.items() if g is not None},
    {strip(k): v.numpy() for k, v in items.items()},
  )


def testNamesAndGradientsEqualFor1And2And4Splits():
  one = _Params(1, num_micro_batches=1).Instantiate()
  th = one.theta.cell_0
  assert th.encoder_0.self_atten.atten.query.w.shape == [DIM, 2, 4]
  assert th.decoder_1.cross_atten.atten.per_dim_scale.per_dim_scale.shape == [4]
  assert th.decoder_1.layer_norm.scale.shape == [DIM]  # the output norm
  ref_loss, ref_grads, weights = _Run(one)
  big = max(float(np.max(np.abs(g))) for g in ref_grads.values())
  for splits in (2, 4):
    loss, grads, _ = _Run(_Params(splits).Instantiate(), weights)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key, g in ref_grads.items():
      scale = float(np.max(np.abs(g)))
      if max(scale, float(np.max(np.abs(grads[key])))) <= 1e-6 * big:
        assert key.endswith('key.b'), key  # zero in exact arithmetic
        continue
      assert np.max(np.abs(grads[key] - g)) / scale < 1e-4, key


def testPackedInputIsRefusedInOneLine():
  with pytest.raises(
    ValueError, match='packed_input=True is not supported; set packed_input'
  ) as e:
    _Params(2, packed_input=True).Instantiate()
  assert '\n' not in str(e.value)
