"""Graph-building helpers of the pipeline and its cells' functions.

Ordering (`After`), copies the graph optimizer cannot merge (`FreshCopies`),
timestamps that do not serialize the cells (`Stamp`), and the gradient sum
that adds each micro-batch's gradient as soon as it is ready
(`SumGradients`), zeros made when the step runs (`RuntimeZero`), the
layer-by-layer order of a cell's backward pass (`BackwardOrder`), and the
ops a block of code built (`OpsMade`).
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
  'RuntimeZero',
  'Zeros',
  'BackwardOrder',
  'OpsMade',
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


@contextlib.contextmanager
def OpsMade(graph=None):
  """`with OpsMade() as made:` ... after the block, the list `made` holds
  the ops built into `graph` (default: the default graph) inside it, in
  the order they were built."""
  graph = graph or tf.compat.v1.get_default_graph()
  start = len(graph.get_operations())
  made = []
  try:
    yield made
  finally:
    made.extend(graph.get_operations()[start:])


class BackwardOrder:
  """Makes the backward pass of each layer of a cell wait for that of the
  layer above it, in a gradient that one `tf.GradientTape` builds over the
  cell's layers inline.

  In such a gradient the executor may run the backward ops of every layer
  in any order their inputs allow: a weight gradient of a layer high in the
  cell can wait until the layers below have started, and the activations it
  reads stay alive meanwhile. Here every gradient op that reads activations
  of layer i-1 (tensors made inside it, not its outputs) waits for every
  gradient op that reads activations of layer i. Only control edges are
  added: the same ops compute the same values. If the layers pass tensors
  to each other other than through their outputs and the edges would close
  a cycle, none is added.

  Use: run the cell's layers through `FProp` (the cell's `fprop` hook),
  call `Start()` before `tape.gradient` and `Apply()` after it.
  """

  def __init__(self):
    self._graph = tf.compat.v1.get_default_graph()
    self._inner = []  # Per layer: names of the tensors made inside it.
    self._forward = set()  # Names of the ops the layers made.
    self._start = None

  def FProp(self, layer, theta, args):
    """Runs `layer` on `args`, noting the ops it makes."""
    with OpsMade(self._graph) as made:
      out = layer.FProp(theta, *args)
    self._forward.update(op.name for op in made)
    returned = {
      t.name for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)
    }
    self._inner.append({t.name for op in made for t in op.outputs} - returned)
    return out

  def Start(self):
    """Marks where the gradient's ops begin."""
    self._start = len(self._graph.get_operations())

  def Apply(self):
    """Adds the control edges; returns how many ops now wait."""
    if self._start is None or len(self._inner) < 2:
      return 0
    owner = {}
    for i, names in enumerate(self._inner):
      for name in names:
        owner[name] = i
    ops = self._graph.get_operations()[self._start :]
    readers = [[] for _ in self._inner]
    for op in ops:
      if op.name in self._forward:
        continue
      for i in {owner[t.name] for t in op.inputs if t.name in owner}:
        readers[i].append(op)
    added, barriers = [], []
    with tf.control_dependencies(None):
      for i in range(len(readers) - 1, 0, -1):
        if not readers[i] or not readers[i - 1]:
          continue
        with tf.control_dependencies(readers[i]):
          barrier = tf.no_op(name='backward_order')
        barriers.append(barrier)
        for op in readers[i - 1]:
          _tf_internal.AddControlInputs(op, [barrier])
          added.append((op, barrier))
    if _HasCycle(ops + barriers):
      for op, barrier in added:
        _tf_internal.RemoveControlInputs(op, [barrier])
      return 0
    return len(added)


def _HasCycle(ops):
  """Whether the edges among `ops` (data and control) close a cycle."""
  names = {op.name for op in ops}
  preds = {
    op.name: {
      p.name
      for p in [t.op for t in op.inputs] + list(op.control_inputs)
      if p.name in names
    }
    for op in ops
  }
  succs = {name: [] for name in names}
  for name, ps in preds.items():
    for p in ps:
      succs[p].append(name)
  waiting = {name: len(ps) for name, ps in preds.items()}
  ready = [name for name, n in waiting.items() if n == 0]
  seen = 0
  while ready:
    name = ready.pop()
    seen += 1
    for s in succs[name]:
      waiting[s] -= 1
      if waiting[s] == 0:
        ready.append(s)
  return seen < len(names)
