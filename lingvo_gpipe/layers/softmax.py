"""`SimpleFullSoftmax` and a label-smoothed softmax cross-entropy.

Weight layout: `weight_<i>` is [input_dim, num_classes / num_shards] by
default (Lingvo's), or [num_classes / num_shards, input_dim] with
`use_num_classes_major_weight=True`. The class-major layout is the layout of
an embedding table [vocab_size, embedding_dim], so a softmax with
`shared_weight_name` set must use it (and num_shards = 1): it then shares its
weight with a `SimpleEmbeddingLayer` of the same `shared_weight_name`.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import linears

__all__ = [
  'SimpleFullSoftmax',
  'SoftmaxCrossEntropyWithLabelSmoothing',
  'UniformLabelSmoother',
]


def SoftmaxCrossEntropyWithLabelSmoothing(
  logits, class_ids=None, class_probabilities=None, label_smoothing=0.0
):
  """Softmax cross-entropy against smoothed targets.

  The target is (1 - label_smoothing) * y + label_smoothing / num_classes,
  with y the one-hot of `class_ids` or `class_probabilities`.

  Args:
    logits: [..., num_classes].
    class_ids: int [...]; exactly one of class_ids and class_probabilities.
    class_probabilities: [..., num_classes].
    label_smoothing: Python float in [0, 1).

  Returns:
    The per-example cross-entropy, [...].
  """
  if (class_ids is None) == (class_probabilities is None):
    raise ValueError('Pass exactly one of class_ids and class_probabilities.')
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(
      f'label_smoothing = {label_smoothing!r} must be in [0, 1).'
    )
  if class_ids is not None and label_smoothing == 0.0:
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(class_ids, tf.int32), logits=logits
    )
  num_classes = logits.shape[-1]
  if class_ids is not None:
    target = tf.one_hot(
      tf.cast(class_ids, tf.int32), num_classes, dtype=logits.dtype
    )
  else:
    target = tf.cast(class_probabilities, logits.dtype)
  if label_smoothing:
    target = target * (1.0 - label_smoothing) + label_smoothing / num_classes
  return tf.nn.softmax_cross_entropy_with_logits(
    labels=tf.stop_gradient(target), logits=logits
  )


class SimpleFullSoftmax(base_layer.BaseLayer):
  """Full softmax: logits [..., num_classes] and the cross-entropy loss."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the input (the last dim).')
    p.Define('num_classes', 0, 'Number of classes.')
    p.Define(
      'num_shards',
      1,
      'Number of weight shards along the classes (must divide num_classes).',
    )
    p.Define('has_bias', True, 'Whether the logits have a bias.')
    p.Define(
      'logits_abs_max',
      None,
      'If set, logits are clipped to [-logits_abs_max, logits_abs_max].',
    )
    p.Define(
      'label_smoothing',
      0.0,
      'Default label smoothing of XentLoss (target = (1 - ls) * y + '
      'ls / num_classes).',
    )
    p.Define(
      'use_num_classes_major_weight',
      False,
      'True: weights are [num_classes, input_dim] (the embedding '
      'layout, required for tying); False: [input_dim, num_classes].',
    )
    p.Define(
      'shared_weight_name',
      None,
      'If set, the weight is shared (tied) with every layer under the '
      'same root creating a weight with this shared name, e.g. a '
      'SimpleEmbeddingLayer [vocab_size = num_classes, embedding_dim = '
      'input_dim]. Requires use_num_classes_major_weight and '
      'num_shards = 1.',
    )
    return p

  @classmethod
  def _Validate(cls, p):
    name = _shapes.LayerName(p)
    _shapes.CheckPositive(p, 'input_dim', 'num_classes', 'num_shards')
    if p.num_classes % p.num_shards:
      raise ValueError(
        f'{name}: num_shards = {p.num_shards} does not divide '
        f'num_classes = {p.num_classes}; pick a divisor.'
      )
    if p.shared_weight_name and not (
      p.use_num_classes_major_weight and p.num_shards == 1
    ):
      raise ValueError(
        f'{name}: shared_weight_name = {p.shared_weight_name!r} ties the '
        'weight with an embedding [vocab, dim], which needs the '
        '[num_classes, input_dim] layout: set use_num_classes_major_weight '
        f'= True and num_shards = 1 (got {p.use_num_classes_major_weight} '
        f'and {p.num_shards}).'
      )
    if not 0.0 <= p.label_smoothing < 1.0:
      raise ValueError(
        f'{name}: p.label_smoothing = {p.label_smoothing!r} must be in [0, 1).'
      )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    per_shard = p.num_classes // p.num_shards
    shape = (
      [per_shard, p.input_dim]
      if p.use_num_classes_major_weight
      else [p.input_dim, per_shard]
    )
    for i in range(p.num_shards):
      self.CreateVariable(
        f'weight_{i}',
        py_utils.WeightParams(shape, shared_name=p.shared_weight_name),
      )
      if p.has_bias:
        self.CreateVariable(
          f'bias_{i}',
          py_utils.WeightParams([per_shard], py_utils.WeightInit.Constant(0.0)),
        )

  def Logits(self, theta, inputs):
    """Logits [..., num_classes] of inputs [..., input_dim]."""
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    _shapes.CheckShape(
      self,
      'inputs',
      inputs.shape,
      [..., p.input_dim],
      f'The last dim of the inputs must equal p.input_dim = {p.input_dim}.',
    )
    ws = [theta[f'weight_{i}'] for i in range(p.num_shards)]
    w = tf.concat(ws, axis=0 if p.use_num_classes_major_weight else 1)
    if p.use_num_classes_major_weight:
      w = tf.transpose(w)
    logits = linears.ProjectLastDim(inputs, w)
    if p.has_bias:
      logits += tf.concat(
        [theta[f'bias_{i}'] for i in range(p.num_shards)], axis=0
      )
    if p.logits_abs_max is not None:
      logits = tf.clip_by_value(logits, -p.logits_abs_max, p.logits_abs_max)
    return logits

  def _Labels(self, name, x, lead, trailing):
    """Checks `x` has shape lead + trailing (or lead + [1]); squeezes the 1."""
    x = tf.convert_to_tensor(x)
    dims = x.shape.as_list()
    if trailing == [] and len(dims) == len(lead) + 1 and dims[-1] == 1:
      x = tf.squeeze(x, -1)
    _shapes.CheckShape(
      self,
      name,
      x.shape,
      lead + trailing,
      f'{name} must be shaped like the inputs without their '
      'last dim' + (' plus num_classes.' if trailing else '.'),
    )
    return x

  def XentLoss(
    self,
    theta,
    inputs,
    class_weights=None,
    class_ids=None,
    class_probabilities=None,
    label_smoothing=None,
  ):
    """Cross-entropy of the softmax of `inputs` against the labels.

    Args:
      theta: NestedMap of the weights.
      inputs: [..., input_dim].
      class_weights: [...] (or [..., 1]) weight of each example; None: 1.
      class_ids: int [...] (or [..., 1]); exactly one of class_ids and
        class_probabilities.
      class_probabilities: [..., num_classes] target distributions.
      label_smoothing: overrides p.label_smoothing if not None.

    Returns:
      NestedMap(logits [..., C], log_probs [..., C], per_example_xent [...],
      per_example_argmax int32 [...], per_example_weight [...], total_xent,
      total_weight, avg_xent (scalars)).
    """
    logits = self.Logits(theta, inputs)
    return self.XentLossFromLogits(
      theta,
      logits,
      class_weights,
      class_ids,
      class_probabilities,
      label_smoothing,
    )

  def XentLossFromLogits(
    self,
    theta,
    logits,
    class_weights=None,
    class_ids=None,
    class_probabilities=None,
    label_smoothing=None,
  ):
    """Like `XentLoss`, from logits [..., num_classes].

    With 16-bit logits the loss statistics (log_probs, xent, totals) are
    computed in float32.
    """
    del theta
    p = self.params
    if (class_ids is None) == (class_probabilities is None):
      raise ValueError(
        f'{_shapes.LayerName(self)}: pass exactly one of '
        'class_ids and class_probabilities.'
      )
    ls = p.label_smoothing if label_smoothing is None else label_smoothing
    lead = logits.shape.as_list()[:-1]
    out_logits = logits
    if logits.dtype.size < 4:  # bfloat16/float16: the loss in float32.
      logits = tf.cast(logits, tf.float32)
    if class_ids is not None:
      class_ids = self._Labels('class_ids', class_ids, lead, [])
      if not class_ids.dtype.is_integer:
        raise TypeError(
          f'{_shapes.LayerName(self)}: class_ids have dtype '
          f'{class_ids.dtype.name}; they must be integers.'
        )
    else:
      class_probabilities = self._Labels(
        'class_probabilities', class_probabilities, lead, [p.num_classes]
      )
    if class_weights is None:
      class_weights = tf.ones(tf.shape(logits)[:-1], logits.dtype)
    else:
      class_weights = tf.cast(
        self._Labels('class_weights', class_weights, lead, []), logits.dtype
      )
    xent = SoftmaxCrossEntropyWithLabelSmoothing(
      logits, class_ids, class_probabilities, ls
    )
    total_xent = tf.reduce_sum(xent * class_weights)
    total_weight = tf.reduce_sum(class_weights)
    return NestedMap(
      logits=out_logits,
      log_probs=tf.nn.log_softmax(logits),
      per_example_xent=xent,
      per_example_argmax=tf.argmax(logits, axis=-1, output_type=tf.int32),
      per_example_weight=class_weights,
      total_xent=total_xent,
      total_weight=total_weight,
      avg_xent=tf.math.divide_no_nan(total_xent, total_weight),
    )

  def FProp(
    self,
    theta,
    inputs,
    class_weights=None,
    class_ids=None,
    class_probabilities=None,
  ):
    """Same as `XentLoss` (Lingvo's argument order)."""
    return self.XentLoss(
      theta, inputs, class_weights, class_ids, class_probabilities
    )

  @classmethod
  def FPropMeta(cls, p, inputs, *unused_labels):
    cls._Validate(p)
    dims = _shapes.CheckShape(
      p,
      'inputs',
      inputs,
      [..., p.input_dim],
      f'The last dim of the inputs must equal p.input_dim = {p.input_dim}.',
    )
    lead = dims[:-1]
    rows = _shapes.NumElements(lead)
    flops = 2 * rows * p.input_dim * p.num_classes + 6 * rows * p.num_classes
    logits = tf.TensorShape(lead + [p.num_classes])
    per_example = tf.TensorShape(lead)
    scalar = tf.TensorShape([])
    return meta.Meta(
      flops,
      NestedMap(
        logits=logits,
        log_probs=logits,
        per_example_xent=per_example,
        per_example_argmax=per_example,
        per_example_weight=per_example,
        total_xent=scalar,
        total_weight=scalar,
        avg_xent=scalar,
      ),
    )


