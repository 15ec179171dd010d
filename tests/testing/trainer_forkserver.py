"""A warm trainer for the tests: forks a trainer run per request.

Starting the trainer binary costs about 4 s on a 2-core host, nearly all of
it importing TensorFlow (which imports Keras, scikit-learn and matplotlib);
a run of a tiny model then takes under a second. This process imports the
trainer once, runs no TensorFlow op (so no runtime, no thread exists yet),
and serves requests on a Unix socket: each is the trainer's arguments, its
environment and working directory, and the run's stdout and stderr (passed
as file descriptors). For each it forks a child that becomes that trainer
run, exactly as `python -m lingvo_gpipe.trainer ARGS` would run from here:
the child parses the flags, sets up its devices, trains and exits with the
trainer's status. The server answers with the child's pid, then with its
exit status (negative: the signal that ended it), as `subprocess` reports
one.

    python -m tests.testing.trainer_forkserver SOCKET_PATH

The server is single-threaded (a fork copies only the calling thread), and
exits when the process that started it is gone.
"""

import json
import os
import selectors
import socket
import sys
import traceback


def _Child(conn, listener, request, fds):
  """Becomes the trainer run of `request`; never returns."""
  code = 1
  try:
    conn.close()
    listener.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
      os.close(fd)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    sys.argv = ['lingvo_gpipe.trainer', *request['argv']]
    from lingvo_gpipe import trainer  # pylint: disable=g-import-not-at-top

    try:
      trainer.main()
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(code)  # pylint: disable=protected-access


def Serve(path):
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  parent = os.getppid()
  from lingvo_gpipe import trainer  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  import params  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import

  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path + '.tmp')
  listener.listen(16)
  os.rename(path + '.tmp', path)  # Ready: the path appears only now.
  sel = selectors.DefaultSelector()
  sel.register(listener, selectors.EVENT_READ)
  running = {}  # pid -> the connection that asked for it
  while os.getppid() == parent:
    for _ in sel.select(timeout=0.05):
      conn, _ = listener.accept()
      data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
      request = json.loads(data.decode())
      pid = os.fork()
      if pid == 0:
        _Child(conn, listener, request, fds)
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


if __name__ == '__main__':
  Serve(sys.argv[1])
