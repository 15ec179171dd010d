"""ClassifierTask: a generic image/feature classifier (Lingvo's ModelV2 style).

  logits = softmax.Logits(network.FProp(batch[input_key]))

`network` is any layer whose output is [batch, dim] features, typically a
`PipeliningLayer` whose `layers` end with a flatten or global pooling layer;
`softmax` (a `SimpleFullSoftmax`, input_dim = dim) maps them to logits.

Metrics, each (value, weight) with weight = the sum of the example weights
(the batch size, or the real examples of a padded eval batch, whose `weight`
key is honored):
  loss      label-smoothed cross-entropy, mean over the batch
  log_pplx  plain cross-entropy (equals loss without label smoothing)
  accuracy, error       top-1
  acc5, error5          top-5 (when num_classes >= 5)
  num_preds             number of examples (weight 1; a count, summed
                        over the batches of an evaluation)
per_example: NestedMap(loss=[b], argmax=int32 [b]).
Weight decay comes from the learner (p.train.l2_regularizer_weight).

With a pipelined network whose schedule is '1f1b', training computes the
loss on the pipeline's last cell, one micro-batch at a time
(`PipeliningLayer.FPropWithLoss`): the softmax runs there with its weights
handed to the pipeline, so a micro-batch's backward pass can start before
the other micro-batches' forwards; the gradients are the same.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_model
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import softmax as softmax_lib

__all__ = ['ClassifierTask', 'Share', 'TopKAccuracy']


def Share(x, weights, total):
  """The weighted sum of per-example `x` over `total`, the weight of the
  whole batch: a mean over it, or one micro-batch's share of that mean."""
  return tf.math.divide_no_nan(tf.reduce_sum(x * weights), total)


def TopKAccuracy(k, logits, labels, weights):
  """Weighted fraction of examples whose label is in the top k logits."""
  correct = tf.cast(tf.math.in_top_k(labels, logits, k), weights.dtype)
  return tf.math.divide_no_nan(
    tf.reduce_sum(correct * weights), tf.reduce_sum(weights)
  )


