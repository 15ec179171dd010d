"""The tree keeps one style: `ruff format` and `ruff check` (see ruff.toml)."""

import os
import shutil
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _Ruff():
  exe = shutil.which('ruff') or os.path.join(
    os.path.dirname(sys.executable), 'ruff'
  )
  if not os.path.exists(exe):
    pytest.fail('ruff is not installed: pip install -e ".[cpu,test]".')
  return exe


@pytest.mark.parametrize('args', [['format', '--check'], ['check']])
def testTreePassesRuff(args):
  out = subprocess.run(
    [_Ruff(), *args, '.'],
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, (
    f'`ruff {" ".join(args)} .` fails; run `ruff format . && ruff check '
    f'--fix .` and commit:\n{out.stdout}{out.stderr}'
  )
