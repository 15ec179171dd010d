"""quiet_start.ImportTensorFlow: TensorFlow's start-up banner is dropped,
every other line of stderr passes in order."""

import os
import pathlib
import subprocess
import sys
import textwrap

from lingvo_gpipe.core import quiet_start

ROOT = pathlib.Path(__file__).resolve().parents[2]

_BANNER = 'oneDNN custom operations'
_NOTICE = 'absl::InitializeLog()'

# Lines written to descriptor 2 while TensorFlow imports: kept, dropped, kept.
_PROGRAM = textwrap.dedent(
  """
  import os
  import sys
  from lingvo_gpipe.core import quiet_start
  os.write(2, b'before\\n')
  real = quiet_start._FilteredStderr
  def Noisy():
    context = real()
    context.__enter__()
    os.write(2, b'kept 1\\nI0000 00:00:1.5   7 port.cc:153] an INFO line\\n')
    sys.stderr.write('kept 2\\n')
    os.write(2, b'W0000 00:00:1.5   7 a.cc:1] a warning\\nno newline')
    return context
  context = Noisy()
  context.__exit__(None, None, None)
  quiet_start.ImportTensorFlow()
  os.write(2, b'\\nafter\\n')
  """
)


def _Run(program, level):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  if level is not None:
    env['TF_CPP_MIN_LOG_LEVEL'] = level
  return subprocess.run(
    [sys.executable, '-c', program],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def testDroppedLines():
  assert quiet_start.Dropped(
    b'I0000 00:00:1795578893.927670   29330 port.cc:153] oneDNN custom '
    b'operations are on.'
  )
  assert quiet_start.Dropped(
    b'I1125 03:57:04.124345 140331144780672 cpu_feature_guard.cc:227] x'
  )
  assert quiet_start.Dropped(
    b'WARNING: All log messages before absl::InitializeLog() is called are '
    b'written to STDERR'
  )
  assert not quiet_start.Dropped(
    b'E0000 00:00:1795579054.814406    4037 context.cc:911] Failed'
  )
  assert not quiet_start.Dropped(b'W0000 00:00:1.5   7 a.cc:1] a warning')
  assert not quiet_start.Dropped(b'INFO: a line of a program')
  assert quiet_start.StderrFd() == 2  # No filter running.


def testImportDropsTheBannerAndKeepsTheRestInOrder():
  res = _Run(_PROGRAM, None)
  assert res.returncode == 0, res.stderr[-3000:]
  assert _BANNER not in res.stderr and _NOTICE not in res.stderr, res.stderr
  assert res.stderr == (
    'before\nkept 1\nkept 2\nW0000 00:00:1.5   7 a.cc:1] a warning\n'
    'no newline\nafter\n'
  ), res.stderr


def testLevelZeroShowsTheBanner():
  # The banner the filter drops is really printed by the import.
  res = _Run(
    'from lingvo_gpipe.core import quiet_start\nquiet_start.ImportTensorFlow()',
    '0',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert _BANNER in res.stderr, res.stderr


def testNativeFilterDropsTheNoiseLinesAndTheirContinuations():
  f = quiet_start.NativeFilter([b'Local rendezvous is aborting'])
  lines = [
    b'I1125 21:10:41.471720 1397 checkpointer.py:306] Saved ckpt-5.',
    b'W0000 00:00:1795641009.06 3955 local_rendezvous.cc:412] Local '
    b'rendezvous is aborting with status: UNAVAILABLE: Socket closed',
    b'Additional GRPC error information from remote target /job:worker:',
    b':{"grpc_message":"Socket closed","grpc_status":14}',
    b'W0000 00:00:1795641009.07 3955 other.cc:1] another warning',
    b'a continuation that stays',
    # A Python log line with the same words passes: only native ones go.
    b'W1125 21:10:41.4 1397 train_loop.py:5] Local rendezvous is aborting',
    b'W0000 00:00:1795641009.06 3955 local_rendezvous.cc:412] Local '
    b'rendezvous is aborting with status: CANCELLED',
    b'ERROR: Lost worker /job:worker/task:1 (127.0.0.1:1) ...',
  ]
  assert [ln for ln in lines if f.Keep(ln)] == [
    lines[0],
    lines[4],
    lines[5],
    lines[6],
    lines[8],
  ]
