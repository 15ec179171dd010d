"""Imports TensorFlow without its start-up banner.

A binary's log should start with what it does, not with TensorFlow's INFO
lines at import ("oneDNN custom operations are on ...", "This TensorFlow
binary is optimized to use available CPU instructions ..."). Setting
TF_CPP_MIN_LOG_LEVEL before the import hides the CPU-feature notice, but not
the oneDNN line: TensorFlow prints it from two of its shared libraries (the
core one, and the profiler plugin that `import tensorflow` also loads), each
with its own copy of the C++ logger, which writes every message to stderr
before it is initialized whatever TF_CPP_MIN_LOG_LEVEL says, each time after
"WARNING: All log messages before absl::InitializeLog() is called are
written to STDERR". So the banner came twice.

`ImportTensorFlow()` sets TF_CPP_MIN_LOG_LEVEL (unless the environment
already does) and imports TensorFlow with file descriptor 2 passed through a
filter that drops those INFO lines and that notice while the level is 1 or
more; every other line passes on at once, in order. TF_CPP_MIN_LOG_LEVEL=0
shows everything. Binaries call it before anything imports TensorFlow:

  from lingvo_gpipe.core import quiet_start
  quiet_start.ImportTensorFlow()
  import tensorflow as tf

`FilterStderr(noise)` keeps such a filter for the rest of the process: it
drops TensorFlow's native (C++) log lines that contain one of `noise`, with
their continuation lines, e.g. the warnings that repeat an error the binary
reports in its own line. `SyncStderr()` waits until what was written before
has passed, so that a last line written to `StderrFd()` comes last.
"""

import contextlib
import os
import re
import sys
import threading

__all__ = [
  'ImportTensorFlow',
  'StderrFd',
  'Dropped',
  'NativeFilter',
  'FilterStderr',
  'SyncStderr',
]

# A C++ INFO line: "I0000 00:00:1795578893.927670   29330 port.cc:153] ...".
_INFO_LINE = re.compile(rb'^I\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] ')
_LOGGER_NOTICE = (
  b'WARNING: All log messages before absl::InitializeLog() is called are '
  b'written to STDERR'
)

# A native (C++) log line: "W0000 00:00:1795.9   29330 op_kernel.cc:1858] ".
_NATIVE_LINE = re.compile(
  rb'^[IWEF]\d{4} [\d:.]+ +\d+ [\w.-]+\.(?:cc|h|c):\d+\] '
)
# Any log line, native or Python (absl).
_LOG_LINE = re.compile(rb'^[IWEF]\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] ')
_SYNC = b'\x00quiet_start-sync\n'

# While the filter runs: a descriptor of the real stderr.
_real_stderr = None
# The filter of `FilterStderr`, once it runs.
_permanent = None


def StderrFd():
  """A file descriptor of the process's real stderr, also while
  `ImportTensorFlow` filters descriptor 2 (e.g. for a signal handler that
  writes its last line and ends the process at once)."""
  return _real_stderr if _real_stderr is not None else 2


def _MinLogLevel():
  try:
    return int(os.environ.get('TF_CPP_MIN_LOG_LEVEL', '0'))
  except ValueError:
    return 0


def Dropped(line):
  """Whether the filter drops `line` (bytes, without its newline)."""
  return line.startswith(_LOGGER_NOTICE) or bool(_INFO_LINE.match(line))


def _WriteAll(fd, data):
  while data:
    data = data[os.write(fd, data) :]


def _Forward(read_fd, out_fd):
  """Copies the lines of pipe `read_fd` to `out_fd`, less the dropped ones,
  until the pipe closes."""
  rest = b''
  while True:
    chunk = os.read(read_fd, 65536)
    if not chunk:
      break
    *lines, rest = (rest + chunk).split(b'\n')
    kept = b''.join(line + b'\n' for line in lines if not Dropped(line))
    _WriteAll(out_fd, kept)
  if rest and not Dropped(rest):
    _WriteAll(out_fd, rest)
  os.close(read_fd)


