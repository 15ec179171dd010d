"""How the trainer binary reports what went wrong, and its log filter.

Every error of every job ends the process with status 1 and one line on
stderr (`OneLine`, `Exit`): a `UserError` (a mistake in the flags or the
model) and the other known errors with their whole message, a TensorFlow
error with its first meaningful line, an unexpected error with its first line
and its traceback in <logdir>/error_traceback.txt. A step that fails because
a remote worker died names the worker (`RaiseIfWorkerLost`). `SetUpLogging`
drops TensorFlow's noise lines from the trainer's log, `FilterNativeLog` its
native warnings that repeat an error.
"""

import logging as std_logging
import os
import re
import sys
import time
import traceback

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core import quiet_start
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import train_loop


class UserError(Exception):
  """A mistake in the flags or the model; reported in one line, exit 1."""


# The exceptions that building a model or tracing its step raise for a
# mistake in the model (a bad Params value, cells that do not fit together).
BUILD_ERRORS = (ValueError, TypeError, NotImplementedError)


def BuildError(what, error):
  """A UserError for `error`, a mistake in the model raised while `what`;
  the traceback is logged at verbosity 1 (--v=1)."""
  logging.vlog(1, 'Traceback of the error while %s:', what, exc_info=error)
  return UserError(f'{OneLine(error, is_user_error=True)} (while {what})')


_KNOWN_ERRORS = (
  UserError,
  checkpointer.CheckpointError,
  train_loop.NonFiniteError,
)


def _TensorFlowText(error):
  """The first meaningful line of a TensorFlow error, without the
  {{function_node ...}} and [Op:...] decorations."""
  text = str(getattr(error, 'message', None) or error)
  text = re.sub(r'\{\{function_node [^}]*\}\}\s*', '', text)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  line = lines[0] if lines else ''
  line = re.sub(r'^Error in user-defined function .*?: (?=assertion)', '', line)
  line = re.sub(r'\s*\[\[\{\{node .*', '', line)
  return re.sub(r'\s*\[Op:[^\]]*\].*$', '', line).strip()


def OneLine(error, logdir=None, is_user_error=False):
  """The one-line message the trainer exits with for `error`.

  Args:
    error: the exception.
    logdir: where an unexpected error's traceback goes
      (error_traceback.txt), if it exists.
    is_user_error: `error` is a mistake in the flags or the model, as the
      `_KNOWN_ERRORS` are: its whole message, no traceback.

  An error raised while tf.function traced a step carries the frames of the
  user's code ("in user code: File ..."); the message is what follows its
  last "<ErrorType>: ".
  """
  text = str(error).strip()
  if 'in user code:' in text:
    marker = f'{type(error).__name__}: '
    if marker in text:
      text = text[text.rindex(marker) + len(marker) :].strip()
  if is_user_error or isinstance(error, _KNOWN_ERRORS):
    return ' '.join(text.split('\n')).strip() or type(error).__name__
  if isinstance(error, tf.errors.OpError):
    message = base_input_generator.CheckMessage(error)
    if message:
      return message
    text = _TensorFlowText(error)
    if text.startswith('assertion failed: '):  # An input's own check.
      text = text[len('assertion failed: ') :]
      return text.replace("\\'", "'").replace('\\"', '"')
    return f'{type(error).__name__} from TensorFlow: {text}'
  where = 'the log (--verbosity=1)'
  if logdir and tf.io.gfile.isdir(logdir):
    path = os.path.join(logdir, 'error_traceback.txt')
    try:
      with open(path, 'w') as f:
        f.write(''.join(traceback.format_exception(error)))
      where = path
    except OSError:
      pass
  logging.vlog(1, '%s', ''.join(traceback.format_exception(error)))
  first = text.split('\n')[0]
  return f'{type(error).__name__}: {first} (traceback in {where})'


# Run by Exit before the process ends (`BeforeExit`).
_BEFORE_EXIT = []


def BeforeExit(fn):
  """Registers `fn()` to run when the process ends through `Exit` (not on
  a stuck worker's timeout): e.g. freeing this process's state on remote
  workers, which `os._exit` leaves behind. Errors in `fn` are ignored."""
  _BEFORE_EXIT.append(fn)


def Exit(status, message=None, release=True):
  """Reports `message` in one line, after every line logged before it, and
  ends the process without running interpreter shutdown (which can block
  in TensorFlow's destructors). `release`: first run the `BeforeExit`
  functions (False where a worker does not answer)."""
  if release:
    while _BEFORE_EXIT:
      try:
        _BEFORE_EXIT.pop()()
      except Exception:  # pylint: disable=broad-except
        pass
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  quiet_start.SyncStderr()
  if message:  # Printed once, not also as a log line.
    os.write(quiet_start.StderrFd(), f'ERROR: {message}\n'.encode())
  os._exit(status)  # pylint: disable=protected-access


