"""Tests of lingvo_gpipe.layers.dropout: stateless, addressable masks."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import sequential


def _Dropout(name='drop', keep_prob=0.5, **kwargs):
  return (
    dropout.DropoutLayer.Params()
    .Set(name=name, keep_prob=keep_prob, **kwargs)
    .Instantiate()
  )


def _Run(layer, seed, x=None):
  x = tf.ones([64, 32]) if x is None else x
  with py_utils.StepSeed(seed):
    return layer.FProp(layer.theta, x).numpy()


def testSameStepSeedSameMask():
  layer = _Dropout()
  np.testing.assert_array_equal(_Run(layer, 7), _Run(layer, 7))
  # A layer rebuilt with the same name draws the same mask too.
  np.testing.assert_array_equal(_Run(layer, 7), _Run(_Dropout(), 7))


def testDifferentStepSeedDifferentMask():
  layer = _Dropout()
  assert not np.array_equal(_Run(layer, 1), _Run(layer, 2))


def testDifferentLayersDifferentMasks():
  p = sequential.SequentialLayer.Params().Set(
    name='root',
    sub=[
      dropout.DropoutLayer.Params().Set(name='a', keep_prob=0.5),
      dropout.DropoutLayer.Params().Set(name='b', keep_prob=0.5),
    ],
  )
  root = p.Instantiate()
  a, b = root.sub
  assert a.layer_seed != b.layer_seed
  assert not np.array_equal(_Run(a, 3), _Run(b, 3))
  seeded = _Dropout(random_seed=5)
  assert not np.array_equal(_Run(_Dropout(), 3), _Run(seeded, 3))


def testKeepFractionAndScaling():
  layer = _Dropout(keep_prob=0.7)
  out = _Run(layer, 11, tf.ones([200, 500]))
  kept = out != 0
  assert abs(kept.mean() - 0.7) < 0.01
  np.testing.assert_allclose(out[kept], 1.0 / 0.7, rtol=1e-6)


def testIdentityInEvalAndAtKeepProbOne():
  x = tf.random.normal([4, 5])
  with py_utils.EvalMode():
    np.testing.assert_array_equal(_Run(_Dropout(), 1, x), x.numpy())
  np.testing.assert_array_equal(_Run(_Dropout(keep_prob=1.0), 1, x), x.numpy())
  assert _Dropout(dropout_at_eval=True).params.dropout_at_eval
  with py_utils.EvalMode():
    assert (_Run(_Dropout(dropout_at_eval=True), 1, x) == 0).any()


def testNoiseShapeBroadcastDims():
  layer = _Dropout(noise_shape_broadcast_dims=[1])
  out = _Run(layer, 4, tf.ones([8, 6, 5]))
  # The same channels are dropped at every time step.
  np.testing.assert_array_equal(out, np.broadcast_to(out[:, :1], out.shape))
  with pytest.raises(ValueError, match="DropoutLayer 'drop'.*rank 2"):
    _Dropout(noise_shape_broadcast_dims=[3]).FProp(None, tf.ones([2, 3]))


def testDeterministicInsideTfFunction():
  layer = _Dropout()

  @tf.function
  def Fn(seed):
    with py_utils.StepSeed(seed):
      return layer.FProp(layer.theta, tf.ones([16, 16]))

  a, b = Fn(tf.constant(5, tf.int64)), Fn(tf.constant(5, tf.int64))
  np.testing.assert_array_equal(a.numpy(), b.numpy())
  np.testing.assert_array_equal(a.numpy(), _Run(layer, 5, tf.ones([16, 16])))
  assert not np.array_equal(a.numpy(), Fn(tf.constant(6, tf.int64)).numpy())


def testParamsAndMeta():
  with pytest.raises(ValueError, match="'drop'.*keep_prob"):
    _Dropout(keep_prob=0.0)
  p = dropout.DropoutLayer.Params().Set(name='drop', keep_prob=0.5)
  m = p.cls.FPropMeta(p, [4, 5])
  assert m.out_shapes == (tf.TensorShape([4, 5]),) and m.flops == 60
