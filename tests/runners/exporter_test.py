"""Tests of the SavedModel exporter: export, load, same predictions."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.runners import exporter

MODEL = 'image.digits.MlpDigitsTiny'


@pytest.fixture(scope='module')
def model():
  m = model_registry.GetParams(MODEL, 'Test').Instantiate()
  train = model_registry.GetParams(MODEL, 'Train').Instantiate()
  # A few steps so the weights are not the initial ones.
  task = train.GetTask()
  step = tf.function(task.TrainStep, autograph=False)
  it = iter(task.input_generator.GetDataset())
  for _ in range(3):
    step(next(it))
  for name, v in m.VariablesByName().items():
    v.assign(train.VariablesByName()[name])
  return m


def _Batch(m):
  return next(iter(m.GetTask().input_generator.GetDataset()))


def testExportLoadSamePredictions(model, tmp_path):
  task = model.GetTask()
  export_dir = str(tmp_path / 'export')
  names = exporter.ExportSavedModel(
    task, export_dir, variables=model.VariablesByName()
  )
  assert names == ['image']  # Labels and weights are not inputs.
  batch = _Batch(model)
  with py_utils.EvalMode():
    expected = task.ComputePredictions(task.theta, batch).logits.numpy()
  loaded = tf.saved_model.load(export_dir)
  out = loaded.signatures['serving_default'](image=batch.image)
  np.testing.assert_allclose(
    out['logits'].numpy(), expected, rtol=1e-5, atol=1e-6
  )
  # Another batch size (a multiple of the 4 micro-batches); the tf.function
  # is saved too.
  out = loaded.predict(batch.image[:8])
  np.testing.assert_allclose(
    out['logits'].numpy(), expected[:8], rtol=1e-5, atol=1e-6
  )
  # The SavedModel holds the weights: changing the model does not change it.
  for v in model.VariablesByName().values():
    if v.dtype.is_floating:
      v.assign(v + 1.0)
  out = loaded.signatures['serving_default'](image=batch.image)
  np.testing.assert_allclose(
    out['logits'].numpy(), expected, rtol=1e-5, atol=1e-6
  )
  for v in model.VariablesByName().values():
    if v.dtype.is_floating:
      v.assign(v - 1.0)


def testExplicitInputKeysAndErrors(model, tmp_path):
  task = model.GetTask()
  names = exporter.ExportSavedModel(
    task, str(tmp_path / 'e'), input_keys=['image', 'label']
  )
  assert names == ['image', 'label']
  with pytest.raises(ValueError, match=r"input_keys \['nope'\]"):
    exporter.ExportSavedModel(task, str(tmp_path / 'f'), input_keys=['nope'])
  assert exporter.SignatureName('a.b[0]') == 'a__b_0'
