"""Graph-building helpers of the pipeline schedule.

Ordering (`After`), copies the graph optimizer cannot merge (`FreshCopies`),
timestamps that do not serialize the cells (`Stamp`), and the gradient sum
that adds each micro-batch's gradient as soon as it is ready
(`SumGradients`).
"""

import contextlib
import os
import secrets

import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import py_utils

__all__ = ['SumGradients', 'DeviceOf', 'After', 'FreshCopies', 'Stamp']


def SumGradients(parts):
  """The sum of a list of gradients (None for None)."""
  if parts is None:
    return None
  if len(parts) == 1:
    return parts[0]
  if tf.executing_eagerly() or _tf_internal.InXlaContext():
    # XLA has no AccumulateNV2 kernel; it schedules the adds itself.
    return tf.add_n(parts)
  # Not a chain of adds: TensorFlow's graph optimizer rewrites that into one
  # AddN, which keeps the gradients of all micro-batches alive at once.
  # AccumulateNV2 adds each as soon as it is ready.
  return tf.raw_ops.AccumulateNV2(
    inputs=parts, shape=parts[0].shape, name=_ACCUMULATOR_NAME
  )


# AccumulateNV2 keeps its running sum in a temporary variable named after the
# op, in a per-step container on the op's device. A step aborted by a lost
# worker leaves that container behind on the surviving workers; a name unique
# to this process keeps the next trainer process (same graph, same step ids)
# from colliding with it.
_ACCUMULATOR_NAME = f'AccumulateGrads_{os.getpid()}_{secrets.token_hex(4)}'


def DeviceOf(structure):
  """A device scope for the first tensor of `structure` that has a device."""
  for t in tf.nest.flatten(structure):
    device = getattr(t, 'device', '') if py_utils.IsTensor(t) else ''
    if device:
      return tf.device(device)
  return contextlib.nullcontext()


def After(x, deps):
  """`x` (a structure) with control dependencies on the tensors of `deps`."""
  dep_tensors = [t for t in tf.nest.flatten(deps) if py_utils.IsTensor(t)]
  if not dep_tensors or tf.executing_eagerly():
    return x
  with tf.control_dependencies(dep_tensors):
    return tf.nest.map_structure(
      lambda t: tf.identity(t) if py_utils.IsTensor(t) else t, x
    )


def FreshCopies(x, deps):
  """Copies of the tensors of `x` that run after `deps` and that graph
  optimizations cannot merge with other ops (DeepCopy is stateful). Under
  XLA (no DeepCopy kernel), identities after `deps`."""
  if tf.executing_eagerly():
    return x
  if _tf_internal.InXlaContext():
    return After(x, deps)
  dep_tensors = [t for t in tf.nest.flatten(deps) if py_utils.IsTensor(t)]

  def Copy(t):
    if not py_utils.IsTensor(t):
      return t
    with tf.control_dependencies(dep_tensors):
      c = tf.raw_ops.DeepCopy(x=t)
    _tf_internal.RunIndependently(c.op)
    return c

  return tf.nest.map_structure(Copy, x)


def Stamp(x):
  """Returns (timestamp taken when `x` is ready, `x` ordered after it)."""
  tensors = [t for t in tf.nest.flatten(x) if py_utils.IsTensor(t)]
  with tf.control_dependencies(tensors):
    stamp = tf.timestamp()
  # tf.function orders stateful ops (like Timestamp) in program order, which
  # would serialize the cells; a timestamp has no side effect to order.
  _tf_internal.RunIndependently(stamp.op)
  return stamp, After(x, [stamp])
