"""Tests of lingvo_gpipe.layers.attention against NumPy / plain TF."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import attention

B, T, S, D, N, H = 2, 3, 4, 6, 2, 4


def _Atten(**kwargs):
  p = attention.MultiHeadedAttention.Params().Set(
    name='att', input_dim=D, hidden_dim=N * H, num_heads=N
  )
  return p.Set(**kwargs)


def _Inputs(seed=0):
  rng = np.random.RandomState(seed)
  q = rng.randn(B, T, D).astype(np.float32)
  kv = rng.randn(B, S, D).astype(np.float32)
  paddings = np.zeros([B, S], np.float32)
  paddings[1, 2:] = 1.0
  return q, kv, paddings


def _Reference(theta, q, k, v, paddings, causal=False, lib=np):
  """Plain attention; `lib` is np (values) or tf (autodiff)."""
  einsum = np.einsum if lib is np else tf.einsum
  qp = einsum('btd,dnh->btnh', q, theta.query.w) + theta.query.b
  kp = einsum('bsd,dnh->bsnh', k, theta.key.w) + theta.key.b
  vp = einsum('bsd,dnh->bsnh', v, theta.value.w) + theta.value.b
  logits = einsum('btnh,bsnh->bnts', qp, kp) / np.sqrt(H)
  mask = paddings[:, None, None, :] > 0
  if causal:
    mask = mask | (np.arange(S)[None, :] > np.arange(T)[:, None])
  if lib is np:
    logits = np.where(mask, -1e9, logits)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
  else:
    probs = tf.nn.softmax(tf.where(mask, -1e9, logits), -1)
  ctx = einsum('bnts,bsnh->btnh', probs, vp)
  return einsum('btnh,dnh->btd', ctx, theta.post.w) + theta.post.b, probs


def _NpTheta(layer):
  return layer.vars.Transform(lambda v: v.numpy())


@pytest.mark.parametrize('causal', [False, True])
def testMatchesNumpy(causal):
  layer = _Atten().Instantiate()
  for name in ('query', 'key', 'value', 'post'):
    b = layer.vars[name].b
    b.assign(tf.random.stateless_normal(b.shape, [1, 2]))
  q, kv, paddings = _Inputs()
  enc, probs = layer.FProp(layer.theta, q, kv, kv, paddings, causal=causal)
  want_enc, want_probs = _Reference(
    _NpTheta(layer), q, kv, kv, paddings, causal
  )
  np.testing.assert_allclose(probs.numpy(), want_probs, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(enc.numpy(), want_enc, rtol=1e-4, atol=1e-5)
  assert np.all(probs.numpy()[1, :, :, 2:] == 0.0)
  np.testing.assert_allclose(probs.numpy().sum(-1), 1.0, rtol=1e-5)


def testPerStepPaddingEqualsCausal():
  layer = _Atten().Instantiate()
  q, kv, paddings = _Inputs(1)
  per_step = np.broadcast_to(
    (np.arange(S)[None, :] > np.arange(T)[:, None]).astype(np.float32),
    [B, T, S],
  )
  a = layer.FProp(layer.theta, q, kv, kv, paddings, per_step_padding=per_step)
  b = _Atten(causal=True).Instantiate()
  b_out = b.FProp(layer.theta, q, kv, kv, paddings)
  for x, y in zip(a, b_out):
    np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6)


def testGradientsMatchTfReference():
  layer = _Atten().Instantiate()
  q, kv, paddings = (tf.constant(a) for a in _Inputs(2))
  theta = layer.vars.Transform(lambda v: tf.constant(v.numpy()))
  leaves = theta.Flatten() + [q, kv]
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(leaves)
    enc, _ = layer.FProp(theta, q, kv, kv, paddings)
    ref, _ = _Reference(theta, q, kv, kv, paddings.numpy(), lib=tf)
    loss, ref_loss = tf.reduce_sum(tf.sin(enc)), tf.reduce_sum(tf.sin(ref))
  np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5)
  for got, want in zip(
    tape.gradient(loss, leaves), tape.gradient(ref_loss, leaves)
  ):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def testMetaAndVariableNames():
  p = _Atten()
  layer = p.Instantiate()
  assert 'att/query/w' in layer.VariablesByName()
  assert layer.vars.query.w.shape == (D, N, H)
  q, kv, paddings = _Inputs()
  outs = layer.FProp(layer.theta, q, kv, kv, paddings)
  m = p.cls.FPropMeta(p, q.shape, kv.shape, kv.shape, paddings.shape)
  assert m.out_shapes == tuple(o.shape for o in outs)
  projections = 2 * (B * T + B * S) * D * N * H * 2
  assert projections < m.flops < 2 * projections


def testDropoutIsDeterministicPerStepSeed():
  layer = _Atten(atten_dropout_prob=0.5).Instantiate()
  q, kv, paddings = _Inputs()

  def Run(seed):
    with py_utils.StepSeed(seed):
      return layer.FProp(layer.theta, q, kv, kv, paddings)[0].numpy()

  np.testing.assert_array_equal(Run(1), Run(1))
  assert not np.array_equal(Run(1), Run(2))
  with py_utils.EvalMode():
    no_drop = layer.FProp(layer.theta, q, kv, kv, paddings)[0].numpy()
  want, _ = _Reference(_NpTheta(layer), q, kv, kv, paddings)
  np.testing.assert_allclose(no_drop, want, rtol=1e-4, atol=1e-5)


def testShapeErrorsNameLayerAndShapes():
  layer = _Atten().Instantiate()
  q, kv, paddings = _Inputs()
  with pytest.raises(
    ValueError,
    match=r"MultiHeadedAttention 'att'.*"
    r'query_vec.*\[2, 3, 5\].*\[\?, \?, 6\]',
  ):
    layer.FProp(layer.theta, q[..., :5], kv, kv, paddings)
  with pytest.raises(ValueError, match=r"'att'.*paddings.*\[2, 3\]"):
    layer.FProp(layer.theta, q, kv, kv, paddings[:, :3])
  with pytest.raises(ValueError, match='divisible'):
    _Atten(hidden_dim=7).Instantiate()


@pytest.mark.parametrize('dtype', [tf.float32, tf.bfloat16])
def testCausalPaddingsOfKnownLengthsAreOneConstant(dtype):
  known = attention.CausalPaddings(3, 4, dtype)
  read = attention.CausalPaddings(tf.constant(3), tf.constant(4), dtype)
  assert known.dtype == read.dtype == dtype
  np.testing.assert_array_equal(
    tf.cast(known, tf.float32), tf.cast(read, tf.float32)
  )
  graph = (
    tf.function(lambda: attention.CausalPaddings(3, 4, dtype))
    .get_concrete_function()
    .graph
  )
  assert [op.type for op in graph.get_operations()] == ['Const', 'Identity']


def testUnknownLengthsGiveTheSameBits():
  """Masks of lengths known when traced (constants, static reshapes) and
  of lengths read at run time compute the same numbers."""
  p = attention.MultiHeadedAttention.Params().Set(
    name='atten', input_dim=8, hidden_dim=8, num_heads=2
  )
  layer = p.Instantiate()
  x = tf.random.stateless_normal([3, 5, 8], [1, 2])
  paddings = tf.constant([[0.0] * 5, [0.0] * 4 + [1.0], [0.0] * 3 + [1.0] * 2])
  known, _ = layer.FProp(layer.theta, x, x, x, paddings, causal=True)

  @tf.function(
    input_signature=[
      tf.TensorSpec([None, None, 8]),
      tf.TensorSpec([None, None]),
    ]
  )
  def Unknown(x, paddings):
    return layer.FProp(layer.theta, x, x, x, paddings, causal=True)[0]

  np.testing.assert_array_equal(known, Unknown(x, paddings))
