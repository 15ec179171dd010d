"""The step's graph holds each cell once: its size does not grow with M.

Each cell is traced into a forward and a recompute-and-backward function
(`cells/cell_function.py`) that every work item calls, so adding
micro-batches adds a few ops per work item to the step's graph, whatever
the cells hold, and nothing to its function library.
"""

from absl import logging
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import normalizations
from lingvo_gpipe.layers import transformer
from lingvo_gpipe.pipeline import pipelining_layer
from tests.testing import graphs
from tests.testing import pipeline_layers

DEVICES = pipeline_layers.DEVICES

# Ops in the step's graph per work item (one call, its seed, ordering).
_OPS_PER_ITEM = 6


def _Pipe(num_layers, num_mb, recompute='always', schedule='gpipe', bn=False):
  layers = pipeline_layers.DenseLayers(num_layers)
  if bn:
    layers.insert(
      1,
      normalizations.BatchNormLayer.Params().Set(name='bn', dim=6),
    )
  return (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=layers,
      num_stages=2,
      num_micro_batches=num_mb,
      devices=DEVICES[:2],
      recompute=recompute,
      schedule=schedule,
    )
    .Instantiate()
  )


def _StepSize(pipe, batch=16):
  x, w = pipeline_layers.Inputs(batch=batch)
  w = tf.ones_like(x)
  variables = pipe.trainable_variables

  @tf.function
  def Step(x):
    with py_utils.UpdateCollector() as updates:
      with tf.GradientTape() as tape:
        if pipeline_layers.UsesLoss(pipe):
          loss, _ = pipe.FPropWithLoss(
            pipe.theta,
            x,
            loss_fn=pipeline_layers.WeightedSum,
            loss_inputs=w,
          )
        else:
          loss = pipeline_layers.WeightedSum(pipe(x), w)
      grads = tape.gradient(loss, variables)
    updates.Apply()
    return grads

  graph = Step.get_concrete_function(x).graph
  return graphs.GraphSize(graph), graph


@pytest.mark.parametrize(
  'recompute,schedule',
  [
    ('always', 'gpipe'),
    ('never', 'gpipe'),
    ('except_last_micro_batch', 'gpipe'),
    ('always', '1f1b'),
  ],
)
def testGraphGrowsByAFewOpsPerWorkItem(recompute, schedule):
  (ops2, lib2), _ = _StepSize(_Pipe(4, 2, recompute, schedule))
  (ops8, lib8), _ = _StepSize(_Pipe(4, 8, recompute, schedule))
  # The functions are the same: one forward, and one backward per kind of
  # call (the device's first backward has no running sum yet).
  assert lib8 == lib2, (lib2, lib8)
  # 2 cells x 2 passes x 6 more micro-batches.
  assert ops8 - ops2 <= _OPS_PER_ITEM * 2 * 2 * 6, (ops2, ops8)


def testPerItemOpsDoNotDependOnTheLayers():
  """Four times the layers: the same ops per extra micro-batch."""
  (a2, _), _ = _StepSize(_Pipe(2, 2))
  (a8, _), _ = _StepSize(_Pipe(2, 8))
  (b2, lib_b), _ = _StepSize(_Pipe(8, 2))
  (b8, _), _ = _StepSize(_Pipe(8, 8))
  assert b8 - b2 == a8 - a2, (a2, a8, b2, b8)
  assert lib_b > 0


def testBatchNormStatisticsMergeInAFewOps():
  (ops2, lib2), _ = _StepSize(_Pipe(4, 2, bn=True))
  (ops8, lib8), _ = _StepSize(_Pipe(4, 8, bn=True))
  assert lib8 == lib2
  assert ops8 - ops2 <= _OPS_PER_ITEM * 2 * 2 * 6 + 2 * 3 * 6, (ops2, ops8)


@pytest.mark.parametrize('jit', [False, True])
def testCellFunctionsHoldEachConstantOnce(jit):
  """Equal constants (shapes, axes, ones of the gradients) are one op per
  cell function: before, 1,799 of the probe's 5,273 ops were constants, of
  109 values."""
  layers = [
    transformer.TransformerLayer.Params().Set(
      name=f'block_{i}', source_dim=8, hidden_dim=16, num_attention_heads=2
    )
    for i in range(4)
  ]
  pipe = pipeline_layers.Pipe(
    layers, num_micro_batches=2, jit_compile=jit, precompile=False
  )

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x))
    return tape.gradient(loss, pipe.trainable_variables)

  graph = Step.get_concrete_function(tf.zeros([4, 5, 8])).graph
  library = graph.as_graph_def().library.function
  cells = [f for f in library if 'Forward' in f.signature.name]
  cells += [f for f in library if 'Backward' in f.signature.name]
  assert len(cells) == 4, [f.signature.name for f in library]
  for f in cells:
    keys = [
      (n.attr['value'].SerializeToString(deterministic=True), n.device)
      for n in f.node_def
      if n.op == 'Const' and not n.input
    ]
    assert len(keys) == len(set(keys)), (
      f'{f.signature.name}: {len(keys)} constants of {len(set(keys))} values'
    )


