"""The pipeline engine: any valid schedule of work items, checked first."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import linears
from lingvo_gpipe.pipeline import engine
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.pipeline import schedule
from tests.testing import graphs
from tests.testing import pipeline_layers

DEVICES = [f'/device:CPU:{i}' for i in range(2)]
F, B = schedule.FORWARD, schedule.BACKWARD


def testFillDrainIsForwardOrderThenBackwardOrder():
  work = schedule.FillDrain(3, 4)
  n = 4 + 3 - 1
  assert [tuple(w[:3]) for w in work if w.kind == F] == (
    schedule.ForwardOrder(3, 4)
  )
  assert [(c - n, k, m) for c, k, m, kind in work if kind == B] == (
    schedule.BackwardOrder(3, 4)
  )
  engine.CheckSchedule(work, 3, 4)


def testCheckScheduleNamesTheBadItem():
  good = schedule.FillDrain(2, 2)
  with pytest.raises(ValueError, match='leaves out 1 of the 8'):
    engine.CheckSchedule(good[:-1], 2, 2)
  with pytest.raises(ValueError, match='repeats item 0'):
    engine.CheckSchedule(good[:1] + good, 2, 2)
  with pytest.raises(
    ValueError,
    match=r'comes before the forward of cell 0 '
    'on micro-batch 0',
  ):
    engine.CheckSchedule([schedule.WorkItem(0, 1, 0, F)] + good, 2, 2)
  with pytest.raises(ValueError, match=r'comes before the backward of cell 1'):
    fwd = [w for w in good if w.kind == F]
    engine.CheckSchedule(fwd + [schedule.WorkItem(9, 0, 0, B)], 2, 2)
  with pytest.raises(ValueError, match="kind 'sideways'"):
    engine.CheckSchedule([schedule.WorkItem(0, 0, 0, 'sideways')], 2, 2)
  with pytest.raises(ValueError, match='outside 2 cells'):
    engine.CheckSchedule([schedule.WorkItem(0, 2, 0, F)], 2, 2)
  with pytest.raises(ValueError, match='recompute=.sometimes.'):
    engine.PipelineEngine(None, None, 2, recompute='sometimes')


def _DepthFirst(num_cells, num_micro_batches):
  """Each micro-batch through every cell before the next one starts."""
  fwd = [
    schedule.WorkItem(0, k, m, F)
    for m in range(num_micro_batches)
    for k in range(num_cells)
  ]
  bwd = [
    schedule.WorkItem(0, k, m, B)
    for m in range(num_micro_batches)
    for k in reversed(range(num_cells))
  ]
  return fwd + bwd


class _DepthFirstPipeline(pipelining_layer.PipeliningLayer):
  _schedule = staticmethod(_DepthFirst)


def _LossAndGrads(cls, x):
  layers = [
    linears.FCLayer.Params().Set(
      name=f'fc_{i}', input_dim=4, output_dim=4, activation='TANH'
    )
    for i in range(4)
  ]
  pipe = (
    cls.Params()
    .Set(
      name='pipe',
      layers=layers,
      num_stages=2,
      num_micro_batches=4,
      devices=DEVICES,
      recompute='except_last_micro_batch',
    )
    .Instantiate()
  )

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = tf.reduce_sum(tf.square(pipe(x)))
    return loss, tape.gradient(loss, (pipe.trainable_variables, x))

  loss, (var_grads, x_grad) = Step(x)
  return loss, var_grads, x_grad, pipe


def testAnotherScheduleGivesTheSameLossAndGradients():
  x = tf.constant(np.random.RandomState(0).randn(8, 4).astype(np.float32))
  loss, grads, x_grad, pipe = _LossAndGrads(pipelining_layer.PipeliningLayer, x)
  assert pipe.engine.Work(4) == schedule.FillDrain(2, 4)
  loss2, grads2, x_grad2, pipe2 = _LossAndGrads(_DepthFirstPipeline, x)
  assert pipe2.engine.Work(4) == _DepthFirst(2, 4)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  np.testing.assert_allclose(x_grad2, x_grad, rtol=1e-5, atol=1e-7)
  for g2, g in zip(grads2, grads):
    np.testing.assert_allclose(g2, g, rtol=1e-5, atol=1e-7)


def testAnInvalidScheduleFailsBeforeBuildingOps():

  class _Broken(pipelining_layer.PipeliningLayer):
    _schedule = staticmethod(lambda k, m: schedule.FillDrain(k, m)[::-1])

  x = tf.zeros([8, 4])
  with pytest.raises(ValueError, match='comes before the'):
    _LossAndGrads(_Broken, x)


def _StepGraph(watch_input, loop=True):
  layers = [
    linears.FCLayer.Params().Set(
      name=f'fc_{i}', input_dim=4, output_dim=4, activation='TANH'
    )
    for i in range(4)
  ]
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=layers,
      num_stages=2,
      num_micro_batches=4,
      devices=DEVICES,
      recompute='always',
      micro_batch_loop=loop,
    )
    .Instantiate()
  )

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      if watch_input:
        tape.watch(x)
      loss = tf.reduce_sum(tf.square(pipe(x)))
    return tape.gradient(loss, pipe.trainable_variables)

  x = tf.constant(np.random.RandomState(1).randn(8, 4).astype(np.float32))
  graph = Step.get_concrete_function(x).graph
  matmuls = sum(t == 'MatMul' for t, _ in graphs.ExpandedOps(graph))
  return Step(x), matmuls


def testAnUnwatchedInputGetsNoGradientComputed():
  """Cell 0 back-propagates into the pipeline's input only when a tape
  watches it: the weight gradients are the same, with one matmul fewer per
  micro-batch."""
  grads, matmuls = _StepGraph(watch_input=True)
  grads2, matmuls2 = _StepGraph(watch_input=False)
  for g2, g in zip(grads2, grads):
    np.testing.assert_allclose(g2, g, rtol=1e-6)
  # Built as loops, the backward loop's body calls cell 0 once.
  assert matmuls - matmuls2 == 1, (matmuls, matmuls2)
  grads3, matmuls3 = _StepGraph(watch_input=True, loop=False)
  grads4, matmuls4 = _StepGraph(watch_input=False, loop=False)

  def Sums(gs):  # The pipelines' variables are listed in their own orders.
    return sorted(float(np.sum(g)) for g in gs)

  assert Sums(grads3) == Sums(grads) and Sums(grads4) == Sums(grads2)
  # One call per micro-batch: 4 micro-batches.
  assert matmuls3 - matmuls4 == 4, (matmuls3, matmuls4)


class _Noisy(pipeline_layers.Dense):
  """A dense layer with a stateful op (an unseeded random draw)."""

  def FProp(self, theta, x):
    y = super().FProp(theta, x)
    return y + 0.0 * tf.random.uniform(tf.shape(y))


def _TracedStep(layers, recompute, num_micro_batches, batch):
  """The graph of a traced train step of `layers` in 2 cells."""
  pipe = pipeline_layers.Pipe(
    layers,
    num_micro_batches=num_micro_batches,
    devices=pipeline_layers.DEVICES[:2],
    recompute=recompute,
  )
  x, _ = pipeline_layers.Inputs(batch=batch)

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x))
    return tape.gradient(loss, pipe.trainable_variables)

  return Step.get_concrete_function(x).graph


@pytest.mark.parametrize('recompute', ['always', 'never'])
def testCellsWithAStatefulOpStillRunAtOnce(recompute):
  """tf.function chains stateful ops in program order, and a cell with a
  stateful op makes its calls stateful: chained, the work items ran one at
  a time, device after device. A call waits only for its data and for its
  device's previous call."""
  layers = pipeline_layers.DenseLayers(4)
  layers[1] = _Noisy.Params().Set(name='noisy1', input_dim=6, output_dim=6)
  layers[3] = _Noisy.Params().Set(name='noisy3', input_dim=6, output_dim=6)
  graph = _TracedStep(layers, recompute, num_micro_batches=4, batch=16)
  calls = [
    op for op in graph.get_operations() if op.type == 'StatefulPartitionedCall'
  ]
  assert len(calls) >= 8, [op.name for op in calls]
  for op in calls:
    waits = [c for c in op.control_inputs if c.type == op.type]
    assert all(c.device == op.device for c in waits), (
      op.name,
      op.device,
      [(c.name, c.device) for c in waits],
    )


