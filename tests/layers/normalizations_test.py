"""Tests of lingvo_gpipe.layers.normalizations."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import normalizations


def _Bn(name='bn', **kwargs):
  p = normalizations.BatchNormLayer.Params().Set(name=name, dim=3, decay=0.9)
  return p.Set(**kwargs)


def _Data(shape=(8, 5, 3), seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(*shape) * [1.0, 2.0, 0.5] + [0.0, 1.0, -2.0]).astype(
    np.float32
  )


def _SetAffine(layer):
  layer.vars.gamma.assign([1.5, 0.5, 2.0])
  layer.vars.beta.assign([0.1, -0.2, 0.3])
  return np.array([1.5, 0.5, 2.0]), np.array([0.1, -0.2, 0.3])


def testVariables():
  layer = _Bn().Instantiate()
  names = {v.name.split(':')[0]: v.trainable for v in layer.variables}
  assert names == {
    'bn/beta': True,
    'bn/gamma': True,
    'bn/moving_mean': False,
    'bn/moving_variance': False,
  }


def testTrainingUsesBatchStatsAndUpdatesAtOnce():
  layer = _Bn().Instantiate()
  gamma, beta = _SetAffine(layer)
  x = _Data()
  out = layer.FProp(layer.theta, tf.constant(x)).numpy()
  mean, var = x.reshape([-1, 3]).mean(0), x.reshape([-1, 3]).var(0)
  want = (x - mean) / np.sqrt(var + 1e-3) * gamma + beta
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
  # No collector: the moving averages were updated once.
  np.testing.assert_allclose(
    layer.vars.moving_mean.numpy(), 0.1 * mean, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    layer.vars.moving_variance.numpy(), 0.9 + 0.1 * var, rtol=1e-5
  )


def testEvalUsesMovingAverages():
  layer = _Bn().Instantiate()
  gamma, beta = _SetAffine(layer)
  layer.vars.moving_mean.assign([1.0, 2.0, 3.0])
  layer.vars.moving_variance.assign([4.0, 1.0, 0.25])
  x = _Data()
  with py_utils.EvalMode():
    with py_utils.UpdateCollector() as updates:
      out = layer.FProp(layer.theta, tf.constant(x)).numpy()
  assert not updates.updates
  want = (x - [1.0, 2.0, 3.0]) / np.sqrt(np.array([4.0, 1.0, 0.25]) + 1e-3)
  np.testing.assert_allclose(out, want * gamma + beta, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(layer.vars.moving_mean.numpy(), [1.0, 2.0, 3.0])


def testDeferredUpdatesOfChunksEqualWholeBatchUpdate():
  x = _Data(shape=(8, 6, 3), seed=1)
  chunked = _Bn('chunked').Instantiate()
  whole = _Bn('whole').Instantiate()
  with py_utils.UpdateCollector() as updates:
    outs = [chunked.FProp(chunked.theta, c) for c in tf.split(x, 4)]
  assert len(updates.updates) == 4
  np.testing.assert_allclose(chunked.vars.moving_mean.numpy(), 0.0)
  updates.Apply()
  with py_utils.UpdateCollector() as whole_updates:
    whole.FProp(whole.theta, tf.constant(x))
  whole_updates.Apply()
  for name in ('moving_mean', 'moving_variance'):
    np.testing.assert_allclose(
      chunked.vars[name].numpy(), whole.vars[name].numpy(), rtol=1e-5, atol=1e-6
    )
  # Each chunk is normalized with its own statistics.
  c0 = x[:2].reshape([-1, 3])
  np.testing.assert_allclose(
    outs[0].numpy().reshape([-1, 3]),
    (c0 - c0.mean(0)) / np.sqrt(c0.var(0) + 1e-3),
    rtol=1e-4,
    atol=1e-4,
  )


def testDeferredUpdatesRunOnTheVariablesDevice():
  """The statistics are merged where the moving averages live, whatever
  the caller's device scope: elsewhere (the driving process, for a
  pipeline over worker processes) every micro-batch's statistics went
  there and back."""
  with tf.device('/device:CPU:1'):
    layer = _Bn('placed').Instantiate()
  x = tf.constant(_Data())

  made = []

  @tf.function
  def Step():
    with py_utils.UpdateCollector() as updates:
      for chunk in tf.split(x, 2):
        layer.FProp(layer.theta, chunk)
    graph = tf.compat.v1.get_default_graph()
    n = len(graph.get_operations())
    with tf.device('/device:CPU:2'):
      updates.Apply()
    made.extend(graph.get_operations()[n:])

  Step.get_concrete_function()
  # (The variables' reads go with the variables wherever they are built.)
  made = [op for op in made if op.type not in ('Placeholder', 'ReadVariableOp')]
  devices = {op.device for op in made}
  assert len(made) > 10 and len(devices) == 1, devices
  assert devices.pop().endswith('/device:CPU:1')


def testMergeMomentsIsExact():
  x = _Data(shape=(10, 3), seed=2)
  sizes = [1, 2, 3, 4]
  chunks = np.split(x, np.cumsum(sizes)[:-1])
  stats = [
    py_utils.NestedMap(
      mean=tf.constant(c.mean(0)),
      variance=tf.constant(c.var(0)),
      count=float(len(c)),
    )
    for c in chunks
  ]
  mean, var, count = normalizations.MergeMoments(stats)
  np.testing.assert_allclose(mean.numpy(), x.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var.numpy(), x.var(0), rtol=1e-5, atol=1e-6)
  assert count.numpy() == 10


def testPaddedPositionsAreLeftOut():
  layer = _Bn().Instantiate()
  x = _Data(shape=(2, 4, 3))
  paddings = np.array([[0, 0, 0, 1], [0, 0, 1, 1]], np.float32)
  with py_utils.UpdateCollector() as updates:
    out = layer.FProp(layer.theta, tf.constant(x), tf.constant(paddings))
  valid = x[paddings == 0]
  stats = updates.updates[0][1]
  np.testing.assert_allclose(
    stats.mean.numpy(), valid.mean(0), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(stats.variance.numpy(), valid.var(0), rtol=1e-4)
  assert stats.count.numpy() == 5
  assert np.all(out.numpy()[paddings == 1] == 0)


def testUseMovingAvgInTraining():
  layer = _Bn(use_moving_avg_in_training=True).Instantiate()
  assert 'gamma' not in layer.vars and 'beta' not in layer.vars
  x = _Data()
  with py_utils.UpdateCollector() as updates:
    out = layer.FProp(layer.theta, tf.constant(x))
  np.testing.assert_allclose(out.numpy(), x / np.sqrt(1.0 + 1e-3), rtol=1e-5)
  assert len(updates.updates) == 1


def testBatchNormShapeErrorAndMeta():
  p = _Bn()
  layer = p.Instantiate()
  with pytest.raises(ValueError) as e:
    layer.FProp(layer.theta, tf.zeros([2, 4]))
  assert "BatchNormLayer 'bn'" in str(e.value) and '[2, 4]' in str(e.value)
  assert '[..., 3]' in str(e.value)
  m = p.cls.FPropMeta(p, [2, 5, 3])
  assert m.out_shapes == (tf.TensorShape([2, 5, 3]),) and m.flops > 0


def testLayerNormMatchesNumpyWithGradients():
  p = normalizations.LayerNorm.Params().Set(name='ln', input_dim=3)
  layer = p.Instantiate()
  assert sorted(layer.VariablesByName()) == ['ln/bias', 'ln/scale']
  x = tf.constant(_Data())
  scale = tf.constant([1.5, 0.5, 2.0])
  bias = tf.constant([0.1, -0.2, 0.3])
  theta = py_utils.NestedMap(scale=scale, bias=bias)
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([x, scale, bias])
    out = layer.FProp(theta, x)
    mean = tf.reduce_mean(x, -1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), -1, keepdims=True)
    ref = (x - mean) / tf.sqrt(var + 1e-6) * scale + bias
    loss, ref_loss = [tf.reduce_sum(tf.sin(y)) for y in (out, ref)]
  xn = x.numpy()
  want = (
    (xn - xn.mean(-1, keepdims=True))
    / np.sqrt(xn.var(-1, keepdims=True) + 1e-6)
  ) * scale.numpy() + bias
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)
  for got, exp in zip(
    tape.gradient(loss, [x, scale, bias]),
    tape.gradient(ref_loss, [x, scale, bias]),
  ):
    np.testing.assert_allclose(got.numpy(), exp.numpy(), rtol=1e-3, atol=1e-4)
  assert p.cls.FPropMeta(p, x.shape).out_shapes == (out.shape,)
  with pytest.raises(ValueError, match=r"LayerNorm 'ln'.*\[2, 4\]"):
    layer.FProp(layer.theta, tf.zeros([2, 4]))
