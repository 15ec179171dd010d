"""Unit tests for lingvo_gpipe.core.graph_ops."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import graph_ops


def _OpsOf(fn, *args):
  return fn.get_concrete_function(*args).graph.get_operations()


def testSumGradientsEagerAndInGraph():
  a, b, c = tf.constant([1.0]), tf.constant([2.0]), tf.constant([4.0])
  assert graph_ops.SumGradients(None) is None
  assert graph_ops.SumGradients([a]) is a
  np.testing.assert_array_equal(graph_ops.SumGradients([a, b, c]), [7.0])

  @tf.function
  def Sum(x, y, z):
    return graph_ops.SumGradients([x, y, z])

  np.testing.assert_array_equal(Sum(a, b, c), [7.0])
  types = [o.type for o in _OpsOf(Sum, a, b, c)]
  # A chain of adds kept apart by snapshots: neither one AddN (which keeps
  # every part alive) nor AccumulateNV2 (whose zeros become constants).
  assert types.count('Snapshot') == 2 and types.count('AddV2') == 2
  assert 'AddN' not in types and 'AccumulateNV2' not in types


def testDeviceOfFirstPlacedTensor():
  with graph_ops.DeviceOf((None, 3)):
    pass  # No tensor: a null scope.

  @tf.function
  def Placed():
    with tf.device('/cpu:0'):
      x = tf.constant(1.0)
    with graph_ops.DeviceOf([None, x]):
      return tf.identity(x, name='placed')

  (op,) = [o for o in _OpsOf(Placed) if o.name == 'placed']
  assert 'CPU:0' in op.device.upper()


def testAfterAddsControlDependenciesInGraphsOnly():
  x = tf.constant(1.0)
  assert graph_ops.After(x, [tf.constant(2.0)]) is x  # Eager: unchanged.

  @tf.function
  def Fn(a, b):
    dep = tf.identity(b, name='dep')
    out = graph_ops.After({'a': a, 'n': None}, [dep, None])
    assert out['n'] is None
    return out['a']

  g = Fn.get_concrete_function(tf.constant(1.0), tf.constant(2.0)).graph
  ordered = [
    o
    for o in g.get_operations()
    if any(c.name == 'dep' for c in o.control_inputs)
  ]
  assert [o.type for o in ordered] == ['Identity']


def testFreshCopiesAreDeepCopiesAfterDeps():
  @tf.function
  def Fn(a, b):
    dep = tf.identity(b, name='dep')
    return graph_ops.FreshCopies((a, 7), [dep])

  g = Fn.get_concrete_function(tf.constant(1.0), tf.constant(2.0)).graph
  copies = [o for o in g.get_operations() if o.type == 'DeepCopy']
  assert len(copies) == 1
  assert [c.name for c in copies[0].control_inputs] == ['dep']
  out = Fn(tf.constant(1.0), tf.constant(2.0))
  assert float(out[0]) == 1.0 and out[1] == 7


def testStampReturnsATimestampAndOrdersXAfterIt():
  @tf.function
  def Fn(a):
    stamp, y = graph_ops.Stamp(a * 2.0)
    return stamp, y

  stamp, y = Fn(tf.constant(3.0))
  assert stamp.dtype == tf.float64 and float(stamp) > 0
  assert float(y) == 6.0


class _Squash:
  """A layer whose backward reads tensors made inside it (not only its
  inputs and outputs); `leak` hands one of them to the next layer."""

  def __init__(self, leak=None):
    self.leak = leak

  def FProp(self, w, x, *extra):
    z = tf.tanh(tf.matmul(x, w))
    if self.leak is not None:
      self.leak.append(z)
    y = z * z
    for e in extra:  # a tensor made inside the layer below
      y = y * e
    return y


def _OrderedGradients(layers, apply_order):
  ws = [
    tf.Variable(tf.random.stateless_normal([4, 4], [i, 1]) * 0.5)
    for i in range(len(layers))
  ]
  x = tf.random.stateless_normal([3, 4], [9, 9])
  out = {}

  @tf.function
  def Step():
    order = graph_ops.BackwardOrder()
    theta = [w.read_value() for w in ws]
    with tf.GradientTape() as tape:
      tape.watch(theta)
      h = x
      for i, (layer, th) in enumerate(zip(layers, theta)):
        extra = (layers[0].leak[-1],) if i == 2 and layers[0].leak else ()
        h = order.FProp(layer, th, (h,) + extra)
      y = tf.reduce_sum(h)
    order.Start()
    grads = tape.gradient(y, theta)
    out['added'] = order.Apply() if apply_order else 0
    return grads

  grads = [g.numpy() for g in Step()]
  return grads, out['added'], Step.get_concrete_function().graph


def testBackwardOrderMakesEachLayerWaitForTheOneAbove():
  plain, _, _ = _OrderedGradients([_Squash() for _ in range(3)], False)
  ordered, added, graph = _OrderedGradients([_Squash() for _ in range(3)], True)
  assert added > 0
  for a, b in zip(plain, ordered):  # Only control edges: the same bits.
    np.testing.assert_array_equal(a, b)
  barriers = [op for op in graph.get_operations() if op.type == 'NoOp']
  barriers = [op for op in barriers if 'backward_order' in op.name]
  assert len(barriers) == 2  # Between layers 2 and 1, and 1 and 0.
  waiting = [
    op
    for op in graph.get_operations()
    if any('backward_order' in c.name for c in op.control_inputs)
  ]
  assert len(waiting) == added
  assert all(op.name.startswith('gradient_tape/') for op in waiting)


def testBackwardOrderAddsNoEdgeThatWouldCloseACycle():
  # Layer 2 reads a tensor made inside layer 0: its backward reads layer
  # 0's activations, and would have to wait for itself.
  leak = []
  layers = [_Squash(leak), _Squash(), _Squash()]
  plain, _, _ = _OrderedGradients(layers, False)
  leak.clear()
  ordered, added, _ = _OrderedGradients(layers, True)
  assert added == 0
  for a, b in zip(plain, ordered):
    np.testing.assert_array_equal(a, b)


def testOpsMadeListsTheBlocksOpsInOrder():
  with tf.Graph().as_default() as g:
    x = tf.constant(1.0, name='x')
    with graph_ops.OpsMade() as made:
      y = tf.square(x, name='y')
      z = tf.add(y, 1.0, name='z')
      assert made == []  # Filled when the block ends.
    tf.identity(z, name='after')
  assert [op.name for op in made] == ['y', 'z/y', 'z'], made
  assert made[0] is y.op and made[-1] is z.op
  assert len(g.get_operations()) == 5
