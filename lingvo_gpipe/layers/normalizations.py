"""Normalization layers: `BatchNormLayer` and `LayerNorm` (Lingvo names).

Batch norm in a pipeline: each micro-batch is normalized with its own
statistics, and the moving averages are updated once per mini-batch from the
statistics of all micro-batches. `FProp` does not assign the moving averages
itself; it hands its statistics to `py_utils.AddDeferredUpdate`, and the
enclosing `py_utils.UpdateCollector` later calls `ApplyDeferredUpdates` with
the list of every micro-batch's statistics, which are merged exactly into the
moments of their union before one moving-average update:

  with py_utils.UpdateCollector() as updates:
    for x in tf.split(batch, 4):
      bn.FProp(bn.theta, x)
  updates.Apply()   # == one update with the moments of the whole batch

Outside any collector the update is applied at once (plain training).
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import _shapes

__all__ = ['BatchNormLayer', 'LayerNorm', 'MergeMoments']


def MergeMoments(stats_list):
  """Merges per-chunk moments into the moments of the union of the chunks.

  Args:
    stats_list: list of NestedMap(mean=[d], variance=[d], count=scalar or
      [d]), the (biased) moments of each chunk and its number of elements.

  Returns:
    (mean [d], variance [d], count): N = sum n_i, mean = sum(n_i mean_i) / N,
    variance = sum(n_i (var_i + mean_i^2)) / N - mean^2. Where N = 0 the
    mean and variance are 0.
  """
  if not stats_list:
    raise ValueError('MergeMoments needs at least one NestedMap of stats.')
  dtype = stats_list[0].mean.dtype
  if len(stats_list) == 1:
    (s,) = stats_list
    total = tf.cast(tf.convert_to_tensor(s.count), dtype)
    sum_x = total * s.mean
    sum_xx = total * (s.variance + tf.square(s.mean))
  else:
    # The chunks stacked, so that merging M micro-batches' statistics is a
    # few ops whatever M is (the pipeline's step graph must not grow with
    # M); the sums run over the chunks in order, as an add_n would.
    counts = py_utils.Stack(
      [tf.cast(tf.convert_to_tensor(s.count), dtype) for s in stats_list]
    )
    means = py_utils.Stack([s.mean for s in stats_list])
    variances = py_utils.Stack([s.variance for s in stats_list])
    n = counts
    if counts.shape.rank == 1:  # One count per chunk: broadcast it.
      n = tf.reshape(counts, [-1] + [1] * (means.shape.rank - 1))
    total = tf.reduce_sum(counts, 0)
    sum_x = tf.reduce_sum(n * means, 0)
    sum_xx = tf.reduce_sum(n * (variances + tf.square(means)), 0)
  # Under a tf.distribute strategy: the moments of every replica's batch.
  sum_x, sum_xx, total = py_utils.CrossReplicaReduce(
    [sum_x, sum_xx, total], tf.distribute.ReduceOp.SUM
  )
  mean = tf.math.divide_no_nan(sum_x, total)
  variance = tf.maximum(
    tf.math.divide_no_nan(sum_xx, total) - tf.square(mean), 0.0
  )
  return mean, variance, total


class BatchNormLayer(base_layer.BaseLayer):
  """Batch normalization over all axes but the last: [..., dim] -> [..., dim].

  Variables: `beta` [dim] and `gamma` [dim] (trainable; gamma is stored as the
  scale itself, initialized to 1), `moving_mean` [dim] and `moving_variance`
  [dim] (non-trainable). All four are read from `theta` in FProp.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Depth of the input/output (the last dim).')
    p.Define(
      'decay',
      0.999,
      'Decay of the moving averages: moving = decay * moving + '
      '(1 - decay) * batch statistic.',
    )
    p.Define('epsilon', 0.001, 'Added to the variance before rsqrt.')
    p.Define(
      'use_moving_avg_in_training',
      False,
      'If True, normalize with the moving averages in training too '
      '(they are still updated); the layer then has no beta/gamma, as '
      'in Lingvo.',
    )
    p.Define(
      'set_padded_output_to_zero',
      True,
      'If True, outputs at padded positions (paddings = 1) are 0.',
    )
    return p

  @classmethod
  def _Validate(cls, p):
    _shapes.CheckPositive(p, 'dim')
    if not 0.0 <= p.decay <= 1.0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: p.decay = {p.decay!r} must '
        'be in [0, 1], e.g. 0.999.'
      )
    if p.epsilon <= 0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: p.epsilon = {p.epsilon!r} '
        'must be > 0, e.g. 0.001.'
      )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    zeros = py_utils.WeightInit.Constant(0.0)
    ones = py_utils.WeightInit.Constant(1.0)
    if not p.use_moving_avg_in_training:
      self.CreateVariable('beta', py_utils.WeightParams([p.dim], zeros))
      self.CreateVariable('gamma', py_utils.WeightParams([p.dim], ones))
    self.CreateVariable(
      'moving_mean', py_utils.WeightParams([p.dim], zeros), trainable=False
    )
    self.CreateVariable(
      'moving_variance', py_utils.WeightParams([p.dim], ones), trainable=False
    )

  def _CheckInputs(self, inputs, paddings):
    p = self.params
    dims = _shapes.CheckShape(
      self,
      'inputs',
      inputs.shape,
      [..., p.dim],
      f'The last dim of the inputs must equal p.dim = {p.dim}.',
    )
    if paddings is None or dims is None:
      return
    pdims = paddings.shape.as_list()
    ok = len(pdims) <= len(dims) and all(
      a is None or b is None or a == b or b == 1
      for a, b in zip(dims[: len(pdims)], pdims)
    )
    if len(pdims) == len(dims):
      ok = ok and pdims[-1] in (1, None)
    if not ok:
      raise ValueError(
        f'{_shapes.LayerName(self)}: paddings have shape {pdims} but the '
        f'inputs have shape {dims}; paddings must match the leading dims '
        'of the inputs (e.g. [batch, time] or [batch, time, 1] for inputs '
        '[batch, time, dim]).'
      )

  @staticmethod
  def _ExpandPaddings(paddings, rank):
    while paddings.shape.rank < rank:
      paddings = tf.expand_dims(paddings, -1)
    return paddings

  def ComputeMoments(self, inputs, paddings=None):
    """Batch moments over all axes but the last.

    Args:
      inputs: [..., dim].
      paddings: optional, 1.0 at padded positions, shaped like the leading
        dims of `inputs` (e.g. [batch, time] or [batch, time, 1]).

    Returns:
      (mean [dim], variance [dim], count scalar): the biased moments over the
      non-padded elements and their number, as floats (float32 for 16-bit
      inputs).
    """
    axes = list(range(inputs.shape.rank - 1))
    if inputs.dtype.size < 4:  # bfloat16/float16: moments in float32.
      inputs = tf.cast(inputs, tf.float32)
    if paddings is None:
      mean, variance = tf.nn.moments(inputs, axes)
      count = tf.cast(tf.size(inputs) // tf.shape(inputs)[-1], inputs.dtype)
      return mean, variance, count
    mask = 1.0 - self._ExpandPaddings(
      tf.cast(paddings, inputs.dtype), inputs.shape.rank
    )
    mask = tf.broadcast_to(
      mask, tf.concat([tf.shape(inputs)[:-1], [1]], axis=0)
    )
    count = tf.reduce_sum(mask)
    mean = tf.math.divide_no_nan(tf.reduce_sum(inputs * mask, axes), count)
    variance = tf.math.divide_no_nan(
      tf.reduce_sum(tf.square(inputs - mean) * mask, axes), count
    )
    return mean, variance, count

  def FProp(self, theta, inputs, paddings=None):
    """Normalizes `inputs`.

    In training (not `self.do_eval`) the batch statistics of `inputs` are used
    and handed to `py_utils.AddDeferredUpdate`; in eval the moving averages.

    Args:
      theta: NestedMap with beta, gamma, moving_mean, moving_variance.
      inputs: [..., dim], e.g. [batch, time, dim] or [batch, h, w, dim].
      paddings: optional paddings (1.0 = padded) shaped like the leading dims
        of `inputs`; padded positions are left out of the statistics.

    Returns:
      The normalized inputs, [..., dim].
    """
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    self._CheckInputs(inputs, paddings)
    if self.do_eval or p.use_moving_avg_in_training:
      mean = tf.cast(theta.moving_mean, inputs.dtype)
      variance = tf.cast(theta.moving_variance, inputs.dtype)
    if not self.do_eval:
      b_mean, b_var, count = self.ComputeMoments(inputs, paddings)
      py_utils.AddDeferredUpdate(
        self,
        NestedMap(
          mean=tf.stop_gradient(b_mean),
          variance=tf.stop_gradient(b_var),
          count=tf.stop_gradient(count),
        ),
      )
      if not p.use_moving_avg_in_training:
        mean = tf.cast(b_mean, inputs.dtype)
        variance = tf.cast(b_var, inputs.dtype)
    if p.use_moving_avg_in_training:
      beta, gamma = None, None
    else:
      beta, gamma = theta.beta, theta.gamma
    out = tf.nn.batch_normalization(
      inputs, mean, variance, beta, gamma, p.epsilon
    )
    if paddings is not None and p.set_padded_output_to_zero:
      mask = 1.0 - self._ExpandPaddings(
        tf.cast(paddings, out.dtype), inputs.shape.rank
      )
      out *= mask
    return out

  def ApplyDeferredUpdates(self, stats_list):
    """Merges the statistics of `stats_list` and updates the moving averages.

    Args:
      stats_list: list of NestedMap(mean, variance, count) added by FProp,
        e.g. one per micro-batch.

    Returns:
      The grouped assign op (None for an abstractly built layer).
    """
    p = self.params
    moving_mean = self.vars.moving_mean
    moving_var = self.vars.moving_variance
    if isinstance(moving_mean, base_layer.AbstractVariable):
      return None
    with py_utils.OnDeviceOf(moving_mean):
      dtype = moving_mean.dtype.base_dtype
      stats_list = [
        s.Transform(lambda t: tf.cast(t, dtype)) for s in stats_list
      ]
      mean, variance, count = MergeMoments(stats_list)
      decay = tf.constant(p.decay, dtype)
      has_data = count > 0

      def Updated(var, value):
        new = decay * var + (1.0 - decay) * value
        return tf.where(has_data, new, tf.convert_to_tensor(var))

      return tf.group(
        moving_mean.assign(Updated(moving_mean, mean)),
        moving_var.assign(Updated(moving_var, variance)),
      )

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    del paddings  # Does not change the cost much.
    cls._Validate(p)
    _shapes.CheckShape(
      p,
      'inputs',
      inputs,
      [..., p.dim],
      f'The last dim of the inputs must equal p.dim = {p.dim}.',
    )
    n = _shapes.NumElements(_shapes.Dims(inputs))
    # Moments (~4 per element) and normalization (~4 per element).
    return meta.Meta(8 * n, _shapes.ToShape(inputs))


class LayerNorm(base_layer.BaseLayer):
  """Layer normalization over the last dim: [..., input_dim] -> same.

  out = (x - mean) / sqrt(var + epsilon) * scale + bias, with variables
  `scale` [input_dim] (initialized to 1) and `bias` [input_dim] (0). With
  `direct_scale=False` (Lingvo's default) `scale` starts at 0 and the
  output is multiplied by 1 + scale, so Lingvo's weights load unchanged.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (the last dim).')
    p.Define('epsilon', 1e-6, 'Added to the variance before rsqrt.')
    p.Define(
      'direct_scale',
      True,
      'True: multiply by `scale` (initialized to 1); False: by 1 + `scale` '
      "(initialized to 0), Lingvo's LayerNorm default.",
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'input_dim')
    self.CreateVariable(
      'scale',
      py_utils.WeightParams(
        [p.input_dim],
        py_utils.WeightInit.Constant(1.0 if p.direct_scale else 0.0),
      ),
    )
    self.CreateVariable(
      'bias',
      py_utils.WeightParams([p.input_dim], py_utils.WeightInit.Constant(0.0)),
    )

  def FProp(self, theta, inputs, paddings=None):
    """Normalizes over the last dim.

    Args:
      theta: NestedMap(scale, bias).
      inputs: [..., input_dim].
      paddings: ignored (Lingvo signature compatibility).

    Returns:
      [..., input_dim].
    """
    del paddings
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    _shapes.CheckShape(
      self,
      'inputs',
      inputs.shape,
      [..., p.input_dim],
      f'The last dim of the inputs must equal p.input_dim = {p.input_dim}.',
    )
    mean, variance = tf.nn.moments(inputs, [-1], keepdims=True)
    normed = (inputs - mean) * tf.math.rsqrt(variance + p.epsilon)
    scale = theta.scale if p.direct_scale else 1.0 + theta.scale
    return normed * scale + theta.bias

  @classmethod
  def FPropMeta(cls, p, inputs, paddings=None):
    del paddings
    _shapes.CheckPositive(p, 'input_dim')
    _shapes.CheckShape(
      p,
      'inputs',
      inputs,
      [..., p.input_dim],
      f'The last dim of the inputs must equal p.input_dim = {p.input_dim}.',
    )
    n = _shapes.NumElements(_shapes.Dims(inputs))
    return meta.Meta(8 * n, _shapes.ToShape(inputs))
