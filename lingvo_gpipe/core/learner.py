"""Learner: turns a loss's gradients into one optimizer update (Lingvo's).

Per training step, `Apply(loss, grads_and_vars, global_step)`:

  1. keeps the variables selected by bprop_variable_filter / _exclusion;
     inside a tf.distribute replica of several (TPUStrategy.run, or
     MirroredStrategy.run), averages their gradients over the replicas;
  2. adds L2 weight decay (if l2_regularizer_weight): g += w * var and reports
     l2_loss = 0.5 * w * sum(var^2), except for variables whose name matches
     `skip_lp_regularization_regex` (by default biases '/b' and batch-norm
     '/beta', '/gamma'; moving averages are not trainable anyway) or that
     were passed in `CreateSlots(..., skip_lp_regularization=names)` (the
     task passes the variables of layers with `skip_lp_regularization`);
  3. clips: by global norm (clip_gradient_norm_to_value), or each tensor by
     its own norm (clip_gradient_single_norm_to_value); a step whose gradient
     norm is NaN/Inf (or above grad_norm_to_clip_to_zero) gets zero
     gradients, as in Lingvo;
  4. lr = learning_rate * lr_schedule.Value(global_step);
  5. optimizer.Apply(lr, grads_and_vars).

It returns (NestedMap(learning_rate, grad_norm, var_norm, grad_scale,
has_nan_or_inf[, l2_loss]), update_op). The L2 step follows Lingvo's order:
weight decay is added before clipping. The learner's variables and its
optimizer's slots are created eagerly by `CreateSlots(variables)`.
"""

import re

import tensorflow as tf
from absl import logging

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core import schedule
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = ['Learner', 'LEGACY_LEARNER_PARAMS', 'DefineLearnerParams']

# Learner params that BaseTask also defines in p.train (Lingvo's legacy
# single-learner configuration).
LEGACY_LEARNER_PARAMS = (
  'learning_rate',
  'lr_schedule',
  'optimizer',
  'clip_gradient_norm_to_value',
  'clip_gradient_single_norm_to_value',
  'grad_norm_to_clip_to_zero',
  'l2_regularizer_weight',
  'bprop_variable_filter',
  'bprop_variable_exclusion',
)


def DefineLearnerParams(p):
  """Defines the learner hyper-parameters in `p` (Learner and p.train)."""
  p.Define('learning_rate', 0.0, 'Base learning rate.')
  p.Define(
    'lr_schedule',
    schedule.ConstantOne.Params(),
    'Schedule Params; its Value(step) multiplies learning_rate.',
  )
  p.Define('optimizer', optimizer.Adam.Params(), 'Optimizer Params.')
  p.Define(
    'clip_gradient_norm_to_value',
    0.0,
    'If > 0, clip the gradients by their global norm to this value '
    '(tf.clip_by_global_norm). Exclusive with the next one.',
  )
  p.Define(
    'clip_gradient_single_norm_to_value',
    0.0,
    'If > 0, clip each gradient tensor to this norm (tf.clip_by_norm).',
  )
  p.Define(
    'grad_norm_to_clip_to_zero',
    0.0,
    'If > 0, a step whose gradient norm exceeds this is skipped '
    '(zero gradients).',
  )
  p.Define(
    'l2_regularizer_weight',
    None,
    'If set, L2 weight decay of this weight (see the module doc for '
    'the variables it skips).',
  )
  p.Define(
    'bprop_variable_filter',
    None,
    'If set, only variables whose names match this regex (re.search) '
    'are trained.',
  )
  p.Define(
    'bprop_variable_exclusion',
    None,
    'If set, variables whose names match this regex are not trained.',
  )


def _AllReduceInReplica(pairs):
  """Inside a tf.distribute replica (e.g. TPUStrategy.run) of several
  replicas: the gradients averaged over the replicas (each replica's loss is
  the mean over its share of the batch), so every replica applies the update
  of the whole batch. Elsewhere: `pairs` unchanged."""
  grads = py_utils.CrossReplicaReduce(
    [g for g, _ in pairs], tf.distribute.ReduceOp.MEAN
  )
  return [(g, v) for g, (_, v) in zip(grads, pairs)]


