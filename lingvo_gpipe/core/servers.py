"""TensorFlow server processes: local ones started for this process, and
whether those of a cluster answer.

* `LocalCluster(n)` starts n TensorFlow server processes on 127.0.0.1 (free
  ports, bounded start-up, always cleaned up); `cluster.Connect(spec)` makes
  their devices `/job:worker/replica:0/task:i/device:CPU:0` usable from this
  process, through TensorFlow's own distributed runtime.
* `UnreachableWorkers(spec)` names the workers that no longer accept
  connections (a worker process that died); `SilentWorkers(spec)` those
  that accept but do not answer; `WaitForWorkers(spec)` waits for all.

`core/cluster.py` re-exports these names: `cluster.LocalCluster` is the
same class.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

from absl import logging

from lingvo_gpipe.core import fork_server

__all__ = [
  'FreePorts',
  'LocalCluster',
  'WorkerDevices',
  'WaitForAddress',
  'WaitForWorkers',
  'UnreachableWorkers',
  'SilentWorkers',
  'Answers',
  'WorkerName',
]

# An HTTP/2 client preface and an empty SETTINGS frame: a live gRPC server
# (a TensorFlow worker) answers with its own SETTINGS frame at once; a stopped
# or wedged process, whose kernel still accepts the connection, says nothing.
_HTTP2_PREFACE = b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' + bytes(
  [0, 0, 0, 4, 0, 0, 0, 0, 0]
)


def WorkerName(job, task, spec):
  return f'/job:{job}/task:{task} ({spec[job][task]})'


def UnreachableWorkers(spec, timeout_s=2.0, skip=None):
  """Names of the tasks of `spec` that do not accept connections."""
  bad = []
  for job, addresses in spec.items():
    for i, address in enumerate(addresses):
      if skip == (job, i):
        continue
      try:
        WaitForAddress(address, timeout_s)
      except TimeoutError:
        bad.append(WorkerName(job, i, spec))
  return bad


def Answers(address, timeout_s=3.0):
  """True if the gRPC server at host:port answers within `timeout_s`."""
  host, port = address.rsplit(':', 1)
  try:
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
      s.settimeout(timeout_s)
      s.sendall(_HTTP2_PREFACE)
      return len(s.recv(9)) > 0
  except OSError:  # Refused, reset, or no answer in time.
    return False


def SilentWorkers(spec, timeout_s=3.0, skip=None):
  """Names of the tasks of `spec` that accept connections but do not answer
  (stopped, swapping, deadlocked). Probed in parallel."""
  tasks = [
    (job, i, address)
    for job, addresses in spec.items()
    for i, address in enumerate(addresses)
    if skip != (job, i)
  ]
  results = [None] * len(tasks)

  def Probe(k):
    results[k] = Answers(tasks[k][2], timeout_s)

  threads = [
    threading.Thread(target=Probe, args=(k,), daemon=True)
    for k in range(len(tasks))
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout_s + 2)
  return [
    WorkerName(job, i, spec)
    for (job, i, _), ok in zip(tasks, results)
    if not ok
  ]


def FreePorts(n):
  """`n` distinct free TCP ports on 127.0.0.1."""
  socks, ports = [], []
  for _ in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(('127.0.0.1', 0))
    socks.append(s)
    ports.append(s.getsockname()[1])
  for s in socks:
    s.close()
  return ports


def WaitForAddress(address, timeout_s):
  """Blocks until host:port accepts TCP connections; raises on timeout."""
  host, port = address.rsplit(':', 1)
  deadline = time.time() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return
    except OSError as e:
      if time.time() > deadline:
        raise TimeoutError(
          f'Worker at {address} is not reachable after {timeout_s:.0f} s '
          f'({e}). Check that its tf_server process runs and that the '
          'address in the cluster spec is right.'
        ) from e
      time.sleep(0.1)


def WaitForWorkers(spec, timeout_s, skip=None, report_every_s=5.0):
  """Blocks until every task of `spec` (but `skip`, a (job, index)) accepts
  TCP connections, logging every `report_every_s` seconds which are still
  missing; raises TimeoutError naming them after `timeout_s`."""
  pending = [
    (job, i, address)
    for job, addresses in spec.items()
    for i, address in enumerate(addresses)
    if (job, i) != skip
  ]
  total = len(pending)
  start = time.time()
  next_report = start + report_every_s
  errors = {}
  while pending:
    still = []
    for job, i, address in pending:
      host, port = address.rsplit(':', 1)
      try:
        with socket.create_connection((host, int(port)), timeout=1.0):
          pass
      except OSError as e:
        errors[(job, i)] = e
        still.append((job, i, address))
    pending = still
    if not pending:
      return
    now = time.time()
    if now - start > timeout_s:
      job, i, address = pending[0]
      others = ''
      if len(pending) > 1:
        others = (
          ' Also unreachable: '
          + ', '.join(f'{j}:{k} ({a})' for j, k, a in pending[1:])
          + '.'
        )
      raise TimeoutError(
        f'{job}:{i}: Worker at {address} is not reachable after '
        f'{timeout_s:.0f} s ({errors[(job, i)]}).{others} Check that its '
        'tf_server process runs and that the address in the cluster spec is '
        'right.'
      )
    if now >= next_report:
      logging.info(
        'Waiting for %d of %d workers (%.0f s of %.0f s): %s',
        len(pending),
        total,
        now - start,
        timeout_s,
        ', '.join(f'{j}:{k} ({a})' for j, k, a in pending),
      )
      next_report = now + report_every_s
    time.sleep(0.2)


def WorkerDevices(num_tasks, job='worker', device='CPU'):
  return [
    f'/job:{job}/replica:0/task:{i}/device:{device}:0' for i in range(num_tasks)
  ]


# A worker's binary, and what its fork server imports before it forks one.
_WORKER_MODULE = 'lingvo_gpipe.runners.tf_server'
_WARM_MODULES = (
  'tensorflow',
  _WORKER_MODULE,
  'lingvo_gpipe.runners.device_memory',
)


class LocalCluster:
  """n TensorFlow server processes on 127.0.0.1.

  with cluster.LocalCluster(2, intra_op_threads=1) as c:
    cluster.Connect(c.cluster_spec)
    devices = c.devices   # ['/job:worker/replica:0/task:0/device:CPU:0', ..]
  """

  def __init__(
    self,
    num_workers,
    intra_op_threads=1,
    inter_op_threads=1,
    startup_timeout_s=120,
    job='worker',
    pin_cpus=False,
    memory_stats=False,
    memory_limit_mb=None,
    profiler=False,
    warm_start=True,
  ):
    """Args:
    num_workers: number of server processes.
    intra_op_threads: threads one op may use in a worker.
    inter_op_threads: ops a worker may run at once (also the threads that
      finish transfers).
    startup_timeout_s: bound on the start-up of each worker.
    job: job name.
    pin_cpus: pin worker i to CPU core i mod cores, so that a worker
      computes on one core like one accelerator, whatever its threads.
    memory_stats: each worker counts its allocations and serves its memory
      figures on `status_addresses[i]` (lingvo_gpipe.runners.device_memory).
    memory_limit_mb: with memory_stats, each worker refuses allocations
      beyond this many MiB, like an accelerator of that memory.
    profiler: each worker serves TensorFlow's profiler on
      `profiler_addresses[i]` (for tf.profiler.experimental.client.trace;
      with memory_stats the trace has every allocation, see
      tools/memory_trace.py).
    warm_start: fork the workers from one process that has imported
      TensorFlow (`core/fork_server.py`, shared by this process's local
      clusters) instead of starting each anew: a fresh start costs about 4 s
      of CPU, nearly all of it importing TensorFlow. Each worker is still a
      process of its own; LINGVO_GPIPE_FORK_SERVER=0 starts them fresh.
    """
    self.num_workers = num_workers
    self._pin = pin_cpus
    self.job = job
    self._threads = (intra_op_threads, inter_op_threads)
    self._timeout = startup_timeout_s
    self._procs = []
    self._warm = warm_start
    self._memory = (memory_stats or bool(memory_limit_mb), memory_limit_mb)
    n = num_workers
    ports = FreePorts(n * (1 + bool(self._memory[0]) + bool(profiler)))
    self.addresses = [f'127.0.0.1:{p}' for p in ports[:n]]
    # The HTTP memory-status endpoint of each worker (empty without stats).
    rest = ports[n:]
    if self._memory[0]:
      self.status_addresses, rest = (
        [f'127.0.0.1:{p}' for p in rest[:n]],
        rest[n:],
      )
    else:
      self.status_addresses = []
    # The profiler service of each worker (empty without profiler).
    self.profiler_addresses = [f'127.0.0.1:{p}' for p in rest]
    self.cluster_spec = {job: list(self.addresses)}

  @property
  def devices(self):
    return WorkerDevices(self.num_workers, self.job)

  def Start(self):
    for i in range(self.num_workers):
      self._procs.append(self._Launch(i))
    try:
      for i in range(self.num_workers):
        self._WaitReady(i)
    except BaseException:
      self.Stop()
      raise
    return self

  def Command(self, task):
    """The command line of worker `task` (what tools/local_cluster prints)."""
    return [sys.executable, '-m', _WORKER_MODULE, *self._Args(task)]

  def _Args(self, task):
    """Worker `task`'s arguments to `_WORKER_MODULE`."""
    cmd = [
      f'--cluster_spec={json.dumps(self.cluster_spec)}',
      f'--job_name={self.job}',
      f'--task_index={task}',
      f'--intra_op_threads={self._threads[0]}',
      f'--inter_op_threads={self._threads[1]}',
    ]
    if self._memory[0]:
      port = self.status_addresses[task].rsplit(':', 1)[1]
      cmd += ['--allocator_stats', f'--status_port={port}']
      if self._memory[1]:
        cmd.append(f'--memory_limit_mb={int(self._memory[1])}')
    if self.profiler_addresses:
      port = self.profiler_addresses[task].rsplit(':', 1)[1]
      cmd.append(f'--profiler_port={port}')
    if self._pin:
      cores = sorted(os.sched_getaffinity(0))
      cmd.append(f'--cpus={cores[task % len(cores)]}')
    return cmd

  def _Launch(self, task):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    server = fork_server.Shared(_WARM_MODULES, env) if self._warm else None
    if server is not None:
      read, write = os.pipe()
      null = os.open(os.devnull, os.O_WRONLY)
      try:
        proc = server.Start(
          _WORKER_MODULE, self._Args(task), env, None, null, write
        )
        proc.stderr = os.fdopen(read, 'rb')
        return proc
      except OSError:  # The server is gone: start this worker afresh.
        os.close(read)
      finally:
        os.close(write)
        os.close(null)
    return subprocess.Popen(
      self.Command(task),
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      preexec_fn=fork_server.DieWithParent,
    )

  def _WaitReady(self, task):
    address = self.addresses[task]
    WaitForAddress(address, self._timeout)
    if self._procs[task].poll() is not None:
      err = self._procs[task].stderr.read().decode(errors='replace')[-2000:]
      raise RuntimeError(f'Worker {task} at {address} exited: {err}')

  def Restart(self, task):
    """Starts worker `task` again (after Kill), on the same address."""
    if self._procs[task].poll() is None:
      raise RuntimeError(f'Worker {task} is still running; Kill it first.')
    if self._procs[task].stderr:
      self._procs[task].stderr.close()
    self._procs[task] = self._Launch(task)
    self._WaitReady(task)

  @property
  def pids(self):
    """Process ids of the workers."""
    return [p.pid for p in self._procs]

  def Alive(self):
    """[bool] per worker."""
    return [p.poll() is None for p in self._procs]

  def Kill(self, task):
    """Kills worker `task` (fault-injection in tests)."""
    self._procs[task].kill()
    self._procs[task].wait(timeout=30)

  def Stop(self):
    for p in self._procs:
      if p.poll() is None:
        p.terminate()
    deadline = time.time() + 10
    for p in self._procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
      if p.stderr:
        p.stderr.close()
    self._procs = []

  def __enter__(self):
    return self.Start()

  def __exit__(self, *unused):
    self.Stop()
