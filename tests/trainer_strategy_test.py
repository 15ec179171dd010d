"""The trainer under a tf.distribute strategy: --strategy=mirrored and --tpu.

2 MirroredStrategy replicas (each a virtual CPU device, its half of the
batch in 2 micro-batches) make the update of one model on the whole batch
(4 micro-batches of the same size), through the trainer binary, across a
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
from tests import trainer_test

MODEL = 'image.digits.MlpDigitsTinyBN'


def _Train(logdir, max_steps, *args):
  r = trainer_test._Run(  # pylint: disable=protected-access
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
  r = trainer_test._Run(  # pylint: disable=protected-access
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
  r = trainer_test._Run(  # pylint: disable=protected-access
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
