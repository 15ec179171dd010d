"""Warm processes: runs of a module's `main`, forked from a process that has
imported TensorFlow once.

Starting a Python process that imports TensorFlow costs about 4 s of CPU on
a 2-core host (TensorFlow imports Keras, scikit-learn and SciPy); a local
cluster of 8 workers paid that 8 times before its first step. A fork server
is one process that imports the modules it will run, runs no TensorFlow op
(so no runtime and no thread exists yet), and forks a child per request.
Each child becomes `python -m MODULE ARGS` would: its own pid, arguments,
environment, working directory, standard streams, signals and exit status.

    worker = 'lingvo_gpipe.runners.tf_server'
    server = fork_server.Shared(('tensorflow', worker))
    proc = server.Start(worker, ['--task_index=0'], env=os.environ,
                        stdout=fd, stderr=fd)
    proc.poll(); proc.wait(timeout); proc.kill(); proc.pid

`proc` has the surface of `subprocess.Popen` that a caller of a worker
uses. A module run this way must have a `main()` that reads `sys.argv` and
returns (or raises SystemExit with) its exit status.

The server exits when the process that started it exits (however it ends),
and each child when the server exits, so nothing outlives its starter.
`Shared` gives None where a server cannot start (no Unix sockets), or when
LINGVO_GPIPE_FORK_SERVER=0: callers then start a fresh process.

    python -m lingvo_gpipe.core.fork_server SOCKET_PATH MODULE...
"""

import atexit
import ctypes
import importlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

__all__ = ['DieWithParent', 'Forked', 'Server', 'Shared']

# Seconds a server may take to import its modules and listen.
START_TIMEOUT_S = 120


def DieWithParent():
  """SIGKILL this process when its parent exits (Linux; a no-op elsewhere).

  For a child: a local worker outliving the process that started it
  (killed, or crashed before it stopped the worker) would hold its memory and
  ports forever. The kernel ties this to the parent's thread that started
  the child: start children from a thread that lives as long as they do
  (the main thread, or this module's single-threaded server).
  """
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _Child(request, fds, close):
  """Becomes the run of `request`; never returns."""
  code = 1
  try:
    for fd in close:
      os.close(fd)
    DieWithParent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {null, *fds}:
      os.close(fd)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    sys.argv = [request['module'], *request['argv']]
    module = importlib.import_module(request['module'])
    try:
      status = module.main()
      code = status if isinstance(status, int) else 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      if not isinstance(e.code, (int, type(None))):
        print(e.code, file=sys.stderr)  # As Python does: exit('message').
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(code)  # pylint: disable=protected-access


def Serve(path, modules):
  """The server: imports `modules`, then forks a child per request."""
  parent = os.getppid()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for its children.
  # TensorFlow's import banner is for an interactive start, not for every
  # process that starts warm: the imports write to /dev/null (an error in
  # one is written out below, and the server exits).
  sys.stderr.flush()
  real_stderr, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  try:
    for name in modules:
      importlib.import_module(name)
  finally:
    os.dup2(real_stderr, 2)
    os.close(real_stderr)
    os.close(null)
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path + '.tmp')
  listener.listen(64)
  os.rename(path + '.tmp', path)  # Ready: the path appears only now.
  sel = selectors.DefaultSelector()
  sel.register(listener, selectors.EVENT_READ)
  running = {}  # pid -> the connection that asked for it
  while os.getppid() == parent:
    for _ in sel.select(timeout=0.05):
      conn, _ = listener.accept()
      data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
      open_fds = [listener.fileno(), conn.fileno()]
      open_fds += [c.fileno() for c in running.values()]
      pid = os.fork()
      if pid == 0:
        _Child(json.loads(data.decode()), fds, open_fds)
      for fd in fds:
        os.close(fd)
      conn.sendall(f'{pid}\n'.encode())
      running[pid] = conn
    while running:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        break
      if pid == 0:
        break
      conn = running.pop(pid, None)
      if conn is not None:
        try:
          conn.sendall(f'{os.waitstatus_to_exitcode(status)}\n'.encode())
        except OSError:
          pass
        conn.close()


