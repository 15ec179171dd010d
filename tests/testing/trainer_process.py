"""Runs the trainer binary in a subprocess, as a user would, for the tests.

Each run is bounded by a timeout; `Proc` runs one in the background and is
always killed on `Close()`.

A run is forked from a warm trainer (`lingvo_gpipe.core.fork_server`, one
per test process, started at the first run) instead of starting Python and
TensorFlow anew: the same binary, arguments, environment and working
directory, its own process, pid, signals and exit status, in a fraction of
the time. Runs that need TensorFlow's native warnings (read when TensorFlow
is imported), or any run when LINGVO_GPIPE_TEST_FORK=0, start a fresh
process.
"""

import os
import pathlib
import subprocess
import sys
import threading
import time

from lingvo_gpipe.core import fork_server
from lingvo_gpipe.runners import checkpointer

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = 'image.digits.MlpDigitsTiny'
TIMEOUT = 120


def Cmd(*args, model=MODEL):
  return [
    sys.executable,
    '-m',
    'lingvo_gpipe.trainer',
    f'--model={model}',
    '--num_cpu_devices=2',
    '--run_locally=cpu',
    *args,
  ]


def Env(native_warnings=False):
  """The trainer's environment; `native_warnings`: TensorFlow's C++
  warnings show, as for a user (TF_CPP_MIN_LOG_LEVEL unset)."""
  path = os.environ.get('PYTHONPATH', '')
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL='2',
    PYTHONPATH=str(REPO) + (os.pathsep + path if path else ''),
  )
  if native_warnings:
    del env['TF_CPP_MIN_LOG_LEVEL']
  return env


# What the warm trainer has imported before it forks a run.
_WARM = ('lingvo_gpipe.trainer', 'params')


def _Server():
  """The test process's warm trainer (lingvo_gpipe.core.fork_server; None
  when runs start fresh)."""
  if os.environ.get('LINGVO_GPIPE_TEST_FORK', '1') == '0':
    return None
  return fork_server.Shared(_WARM, env=Env())


def _Start(argv, stdout_fd, stderr_fd, native_warnings=False):
  """A forked run when the fork server serves, else None."""
  server = None if native_warnings else _Server()
  if server is None:
    return None
  return server.Start(argv[2], argv[3:], Env(), str(REPO), stdout_fd, stderr_fd)


def _Read(fd, out, key):
  with os.fdopen(fd, 'rb') as f:
    out[key] = f.read().decode(errors='replace')


def Run(*args, model=MODEL, timeout=TIMEOUT):
  argv = Cmd(*args, model=model)
  if _Server() is None:
    return subprocess.run(
      argv, cwd=REPO, env=Env(), capture_output=True, text=True, timeout=timeout
    )
  (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
  try:
    proc = _Start(argv, out_w, err_w)
  finally:
    os.close(out_w)
    os.close(err_w)
  got = {}
  readers = [
    threading.Thread(target=_Read, args=(out_r, got, 'out')),
    threading.Thread(target=_Read, args=(err_r, got, 'err')),
  ]
  for r in readers:
    r.start()
  try:
    code = proc.wait(timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait(30)
    raise
  finally:
    for r in readers:
      r.join()
  return subprocess.CompletedProcess(argv, code, got['out'], got['err'])


class Proc:
  """A background trainer whose stderr goes to a file; always killed."""

  def __init__(self, log_path, *args, native_warnings=False):
    self.log_path = log_path
    self._log = open(log_path, 'w')
    argv = Cmd(*args)
    fd = self._log.fileno()
    self.proc = _Start(argv, fd, fd, native_warnings) or subprocess.Popen(
      argv,
      cwd=REPO,
      env=Env(native_warnings),
      stdout=self._log,
      stderr=subprocess.STDOUT,
    )

  def Log(self):
    with open(self.log_path) as f:
      return f.read()

  def WaitFor(self, predicate, timeout=TIMEOUT):
    deadline = time.time() + timeout
    while time.time() < deadline:
      if predicate():
        return
      if self.proc.poll() is not None:
        raise AssertionError(
          f'Trainer exited early ({self.proc.returncode}):'
          f'\n{self.Log()[-3000:]}'
        )
      time.sleep(0.05)
    raise AssertionError(f'Timed out waiting; log:\n{self.Log()[-3000:]}')

  def Close(self):
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait(timeout=30)
    self._log.close()


def ErrorLine(stderr):
  """The one ERROR line of a failed run's stderr (asserting there is one
  and no traceback)."""
  lines = [ln for ln in stderr.splitlines() if ln.startswith('ERROR:')]
  assert len(lines) == 1, stderr[-3000:]
  assert 'Traceback' not in stderr, stderr[-3000:]
  return lines[0]


def Latest(train_dir):
  """The step of the checkpoint the pointer names (-1: none)."""
  latest = checkpointer.LatestCheckpoint(str(train_dir))
  return checkpointer.StepOf(latest) if latest else -1
