"""Data parallel x pipeline: R replicas of a K-cell pipeline on R*K devices.

R replicas of M micro-batches must compute exactly what one pipeline of R*M
micro-batches computes (and so what the sequential model computes): the same
outputs, gradients (the cross-replica sum) and batch-norm moving averages,
the same random values; each replica's ops run on its own devices.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.pipeline import schedule
from tests.testing import fake_tpu
from tests.testing import graphs
from tests.testing import pipeline_layers

DEVICES = pipeline_layers.DEVICES
PipeliningLayer = pipelining_layer.PipeliningLayer


def _Pipe(layers, num_stages, num_replicas, num_micro_batches, **kwargs):
  return (
    PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=layers,
      num_stages=num_stages,
      num_replicas=num_replicas,
      num_micro_batches=num_micro_batches,
      devices=DEVICES[: num_stages * num_replicas],
      **kwargs,
    )
    .Instantiate()
  )


@pytest.mark.parametrize(
  'num_replicas,num_stages,num_micro_batches',
  [(2, 1, 1), (2, 1, 4), (2, 2, 1), (2, 2, 2), (4, 1, 2)],
)
def testReplicasEqualSequential(
  plt_reference, num_replicas, num_stages, num_micro_batches
):
  _, x, w, (ref_out, ref_loss, ref_grads, ref_in_grads) = plt_reference
  pipe = _Pipe(
    pipeline_layers.DenseLayers(), num_stages, num_replicas, num_micro_batches
  )
  assert pipe.num_replicas == num_replicas
  out, loss, grads, in_grads = pipeline_layers.LossAndGrads(pipe, (x,), w)
  pipeline_layers.AssertClose(out, ref_out)
  pipeline_layers.AssertClose(loss, ref_loss)
  assert sorted(grads) == sorted(ref_grads)
  for name in grads:
    assert pipeline_layers.MaxRelDiff(grads[name], ref_grads[name]) <= 1e-5, (
      name
    )
  pipeline_layers.AssertClose(in_grads, ref_in_grads)


@pytest.fixture(scope='module')
def plt_reference():
  return pipeline_layers.Reference()


def testVariablesOnReplicaZeroOpsOnEveryReplica():
  pipe = _Pipe(pipeline_layers.DenseLayers(4), 2, 2, 2)
  assert pipe.devices == [
    tf.DeviceSpec.from_string(d).to_string() for d in pipe.replica_devices[0]
  ]
  assert [
    [tf.DeviceSpec.from_string(d).device_index for d in rd]
    for rd in pipe.replica_devices
  ] == [[0, 1], [2, 3]]
  for v in pipe.trainable_variables:
    assert tf.DeviceSpec.from_string(v.device).device_index in (0, 1), v.name
  x, w = pipeline_layers.Inputs()

  def Step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x) * w)
    return tape.gradient(loss, pipe.trainable_variables)

  graph = tf.function(Step).get_concrete_function(x).graph
  matmul_devices = {
    graphs.DeviceIndex(device)
    for op_type, device in graphs.ExpandedOps(graph)
    if op_type == 'MatMul'
  }
  # Forward and backward matmuls of both replicas' cells.
  assert matmul_devices == {0, 1, 2, 3}
  # Replica 1 splits its share into micro-batches on its own first device
  # (stacked by a reshape, where the step is built as loops).
  split_devices = {
    tf.DeviceSpec.from_string(op.device).device_index
    for op in graph.get_operations()
    if op.type in ('Split', 'Reshape')
  }
  assert 2 in split_devices
  text = pipe.PlacementText()
  assert '2 data-parallel replicas' in text
  assert '(replica 1)' in text and 'CPU:3' in text


def testSameRandomValuesAsOnePipelineOfRTimesMMicroBatches():
  layers = [
    pipeline_layers.RandomScale.Params().Set(name=f'r{i}') for i in range(2)
  ]
  x = tf.random.uniform([8, 5], 1.0, 2.0)

  def Run(pipe):
    with py_utils.StepSeed(tf.constant(7, tf.int64)):
      return tf.function(lambda x: pipe(x))(x)

  one = Run(_Pipe(layers, 2, 1, 4))
  two = Run(_Pipe(layers, 2, 2, 2))
  np.testing.assert_array_equal(one.numpy(), two.numpy())


def testBatchNormStatsOverAllReplicas():
  """Each micro-batch normalizes by its own statistics; the moving averages
  take the statistics of the whole mini-batch, across replicas."""
  dim = 6
  layers = pipeline_layers.NormLayers(dim)
  x = tf.random.normal([16, dim], seed=5)

  def Train(pipe):

    @tf.function
    def Step(x):
      with py_utils.UpdateCollector() as updates:
        with tf.GradientTape() as tape:
          y = pipe(x)
          loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, pipe.trainable_variables)
      updates.Apply()
      return y, grads

    y, grads = Step(x)
    bn = pipe.body[1]
    return (
      y,
      grads,
      bn.vars.moving_mean.numpy(),
      bn.vars.moving_variance.numpy(),
    )

  ref = Train(_Pipe(layers, 2, 1, 4, splits=[2, 3]))
  got = Train(_Pipe(layers, 2, 2, 2, splits=[2, 3]))
  pipeline_layers.AssertClose(got[0], ref[0])
  for g, rg in zip(got[1], ref[1]):
    assert pipeline_layers.MaxRelDiff(g, rg) <= 1e-5
  np.testing.assert_allclose(got[2], ref[2], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got[3], ref[3], rtol=1e-5)


def testTraceHasOneRowPerDevice():
  pipe = _Pipe(pipeline_layers.DenseLayers(4), 2, 2, 2)
  x, w = pipeline_layers.Inputs()
  tracer = schedule.ScheduleTracer()

  @tf.function
  def Step(x):
    with tracer:
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(pipe(x) * w)
      grads = tape.gradient(loss, pipe.trainable_variables)
    return grads, tracer.Tensors()

  _, stamps = Step(x)
  events = tracer.Events(stamps)
  rows = {(phase, row) for phase, row, _, _, _ in events}
  assert rows == {(p, r) for p in ('forward', 'backward') for r in range(4)}
  # Replica 1 (rows 2, 3) runs micro-batches 2 and 3 of the mini-batch.
  assert {mb for _, row, mb, _, _ in events if row >= 2} == {2, 3}


def testEvalWithBatchThatReplicasDoNotDivideRunsOnReplicaZero(plt_reference):
  _, x, _, (ref_out, _, _, _) = plt_reference
  pipe = _Pipe(pipeline_layers.DenseLayers(), 2, 2, 2)
  with py_utils.EvalMode():
    out = tf.function(lambda x: pipe(x))(x[:5])
  pipeline_layers.AssertClose(out, ref_out[:5])


def testBadReplicaConfigurations():
  with pytest.raises(
    ValueError,
    match=r'3 replicas x 2 stages need 6 devices '
    r'but only 4 devices',
  ):
    PipeliningLayer.Params().Set(
      name='pipe',
      layers=pipeline_layers.DenseLayers(4),
      num_stages=2,
      num_replicas=3,
      devices=DEVICES,
    ).Instantiate()
  with pytest.raises(ValueError, match='num_replicas=0'):
    PipeliningLayer.Params().Set(
      name='pipe',
      layers=pipeline_layers.DenseLayers(4),
      num_replicas=0,
      devices=DEVICES[:1],
    ).Instantiate()
  with pytest.raises(ValueError, match='must be distinct'):
    PipeliningLayer.Params().Set(
      name='pipe',
      layers=pipeline_layers.DenseLayers(4),
      num_stages=2,
      num_replicas=2,
      devices=DEVICES[:2] * 2,
    ).Instantiate()
  pipe = _Pipe(pipeline_layers.DenseLayers(4), 1, 2, 1)
  with pytest.raises(
    ValueError,
    match=r'num_replicas=2 does not divide the '
    r'batch size 7',
  ):
    pipe(tf.zeros([7, 6]))
  pipe = _Pipe(pipeline_layers.DenseLayers(4), 1, 2, 3)
  with pytest.raises(ValueError, match=r'split over 2 replicas: 4 each'):
    pipe(tf.zeros([8, 6]))


def testInATpuReplicaCellsArePinnedToLogicalCores(plt_reference):
  """The TPU code path, with a stand-in TPUStrategy of 2 cores per replica:
  every cell's inputs, weights and outputs go to its logical core, no
  tf.device placement is used, and the result is unchanged."""

  _, x, w, (ref_out, _, ref_grads, _) = plt_reference
  strategy = fake_tpu.FakeTPUStrategy(4, 2)
  strategy.extended.value_container = lambda v: v  # Variables read as is.
  with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
    pipe = (
      PipeliningLayer.Params()
      .Set(
        name='pipe',
        layers=pipeline_layers.DenseLayers(),
        num_stages=2,
        num_micro_batches=2,
      )
      .Instantiate()
    )
    assert 'logical core 1 of each TPU replica' in pipe.PlacementText()

  @tf.function
  def Step(x):
    with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
      with tf.GradientTape() as tape:
        y = pipe(x)
        loss = tf.reduce_sum(y * w)
      return y, tape.gradient(loss, pipe.trainable_variables)

  graph = Step.get_concrete_function(x).graph
  assert not [
    op for op in graph.get_operations() if op.type == 'MatMul' and op.device
  ]
  cores = {k for _, k in strategy.calls}
  assert cores == {0, 1}
  y, grads = Step(x)
  pipeline_layers.AssertClose(y, ref_out)
  for v, g in zip(pipe.trainable_variables, grads):
    assert pipeline_layers.MaxRelDiff(g, ref_grads[v.name]) <= 1e-5, v.name
  with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
    dp = (
      PipeliningLayer.Params()
      .Set(
        name='pipe',
        layers=pipeline_layers.DenseLayers(2),
        num_replicas=2,
        num_stages=1,
      )
      .Instantiate()
    )
  with pytest.raises(ValueError, match='set num_replicas=1'):
    with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
      dp(x)
