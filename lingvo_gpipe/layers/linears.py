"""Linear layers: `ProjectionLayer`, `FCLayer`, `BiasLayer` and `GluLayer`
(Lingvo names).

A projection maps [..., input_dim] to [..., output_dim] (any rank):

  out = activation(batch_norm(inputs @ w + b))

Variables: `w` [input_dim, output_dim], `b` [output_dim] (if has_bias) and,
if batch_norm, a `BatchNormLayer` child `bn`. `GluLayer` gates one
projection by another: x + dropout(value(LN(x)) * sigmoid(gate(LN(x)))).
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import activations
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import normalizations

__all__ = [
  'ProjectionLayer',
  'FCLayer',
  'BiasLayer',
  'GluLayer',
  'ProjectLastDim',
]


def ProjectLastDim(inputs, w):
  """[..., input_dim] @ w [input_dim, output_dim] -> [..., output_dim]."""
  if inputs.shape.rank == 2:
    return tf.matmul(inputs, w)
  out_dim = w.shape[-1]
  if inputs.shape.rank is None:
    flat = tf.reshape(inputs, [-1, tf.shape(inputs)[-1]])
    out = tf.matmul(flat, w)
    return tf.reshape(out, tf.concat([tf.shape(inputs)[:-1], [out_dim]], 0))
  shape = py_utils.GetShape(inputs)
  out = tf.matmul(tf.reshape(inputs, [-1, shape[-1]]), w)
  return tf.reshape(out, shape[:-1] + [out_dim])


def _ApplyPaddings(out, paddings):
  """Zeroes `out` [..., d] where `paddings` [..., 1] (or [...]) is 1."""
  paddings = tf.cast(paddings, out.dtype)
  if paddings.shape.rank == out.shape.rank - 1:
    paddings = tf.expand_dims(paddings, -1)
  return out * (1.0 - paddings)


class ProjectionLayer(base_layer.BaseLayer):
  """Projection with optional bias, batch norm and activation.

  [..., input_dim] -> [..., output_dim].
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input.')
    p.Define('output_dim', 0, 'Depth of the output.')
    p.Define(
      'activation',
      'RELU',
      'Activation applied last, by Lingvo name (RELU, TANH, NONE, ...).',
    )
    p.Define('has_bias', True, 'Whether to add a bias `b` [output_dim].')
    p.Define(
      'batch_norm',
      False,
      'Whether to batch-normalize the projection before the '
      'activation (a BatchNormLayer child `bn`).',
    )
    p.Define('bias_init', 0.0, 'Initial value of the bias.')
    p.Define(
      'bn_params',
      normalizations.BatchNormLayer.Params(),
      'Params of the batch norm child; dim is set to output_dim.',
    )
    return p

  @classmethod
  def _Validate(cls, p):
    _shapes.CheckPositive(p, 'input_dim', 'output_dim')
    activations.CheckActivation(p)

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self.CreateVariable('w', py_utils.WeightParams([p.input_dim, p.output_dim]))
    if p.has_bias:
      self.CreateVariable(
        'b',
        py_utils.WeightParams(
          [p.output_dim], py_utils.WeightInit.Constant(p.bias_init)
        ),
      )
    if p.batch_norm:
      self.CreateChild('bn', p.bn_params.Copy().Set(dim=p.output_dim))

  def FProp(self, theta, inputs, paddings=None):
    """Projects the last dim of `inputs`.

    Args:
      theta: NestedMap(w, b?, bn?).
      inputs: [..., input_dim].
      paddings: optional [..., 1] or [...] (1.0 = padded); padded positions
        of the output are zeroed and left out of the batch-norm statistics.

    Returns:
      [..., output_dim].
    """
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    _shapes.CheckShape(
      self,
      'inputs',
      inputs.shape,
      [..., p.input_dim],
      f'The last dim of the inputs must equal p.input_dim = {p.input_dim}; '
      "fix p.input_dim or the previous layer's output dim.",
    )
    out = ProjectLastDim(inputs, theta.w)
    if p.has_bias:
      out += theta.b
    if p.batch_norm:
      out = self.bn.FProp(theta.bn, out, paddings)
    out = activations.GetFn(p.activation)(out)
    if paddings is not None:
      out = _ApplyPaddings(out, paddings)
    return out

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    del paddings
    cls._Validate(p)
    dims = _shapes.CheckShape(
      p,
      'inputs',
      inputs,
      [..., p.input_dim],
      f'The last dim of the inputs must equal p.input_dim = {p.input_dim}.',
    )
    rows = _shapes.NumElements(dims[:-1])
    n_out = rows * p.output_dim
    flops = 2 * rows * p.input_dim * p.output_dim
    if p.has_bias:
      flops += n_out
    if p.batch_norm:
      flops += 8 * n_out
    flops += activations.FlopsPerElement(p.activation) * n_out
    return meta.Meta(flops, tf.TensorShape(dims[:-1] + [p.output_dim]))


