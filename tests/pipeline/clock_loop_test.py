"""The fill-drain schedule built as two loops (`micro_batch_loop=True`).

The loops call the same cell functions on the same tensors as the work
items, sum the weights' gradients in the same order and use the same seeds:
every result is the same to the bit. The step's graph and its function
library do not grow with the micro-batches beyond a few reads each.
"""

import collections
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import normalizations
from lingvo_gpipe.pipeline import clock_loop
from lingvo_gpipe.pipeline import pipelining_layer
from tests.testing import graphs
from tests.testing import pipeline_layers

DEVICES = pipeline_layers.DEVICES


def _Layers(kind):
  layers = pipeline_layers.DenseLayers(4)
  if kind == 'bn_dropout':
    layers.insert(
      1,
      normalizations.BatchNormLayer.Params().Set(name='bn', dim=6, decay=0.5),
    )
    layers.insert(
      3, dropout.DropoutLayer.Params().Set(name='drop', keep_prob=0.5)
    )
  return layers


def _Pipe(loop, kind='dense', num_mb=4, replicas=1, layers=None, **kwargs):
  devices = DEVICES[:2] if replicas == 1 else None
  kwargs.setdefault('recompute', 'always')
  return (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=layers or _Layers(kind),
      num_stages=2,
      num_micro_batches=num_mb,
      devices=devices,
      num_replicas=replicas,
      micro_batch_loop=loop,
      **kwargs,
    )
    .Instantiate()
  )


def _Step(pipe, with_loss, watch_input=True, is_eval=False):
  """A traced train step: (function, its inputs)."""
  x, _ = pipeline_layers.Inputs(batch=16)
  w = tf.ones_like(x) * tf.range(16.0)[:, None] / 16.0
  variables = list(pipe.trainable_variables)

  @tf.function
  def Step(x):
    with py_utils.EvalMode(is_eval), py_utils.StepSeed(5):
      with py_utils.UpdateCollector() as updates:
        with tf.GradientTape() as tape:
          if watch_input:
            tape.watch(x)
          if with_loss:
            loss, out = pipe.FPropWithLoss(
              pipe.theta,
              x,
              loss_fn=pipeline_layers.WeightedSum,
              loss_inputs=w,
            )
          else:
            out = pipe(x)
            loss = pipeline_layers.WeightedSum(out, w)
        sources = variables + ([x] if watch_input else [])
        grads = tape.gradient(loss, sources)
      with tf.control_dependencies(updates.Apply()):
        moving = [tf.identity(v) for v in pipe.variables if 'moving' in v.name]
    return [loss, out] + grads + moving

  return Step, x


def _Results(loop, with_loss, **kwargs):
  tf.random.set_seed(1)
  watch_input = kwargs.pop('watch_input', True)
  is_eval = kwargs.pop('is_eval', False)
  pipe = _Pipe(loop, **kwargs)
  step, x = _Step(pipe, with_loss, watch_input, is_eval)
  return [t.numpy() for t in step(x)]


def _AssertSame(a, b):
  assert len(a) == len(b)
  for i, (u, v) in enumerate(zip(a, b)):
    np.testing.assert_array_equal(u, v, err_msg=f'result {i}')


@pytest.mark.parametrize('with_loss', [False, True])
@pytest.mark.parametrize('kind', ['dense', 'bn_dropout'])
def testSameBitsAsTheWorkItems(kind, with_loss):
  """Forward, loss, every gradient (weights and input) and the batch-norm
  moving averages (per-micro-batch statistics merged per mini-batch)."""
  a = _Results(True, with_loss, kind=kind)
  b = _Results(False, with_loss, kind=kind)
  # The graph optimizer may regroup the sum of the micro-batches' losses
  # (an AddN of M reads here, of M calls there): its last bit may differ.
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
  _AssertSame(a[1:], b[1:])


def testSameBitsWithReplicasAndWithoutInputGradient():
  _AssertSame(
    _Results(True, False, kind='bn_dropout', replicas=2),
    _Results(False, False, kind='bn_dropout', replicas=2),
  )
  _AssertSame(
    _Results(True, True, watch_input=False),
    _Results(False, True, watch_input=False),
  )


def testSameBitsWithSharedLayerFunctionsAndInEvaluation():
  _AssertSame(
    _Results(True, False, kind='bn_dropout', share_layer_functions=True),
    _Results(False, False, kind='bn_dropout', share_layer_functions=True),
  )
  _AssertSame(
    _Results(True, False, kind='bn_dropout', is_eval=True),
    _Results(False, False, kind='bn_dropout', is_eval=True),
  )


def testMultipleReplicasWithLoss():
  a = _Results(True, True, replicas=2)
  b = _Results(False, True, replicas=2)
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
  _AssertSame(a[1:], b[1:])


