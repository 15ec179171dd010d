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
"""

import contextlib
import os
import re
import sys
import threading

__all__ = ['ImportTensorFlow', 'StderrFd', 'Dropped']

# A C++ INFO line: "I0000 00:00:1795578893.927670   29330 port.cc:153] ...".
_INFO_LINE = re.compile(rb'^I\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] ')
_LOGGER_NOTICE = (
  b'WARNING: All log messages before absl::InitializeLog() is called are '
  b'written to STDERR'
)

# While the filter runs: a descriptor of the real stderr.
_real_stderr = None


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