@pytest.mark.parametrize('recompute', ['always', 'never'])
def testStatefulRandomOpsInARecomputedCellAreNamed(recompute, caplog):
  """A stateful random op draws other values when the backward pass
  re-runs the cell: its gradients would not match its outputs. The
  pipeline says so once per cell, naming the op; stateless ops (the
  library's dropout) and a cell that is not re-run are not named."""
  layers = pipeline_layers.DenseLayers(4)
  layers[3] = _Noisy.Params().Set(name='noisy3', input_dim=6, output_dim=6)
  # Cell 0 drops out with the library's stateless dropout: not named.
  layers.insert(
    1, dropout.DropoutLayer.Params().Set(name='drop', keep_prob=0.5)
  )
  with caplog.at_level('WARNING'):
    _TracedStep(layers, recompute, num_micro_batches=2, batch=8)
  said = [r.getMessage() for r in caplog.records]
  said = [m for m in said if 'stateful ops' in m]
  if recompute == 'never':
    assert not said, said
    return
  assert len(said) == 1, said
  assert 'cell 1 draws random numbers with stateful ops (' in said[0]
  assert 'RandomUniform' in said[0] and 'DropoutLayer' in said[0]


@pytest.mark.parametrize('loop', [False, True])
def testDeepStepsBuiltItemByItemPointOutTheLoopsOnce(loop, caplog, monkeypatch):
  """Item by item, TensorFlow's first call rebuilds each cell's layers at
  every call op: from LOOP_HINT_LAYER_CALLS work items x layers the
  pipeline says, once, that micro_batch_loop builds the step as loops;
  a pipeline already built as loops says nothing."""
  monkeypatch.setattr(engine, 'LOOP_HINT_LAYER_CALLS', 16)
  monkeypatch.setattr(engine, '_hinted', set())
  pipe = pipeline_layers.Pipe(
    pipeline_layers.DenseLayers(4),
    num_micro_batches=4,
    devices=DEVICES,
    micro_batch_loop=loop,
  )
  x, _ = pipeline_layers.Inputs(batch=8)

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x))
    return tape.gradient(loss, pipe.trainable_variables)

  with caplog.at_level('INFO'):
    Step.get_concrete_function(x)
    Step.get_concrete_function(tf.TensorSpec([16, 6], tf.float32))
  said = [r.getMessage() for r in caplog.records]
  said = [m for m in said if 'micro_batch_loop=True' in m]
  if loop:
    assert not said, said
    return
  assert len(said) == 1, said
  assert '16 work items of cells of up to 2 layers' in said[0], said[0]
  assert 'about 32 layer bodies' in said[0], said[0]
