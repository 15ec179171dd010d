"""Tests of lingvo_gpipe.layers.softmax."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.layers import softmax

_RNG = np.random.RandomState(0)
_X = _RNG.randn(2, 3, 4).astype(np.float32)
_IDS = np.array([[0, 4, 2], [1, 1, 3]], np.int32)
_WEIGHTS = np.array([[1.0, 0.5, 0.0], [2.0, 1.0, 1.0]], np.float32)


def _Sm(**kwargs):
  p = softmax.SimpleFullSoftmax.Params().Set(
    name='sm', input_dim=4, num_classes=5
  )
  return p.Set(**kwargs)


def _LogSoftmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _NpLogits(layer):
  w = layer.vars.weight_0.numpy()
  if layer.params.use_num_classes_major_weight:
    w = w.T
  return _X @ w + layer.vars.bias_0.numpy()


def testXentLossMatchesNumpy():
  layer = _Sm().Instantiate()
  layer.vars.bias_0.assign(np.arange(5, dtype=np.float32) * 0.1)
  out = layer.XentLoss(
    layer.theta, tf.constant(_X), class_weights=_WEIGHTS, class_ids=_IDS
  )
  logits = _NpLogits(layer)
  log_probs = _LogSoftmax(logits)
  xent = -np.take_along_axis(log_probs, _IDS[..., None], -1)[..., 0]
  np.testing.assert_allclose(out.logits.numpy(), logits, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    out.log_probs.numpy(), log_probs, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(out.per_example_xent.numpy(), xent, rtol=1e-5)
  np.testing.assert_array_equal(
    out.per_example_argmax.numpy(), logits.argmax(-1)
  )
  np.testing.assert_allclose(
    out.total_xent.numpy(), (xent * _WEIGHTS).sum(), rtol=1e-5
  )
  assert out.total_weight.numpy() == _WEIGHTS.sum()
  np.testing.assert_allclose(
    out.avg_xent.numpy(), (xent * _WEIGHTS).sum() / _WEIGHTS.sum(), rtol=1e-5
  )
  # FProp is XentLoss with Lingvo's argument order; [..., 1] labels work.
  fprop = layer.FProp(
    layer.theta, tf.constant(_X), _WEIGHTS[..., None], _IDS[..., None]
  )
  np.testing.assert_allclose(fprop.avg_xent.numpy(), out.avg_xent.numpy())


def testLabelSmoothingAndProbabilities():
  layer = _Sm(label_smoothing=0.1).Instantiate()
  out = layer.XentLoss(layer.theta, tf.constant(_X), class_ids=_IDS)
  target = np.eye(5)[_IDS] * 0.9 + 0.1 / 5
  want = -(target * _LogSoftmax(_NpLogits(layer))).sum(-1)
  np.testing.assert_allclose(out.per_example_xent.numpy(), want, rtol=1e-5)
  # The same from class_probabilities, with smoothing passed per call.
  probs = np.eye(5, dtype=np.float32)[_IDS]
  out2 = layer.XentLoss(
    layer.theta, tf.constant(_X), class_probabilities=probs, label_smoothing=0.1
  )
  np.testing.assert_allclose(out2.per_example_xent.numpy(), want, rtol=1e-5)
  fn = softmax.SoftmaxCrossEntropyWithLabelSmoothing(
    tf.constant(_NpLogits(layer), tf.float32),
    class_ids=_IDS,
    label_smoothing=0.1,
  )
  np.testing.assert_allclose(fn.numpy(), want, rtol=1e-5)
  # No smoothing: the plain cross-entropy.
  out0 = layer.XentLoss(
    layer.theta, tf.constant(_X), class_ids=_IDS, label_smoothing=0.0
  )
  want0 = -np.take_along_axis(
    _LogSoftmax(_NpLogits(layer)), _IDS[..., None], -1
  )[..., 0]
  np.testing.assert_allclose(out0.per_example_xent.numpy(), want0, rtol=1e-5)


def testLogitsAbsMax():
  layer = _Sm(logits_abs_max=0.2).Instantiate()
  logits = layer.Logits(layer.theta, tf.constant(_X * 100)).numpy()
  assert np.abs(logits).max() <= 0.2 + 1e-6
  assert np.isclose(np.abs(logits).max(), 0.2)


def testShardsAndClassMajorLayout():
  sharded = _Sm(num_classes=6, num_shards=3).Instantiate()
  assert sharded.vars.weight_2.shape == (4, 2)
  w = np.concatenate([sharded.vars[f'weight_{i}'].numpy() for i in range(3)], 1)
  np.testing.assert_allclose(
    sharded.Logits(sharded.theta, tf.constant(_X)).numpy(),
    _X @ w,
    rtol=1e-5,
    atol=1e-6,
  )
  major = _Sm(use_num_classes_major_weight=True).Instantiate()
  assert major.vars.weight_0.shape == (5, 4)
  np.testing.assert_allclose(
    major.Logits(major.theta, tf.constant(_X)).numpy(),
    _NpLogits(major),
    rtol=1e-5,
    atol=1e-6,
  )


def testMetaMatchesFProp():
  p = _Sm()
  layer = p.Instantiate()
  out = layer.FProp(layer.theta, tf.constant(_X), _WEIGHTS, _IDS)
  m = p.cls.FPropMeta(p, _X.shape, _WEIGHTS.shape, _IDS.shape)
  (shapes,) = m.out_shapes
  assert sorted(shapes) == sorted(out)
  for k in out:
    assert shapes[k] == out[k].shape, k
  assert m.flops >= 2 * 6 * 4 * 5


def testErrors():
  layer = _Sm().Instantiate()
  with pytest.raises(ValueError, match=r"SimpleFullSoftmax 'sm'.*\[2, 3, 3\]"):
    layer.Logits(layer.theta, tf.zeros([2, 3, 3]))
  with pytest.raises(ValueError, match='exactly one'):
    layer.XentLoss(layer.theta, tf.constant(_X))
  with pytest.raises(ValueError, match=r"'sm'.*class_ids.*\[2, 2\]"):
    layer.XentLoss(layer.theta, tf.constant(_X), class_ids=_IDS[:, :2])
  with pytest.raises(ValueError, match='num_shards'):
    _Sm(num_shards=2).Instantiate()