class Learner:
  """Computes the update of one loss. See the module docstring."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define(
      'name',
      'loss',
      'Name of the learner; also the metric it minimizes unless '
      "loss_name is set (Lingvo's convention).",
    )
    p.Define('loss_name', None, 'Metric to minimize; None: p.name.')
    DefineLearnerParams(p)
    p.Define(
      'skip_lp_regularization_regex',
      r'/(b|beta|gamma)$',
      'Variables whose names match this regex (re.search) get no '
      'weight decay; None: only those passed to CreateSlots.',
    )
    p.Define(
      'loss_scale',
      None,
      'Loss scaling, for float16 compute (fprop_dtype) whose small '
      'gradients would underflow: None (off); a number S (static: '
      'back-propagate S * loss, divide the gradients by S); or '
      '"dynamic": S starts at initial_loss_scale, is halved when a '
      'gradient is not finite (that step gets zero gradients, like '
      'any non-finite step), and doubled after '
      'loss_scale_growth_interval finite steps.',
    )
    p.Define('initial_loss_scale', 2.0**15, 'Initial dynamic loss scale.')
    p.Define(
      'loss_scale_growth_interval',
      2000,
      'Finite steps before the dynamic loss scale doubles.',
    )
    return p

  def __init__(self, params):
    if not isinstance(params, hyperparams.Params):
      raise TypeError(
        f'Learner expects its Params, got '
        f'{type(params).__name__}; use '
        'Learner.Params().Set(...).Instantiate().'
      )
    self._params = params.Copy().Freeze()
    p = self._params
    if p.clip_gradient_norm_to_value and p.clip_gradient_single_norm_to_value:
      raise ValueError(
        f'Learner {p.name!r}: clip_gradient_norm_to_value = '
        f'{p.clip_gradient_norm_to_value} and '
        f'clip_gradient_single_norm_to_value = '
        f'{p.clip_gradient_single_norm_to_value} are both set; set one to 0.'
      )
    if p.learning_rate is None or p.learning_rate < 0:
      raise ValueError(
        f'Learner {p.name!r}: learning_rate = '
        f'{p.learning_rate!r}; set a rate >= 0.'
      )
    for what in ('optimizer', 'lr_schedule'):
      if not isinstance(p.Get(what), hyperparams.InstantiableParams):
        raise TypeError(
          f'Learner {p.name!r}: p.{what} = {p.Get(what)!r}; '
          f'set it to the Params of a {what} class.'
        )
    if not (
      p.loss_scale is None
      or p.loss_scale == 'dynamic'
      or (isinstance(p.loss_scale, (int, float)) and p.loss_scale > 0)
    ):
      raise ValueError(
        f'Learner {p.name!r}: loss_scale = {p.loss_scale!r}; '
        'use None, a positive number or "dynamic".'
      )
    self._optimizer = p.optimizer.Instantiate()
    self._schedule = p.lr_schedule.Instantiate()
    self._variables = None
    self._skip_lp = set()
    self._loss_scale_vars = None  # (scale, good steps) when dynamic

  @property
  def params(self):
    """The frozen Params."""
    return self._params

  @property
  def loss_name(self):
    return self.params.loss_name or self.params.name

  @property
  def optimizer(self):
    return self._optimizer

  @property
  def lr_schedule(self):
    return self._schedule

  @property
  def variables(self):
    """The variables this learner trains (sorted by name), once known."""
    return list(self._variables) if self._variables is not None else None

  def _Selected(self, var):
    p = self.params
    name = optimizer.VarName(var)
    if not getattr(var, 'trainable', True):
      return False
    if p.bprop_variable_filter and not re.search(p.bprop_variable_filter, name):
      return False
    if p.bprop_variable_exclusion and re.search(
      p.bprop_variable_exclusion, name
    ):
      return False
    return True

  def CreateSlots(self, variables, skip_lp_regularization=()):
    """Selects the trained variables and creates their optimizer slots.

    Args:
      variables: candidate variables (non-trainable ones are ignored).
      skip_lp_regularization: names of variables exempt from weight decay.
    """
    chosen = {}
    for v in variables:
      if self._Selected(v):
        chosen.setdefault(optimizer.VarName(v), v)
    self._variables = [chosen[k] for k in sorted(chosen)]
    self._skip_lp |= set(skip_lp_regularization)
    self._optimizer.CreateSlots(self._variables)
    if self.params.loss_scale == 'dynamic' and self._loss_scale_vars is None:
      name = self.params.name
      with tf.init_scope():
        self._loss_scale_vars = (
          tf.Variable(
            float(self.params.initial_loss_scale),
            dtype=tf.float32,
            trainable=False,
            name=f'{name}/loss_scale/',
            aggregation=py_utils.REPLICATED_AGGREGATION,
          ),
          tf.Variable(
            tf.constant(0, tf.int64),
            trainable=False,
            name=f'{name}/loss_scale_good_steps/',
            aggregation=py_utils.REPLICATED_AGGREGATION,
          ),
        )

  def slots(self):
    """{name: variable} of the optimizer's slots and counters (and of the
    dynamic loss scale)."""
    out = self._optimizer.slots()
    for v in self._loss_scale_vars or ():
      out[optimizer.VarName(v)] = v
    return out

  def LossScale(self):
    """The current loss scale (a float32 scalar), or None when off."""
    p = self.params
    if p.loss_scale is None:
      return None
    if p.loss_scale == 'dynamic':
      if self._loss_scale_vars is None:
        raise ValueError(
          f'Learner {p.name!r}: call CreateSlots before '
          'using the dynamic loss scale.'
        )
      return tf.convert_to_tensor(self._loss_scale_vars[0])
    return tf.constant(float(p.loss_scale), tf.float32)

  def _UpdateLossScale(self, finite):
    """Dynamic loss scale: halve on a non-finite step, double after
    loss_scale_growth_interval finite ones. Returns the update op."""
    scale, good = self._loss_scale_vars
    interval = self.params.loss_scale_growth_interval
    grow = tf.logical_and(finite, good + 1 >= interval)
    new_scale = tf.where(
      finite, tf.where(grow, scale * 2.0, scale), tf.maximum(scale * 0.5, 1.0)
    )
    new_good = tf.where(
      tf.logical_and(finite, tf.logical_not(grow)),
      good + 1,
      tf.zeros_like(good),
    )
    return tf.group(scale.assign(new_scale), good.assign(new_good))

  def LearningRate(self, step):
    """learning_rate * lr_schedule.Value(step), a float32 scalar."""
    return tf.constant(
      self.params.learning_rate, tf.float32
    ) * self._schedule.Value(step)

  def _SkipLp(self, var):
    name = optimizer.VarName(var)
    regex = self.params.skip_lp_regularization_regex
    return name in self._skip_lp or bool(regex and re.search(regex, name))

  def Apply(self, loss, grads_and_vars, global_step):
    """Applies one update. See the module docstring.

    Args:
      loss: the scalar loss (used when `grads_and_vars` is a tape).
      grads_and_vars: list of (gradient, variable), or the tf.GradientTape
        that recorded `loss` (gradients are then taken w.r.t. the variables
        given to CreateSlots).
      global_step: the step before this update (schedules read it).

    Returns:
      (NestedMap of scalar stats, update op).
    """
    p = self.params
    if isinstance(grads_and_vars, tf.GradientTape):
      if self._variables is None:
        raise ValueError(
          f'Learner {p.name!r}: call CreateSlots(variables) '
          'before Apply with a tape.'
        )
      loss_scale = self.LossScale()
      if loss_scale is None:
        grads = grads_and_vars.gradient(loss, self._variables)
      else:
        # d(S * loss)/dw, without recording S * loss on the tape.
        grads = grads_and_vars.gradient(
          loss,
          self._variables,
          output_gradients=tf.cast(loss_scale, loss.dtype),
        )
        grads = [
          None if g is None else g / tf.cast(loss_scale, g.dtype) for g in grads
        ]
      grads_and_vars = list(zip(grads, self._variables))
    pairs, dropped = [], []
    for g, v in grads_and_vars:
      if not self._Selected(v):
        continue
      if g is None:
        dropped.append(optimizer.VarName(v))
        continue
      with tf.device(v.device):
        pairs.append((tf.convert_to_tensor(g), v))
    if dropped:
      logging.warning(
        'Learner %s: no gradient for %s; they are not updated.', p.name, dropped
      )
    pairs = _AllReduceInReplica(pairs)
    if not pairs:
      raise ValueError(
        f'Learner {p.name!r}: no variable has a gradient; '
        'check that the loss depends on the trainable '
        'variables and the bprop_variable_filter/_exclusion.'
      )
    stats = NestedMap()
    if p.l2_regularizer_weight:
      w = float(p.l2_regularizer_weight)
      decayed = [v for _, v in pairs if not self._SkipLp(v)]
      # Each term on its variable's device: elsewhere every decayed
      # variable went to the step's device (over worker processes, the
      # driving process) at every step.
      stats.l2_loss = (
        0.5 * w * tf.add_n([_SquaredSum(v) for v in decayed])
        if decayed
        else tf.constant(0.0)
      )
      new_pairs = []
      for g, v in pairs:
        if not self._SkipLp(v):
          with tf.device(v.device):
            g = g + tf.cast(w, g.dtype) * tf.cast(v, g.dtype)
        new_pairs.append((g, v))
      pairs = new_pairs
    grad_norm = tf.linalg.global_norm(
      [tf.cast(g, tf.float32) for g, _ in pairs]
    )
    var_norm = tf.linalg.global_norm([tf.cast(v, tf.float32) for _, v in pairs])
    has_nan_or_inf = tf.logical_not(tf.math.is_finite(grad_norm))
    scale = tf.constant(1.0, tf.float32)
    if p.clip_gradient_norm_to_value:
      scale = tf.minimum(
        1.0, p.clip_gradient_norm_to_value / tf.maximum(grad_norm, 1e-30)
      )
    if p.grad_norm_to_clip_to_zero:
      scale *= tf.cast(grad_norm < p.grad_norm_to_clip_to_zero, tf.float32)
    scale = tf.where(has_nan_or_inf, 0.0, scale)
    final = []
    for g, v in pairs:
      with tf.device(v.device):
        if p.clip_gradient_single_norm_to_value:
          g = tf.clip_by_norm(g, p.clip_gradient_single_norm_to_value)
        s = tf.cast(scale, g.dtype)
        g = tf.where(tf.equal(s, 0.0), tf.zeros_like(g), g * s)
        final.append((g, v))
    lr = self.LearningRate(global_step)
    update_op = self._optimizer.Apply(lr, final)
    if self._loss_scale_vars is not None:
      update_op = tf.group(
        update_op, self._UpdateLossScale(tf.logical_not(has_nan_or_inf))
      )
    if self.params.loss_scale is not None:
      stats.loss_scale = self.LossScale()
    stats.learning_rate = lr
    stats.grad_norm = grad_norm
    stats.var_norm = var_norm
    stats.grad_scale = scale
    stats.has_nan_or_inf = tf.cast(has_nan_or_inf, tf.float32)
    return stats, update_op


def _SquaredSum(v):
  """sum(v^2) in float32, on v's device."""
  with tf.device(v.device):
    return tf.reduce_sum(tf.square(tf.cast(v, tf.float32)))
