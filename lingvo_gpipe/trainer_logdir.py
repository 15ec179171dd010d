"""The trainer's logdir: who owns it, and the Params it was trained with.

`OwnLogdir` makes this process the one trainer of a logdir: it creates
`<logdir>/trainer.lock` atomically (O_EXCL), naming the host, the process
and when it started. A second trainer on the same logdir refuses in one
line naming the holder; a lock left by a process that is gone (a pid of
this host that no longer runs, or runs another program) is taken over with
a warning. Evalers, decoders and the inspect and export modes only read
the logdir and never take the lock. `LogdirLock.Release` removes it; a
process killed before (SIGKILL, a second signal) leaves a stale lock that
the next trainer takes over.

`CheckParamsChange` runs when a trainer resumes from a checkpoint: its
Params must be those of the logdir's params.txt, except the fields that say
how the run goes (`RUN_FIELDS`: the pipeline's placement and schedule,
which give the same gradients, and when training stops and saves). A resume
with other Params (a dropped --model_params_override) is refused in one
line naming the keys, before params.txt is rewritten; --allow_params_change
accepts the change.
"""

import json
import os
import socket
import time

from absl import logging
import tensorflow as tf

from lingvo_gpipe import trainer_errors

__all__ = [
  'LOCK_FILE',
  'LogdirLock',
  'OwnLogdir',
  'RUN_FIELDS',
  'ParamsChanges',
  'CheckParamsChange',
]

LOCK_FILE = 'trainer.lock'


def _StartTime(pid):
  """The start time of process `pid` (clock ticks since boot, from /proc),
  or None where /proc does not say; tells a reused pid from its holder."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return int(f.read().rsplit(')', 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


def _Alive(holder):
  """Whether the process of lock `holder` (a dict) still runs; only asked
  for a holder of this host."""
  pid = holder.get('pid')
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  started = holder.get('start_time')
  return started is None or _StartTime(pid) in (None, started)


def _Describe(holder, path):
  since = holder.get('since')
  when = (
    time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))
    if isinstance(since, (int, float))
    else 'an unknown time'
  )
  return (
    f'pid {holder.get("pid")} on host {holder.get("host")}, since {when} '
    f'({path})'
  )


class LogdirLock:
  """This process's ownership of a logdir (see `OwnLogdir`)."""

  def __init__(self, path, holder):
    self.path = path
    self.holder = holder

  def Release(self):
    """Removes the lock file if it is still this process's."""
    try:
      with open(self.path) as f:
        if json.load(f).get('pid') != self.holder['pid']:
          return
      os.remove(self.path)
    except (OSError, ValueError):
      pass


def _Read(path):
  """The holder recorded in lock file `path`: a dict, {} when the file is
  empty or not JSON, None when it is gone."""
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    return None
  try:
    holder = json.loads(text)
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def OwnLogdir(logdir):
  """Makes this process the trainer of `logdir` (see the module doc).

  Returns:
    A LogdirLock, or None on a remote file system (gs://...), where no lock
    is taken.

  Raises:
    UserError: another trainer holds the logdir, naming it and the fix.
  """
  if '://' in logdir:
    logging.info('%s is on a remote file system: no ownership lock.', logdir)
    return None
  path = os.path.join(logdir, LOCK_FILE)
  me = {
    'host': socket.gethostname(),
    'pid': os.getpid(),
    'start_time': _StartTime(os.getpid()),
    'since': time.time(),
  }
  for _ in range(50):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      pass
    else:
      with os.fdopen(fd, 'w') as f:
        f.write(json.dumps(me, sort_keys=True) + '\n')
        f.flush()
        os.fsync(f.fileno())
      return LogdirLock(path, me)
    holder = _Read(path)
    if holder is None:  # Released in between: try again.
      continue
    mine = holder.get('host') == me['host'] and holder.get('pid') == me['pid']
    if mine:
      return LogdirLock(path, me)
    if not holder:  # Being written, or left empty by a crash.
      try:
        age = time.time() - os.path.getmtime(path)
      except OSError:
        continue
      if age < 5:
        time.sleep(0.1)
        continue
    elif holder.get('host') != me['host']:
      raise trainer_errors.UserError(
        f'--logdir {logdir} belongs to another trainer: '
        f'{_Describe(holder, path)}. Stop it or pass another --logdir; if '
        f'that trainer is gone (its host down), remove {path}.'
      )
    elif _Alive(holder):
      raise trainer_errors.UserError(
        f'--logdir {logdir} belongs to another trainer: '
        f'{_Describe(holder, path)}, still running. Stop it (kill '
        f'{holder.get("pid")}) or pass another --logdir.'
      )
    logging.warning(
      'Taking over %s from a trainer that is gone: %s.',
      logdir,
      _Describe(holder, path) if holder else f'an empty {path}',
    )
    stale = f'{path}.stale-{os.getpid()}'
    try:
      os.rename(path, stale)  # One taker wins; the others try again.
      os.remove(stale)
    except OSError:
      pass
  raise trainer_errors.UserError(
    f'Could not take {path}: other processes keep taking it. Pass a '
    '--logdir of this trainer alone.'
  )


