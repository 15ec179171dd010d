"""The TensorFlow internals the library uses still exist and still work.

A failure here after a TensorFlow upgrade names the internal that changed;
`lingvo_gpipe/core/_tf_internal.py` says what each one is for.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal


def testTapeRecordingInternals():
  v = tf.Variable(2.0)
  x = tf.constant(3.0)
  assert not _tf_internal.CouldPossiblyRecord(), (
    'tensorflow.python.eager.record.could_possibly_record changed'
  )
  with tf.GradientTape() as tape:
    tape.watch(x)
    assert _tf_internal.CouldPossiblyRecord()
    with _tf_internal.VariableWatcher() as watcher:
      _ = v * 1.0
    assert [w.name for w in watcher.watched_variables()] == [v.name], (
      'tensorflow.python.eager.record.VariableWatcher changed'
    )
    assert _tf_internal.ShouldRecordBackprop([x]), (
      'tensorflow.python.eager.record.should_record_backprop changed'
    )
    assert not _tf_internal.ShouldRecordBackprop([tf.constant(1.0)])
    y = tf.identity(x * 5.0)
    _tf_internal.RecordOperation('Test', [y], [x], lambda dy: [dy * 7.0])
  # The recorded op's gradient (7) is used, not the one of x * 5.
  assert float(tape.gradient(y, x)) == 7.0, (
    'tensorflow.python.eager.record.record_operation changed'
  )


def testOpFlops():
  graph = tf.Graph()
  with graph.as_default():
    a = tf.zeros([2, 3])
    b = tf.zeros([3, 4])
    c = tf.matmul(a, b)
  assert _tf_internal.OpFlops(graph, c.op.node_def) == 2 * 2 * 3 * 4, (
    'tensorflow.python.framework.ops.get_stats_for_node_def changed'
  )


def testRunIndependently():

  @tf.function
  def F():
    assert hasattr(
      tf.compat.v1.get_default_graph(), 'experimental_acd_manager'
    ), 'FuncGraph.experimental_acd_manager is gone'
    t = tf.timestamp()
    _tf_internal.RunIndependently(t.op)
    return t

  assert F().numpy() > 0


def testTPUStrategyAttributes():
  # No TPU here: the attributes are read from TPUStrategy's extended class,
  # whose __init__ sets them; a rename shows up in its source.
  import inspect  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import tpu_strategy  # pylint: disable=g-import-not-at-top

  src = inspect.getsource(tpu_strategy.TPUExtended.__init__)
  for attr in ('_device_assignment', '_tpu_devices'):
    assert f'self.{attr} =' in src, (
      f'TPUStrategy.extended.{attr} is gone: update '
      '_tf_internal.TPUDeviceAssignment / TPUDevices.'
    )

  class FakeExtended:
    _device_assignment = 'da'
    _tpu_devices = np.zeros([2, 4])

  assert _tf_internal.TPUDeviceAssignment(FakeExtended()) == 'da'
  assert _tf_internal.TPUDevices(FakeExtended()).shape == (2, 4)
  assert _tf_internal.TPUDeviceAssignment(object()) is None


def testInXlaContext():
  seen = []

  def F(x):
    seen.append(_tf_internal.InXlaContext())
    return x + 1

  tf.function(F, jit_compile=True)(tf.constant(1.0))
  tf.function(F)(tf.constant(1.0))
  assert seen == [True, False]
  assert not _tf_internal.InXlaContext()


def testRecordingOnUndoesInitScope():
  x = tf.constant(2.0)
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(x)
    with tf.init_scope():
      stopped = x * x
      with _tf_internal.RecordingOn():
        recorded = x * x
  assert tape.gradient(stopped, x) is None
  assert float(tape.gradient(recorded, x)) == 4.0


def testStopRecording():
  x = tf.constant(3.0)
  with tf.GradientTape() as tape:
    tape.watch(x)
    with _tf_internal.StopRecording():
      assert not _tf_internal.ShouldRecordBackprop([x]), (
        'tensorflow.python.eager.record.stop_recording changed'
      )
      y = x * 2.0
  assert tape.gradient(y, x) is None


def testCallFunctionSkipsShapeInferenceOfTheBody():
  @tf.function(autograph=False)
  def Body(x, y):
    return tf.tanh(x) * y, tf.reduce_sum(x)

  concrete = Body.get_concrete_function(
    tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([], tf.float32)
  )

  @tf.function(autograph=False)
  def Step(x, y):
    a, b = _tf_internal.CallFunction(concrete, [x, y])
    op = a.op
    assert op.type in ('PartitionedCall', 'StatefulPartitionedCall'), op.type
    assert op.get_attr('_disable_call_shape_inference')
    assert op.get_attr('f').name == concrete.name.decode()
    # The outputs carry the function's shapes.
    assert a.shape == [2, 3] and b.shape == [], (a.shape, b.shape)
    return a, b

  x = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
  a, b = Step(x, tf.constant(2.0))
  np.testing.assert_allclose(a, np.tanh(x.numpy()) * 2.0, rtol=1e-6)
  assert float(b) == 15.0


def testOutermostOfControlFlowLeavesLoopsAndBranches():
  seen = {}

  @tf.function
  def Step(x):
    seen['step'] = tf.compat.v1.get_default_graph()

    def Body(i, y):
      def Then():
        seen['branch'] = tf.compat.v1.get_default_graph()
        return y + 1.0

      return i + 1, tf.cond(i > 0, Then, lambda: y)

    return tf.while_loop(lambda i, _: i < 2, Body, (0, x))[1]

  Step(tf.constant(1.0))
  assert seen['branch'] is not seen['step']
  assert _tf_internal.OutermostOfControlFlow(seen['branch']) is seen['step']
  assert _tf_internal.OutermostOfControlFlow(seen['step']) is seen['step']


def testIsStateful():
  assert _tf_internal.IsStateful('RandomUniform') is True
  assert _tf_internal.IsStateful('AssignVariableOp') is True
  assert _tf_internal.IsStateful('MatMul') is False
  assert _tf_internal.IsStateful('__inference_not_an_op_1') is None


def testReleaseDefinitionCopiesKeepsTheFunctionCallable():
  @tf.function(jit_compile=True, autograph=False)
  def Body(x):
    return tf.tanh(x) * 2.0

  concrete = Body.get_concrete_function(tf.TensorSpec([3], tf.float32))
  _tf_internal.ReleaseDefinitionCopies(concrete)
  # TensorFlow's attribute holders are plain dicts of their own now, not
  # fields of a copy of the whole definition.
  assert isinstance(concrete._attrs, dict)  # pylint: disable=protected-access
  assert concrete._inference_function._cached_definition is None  # pylint: disable=protected-access
  x = tf.constant([0.5, 1.0, 2.0])

  @tf.function(autograph=False)
  def Step(x):
    (y,) = _tf_internal.CallFunction(concrete, [x])
    # The call still carries the function's XLA attribute.
    assert y.op.get_attr('_XlaMustCompile')
    return y

  np.testing.assert_allclose(Step(x), np.tanh(x.numpy()) * 2.0, rtol=1e-6)
  np.testing.assert_allclose(concrete(x), np.tanh(x.numpy()) * 2.0, rtol=1e-6)


def testReleaseControlFlowGraphsDropsBodiesAndBranches():
  seen = {}

  @tf.function
  def Step(x):
    def Body(i, y):
      return i + 1, tf.cond(i > 0, lambda: y + 1.0, lambda: y * 2.0)

    graph = tf.compat.v1.get_default_graph()
    out = tf.while_loop(lambda i, _: i < 3, Body, (0, x))[1]
    whiles = [op for op in graph.get_operations() if 'While' in op.type]
    assert len(whiles) == 1, whiles
    (loop,) = whiles
    body = loop._body_graph  # pylint: disable=protected-access
    conds = [o for o in body.get_operations() if 'If' in o.type]
    assert conds and conds[0]._true_graph is not None  # pylint: disable=protected-access
    _tf_internal.ReleaseControlFlowGraphs(whiles)
    seen['loop'], seen['cond'] = loop, conds[0]
    return out

  # (1 * 2) + 1 + 1: the loop runs as built.
  assert float(Step(tf.constant(1.0))) == 4.0
  assert seen['loop']._body_graph is None  # pylint: disable=protected-access
  assert seen['loop']._cond_graph is None  # pylint: disable=protected-access
  assert seen['cond']._true_graph is None  # pylint: disable=protected-access
  graph = seen['loop'].graph
  for name in (
    seen['loop'].get_attr('body').name,
    seen['cond'].get_attr('then_branch').name,
  ):
    assert graph._functions[name]._cached_graph is None  # pylint: disable=protected-access
  # Were a graph asked for again, TensorFlow builds it from the runtime.
  body = graph._functions[seen['loop'].get_attr('body').name].graph  # pylint: disable=protected-access
  assert any('If' in o.type for o in body.get_operations())


def testWithoutGraphRunsTheFunctionEagerly():
  w = tf.constant([1.0, 2.0])

  @tf.function(autograph=False)
  def Body(x):
    return x * w + 1.0

  concrete = Body.get_concrete_function(tf.TensorSpec([2], tf.float32))
  run = _tf_internal.WithoutGraph(concrete)
  atomic = concrete._inference_function  # pylint: disable=protected-access
  assert atomic._cached_graph is None  # pylint: disable=protected-access
  (y,) = run(tf.constant([3.0, 4.0]))
  np.testing.assert_allclose(y, [4.0, 9.0])


def testWithoutGraphOptimizerRestoresTheCallOptions():
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top

  before = context.context().function_call_options.config_proto_serialized
  with _tf_internal.WithoutGraphOptimizer():
    inside = context.context().function_call_options.config_proto_serialized
  after = context.context().function_call_options.config_proto_serialized
  assert inside != before and after == before


def testSharedConstantsMakeOneConstPerValue():
  names = {}

  def Const(t, i=1):
    return t.op.inputs[i].op.name

  @tf.function(autograph=False)
  def F(x):
    with _tf_internal.SharedConstants():
      a = x + 1.0
      b = x * tf.constant(1.0)  # the same value and dtype: the same op
      names['a'], names['b'] = Const(a), Const(b)
      c = tf.reduce_sum(a * b, axis=0) + 2.0
      with tf.control_dependencies([c]):
        d = c + 1.0  # made anew: it must wait for c
      names['d'] = Const(d)
      with tf.device('/device:CPU:0'):
        e = d + 1.0  # made anew: another device scope
      names['e'] = Const(e)
      i32 = tf.constant([1, 2], tf.int32)
      i64 = tf.constant([1, 2], tf.int64)  # another dtype: its own op
      names['i32'], names['i64'] = i32.op.name, i64.op.name
      f = i32 + tf.cast(i64, tf.int32)
    out = e + 1.0  # outside the scope: made anew
    names['out'] = Const(out)
    return out, f

  out, f = F(tf.ones([3, 2]))
  assert names['a'] == names['b'], (
    'tensorflow.python.framework.ops._create_graph_constant changed: '
    f'the constants of one value are {names["a"]} and {names["b"]}'
  )
  assert len({names[k] for k in ('a', 'd', 'e', 'out')}) == 4, names
  assert names['i32'] != names['i64']
  np.testing.assert_array_equal(out, [11.0, 11.0])
  np.testing.assert_array_equal(f, [2, 4])

  # Outside the scope every constant is its own op, as TensorFlow makes it.
  @tf.function(autograph=False)
  def G(x):
    return x + 1.0, x - 1.0

  graph = G.get_concrete_function(tf.TensorSpec([2])).graph
  assert sum(op.type == 'Const' for op in graph.get_operations()) == 2
