"""The trainer binary on AmoebaNetTiny, and fine-tuning from it.

Each test runs `python -m lingvo_gpipe.trainer` in a subprocess on two
virtual CPU devices, as a user would. The fine-tuning test is the tiny
stand-in of the paper's transfer learning: AmoebaNetTiny (the digits
standing in for ImageNet) -> AmoebaNetTinyCifar100 (CIFAR-100 files written
here), restoring the network and not the softmax, whose classes differ.
"""

import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.runners import checkpointer
from tests.testing import warm_python

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT = 240


def _Run(model, *args):
  cmd = [
    sys.executable,
    '-m',
    'lingvo_gpipe.trainer',
    f'--model={model}',
    '--num_cpu_devices=2',
    '--run_locally=cpu',
    '--mode=sync',
    *args,
  ]
  return warm_python.Run(
    cmd, cwd=REPO, env=warm_python.ServerEnv(), timeout=TIMEOUT
  )


@pytest.fixture(scope='module')
def tiny_logdir(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('amoeba') / 'logdir'
  res = _Run(
    'image.amoebanet.AmoebaNetTiny',
    f'--logdir={logdir}',
    '--max_steps=3',
    '--log_interval_steps=1',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  return logdir, res.stderr


def testTinyTrainsPipelined(tiny_logdir):
  logdir, log = tiny_logdir
  assert "Pipeline 'amoebanet/network': 2 cells, 2 micro-batches" in log
  assert 'cell 1 on /device:CPU:1' in log
  assert 'step       3/3' in log
  latest = checkpointer.LatestCheckpoint(str(logdir / 'train'))
  assert latest.endswith('ckpt-3')
  names = checkpointer.ReadCheckpointVariables(latest)
  assert 'amoebanet/network/cell_0/comb_iter_1_right/conv_1x7/w' in names
  assert 'amoebanet/network/cell_0/cur_proj/w/rms' in names  # RMSProp.


def _WriteCifar100(path, n, seed):
  rng = np.random.RandomState(seed)
  with open(path, 'wb') as f:
    for _ in range(n):
      f.write(
        bytes([rng.randint(20), rng.randint(100)])
        + rng.randint(0, 256, 3072).astype(np.uint8).tobytes()
      )


@pytest.mark.slow
def testFineTuneRestoresTheBodyNotTheHead(tiny_logdir, tmp_path):
  source_dir, _ = tiny_logdir
  data = tmp_path / 'cifar-100-binary'
  data.mkdir()
  _WriteCifar100(data / 'train.bin', 64, 0)
  _WriteCifar100(data / 'test.bin', 8, 1)
  logdir = tmp_path / 'finetune'
  res = _Run(
    'image.amoebanet.AmoebaNetTinyCifar100',
    f'--logdir={logdir}',
    '--max_steps=1',
    '--seed=99',
    f'--restore_from={source_dir}',
    r'--restore_map=amoebanet/network/(.*)=>amoebanet/network/\1',
    f'--model_params_override=input.data_dir : {data}',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  log = res.stderr
  source = checkpointer.LatestCheckpoint(str(source_dir / 'train'))
  assert f'variables from {source}:' in log
  body = 'amoebanet/network/cell_2/comb_iter_0_left/conv/w'
  assert f'{body} <- {body}' in log
  assert 'amoebanet/softmax/weight_0: no --restore_map rule matches it' in log
  new = tf.train.load_checkpoint(str(logdir / 'train' / 'ckpt-1'))
  old = tf.train.load_checkpoint(source)
  key = checkpointer.VariableKey
  # Restored, then one small SGD step; a fresh init (seed 99) differs a lot.
  delta = new.get_tensor(key(body)) - old.get_tensor(key(body))
  assert np.abs(delta).max() < 0.02 * np.abs(old.get_tensor(key(body))).max()
  assert new.get_tensor(key('amoebanet/softmax/weight_0')).shape[-1] == 100
  assert old.get_tensor(key('amoebanet/softmax/weight_0')).shape[-1] == 10