class Forked:
  """A forked run, with the `subprocess.Popen` surface its callers use."""

  def __init__(self, path, module, argv, env, cwd, stdout, stderr):
    self.args = [sys.executable, '-m', module, *argv]
    self.returncode = None
    self.stderr = None
    self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._conn.connect(path)
    request = dict(module=module, argv=list(argv), env=dict(env), cwd=cwd)
    socket.send_fds(
      self._conn, [json.dumps(request).encode()], [stdout, stderr]
    )
    self._pending = b''
    self.pid = int(self._Line(START_TIMEOUT_S))

  def _Line(self, timeout):
    deadline = None if timeout is None else time.time() + timeout
    while b'\n' not in self._pending:
      left = None if deadline is None else max(0.0, deadline - time.time())
      if not select.select([self._conn], [], [], left)[0]:
        raise subprocess.TimeoutExpired(self.args, timeout)
      chunk = self._conn.recv(64)
      if not chunk:
        # The server is gone, and its children with it (DieWithParent).
        return str(-signal.SIGKILL)
      self._pending += chunk
    line, self._pending = self._pending.split(b'\n', 1)
    return line.decode()

  def poll(self):
    if self.returncode is None:
      try:
        self.wait(0)
      except subprocess.TimeoutExpired:
        pass
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None:
      self.returncode = int(self._Line(timeout))
      self._conn.close()
    return self.returncode

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def terminate(self):
    self.send_signal(signal.SIGTERM)


class Server:
  """A fork server process that has imported `modules`."""

  def __init__(self, modules, env=None):
    self.modules = tuple(modules)
    self._dir = tempfile.mkdtemp(prefix='lingvo_gpipe_fork_')
    self.path = os.path.join(self._dir, 'socket')
    self._proc = subprocess.Popen(
      [sys.executable, '-m', __name__, self.path, *self.modules],
      env=dict(os.environ if env is None else env),
      stdin=subprocess.DEVNULL,
      stdout=subprocess.DEVNULL,
    )
    deadline = time.time() + START_TIMEOUT_S
    while not os.path.exists(self.path):
      if self._proc.poll() is not None or time.time() > deadline:
        self.Close()
        raise RuntimeError(f'The fork server for {self.modules} did not start.')
      time.sleep(0.05)

  def Start(self, module, argv, env, cwd=None, stdout=None, stderr=None):
    """Runs `module`'s main with `argv`, as `python -m module argv` would.

    stdout, stderr: file descriptors for the run's streams (default: this
    process's own).
    """
    return Forked(
      self.path,
      module,
      argv,
      env,
      cwd or os.getcwd(),
      sys.stdout.fileno() if stdout is None else stdout,
      sys.stderr.fileno() if stderr is None else stderr,
    )

  def Alive(self):
    return self._proc.poll() is None

  def Close(self):
    if self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait(timeout=30)
    shutil.rmtree(self._dir, ignore_errors=True)


_lock = threading.Lock()
_servers = {}  # modules -> Server, or None where it could not start


def Shared(modules, env=None):
  """This process's fork server for `modules` (started at the first call,
  again if it died; None where it cannot run, or with
  LINGVO_GPIPE_FORK_SERVER=0).

  env: the server's environment (default: this process's); each run gets
  its own environment from `Server.Start`.
  """
  if os.environ.get('LINGVO_GPIPE_FORK_SERVER', '1') == '0':
    return None
  if not hasattr(socket, 'AF_UNIX') or not hasattr(socket, 'send_fds'):
    return None
  modules = tuple(modules)
  with _lock:
    server = _servers.get(modules, False)
    if server is None:  # It could not start before: it will not now.
      return None
    if server is False or not server.Alive():
      try:
        server = Server(modules, env)
        atexit.register(server.Close)
      except (OSError, RuntimeError):
        server = None
      _servers[modules] = server
    return server


if __name__ == '__main__':
  Serve(sys.argv[1], sys.argv[2:])
