"""`python ARGS` for the tests, forked from a warm Python.

Each test process keeps one fork server (`lingvo_gpipe.core.fork_server`)
that has imported TensorFlow and the trainer once; a command the tests
would start as `[sys.executable, ...]` is forked from it instead of paying
for a fresh Python and TensorFlow (about 4 s of CPU each on 2 cores). The
run is still a process of its own, started before TensorFlow has run any op
(so CPU allocator statistics switched on in it count from zero): its own
pid, arguments, environment, working directory, streams and exit status.

    res = warm_python.Run([sys.executable, 'tools/plan.py', '--help'],
                          env=env, cwd=REPO, timeout=60)   # CompletedProcess
    proc = warm_python.Popen([sys.executable, '-m', 'lingvo_gpipe.trainer',
                              ...], stdout=fd, stderr=fd)  # .poll/.wait/.kill

`python -m MODULE` runs `MODULE.main()` (every module the tests run so has
one); `python PATH` and `python -c CODE` run the script as `__main__`.

A command starts fresh where the warm one would differ: TensorFlow's
native (C++) log level is read when TensorFlow is imported, and the import
path when Python starts, so a run whose environment sets another
TF_CPP_MIN_LOG_LEVEL than the server's, or a PYTHONPATH folder the server
lacks, starts fresh; so does every run when LINGVO_GPIPE_TEST_FORK=0 (or
when the fork server cannot start).
"""

import os
import pathlib
import runpy
import subprocess
import sys
import threading

from lingvo_gpipe.core import fork_server

REPO = pathlib.Path(__file__).resolve().parents[2]
# What the warm Python has imported before it forks a run.
_WARM = ('lingvo_gpipe.trainer', 'params')
_LOG_LEVEL = '2'


def ServerEnv():
  """The warm Python's environment: this process's, with TensorFlow's
  native log level at 2 and this checkout first on PYTHONPATH."""
  path = os.environ.get('PYTHONPATH', '')
  return dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL=_LOG_LEVEL,
    PYTHONPATH=str(REPO) + (os.pathsep + path if path else ''),
  )


def Server(env):
  """The test process's fork server, or None where a run with `env` starts
  fresh."""
  if os.environ.get('LINGVO_GPIPE_TEST_FORK', '1') == '0':
    return None
  if env.get('TF_CPP_MIN_LOG_LEVEL') != _LOG_LEVEL:
    return None
  # The server's import path is set: a run that looks elsewhere (a user's
  # package on PYTHONPATH) starts fresh.
  paths = ServerEnv()['PYTHONPATH'].split(os.pathsep)
  if not set(env.get('PYTHONPATH', '').split(os.pathsep)) <= {'', *paths}:
    return None
  return fork_server.Shared(_WARM, env=ServerEnv())


def _Request(cmd):
  """(module, argv) for the fork server from `[python, ...]`."""
  if cmd[0] != sys.executable:
    raise ValueError(f'Not a command of this Python: {cmd[0]!r}.')
  if cmd[1] == '-m':
    return cmd[2], list(cmd[3:])
  return __name__, list(cmd[1:])


def Popen(cmd, env=None, cwd=None, stdout=None, stderr=None):
  """A forked run of `cmd` writing to the file descriptors `stdout` and
  `stderr` (default: this process's), else a `subprocess.Popen`."""
  env = dict(os.environ if env is None else env)
  server = Server(env)
  if server is None:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
  return _Start(server, cmd, env, cwd, stdout, stderr)


def _Start(server, cmd, env, cwd, stdout, stderr):
  module, argv = _Request(cmd)
  cwd = str(cwd or os.getcwd())
  return server.Start(module, argv, env, cwd, stdout, stderr)


def _Read(fd, out, key):
  with os.fdopen(fd, 'rb') as f:
    out[key] = f.read().decode(errors='replace')


def Run(cmd, env=None, cwd=None, timeout=None):
  """Runs `cmd` to its end, its output captured as text, as
  `subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout,
  capture_output=True, text=True)` does."""
  env = dict(os.environ if env is None else env)
  server = Server(env)
  if server is None:
    return subprocess.run(
      cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
  (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
  try:
    proc = _Start(server, cmd, env, cwd, out_w, err_w)
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
  return subprocess.CompletedProcess(cmd, code, got['out'], got['err'])


def main():
  """In the forked child: runs `python PATH ARGS` or `python -c CODE ARGS`
  (sys.argv holds what followed `python`)."""
  args = sys.argv[1:]
  if args[0] == '-c':
    sys.argv = ['-c', *args[2:]]
    sys.path.insert(0, '')
    code = compile(args[1], '<string>', 'exec')
    exec(code, {'__name__': '__main__', '__builtins__': __builtins__})  # pylint: disable=exec-used
  else:
    sys.argv = list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name='__main__')
  return 0
