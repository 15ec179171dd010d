"""Small layers and checks shared by the pipeline tests.

`Stack` runs the same layer Params as a `PipeliningLayer` without a pipeline:
the reference a pipeline must match to float32 rounding.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.pipeline import pipelining_layer

DEVICES = [f'/device:CPU:{i}' for i in range(4)]
SCHEDULES = pipelining_layer.SCHEDULES


def Pipe(layers, num_stages=2, **params):
  """A `PipeliningLayer` named 'pipe' of `layers` in `num_stages` cells, on
  the first `num_stages` of DEVICES unless `devices` is given; `params` set
  the rest of its Params."""
  params.setdefault('devices', DEVICES[:num_stages])
  return (
    pipelining_layer.PipeliningLayer.Params()
    .Set(name='pipe', layers=layers, num_stages=num_stages, **params)
    .Instantiate()
  )


def Devices(schedule, num_cells):
  """The devices of a pipeline of `num_cells`: 'interleaved' puts two cells
  on each device (cell k on device k mod D)."""
  if schedule == 'interleaved':
    return DEVICES[: max(1, num_cells // 2)]
  return DEVICES[:num_cells]


class Dense(base_layer.BaseLayer):
  """tanh(x w + b): a small test layer with a FPropMeta."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 4, 'Input width.')
    p.Define('output_dim', 4, 'Output width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', py_utils.WeightParams([p.input_dim, p.output_dim]))
    self.CreateVariable(
      'b',
      py_utils.WeightParams([p.output_dim], py_utils.WeightInit.Gaussian(0.1)),
    )

  def FProp(self, theta, x):
    py_utils.HasShape(x, [-1, self.params.input_dim], self.path)
    return tf.tanh(tf.matmul(x, theta.w) + theta.b)

  @classmethod
  def FPropMeta(cls, p, x):
    x = tf.TensorShape(x)
    if x[-1] != p.input_dim:
      raise ValueError(
        f'{p.name}: input dim {x[-1]} != input_dim {p.input_dim}'
      )
    return NestedMap(
      flops=2 * x[0] * p.input_dim * p.output_dim,
      out_shapes=(tf.TensorShape([x[0], p.output_dim]),),
    )


class TwoState(base_layer.BaseLayer):
  """AmoebaNet-like cell: takes (prev, cur), returns (cur, new)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    d = self.params.dim
    self.CreateVariable('w', py_utils.WeightParams([2 * d, d]))

  def FProp(self, theta, state):
    both = tf.concat([state.prev, state.cur], axis=-1)
    new = tf.tanh(tf.matmul(both, theta.w)) + 0.5 * state.prev
    return NestedMap(prev=state.cur, cur=new)


class Stack(base_layer.BaseLayer):
  """The sequential reference: the same layers as children, no pipeline."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('layers', [], 'Layer params.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChildren('body', list(self.params.layers))

  def FProp(self, theta, *args):
    for layer, th in zip(self.body, theta.body):
      out = layer.FProp(th, *args)
      args = out if isinstance(out, tuple) else (out,)
    return args[0] if len(args) == 1 else args


def DenseLayers(n=8, dim=6):
  return [
    Dense.Params().Set(name=f'fc_{i}', input_dim=dim, output_dim=dim)
    for i in range(n)
  ]


def WeightedSum(out, weights):
  return tf.add_n(
    [
      tf.reduce_sum(o * w)
      for o, w in zip(tf.nest.flatten(out), tf.nest.flatten(weights))
    ]
  )


def UsesLoss(layer):
  """Whether `LossAndGrads` trains `layer` through FPropWithLoss."""
  return (
    isinstance(layer, pipelining_layer.PipeliningLayer)
    and layer.params.schedule != 'gpipe'
  )


