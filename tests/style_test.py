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


_MAX_LINES = 500
_REASON = 'Over 500 lines:'


def testLongLibraryModulesSayWhy():
  unexplained, stale = [], []
  for base in ('lingvo_gpipe', 'params'):
    for dirpath, _, names in os.walk(os.path.join(_ROOT, base)):
      for name in sorted(names):
        if not name.endswith('.py'):
          continue
        path = os.path.join(dirpath, name)
        with open(path, encoding='utf-8') as f:
          lines = f.read().split('\n')
        says = any(line.startswith(_REASON) for line in lines[:8])
        where = f'{os.path.relpath(path, _ROOT)} ({len(lines)})'
        if len(lines) > _MAX_LINES and not says:
          unexplained.append(where)
        elif len(lines) <= _MAX_LINES and says:
          stale.append(where)
  assert not stale, (
    f'Modules of at most {_MAX_LINES} lines that still say "{_REASON}": '
    f'{stale}; drop the sentence.'
  )
  assert not unexplained, (
    f'Modules over {_MAX_LINES} lines without a reason: {unexplained}. '
    f'Split them by concept, or put a line "{_REASON} <why>" right after '
    'the summary line of the module docstring.'
  )
