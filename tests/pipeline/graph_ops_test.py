"""Unit tests for lingvo_gpipe.pipeline.graph_ops."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.pipeline import graph_ops


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
