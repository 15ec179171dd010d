"""Data parallelism through a tf.distribute strategy (the TPUStrategy path).

On TPUs, TPUStrategy runs the training step once per replica: the learner
averages the gradients over the replicas, batch norm merges its statistics
over them, and every variable takes the first replica's (identical) update.
MirroredStrategy on two CPU devices exercises the same code here: 2 replicas
of a 1-cell pipeline must make the update of one model with the whole batch.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import trainer

MODEL = 'image.digits.MlpDigitsTinyBN'


def _Params(num_micro_batches):
  return trainer.BuildParams(
    MODEL,
    'Train',
    worker_split_size=1,
    overrides=[f'task.network.num_micro_batches : {num_micro_batches}'],
  )


def testMirroredReplicasMakeTheUpdateOfTheWholeBatch():
  # Reference: one model, the whole batch of 64 in 4 micro-batches of 16.
  p = _Params(4)
  p.task.network.devices = None
  model = p.Instantiate()
  task = model.GetTask()
  it = iter(task.input_generator.GetDataset())
  batches = [next(it) for _ in range(3)]
  step = tf.function(task.TrainStep, autograph=False)
  for b in batches:
    step(b)
  want = {n: v.numpy() for n, v in model.VariablesByName().items()}

  # 2 replicas, each 32 examples in 2 micro-batches of 16.
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  p = _Params(2)
  p.task.network.devices = None
  with strategy.scope():
    dp_model = p.Instantiate()
    dp_task = dp_model.GetTask()
    dp_task.CreateOptimizerSlots()
  assert "each MirroredStrategy replica's device" in (
    dp_task.network.PlacementText()
  )

  @tf.function(autograph=False)
  def DpStep(batch):
    shards = strategy.experimental_distribute_values_from_function(
      lambda ctx: batch.Transform(
        lambda t: tf.split(t, 2)[ctx.replica_id_in_sync_group]
      )
    )
    return strategy.run(dp_task.TrainStep, args=(shards,))

  for b in batches:
    DpStep(b)
  got = {n: v.numpy() for n, v in dp_model.VariablesByName().items()}
  assert sorted(got) == sorted(want)
  assert int(got['global_step']) == 3
  assert any('moving_mean' in n for n in got)
  for name in want:
    np.testing.assert_allclose(
      got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name
    )
  # Every replica's copy holds the same values.
  for v in dp_model.VariablesByName().values():
    copies = [c.numpy() for c in strategy.experimental_local_results(v)]
    assert len(copies) == 2
    np.testing.assert_array_equal(copies[0], copies[1])


def testMultiCellPipelineRunsOnEachMirroredReplicasDevice():
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  p = _Params(2)
  p.task.network.num_stages = 2
  p.task.network.devices = None
  with strategy.scope():
    model = p.Instantiate()
  text = model.GetTask().network.PlacementText()
  assert "cell 1 on each MirroredStrategy replica's device" in text


def testReplicatedPipelineUnderMirroredStrategyIsRefused():
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  p = _Params(2)
  p.task.network.num_replicas = 2
  p.task.network.devices = None
  with strategy.scope():
    with pytest.raises(
      ValueError,
      match=r'has 2 replicas but is built under MirroredStrategy.*'
      r'num_replicas=1',
    ):
      p.Instantiate()