class NativeFilter:
  """Drops native log lines containing one of `noise` (bytes), and the
  lines that continue them (up to the next log line)."""

  def __init__(self, noise):
    self._noise = tuple(noise)
    self._dropping = False

  def Keep(self, line):
    """Whether `line` (bytes, without its newline) passes."""
    if _LOG_LINE.match(line):
      self._dropping = bool(_NATIVE_LINE.match(line)) and any(
        n in line for n in self._noise
      )
    elif line.startswith(b'ERROR:'):
      self._dropping = False
    return not self._dropping


class _Permanent:
  """Forwards descriptor 2 through a NativeFilter for the rest of the
  process; `Sync` waits until what was written before has passed."""

  def __init__(self, noise):
    self.filter = NativeFilter(noise)
    self._synced = threading.Condition()
    self._syncs = 0
    sys.stderr.flush()
    self.real = os.dup(2)
    read_fd, write_fd = os.pipe()
    threading.Thread(
      target=self._Forward, args=(read_fd,), name='stderr_filter', daemon=True
    ).start()
    os.dup2(write_fd, 2)
    os.close(write_fd)

  def _Forward(self, read_fd):
    rest = b''
    while True:
      chunk = os.read(read_fd, 65536)
      if not chunk:
        return
      *lines, rest = (rest + chunk).split(b'\n')
      kept, syncs = [], 0
      for line in lines:
        if line.endswith(_SYNC[:-1]):
          syncs += 1
          line = line[: -len(_SYNC) + 1]
          if not line:
            continue
        if self.filter.Keep(line):
          kept.append(line + b'\n')
      _WriteAll(self.real, b''.join(kept))
      if syncs:
        with self._synced:
          self._syncs += syncs
          self._synced.notify_all()

  def Sync(self, timeout):
    sys.stderr.flush()
    with self._synced:
      want = self._syncs + 1
      os.write(2, _SYNC)
      self._synced.wait_for(lambda: self._syncs >= want, timeout)


def FilterStderr(noise):
  """For the rest of the process, drops the native log lines that contain
  one of `noise` (bytes) from descriptor 2, with their continuation lines
  (not with TF_CPP_MIN_LOG_LEVEL=0, which shows everything). Idempotent."""
  global _permanent, _real_stderr
  if _permanent is None and _MinLogLevel() >= 1 and _real_stderr is None:
    _permanent = _Permanent(noise)
    _real_stderr = _permanent.real


def SyncStderr(timeout=2.0):
  """Waits (at most `timeout` s) until what this process wrote to stderr
  has passed `FilterStderr`'s filter, so that a line written next to
  `StderrFd()` comes after it."""
  if _permanent is not None:
    _permanent.Sync(timeout)


@contextlib.contextmanager
def _FilteredStderr():
  """Descriptor 2 goes through `Dropped` while the context is open."""
  global _real_stderr
  sys.stderr.flush()
  real = os.dup(2)
  read_fd, write_fd = os.pipe()
  forward = threading.Thread(
    target=_Forward, args=(read_fd, real), name='stderr_filter', daemon=True
  )
  forward.start()
  os.dup2(write_fd, 2)
  os.close(write_fd)
  _real_stderr = real
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(real, 2)  # Closes the pipe's last write end: the thread ends.
    forward.join()
    _real_stderr = None
    os.close(real)


def ImportTensorFlow(min_log_level='1'):
  """Imports and returns the `tensorflow` module without its banner.

  Args:
    min_log_level: TF_CPP_MIN_LOG_LEVEL to set if the environment has none:
      '1' hides TensorFlow's C++ INFO lines, '2' also its warnings.
  """
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', str(min_log_level))
  if 'tensorflow' in sys.modules or _MinLogLevel() < 1:
    import tensorflow  # pylint: disable=g-import-not-at-top

    return tensorflow
  with _FilteredStderr():
    import tensorflow  # pylint: disable=g-import-not-at-top
  return tensorflow
