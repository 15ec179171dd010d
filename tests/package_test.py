"""`import lingvo_gpipe` without TensorFlow names the extra to install."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _Import(prelude):
  return subprocess.run(
    [sys.executable, '-c', f'{prelude}; import lingvo_gpipe'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )


def testImportWithoutTensorFlowNamesTheExtra():
  # sys.modules[name] = None is how Python marks a module as absent.
  out = _Import("import sys; sys.modules['tensorflow'] = None")
  assert out.returncode == 1
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('ImportError: lingvo_gpipe needs TensorFlow')
  assert '"lingvo_gpipe[cpu]"' in last and '"lingvo_gpipe[gpu]"' in last


def testImportWithTensorFlow():
  out = _Import('pass')
  assert out.returncode == 0, out.stderr[-2000:]