@pytest.mark.parametrize('with_loss', [False, True])
def testGraphDoesNotGrowWithMicroBatches(with_loss):
  sizes = {}
  for num_mb in (2, 16):
    step, x = _Step(_Pipe(True, num_mb=num_mb), with_loss)
    graph = step.get_concrete_function(x).graph
    sizes[num_mb] = graphs.GraphSize(graph)
    calls = [
      op
      for op in graph.get_operations()
      if op.type in ('PartitionedCall', 'StatefulPartitionedCall')
    ]
    # Every cell call is in the loops' bodies.
    assert not calls, [op.name for op in calls]
  (ops2, lib2), (ops16, lib16) = sizes[2], sizes[16]
  # (The bodies hold M - 1 as a constant or two.)
  assert lib16 - lib2 <= 8, sizes
  # A few reads per micro-batch after the loops (outputs, losses, input
  # gradients), nothing per work item.
  assert ops16 - ops2 <= 12 * 14, sizes


def _StepGraph(num_layers, loop=True, jit_compile=False, batch_norms=0):
  """The graph of a train step whose cells hold `num_layers` dense layers
  in all (and `batch_norms` batch norms after the first)."""
  layers = pipeline_layers.DenseLayers(num_layers)
  for i in range(batch_norms):
    layers.insert(
      1, normalizations.BatchNormLayer.Params().Set(name=f'bn{i}', dim=6)
    )
  pipe = _Pipe(loop, layers=layers, jit_compile=jit_compile)
  step, x = _Step(pipe, with_loss=False)
  return step.get_concrete_function(x).graph


def _LoopInputs(num_layers, jit_compile=False, batch_norms=0):
  """[number of inputs of each while loop] of a loop step."""
  graph = _StepGraph(num_layers, True, jit_compile, batch_norms)
  return [
    len(op.inputs)
    for op in graph.get_operations()
    if op.type in ('While', 'StatelessWhile')
  ]


def testLoopsTakeEachCellsWeightsAsOneList():
  """A loop (and each tick's cond) passes every tensor it takes through
  ops of its own: the cells' weights cross them packed, one list per dtype
  per cell, so the loops take as many tensors for 12 layers as for 4."""
  four, twelve = _LoopInputs(4), _LoopInputs(12)
  assert len(four) == 2 and four == twelve, (four, twelve)
  # The forward loop carries a cell's batch-norm statistics packed too:
  # one tensor per dtype, however many layers make them.
  one, three = _LoopInputs(4, batch_norms=1), _LoopInputs(4, batch_norms=3)
  assert one == three, (one, three)
  # Compiled cells take their weights one by one (XLA takes no lists), but
  # the loops pass them packed all the same: each call unpacks them first.
  four, twelve = _LoopInputs(4, True), _LoopInputs(12, True)
  assert len(four) == 2 and four == twelve, (four, twelve)


def testLoopsKeepNoGraphsOfTheirBodies():
  """Once built, a loop keeps neither its body's graph nor its ticks'
  branch graphs (each held a copy of every cell function it calls): no
  tape records the loops. The step still runs (the same bits:
  testSameBitsAsTheWorkItems)."""
  graph = _StepGraph(4, jit_compile=True)
  loops = [
    op
    for op in graph.get_operations()
    if op.type in ('While', 'StatelessWhile')
  ]
  assert len(loops) == 2, loops
  for op in loops:
    assert op._body_graph is None and op._cond_graph is None  # pylint: disable=protected-access
    atomic = graph._functions[op.get_attr('body').name]  # pylint: disable=protected-access
    assert atomic._cached_graph is None  # pylint: disable=protected-access


def testCellsOfOneTickAreNotChained():
  """A tick's cells run at once: tf.function chains the stateful ops of a
  loop's body in program order, and a compiled cell's cond is stateful
  (its call's anchor). Chained, a tick's cells ran one after another."""
  library = _StepGraph(4, jit_compile=True).as_graph_def().library
  conds = [
    node
    for f in library.function
    for node in f.node_def
    if node.op in ('If', 'StatelessIf')
  ]
  assert 'If' in {node.op for node in conds}, conds
  # Two cells per tick in each loop; no cond waits for another.
  assert len(conds) == 4, [node.name for node in conds]
  for node in conds:
    waits = [i for i in node.input if i.startswith('^')]
    assert not waits, (node.name, waits)


def _Functions(graph):
  return {f.signature.name: f for f in graph.as_graph_def().library.function}


def testCellsReadTheirInputsWhereTheListIs():
  """In the backward loop cell k re-reads its inputs from cell k-1's list
  of outputs on cell k-1's device: read on cell k's, the whole list
  (every micro-batch's outputs) crossed between the devices at every
  tick, over worker processes a copy each time."""
  graph = _StepGraph(4)
  loops = [
    op
    for op in graph.get_operations()
    if op.type in ('While', 'StatelessWhile')
  ]
  body = _Functions(graph)[loops[1].get_attr('body').name]
  reads = [n.device for n in body.node_def if n.op == 'TensorListGetItem']
  # Only cell 1 reads a list: cell 0's outputs, on cell 0's device.
  assert reads and set(reads) == {DEVICES[0]}, reads


