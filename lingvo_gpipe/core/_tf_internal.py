"""Every TensorFlow internal the library relies on, in one place.

Each name here is outside TensorFlow's public API; each comes with why it is
needed, and `tests/core/tf_internal_test.py` fails with a clear message if a
TensorFlow upgrade removes or changes it. Nothing else in the library
imports `tensorflow.python`.
"""

import contextlib

import tensorflow as tf

# The gradient-tape recording API that tf.custom_gradient is built on. The
# pipeline records its whole forward schedule as one tape operation; through
# tf.custom_gradient every tensor would pass one device-less IdentityN op,
# dragging a multi-host pipeline's activations through one host.
from tensorflow.python.eager import record as _record

# Per-op statistics ('flops') that TensorFlow registers for its kernels; the
# public profiler only reports them for a whole graph, not per op.
from tensorflow.python.framework import ops as _ops

# Whether the graph being built is compiled by XLA (tf.function(jit_compile=
# True) enters an XLA context): the pipeline's scheduling op DeepCopy has
# no XLA kernel, and XLA orders the computation itself.
from tensorflow.python.ops import control_flow_util as _control_flow_util

# Silences the deprecation notice that TensorFlow's own flop statistics
# print (they call a TF1 shape helper) every time a new graph is counted.
from tensorflow.python.util import deprecation as _deprecation

__all__ = [
  'CouldPossiblyRecord',
  'ShouldRecordBackprop',
  'VariableWatcher',
  'RecordOperation',
  'OpFlops',
  'RunIndependently',
  'TPUDeviceAssignment',
  'TPUDevices',
  'InXlaContext',
  'RecordingOn',
]


def CouldPossiblyRecord():
  """Whether a gradient tape could record an op built now."""
  return _record.could_possibly_record()


def ShouldRecordBackprop(tensors):
  """Whether an active gradient tape watches any of `tensors` (the
  pipeline skips the gradient of inputs that no tape asks for)."""
  return bool(tensors) and _record.should_record_backprop(tensors)


def VariableWatcher():
  """A context that lists the variables read inside it
  (`.watched_variables()`); the pipeline uses it to reject layers that read
  variables directly instead of through theta."""
  return _record.VariableWatcher()


@contextlib.contextmanager
def RecordingOn():
  """Gradient tapes record inside, even where `tf.init_scope` stopped them:
  the XLA check of a compiled pipeline cell traces its backward function
  (which computes gradients with a tape) from inside `tf.init_scope`."""
  stopped = _record.pywrap_tfe.TFE_Py_TapeSetIsStopped()
  if stopped:
    _record.pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
  try:
    yield
  finally:
    if stopped:
      _record.pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def RecordOperation(op_type, outputs, inputs, backward_fn):
  """Records `outputs` = op(`inputs`) on the active tapes, with gradient
  function backward_fn(*output_grads) -> input grads."""
  _record.record_operation(op_type, outputs, inputs, backward_fn)


def OpFlops(graph, node_def):
  """TensorFlow's registered 'flops' statistic of one op (None if unset).

  Raises ValueError or TypeError where the op has no statistic function or
  its shapes are unknown.
  """
  with _deprecation.silence():
    return _ops.get_stats_for_node_def(graph, node_def, 'flops').value


def RunIndependently(op):
  """Exempts a stateful op from tf.function's program-order chaining.

  tf.function makes every stateful op depend on the one built before it
  (automatic control dependencies); the pipeline's fresh copies must instead
  run when their own inputs are ready. The graph's
  `experimental_acd_manager` is the only way to opt one op out.
  """
  acd = getattr(
    tf.compat.v1.get_default_graph(), 'experimental_acd_manager', None
  )
  if acd is not None and not tf.executing_eagerly():
    acd.run_independently(op)


def TPUDeviceAssignment(extended):
  """A TPUStrategy's device assignment (`extended._device_assignment`), or
  None: TPUStrategy has no public count of cores per replica."""
  return getattr(extended, '_device_assignment', None)


def TPUDevices(extended):
  """A TPUStrategy's [replicas, cores] TPU devices (`extended._tpu_devices`),
  which `experimental_assign_to_logical_device` checks core ids against
  (tensorflow/python/distribute/tpu_strategy.py); None if absent."""
  return getattr(extended, '_tpu_devices', None)


def InXlaContext():
  """Whether ops built now are compiled by XLA (tf.function(jit_compile=True)
  or an XLA-compiled TPU computation)."""
  return _control_flow_util.GraphOrParentsInXlaContext(
    tf.compat.v1.get_default_graph()
  )
