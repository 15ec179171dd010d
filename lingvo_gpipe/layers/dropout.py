"""`DropoutLayer` with stateless, addressable randomness.

The mask is `tf.random.stateless_uniform(shape, seed)` with seed
`py_utils.GenerateStepSeedPair(layer_seed)`: the layer seed is a hash of the
layer's path and `random_seed`, the step seed comes from the enclosing
`py_utils.StepSeed(s)`. So the same layer under the same step seed always
draws the same mask (a pipeline that recomputes the forward pass in the
backward pass relies on this), different step seeds (steps, micro-batches)
draw different masks, and two layers never share a mask.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes

__all__ = ['DropoutLayer', 'StatelessDropout', 'DeterministicDropoutLayer']


def StatelessDropout(inputs, keep_prob, seed_pair, noise_shape=None):
  """Dropout with a stateless mask.

  Args:
    inputs: any float tensor.
    keep_prob: Python float in (0, 1]: probability of keeping an element.
    seed_pair: int64 [2] stateless seed.
    noise_shape: shape of the mask, broadcastable to `inputs`; None: the
      inputs' shape.

  Returns:
    inputs * mask / keep_prob, mask ~ Bernoulli(keep_prob).
  """
  if keep_prob >= 1.0:
    return inputs
  if noise_shape is None:
    noise_shape = tf.shape(inputs)
  # Philox explicitly: the default algorithm differs under XLA, which would
  # give a compiled step other masks than an uncompiled one.
  u = tf.random.stateless_uniform(
    noise_shape, seed=seed_pair, dtype=tf.float32, alg='philox'
  )
  keep = tf.cast(u < keep_prob, inputs.dtype)
  return inputs * keep * tf.cast(1.0 / keep_prob, inputs.dtype)


class DropoutLayer(base_layer.BaseLayer):
  """Dropout: [...] -> [...], identity in eval mode or when keep_prob == 1."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('keep_prob', 1.0, 'Probability of keeping an element.')
    p.Define(
      'noise_shape',
      None,
      'Shape of the mask (a list, broadcastable to the inputs); None: '
      "the inputs' shape.",
    )
    p.Define(
      'noise_shape_broadcast_dims',
      None,
      'Dims (ints) where the mask has size 1 and is broadcast, e.g. '
      '[1] to drop the same channels at every time step of '
      '[batch, time, dim]. Ignored if noise_shape is set.',
    )
    p.Define('dropout_at_eval', False, 'Whether to apply dropout in eval too.')
    return p

  @classmethod
  def _Validate(cls, p):
    if not 0.0 < p.keep_prob <= 1.0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: p.keep_prob = '
        f'{p.keep_prob!r} must be in (0, 1] (1 = no dropout).'
      )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self._layer_seed = py_utils.StableHash(
      p.random_seed or 0, self.path, 'dropout'
    )

  @property
  def layer_seed(self):
    """The Python-int part of this layer's stateless seed."""
    return self._layer_seed

  def _NoiseShape(self, inputs):
    p = self.params
    if p.noise_shape is not None:
      return list(p.noise_shape)
    if not p.noise_shape_broadcast_dims:
      return tf.shape(inputs)
    rank = inputs.shape.rank
    dims = py_utils.GetShape(inputs)
    for d in p.noise_shape_broadcast_dims:
      if not -rank <= d < rank:
        raise ValueError(
          f'{_shapes.LayerName(self)}: noise_shape_broadcast_dims '
          f'{p.noise_shape_broadcast_dims} has dim {d} but the inputs have '
          f'shape {inputs.shape.as_list()} (rank {rank}); use dims in '
          f'[{-rank}, {rank}).'
        )
      dims[d] = 1
    return tf.stack([tf.cast(d, tf.int32) for d in dims])

  def FProp(self, theta, inputs):
    """Applies dropout to `inputs` (any shape), scaling kept ones by 1/keep."""
    del theta  # No weights.
    p = self.params
    if p.keep_prob >= 1.0 or (self.do_eval and not p.dropout_at_eval):
      return inputs
    seed = py_utils.GenerateStepSeedPair(self._layer_seed)
    return StatelessDropout(inputs, p.keep_prob, seed, self._NoiseShape(inputs))

  @classmethod
  def FPropMeta(cls, p, inputs):
    cls._Validate(p)
    n = _shapes.NumElements(_shapes.Dims(inputs))
    flops = 0 if p.keep_prob >= 1.0 else 3 * n
    return meta.Meta(flops, _shapes.ToShape(inputs))


class DeterministicDropoutLayer(DropoutLayer):
  """Lingvo's name for a dropout whose mask is a function of the step and
  the layer: every `DropoutLayer` here is one (stateless seeds), so a
  re-materialized cell draws the forward pass's mask."""
