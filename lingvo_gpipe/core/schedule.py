"""Learning-rate schedules (Lingvo names): multipliers of the base rate.

The learner's learning rate at step `s` is

  learner.params.learning_rate * schedule.Value(s)

where `s` is the global step before the update (0 for the first step).
`Value(step)` takes a Python int or an integer/float scalar tensor and returns
a float32 scalar tensor; it works eagerly and inside `tf.function` (the step
may be a tensor there). Unlike Lingvo, the step is always passed explicitly:
there is no global graph step to read.

Example:

  sched = schedule.TransformerSchedule.Params().Set(
      warmup_steps=4000, model_dim=512).Instantiate()
  sched.Value(tf.constant(10, tf.int64))   # float32 scalar

The AmoebaNet ImageNet recipe (RMSProp, base rate 0.256 per 4096 examples,
decayed by 0.97 every 2.4 epochs, linear warmup) is

  schedule.WarmupExponentialDecay.Params().Set(
      warmup_steps=steps_per_epoch * 3, decay_rate=0.97,
      decay_steps=int(2.4 * steps_per_epoch))
"""

import math

import tensorflow as tf

from lingvo_gpipe.core import hyperparams

__all__ = [
  'BaseSchedule',
  'Constant',
  'ConstantOne',
  'PiecewiseConstantSchedule',
  'PiecewiseConstant',
  'LinearSchedule',
  'ExponentialSchedule',
  'StepwiseExponentialSchedule',
  'ContinuousSchedule',
  'LinearWarmup',
  'TransformerSchedule',
  'SqrtDecay',
  'CosineSchedule',
  'CosineDecay',
  'LinearRampupCosineSchedule',
  'WarmupExponentialDecay',
  'LinearRampupExponentialDecay',
]


def _Step(step, who):
  if step is None:
    raise ValueError(
      f'{who}.Value(step) needs the step (e.g. the global '
      'step tensor); lingvo_gpipe has no implicit global step.'
    )
  return tf.cast(step, tf.float32)


class BaseSchedule:
  """Base class of schedules: frozen Params and `Value(step)`."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'LRSched', 'Name of the schedule (for summaries).')
    return p

  def __init__(self, params):
    if not isinstance(params, hyperparams.Params):
      raise TypeError(
        f'{type(self).__name__} expects its Params, got '
        f'{type(params).__name__}; build it with '
        f'{type(self).__name__}.Params().Instantiate().'
      )
    self._params = params.Copy().Freeze()
    self._Validate(self._params)

  @property
  def params(self):
    """The frozen Params."""
    return self._params

  def _Validate(self, p):
    """Raises ValueError for bad Params; subclasses extend."""
    del p

  def _Error(self, what, fix):
    return ValueError(f'{type(self).__name__}: {what}; {fix}')

  def Value(self, step):
    """Returns the float32 scalar multiplier at `step`."""
    raise NotImplementedError(f'{type(self).__name__}.Value')


class Constant(BaseSchedule):
  """Always `value`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('value', 1.0, 'The constant value.')
    return p

  def Value(self, step=None):
    del step
    return tf.constant(self.params.value, tf.float32)


class ConstantOne(Constant):
  """Always 1.0 (Lingvo's name)."""


class PiecewiseConstantSchedule(BaseSchedule):
  """`values[i]` for `boundaries[i-1] <= step < boundaries[i]` (Lingvo's rule).

  E.g. boundaries=[10, 20], values=[1., .1, .01]: 1.0 for steps 0..9, 0.1
  for 10..19, 0.01 from 20 on.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('boundaries', [], 'Increasing steps at which the value changes.')
    p.Define('values', [1.0], 'len(boundaries) + 1 values, one per interval.')
    return p

  def _Validate(self, p):
    b, v = list(p.boundaries or []), list(p.values or [])
    if len(v) != len(b) + 1:
      raise self._Error(
        f'{len(b)} boundaries {b} need {len(b) + 1} values, got {len(v)} {v}',
        'give one value per interval.',
      )
    if sorted(b) != b:
      raise self._Error(f'boundaries {b} are not increasing', 'sort them.')

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    if not p.boundaries:
      return tf.constant(p.values[0], tf.float32)
    bs = tf.constant(p.boundaries, tf.float32)
    index = tf.reduce_sum(tf.cast(x >= bs, tf.int32))
    return tf.gather(tf.constant(p.values, tf.float32), index)


PiecewiseConstant = PiecewiseConstantSchedule


class LinearSchedule(BaseSchedule):
  """y0 before x0, y1 from x1 on, linear in between."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('start', (0, 1.0), '(x0, y0): the value y0 up to step x0.')
    p.Define('limit', (1, 1.0), '(x1, y1): the value y1 from step x1 on.')
    return p

  def _Validate(self, p):
    if not p.start[0] < p.limit[0]:
      raise self._Error(
        f'start step {p.start[0]} >= limit step {p.limit[0]}',
        'use start=(x0, y0), limit=(x1, y1) with x0 < x1.',
      )

  def Value(self, step):
    p = self.params
    (x0, y0), (x1, y1) = p.start, p.limit
    x = _Step(step, type(self).__name__)
    frac = tf.clip_by_value((x - x0) / float(x1 - x0), 0.0, 1.0)
    return tf.constant(y0, tf.float32) + (y1 - y0) * frac


