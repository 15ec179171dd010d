"""Runs the trainer binary in a subprocess, as a user would, for the tests.

Each run is bounded by a timeout; `Proc` runs one in the background and is
always killed on `Close()`.

A run is forked from the test process's warm Python (`warm_python`)
instead of starting Python and TensorFlow anew: the same binary, arguments,
environment and working directory, its own process, pid, signals and exit
status, in a fraction of the time. Runs that need TensorFlow's native
warnings (read when TensorFlow is imported), or any run when
LINGVO_GPIPE_TEST_FORK=0, start a fresh process.
"""

import pathlib
import sys
import time

from lingvo_gpipe.runners import checkpointer
from tests.testing import warm_python

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
  warnings show, as for a user (TF_CPP_MIN_LOG_LEVEL unset; such a run
  starts fresh)."""
  env = warm_python.ServerEnv()
  if native_warnings:
    del env['TF_CPP_MIN_LOG_LEVEL']
  return env


def Server():
  """The test process's warm Python (None when runs start fresh)."""
  return warm_python.Server(Env())


def Run(*args, model=MODEL, timeout=TIMEOUT):
  return warm_python.Run(Cmd(*args, model=model), Env(), REPO, timeout)


class Proc:
  """A background trainer whose stderr goes to a file; always killed."""

  def __init__(self, log_path, *args, native_warnings=False):
    self.log_path = log_path
    self._log = open(log_path, 'w')
    fd = self._log.fileno()
    self.proc = warm_python.Popen(
      Cmd(*args), Env(native_warnings), REPO, stdout=fd, stderr=fd
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
