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
  for layer, k in zip(pipe.body, keras_layer.KerasChain(model)):
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
  # The wrapped Keras layer holds no copy of the weights: ours.
  inner = pipe.body[2].keras_layer
  assert inner.kernel.value is pipe.body[2].vars.kernel
  assert inner.bias.value is pipe.body[2].vars.bias


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


def testVariablesInKerasOrder():
  model = _Model(keras.layers.BatchNormalization())
  pipe = _Pipe(model, 2)
  pipe(tf.random.normal([8, 8], seed=5))  # Calls add no earlier attribute.
  want = [v.path.split('/', 1)[1] for v in model.trainable_variables]
  got = [
    '/'.join(v.name.split(':')[0].split('/')[1:])
    for v in pipe.trainable_variables
  ]
  # Our layer names are the Keras class and index, the weight names Keras's.
  assert [g.split('/')[1] for g in got] == [w.split('/')[1] for w in want]
  assert got[:4] == [
    'dense_0/kernel',
    'dense_0/bias',
    'batch_normalization_1/gamma',
    'batch_normalization_1/beta',
  ]
  # So the lists zip: the same values, the same gradients.
  for a, b in zip(pipe.trainable_variables, model.trainable_variables):
    np.testing.assert_array_equal(a, b)
  assert [v.name for v in pipe.variables][4:6] == [
    'pipe/batch_normalization_1/moving_mean:0',
    'pipe/batch_normalization_1/moving_variance:0',
  ]


def testTrainingArgument():
  model = _Model(keras.layers.Dropout(0.5))
  pipe = _Pipe(model, 2)
  x = tf.random.normal([8, 8], seed=6)
  with py_utils.EvalMode():
    evaluated = pipe(x)
  np.testing.assert_array_equal(pipe(x, training=False), evaluated)
  np.testing.assert_allclose(evaluated, model(x, training=False), rtol=1e-5)
  assert not np.allclose(pipe(x, training=True), evaluated)
  with py_utils.EvalMode():
    assert not np.allclose(pipe(x, training=True), evaluated)
  # NumPy inputs split into micro-batches like tensors.
  assert _Pipe(model, 2)(x.numpy()).shape == (8, 4)


def testFunctionalChain():
  keras.utils.set_random_seed(1)
  inner = keras.Sequential([keras.layers.Dense(16, activation='tanh')])
  x = keras.Input((8,))
  y = keras.layers.Dense(4)(inner(keras.layers.Dense(16, 'relu')(x)))
  model = keras.Model(x, y)
  assert [type(k).__name__ for k in keras_layer.KerasChain(model)] == [
    'Dense'
  ] * 3
  assert keras_layer.KerasInputShape(model) == [None, 8]
  pipe = _Pipe(model, 2)
  data = tf.random.normal([8, 8], seed=7)
  np.testing.assert_allclose(pipe(data), model(data), rtol=1e-5, atol=1e-6)
  # And back: the Keras model takes the pipeline's weights.
  for v in pipe.trainable_variables:
    v.assign(v * 2.0)
  for layer, k in zip(pipe.body, keras_layer.KerasChain(model)):
    layer.CopyWeightsTo(k)
  np.testing.assert_allclose(pipe(data), model(data), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  'build,message',
  [
    (
      lambda x: keras.layers.Concatenate()(
        [keras.layers.Dense(4)(x), keras.layers.Dense(4)(x)]
      ),
      "layer 'concatenate' takes 2 inputs",
    ),
    (lambda x: keras.ops.relu(keras.layers.Dense(4)(x)), 'not a Keras layer'),
    (
      lambda x: keras.layers.Dropout(0.1)(
        keras.layers.Dense(4)(x), training=True
      ),
      "with arguments \\['training'\\]",
    ),
  ],
)
def testNonChainFunctionalModels(build, message):
  x = keras.Input((8,))
  model = keras.Model(x, build(x))
  with pytest.raises(ValueError, match=message) as e:
    keras_layer.KerasLayersParams(model, [None, 8])
  assert '\n' not in str(e.value)


def testSubclassedModelRefused():
  class Net(keras.Model):
    def call(self, x):
      return x

  with pytest.raises(ValueError, match='subclassed keras.Model'):
    keras_layer.KerasChain(Net())
