"""Tests of lingvo_gpipe.layers.linears."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import sequential


def _Fc(**kwargs):
  p = linears.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=3)
  return p.Set(**kwargs)


def testFCDefaultsAreLingvos():
  p = linears.FCLayer.Params()
  assert p.has_bias and not p.batch_norm and p.activation == 'RELU'


def testFCForwardMatchesNumpyOnRank3():
  layer = _Fc(bias_init=0.5).Instantiate()
  x = np.random.RandomState(0).randn(2, 5, 4).astype(np.float32)
  out = layer.FProp(layer.theta, tf.constant(x)).numpy()
  w, b = layer.vars.w.numpy(), layer.vars.b.numpy()
  np.testing.assert_allclose(
    out, np.maximum(x @ w + b, 0), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(b, 0.5)


def testFCGradientsMatchReference():
  layer = _Fc(activation='TANH').Instantiate()
  x = tf.constant(np.random.RandomState(1).randn(3, 4).astype(np.float32))
  w = tf.constant(layer.vars.w.numpy())
  b = tf.constant(layer.vars.b.numpy())
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([x, w, b])
    theta = py_utils.NestedMap(w=w, b=b)
    loss = tf.reduce_sum(tf.square(layer.FProp(theta, x)))
    ref = tf.reduce_sum(tf.square(tf.tanh(tf.matmul(x, w) + b)))
  np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-6)
  for got, want in zip(
    tape.gradient(loss, [x, w, b]), tape.gradient(ref, [x, w, b])
  ):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def testFPropMetaMatchesFProp():
  p = _Fc(activation='NONE')
  layer = p.Instantiate()
  out = layer.FProp(layer.theta, tf.zeros([2, 5, 4]))
  m = p.cls.FPropMeta(p, tf.TensorShape([2, 5, 4]))
  assert m.out_shapes == (out.shape,)
  assert m.flops == 2 * 4 * 3 * 10 + 3 * 10  # matmul + bias
  assert p.cls.FPropMeta(p, [None, 4]).out_shapes[0].as_list() == [None, 3]


def testShapeMismatchNamesLayerAndShapes():
  layer = _Fc().Instantiate()
  with pytest.raises(ValueError) as e:
    layer.FProp(layer.theta, tf.zeros([2, 5]))
  msg = str(e.value)
  assert "FCLayer 'fc'" in msg and '[2, 5]' in msg and '[..., 4]' in msg
  assert 'input_dim' in msg
  with pytest.raises(ValueError, match=r"'fc'.*\[7, 5\]"):
    linears.FCLayer.FPropMeta(_Fc(), [7, 5])


def testBadParamsNameLayer():
  with pytest.raises(ValueError, match="FCLayer 'fc'.*output_dim"):
    _Fc(output_dim=0).Instantiate()
  with pytest.raises(ValueError, match='activation'):
    _Fc(activation='NOPE').Instantiate()


def testProjectionWithBatchNormAndPaddings():
  p = linears.ProjectionLayer.Params().Set(
    name='proj',
    input_dim=4,
    output_dim=3,
    has_bias=False,
    batch_norm=True,
    activation='NONE',
  )
  layer = p.Instantiate()
  assert 'b' not in layer.vars and 'bn' in layer.vars
  x = np.random.RandomState(2).randn(2, 4, 4).astype(np.float32)
  paddings = np.zeros([2, 4, 1], np.float32)
  paddings[1, 2:] = 1.0
  out = layer.FProp(layer.theta, tf.constant(x), tf.constant(paddings))
  y = (x @ layer.vars.w.numpy()).reshape([-1, 3])
  valid = y[paddings.reshape([-1]) == 0]
  mean, var = valid.mean(0), valid.var(0)
  want = (y - mean) / np.sqrt(var + 1e-3) * (1 - paddings.reshape([-1, 1]))
  np.testing.assert_allclose(
    out.numpy().reshape([-1, 3]), want, rtol=1e-4, atol=1e-5
  )


def testVariableNamesAreHierarchical():
  p = sequential.SequentialLayer.Params().Set(
    name='root', sub=[_Fc(name='child')]
  )
  layer = p.Instantiate()
  assert sorted(layer.VariablesByName()) == ['root/child/b', 'root/child/w']


def testBiasLayer():
  p = linears.BiasLayer.Params().Set(name='bias', dims=3, bias_init=1.5)
  layer = p.Instantiate()
  out = layer.FProp(layer.theta, tf.zeros([2, 3]))
  np.testing.assert_allclose(out.numpy(), np.full([2, 3], 1.5))
  assert p.cls.FPropMeta(p, [2, 3]).out_shapes == (out.shape,)
  with pytest.raises(ValueError, match=r"BiasLayer 'bias'.*\[2, 4\]"):
    layer.FProp(layer.theta, tf.zeros([2, 4]))
