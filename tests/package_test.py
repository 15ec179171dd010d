"""`import lingvo_gpipe` without TensorFlow names the extra to install."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Hides TensorFlow as an uninstalled package does: the import system finds
# no spec for it (sys.modules[name] = None is how Python marks a module as
# absent).
_NO_TF = "import sys; sys.modules['tensorflow'] = None"


def _Import(prelude, then='import lingvo_gpipe'):
  return subprocess.run(
    [sys.executable, '-c', f'{prelude}\n{then}'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )


def _OneLine(out):
  assert out.returncode == 1, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr  # No traceback before it.
  return lines[0]


def testImportWithoutTensorFlowNamesTheExtraInOneLine():
  line = _OneLine(_Import(_NO_TF))
  assert line.startswith('ImportError: lingvo_gpipe needs TensorFlow')
  assert '"lingvo_gpipe[cpu]"' in line and '"lingvo_gpipe[gpu]"' in line


def testTrainerAndToolsWithoutTensorFlowSayTheSameLine():
  trainer = "import runpy; runpy.run_module('lingvo_gpipe.trainer')"
  tool = 'from lingvo_gpipe.tools import plan'
  for then in (trainer, tool):
    line = _OneLine(_Import(_NO_TF, then))
    assert line.startswith('ImportError: lingvo_gpipe needs TensorFlow')


def testMissingTensorFlowIsStillAnImportErrorToCatch():
  then = (
    'try:\n  import lingvo_gpipe\nexcept ImportError as e:\n'
    '  print(type(e).__name__)\nraise ValueError("other errors keep their '
    'traceback")'
  )
  out = _Import(_NO_TF, then)
  assert out.stdout.strip() == 'MissingTensorFlowError'
  assert 'Traceback' in out.stderr and 'ValueError: other errors' in out.stderr


def testImportWithTensorFlow():
  out = _Import('pass')
  assert out.returncode == 0, out.stderr[-2000:]