def LossAndGrads(layer, inputs, weights, eager=False):
  """tf.function: loss = sum(out * weights); returns (out, loss, grads).

  A pipeline whose schedule is not 'gpipe' computes each micro-batch's share
  of the loss on its last cell (FPropWithLoss, weights split with the
  inputs).
  """
  variables = layer.trainable_variables

  def Step(inputs):
    with tf.GradientTape() as tape:
      tape.watch(tf.nest.flatten(inputs))
      if UsesLoss(layer):
        loss, out = layer.FPropWithLoss(
          layer.theta, *inputs, loss_fn=WeightedSum, loss_inputs=weights
        )
      else:
        out = layer(*inputs)
        loss = WeightedSum(out, weights)
    grads = tape.gradient(loss, (variables, inputs))
    return out, loss, grads

  if not eager:
    Step = tf.function(Step)
  out, loss, (var_grads, in_grads) = Step(inputs)
  named = {v.name: g for v, g in zip(variables, var_grads)}
  return out, loss, named, in_grads


def MaxRelDiff(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def AssertClose(actual, expected, tol=1e-5):
  for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
    assert MaxRelDiff(a, e) <= tol, (MaxRelDiff(a, e), a, e)


def Inputs(batch=8, dim=6, seed=0):
  rng = np.random.RandomState(seed)
  x = tf.constant(rng.randn(batch, dim).astype(np.float32))
  w = tf.constant(rng.randn(batch, dim).astype(np.float32))
  return x, w


def Reference():
  """(the Stack of DenseLayers(), x, w, LossAndGrads of it) on Inputs()."""
  x, w = Inputs()
  ref = Stack.Params().Set(name='pipe', layers=DenseLayers()).Instantiate()
  return ref, x, w, LossAndGrads(ref, (x,), w)


class RandomScale(base_layer.BaseLayer):
  """y = x * u, u ~ U(0.5, 1.5) drawn statelessly per call (like dropout)."""

  def FProp(self, theta, x):
    seed = py_utils.GenerateStepSeedPair(py_utils.StableHash(self.path))
    u = tf.random.stateless_uniform(tf.shape(x), seed, 0.5, 1.5)
    return x * u


class NormStats(base_layer.BaseLayer):
  """Minimal batch norm (no scale/offset) used to test deferred updates."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Width.')
    p.Define('decay', 0.9, 'Moving average decay.')
    return p

  def __init__(self, params):
    super().__init__(params)
    d = self.params.dim
    self.CreateVariable(
      'moving_mean',
      py_utils.WeightParams([d], py_utils.WeightInit.Constant(0.0)),
      trainable=False,
    )
    self.CreateVariable(
      'moving_variance',
      py_utils.WeightParams([d], py_utils.WeightInit.Constant(1.0)),
      trainable=False,
    )

  def FProp(self, theta, x):
    if self.do_eval:
      mean, var = theta.moving_mean, theta.moving_variance
    else:
      mean, var = tf.nn.moments(x, [0])
      py_utils.AddDeferredUpdate(
        self,
        NestedMap(
          mean=tf.stop_gradient(mean),
          variance=tf.stop_gradient(var),
          count=tf.cast(tf.shape(x)[0], tf.float32),
        ),
      )
    return (x - mean) * tf.math.rsqrt(var + 1e-3)

  def ApplyDeferredUpdates(self, stats_list):
    n = tf.add_n([s.count for s in stats_list])
    mean = tf.add_n([s.count * s.mean for s in stats_list]) / n
    sq = (
      tf.add_n([s.count * (s.variance + tf.square(s.mean)) for s in stats_list])
      / n
    )
    var = sq - tf.square(mean)
    d = self.params.decay
    self.vars.moving_mean.assign(d * self.vars.moving_mean + (1 - d) * mean)
    self.vars.moving_variance.assign(
      d * self.vars.moving_variance + (1 - d) * var
    )


def NormLayers(dim):
  """fc_0, bn (NormStats), fc_1: a batch-norm layer between two others."""
  return [
    Dense.Params().Set(name='fc_0', input_dim=dim, output_dim=dim),
    NormStats.Params().Set(name='bn', dim=dim),
    Dense.Params().Set(name='fc_1', input_dim=dim, output_dim=dim),
  ]
