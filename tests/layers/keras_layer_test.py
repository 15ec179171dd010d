"""Keras 3 layers in a pipeline: the gradients of the unpipelined model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import keras_layer
from lingvo_gpipe.pipeline import pipelining_layer

DEVICES = ['/device:CPU:0', '/device:CPU:1']


@pytest.fixture(autouse=True)
def _NoGlobalSeedAfterwards():
  """keras.utils.set_random_seed sets TensorFlow's global seed, which
  changes the op seeds of later tests in this process: unset it after."""
  yield
  tf.random.set_seed(None)


def _Model(*extra):
  keras.utils.set_random_seed(1)
  return keras.Sequential(
    [
      keras.Input((8,)),
      keras.layers.Dense(16, activation='relu'),
      *extra,
      keras.layers.Dense(16, activation='tanh'),
      keras.layers.Dense(4),
    ]
  )


def _Pipe(model, num_micro_batches):
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=keras_layer.KerasLayersParams(model, [None, 8]),
      num_stages=2,
      num_micro_batches=num_micro_batches,
      devices=DEVICES,
    )
    .Instantiate()
  )
  for layer, k in zip(pipe.body, model.layers):
    layer.LoadKerasWeights(k)
  return pipe


def _OrderedVars(pipe):
  return [v for layer in pipe.body for v in layer.KerasOrderedVariables()]


@pytest.mark.parametrize('num_micro_batches', [2, 4])
def testGradientsEqualTheKerasModels(num_micro_batches):
  model = _Model()
  pipe = _Pipe(model, num_micro_batches)
  assert len(pipe.CellLayers(0)) + len(pipe.CellLayers(1)) == 3
  x = tf.random.normal([8, 8], seed=2)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(pipe(x) ** 2)
  grads = tape.gradient(loss, [v for v in _OrderedVars(pipe) if v.trainable])
  with tf.GradientTape() as tape:
    ref_loss = tf.reduce_sum(model(x) ** 2)
  ref_grads = tape.gradient(ref_loss, model.trainable_variables)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert len(grads) == len(ref_grads) == 6
  for g, rg in zip(grads, ref_grads):
    np.testing.assert_allclose(g, rg, rtol=1e-4, atol=1e-5)
  # Variables are named by the layer paths, placed on their cells.
  names = sorted(v.name for v in pipe.trainable_variables)
  assert names[:2] == ['pipe/dense_0/bias:0', 'pipe/dense_0/kernel:0']
  assert pipe.body[2].vars.kernel.device.endswith('CPU:1')


def testBatchNormMovingAveragesUpdatedOncePerBatch():
  model = _Model(keras.layers.BatchNormalization(momentum=0.5))
  pipe = _Pipe(model, 2)
  bn = pipe.body[1]
  x = tf.random.normal([8, 8], seed=3)

  @tf.function
  def Train(x):
    with py_utils.UpdateCollector() as updates:
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(pipe(x) ** 2)
      grads = tape.gradient(loss, pipe.trainable_variables)
    updates.Apply()
    return grads

  Train(x)
  # The moving mean: momentum 0.5 toward the mean of the micro-batch means.
  h = model.layers[0](x)
  expected = 0.5 * 0.0 + 0.5 * tf.reduce_mean(h, 0)
  np.testing.assert_allclose(bn.vars.moving_mean, expected, atol=1e-5)
  assert not bn.vars.moving_mean.trainable
  # In eval the moving averages are used, and nothing is updated.
  with py_utils.EvalMode():
    before = bn.vars.moving_mean.numpy()
    pipe(x)
    np.testing.assert_array_equal(bn.vars.moving_mean, before)


def testDropoutMasksFollowTheStepSeed():
  model = _Model(keras.layers.Dropout(0.5))
  pipe = _Pipe(model, 2)
  x = tf.random.normal([8, 8], seed=4)
  drop = pipe.body[1]
  h = tf.ones([4, 16])
  with py_utils.StepSeed(7):
    a = drop.FProp(drop.theta, h)
    b = drop.FProp(drop.theta, h)
  with py_utils.StepSeed(8):
    c = drop.FProp(drop.theta, h)
  np.testing.assert_array_equal(a, b)  # Recomputation draws the same mask.
  assert np.any(a.numpy() != c.numpy())
  assert set(np.unique(a.numpy())) <= {0.0, 2.0}
  with py_utils.EvalMode():
    np.testing.assert_array_equal(drop.FProp(drop.theta, h), h)
  # Trains through the pipeline (recomputation uses the same masks).
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(pipe(x) ** 2)
  grads = tape.gradient(loss, pipe.trainable_variables)
  assert all(np.all(np.isfinite(g)) for g in grads)


def testErrors():
  with pytest.raises(ValueError, match='pass a non-empty list of Keras'):
    keras_layer.KerasLayersParams([], [None, 8])
  with pytest.raises(TypeError, match='Expected a Keras 3 layer'):
    keras_layer.KerasLayersParams([tf.Module()], [None, 8])
  with pytest.raises(ValueError, match='cannot take an input of shape'):
    keras_layer.KerasLayersParams(
      [keras.layers.Dense(4), keras.layers.Reshape((3, 3))], [None, 8]
    )
  with pytest.raises(ValueError, match='keras_config=None'):
    keras_layer.KerasLayer.Params().Set(name='k').Instantiate()
  p = keras_layer.KerasLayersParams([_Model()], [None, 8])[0]
  with pytest.raises(ValueError, match='wraps a Keras model'):
    p.Instantiate()
