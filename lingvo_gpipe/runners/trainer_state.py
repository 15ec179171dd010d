"""The trainer's state file: whether a trainer writes checkpoints to a
train directory, so that a standalone evaler knows when no more will come.

  WriteTrainerState(train_dir, running=True)        # the trainer, at start
  WriteTrainerState(train_dir, running=False, step=s)   # ... and at exit
  TrainerRunning(train_dir)                         # an evaler
"""

import json
import os
import socket
import time

import tensorflow as tf

__all__ = [
  'TRAINER_STATE_FILE',
  'WriteTrainerState',
  'TrainerRunning',
  'KilledTrainer',
]

# In the train directory: whether the trainer runs (and its
# process), so that a standalone evaler knows when no checkpoint will come.
TRAINER_STATE_FILE = 'trainer_state.json'


def WriteTrainerState(train_dir, running, step=None):
  """Records in `<train_dir>/trainer_state.json` that the trainer of this
  process runs (`running`) or has stopped (at `step`)."""
  state = {
    'running': bool(running),
    'pid': os.getpid(),
    'host': socket.gethostname(),
    'step': step,
    'wall_time': time.time(),
  }
  tf.io.gfile.makedirs(train_dir)
  with tf.io.gfile.GFile(os.path.join(train_dir, TRAINER_STATE_FILE), 'w') as f:
    f.write(json.dumps(state, sort_keys=True) + '\n')


def _ReadState(train_dir):
  path = os.path.join(train_dir, TRAINER_STATE_FILE)
  try:
    with tf.io.gfile.GFile(path) as f:
      return json.loads(f.read())
  except (tf.errors.NotFoundError, ValueError):
    return None


def KilledTrainer(train_dir):
  """The state of the last trainer of `train_dir` if it ended without
  recording its exit (killed: SIGKILL, the out-of-memory killer) and ran
  on this host, whose process is gone; else None."""
  state = _ReadState(train_dir)
  if not state or not state.get('running') or not state.get('pid'):
    return None
  if state.get('host') != socket.gethostname():
    return None
  try:
    os.kill(int(state['pid']), 0)
  except ProcessLookupError:
    return state
  except PermissionError:
    pass
  return None


def TrainerRunning(train_dir):
  """Whether a trainer still writes checkpoints to `train_dir`: its state
  file says it runs and, on this host, its process is alive. False without
  a state file (a logdir whose trainer is gone, or copied)."""
  path = os.path.join(train_dir, TRAINER_STATE_FILE)
  try:
    with tf.io.gfile.GFile(path) as f:
      state = json.loads(f.read())
  except (tf.errors.NotFoundError, ValueError):
    return False
  if not state.get('running'):
    return False
  if state.get('host') == socket.gethostname() and state.get('pid'):
    try:
      os.kill(int(state['pid']), 0)
    except ProcessLookupError:
      return False  # Killed without writing its state.
    except PermissionError:
      pass
  return True
