"""Tests for ClassifierTask on the digits with a pipelined MLP."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.input import digits
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import reshape
from lingvo_gpipe.models import classifier
from lingvo_gpipe.pipeline import pipelining_layer


def _TaskParams(num_stages=2, batch_norm=False, num_classes=10, hidden=32):
  layers = [reshape.FlattenLayer.Params().Set(name='flatten')]
  in_dim = 64
  for i in range(2):
    layers.append(
      linears.ProjectionLayer.Params().Set(
        name=f'fc{i}',
        input_dim=in_dim,
        output_dim=hidden,
        batch_norm=batch_norm,
      )
    )
    in_dim = hidden
  p = classifier.ClassifierTask.Params().Set(
    name='cls', num_classes=num_classes, random_seed=3
  )
  p.network = pipelining_layer.PipeliningLayer.Params().Set(
    name='network', layers=layers, num_stages=num_stages, num_micro_batches=4
  )
  p.softmax.input_dim = hidden
  p.train.Set(learning_rate=0.01, optimizer=optimizer.Adam.Params())
  return p


def _Batch(split='train', n=64):
  images, labels = digits.LoadSplit(split)
  return NestedMap(image=tf.constant(images[:n]), label=tf.constant(labels[:n]))


def testRegisteredModelLearnsTheDigits():
  p = model_registry.GetParams('image.digits.MlpDigitsTiny', 'Train')
  model = p.Instantiate()
  task = model.GetTask()
  assert task.network.num_stages == 2
  dev = _Batch('dev')
  eval_step = tf.function(task.EvalStep)
  before = float(eval_step(dev).loss[0])
  train_step = tf.function(task.TrainStep)
  gen = task.input_generator
  for _ in range(60):
    out = train_step(gen.GetPreprocessedInputBatch())
  after = eval_step(dev)
  assert float(after.loss[0]) < 0.6 * before
  assert float(after.accuracy[0]) > 0.5
  assert int(model.global_step.numpy()) == 60
  assert {'loss', 'accuracy', 'acc5', 'learning_rate', 'grad_norm'} <= set(out)


def _LossAndGrads(task, batch):
  variables = {k: v for k, v in task.VariablesByName().items() if v.trainable}
  with py_utils.StepSeed(0), tf.GradientTape() as tape:
    metrics, _ = task.FPropDefaultTheta(batch)
  grads = tape.gradient(metrics.loss[0], list(variables.values()))
  return float(metrics.loss[0]), dict(zip(variables, grads))


@pytest.mark.parametrize('batch_norm', [False, True])
def testOneVsTwoStagesSameLossAndGrads(batch_norm):
  batch = _Batch()
  one = _TaskParams(num_stages=1, batch_norm=batch_norm).Instantiate()
  two = _TaskParams(num_stages=2, batch_norm=batch_norm).Instantiate()
  assert one.network.num_stages == 1 and two.network.num_stages == 2
  loss1, grads1 = _LossAndGrads(one, batch)
  loss2, grads2 = _LossAndGrads(two, batch)
  assert sorted(grads1) == sorted(grads2)
  np.testing.assert_allclose(loss1, loss2, rtol=1e-6)
  for name, g in grads1.items():
    assert g is not None, name
    np.testing.assert_allclose(
      g.numpy(), grads2[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name
    )
  out1, out2 = one.TrainStep(batch), two.TrainStep(batch)
  np.testing.assert_allclose(float(out1.loss), float(out2.loss), rtol=1e-6)
  v2 = two.VariablesByName()
  for name, v in one.VariablesByName().items():
    np.testing.assert_allclose(
      v.numpy(), v2[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name
    )


@pytest.mark.parametrize('batch_norm', [False, True])
def testOneFOneBTrainsThroughTheLossOnTheLastCell(batch_norm):
  """Schedule '1f1b': the softmax and loss run on the last cell per
  micro-batch (FPropWithLoss, the softmax's weights handed to the pipeline);
  loss, gradients (the softmax's included) and the update are those of
  'gpipe'."""
  batch = _Batch()
  batch.weight = tf.constant(np.linspace(0.5, 1.5, 64), tf.float32)
  tasks = {}
  for schedule in ('gpipe', '1f1b'):
    p = _TaskParams(batch_norm=batch_norm)
    p.label_smoothing = 0.1
    p.network.schedule = schedule
    tasks[schedule] = p.Instantiate()
  assert tasks['1f1b']._LossOnLastCell()
  assert not tasks['gpipe']._LossOnLastCell()
  loss_g, grads_g = _LossAndGrads(tasks['gpipe'], batch)
  loss_1, grads_1 = _LossAndGrads(tasks['1f1b'], batch)
  np.testing.assert_allclose(loss_1, loss_g, rtol=1e-6)
  assert sorted(grads_1) == sorted(grads_g)
  assert any('softmax' in name for name in grads_1)
  for name, g in grads_g.items():
    assert grads_1[name] is not None, name
    np.testing.assert_allclose(
      grads_1[name].numpy(), g.numpy(), rtol=1e-5, atol=1e-6, err_msg=name
    )
  out_g = tasks['gpipe'].TrainStep(batch)
  out_1 = tasks['1f1b'].TrainStep(batch)
  for key in ('loss', 'accuracy', 'log_pplx'):
    np.testing.assert_allclose(
      float(out_1[key]), float(out_g[key]), rtol=1e-6, err_msg=key
    )
  after_g = tasks['gpipe'].VariablesByName()
  for name, v in tasks['1f1b'].VariablesByName().items():
    np.testing.assert_allclose(
      v.numpy(), after_g[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name
    )


def testMetricsHonorEvalWeights():
  task = _TaskParams().Instantiate()
  full = _Batch(n=64)
  weighted = NestedMap(full, weight=tf.constant([1.0] * 32 + [0.0] * 32))
  half = NestedMap(image=full.image[:32], label=full.label[:32])
  a, b = task.EvalStep(weighted), task.EvalStep(half)
  assert sorted(a) == [
    'acc5',
    'accuracy',
    'error',
    'error5',
    'log_pplx',
    'loss',
    'num_preds',
  ]
  for k in a:
    np.testing.assert_allclose(
      float(a[k][0]), float(b[k][0]), rtol=1e-5, err_msg=k
    )
    np.testing.assert_allclose(float(a[k][1]), float(b[k][1]), err_msg=k)
  assert float(a.loss[1]) == 32.0


def testPerExampleOutputsAndLabelSmoothing():
  p = _TaskParams()
  p.label_smoothing = 0.1
  task = p.Instantiate()
  batch = _Batch(n=16)
  preds = task.ComputePredictions(task.theta, batch)
  assert preds.logits.shape == (16, 10)
  metrics, per_example = task.ComputeLoss(task.theta, preds, batch)
  assert per_example.loss.shape == (16,)
  assert per_example.argmax.dtype == tf.int32
  assert float(metrics.loss[0]) > float(metrics.log_pplx[0])
  np.testing.assert_allclose(
    float(metrics.loss[0]), float(tf.reduce_mean(per_example.loss)), rtol=1e-6
  )


def testNoTop5BelowFiveClasses():
  task = _TaskParams(num_classes=3).Instantiate()
  batch = NestedMap(
    image=tf.zeros([8, 8, 8, 1]), label=tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
  )
  assert 'acc5' not in task.EvalStep(batch)


def testErrors():
  p = _TaskParams()
  with pytest.raises(ValueError, match='p.network is None'):
    p.Copy().Set(network=None).Instantiate()
  bad = p.Copy()
  bad.softmax.input_dim = 0
  with pytest.raises(ValueError, match='softmax.input_dim'):
    bad.Instantiate()
  bad = p.Copy()
  bad.softmax.num_classes = 7
  with pytest.raises(ValueError, match='num_classes'):
    bad.Instantiate()
  no_flatten = p.Copy()
  no_flatten.network = linears.ProjectionLayer.Params().Set(
    name='net', input_dim=1, output_dim=32
  )
  task = no_flatten.Instantiate()
  with pytest.raises(ValueError, match='FlattenLayer'):
    task.ComputePredictions(task.theta, _Batch(n=4))
  with pytest.raises(KeyError, match='input_key'):
    task.ComputePredictions(task.theta, NestedMap(data=tf.zeros([4, 1])))


def testFlattenLayer():
  layer = reshape.FlattenLayer.Params().Set(name='f').Instantiate()
  assert layer(tf.zeros([3, 2, 4])).shape == (3, 8)
  meta = reshape.FlattenLayer.FPropMeta(layer.params, [None, 8, 8, 1])
  assert meta.out_shapes[0].as_list() == [None, 64]
  assert meta.flops == 0


def testModelWrapsTaskNames():
  model = base_model.SingleTaskModel.Params(_TaskParams()).Instantiate()
  names = model.VariablesByName()
  assert 'cls/network/fc0/w' in names and 'cls/network/fc0/w/m' in names
  assert not [n for n in names if 'CPU' in n or 'cell' in n]
