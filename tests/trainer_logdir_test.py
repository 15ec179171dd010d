"""The logdir's owner lock and the Params check on resume, in process."""

import json
import os
import socket
import subprocess
import sys

import pytest

from lingvo_gpipe import trainer_errors
from lingvo_gpipe import trainer_logdir


def _Lock(logdir, **holder):
  path = logdir / trainer_logdir.LOCK_FILE
  path.write_text(json.dumps(holder))
  return path


def _DeadPid():
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  proc.wait()
  return proc.pid


def testLockIsTakenReleasedAndReentrant(tmp_path):
  lock = trainer_logdir.OwnLogdir(str(tmp_path))
  holder = json.loads((tmp_path / trainer_logdir.LOCK_FILE).read_text())
  assert holder['pid'] == os.getpid()
  assert holder['host'] == socket.gethostname()
  assert trainer_logdir.OwnLogdir(str(tmp_path)).holder['pid'] == os.getpid()
  lock.Release()
  assert not (tmp_path / trainer_logdir.LOCK_FILE).exists()


def testLockOfALiveProcessOrAnotherHostIsRefused(tmp_path):
  path = _Lock(tmp_path, host=socket.gethostname(), pid=1, since=0)
  with pytest.raises(
    trainer_errors.UserError, match=r'pid 1 on host .* still running'
  ):
    trainer_logdir.OwnLogdir(str(tmp_path))
  _Lock(tmp_path, host='elsewhere', pid=_DeadPid(), since=0)
  with pytest.raises(trainer_errors.UserError) as e:
    trainer_logdir.OwnLogdir(str(tmp_path))
  assert 'on host elsewhere' in str(e.value)
  assert f'if that trainer is gone (its host down), remove {path}' in str(
    e.value
  )
  # Refused locks are left as they were; a lock of another process is
  # never released by this one.
  trainer_logdir.LogdirLock(str(path), {'pid': os.getpid()}).Release()
  assert json.loads(path.read_text())['host'] == 'elsewhere'


def testStaleLockIsTakenOver(tmp_path):
  _Lock(tmp_path, host=socket.gethostname(), pid=_DeadPid(), since=0)
  lock = trainer_logdir.OwnLogdir(str(tmp_path))
  assert lock.holder['pid'] == os.getpid()
  # A live pid that another program now has (its start time differs).
  _Lock(tmp_path, host=socket.gethostname(), pid=os.getppid(), start_time=-5)
  assert trainer_logdir.OwnLogdir(str(tmp_path)).holder['pid'] == os.getpid()


def testParamsChangesLeaveOutHowTheRunGoes():
  old = '\n'.join(
    [
      'task.train.learning_rate : 0.001',
      'task.train.max_steps : 30',
      'task.network.num_stages : 2',
      "task.network.devices : ['/device:CPU:0', '/device:CPU:1']",
      'task.network.layers[0].bn_decay : 0.9',
      'task.gone : 1',
    ]
  )
  new = '\n'.join(
    [
      'task.train.learning_rate : 0.001',
      'task.train.max_steps : 40',
      'task.network.num_stages : 1',
      'task.network.devices : NoneType',
      'task.network.layers[0].bn_decay : 0.999',
      'task.new : 2',
    ]
  )
  assert trainer_logdir.ParamsChanges(old, new) == [
    ('task.gone', '1', None),
    ('task.network.layers[0].bn_decay', '0.9', '0.999'),
    ('task.new', None, '2'),
  ]
