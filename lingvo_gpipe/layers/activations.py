"""Activation functions by their Lingvo names, and `ActivationLayer`.

Example:

  fn = activations.GetFn('GELU')
  p = activations.ActivationLayer.Params().Set(name='act', activation='TANH')
"""

import functools

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.layers import _shapes

__all__ = [
  'ACTIVATIONS',
  'GetFn',
  'IsSupported',
  'FlopsPerElement',
  'CheckActivation',
  'ActivationLayer',
]

ACTIVATIONS = {
  'NONE': tf.identity,
  'RELU': tf.nn.relu,
  'RELU6': tf.nn.relu6,
  'SIGMOID': tf.sigmoid,
  'TANH': tf.tanh,
  'GELU': functools.partial(tf.nn.gelu, approximate=False),
  'GELU_APPROXIMATE': functools.partial(tf.nn.gelu, approximate=True),
  'SWISH': tf.nn.silu,
  'SILU': tf.nn.silu,
  'LEAKY_RELU': functools.partial(tf.nn.leaky_relu, alpha=0.2),
  'SOFTPLUS': tf.nn.softplus,
  'ELU': tf.nn.elu,
  'SELU': tf.nn.selu,
  'SQUARED_RELU': lambda x: tf.square(tf.nn.relu(x)),
}

# Rough flops per element, for FPropMeta (a transcendental counts 4).
_FLOPS = {
  'NONE': 0,
  'RELU': 1,
  'RELU6': 2,
  'SIGMOID': 4,
  'TANH': 4,
  'GELU': 8,
  'GELU_APPROXIMATE': 8,
  'SWISH': 5,
  'SILU': 5,
  'LEAKY_RELU': 2,
  'SOFTPLUS': 5,
  'ELU': 5,
  'SELU': 6,
  'SQUARED_RELU': 2,
}


def IsSupported(name):
  """True if `name` is a known activation name."""
  return isinstance(name, str) and name in ACTIVATIONS


def GetFn(name):
  """The activation function called `name` (e.g. 'RELU')."""
  if not IsSupported(name):
    raise ValueError(
      f'Unknown activation {name!r}; use one of {sorted(ACTIVATIONS)}.'
    )
  return ACTIVATIONS[name]


def FlopsPerElement(name):
  """Approximate flops per element of activation `name`."""
  GetFn(name)
  return _FLOPS[name]


def CheckActivation(p, field='activation'):
  """Raises ValueError naming the layer if `p.<field>` is not supported."""
  name = p.Get(field)
  if not IsSupported(name):
    raise ValueError(
      f'{_shapes.LayerName(p)}: p.{field} = {name!r} is not a '
      f'known activation; use one of {sorted(ACTIVATIONS)}.'
    )


class ActivationLayer(base_layer.BaseLayer):
  """Applies an activation function elementwise: [...] -> [...]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'activation', 'RELU', f'Activation name, one of {sorted(ACTIVATIONS)}.'
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    CheckActivation(self.params)

  def FProp(self, theta, inputs):
    """Returns activation(inputs), same shape and dtype as `inputs`."""
    del theta  # No weights.
    return GetFn(self.params.activation)(inputs)

  @classmethod
  def FPropMeta(cls, p, inputs):
    CheckActivation(p)
    dims = _shapes.Dims(inputs)
    flops = FlopsPerElement(p.activation) * _shapes.NumElements(dims)
    return meta.Meta(flops, _shapes.ToShape(inputs))
