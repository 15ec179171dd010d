"""PipelinedModel: Keras fit, evaluate, predict and weights as the model's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.gpipe_layers import keras_model

DEVICES = ['/device:CPU:0', '/device:CPU:1']


@pytest.fixture(autouse=True)
def _NoGlobalSeedAfterwards():
  """keras.utils.set_random_seed sets TensorFlow's global seed, which
  changes the op seeds of later tests in this process: unset it after."""
  yield
  tf.random.set_seed(None)


def _Model(*extra, functional=False):
  keras.utils.set_random_seed(1)
  layers = [
    keras.layers.Dense(8, activation='tanh'),
    *extra,
    keras.layers.Dense(8, activation='relu'),
    keras.layers.Dense(3),
  ]
  if not functional:
    return keras.Sequential([keras.Input((6,)), *layers])
  x = h = keras.Input((6,))
  for layer in layers:
    h = layer(h)
  return keras.Model(x, h)


def _Data(n=16):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 6)).astype(np.float32)
  y = rng.normal(size=(n, 3)).astype(np.float32)
  return x, y


def _Pipelined(model, k, m, **kwargs):
  return keras_model.PipelinedModel(
    model,
    num_stages=k,
    num_micro_batches=m,
    devices=DEVICES[:k],
    seed=3,
    **kwargs,
  )


def _Compile(model):
  model.compile(
    optimizer=keras.optimizers.Adam(0.01), loss='mse', jit_compile=False
  )


@pytest.mark.parametrize(
  'k,m,functional', [(1, 1, False), (1, 4, False), (2, 1, True), (2, 4, False)]
)
def testFitEqualsThePlainModelsFit(k, m, functional):
  x, y = _Data()
  plain = _Model(functional=functional)
  pipelined = _Pipelined(_Model(functional=functional), k, m)
  # The same initial weights, in the same order.
  assert len(pipelined.trainable_variables) == 6
  for a, b in zip(pipelined.trainable_variables, plain.trainable_variables):
    np.testing.assert_array_equal(a, b)
  _Compile(plain)
  _Compile(pipelined)
  kwargs = dict(batch_size=8, epochs=3, shuffle=False, verbose=0)
  ref = plain.fit(x, y, **kwargs).history['loss']
  got = pipelined.fit(x, y, **kwargs).history['loss']
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  assert ref[-1] < ref[0]
  assert len(pipelined.get_weights()) == len(plain.get_weights())
  for a, b in zip(pipelined.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(
    pipelined.evaluate(x, y, verbose=0),
    plain.evaluate(x, y, verbose=0),
    rtol=1e-5,
  )
  # predict's last batch (5 of 21) is not a multiple of M: eval runs it whole.
  x21 = np.concatenate([x, x[:5]])
  np.testing.assert_allclose(
    pipelined.predict(x21, batch_size=8, verbose=0),
    plain.predict(x21, batch_size=8, verbose=0),
    rtol=1e-5,
    atol=1e-6,
  )
  if k == 2:
    kernel = pipelined.pipeline.body[2].vars.kernel
    assert kernel.device.endswith('CPU:1')


def testGradientsEqualTheModels():
  x, _ = _Data(8)
  plain = _Model()
  pipelined = _Pipelined(_Model(), 2, 4)
  grads = []
  for model in (plain, pipelined):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x, training=True) ** 2)
    grads.append(tape.gradient(loss, model.trainable_variables))
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def testWeightsCopiedBothWays(tmp_path):
  x, y = _Data()
  model = _Model(keras.layers.BatchNormalization())
  pipelined = _Pipelined(model, 2, 2)
  assert [w.path for w in pipelined.weights] == [
    f'{w.path.split("/")[-2]}/{w.name}' for w in model.weights
  ]
  _Compile(pipelined)
  pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  # To the Keras model: it now computes what the pipelined model does.
  assert not np.allclose(model.predict(x, verbose=0), pipelined.predict(x))
  pipelined.CopyWeightsTo(model)
  for a, b in zip(model.get_weights(), pipelined.get_weights()):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(
    model.predict(x, verbose=0), pipelined.predict(x, verbose=0), rtol=1e-5
  )
  # From a Keras model; and Keras's own get/set_weights lists match.
  fresh = _Pipelined(_Model(keras.layers.BatchNormalization()), 1, 1)
  fresh.CopyWeightsFrom(model)
  for a, b in zip(fresh.get_weights(), model.get_weights()):
    np.testing.assert_array_equal(a, b)
  other = _Model(keras.layers.BatchNormalization())
  other.set_weights(pipelined.get_weights())
  np.testing.assert_allclose(
    other.predict(x, verbose=0), pipelined.predict(x, verbose=0), rtol=1e-5
  )
  # save_weights / load_weights round trip.
  path = str(tmp_path / 'pipelined.weights.h5')
  pipelined.save_weights(path)
  fresh.load_weights(path)
  for a, b in zip(fresh.get_weights(), pipelined.get_weights()):
    np.testing.assert_array_equal(a, b)


def testTrainingIsHonoured():
  x, _ = _Data(8)
  model = _Model(keras.layers.Dropout(0.5), keras.layers.BatchNormalization())
  pipelined = _Pipelined(model, 2, 2)
  moving_mean = pipelined.pipeline.body[2].vars.moving_mean
  # Evaluation: no dropout, the moving averages, nothing updated.
  want = model(x, training=False)
  np.testing.assert_allclose(pipelined(x), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    pipelined(x, training=False), want, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_array_equal(moving_mean, np.zeros(8))
  # Training: dropout (a new mask each call), batch statistics, updates.
  a = pipelined(x, training=True).numpy()
  b = pipelined(x, training=True).numpy()
  assert not np.allclose(a, b)
  assert not np.allclose(a, want)
  assert np.any(moving_mean.numpy() != 0)
  # The pipeline itself takes training= too.
  np.testing.assert_array_equal(
    pipelined.pipeline(x, training=False), pipelined(x, training=False)
  )
  c = pipelined.pipeline(x, training=True).numpy()
  assert not np.allclose(c, pipelined(x))


def testErrors():
  x = keras.Input((6,))
  branches = keras.layers.Add()([keras.layers.Dense(3)(x), x[:, :3]])
  with pytest.raises(ValueError, match='is not a chain of layers'):
    keras_model.PipelinedModel(keras.Model(x, branches))
  with pytest.raises(ValueError, match='num_stages=0; pass a positive int'):
    _Pipelined(_Model(), 0, 1)
  with pytest.raises(ValueError, match='num_stages=5 is more than the 3'):
    _Pipelined(_Model(), 5, 1)
  with pytest.raises(ValueError, match='input_shape=\\[None, ...\\]'):
    keras_model.PipelinedModel(keras.Sequential([keras.layers.Dense(2)]))
  with pytest.raises(ValueError, match='layers=.* is not a pipeline param'):
    _Pipelined(_Model(), 1, 1, layers=[])
  pipelined = _Pipelined(_Model(), 1, 4)
  _Compile(pipelined)
  xs, ys = _Data(16)
  with pytest.raises(ValueError, match='batch_size=6 is not a multiple of'):
    pipelined.fit(xs, ys, batch_size=6, verbose=0)
  with pytest.raises(ValueError, match='end in a batch of 2, not a multiple'):
    pipelined.fit(xs[:10], ys[:10], batch_size=8, verbose=0)
  # A dataset's last batch is known when run only.
  ds = tf.data.Dataset.from_tensor_slices((xs[:10], ys[:10])).batch(8)
  with pytest.raises(ValueError, match='batch of 2 examples is not a multiple'):
    pipelined.fit(ds, shuffle=False, verbose=0)
  with pytest.raises(ValueError, match='has 4 layers but'):
    pipelined.CopyWeightsTo(_Model(keras.layers.Dropout(0.1)))


def testSaveAndLoadTheWholeModel(tmp_path):
  x, y = _Data()
  pipelined = _Pipelined(_Model(), 2, 2)
  _Compile(pipelined)
  pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  path = str(tmp_path / 'pipelined.keras')
  pipelined.save(path)
  loaded = keras.models.load_model(path)
  assert isinstance(loaded, keras_model.PipelinedModel)
  assert (loaded.pipeline.num_stages, loaded.num_micro_batches) == (2, 2)
  for a, b in zip(loaded.get_weights(), pipelined.get_weights()):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(
    loaded.evaluate(x, y, verbose=0), pipelined.evaluate(x, y, verbose=0)
  )


def testBatchNormFitEqualsThePlainModelsFitForOneMicroBatch():
  """With M = 1 the batch statistics are the model's, and so are the
  moving averages, updated once per step (with M > 1, per micro-batch
  statistics: GPipe's batch norm)."""
  x, y = _Data()
  plain = _Model(keras.layers.BatchNormalization(momentum=0.5))
  pipelined = _Pipelined(
    _Model(keras.layers.BatchNormalization(momentum=0.5)), 2, 1
  )
  _Compile(plain)
  _Compile(pipelined)
  kwargs = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
  np.testing.assert_allclose(
    pipelined.fit(x, y, **kwargs).history['loss'],
    plain.fit(x, y, **kwargs).history['loss'],
    rtol=1e-5,
  )
  moving_mean = pipelined.pipeline.body[1].vars.moving_mean.numpy()
  assert np.any(moving_mean != 0)
  for a, b in zip(pipelined.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
