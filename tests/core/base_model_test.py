"""Tests for BaseTask, SingleTaskModel and the metrics aggregator."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import base_model
from lingvo_gpipe.core import learner
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.input import digits
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import normalizations
from lingvo_gpipe.pipeline import pipelining_layer


class _RegressionTask(base_model.BaseTask):
  """y ~ fc(x); reports the step seed and the eval mode as metrics."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 3, 'Input dim.')
    p.Define(
      'fc', linears.FCLayer.Params().Set(activation='NONE'), 'The projection.'
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateChild('fc', p.fc.Copy().Set(input_dim=p.dim, output_dim=1))

  def ComputePredictions(self, theta, input_batch):
    return self.fc.FProp(theta.fc, input_batch.x)[:, 0]

  def ComputeLoss(self, theta, predictions, input_batch):
    n = tf.cast(tf.shape(predictions)[0], tf.float32)
    err = predictions - input_batch.y
    metrics = NestedMap(
      loss=(tf.reduce_mean(tf.square(err)), n),
      seed=(tf.cast(py_utils.CurrentStepSeed(), tf.float32), 1.0),
      is_eval=(tf.constant(float(self.do_eval)), 1.0),
    )
    return metrics, NestedMap(err=err)


def _Batch(n=8, dim=3, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(n, dim).astype(np.float32)
  y = x @ np.array([1.0, -2.0, 0.5][:dim], np.float32) + 0.3
  return NestedMap(x=tf.constant(x), y=tf.constant(y))


def _Model(**train):
  tp = _RegressionTask.Params().Set(name='reg', random_seed=1)
  tp.train.learning_rate = 0.05
  tp.train.optimizer = optimizer.SGD.Params()
  tp.train.Set(**train)
  return base_model.SingleTaskModel.Params(tp).Instantiate()


def testTrainStepLearnsAndCountsSteps():
  model = _Model()
  task = model.GetTask()
  batch = _Batch()
  step = tf.function(task.TrainStep)
  losses = []
  for i in range(30):
    out = step(batch)
    assert float(out.seed) == i  # StepSeed(global_step) inside the step.
    losses.append(float(out.loss))
  assert losses[-1] < 0.1 * losses[0]
  assert int(model.global_step.numpy()) == 30
  assert model.global_step is task.global_step
  assert {
    'loss',
    'seed',
    'is_eval',
    'learning_rate',
    'grad_norm',
    'var_norm',
    'grad_scale',
    'has_nan_or_inf',
  } <= set(out)
  assert float(out.is_eval) == 0.0
  assert all(v.dtype == tf.float32 and v.shape.rank == 0 for v in out.values())


def testVariablesByNameAndSlots():
  model = _Model(optimizer=optimizer.Adam.Params())
  names = sorted(model.VariablesByName())
  assert names == [
    'Adam/iterations',
    'global_step',
    'reg/fc/b',
    'reg/fc/b/m',
    'reg/fc/b/v',
    'reg/fc/w',
    'reg/fc/w/m',
    'reg/fc/w/v',
  ]
  gs = model.VariablesByName()['global_step']
  assert gs.dtype == tf.int64 and not gs.trainable
  for name, v in model.VariablesByName().items():
    assert v.name.split(':')[0] == name


def testEvalStepChangesNothing():
  model = _Model()
  task = model.GetTask()
  before = {k: v.numpy().copy() for k, v in model.VariablesByName().items()}
  metrics = tf.function(task.EvalStep)(_Batch())
  for k, (value, weight) in metrics.items():
    assert value.shape.rank == 0 and weight.shape.rank == 0, k
  assert float(metrics.is_eval[0]) == 1.0
  assert float(metrics.loss[1]) == 8.0
  for k, v in model.VariablesByName().items():
    np.testing.assert_array_equal(v.numpy(), before[k])
  preds = task.Decode(_Batch())
  assert preds.shape == (8,)


def testLearnerFromLegacyOrExplicitParams():
  model = _Model(learning_rate=0.25)
  lrn = model.GetTask().learner
  assert lrn.params.learning_rate == 0.25
  assert isinstance(lrn.optimizer, optimizer.SGD)
  explicit = learner.Learner.Params().Set(
    learning_rate=0.5, optimizer=optimizer.Momentum.Params()
  )
  model = _Model(learner=explicit)
  lrn = model.GetTask().learner
  assert lrn.params.learning_rate == 0.5
  assert isinstance(lrn.optimizer, optimizer.Momentum)
  assert 'reg/fc/w/momentum' in model.VariablesByName()


def testWeightDecaySkipsLayersWithSkipLpRegularization():
  out = _Model(l2_regularizer_weight=1.0).GetTask().TrainStep(_Batch())
  assert float(out.l2_loss) > 0
  tp = _RegressionTask.Params().Set(name='reg')
  tp.fc.skip_lp_regularization = True
  tp.train.Set(learning_rate=0.1, l2_regularizer_weight=1.0)
  model = base_model.SingleTaskModel.Params(tp).Instantiate()
  out = model.GetTask().TrainStep(_Batch())
  assert float(out.l2_loss) == 0.0


class _BatchNormTask(base_model.BaseTask):
  """A pipeline of one batch-norm layer split into 2 micro-batches."""

  def __init__(self, params):
    super().__init__(params)
    bn = normalizations.BatchNormLayer.Params().Set(name='bn', dim=2, decay=0.5)
    self.CreateChild(
      'net',
      pipelining_layer.PipeliningLayer.Params().Set(
        layers=[bn], num_stages=1, num_micro_batches=2
      ),
    )

  def ComputePredictions(self, theta, input_batch):
    return self.net.FProp(theta.net, input_batch.x)

  def ComputeLoss(self, theta, predictions, input_batch):
    loss = tf.reduce_mean(predictions * tf.constant([1.0, -1.0]))
    return NestedMap(loss=(loss, 1.0)), NestedMap()


def testBatchNormMovingAveragesUpdatedOncePerStep():
  p = _BatchNormTask.Params().Set(name='bnt')
  p.train.learning_rate = 0.1
  model = base_model.SingleTaskModel.Params(p).Instantiate()
  x = np.random.RandomState(0).randn(8, 2).astype(np.float32) * 3 + 1
  tf.function(model.GetTask().TrainStep)(NestedMap(x=tf.constant(x)))
  variables = model.VariablesByName()
  np.testing.assert_allclose(
    variables['bnt/net/bn/moving_mean'].numpy(), 0.5 * x.mean(0), rtol=1e-5
  )
  np.testing.assert_allclose(
    variables['bnt/net/bn/moving_variance'].numpy(),
    0.5 + 0.5 * x.var(0),
    rtol=1e-5,
  )


class _NoLossTask(_RegressionTask):
  def ComputeLoss(self, theta, predictions, input_batch):
    metrics, per_example = super().ComputeLoss(theta, predictions, input_batch)
    del metrics.loss
    return metrics, per_example


def testErrors():
  task = _NoLossTask.Params().Set(name='x').Instantiate()
  with pytest.raises(ValueError, match="without 'loss'"):
    task.TrainStep(_Batch())
  with pytest.raises(ValueError, match='p.task is None'):
    base_model.SingleTaskModel.Params().Set(name='m').Instantiate()
  with pytest.raises(ValueError, match='task.name'):
    base_model.SingleTaskModel.Params(_RegressionTask.Params()).Instantiate()


def testInputChildAndAbstractBuild():
  tp = _RegressionTask.Params().Set(name='reg')
  tp.input = digits.DigitsInput.Params().Set(batch_size=4)
  mp = base_model.SingleTaskModel.Params(tp)
  assert mp.input is tp.input
  model = mp.Instantiate()
  gen = model.GetTask().input_generator
  assert isinstance(gen, digits.DigitsInput)
  assert gen.path == 'reg/input'
  # p.input of the model replaces the task's.
  mp.input = digits.DigitsInput.Params().Set(batch_size=6, split='dev')
  model = mp.Instantiate()
  assert model.GetTask().input_generator.params.batch_size == 6
  # Counting builds no input, no global step and no slots.
  assert base_layer.CountParams(mp) == 3 + 1
  with base_layer.AbstractBuild():
    abstract = mp.Instantiate()
  assert abstract.global_step is None
  assert abstract.GetTask().input_generator is None
  assert sorted(abstract.VariablesByName()) == ['reg/fc/b', 'reg/fc/w']


def testMetricsAggregator():
  agg = base_model.MetricsAggregator()
  agg.Update(
    NestedMap(loss=(tf.constant(1.0), tf.constant(3.0)), accuracy=(0.5, 3.0))
  )
  agg.Update({'loss': (2.0, 1.0), 'accuracy': (1.0, 1.0)})
  result = agg.Result()
  assert result['loss'] == pytest.approx(1.25)
  assert result['accuracy'] == pytest.approx(0.625)
  assert agg.TotalWeight('loss') == 4.0
  metric = base_model.AverageMetric()
  assert metric.value == 0.0
  with pytest.raises(ValueError, match='weight'):
    metric.Update(1.0, -1.0)
