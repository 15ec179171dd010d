"""tests/testing/warm_python.py: a command forked from the test process's
warm Python behaves as `python ARGS` started afresh would."""

import os
import sys
import textwrap

import pytest

from tests.testing import warm_python

_SCRIPT = textwrap.dedent("""\
  import os, sys
  import sibling
  print('argv', sys.argv, 'cwd', os.getcwd(), 'env', os.environ.get('WP_TEST'))
  print('parent', os.getppid(), 'sibling', sibling.VALUE)
  print('to stderr', file=sys.stderr)
  sys.exit(int(sys.argv[1]))
  """)


def _Parent(res):
  line = [ln for ln in res.stdout.splitlines() if ln.startswith('parent')][0]
  return int(line.split()[1])


@pytest.fixture
def script(tmp_path):
  (tmp_path / 'sibling.py').write_text('VALUE = 7\n')
  (tmp_path / 'prog.py').write_text(_SCRIPT)
  return tmp_path / 'prog.py'


def testScriptRunsForkedWithItsArgumentsEnvironmentAndStatus(script, tmp_path):
  if os.environ.get('LINGVO_GPIPE_TEST_FORK', '1') == '0':
    pytest.skip('LINGVO_GPIPE_TEST_FORK=0: runs start fresh processes.')
  env = dict(os.environ, WP_TEST='x')
  res = warm_python.Run(
    [sys.executable, str(script), '3', 'b'], env=env, cwd=tmp_path, timeout=60
  )
  assert res.returncode == 3, res.stderr
  assert f"argv ['{script}', '3', 'b'] cwd {tmp_path} env x" in res.stdout
  assert 'sibling 7' in res.stdout  # The script's folder is on the path.
  assert res.stderr == 'to stderr\n'
  server = warm_python.Server(env)
  assert _Parent(res) == server._proc.pid  # pylint: disable=protected-access


def testCodeRunsAsPythonDashC(tmp_path):
  code = 'import sys; print(sys.argv, repr(sys.path[0])); sys.exit(sys.argv[1])'
  res = warm_python.Run([sys.executable, '-c', code, 'bad'], cwd=tmp_path)
  assert res.stdout.startswith("['-c', 'bad'] ''"), res.stdout
  assert res.returncode == 1 and res.stderr == 'bad\n'
  res = warm_python.Run([sys.executable, '-c', 'raise ValueError("v")'])
  assert res.returncode == 1 and 'ValueError: v' in res.stderr


@pytest.mark.parametrize(
  'change',
  [dict(TF_CPP_MIN_LOG_LEVEL='0'), dict(PYTHONPATH='elsewhere')],
  ids=['log_level', 'python_path'],
)
def testRunStartsFreshWhereTheWarmOneWouldDiffer(script, tmp_path, change):
  env = dict(os.environ, **change)
  assert warm_python.Server(env) is None
  res = warm_python.Run(
    [sys.executable, str(script), '0'], env=env, cwd=tmp_path, timeout=120
  )
  assert res.returncode == 0, res.stderr
  assert _Parent(res) == os.getpid()
