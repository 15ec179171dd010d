"""BaseTask and SingleTaskModel: what a trainer builds and steps (Lingvo's).

A task computes predictions and a loss; a model wraps one task. The trainer
(`lingvo_gpipe.trainer`) uses exactly this contract:

  p = model_registry.GetParams('image.digits.MlpDigitsTiny', 'Train')
  model = p.Instantiate()            # SingleTaskModel; builds every variable
  task = model.GetTask()             # and the optimizer slots, eagerly
  gen = task.input_generator         # BaseInputGenerator child (or None)
  train_step = tf.function(task.TrainStep)
  eval_step = tf.function(task.EvalStep)         # a separate function
  out = train_step(gen.GetPreprocessedInputBatch())
  # out: NestedMap of float32 scalars: every metric value ('loss', ...) plus
  # learning_rate, grad_norm, var_norm, grad_scale, has_nan_or_inf[, l2_loss]
  metrics = eval_step(batch)         # NestedMap name -> (value, weight)
  model.global_step                  # int64 variable 'global_step'
  model.VariablesByName()            # {name: variable} to checkpoint: model
                                     # weights, optimizer slots, global_step
  p.task.train.max_steps, .save_interval_steps, .save_interval_seconds,
  .save_max_to_keep, .summary_interval_steps, .tpu_steps_per_loop

`TrainStep(batch)` is the whole step: under `py_utils.UpdateCollector()` and
`py_utils.StepSeed(global_step)` it runs the forward pass on a gradient tape,
the learner applies the gradients, the deferred updates (batch-norm moving
averages) are applied once, and the global step is incremented. `EvalStep`
runs under `py_utils.EvalMode()` and changes no variable. Both are marked
`tf.autograph.experimental.do_not_convert`: model code is graph-style, as in
Lingvo (Python control flow only on static values), and converting the
pipeline's code with autograph would only cost seconds per trace.

Checkpoint names depend only on layer names: `<task name>/<layer>/.../<var>`,
slots `<var name>/<slot>`, and `global_step`, whatever the pipeline split.

`MetricsAggregator` averages the (value, weight) pairs of eval batches.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import learner as learner_lib
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = [
  'BaseTask',
  'SingleTaskModel',
  'AverageMetric',
  'MetricsAggregator',
  'IsCountMetric',
]


def _VarName(v):
  return v.name.split(':')[0]


class BaseTask(base_layer.BaseLayer):
  """A single task: predictions, loss, learner. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'input',
      None,
      'Input generator Params; built as child "input" (not under '
      'base_layer.AbstractBuild).',
    )
    p.Define('train', hyperparams.Params(), 'How this task is trained.')
    tp = p.train
    tp.Define(
      'learner',
      None,
      'Learner Params; None: a Learner built from the legacy params '
      'below (learning_rate, optimizer, lr_schedule, ...), as in '
      'Lingvo.',
    )
    learner_lib.DefineLearnerParams(tp)
    tp.Define('max_steps', 4 * 10**6, 'Maximum number of training steps.')
    tp.Define(
      'save_interval_seconds',
      60 * 10,
      'Checkpoint roughly once every this many seconds.',
    )
    tp.Define(
      'save_interval_steps',
      None,
      'If set, checkpoint every this many steps instead of by time.',
    )
    tp.Define('save_max_to_keep', 100, 'Most recent checkpoints to keep.')
    tp.Define(
      'summary_interval_steps',
      100,
      'Write training summaries every this many steps.',
    )
    tp.Define(
      'tpu_steps_per_loop',
      1,
      'Training steps per trainer loop (inside one tf.function '
      "call); Lingvo's name.",
    )
    p.Define('eval', hyperparams.Params(), 'How this task is evaluated.')
    ep = p.eval
    ep.Define(
      'samples_per_summary',
      0,
      'Examples per eval summary; 0: the whole eval set.',
    )
    ep.Define(
      'decoder_samples_per_summary',
      None,
      'Examples per decoder summary; None: samples_per_summary.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.input is not None and not base_layer.IsAbstract():
      self.CreateChild('input', p.input)
    if base_layer.IsAbstract():
      self._global_step = None
    else:
      with tf.init_scope():
        self._global_step = tf.Variable(
          tf.constant(0, tf.int64),
          trainable=False,
          name='global_step',
          aggregation=py_utils.REPLICATED_AGGREGATION,
        )
    lp = p.train.learner
    if lp is None:
      lp = learner_lib.Learner.Params()
      for name in learner_lib.LEGACY_LEARNER_PARAMS:
        lp.Set(**{name: p.train.Get(name)})
    self._learner = lp.Instantiate()
    self._slots_created = False

  # -- Accessors -------------------------------------------------------------

  @property
  def input_generator(self):
    """The input generator child, or None."""
    return self._private_children.get('input')

  @property
  def learner(self):
    return self._learner

  @property
  def global_step(self):
    """The int64 'global_step' variable (None under AbstractBuild)."""
    return self._global_step

  def _SkipLpNames(self):
    names = []

    def Visit(layer):
      children = layer.children
      if layer.params.skip_lp_regularization:
        names.extend(
          _VarName(v) for k, v in layer.vars.items() if k not in children
        )
      for child in children.values():
        for c in child if isinstance(child, (list, tuple)) else [child]:
          Visit(c)

    Visit(self)
    return names

  def CreateOptimizerSlots(self):
    """Creates the learner's optimizer slots eagerly (idempotent)."""
    if self._slots_created or base_layer.IsAbstract():
      return
    variables = [v for v in self.VariablesByName().values() if v.trainable]
    self._learner.CreateSlots(variables, self._SkipLpNames())
    self._slots_created = True

  # -- Computation -----------------------------------------------------------

  def ComputePredictions(self, theta, input_batch):
    """Returns the predictions (any structure) of `input_batch`."""
    raise NotImplementedError(f'{type(self).__name__}.ComputePredictions')

  def ComputeLoss(self, theta, predictions, input_batch):
    """Returns (metrics, per_example).

    metrics: NestedMap name -> (scalar value, scalar weight), with 'loss'.
    per_example: NestedMap of per-example tensors.
    """
    raise NotImplementedError(f'{type(self).__name__}.ComputeLoss')

  def _CheckMetrics(self, metrics):
    if not isinstance(metrics, dict):
      raise TypeError(
        f'{type(self).__name__}.ComputeLoss must return '
        f'(metrics, per_example) with metrics a NestedMap; got '
        f'{type(metrics).__name__}.'
      )
    metrics = NestedMap(metrics)
    for k, v in metrics.items():
      if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise ValueError(
          f'{type(self).__name__}: metric {k!r} is {v!r}; '
          'each metric must be a (value, weight) pair.'
        )
    if self._learner.loss_name not in metrics:
      raise ValueError(
        f'{type(self).__name__}.ComputeLoss returned metrics '
        f'{sorted(metrics)} without {self._learner.loss_name!r}, the loss '
        "the learner minimizes; add it (or set the learner's loss_name)."
      )
    return metrics

  def FProp(self, theta, input_batch):
    """Returns (metrics, per_example) of `input_batch`."""
    predictions = self.ComputePredictions(theta, input_batch)
    metrics, per_example = self.ComputeLoss(theta, predictions, input_batch)
    return self._CheckMetrics(metrics), NestedMap(per_example or {})

  def FPropDefaultTheta(self, input_batch):
    return self.FProp(self.theta, input_batch)

  @tf.autograph.experimental.do_not_convert
  def TrainStep(self, input_batch):
    """One training step. See the module docstring.

    Returns:
      NestedMap of float32 scalars: each metric's value and the learner's
      stats (learning_rate, grad_norm, ...).
    """
    if self._global_step is None:
      raise ValueError('TrainStep needs a built (not abstract) task.')
    self.CreateOptimizerSlots()
    step = self._global_step.read_value()
    with py_utils.UpdateCollector() as updates, py_utils.StepSeed(step):
      with tf.GradientTape() as tape:
        metrics, _ = self.FPropDefaultTheta(input_batch)
        loss = tf.convert_to_tensor(metrics[self._learner.loss_name][0])
    stats, _ = self._learner.Apply(loss, tape, step)
    updates.Apply()
    self._global_step.assign_add(1)
    out = NestedMap()
    for k, (value, _) in metrics.items():
      out[k] = tf.cast(value, tf.float32)
    for k, value in stats.items():
      if k in out:
        raise ValueError(
          f'{type(self).__name__}: metric {k!r} clashes with '
          'the learner statistic of the same name; rename it.'
        )
      out[k] = tf.cast(value, tf.float32)
    return out

  @tf.autograph.experimental.do_not_convert
  def EvalStep(self, input_batch):
    """Metrics of one eval batch: NestedMap name -> (value, weight)."""
    with py_utils.EvalMode(), py_utils.NoUpdateCollection():
      metrics, _ = self.FPropDefaultTheta(input_batch)
    return NestedMap(
      {
        k: (tf.cast(v, tf.float32), tf.cast(w, tf.float32))
        for k, (v, w) in metrics.items()
      }
    )

  @tf.autograph.experimental.do_not_convert
  def Decode(self, input_batch):
    """Predictions in eval mode (override for real decoding)."""
    with py_utils.EvalMode(), py_utils.NoUpdateCollection():
      return self.ComputePredictions(self.theta, input_batch)

  def EvaluateDecoder(self, max_batches=None, **decode):
    """Decodes this task's input and scores it (e.g. BLEU): what
    `runners.evaler.EvaluateBleuCheckpoint` reports. A task with a decoder
    metric overrides this."""
    del max_batches, decode
    raise ValueError(
      f'Task {self.params.name!r} ({type(self).__name__}) has no decoder '
      'evaluation; evaluate it with --job=evaler_dev (its metrics) instead.'
    )


class SingleTaskModel(base_layer.BaseLayer):
  """A model of one task (Lingvo's). See the module docstring.

  The task is built as a root layer, so its variables are named
  `<task name>/...` as in Lingvo, and is then adopted as child 'task'.
  """

  @classmethod
  def Params(cls, task_params=None):
    p = super().Params()
    p.Define('task', None, 'Params of the BaseTask.')
    p.Define(
      'input', None, 'Input generator Params; when set it replaces task.input.'
    )
    if task_params is not None:
      p.task = task_params
      p.input = task_params.input
    return p

  def __init__(self, params):
    p = params.Copy()
    if p.task is None:
      raise ValueError(
        'SingleTaskModel: p.task is None; set it to the task '
        'Params, e.g. SingleTaskModel.Params(task_params).'
      )
    task_p = p.task.Copy()
    if not task_p.name:
      task_p.name = p.name
    if not task_p.name:
      raise ValueError(
        'SingleTaskModel: set p.task.name (it prefixes every '
        'variable name), e.g. "digits".'
      )
    p.name = p.name or task_p.name
    if p.input is not None:
      task_p.input = p.input.Copy()
    else:
      p.input = task_p.input
    base_layer.BaseLayer.CopyBaseParams(p, task_p)
    p.task = task_p
    task = task_p.Instantiate()
    super().__init__(p)
    self._private_children['task'] = task
    task.CreateOptimizerSlots()

  def GetTask(self):
    return self._private_children['task']

  @property
  def global_step(self):
    """The task's int64 'global_step' variable."""
    return self.GetTask().global_step

  def FProp(self, theta, input_batch):
    return self.GetTask().FProp(theta.task, input_batch)

  def VariablesByName(self):
    """{name: variable}: weights, optimizer slots and global_step."""
    out = super().VariablesByName()
    task = self.GetTask()
    extra = dict(task.learner.slots())
    if task.global_step is not None:
      extra['global_step'] = task.global_step
    for name, v in extra.items():
      if name in out and out[name] is not v:
        raise ValueError(
          f'SingleTaskModel: variable name {name!r} is used '
          'by a weight and by an optimizer variable; rename '
          'the layer or the optimizer.'
        )
      out[name] = v
    return out


def _Float(x):
  return float(np.asarray(x))


class AverageMetric:
  """Weighted average of values (Lingvo's metrics.AverageMetric)."""

  def __init__(self):
    self.total_value = 0.0
    self.total_weight = 0.0

  def Update(self, value, weight=1.0):
    weight = _Float(weight)
    if weight < 0:
      raise ValueError(
        f'AverageMetric: weight {weight} < 0; weights count '
        'examples and must be >= 0.'
      )
    self.total_value += _Float(value) * weight
    self.total_weight += weight

  @property
  def value(self):
    return (
      self.total_value / self.total_weight if self.total_weight > 0 else 0.0
    )


def IsCountMetric(name):
  """Metrics named num_* (e.g. num_preds) count examples: over batches they
  are summed, not averaged."""
  return name.startswith('num_')


class MetricsAggregator:
  """Weighted means of EvalStep metrics over batches (counts, `num_*`,
  summed).

  agg = MetricsAggregator()
  for batch in dataset:
    agg.Update(eval_step(batch))
  agg.Result()   # {'loss': ..., 'accuracy': ...}
  """

  def __init__(self):
    self._metrics = {}

  def Update(self, metrics):
    """Adds one batch's NestedMap/dict name -> (value, weight)."""
    for name, (value, weight) in dict(metrics).items():
      self._metrics.setdefault(name, AverageMetric()).Update(value, weight)

  def Result(self):
    """{name: weighted mean (a count: the sum)} of every metric seen."""
    return {
      k: m.total_value if IsCountMetric(k) else m.value
      for k, m in sorted(self._metrics.items())
    }

  def TotalWeight(self, name):
    return self._metrics[name].total_weight if name in self._metrics else 0.0