class FCLayer(ProjectionLayer):
  """Fully-connected layer: matmul + bias + activation (no batch norm)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.batch_norm = False
    p.has_bias = True
    return p


class BiasLayer(base_layer.BaseLayer):
  """Adds a bias `b` [dims] to [..., dims]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dims', 0, 'Depth of the input (the last dim).')
    p.Define('bias_init', 0.0, 'Initial value of the bias.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'dims')
    self.CreateVariable(
      'b',
      py_utils.WeightParams(
        [p.dims], py_utils.WeightInit.Constant(p.bias_init)
      ),
    )

  def FProp(self, theta, inputs):
    """[..., dims] -> inputs + b, [..., dims]."""
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    _shapes.CheckShape(
      self,
      'inputs',
      inputs.shape,
      [..., p.dims],
      f'The last dim of the inputs must equal p.dims = {p.dims}.',
    )
    return inputs + theta.b

  @classmethod
  def FPropMeta(cls, p, inputs):
    _shapes.CheckPositive(p, 'dims')
    dims = _shapes.CheckShape(
      p,
      'inputs',
      inputs,
      [..., p.dims],
      f'The last dim of the inputs must equal p.dims = {p.dims}.',
    )
    return meta.Meta(_shapes.NumElements(dims), tf.TensorShape(dims))


class GluLayer(base_layer.BaseLayer):
  """Gated linear unit (Dauphin et al. 2017), Lingvo's `layers.GluLayer`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input.')
    p.Define('output_dim', 0, 'Depth of the output; 0: input_dim.')
    p.Define(
      'ln_tpl',
      normalizations.LayerNorm.Params().Set(direct_scale=False),
      'Layer norm Params; None: none.',
    )
    p.Define('dense_tpl', FCLayer.Params(), 'Params of both denses.')
    p.Define('activation', 'NONE', 'Activation of the value branch.')
    p.Define('gate_activation', 'SIGMOID', 'Activation of the gate.')
    p.Define('dropout_tpl', dropout.DropoutLayer.Params(), 'Output dropout.')
    p.Define('apply_residual', True, 'Add the inputs to the outputs.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim')
    out = p.output_dim or p.input_dim
    if p.apply_residual and out != p.input_dim:
      raise ValueError(
        f'{_shapes.LayerName(p)}: apply_residual needs output_dim '
        f'({p.output_dim}) = input_dim ({p.input_dim}); set output_dim to 0 '
        'or apply_residual to False.'
      )
    for name, act in (
      ('value_layer', p.activation),
      ('gate_layer', p.gate_activation),
    ):
      self.CreateChild(
        name,
        p.dense_tpl.Copy().Set(
          name=name, input_dim=p.input_dim, output_dim=out, activation=act
        ),
      )
    if p.ln_tpl:
      self.CreateChild(
        'layer_norm',
        p.ln_tpl.Copy().Set(name='layer_norm', input_dim=p.input_dim),
      )
    self.CreateChild('dropout', p.dropout_tpl.Copy())

  def FProp(self, theta, inputs, paddings):
    """inputs [..., d]; paddings [...] or [..., 1] (1.0 = padded)."""
    x = inputs
    if self.params.ln_tpl:
      x = self.layer_norm.FProp(theta.layer_norm, x)
    if paddings.shape.rank != x.shape.rank:
      paddings = tf.expand_dims(paddings, -1)
    values = self.value_layer.FProp(theta.value_layer, x, paddings)
    gates = self.gate_layer.FProp(theta.gate_layer, x, paddings)
    out = self.dropout.FProp(theta.dropout, values * gates)
    return inputs + out if self.params.apply_residual else out

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    dims = _shapes.Dims(inputs)
    n = _shapes.NumElements(dims[:-1])
    out = p.output_dim or p.input_dim
    flops = 4 * n * p.input_dim * out + 8 * n * p.input_dim
    return meta.Meta(flops, tf.TensorShape(dims[:-1] + [out]))