class ClassifierTask(base_model.BaseTask):
  """Classifies batch[input_key] into num_classes. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'network',
      None,
      'Layer Params mapping the input to [batch, dim] features, e.g. '
      'a PipeliningLayer.',
    )
    p.Define(
      'softmax',
      softmax_lib.SimpleFullSoftmax.Params(),
      'SimpleFullSoftmax Params; input_dim = the feature dim; '
      'num_classes defaults to p.num_classes.',
    )
    p.Define('num_classes', 0, 'Number of classes.')
    p.Define(
      'label_smoothing',
      0.0,
      'Smooths the targets towards 1/num_classes in the loss.',
    )
    p.Define('input_key', 'image', 'Key of the network input in the batch.')
    p.Define('label_key', 'label', 'Key of the int labels [batch].')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.network is None:
      raise ValueError(
        f'ClassifierTask {self.path!r}: p.network is None; set '
        'it to the Params of a layer producing [batch, dim] '
        'features.'
      )
    sp = p.softmax.Copy()
    if not sp.num_classes:
      sp.num_classes = p.num_classes
    elif p.num_classes and sp.num_classes != p.num_classes:
      raise ValueError(
        f'ClassifierTask {self.path!r}: softmax.num_classes = '
        f'{sp.num_classes} but num_classes = {p.num_classes}; '
        'set one of them (or make them equal).'
      )
    if not sp.num_classes or not sp.input_dim:
      raise ValueError(
        f'ClassifierTask {self.path!r}: softmax.input_dim = {sp.input_dim} '
        f'and num_classes = {sp.num_classes}; set p.softmax.input_dim to '
        'the feature dim of the network and p.num_classes.'
      )
    if not 0.0 <= p.label_smoothing < 1.0:
      raise ValueError(
        f'ClassifierTask {self.path!r}: label_smoothing = '
        f'{p.label_smoothing!r} must be in [0, 1).'
      )
    self._num_classes = sp.num_classes
    self.CreateChild('network', p.network)
    self.CreateChild('softmax', sp)

  @property
  def num_classes(self):
    return self._num_classes

  def _Get(self, batch, key, what):
    if key not in batch:
      raise KeyError(
        f'ClassifierTask {self.path!r}: the input batch has no '
        f'{what} key {key!r}; its keys are {sorted(batch)}. Set '
        f'p.{what}_key.'
      )
    return batch[key]

  def _LossOnLastCell(self):
    """Whether training computes the loss on the network's last cell (a
    pipeline with schedule '1f1b'): the softmax then runs there, per
    micro-batch, with its weights handed to the pipeline."""
    net = self.network
    return (
      not self.do_eval
      and hasattr(net, 'FPropWithLoss')
      and net.params.schedule == '1f1b'
    )

  def _NetworkOutput(self, out):
    """(features [b, dim], NestedMap of the network's other outputs)."""
    if isinstance(out, tuple) and len(out) == 1:
      out = out[0]
    if not isinstance(out, tf.Tensor) or out.shape.rank != 2:
      shape = getattr(out, 'shape', type(out).__name__)
      raise ValueError(
        f'ClassifierTask {self.path!r}: the network returned {shape}; '
        'it must return features [batch, dim]. End it with a FlattenLayer '
        'or a GlobalPoolingLayer.'
      )
    return out, NestedMap()

  def _Xent(self, logits, labels):
    return softmax_lib.SoftmaxCrossEntropyWithLabelSmoothing(
      tf.cast(logits, tf.float32),
      class_ids=labels,
      label_smoothing=self.params.label_smoothing,
    )

  def _LossTerms(self, xent, others, labels, weights, total):
    """[(metric name, share, weight)]: the terms of these examples' training
    loss, which is their weighted sum. Each is a share of a batch whose
    weights sum to `total`, so the shares of its micro-batches add up.
    `xent`: the examples' label-smoothed cross-entropy; `others`: the
    network's other outputs (subclasses add terms for them)."""
    del others, labels
    return [('main_loss', Share(xent, weights, total), 1.0)]

  @staticmethod
  def _SumTerms(terms):
    loss = None
    for _, share, weight in terms:
      part = share if weight == 1.0 else weight * share
      loss = part if loss is None else loss + part
    return loss

  def _LabelsAndWeights(self, input_batch):
    """(int32 labels [b], float32 weights [b]) of a batch."""
    p = self.params
    labels = tf.cast(self._Get(input_batch, p.label_key, 'label'), tf.int32)
    if labels.shape.rank == 2 and labels.shape[-1] == 1:
      labels = tf.squeeze(labels, -1)
    if labels.shape.rank != 1:
      raise ValueError(
        f'ClassifierTask {self.path!r}: labels have shape '
        f'{labels.shape.as_list()}; expected int [batch].'
      )
    if 'weight' in input_batch:
      weights = tf.cast(input_batch['weight'], tf.float32)
    else:
      weights = tf.ones(tf.shape(labels), tf.float32)
    return labels, weights

  def ComputePredictions(self, theta, input_batch):
    """NestedMap(logits=[batch, num_classes], the network's other outputs);
    with the loss on the last cell (schedule '1f1b') also `loss`, the
    training loss."""
    x = self._Get(input_batch, self.params.input_key, 'input')
    if not self._LossOnLastCell():
      features, others = self._NetworkOutput(
        self.network.FProp(theta.network, x)
      )
      others.logits = self.softmax.Logits(theta.softmax, features)
      return others
    labels, weights = self._LabelsAndWeights(input_batch)
    total = tf.reduce_sum(weights)

    def LossFn(out, mb, softmax_theta):
      features, others = self._NetworkOutput(out)
      xent = self._Xent(self.softmax.Logits(softmax_theta, features), mb.labels)
      return self._SumTerms(
        self._LossTerms(xent, others, mb.labels, mb.weights, total)
      )

    loss, out = self.network.FPropWithLoss(
      theta.network,
      x,
      loss_fn=LossFn,
      loss_inputs=NestedMap(labels=labels, weights=weights),
      loss_theta=theta.softmax,
    )
    # For the metrics: no gradient flows through them.
    features, others = self._NetworkOutput(out)
    others.logits = self.softmax.Logits(theta.softmax, features)
    preds = tf.nest.map_structure(tf.stop_gradient, others)
    preds.loss = loss
    return preds

  def ComputeLoss(self, theta, predictions, input_batch):
    """(metrics, per_example). See the module docstring."""
    del theta
    logits = tf.cast(predictions.logits, tf.float32)
    labels, weights = self._LabelsAndWeights(input_batch)
    total = tf.reduce_sum(weights)
    xent = self._Xent(logits, labels)
    plain = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits
    )

    acc1 = TopKAccuracy(1, logits, labels, weights)
    terms = self._LossTerms(xent, predictions, labels, weights, total)
    if 'loss' in predictions:  # computed on the last cell
      loss = predictions.loss
    else:
      loss = self._SumTerms(terms)
    metrics = NestedMap(
      loss=(loss, total),
      log_pplx=(Share(plain, weights, total), total),
      accuracy=(acc1, total),
      error=(1.0 - acc1, total),
      num_preds=(total, tf.constant(1.0)),
    )
    if self._num_classes >= 5:
      acc5 = TopKAccuracy(5, logits, labels, weights)
      metrics.acc5 = (acc5, total)
      metrics.error5 = (1.0 - acc5, total)
    if len(terms) > 1:  # the loss's parts, e.g. main_loss and aux_loss
      for name, share, _ in terms:
        metrics[name] = (share, total)
    per_example = NestedMap(
      loss=xent, argmax=tf.argmax(logits, -1, output_type=tf.int32)
    )
    return metrics, per_example
