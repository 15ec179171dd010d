"""Data parallelism through a tf.distribute strategy (the TPUStrategy path).

On TPUs, TPUStrategy runs the training step once per replica: the learner
averages the gradients over the replicas, batch norm merges its statistics
over them, and every variable takes the first replica's (identical) update.
MirroredStrategy on two CPU devices exercises the same code here: 2 replicas
of a 1-cell pipeline must make the update of one model with the whole batch,
in process and through the trainer binary (--strategy=mirrored) across a
restart that resumes from the checkpoint. Without a TPU, --tpu fails within
seconds saying what it looked for.
"""

import glob
import os
import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import trainer
from lingvo_gpipe.runners import checkpointer
from tests.testing import trainer_process

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


def _Train(logdir, max_steps, *args):
  r = trainer_process.Run(
    f'--logdir={logdir}',
    f'--max_steps={max_steps}',
    '--worker_split_size=1',
    '--job=trainer',
    *args,
    model=MODEL,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return r


def _Values(logdir):
  prefix = checkpointer.LatestCheckpoint(os.path.join(logdir, 'train'))
  reader = tf.train.load_checkpoint(prefix)
  return {
    name: reader.get_tensor(name)
    for name in reader.get_variable_to_shape_map()
    if name.endswith('.ATTRIBUTES/VARIABLE_VALUE')
  }


@pytest.mark.slow
def testMirroredReplicasMatchTheWholeBatchWithResume(tmp_path):
  whole = tmp_path / 'whole'
  _Train(whole, 3, '--model_params_override=task.network.num_micro_batches:4')
  mirrored = tmp_path / 'mirrored'
  args = (
    '--strategy=mirrored',
    '--worker_replicas=2',
    '--model_params_override=task.network.num_micro_batches:2',
  )
  r = _Train(mirrored, 2, *args)
  assert 'MirroredStrategy: 2 replicas' in r.stderr
  placement = (mirrored / 'placement.txt').read_text()
  assert 'MirroredStrategy: 2 replicas' in placement
  assert "cell 0 on each MirroredStrategy replica's device" in placement
  r = _Train(mirrored, 3, *args)  # Resumes at step 2.
  assert 'step       3/3' in r.stderr
  want, got = _Values(whole), _Values(mirrored)
  assert sorted(got) == sorted(want)
  assert any('moving_mean' in n for n in got)
  assert int(got['model/global_step/.ATTRIBUTES/VARIABLE_VALUE']) == 3
  for name, value in want.items():
    np.testing.assert_allclose(
      got[name], value, rtol=2e-5, atol=2e-6, err_msg=name
    )
  # Summaries as without a strategy.
  assert glob.glob(str(mirrored / 'train' / 'events.out.tfevents.*'))


@pytest.mark.slow
def testMirroredTwoCellsPerReplicaWithCompiledCells(tmp_path):
  r = _Train(
    tmp_path,
    2,
    '--strategy=mirrored',
    '--worker_split_size=2',
    '--model_params_override=task.network.jit_compile:True',
  )
  assert 'MirroredStrategy: 2 replicas' in r.stderr  # All devices: 2.
  placement = (tmp_path / 'placement.txt').read_text()
  assert 'XLA-compiled cells' in placement
  assert "cell 1 on each MirroredStrategy replica's device" in placement
  assert checkpointer.LatestCheckpoint(str(tmp_path / 'train')).endswith('-2')


def testTpuWithoutATpuFailsWithinSeconds(tmp_path, monkeypatch):
  for var in ('TPU_NAME', 'KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS', 'TPU_CONFIG'):
    monkeypatch.delenv(var, raising=False)
  start = time.time()
  r = trainer_process.Run(
    f'--logdir={tmp_path}', '--tpu=', '--worker_split_size=2', model=MODEL
  )
  assert time.time() - start < 60  # Python and TensorFlow start included.
  assert r.returncode == 1
  assert "No TPU was found for tpu=''" in r.stderr
  assert 'TPU_NAME' in r.stderr and 'grpc://' in r.stderr


def testTpuAndStrategyTogetherAreRefused():
  try:
    trainer.CreateStrategy('mirrored', 'local')
  except trainer.UserError as e:
    assert '--tpu' in str(e) and '--strategy=mirrored' in str(e)
    assert 'Give one of them' in str(e)
  else:
    raise AssertionError('no error')


def testReplicasThatDoNotDivideTheBatchAreRefused(tmp_path):
  r = trainer_process.Run(
    f'--logdir={tmp_path}',
    '--strategy=mirrored',
    '--worker_replicas=3',
    '--num_cpu_devices=3',
    '--worker_split_size=1',
    '--max_steps=1',
    model=MODEL,
  )
  assert r.returncode == 1
  assert '--strategy' in r.stderr
  assert 'do not divide the batch size 64' in r.stderr
  assert 'task.input.batch_size' in r.stderr