class ExponentialSchedule(BaseSchedule):
  """y0 before x0, y1 from x1 on, exponential (log-linear) in between."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('start', (0, 1.0), '(x0, y0), y0 > 0.')
    p.Define('limit', (1, 0.5), '(x1, y1), y1 > 0, x1 > x0.')
    return p

  def _Validate(self, p):
    if not p.start[0] < p.limit[0]:
      raise self._Error(
        f'start step {p.start[0]} >= limit step {p.limit[0]}', 'use x0 < x1.'
      )
    if p.start[1] <= 0 or p.limit[1] <= 0:
      raise self._Error(
        f'values {p.start[1]}, {p.limit[1]} must be > 0',
        'an exponential never reaches 0.',
      )

  def Value(self, step):
    p = self.params
    (x0, y0), (x1, y1) = p.start, p.limit
    x = _Step(step, type(self).__name__)
    frac = tf.clip_by_value((x - x0) / float(x1 - x0), 0.0, 1.0)
    return tf.exp(math.log(y0) + (math.log(y1) - math.log(y0)) * frac)


class StepwiseExponentialSchedule(BaseSchedule):
  """decay ** floor(step / num_steps_per_decay)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('decay', 0.99, 'Decay factor.')
    p.Define('num_steps_per_decay', 1000, 'Number of steps between decays.')
    return p

  def _Validate(self, p):
    if p.num_steps_per_decay <= 0:
      raise self._Error(
        f'num_steps_per_decay = {p.num_steps_per_decay}', 'it must be > 0.'
      )

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    return tf.pow(
      tf.constant(p.decay, tf.float32),
      tf.floor(x / float(p.num_steps_per_decay)),
    )


class ContinuousSchedule(BaseSchedule):
  """Lingvo's default: 1 until start_step, then halves every half_life_steps.

  initial_value * max(min, 0.5 ** ((step - start_step) / half_life_steps)).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('initial_value', 1.0, 'Initial decay value.')
    p.Define('start_step', 400000, 'Starts to decay from this step.')
    p.Define('half_life_steps', 100000, 'Halves every this many steps.')
    p.Define('min', 0.01, 'Minimum relative value.')
    return p

  def _Validate(self, p):
    if p.half_life_steps <= 0 or not 0 < p.min <= 1:
      raise self._Error(
        f'half_life_steps = {p.half_life_steps}, min = {p.min}',
        'use half_life_steps > 0 and 0 < min <= 1.',
      )

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    decayed = tf.pow(
      0.5, tf.maximum(x - p.start_step, 0.0) / float(p.half_life_steps)
    )
    return p.initial_value * tf.maximum(decayed, p.min)


class LinearWarmup(BaseSchedule):
  """Linear from warmup_init at step 0 to 1.0 at warmup_steps, then 1.0."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('warmup_steps', 1000, 'Number of warmup steps (0: none).')
    p.Define('warmup_init', 0.0, 'Value at step 0.')
    return p

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    if p.warmup_steps <= 0:
      return tf.constant(1.0, tf.float32)
    frac = tf.minimum(x / float(p.warmup_steps), 1.0)
    return p.warmup_init + (1.0 - p.warmup_init) * frac


