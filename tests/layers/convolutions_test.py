"""Tests of lingvo_gpipe.layers.convolutions."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import convolutions


def _Pad(x, kernel, stride, dilation, padding):
  """Pads NHWC `x` as TensorFlow does; returns the padded array."""
  if padding == 'VALID':
    return x
  pads = [(0, 0)]
  for i in range(2):
    size = x.shape[1 + i]
    eff = (kernel[i] - 1) * dilation[i] + 1
    out = -(-size // stride[i])
    total = max((out - 1) * stride[i] + eff - size, 0)
    pads.append((total // 2, total - total // 2))
  return np.pad(x, pads + [(0, 0)])


def _NumpyConv(x, w, stride, dilation, padding, depthwise=False):
  """Direct convolution; w is [h, w, in, out] (or [h, w, in, mult])."""
  kh, kw, c_in, c_out = w.shape
  xp = _Pad(x, (kh, kw), stride, dilation, padding)
  eh, ew = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
  oh = (xp.shape[1] - eh) // stride[0] + 1
  ow = (xp.shape[2] - ew) // stride[1] + 1
  n_out = c_in * c_out if depthwise else c_out
  out = np.zeros([x.shape[0], oh, ow, n_out], np.float64)
  for i in range(oh):
    for j in range(ow):
      patch = xp[
        :,
        i * stride[0] : i * stride[0] + eh : dilation[0],
        j * stride[1] : j * stride[1] + ew : dilation[1],
        :,
      ]
      if depthwise:
        out[:, i, j, :] = np.einsum('bhwc,hwcm->bcm', patch, w).reshape(
          [x.shape[0], -1]
        )
      else:
        out[:, i, j, :] = np.einsum('bhwc,hwco->bo', patch, w)
  return out


@pytest.mark.parametrize(
  'fs,stride,dil,pad',
  [
    ((3, 3, 2, 4), (1, 1), (1, 1), 'SAME'),
    ((3, 2, 2, 4), (2, 2), (1, 1), 'SAME'),
    ((3, 3, 2, 3), (2, 1), (1, 1), 'VALID'),
    ((2, 3, 2, 3), (1, 1), (2, 2), 'VALID'),
    ((3, 3, 2, 3), (1, 1), (2, 1), 'SAME'),
  ],
)
def testConv2DMatchesNumpyAndMeta(fs, stride, dil, pad):
  p = convolutions.Conv2DLayer.Params().Set(
    name='conv',
    filter_shape=fs,
    filter_stride=stride,
    dilation_rate=dil,
    padding_algorithm=pad,
    activation='NONE',
    bias=True,
  )
  layer = p.Instantiate()
  layer.vars.b.assign(tf.range(fs[3], dtype=tf.float32))
  x = np.random.RandomState(0).randn(2, 7, 6, 2).astype(np.float32)
  out = layer.FProp(layer.theta, tf.constant(x))
  want = _NumpyConv(x, layer.vars.w.numpy(), stride, dil, pad) + np.arange(
    fs[3]
  )
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)
  m = p.cls.FPropMeta(p, [2, 7, 6, 2])
  assert m.out_shapes == (out.shape,)
  n_out = int(np.prod(out.shape))
  assert m.flops == 2 * fs[0] * fs[1] * fs[2] * n_out + n_out


def testConv2DGradientsMatchReference():
  p = convolutions.Conv2DLayer.Params().Set(
    name='conv',
    filter_shape=(3, 3, 2, 3),
    filter_stride=(2, 2),
    bias=True,
    activation='RELU',
  )
  layer = p.Instantiate()
  x = tf.constant(np.random.RandomState(1).randn(2, 5, 5, 2), tf.float32)
  w = tf.constant(layer.vars.w.numpy())
  b = tf.constant([0.1, -0.1, 0.2])
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([x, w, b])
    loss = tf.reduce_sum(
      tf.square(layer.FProp(py_utils.NestedMap(w=w, b=b), x))
    )
    ref = tf.reduce_sum(
      tf.square(tf.nn.relu(tf.nn.conv2d(x, w, [2, 2], 'SAME') + b))
    )
  np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-5)
  for got, want in zip(
    tape.gradient(loss, [x, w, b]), tape.gradient(ref, [x, w, b])
  ):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def testDepthwiseMatchesNumpy():
  p = convolutions.DepthwiseConv2DLayer.Params().Set(
    name='dw',
    filter_shape=(3, 3, 2, 2),
    filter_stride=(2, 2),
    activation='NONE',
  )
  layer = p.Instantiate()
  x = np.random.RandomState(2).randn(1, 5, 6, 2).astype(np.float32)
  out = layer.FProp(layer.theta, tf.constant(x))
  want = _NumpyConv(
    x, layer.vars.w.numpy(), (2, 2), (1, 1), 'SAME', depthwise=True
  )
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)
  m = p.cls.FPropMeta(p, [1, 5, 6, 2])
  assert m.out_shapes == (out.shape,) and out.shape[-1] == 4
  assert m.flops == 2 * 9 * int(np.prod(out.shape))


def testSeparableIsDepthwiseThenPointwise():
  p = convolutions.SeparableConv2DLayer.Params().Set(
    name='sep',
    filter_shape=(3, 3, 2, 5),
    depth_multiplier=2,
    activation='NONE',
    bias=True,
  )
  layer = p.Instantiate()
  assert layer.vars.w.shape == (1, 1, 4, 5)
  assert layer.vars.depthwise_conv.w.shape == (3, 3, 2, 2)
  x = np.random.RandomState(3).randn(1, 4, 4, 2).astype(np.float32)
  out = layer.FProp(layer.theta, tf.constant(x))
  dw = _NumpyConv(
    x,
    layer.vars.depthwise_conv.w.numpy(),
    (1, 1),
    (1, 1),
    'SAME',
    depthwise=True,
  )
  want = dw @ layer.vars.w.numpy()[0, 0] + layer.vars.b.numpy()
  np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)
  m = p.cls.FPropMeta(p, [1, 4, 4, 2])
  assert m.out_shapes == (out.shape,)
  assert m.flops == 2 * 9 * 16 * 4 + 2 * 4 * 16 * 5 + 16 * 5


def testBatchNormChild():
  p = convolutions.Conv2DLayer.Params().Set(
    name='conv', filter_shape=(1, 1, 2, 3), batch_norm=True
  )
  layer = p.Instantiate()
  assert sorted(layer.VariablesByName()) == [
    'conv/bn/beta',
    'conv/bn/gamma',
    'conv/bn/moving_mean',
    'conv/bn/moving_variance',
    'conv/w',
  ]
  with py_utils.UpdateCollector():  # keep the moving averages untouched
    out = layer.FProp(layer.theta, tf.random.normal([4, 3, 3, 2]))
  pre = out.numpy()
  assert pre.min() >= 0.0  # RELU after the normalization.


def testPaddingsGiveOutputPaddings():
  p = convolutions.Conv2DLayer.Params().Set(
    name='conv', filter_shape=(3, 1, 1, 1), filter_stride=(2, 1)
  )
  layer = p.Instantiate()
  x = tf.ones([1, 6, 1, 1])
  paddings = tf.constant([[0.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
  out, out_paddings = layer.FProp(layer.theta, x, paddings)
  np.testing.assert_array_equal(out_paddings.numpy(), [[0.0, 0.0, 1.0]])
  assert out.numpy()[0, 2, 0, 0] == 0.0
  m = p.cls.FPropMeta(p, [1, 6, 1, 1], [1, 6])
  assert m.out_shapes == (out.shape, out_paddings.shape)


def testChannelMismatchNamesLayerAndShapes():
  p = convolutions.Conv2DLayer.Params().Set(
    name='conv', filter_shape=(3, 3, 2, 4)
  )
  layer = p.Instantiate()
  with pytest.raises(ValueError) as e:
    layer.FProp(layer.theta, tf.zeros([1, 5, 5, 3]))
  msg = str(e.value)
  assert "Conv2DLayer 'conv'" in msg and '[1, 5, 5, 3]' in msg
  assert '[?, ?, ?, 2]' in msg


def testBadParams():
  base = convolutions.Conv2DLayer.Params().Set(
    name='conv', filter_shape=(3, 3, 2, 4)
  )
  with pytest.raises(ValueError, match='both > 1'):
    base.Copy().Set(filter_stride=(2, 2), dilation_rate=(2, 2)).Instantiate()
  with pytest.raises(ValueError, match='padding_algorithm'):
    base.Copy().Set(padding_algorithm='FULL').Instantiate()
  with pytest.raises(ValueError, match='filter_shape'):
    base.Copy().Set(filter_shape=(3, 3, 2)).Instantiate()
  p = base.Copy().Set(padding_algorithm='VALID', filter_shape=(5, 5, 2, 4))
  with pytest.raises(ValueError, match='empty'):
    p.cls.FPropMeta(p, [1, 3, 3, 2])


@pytest.mark.parametrize(
  'cls', [convolutions.Conv2DLayer, convolutions.SeparableConv2DLayer]
)
@pytest.mark.parametrize('dil', [1, 2])
def testCausalConvolutionSeesOnlyThePast(cls, dil):
  """Output step t depends on input steps <= t only, and the output is as
  long as the input; it equals the convolution of the input with
  (kernel - 1) * dilation zero steps in front (numpy)."""
  p = cls.Params().Set(
    name='causal',
    filter_shape=(3, 1, 2, 3),
    dilation_rate=(dil, 1),
    causal_convolution=True,
    activation='NONE',
  )
  layer = p.Instantiate()
  x = np.random.RandomState(0).randn(2, 7, 1, 2).astype(np.float32)
  y = layer.FPropDefaultTheta(tf.constant(x)).numpy()
  assert y.shape == (2, 7, 1, 3)
  x2 = x.copy()
  x2[:, 4:] *= 3.0
  y2 = layer.FPropDefaultTheta(tf.constant(x2)).numpy()
  np.testing.assert_allclose(y[:, :4], y2[:, :4], rtol=1e-6)
  assert not np.allclose(y[:, 4:], y2[:, 4:])
  if cls is convolutions.Conv2DLayer:
    front = np.pad(x, [(0, 0), (2 * dil, 0), (0, 0), (0, 0)])
    w = layer.theta.w.numpy()
    ref = _NumpyConv(front, w, (1, 1), (dil, 1), 'VALID')
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
  assert p.cls.FPropMeta(p, [2, 7, 1, 2]).out_shapes[0] == [2, 7, 1, 3]


def testCausalConvolutionRefusesOtherPadding():
  p = convolutions.Conv2DLayer.Params().Set(
    name='c', filter_shape=(3, 1, 2, 3), causal_convolution=True
  )
  with pytest.raises(ValueError, match="padding_algorithm='VALID' conflicts"):
    p.Copy().Set(padding_algorithm='VALID').Instantiate()
  with pytest.raises(ValueError, match='width stride > 1'):
    p.Copy().Set(filter_shape=(3, 2, 2, 3), filter_stride=(1, 2)).Instantiate()
