"""Tests of lingvo_gpipe.layers.activations."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.layers import activations

_X = np.linspace(-4.0, 4.0, 17).astype(np.float32)
_ERF = np.vectorize(math.erf)


def _Sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


_REFERENCES = {
  'NONE': lambda x: x,
  'RELU': lambda x: np.maximum(x, 0.0),
  'RELU6': lambda x: np.clip(x, 0.0, 6.0),
  'SIGMOID': _Sigmoid,
  'TANH': np.tanh,
  'GELU': lambda x: 0.5 * x * (1.0 + _ERF(x / np.sqrt(2.0))),
  'SWISH': lambda x: x * _Sigmoid(x),
  'SILU': lambda x: x * _Sigmoid(x),
  'LEAKY_RELU': lambda x: np.where(x > 0, x, 0.2 * x),
  'SOFTPLUS': lambda x: np.log1p(np.exp(x)),
  'ELU': lambda x: np.where(x > 0, x, np.expm1(x)),
}


@pytest.mark.parametrize('name', sorted(_REFERENCES))
def testActivationMatchesNumpy(name):
  got = activations.GetFn(name)(tf.constant(_X)).numpy()
  np.testing.assert_allclose(got, _REFERENCES[name](_X), rtol=1e-5, atol=1e-5)


def testUnknownActivationNamesChoices():
  with pytest.raises(ValueError, match='RELU'):
    activations.GetFn('relu')
  assert not activations.IsSupported('FOO')


def testActivationLayer():
  p = activations.ActivationLayer.Params().Set(name='act', activation='TANH')
  layer = p.Instantiate()
  x = tf.constant(_X.reshape([1, 17]))
  np.testing.assert_allclose(
    layer.FProp(layer.theta, x).numpy(), np.tanh(x.numpy()), rtol=1e-6
  )
  m = p.cls.FPropMeta(p, [1, 17])
  assert m.out_shapes == (tf.TensorShape([1, 17]),)
  assert m.flops == 4 * 17


def testActivationLayerBadNameNamesLayer():
  p = activations.ActivationLayer.Params().Set(name='act', activation='FOO')
  with pytest.raises(ValueError, match="ActivationLayer 'act'.*FOO"):
    p.Instantiate()
