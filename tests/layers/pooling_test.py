"""Tests of lingvo_gpipe.layers.pooling."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.layers import pooling

_X = np.random.RandomState(0).randn(2, 4, 6, 3).astype(np.float32)


@pytest.mark.parametrize('pooling_type,fn', [('MAX', np.max), ('AVG', np.mean)])
def testPoolingMatchesNumpy(pooling_type, fn):
  p = pooling.PoolingLayer.Params().Set(
    name='pool',
    window_shape=(2, 3),
    window_stride=(2, 3),
    pooling_type=pooling_type,
    padding_algorithm='VALID',
  )
  layer = p.Instantiate()
  out = layer.FProp(layer.theta, tf.constant(_X))
  want = fn(_X.reshape([2, 2, 2, 2, 3, 3]), axis=(2, 4))
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
  m = p.cls.FPropMeta(p, _X.shape)
  assert m.out_shapes == (out.shape,)
  assert m.flops == 6 * int(np.prod(out.shape))


def testSamePaddingShape():
  p = pooling.PoolingLayer.Params().Set(
    name='pool', window_shape=(3, 3), window_stride=(2, 2)
  )
  layer = p.Instantiate()
  out = layer.FProp(layer.theta, tf.zeros([1, 5, 7, 2]))
  assert out.shape == (1, 3, 4, 2)
  assert p.cls.FPropMeta(p, [1, 5, 7, 2]).out_shapes == (out.shape,)


def testPoolingErrors():
  p = pooling.PoolingLayer.Params().Set(name='pool', pooling_type='MIN')
  with pytest.raises(ValueError, match="PoolingLayer 'pool'.*MIN"):
    p.Instantiate()
  layer = pooling.PoolingLayer.Params().Set(name='pool').Instantiate()
  with pytest.raises(ValueError, match=r"'pool'.*\[2, 3\]"):
    layer.FProp(layer.theta, tf.zeros([2, 3]))


@pytest.mark.parametrize('keepdims', [True, False])
@pytest.mark.parametrize('pooling_type,fn', [('MAX', np.max), ('AVG', np.mean)])
def testGlobalPooling(pooling_type, fn, keepdims):
  p = pooling.GlobalPoolingLayer.Params().Set(
    name='gp', pooling_type=pooling_type, keepdims=keepdims
  )
  layer = p.Instantiate()
  out = layer.FProp(layer.theta, tf.constant(_X))
  want = fn(_X, axis=(1, 2), keepdims=keepdims)
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
  assert p.cls.FPropMeta(p, _X.shape).out_shapes == (out.shape,)