# -- Params on resume ----------------------------------------------------------

# The Params fields a resume may change: how a pipeline is placed, split
# and scheduled (the gradients are the same), and when training stops and
# saves (under `.train.`).
RUN_FIELDS = frozenset(
  [
    'devices',
    'num_stages',
    'splits',
    'num_replicas',
    'num_micro_batches',
    'micro_batch_size',
    'balance_by',
    'schedule',
    'recompute',
    'jit_compile',
    'memory_state_copies',
    'strict_order',
    'planner_device',
    'planner_memory_per_device',
  ]
)
_TRAIN_RUN_FIELDS = frozenset(
  [
    'max_steps',
    'save_max_to_keep',
    'save_interval_steps',
    'save_interval_seconds',
    'summary_interval_steps',
    'tpu_steps_per_loop',
  ]
)
_SHOWN = 5


def _Lines(text):
  """{key: value} of the "a.b.c : value" lines of a Params text."""
  out = {}
  for line in text.splitlines():
    key, sep, value = line.partition(' : ')
    if sep:
      out[key.strip()] = value.strip()
  return out


def _IsRunField(key):
  parts = [part.split('[')[0] for part in key.split('.')]
  if parts[-1] in RUN_FIELDS:
    return True
  return (
    len(parts) > 1 and parts[-2] == 'train' and parts[-1] in (_TRAIN_RUN_FIELDS)
  )


def ParamsChanges(old_text, new_text):
  """[(key, old value, new value)] where two Params texts differ, less the
  `RUN_FIELDS`; a value is None where its text lacks the key."""
  old, new = _Lines(old_text), _Lines(new_text)
  return [
    (key, old.get(key), new.get(key))
    for key in sorted(set(old) | set(new))
    if old.get(key) != new.get(key) and not _IsRunField(key)
  ]


def CheckParamsChange(logdir, params, resumed, allow):
  """Refuses to resume `logdir` with Params other than its params.txt's.

  Args:
    logdir: the trainer's logdir.
    params: the Params the trainer resumes with.
    resumed: the checkpoint it restored, or None (a fresh start: no check).
    allow: --allow_params_change: log the changes and go on.

  Raises:
    UserError: naming the differing keys, the overrides that give the
      trained Params back and --allow_params_change.
  """
  path = os.path.join(logdir, 'params.txt')
  if resumed is None or not tf.io.gfile.exists(path):
    return
  with tf.io.gfile.GFile(path) as f:
    changes = ParamsChanges(f.read(), params.ToText())
  if not changes:
    return
  shown = ', '.join(
    f'{key} {"(none)" if old is None else old} -> '
    f'{"(none)" if new is None else new}'
    for key, old, new in changes[:_SHOWN]
  )
  if len(changes) > _SHOWN:
    shown += f' and {len(changes) - _SHOWN} more'
  if allow:
    logging.warning(
      'Resuming %s with other Params than its params.txt (allowed by '
      '--allow_params_change): %s. params.txt now records the new ones.',
      resumed,
      shown,
    )
    return
  if all(old is not None and new is not None for _, old, new in changes):
    fix = "rerun with the same overrides (--model_params_override='" + (
      '; '.join(f'{key} : {old}' for key, old, _ in changes) + "')"
    )
  else:
    fix = 'rerun with the model and overrides it was trained with'
  raise trainer_errors.UserError(
    f'{resumed} was trained with other Params than these ({path}): '
    f'{shown}. To resume it as trained, {fix}; to train on with the new '
    'Params, pass --allow_params_change (params.txt is left as it was).'
  )