def testCellFunctionsAreNotInlined():
  _, graph = _StepSize(_Pipe(4, 4))
  library = graph.as_graph_def().library.function
  calls = ('PartitionedCall', 'StatefulPartitionedCall')
  # The calls stand in the step's graph or, where the schedule is a loop
  # (`clock_loop`), in the loop's body and branch functions.
  called = {
    op.get_attr('f').name for op in graph.get_operations() if op.type in calls
  }
  for f in library:
    called |= {n.attr['f'].func.name for n in f.node_def if n.op in calls}
  assert called
  by_name = {f.signature.name: f for f in library}
  for name in called:
    assert by_name[name].attr['_noinline'].b, name


def _FromConstantsOnly(op, memo):
  """Whether `op`'s value is computed from constants alone (a Const, or ops
  whose inputs all are), which the graph optimizer folds into a constant."""
  if op.name not in memo:
    memo[op.name] = False  # Cycles (none expected) count as not constant.
    memo[op.name] = op.type == 'Const' or (
      bool(op.inputs)
      and op.type not in ('Placeholder', 'PlaceholderWithDefault')
      and not op.op_def.is_stateful
      and all(_FromConstantsOnly(t.op, memo) for t in op.inputs)
    )
  return memo[op.name]


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def testRecomputedCallsTakeNoConstantInputs(schedule):
  # A call with a constant input makes the graph optimizer copy the called
  # function and optimize it again for that call (its "specialization"):
  # the device's first backward once added its gradients to constant zeros.
  # (A cell that keeps its forward's tape, recompute='never', still gets
  # constant zeros from TensorFlow's tape for the outputs nothing
  # differentiates.)
  _, graph = _StepSize(_Pipe(4, 4, 'always', schedule))
  memo = {}
  calls = [
    op
    for op in graph.get_operations()
    if op.type in ('PartitionedCall', 'StatefulPartitionedCall')
  ]
  assert calls
  for op in calls:
    constant = [t.name for t in op.inputs if _FromConstantsOnly(t.op, memo)]
    assert not constant, (op.name, op.get_attr('f').name, constant)


def testEachCellTracedOncePerStep(monkeypatch):
  """A step traced anew at every call retraces the cells: a warning says
  so (and what to do); the same step function called again traces
  nothing."""
  pipe = _Pipe(2, 2)
  x, w = pipeline_layers.Inputs()
  warnings = []
  monkeypatch.setattr(
    logging, 'warning', lambda msg, *a: warnings.append(msg % a)
  )

  @tf.function
  def Step(x):
    return pipe(x)

  for _ in range(3):
    Step(x)
  assert not warnings
  for _ in range(3):
    tf.function(lambda x: pipe(x))(x)
  assert any('traced 3 times for the same input shapes' in m for m in warnings)
  assert any('Trace the step once' in m for m in warnings)


def testEachLayersBackwardWaitsForTheLayerAbove():
  # Layers inline in a cell's recompute-and-backward function: the
  # gradient ops that read a layer's activations wait for those of the
  # layer above (graph_ops.BackwardOrder), so they are freed layer by layer.
  from lingvo_gpipe.layers import transformer  # pylint: disable=g-import-not-at-top

  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=[
        transformer.TransformerLayer.Params().Set(
          name=f'block_{i}', source_dim=8, hidden_dim=16, num_attention_heads=2
        )
        for i in range(4)
      ],
      num_stages=2,
      num_micro_batches=2,
      devices=DEVICES[:2],
    )
    .Instantiate()
  )
  variables = pipe.trainable_variables

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x))
    return tape.gradient(loss, variables)

  x = tf.random.stateless_normal([4, 3, 8], [1, 2])
  graph = Step.get_concrete_function(x).graph
  backward = [
    f
    for f in graph.as_graph_def().library.function
    if 'Backward' in f.signature.name
  ]
  assert backward
  for f in backward:
    barriers = [n for n in f.node_def if 'backward_order' in n.name]
    # Two layers per cell: one boundary between them.
    assert len(barriers) == 1, (f.signature.name, len(barriers))
