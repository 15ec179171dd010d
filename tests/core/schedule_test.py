"""Tests for lingvo_gpipe.core.schedule: values vs formulas."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import schedule


def _Values(p, steps):
  s = p.Instantiate()
  eager = [float(s.Value(x)) for x in steps]
  fn = tf.function(lambda x: s.Value(x))
  traced = [float(fn(tf.constant(x, tf.int64))) for x in steps]
  np.testing.assert_allclose(eager, traced, rtol=1e-6)
  for x in steps:
    assert s.Value(x).dtype == tf.float32
  return eager


def testConstant():
  assert _Values(schedule.Constant.Params().Set(value=0.5), [0, 9]) == [
    0.5,
    0.5,
  ]
  assert _Values(schedule.ConstantOne.Params(), [3]) == [1.0]


def testPiecewiseConstant():
  p = schedule.PiecewiseConstantSchedule.Params().Set(
    boundaries=[10, 20], values=[1.0, 0.1, 0.01]
  )
  got = _Values(p, [0, 9, 10, 19, 20, 1000])
  np.testing.assert_allclose(got, [1, 1, 0.1, 0.1, 0.01, 0.01], rtol=1e-6)
  assert schedule.PiecewiseConstant is schedule.PiecewiseConstantSchedule


def testLinearAndExponential():
  p = schedule.LinearSchedule.Params().Set(start=(10, 1.0), limit=(20, 0.0))
  np.testing.assert_allclose(
    _Values(p, [0, 10, 15, 20, 30]), [1, 1, 0.5, 0, 0], atol=1e-6
  )
  p = schedule.ExponentialSchedule.Params().Set(
    start=(0, 1.0), limit=(10, 0.01)
  )
  np.testing.assert_allclose(
    _Values(p, [0, 5, 10, 20]), [1, 0.1, 0.01, 0.01], rtol=1e-5
  )


def testStepwiseExponentialAndContinuous():
  p = schedule.StepwiseExponentialSchedule.Params().Set(
    decay=0.5, num_steps_per_decay=10
  )
  np.testing.assert_allclose(_Values(p, [0, 9, 10, 25]), [1, 1, 0.5, 0.25])
  p = schedule.ContinuousSchedule.Params().Set(
    start_step=100, half_life_steps=10, min=0.1
  )
  np.testing.assert_allclose(
    _Values(p, [0, 100, 110, 120, 1000]), [1, 1, 0.5, 0.25, 0.1], rtol=1e-5
  )


def testLinearWarmup():
  p = schedule.LinearWarmup.Params().Set(warmup_steps=10, warmup_init=0.2)
  np.testing.assert_allclose(
    _Values(p, [0, 5, 10, 50]), [0.2, 0.6, 1, 1], rtol=1e-6
  )


@pytest.mark.parametrize('step', [0, 1, 99, 3999, 4000, 4001, 100000])
def testTransformerSchedule(step):
  p = schedule.TransformerSchedule.Params().Set(
    warmup_steps=4000, model_dim=512
  )
  want = 512**-0.5 * min((step + 1) * 4000**-1.5, (step + 1) ** -0.5)
  np.testing.assert_allclose(_Values(p, [step]), [want], rtol=1e-5)


def testTransformerScheduleDecayEnd():
  p = schedule.TransformerSchedule.Params().Set(
    warmup_steps=10, model_dim=4, decay_end=100
  )
  a, b = _Values(p, [100, 5000])
  assert a == b


def testSqrtDecay():
  p = schedule.SqrtDecay.Params().Set(warmup_steps=100, multiplier=2.0)
  np.testing.assert_allclose(
    _Values(p, [0, 100, 400]), [0.2, 0.2, 0.1], rtol=1e-6
  )


@pytest.mark.parametrize('step', [0, 25, 50, 100, 200])
def testCosine(step):
  p = schedule.CosineSchedule.Params().Set(
    initial_value=1.0, final_value=0.1, total_steps=100
  )
  want = 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, 100) / 100))
  np.testing.assert_allclose(_Values(p, [step]), [want], rtol=1e-5, atol=1e-7)


def testCosineWithWarmup():
  p = schedule.CosineDecay.Params().Set(total_steps=100, warmup_steps=10)
  got = _Values(p, [0, 5, 10, 50])
  np.testing.assert_allclose(got[:2], [0.0, 0.5], atol=1e-6)
  np.testing.assert_allclose(
    got[2:],
    [0.5 * (1 + math.cos(math.pi * s / 100)) for s in (10, 50)],
    rtol=1e-5,
  )


def testWarmupExponentialDecay():
  p = schedule.WarmupExponentialDecay.Params().Set(
    warmup_steps=10, decay_rate=0.5, decay_steps=20, min_value=0.2
  )
  got = _Values(p, [0, 5, 10, 19, 20, 40, 60, 100])
  np.testing.assert_allclose(
    got, [0, 0.5, 1, 1, 0.5, 0.25, 0.2, 0.2], rtol=1e-6
  )
  p = schedule.WarmupExponentialDecay.Params().Set(
    decay_rate=0.97, decay_steps=24, staircase=False
  )
  np.testing.assert_allclose(_Values(p, [12]), [0.97**0.5], rtol=1e-6)


def testLinearRampupExponentialDecay():
  p = schedule.LinearRampupExponentialDecay.Params().Set(
    warmup=10, decay_start=20, decay_end=30, min=0.01
  )
  got = _Values(p, [0, 5, 10, 20, 25, 30, 100])
  np.testing.assert_allclose(
    got, [0, 0.5, 1, 1, 0.1, 0.01, 0.01], rtol=1e-5, atol=1e-7
  )


def testValidationErrors():
  with pytest.raises(ValueError, match='values'):
    schedule.PiecewiseConstantSchedule.Params().Set(
      boundaries=[1], values=[1.0]
    ).Instantiate()
  with pytest.raises(ValueError, match='increasing'):
    schedule.PiecewiseConstantSchedule.Params().Set(
      boundaries=[5, 1], values=[1.0, 2.0, 3.0]
    ).Instantiate()
  with pytest.raises(ValueError, match='total_steps'):
    schedule.CosineSchedule.Params().Instantiate()
  with pytest.raises(ValueError, match='x0 < x1'):
    schedule.LinearSchedule.Params().Set(
      start=(5, 1.0), limit=(5, 0.0)
    ).Instantiate()
  with pytest.raises(ValueError, match='needs the step'):
    schedule.SqrtDecay.Params().Instantiate().Value(None)


def testParamsFrozen():
  s = schedule.Constant.Params().Instantiate()
  with pytest.raises(TypeError, match='frozen'):
    s.params.value = 2.0