# What TensorFlow raises when a remote worker goes away during a step.
_LOST_WORKER_ERRORS = (
  tf.errors.UnavailableError,
  tf.errors.AbortedError,
  tf.errors.CancelledError,
  tf.errors.InternalError,
  tf.errors.UnknownError,
)


_LOST_WORKER_GRACE_S = 5.0


def RaiseIfWorkerLost(
  error, train_dir, cluster, during='training', memory=None
):
  """Turns the error of a step that lost a remote worker of `cluster` (the
  process's cluster.Cluster, or None) into a UserError naming the worker
  (the trainer then exits with status 1); `during`: what the trainer was
  doing; `memory`: the trainer's `worker_memory.WorkerMemory`, or None (its
  last sample of the lost worker is named, and an out-of-memory kill)."""
  if (
    cluster is None
    or not cluster.is_remote
    or not isinstance(error, _LOST_WORKER_ERRORS)
  ):
    return
  lost = cluster.UnreachableWorkers()
  # A worker killed mid-step can fail the step a moment before its port
  # closes (the process is still being torn down): look again for a while.
  deadline = time.time() + _LOST_WORKER_GRACE_S
  while not lost and time.time() < deadline:
    time.sleep(0.25)
    lost = cluster.UnreachableWorkers()
  if not lost:
    return
  last = checkpointer.LatestCheckpoint(train_dir)
  first_line = str(error).strip().splitlines()[0] if str(error) else ''
  raise UserError(
    f'{LostWorkers(lost, memory, during)} The last checkpoint is '
    f'{last or "none"}; restart the worker and rerun the trainer to resume '
    f'from it. (TensorFlow: {type(error).__name__}: {first_line})'
  ) from error


def LostWorkers(lost, memory=None, during='training'):
  """The sentences that name the lost workers `lost` (`cluster.WorkerName`s)
  and what is known of them: an out-of-memory kill, the last measured
  memory."""
  details = [memory.Describe(w) for w in lost] if memory is not None else []
  details = [d for d in details if d]
  oom = any('ran out of memory' in d for d in details)
  hint = (
    ''
    if oom
    else (
      '; a worker killed without a traceback of its own is most often the '
      "kernel's out-of-memory killer, see dmesg"
    )
  )
  text = (
    f'Lost worker {", ".join(lost)} during {during}: it no longer accepts '
    f'connections (the process died or its host is down{hint}).'
  )
  if details:
    text += ' ' + '; '.join(d[0].upper() + d[1:] for d in details) + '.'
  return text


def Restore(ckpt, train_dir, cluster):
  """ckpt.Restore() (the resumed step or None), naming a remote worker lost
  while the checkpoint is read (`RaiseIfWorkerLost`)."""
  during = 'the restore of the checkpoint'
  try:
    return ckpt.Restore()
  except tf.errors.OpError as e:
    RaiseIfWorkerLost(e, train_dir, cluster, during=during)
    raise
  except checkpointer.CheckpointError as e:
    if isinstance(e.__cause__, tf.errors.OpError):
      RaiseIfWorkerLost(e.__cause__, train_dir, cluster, during=during)
    raise


# TensorFlow's Python INFO lines that are noise in the trainer's log: its
# checkpoint saver's timing at every save, and the ~20-line session config
# that connecting to remote workers (--cluster_spec) dumps.
_NOISE = ('Sharding callback duration', 'default session config:')


class _DropNoise(std_logging.Filter):
  """Drops the log records whose message starts with one of `_NOISE`."""

  def filter(self, record):
    return not record.getMessage().startswith(_NOISE)


_DROP_NOISE = _DropNoise()


# TensorFlow's native (C++) warnings that come before an error the trainer
# reports in its own line, and repeat it: a failed op (a save on a full
# disk), a step's rendezvous aborting, a remote worker gone (with the gRPC
# details on the lines that follow).
NATIVE_NOISE = (
  b'OP_REQUIRES failed at ',
  b'Local rendezvous is aborting',
  b'Failed to register function remotely',
  b'Additional GRPC error information',
)


def FilterNativeLog():
  """Drops the `NATIVE_NOISE` lines from the process's stderr (the binary
  calls it when it starts; TF_CPP_MIN_LOG_LEVEL=0 shows them)."""
  quiet_start.FilterStderr(NATIVE_NOISE)


def SetUpLogging():
  """The trainer's log filters, in one place: drops TensorFlow's `_NOISE`
  lines (its Python logger's records reach absl's handler)."""
  for logger in (tf.get_logger(), logging.get_absl_logger()):
    if _DROP_NOISE not in logger.filters:
      logger.addFilter(_DROP_NOISE)
