"""Exports a task's inference function as a SavedModel.

    exporter.ExportSavedModel(task, '/tmp/export',
                              variables=model.VariablesByName())
    loaded = tf.saved_model.load('/tmp/export')
    out = loaded.signatures['serving_default'](image=images)  # dict of tensors

The exported function runs `task.ComputePredictions(task.theta, batch)` under
`py_utils.EvalMode()` (dropout off, batch norm on its moving averages). Its
signature takes the input tensors the predictions read (by default those of
the task's input generator, batch dimension left free) under their flattened
NestedMap names with '.' replaced by '__'; it returns the predictions the same
way. The SavedModel also holds `predict` (the tf.function) and the variables.
"""

import os

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = ['InputSpec', 'ExportSavedModel', 'SignatureName']

SERVING_KEY = 'serving_default'


def SignatureName(key):
  """A NestedMap key ('a.b' or 'a[0]') as a signature argument name."""
  out = key.replace('.', '__').replace('[', '_').replace(']', '')
  return out if out and not out[0].isdigit() else 'x_' + out


def _ToNestedMap(x):
  if isinstance(x, NestedMap):
    return x
  if isinstance(x, dict):
    return NestedMap({k: _ToNestedMap(v) for k, v in x.items()})
  return x


def InputSpec(input_generator):
  """NestedMap of TensorSpecs of one input batch, batch dimension free."""
  spec = _ToNestedMap(input_generator.GetDataset().element_spec)

  def Free(s):
    shape = s.shape.as_list() if s.shape.rank else []
    if shape:
      shape[0] = None
    return tf.TensorSpec(shape, s.dtype)

  return spec.Transform(Free)


def _Flat(structure):
  """[(key, value)] of a NestedMap/dict/tensor."""
  structure = _ToNestedMap(structure)
  if isinstance(structure, NestedMap):
    return structure.FlattenItems()
  return [('output', structure)]


def _Pack(keys, values):
  batch = NestedMap()
  for key, value in zip(keys, values):
    batch.Set(key, value)
  return batch


def _UsedInputs(fn, keys, specs):
  """The keys whose placeholders the traced predictions consume."""
  concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
  used = []
  placeholders = [t for t in concrete.graph.inputs if t.dtype != tf.resource][
    : len(keys)
  ]
  for key, t in zip(keys, placeholders):
    if t.consumers():
      used.append(key)
  return used


def ExportSavedModel(
  task, export_dir, variables=None, input_spec=None, input_keys=None
):
  """Writes a SavedModel of the task's predictions to `export_dir`.

  Args:
    task: a BaseTask with `ComputePredictions(theta, input_batch)`.
    export_dir: output directory (replaced if it exists).
    variables: {name: tf.Variable} to save (default: the task's).
    input_spec: NestedMap of TensorSpecs of a batch (default: from the
      task's input generator, batch dimension free).
    input_keys: flattened input keys the signature takes (default: those the
      predictions read).

  Returns:
    The signature's argument names, in order.
  """
  if input_spec is None:
    input_spec = InputSpec(task.input_generator)
  items = _Flat(input_spec)
  keys = [k for k, _ in items]
  specs = [s for _, s in items]

  def Predict(*tensors, keys=tuple(keys)):
    with py_utils.EvalMode():
      preds = task.ComputePredictions(task.theta, _Pack(keys, tensors))
    return {
      SignatureName(k): v
      for k, v in _Flat(preds)
      if isinstance(v, (tf.Tensor, tf.Variable))
    }

  if input_keys is None:
    try:
      input_keys = _UsedInputs(Predict, keys, specs)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning(
        'Could not find which inputs the predictions read (%s); '
        'the signature takes them all.',
        e,
      )
      input_keys = keys
  unknown = sorted(set(input_keys) - set(keys))
  if unknown:
    raise ValueError(
      f'input_keys {unknown} are not in the input spec, whose keys are {keys}.'
    )
  chosen = [(k, s) for k, s in items if k in input_keys]
  names = [SignatureName(k) for k, _ in chosen]
  signature = [
    tf.TensorSpec(s.shape, s.dtype, name=n) for n, (_, s) in zip(names, chosen)
  ]
  chosen_keys = tuple(k for k, _ in chosen)
  serve = tf.function(
    lambda *t: Predict(*t, keys=chosen_keys),
    input_signature=signature,
    autograph=False,
  )
  concrete = serve.get_concrete_function()
  if not concrete.structured_outputs:
    raise ValueError(
      f'{type(task).__name__}.ComputePredictions returned no '
      'tensors; it must return a tensor or a NestedMap of '
      'them to be exported.'
    )

  root = tf.Module()
  if variables is None:
    variables = task.VariablesByName()
  root.model_variables = list(variables.values())
  root.predict = serve
  if tf.io.gfile.exists(export_dir):
    tf.io.gfile.rmtree(export_dir)
  tf.io.gfile.makedirs(os.path.dirname(os.path.abspath(export_dir)))
  tf.saved_model.save(root, export_dir, signatures={SERVING_KEY: concrete})
  logging.info(
    'Exported SavedModel to %s: inputs %s, outputs %s.',
    export_dir,
    names,
    sorted(concrete.structured_outputs),
  )
  return names
