"""Tests of lingvo_gpipe.layers.sequential and the core.layers import path."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers as layers_pkg
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import layers
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import sequential


def _Fc(i, o, name=''):
  return layers.FCLayer.Params().Set(
    name=name, input_dim=i, output_dim=o, activation='TANH'
  )


class _ToMap(base_layer.BaseLayer):
  """Test layer: x -> NestedMap(x=x, y=2x)."""

  def FProp(self, theta, x):
    return py_utils.NestedMap(x=x, y=2.0 * x)

  @classmethod
  def FPropMeta(cls, p, x):
    s = tf.TensorShape(x)
    return py_utils.NestedMap(
      flops=1, out_shapes=(py_utils.NestedMap(x=s, y=s),)
    )


class _FromMap(base_layer.BaseLayer):
  """Test layer: NestedMap(x, y) -> x + y."""

  def FProp(self, theta, m):
    return m.x + m.y

  @classmethod
  def FPropMeta(cls, p, m):
    return py_utils.NestedMap(flops=1, out_shapes=(m.x,))


def testSequentialMatchesManualChain():
  p = layers.SequentialLayer.Params().Set(
    name='seq', sub=[_Fc(4, 5), _Fc(5, 3, name='top')]
  )
  seq = p.Instantiate()
  assert sorted(seq.VariablesByName()) == [
    'seq/sub_0/b',
    'seq/sub_0/w',
    'seq/top/b',
    'seq/top/w',
  ]
  x = np.random.RandomState(0).randn(2, 4).astype(np.float32)
  out = seq.FProp(seq.theta, tf.constant(x))
  v = seq.vars.sub
  h = np.tanh(x @ v[0].w.numpy() + v[0].b.numpy())
  want = np.tanh(h @ v[1].w.numpy() + v[1].b.numpy())
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
  m = p.cls.FPropMeta(p, [2, 4])
  assert m.out_shapes == (out.shape,)
  assert m.flops == sum(
    sp.cls.FPropMeta(sp, s).flops for sp, s in zip(p.sub, ([2, 4], [2, 5]))
  )


def testTuplesAndNestedMapsFlowThrough():
  conv = layers.Conv2DLayer.Params().Set(
    filter_shape=(3, 1, 1, 1), filter_stride=(2, 1)
  )
  p = layers.SequentialLayer.Params().Set(name='seq', sub=[conv, conv.Copy()])
  seq = p.Instantiate()
  out, paddings = seq.FProp(seq.theta, tf.ones([1, 8, 1, 1]), tf.zeros([1, 8]))
  assert out.shape == (1, 2, 1, 1) and paddings.shape == (1, 2)
  m = p.cls.FPropMeta(p, [1, 8, 1, 1], [1, 8])
  assert m.out_shapes == (out.shape, paddings.shape)
  maps = layers.SequentialLayer.Params().Set(
    name='maps', sub=[_ToMap.Params(), _FromMap.Params()]
  )
  layer = maps.Instantiate()
  np.testing.assert_allclose(
    layer.FProp(layer.theta, tf.ones([2])).numpy(), [3.0, 3.0]
  )
  assert maps.cls.FPropMeta(maps, [2]).out_shapes == (tf.TensorShape([2]),)


def testMetaErrorNamesTheLayer():
  p = layers.SequentialLayer.Params().Set(
    name='seq', sub=[_Fc(4, 5), _Fc(6, 3, name='bad')]
  )
  with pytest.raises(ValueError, match=r'Layer 1 \(bad, FCLayer\).*\[2, 5\]'):
    p.cls.FPropMeta(p, [2, 4])
  with pytest.raises(ValueError, match="'seq'.*non-empty"):
    layers.SequentialLayer.Params().Set(name='seq').Instantiate()


def testRepeatLayer():
  p = layers.RepeatLayer.Params().Set(name='rep', body=_Fc(4, 4), repeat=3)
  rep = p.Instantiate()
  assert [c.path for c in rep.body] == [
    'rep/body_0',
    'rep/body_1',
    'rep/body_2',
  ]
  assert 'rep/body_2/w' in rep.VariablesByName()
  # Copies have distinct initial values (the seed includes the name).
  assert not np.allclose(rep.vars.body[0].w.numpy(), rep.vars.body[1].w.numpy())
  x = tf.random.normal([2, 4])
  out = rep.FProp(rep.theta, x)
  y = x
  for i in range(3):
    y = rep.body[i].FProp(rep.theta.body[i], y)
  np.testing.assert_allclose(out.numpy(), y.numpy(), rtol=1e-6)
  m = p.cls.FPropMeta(p, [2, 4])
  body = p.body.cls.FPropMeta(p.body, [2, 4])
  assert m.out_shapes == (out.shape,) and m.flops == 3 * body.flops
  with pytest.raises(ValueError, match="'rep'.*repeat"):
    p.Copy().Set(repeat=0).Instantiate()


def testCoreLayersReexportsEveryLayer():
  for name in layers_pkg.__all__:
    assert getattr(layers, name) is getattr(layers_pkg, name)
  assert layers.FCLayer.__name__ == 'FCLayer'
  assert sequential.SequentialLayer is layers.SequentialLayer
