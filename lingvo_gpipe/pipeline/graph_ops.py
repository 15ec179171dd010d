"""Graph-building helpers of the pipeline schedule.

Ordering (`After`), copies the graph optimizer cannot merge (`FreshCopies`),
timestamps that do not serialize the cells (`Stamp`), and the gradient sum
that adds each micro-batch's gradient as soon as it is ready
(`SumGradients`), and every node of a traced graph (`NodeDefs`).
"""

import contextlib

import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import py_utils

__all__ = [
  'SumGradients',
  'AddTo',
  'DeviceOf',
  'After',
  'FreshCopies',
  'Stamp',
  'Opaque',
  'NodeDefs',
  'RuntimeZero',
  'Zeros',
]


def SumGradients(parts):
  """The sum of a list of gradients (None for None)."""
  if parts is None:
    return None
  if len(parts) == 1:
    return parts[0]
  if tf.executing_eagerly() or _tf_internal.InXlaContext():
    # XLA orders the computation itself.
    return tf.add_n(parts)
  total = parts[0]
  for part in parts[1:]:
    total = AddTo(total, part)
  return total


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


def AddTo(total, part):
  """total + part, added in place into `total`'s buffer where the graph
  allows: one link of a running sum."""
  if tf.executing_eagerly() or _tf_internal.InXlaContext():
    return total + part
  # A chain of such adds adds each micro-batch's gradient as soon as it is
  # ready (in place: the running sum's buffer is reused). TensorFlow's graph
  # optimizer would rewrite a bare chain into one AddN, which waits for and
  # keeps the gradients of all micro-batches at once; a Snapshot after each
  # add (a no-op that passes its input's buffer on) keeps the adds apart.
  # AccumulateNV2, which also adds as inputs arrive, is rewritten into a
  # temporary variable initialized from zeros that constant folding turns
  # into constants of every weight's shape, held for as long as the function
  # lives: one more copy of the weights on every device.
  return tf.raw_ops.Snapshot(input=tf.add(total, part))


def Opaque(structure):
  """The tensors of `structure` as values the graph optimizer cannot fold
  into constants (PlaceholderWithDefault: an identity it must not look
  through).

  The pipeline passes its inputs, output gradients and seeds through it:
  where a step's inputs are constants (a benchmark's generated batch, a
  test's fixed one), each micro-batch's slice would otherwise be a distinct
  constant, and the optimizer would specialize (copy and optimize) the
  cell's function once per call instead of once.
  """
  if tf.executing_eagerly() or _tf_internal.InXlaContext():
    return structure

  def Wrap(t):
    if not py_utils.IsTensor(t):
      return t
    return tf.raw_ops.PlaceholderWithDefault(input=t, shape=t.shape)

  return tf.nest.map_structure(Wrap, structure)


def RuntimeZero(tensors):
  """A scalar zero computed from the first float tensor of `tensors` when
  the step runs (None if there is none): put the weights first, which are
  read from variables; a tensor computed from constants is folded too.

  Zeros made from constants alone (tf.zeros, tf.fill of a constant, even
  tf.zeros_like of a tensor of known shape) are folded into a constant
  when TensorFlow instantiates the step, and a constant stays allocated
  between steps: one more copy of every running sum and loop state. Passed
  to a function call, it also makes the graph optimizer specialize (copy
  and optimize again) the function for that call. multiply_no_nan gives 0
  even for an inf or NaN.
  """
  for t in tf.nest.flatten(tensors):
    if py_utils.IsTensor(t) and t.dtype.is_floating:
      first = tf.reshape(t, [-1])[:1]
      return tf.reduce_sum(tf.math.multiply_no_nan(first, tf.zeros_like(first)))
  return None


def Zeros(spec, zero):
  """Zeros of `spec` (a TensorSpec or a tensor of known shape), from the
  runtime scalar `zero` (`RuntimeZero`; None: constant zeros)."""
  if zero is None:
    return tf.zeros(spec.shape, spec.dtype)
  return tf.fill(spec.shape, tf.cast(zero, spec.dtype))


def NodeDefs(graph):
  """Every NodeDef of `graph` and of the functions it calls (those of its
  function library), as one list."""
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node)
  for fn in graph_def.library.function:
    nodes += fn.node_def
  return nodes