class UniformLabelSmoother(base_layer.BaseLayer):
  """Lingvo's label smoother: the label gets 1 - uncertainty, each other
  class uncertainty / (num_classes - 1)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_classes', 0, 'Number of classes.')
    p.Define('uncertainty', 0.1, 'Probability mass taken from the label.')
    p.Define(
      'uncertainty_larger',
      0.1,
      "Lingvo's uncertainty for punctuation tokens; unused (no token ids).",
    )
    p.Define(
      'token_id_uncertainty_larger',
      None,
      "Lingvo's punctuation token ids; only None.",
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'num_classes')
    if not 0.0 <= p.uncertainty < 1.0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: uncertainty={p.uncertainty!r} must be in '
        '[0, 1).'
      )
    base_layer.RejectUnsupportedParams(
      p,
      {
        'token_id_uncertainty_larger': (
          None,
          'remove it: every label is smoothed by `uncertainty`.',
        )
      },
    )

  def FProp(self, theta, target_paddings, target_labels, target_ids=None):
    """Target distributions [..., num_classes] for labels [...] (paddings
    and ids unused, as in Lingvo's uniform smoother)."""
    del theta, target_paddings, target_ids
    p = self.params
    low = p.uncertainty / (p.num_classes - 1)
    return tf.one_hot(
      tf.cast(target_labels, tf.int32),
      p.num_classes,
      on_value=tf.constant(1.0 - p.uncertainty, self.fprop_dtype),
      off_value=tf.constant(low, self.fprop_dtype),
    )
