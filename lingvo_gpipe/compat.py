"""Lingvo's `lingvo.compat` (`import lingvo_gpipe.compat as tf`).

TensorFlow 2 under Lingvo's import: every name of `tensorflow` (e.g.
`tf.matmul`, `tf.function`), then, for names TF2 dropped from its top level,
`tf.compat.v1`'s (`tf.logging`, `tf.to_float`). The TF1 names of sessions,
graph-mode switches and collections cannot work in eager TF2: calling one
fails with one line saying what to use instead.
"""

import tensorflow as _tf

_INSTEAD = {
  'disable_v2_behavior': 'remove it: layers run eagerly or in tf.function.',
  'enable_v2_behavior': 'remove it: TF2 behavior is on.',
  'disable_eager_execution': 'remove it: wrap a step in tf.function instead.',
  'Session': 'call the layer (layer.FPropDefaultTheta(x)) and read .numpy().',
  'InteractiveSession': 'compute eagerly and read .numpy().',
  'placeholder': 'pass tensors (or tf.TensorSpec to tf.function) instead.',
  'global_variables_initializer': 'remove it: variables start initialized.',
  'get_collection': 'use layer.vars / layer.trainable_variables instead.',
  'add_to_collection': 'keep the values in Python (e.g. a NestedMap).',
  'get_default_graph': 'use tf.function; there is no default graph.',
  'variable_scope': 'name layers by their Params names instead.',
  'get_variable': 'create variables with CreateVariable in a layer.',
}


def _Refused(name, instead):
  def Fn(*unused_args, **unused_kwargs):
    raise RuntimeError(
      f'lingvo_gpipe.compat.{name} is TF1 (sessions, graphs, collections), '
      f'which TF2 eager does not have; {instead}'
    )

  Fn.__name__ = name
  return Fn


def __getattr__(name):
  if name in _INSTEAD:
    return _Refused(name, _INSTEAD[name])
  if hasattr(_tf, name):
    return getattr(_tf, name)
  if hasattr(_tf.compat.v1, name):
    return getattr(_tf.compat.v1, name)
  raise AttributeError(
    f'lingvo_gpipe.compat (TensorFlow {_tf.__version__}) has no {name!r}.'
  )


def __dir__():
  return sorted(set(dir(_tf)) | set(_INSTEAD))
