"""core/fork_server.py: a forked run is `python -m MODULE ARGS` (arguments,
environment, working directory, streams, exit status, signals), and nothing
outlives the process that started the server."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lingvo_gpipe.core import fork_server

_MODULE = textwrap.dedent("""\
  import os, sys, time

  def main():
    env = os.environ.get('FS_TEST')
    print('argv', sys.argv[1:], 'cwd', os.getcwd(), 'env', env)
    print('to stderr', file=sys.stderr)
    if sys.argv[1] == 'sleep':
      time.sleep(60)
    if sys.argv[1] == 'raise':
      raise ValueError('bad run')
    if sys.argv[1] == 'exit':
      sys.exit('exit message')
    return int(sys.argv[1])
  """)


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  path = tmp_path_factory.mktemp('mod')
  (path / 'fs_test_mod.py').write_text(_MODULE)
  env = dict(os.environ, PYTHONPATH=str(path))
  s = fork_server.Server(('fs_test_mod',), env)
  yield s, env
  s.Close()


def _Run(server, argv, cwd):
  s, env = server
  out_r, out_w = os.pipe()
  proc = s.Start(
    'fs_test_mod', argv, dict(env, FS_TEST='x'), str(cwd), out_w, out_w
  )
  os.close(out_w)
  return proc, out_r


def _ReadAll(fd):
  with os.fdopen(fd) as f:
    return f.read()


def testRunGetsItsArgumentsEnvironmentDirectoryStreamsAndStatus(
  server, tmp_path
):
  proc, out = _Run(server, ['3', 'b'], tmp_path)
  assert proc.wait(timeout=30) == 3
  text = _ReadAll(out)
  assert f"argv ['3', 'b'] cwd {tmp_path} env x" in text
  assert 'to stderr' in text
  assert proc.pid != server[0]._proc.pid  # pylint: disable=protected-access


def testAnExceptionIsStatusOneWithItsTraceback(server, tmp_path):
  proc, out = _Run(server, ['raise'], tmp_path)
  assert proc.wait(timeout=30) == 1
  assert 'ValueError: bad run' in _ReadAll(out)


def testSystemExitWithAMessageWritesItAndIsStatusOne(server, tmp_path):
  proc, out = _Run(server, ['exit'], tmp_path)
  assert proc.wait(timeout=30) == 1
  assert 'to stderr\nexit message\n' in _ReadAll(out)


def testASignalIsANegativeStatusAndPollWaits(server, tmp_path):
  proc, out = _Run(server, ['sleep'], tmp_path)
  assert proc.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    proc.wait(timeout=0.2)
  proc.terminate()
  assert proc.wait(timeout=30) == -signal.SIGTERM
  proc.kill()  # A finished run: nothing to signal.
  os.close(out)


_STARTER = textwrap.dedent("""\
  import os, sys
  from lingvo_gpipe.core import fork_server
  s = fork_server.Server(('fs_test_mod',))
  null = os.open(os.devnull, os.O_WRONLY)
  p = s.Start('fs_test_mod', ['sleep'], dict(os.environ), None, null, null)
  print(s._proc.pid, p.pid, flush=True)
  os.kill(os.getpid(), 9)
  """)


def _Alive(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def testNothingOutlivesTheProcessThatStartedTheServer(server):
  _, env = server
  env = dict(env, PYTHONPATH=os.pathsep.join([env['PYTHONPATH'], os.getcwd()]))
  res = subprocess.run(
    [sys.executable, '-c', _STARTER],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  pids = [int(p) for p in res.stdout.split()]
  assert len(pids) == 2, res.stderr[-2000:]
  deadline = time.time() + 10
  while any(_Alive(p) for p in pids) and time.time() < deadline:
    time.sleep(0.05)
  assert not any(_Alive(p) for p in pids)


def testSharedIsOneServerPerModulesStartedAgainIfItDiedAndCanBeTurnedOff(
  monkeypatch,
):
  monkeypatch.delenv('LINGVO_GPIPE_FORK_SERVER', raising=False)
  first = fork_server.Shared(('json',))
  assert first is fork_server.Shared(('json',)) and first.Alive()
  first.Close()
  again = fork_server.Shared(('json',))
  assert again is not first and again.Alive()
  again.Close()
  monkeypatch.setenv('LINGVO_GPIPE_FORK_SERVER', '0')
  assert fork_server.Shared(('json',)) is None
