"""Lingvo's GPipeTransformerStack (`lingvo_gpipe.core.layers_with_gpipe`).

Lingvo's names (cells `cell_<k>`, `theta.cell_0.encoder_0...`), the same
loss and gradients for 1, 2 and 4 splits given the same weights, and the
one-line refusals of unsupported Params.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import layers
from lingvo_gpipe.core import layers_with_attention
from lingvo_gpipe.core import layers_with_gpipe

VOCAB, DIM, T, B = 11, 8, 5, 4


def _Params(splits, num_micro_batches=2, **kwargs):
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
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
    tpl.tr_atten_tpl.num_attention_heads = 2
    tpl.tr_fflayer_tpl.hidden_dim = 16
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
  """A weight's key without its cell: the same layer in any split."""
  return re.sub(r'^cell_\d+\.', '', key)


def _Run(stack, weights=None):
  items = dict(stack.vars.FlattenItems())
  if weights is not None:
    for key, var in items.items():
      var.assign(weights[_Unsplit(key)])
  with tf.GradientTape() as tape:
    xent, logits = stack.FPropDefaultTheta(*_Inputs())
    loss = tf.reduce_sum(xent * _Inputs()[-1])
  grads = tape.gradient(loss, items)
  return (
    float(loss),
    logits.numpy(),
    {_Unsplit(k): g.numpy() for k, g in grads.items() if g is not None},
    {_Unsplit(k): v.numpy() for k, v in items.items()},
  )


def testLingvoNamesAndFPropDefaultTheta():
  stack = _Params([2, 4]).Instantiate()
  assert [c.params.name for c in stack.cells] == ['cell_0', 'cell_1']
  th = stack.theta
  assert th.cell_0.encoder_0.self_atten.atten.query_proj.shape == [DIM, DIM]
  assert th.cell_0.encoder_0.self_atten.atten.atten.per_dim_scale.shape == [4]
  assert th.cell_1.decoder_1.atten.layer_norm.scale.shape == [DIM]
  assert th.cell_1.softmax.weight_0.shape == [DIM, VOCAB]
  assert th.cell_0.emb.src_token_emb.wm.shape == [VOCAB, DIM]
  names = stack.VariablesByName()
  assert 'stack/cell_0/encoder_1/tr_fflayer/fflayer/fflayer_0/w' in names, (
    sorted(names)
  )
  assert 'stack/cell_1/decoder_0/multihead_atten/atten_ln/scale' in names
  assert [e.params.name for e in stack.GetEncoders()] == [
    'encoder_0',
    'encoder_1',
  ]
  assert len(stack.GetDecoders()) == 2
  xent, logits = stack.FPropDefaultTheta(*_Inputs())
  assert xent.shape == [T, B] and logits.shape == [T, B, VOCAB]


@pytest.mark.parametrize('transparent', [False, True])
def testGradientsEqualFor1And2And4Splits(transparent):
  # No dropout: its masks depend on the layer's path, which has its cell.
  kw = dict(is_transparent=transparent, transparent_merger_dropout_prob=0.0)
  ref_loss, ref_logits, ref_grads, weights = _Run(
    _Params(1, num_micro_batches=1, **kw).Instantiate()
  )
  for splits in (2, [1, 2, 3, 4]):
    stack = _Params(splits, **kw).Instantiate()
    assert len(stack.cells) == (2 if splits == 2 else 4)
    loss, logits, grads, _ = _Run(stack, weights)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert sorted(grads) == sorted(ref_grads)
    # The keys' biases have zero gradients in exact arithmetic (they shift
    # all logits of a query alike): rounding noise, below 1e-6 of the
    # largest gradient on both sides.
    big = max(float(np.max(np.abs(g))) for g in ref_grads.values())
    for key, g in ref_grads.items():
      scale = float(np.max(np.abs(g)))
      if max(scale, float(np.max(np.abs(grads[key])))) <= 1e-6 * big:
        assert key.endswith('source_proj_b'), key
        continue
      assert np.max(np.abs(grads[key] - g)) / scale < 1e-4, key


def testLabelSmoothingAndDeterministicDropoutParams():
  p = _Params(2, label_smoothing=layers.UniformLabelSmoother.Params())
  p.label_smoothing.Set(num_classes=VOCAB, uncertainty=0.1)
  stack = p.Instantiate()
  smooth, _ = stack.FPropDefaultTheta(*_Inputs())
  plain, _ = _Params(2).Instantiate().FPropDefaultTheta(*_Inputs())
  assert smooth.shape == [T, B]
  assert not np.allclose(smooth.numpy(), plain.numpy())
  # More than one split: Lingvo's deterministic dropout Params.
  enc = stack.cells[0].encoder_0.params
  assert enc.tr_atten_tpl.residual_dropout_tpl.cls.__name__ == (
    'DeterministicDropoutLayer'
  )


def testUnsupportedParamsAreRefusedInOneLine():
  with pytest.raises(
    ValueError, match=r'packed_input=True is not supported .*one sequence'
  ):
    _Params(2, packed_input=True).Instantiate()
  with pytest.raises(ValueError, match=r'splits=\[3, 5\] must be increasing'):
    _Params([3, 5]).Instantiate()
  atten = layers_with_attention.TransformerAttentionLayer.Params().Set(
    name='a', source_dim=8, num_attention_heads=2
  )
  with pytest.raises(ValueError, match='residual_function=.* is not supported'):
    atten.Copy().Set(residual_function=layers.FCLayer.Params()).Instantiate()
  with pytest.raises(ValueError, match="mask_type='left'; use 'future'"):
    atten.Copy().Set(mask_type='left').Instantiate()
  for build in (
    lambda: _Params(2, packed_input=True).Instantiate(),
    lambda: (
      atten.Copy().Set(residual_function=layers.FCLayer.Params()).Instantiate()
    ),
  ):
    assert '\n' not in str(_Err(build))


def _Err(fn):
  try:
    fn()
  except ValueError as e:
    return e
  raise AssertionError('no error')


def testTransformerLayerAttendsCausally():
  """A decoder layer's output at step t does not depend on steps > t."""
  p = layers_with_attention.TransformerLayer.Params().Set(
    name='dec', source_dim=DIM, mask_self_atten=True
  )
  p.tr_atten_tpl.num_attention_heads = 2
  p.tr_fflayer_tpl.hidden_dim = 16
  layer = p.Instantiate()
  x = tf.random.stateless_normal([T, B, DIM], [1, 2])
  pad = tf.zeros([T, B])
  y, _ = layer.FPropDefaultTheta(x, pad)
  x2 = tf.concat([x[:3], x[3:] * 2.0], 0)
  y2, _ = layer.FPropDefaultTheta(x2, pad)
  np.testing.assert_allclose(y[:3].numpy(), y2[:3].numpy(), rtol=1e-5)
  assert not np.allclose(y[3:].numpy(), y2[3:].numpy())


def testDecodingHelpersMatchThePipeline():
  """The stack's encoder, run layer by layer, gives the pipeline's encoder
  output (a stack of encoder layers only, no softmax)."""
  p = _Params([1, 2], num_decoder_layers=0)
  p.softmax_tpl = None
  stack = p.Instantiate()
  src, src_pad = _Inputs()[:2]
  outs = stack.FPropDefaultTheta(src, src_pad)
  emb = stack.EncoderEmbedFPropDefaultTheta(src)
  enc = stack.EncoderFPropDefaultTheta(emb, src_pad)
  np.testing.assert_allclose(enc.numpy(), outs[0].numpy(), rtol=1e-5)