def testEachCellCountsTheTicksOnItsDevice():
  """Each cell takes its micro-batch's index from a tick count on its own
  device: from the loop's counter, every worker fetched it from the driver
  at every tick (the pipeline-8 LM's loop step: 7% slower)."""
  graph = _StepGraph(4)
  for loop in [
    op
    for op in graph.get_operations()
    if op.type in ('While', 'StatelessWhile')
  ]:
    counters = [
      t.device
      for t in loop.inputs
      if t.dtype == tf.int32 and t.shape.rank == 0 and t.op.type == 'Const'
    ]
    assert set(DEVICES[:2]) <= set(counters), counters


def _UnplacedIdentities(graph):
  """[(function, identity)] of the loops' bodies and conds' branches: an
  identity without a device whose input has one."""
  found = []
  for name, f in _Functions(graph).items():
    if 'while' not in name:
      continue
    devices = {n.name: n.device for n in f.node_def}
    for n in f.node_def:
      if n.op == 'Identity' and not n.device:
        source = n.input[0].lstrip('^').split(':')[0]
        if devices.get(source):
          found.append((name, n.name))
  return found


def testCompiledCellsResultsStayOnTheirDevice():
  """tf.function passes what a loop's body or a cond's branch returns
  through an identity it builds outside the cells' device scopes: with
  compiled cells they went to the first device, and each cell's state and
  results crossed to it and back at every tick."""
  assert not _UnplacedIdentities(_StepGraph(4, jit_compile=True))
  # Cells that are not compiled keep their loops as they were built.
  assert _UnplacedIdentities(_StepGraph(4))


def _OpsOnTheCallersDevice(loop):
  """{op type: count} of a train step's ops on the device of the scope
  that the pipeline and its gradient are called in (one no cell is on)."""
  pipe = _Pipe(loop, kind='bn_dropout')
  x, w = pipeline_layers.Inputs(batch=16)
  scope = DEVICES[3]

  @tf.function
  def Step(x):
    with tf.device(scope), py_utils.UpdateCollector() as updates:
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = pipeline_layers.WeightedSum(pipe(x), w)
      grads = tape.gradient(loss, list(pipe.trainable_variables) + [x])
      updates.Apply()
    return grads

  graph = Step.get_concrete_function(x).graph
  return collections.Counter(
    op.type for op in graph.get_operations() if op.device == scope
  )


def testLoopsPutNothingOfTheCellsOnTheCallersDevice():
  """What the loops add around the cells runs on the cells' devices, not
  in the caller's device scope: only the loops themselves (their counters
  and conditions) and constants go there, besides what the work items
  also put there (the loss's gradient, the moving averages' updates).
  After the backward loop each cell's packed gradient sums were split on
  the caller's device (the tools take gradients on the last one): every
  cell's sums went there and back, and the pipeline-8 LM's last device
  held 2x the others' step memory."""
  items, loops = _OpsOnTheCallersDevice(False), _OpsOnTheCallersDevice(True)
  extra = {
    t: n
    for t, n in loops.items()
    if n > items.get(t, 0)
    and t not in ('While', 'StatelessWhile', 'Const', 'PlaceholderWithDefault')
  }
  assert not extra, extra


def testLoopsRunAtMostTwoTicksAtOnce():
  """Every tick allowed at once let a worker process run ahead of the
  schedule: 4-7x the memory on a device (clock_loop.PARALLEL_TICKS)."""
  graph = _StepGraph(4)
  loops = [
    op.get_attr('parallel_iterations')
    for op in graph.get_operations()
    if op.type in ('While', 'StatelessWhile')
  ]
  assert loops == [clock_loop.PARALLEL_TICKS] * 2 == [2, 2], loops


@pytest.mark.parametrize(
  'settings',
  [
    dict(schedule='1f1b'),
    dict(recompute='never'),
    dict(num_mb=1),
  ],
)
def testOtherSchedulesBuildItemByItem(settings):
  """The loops apply to fill-drain with re-materialization; other steps
  are built item by item, with the same results."""
  settings = dict(settings)
  with_loss = settings.get('schedule') == '1f1b'
  _AssertSame(
    _Results(True, with_loss, **settings),
    _Results(False, with_loss, **settings),
  )
  step, x = _Step(_Pipe(True, **settings), with_loss)
  graph = step.get_concrete_function(x).graph
  assert not any(
    op.type in ('While', 'StatelessWhile') for op in graph.get_operations()
  )


def testSameBitsWithCompiledCells():
  _AssertSame(
    _Results(True, False, jit_compile=True),
    _Results(False, False, jit_compile=True),
  )
