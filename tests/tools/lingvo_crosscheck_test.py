"""tools/lingvo_crosscheck.py: the port of each Lingvo model file in
tools/lingvo_models computes Lingvo 0.12.7's outputs and gradients.

The comparison needs a Lingvo 0.12.7 venv (Python 3.10, TF 2.9): its Python
in LINGVO_PYTHON, else the test is skipped. It is slow (Lingvo's graph
build) and marked so.
"""

import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_TOOL = _ROOT / 'tools' / 'lingvo_crosscheck.py'
_MODELS = sorted((_ROOT / 'tools' / 'lingvo_models').glob('*.py'))


def testPortedSourceChangesOnlyTheImportPrefix(tmp_path):
  model = tmp_path / 'm.py'
  model.write_text(
    'from lingvo.core import gpipe\nimport lingvo.compat as tf\nx = 1\n'
  )
  proc = subprocess.run(
    [
      sys.executable,
      '-c',
      'import runpy, sys; m = runpy.run_path(sys.argv[1]); '
      'print(m["PortedSource"](sys.argv[2]), end="")',
      str(_TOOL),
      str(model),
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  assert proc.stdout == (
    'from lingvo_gpipe.core import gpipe\n'
    'import lingvo_gpipe.compat as tf\nx = 1\n'
  )


@pytest.mark.slow
@pytest.mark.parametrize('via', ['key', 'checkpoint'])
@pytest.mark.parametrize('model', _MODELS, ids=lambda p: p.stem)
def testPortMatchesLingvo(model, via):
  lingvo_python = os.environ.get('LINGVO_PYTHON')
  if not lingvo_python or not os.path.exists(lingvo_python):
    pytest.skip('LINGVO_PYTHON names no Lingvo 0.12.7 venv Python.')
  proc = subprocess.run(
    [
      sys.executable,
      str(_TOOL),
      f'--model={model}',
      f'--lingvo_python={lingvo_python}',
    ]
    + (['--via_checkpoint'] if via == 'checkpoint' else []),
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert 'OK' in proc.stdout.splitlines()[-1]
