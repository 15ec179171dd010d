"""Tests of lingvo_gpipe.layers.evolved_transformer (Lingvo's Evolved
Transformer layers; their numbers against Lingvo's are checked by
tools/lingvo_crosscheck.py)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import layers
from lingvo_gpipe.core import layers_with_attention

DIM, T, B = 8, 7, 3


def _Decoder(**kw):
  p = layers_with_attention.EvolvedTransformerDecoderLayer.Params().Set(
    name='dec', source_dim=DIM, **kw
  )
  p.tr_double_heads_atten_tpl.num_attention_heads = 4
  p.tr_atten_tpl.num_attention_heads = 2
  p.transformer_tpl.tr_atten_tpl.num_attention_heads = 2
  return p


def _Encoder(**kw):
  p = layers_with_attention.EvolvedTransformerEncoderLayer.Params().Set(
    name='enc', source_dim=DIM, **kw
  )
  p.transformer_tpl.tr_atten_tpl.num_attention_heads = 2
  return p


def _X(seed=0, t=T):
  return tf.random.stateless_normal([t, B, DIM], [seed, 1])


def testLingvoChildNamesAndShapes():
  enc = _Encoder().Instantiate()
  th = enc.theta
  assert th.glu_layer.value_layer.w.shape == [DIM, DIM]
  assert th.glu_layer.gate_layer.b.shape == [DIM]
  convs = th.branched_convs_layer
  assert convs.dense_layer.w.shape == [DIM, 4 * DIM]
  assert convs.conv_layer.w.shape == [3, 1, DIM, DIM // 2]
  assert convs.separable_conv_layer.depthwise_conv.w.shape == [9, 1, 4 * DIM, 1]
  assert convs.separable_conv_layer.w.shape == [1, 1, 4 * DIM, DIM]
  assert th.transformer_layer.fflayer.fflayer.fc[0].w.shape == [DIM, 4 * DIM]
  # Lingvo's layer norm: the scale is 1 + `scale`, initialized to 0.
  assert not np.any(th.glu_layer.layer_norm.scale.numpy())
  pad = tf.zeros([T, B])
  out, probs = enc.FPropDefaultTheta(_X(), pad)
  assert out.shape == [T, B, DIM] and probs.shape == [T, B, T]

  dec = _Decoder(mask_self_atten=True).Instantiate()
  th = dec.theta
  assert th.self_atten_double_heads.atten.atten.per_dim_scale.shape == [2]
  assert th.attend_to_encoder.atten.atten.per_dim_scale.shape == [4]
  convs = th.branched_convs
  assert convs.separable_conv_11x1_layer.w.shape == [1, 1, DIM, 2 * DIM]
  assert convs.separable_conv_7x1_layer.w.shape == [1, 1, DIM, DIM // 2]
  assert convs.separable_conv_7x1_layer_2.depthwise_conv.w.shape == [
    7,
    1,
    2 * DIM,
    1,
  ]
  assert dec.transformer_layer.params.tr_fflayer_tpl.activation == 'SWISH'
  enc_out = _X(5, t=4)
  out, probs = dec.FPropDefaultTheta(_X(), pad, enc_out, tf.zeros([4, B]))
  assert out.shape == [T, B, DIM] and probs.shape == [T, B, 4]


def testDecoderIsCausal():
  """With masked self-attention, the decoder's output at step t does not
  depend on steps > t: attention and branched convolutions alike."""
  dec = _Decoder(has_aux_atten=False, mask_self_atten=True).Instantiate()
  pad = tf.zeros([T, B])
  x = _X()
  y, _ = dec.FPropDefaultTheta(x, pad)
  x2 = tf.concat([x[:4], x[4:] * 2.0], 0)
  y2, _ = dec.FPropDefaultTheta(x2, pad)
  np.testing.assert_allclose(y[:4].numpy(), y2[:4].numpy(), rtol=1e-5)
  assert not np.allclose(y[4:].numpy(), y2[4:].numpy())


def testPaddedStepsDoNotReachTheEncoderOutput():
  """A padded source step's value does not change the other steps."""
  enc = _Encoder().Instantiate()
  pad = np.zeros([T, B], np.float32)
  pad[-2:, 1] = 1.0
  x = _X().numpy()
  y, _ = enc.FPropDefaultTheta(tf.constant(x), tf.constant(pad))
  x[-2:, 1] += 5.0
  y2, _ = enc.FPropDefaultTheta(tf.constant(x), tf.constant(pad))
  np.testing.assert_allclose(y[:-2].numpy(), y2[:-2].numpy(), rtol=1e-5)
  np.testing.assert_allclose(y[:, 0].numpy(), y2[:, 0].numpy(), rtol=1e-5)


def testGluLayer():
  p = layers.GluLayer.Params().Set(name='glu', input_dim=DIM)
  glu = p.Instantiate()
  x = _X()[0]
  pad = tf.constant([0.0, 1.0, 0.0])
  th = glu.theta
  xn = glu.layer_norm.FPropDefaultTheta(x)
  values = tf.matmul(xn, th.value_layer.w) + th.value_layer.b
  gates = tf.sigmoid(tf.matmul(xn, th.gate_layer.w) + th.gate_layer.b)
  ref = x + values * gates * (1.0 - pad)[:, None]
  np.testing.assert_allclose(
    glu.FPropDefaultTheta(x, pad).numpy(), ref.numpy(), rtol=1e-5, atol=1e-6
  )
  plain = p.Copy().Set(apply_residual=False, output_dim=4, ln_tpl=None)
  assert plain.Instantiate().FPropDefaultTheta(x, pad).shape == [B, 4]


def testBadParamsAreRefusedInOneLine():
  cases = [
    (
      lambda: (
        layers.GluLayer.Params()
        .Set(name='g', input_dim=DIM, output_dim=4)
        .Instantiate()
      ),
      'apply_residual needs output_dim',
    ),
    (
      lambda: _Encoder(has_aux_atten=True).Instantiate(),
      'has_aux_atten=True is not supported',
    ),
    (
      lambda: _Decoder(packed_input=True).Instantiate(),
      'packed_input=True is not supported',
    ),
  ]
  for build, match in cases:
    with pytest.raises(ValueError, match=match) as err:
      build()
    assert '\n' not in str(err.value)
  dec = _Decoder().Instantiate()
  with pytest.raises(ValueError, match='needs aux_vecs and aux_paddings'):
    dec.FPropDefaultTheta(_X(), tf.zeros([T, B]))
  with pytest.raises(NotImplementedError, match='ExtendStep'):
    dec.ExtendStep(dec.theta, _X()[0], None)


def testDeterministicDropoutIsOnAndRepeatable():
  """The GPipe form of the layers' dropout (deterministic, keep_prob kept)
  drops: the output differs from that without dropout, and repeats."""
  p = _Encoder()
  det = layers.DeterministicDropoutLayer.Params().Set(keep_prob=0.7)
  p.glu_tpl.dropout_tpl = det.Copy()
  p.branched_convs_tpl.dropout_tpl = det.Copy()
  layer = p.Instantiate()
  plain = _Encoder().Instantiate()
  for key, var in plain.vars.FlattenItems():
    var.assign(dict(layer.vars.FlattenItems())[key])
  pad = tf.zeros([T, B])
  a, _ = layer.FPropDefaultTheta(_X(), pad)
  b, _ = layer.FPropDefaultTheta(_X(), pad)
  c, _ = plain.FPropDefaultTheta(_X(), pad)
  np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert not np.allclose(a.numpy(), c.numpy())
