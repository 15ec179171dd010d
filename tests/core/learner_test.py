"""Tests for lingvo_gpipe.core.learner: clipping, L2, schedules, filters."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import learner
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import schedule


def _Learner(**kwargs):
  p = learner.Learner.Params().Set(
    learning_rate=1.0, optimizer=optimizer.SGD.Params()
  )
  return p.Set(**kwargs).Instantiate()


def _Var(value, name):
  return tf.Variable(np.asarray(value, np.float32), name=name)


def testGlobalNormClipping():
  a, b = _Var([0.0, 0.0], 'l/a'), _Var([0.0], 'l/c')
  lrn = _Learner(clip_gradient_norm_to_value=1.0)
  lrn.CreateSlots([a, b])
  stats, _ = lrn.Apply(
    None, [(tf.constant([3.0, 0.0]), a), (tf.constant([4.0]), b)], 0
  )
  np.testing.assert_allclose(float(stats.grad_norm), 5.0)
  np.testing.assert_allclose(float(stats.grad_scale), 0.2)
  np.testing.assert_allclose(a.numpy(), [-0.6, 0.0], rtol=1e-6)
  np.testing.assert_allclose(b.numpy(), [-0.8], rtol=1e-6)


def testNoClippingBelowThreshold():
  a = _Var([0.0, 0.0], 'l/a')
  lrn = _Learner(clip_gradient_norm_to_value=10.0)
  lrn.Apply(None, [(tf.constant([3.0, 4.0]), a)], 0)
  np.testing.assert_allclose(a.numpy(), [-3.0, -4.0])


def testSingleNormClipping():
  a, b = _Var([0.0, 0.0], 'l/a'), _Var([0.0], 'l/c')
  lrn = _Learner(clip_gradient_single_norm_to_value=1.0)
  lrn.Apply(None, [(tf.constant([3.0, 4.0]), a), (tf.constant([0.5]), b)], 0)
  np.testing.assert_allclose(a.numpy(), [-0.6, -0.8], rtol=1e-6)
  np.testing.assert_allclose(b.numpy(), [-0.5], rtol=1e-6)


def testBothClippingsRejected():
  with pytest.raises(ValueError, match='set one to 0'):
    _Learner(
      clip_gradient_norm_to_value=1.0, clip_gradient_single_norm_to_value=1.0
    )


def testL2RegularizationSkipsBiasesAndListedVars():
  w = _Var([1.0, 2.0], 'fc/w')
  bias = _Var([3.0], 'fc/b')
  gamma = _Var([1.0], 'bn/gamma')
  other = _Var([4.0], 'emb/table')
  lrn = _Learner(l2_regularizer_weight=0.1)
  lrn.CreateSlots([w, bias, gamma, other], skip_lp_regularization=['emb/table'])
  zeros = [tf.zeros_like(v) for v in (w, bias, gamma, other)]
  stats, _ = lrn.Apply(None, list(zip(zeros, [w, bias, gamma, other])), 0)
  np.testing.assert_allclose(
    float(stats.l2_loss), 0.5 * 0.1 * (1 + 4), rtol=1e-6
  )
  np.testing.assert_allclose(w.numpy(), [0.9, 1.8], rtol=1e-6)
  np.testing.assert_allclose(bias.numpy(), [3.0])
  np.testing.assert_allclose(gamma.numpy(), [1.0])
  np.testing.assert_allclose(other.numpy(), [4.0])


def testL2TermsAreComputedOnTheVariablesDevices():
  # Elsewhere every decayed variable went to the step's device (over worker
  # processes, the driving process) at every step.
  with tf.device('/device:CPU:1'):
    w = _Var([1.0, 2.0], 'a/w')
  with tf.device('/device:CPU:2'):
    v = _Var([3.0], 'b/w')
  lrn = _Learner(l2_regularizer_weight=0.1)
  lrn.CreateSlots([w, v])

  @tf.function
  def Step():
    with tf.device('/device:CPU:3'):
      stats, _ = lrn.Apply(None, [(tf.zeros([2]), w), (tf.zeros([1]), v)], 0)
    return stats.l2_loss

  graph = Step.get_concrete_function().graph
  squares = sorted(
    op.device.split('/')[-1]
    for op in graph.get_operations()
    if op.type == 'Square'
  )
  assert squares == ['device:CPU:1', 'device:CPU:2'], squares


def testNanGradientSkipsStep():
  a = _Var([1.0, 1.0], 'l/a')
  lrn = _Learner()
  stats, _ = lrn.Apply(None, [(tf.constant([np.nan, 1.0]), a)], 0)
  assert float(stats.has_nan_or_inf) == 1.0
  np.testing.assert_allclose(a.numpy(), [1.0, 1.0])


def testGradNormToClipToZero():
  a = _Var([1.0], 'l/a')
  lrn = _Learner(grad_norm_to_clip_to_zero=2.0)
  lrn.Apply(None, [(tf.constant([3.0]), a)], 0)
  np.testing.assert_allclose(a.numpy(), [1.0])
  lrn.Apply(None, [(tf.constant([1.0]), a)], 0)
  np.testing.assert_allclose(a.numpy(), [0.0])


def testLearningRateIsBaseTimesSchedule():
  a = _Var([0.0], 'l/a')
  sched = schedule.PiecewiseConstantSchedule.Params().Set(
    boundaries=[10], values=[1.0, 0.1]
  )
  lrn = _Learner(learning_rate=0.5, lr_schedule=sched)
  stats, _ = lrn.Apply(
    None, [(tf.constant([1.0]), a)], tf.constant(3, tf.int64)
  )
  np.testing.assert_allclose(float(stats.learning_rate), 0.5)
  stats, _ = lrn.Apply(None, [(tf.constant([1.0]), a)], 10)
  np.testing.assert_allclose(float(stats.learning_rate), 0.05, rtol=1e-6)
  np.testing.assert_allclose(a.numpy(), [-0.55], rtol=1e-6)


def testApplyWithTapeAndInFunction():
  w = _Var([1.0, 2.0], 'm/w')
  lrn = _Learner(
    learning_rate=0.1, optimizer=optimizer.Momentum.Params().Set(alpha=0.5)
  )
  lrn.CreateSlots([w])
  assert sorted(lrn.slots()) == ['m/w/momentum']

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(w))
    stats, _ = lrn.Apply(loss, tape, 0)
    return stats

  Step()
  np.testing.assert_allclose(w.numpy(), [0.8, 1.6], rtol=1e-6)


def testVariableFiltersAndMissingGradients():
  a, b, c = _Var([1.0], 'x/a'), _Var([1.0], 'y/b'), _Var([1.0], 'x/c')
  frozen = tf.Variable([1.0], name='x/frozen', trainable=False)
  lrn = _Learner(bprop_variable_filter='^x/', bprop_variable_exclusion='/c$')
  lrn.CreateSlots([a, b, c, frozen])
  assert [v.name.split(':')[0] for v in lrn.variables] == ['x/a']
  one = tf.constant([1.0])
  lrn.Apply(None, [(one, a), (one, b), (one, c), (None, frozen)], 0)
  np.testing.assert_allclose(
    [a.numpy()[0], b.numpy()[0], c.numpy()[0]], [0.0, 1.0, 1.0]
  )
  with pytest.raises(ValueError, match='no variable has a gradient'):
    lrn.Apply(None, [(None, a)], 0)


def testParamsErrors():
  with pytest.raises(ValueError, match='learning_rate'):
    _Learner(learning_rate=-1.0)
  with pytest.raises(TypeError, match='optimizer'):
    _Learner(optimizer='adam')
  lrn = _Learner()
  assert lrn.loss_name == 'loss'
  with pytest.raises(TypeError, match='frozen'):
    lrn.params.learning_rate = 3.0


def _Float16Step(lrn, w, x, loss_factor):
  """One learner step on loss = factor * sum(tanh(x w)) computed in float16."""
  with tf.GradientTape() as tape:
    y = tf.tanh(tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16)))
    loss = tf.cast(tf.reduce_sum(y), tf.float32) * loss_factor
  return lrn.Apply(loss, tape, 0)


def testStaticLossScaleKeepsFloat16GradientsFromUnderflowing():
  x = tf.constant(np.random.RandomState(0).rand(4, 3).astype(np.float32))
  w0 = np.zeros([3, 2], np.float32)  # updates of 1e-8 stay exact
  factor = 1e-8  # float16 gradients below its smallest subnormal (6e-8)
  # The float32 reference gradient of the same loss.
  w32 = tf.Variable(w0)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w32))) * factor
  want = tape.gradient(loss, w32).numpy()
  grads = {}
  for scale in (None, 2.0**15):
    w = _Var(w0, f'ls{scale is None}/w')
    lrn = _Learner(loss_scale=scale)
    lrn.CreateSlots([w])
    stats, _ = _Float16Step(lrn, w, x, factor)
    grads[scale] = w0 - w.numpy()  # SGD with lr 1
    if scale:
      assert float(stats.loss_scale) == scale
  assert not np.any(grads[None])  # underflowed to zero
  np.testing.assert_allclose(grads[2.0**15], want, rtol=2e-2)


def testDynamicLossScaleHalvesOnOverflowAndGrowsWhenFinite():
  x = tf.ones([2, 2])
  w = _Var(np.full([2, 2], 0.5, np.float32), 'dyn/w')
  lrn = _Learner(
    loss_scale='dynamic',
    initial_loss_scale=2.0**20,
    loss_scale_growth_interval=2,
  )
  lrn.CreateSlots([w])
  assert 'loss/loss_scale' in lrn.slots()
  # 2**20 * 10 overflows float16 (max 65504): halve until finite.
  scales, finite = [], []
  for _ in range(12):
    stats, _ = _Float16Step(lrn, w, x, 10.0)
    scales.append(float(stats.loss_scale))
    finite.append(not float(stats.has_nan_or_inf))
  first = finite.index(True)
  assert first > 0 and scales[0] == 2.0**19
  assert not any(finite[:first])
  # After two finite steps in a row the scale doubles; overflowing again, it
  # halves again: it settles at the largest scale that stays finite.
  assert finite[first + 1] and scales[first + 1] == 2 * scales[first]
  assert not finite[first + 2] and scales[first + 2] == scales[first]
  with pytest.raises(ValueError, match='loss_scale = -1'):
    _Learner(loss_scale=-1)