class TransformerSchedule(BaseSchedule):
  """Vaswani et al.: linear warmup then inverse square root decay.

  model_dim^-0.5 * min((step + 1) * warmup^-1.5, (step + 1)^-0.5) with the
  defaults (decay_factor = -0.5); `warmup` is warmup_steps * worker_replicas.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('warmup_steps', 4000, 'Linear warmup steps.')
    p.Define('model_dim', 512, 'Model dimension (scales by model_dim^-0.5).')
    p.Define('worker_replicas', 1, 'Number of worker replicas.')
    p.Define('decay_end', None, 'If set, the value is held from this step on.')
    p.Define('decay_factor', -0.5, 'Exponent of the decay after warmup.')
    p.Define('start_step', 0, 'Shifts the decay part left by this many steps.')
    return p

  def _Validate(self, p):
    if p.warmup_steps <= 0 or p.model_dim <= 0:
      raise self._Error(
        f'warmup_steps = {p.warmup_steps}, model_dim = {p.model_dim}',
        'both must be > 0.',
      )

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    if p.decay_end is not None:
      x = tf.minimum(x, float(p.decay_end))
    warmup = float(p.warmup_steps * p.worker_replicas)
    return p.model_dim**-0.5 * tf.minimum(
      (x + 1.0) * warmup ** (p.decay_factor - 1.0),
      tf.pow(x + p.start_step + 1.0, p.decay_factor),
    )


class SqrtDecay(BaseSchedule):
  """multiplier * rsqrt(max(step - offset, warmup_steps)) (Lingvo's)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('warmup_steps', 10000, 'Constant until this step, then decays.')
    p.Define('multiplier', 1.0, 'Multiplier.')
    p.Define('offset', 0.0, 'Subtracted from the step.')
    return p

  def _Validate(self, p):
    if p.warmup_steps <= 0:
      raise self._Error(
        f'warmup_steps = {p.warmup_steps}',
        'it must be > 0 (rsqrt of 0 is infinite).',
      )

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    return p.multiplier * tf.math.rsqrt(
      tf.maximum(x - p.offset, float(p.warmup_steps))
    )


class CosineSchedule(BaseSchedule):
  """Cosine decay from initial_value to final_value over total_steps.

  value = final + (initial - final) * (1 + cos(pi * min(step, total) /
  total)) / 2. With warmup_steps > 0 the value is also capped by a linear
  ramp from warmup_init at step 0 to initial_value at warmup_steps (Lingvo's
  LinearRampupCosineSchedule).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('initial_value', 1.0, 'Value at step 0 (after warmup).')
    p.Define('final_value', 0.0, 'Value from total_steps on.')
    p.Define('total_steps', 0, 'Steps to reach final_value (> 0).')
    p.Define('warmup_steps', 0, 'Linear warmup steps; 0: no warmup.')
    p.Define('warmup_init', 0.0, 'Value at step 0 when warming up.')
    return p

  def _Validate(self, p):
    if p.total_steps <= 0:
      raise self._Error(
        f'total_steps = {p.total_steps}',
        'set total_steps > 0, e.g. the max training steps.',
      )

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    angle = math.pi * tf.minimum(x, float(p.total_steps)) / p.total_steps
    value = p.final_value + 0.5 * (p.initial_value - p.final_value) * (
      1.0 + tf.cos(angle)
    )
    if p.warmup_steps > 0:
      ramp = p.warmup_init + (p.initial_value - p.warmup_init) * tf.minimum(
        x / float(p.warmup_steps), 1.0
      )
      value = tf.minimum(value, ramp)
    return value


CosineDecay = CosineSchedule
LinearRampupCosineSchedule = CosineSchedule


class WarmupExponentialDecay(BaseSchedule):
  """Linear warmup, then staircase exponential decay (the AmoebaNet recipe).

  step < warmup_steps: warmup_init + (1 - warmup_init) * step / warmup_steps;
  afterwards max(min_value, decay_rate ** (step / decay_steps)), with the
  exponent floored when `staircase`. As in the TPU AmoebaNet trainer, the
  decay counts from step 0, not from the end of the warmup.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('warmup_steps', 0, 'Linear warmup steps; 0: no warmup.')
    p.Define('warmup_init', 0.0, 'Value at step 0 when warming up.')
    p.Define('decay_rate', 0.97, 'Decay factor per decay_steps.')
    p.Define('decay_steps', 1000, 'Steps per decay, e.g. 2.4 epochs.')
    p.Define('staircase', True, 'Decay in discrete steps (floor).')
    p.Define('min_value', 0.0, 'Floor of the decayed value.')
    return p

  def _Validate(self, p):
    if p.decay_steps <= 0 or not 0 < p.decay_rate <= 1:
      raise self._Error(
        f'decay_steps = {p.decay_steps}, decay_rate = {p.decay_rate}',
        'use decay_steps > 0 and 0 < decay_rate <= 1.',
      )

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    exponent = x / float(p.decay_steps)
    if p.staircase:
      exponent = tf.floor(exponent)
    value = tf.maximum(
      tf.pow(tf.constant(p.decay_rate, tf.float32), exponent), p.min_value
    )
    if p.warmup_steps > 0:
      ramp = p.warmup_init + (1.0 - p.warmup_init) * x / float(p.warmup_steps)
      value = tf.where(x < p.warmup_steps, ramp, value)
    return value


class LinearRampupExponentialDecay(BaseSchedule):
  """Lingvo's: ramp warmup_init -> 1 by `warmup`, 1 until decay_start, then
  exponential decay to `min` at decay_end, capped by `max`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('warmup', 300, 'Linear ramp-up steps.')
    p.Define('warmup_init', 0.0, 'Value at step 0.')
    p.Define('decay_start', 70000, 'Step where the decay starts.')
    p.Define('decay_end', 100000, 'Step where the decay reaches min.')
    p.Define('min', 0.01, 'Value from decay_end on (> 0).')
    p.Define('max', 1e8, 'Cap of the value.')
    return p

  def _Validate(self, p):
    if p.min <= 0:
      raise self._Error(f'min = {p.min}', 'it must be > 0.')

  def Value(self, step):
    p = self.params
    x = _Step(step, type(self).__name__)
    decay_start = max(p.warmup + 1.0, float(p.decay_start))
    decay_end = max(decay_start + 1.0, float(p.decay_end))
    frac = tf.clip_by_value(
      (x - decay_start) / (decay_end - decay_start), 0.0, 1.0
    )
    value = tf.exp(math.log(p.min) * frac)
    if p.warmup > 0:
      ramp = p.warmup_init + (1.0 - p.warmup_init) * tf.minimum(
        x / float(p.warmup), 1.0
      )
      value = tf.minimum(value, ramp)
    return tf.minimum(value, float(p.max))
