"""Devices and clusters: where pipeline cells and replicas run.

Over 500 lines: device discovery, CPU/GPU splits and local TensorFlow servers
are the one "where things run" concept.

* `Cluster` (Lingvo's cluster, from the trainer's flags) knows the devices of
  this job: local CPUs (split into `num_cpu_devices` virtual devices for
  development), local GPUs (optionally split into logical GPUs), or the
  devices of remote TensorFlow workers (`cluster_spec` or `TF_CONFIG`). It
  hands out the device of each (replica, stage): `StageDevices()`.
* `SplitCpu(n)` / `SplitGpu(n)` split the host CPU / the first GPU into n
  logical devices. Call them before TensorFlow runs any op.
* `LocalCluster(n)` starts n TensorFlow server processes on 127.0.0.1 (free
  ports, bounded start-up, always cleaned up) and `Connect(spec)` makes their
  devices `/job:worker/replica:0/task:i/device:CPU:0` usable from this
  process, through TensorFlow's own distributed runtime.
* `UnreachableWorkers(spec)` names the workers that no longer accept
  connections (a worker process that died).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import tensorflow as tf

from absl import logging

from lingvo_gpipe.core import hyperparams

__all__ = [
  'PreferredDevices',
  'Cluster',
  'SplitCpu',
  'SplitGpu',
  'FreePorts',
  'LocalCluster',
  'Connect',
  'WorkerDevices',
  'StageDevices',
  'WaitForAddress',
  'WaitForWorkers',
  'ParseClusterSpec',
  'ClusterSpecFromTfConfig',
  'UnreachableWorkers',
  'SilentWorkers',
  'Answers',
  'WorkerName',
]


def PreferredDevices(devices=None):
  """The names of the TPUs among `devices`, else of the GPUs, else the CPUs.

  Args:
    devices: logical devices (`tf.config.LogicalDevice`s), in the order to
      keep; None: every device TensorFlow lists.

  Returns:
    A list of device names; [] if there is none.
  """
  if devices is None:
    devices = tf.config.list_logical_devices()
  for kind in ('TPU', 'GPU', 'CPU'):
    found = [d.name for d in devices if d.device_type == kind]
    if found:
      return found
  return []


def SplitCpu(num_devices):
  """Splits the first physical CPU into `num_devices` logical devices."""
  cpus = tf.config.list_physical_devices('CPU')
  current = tf.config.get_logical_device_configuration(cpus[0])
  if current is not None and len(current) == num_devices:
    return
  try:
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices
    )
  except RuntimeError as e:
    raise RuntimeError(
      f'Cannot split the CPU into {num_devices} devices: TensorFlow has '
      'already initialized its devices. Call SplitCpu (trainer flag '
      '--num_cpu_devices) before running any TensorFlow op.'
    ) from e


def SplitGpu(num_devices, memory_limit_mb=None):
  """Splits the first physical GPU into `num_devices` logical GPUs.

  Args:
    num_devices: logical GPUs to make (`/device:GPU:0..n-1`).
    memory_limit_mb: memory of each; None: the GPU's memory divided evenly
      is not known to TensorFlow before start-up, so this is required when
      num_devices > 1.
  """
  gpus = tf.config.list_physical_devices('GPU')
  if not gpus:
    raise RuntimeError(
      f'Cannot split the GPU into {num_devices} devices: TensorFlow finds '
      'no GPU on this host. Use --run_locally=cpu and --num_cpu_devices '
      'instead.'
    )
  if num_devices > 1 and not memory_limit_mb:
    raise ValueError(
      f'Splitting a GPU into {num_devices} logical GPUs needs a memory '
      'limit for each (--gpu_memory_limit_mb), e.g. a quarter of the '
      "GPU's memory for 4 devices."
    )
  config = [
    tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
  ] * num_devices
  try:
    tf.config.set_logical_device_configuration(gpus[0], config)
  except RuntimeError as e:
    raise RuntimeError(
      f'Cannot split the GPU into {num_devices} devices: TensorFlow has '
      'already initialized its devices. Split it (trainer flag '
      '--num_gpu_devices) before running any TensorFlow op.'
    ) from e


def ParseClusterSpec(text):
  """A cluster spec from text: JSON ('{"worker": ["h:p", ...]}') or Lingvo's
  'worker=h:p,h:p@ps=h:p' form. Returns {job: [addresses]}."""
  text = (text or '').strip()
  if not text:
    raise ValueError(
      'The cluster spec is empty; give e.g. '
      '"worker=127.0.0.1:2222,127.0.0.1:2223".'
    )
  if text.startswith('{'):
    try:
      spec = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f'Cluster spec {text!r} is not valid JSON: {e}') from e
  else:
    spec = {}
    for part in text.split('@'):
      job, sep, addresses = part.partition('=')
      if not sep or not job.strip() or not addresses.strip():
        raise ValueError(
          f'Cluster spec part {part!r} is not "job=host:port[,host:port]"; '
          'e.g. "worker=127.0.0.1:2222,127.0.0.1:2223".'
        )
      spec[job.strip()] = [a.strip() for a in addresses.split(',')]
  for job, addresses in spec.items():
    if not isinstance(addresses, list) or not addresses:
      raise ValueError(f'Job {job!r} of the cluster spec has no addresses.')
    for address in addresses:
      host, sep, port = str(address).rpartition(':')
      if not sep or not host or not port.isdigit():
        raise ValueError(
          f'Address {address!r} of job {job!r} is not host:port.'
        )
  return spec


def ClusterSpecFromTfConfig(tf_config=None):
  """(cluster spec dict, job, task) from TF_CONFIG (or the JSON given)."""
  text = os.environ.get('TF_CONFIG') if tf_config is None else tf_config
  if not text:
    return None, None, None
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f'TF_CONFIG is not valid JSON: {e}: {text!r}') from e
  if 'cluster' not in config:
    raise ValueError(f'TF_CONFIG has no "cluster": {text!r}')
  task = config.get('task', {})
  return (
    ParseClusterSpec(json.dumps(config['cluster'])),
    task.get('type'),
    task.get('index'),
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


# An HTTP/2 client preface and an empty SETTINGS frame: a live gRPC server
# (a TensorFlow worker) answers with its own SETTINGS frame at once; a stopped
# or wedged process, whose kernel still accepts the connection, says nothing.
_HTTP2_PREFACE = b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' + bytes(
  [0, 0, 0, 4, 0, 0, 0, 0, 0]
)


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


def _DieWithParent():
  """In a child before exec: SIGKILL it when the parent dies (Linux).

  A local worker outliving the process that started it (killed, or crashed
  before `Stop`) would hold its memory and ports forever. (The kernel ties
  this to the starting thread: start a LocalCluster from a thread that lives
  as long as the cluster, e.g. the main thread.)
  """
  try:
    import ctypes  # pylint: disable=g-import-not-at-top

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


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
    """
    self.num_workers = num_workers
    self._pin = pin_cpus
    self.job = job
    self._threads = (intra_op_threads, inter_op_threads)
    self._timeout = startup_timeout_s
    self._procs = []
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
    cmd = [
      sys.executable,
      '-m',
      'lingvo_gpipe.runners.tf_server',
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
    return subprocess.Popen(
      self.Command(task),
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      preexec_fn=_DieWithParent,
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


def Connect(cluster_spec, job_name=None, task_index=None, timeout_s=30):
  """Connects this process to `cluster_spec` (a dict or ClusterSpec).

  Every address is checked first, so an unreachable worker fails within
  `timeout_s` with its address in the message instead of hanging.
  """
  spec = (
    cluster_spec.as_dict()
    if isinstance(cluster_spec, tf.train.ClusterSpec)
    else dict(cluster_spec)
  )
  WaitForWorkers(spec, timeout_s, skip=(job_name, task_index))
  kwargs = {}
  if job_name is not None:
    kwargs = dict(job_name=job_name, task_index=task_index)
  tf.config.experimental_connect_to_cluster(
    tf.train.ClusterSpec(spec), **kwargs
  )


def StageDevices(num_stages, num_replicas=1, devices=None):
  """Devices of each replica's stages: [[replica 0 stage devices], ...].

  Args:
    num_stages: K, devices per model split (Lingvo's --worker_split_size).
    num_replicas: R, data-parallel copies of the pipeline.
    devices: the devices to use; None: accelerators if any, else CPUs.

  Raises:
    ValueError: if R * K exceeds the devices found.
  """
  devices = list(devices) if devices else PreferredDevices()
  need = num_stages * num_replicas
  if need > len(devices):
    raise ValueError(
      f'{num_replicas} replicas x {num_stages} stages need {need} devices '
      f'but {len(devices)} were found: {devices}. Reduce the stages or '
      'replicas, or add devices (--num_cpu_devices for virtual CPUs).'
    )
  return [
    devices[r * num_stages : (r + 1) * num_stages] for r in range(num_replicas)
  ]


class Cluster:
  """The devices of this job, from the trainer's flags (Lingvo's cluster).

  c = cluster.Cluster(cluster.Cluster.Params().Set(
      worker_split_size=2, worker_replicas=2, num_cpu_devices=4))
  c.Configure()              # split the CPU / connect to the workers
  c.StageDevices()           # [[replica 0's 2 devices], [replica 1's]]
  """

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('run_locally', None, 'cpu: hide GPUs; gpu: require one; None.')
    p.Define(
      'num_cpu_devices',
      None,
      'Split the host CPU into this many virtual devices.',
    )
    p.Define(
      'num_gpu_devices',
      None,
      'Split the first GPU into this many logical GPUs.',
    )
    p.Define(
      'gpu_memory_limit_mb',
      None,
      'Memory of each logical GPU (with num_gpu_devices > 1).',
    )
    p.Define(
      'cluster_spec',
      None,
      'Remote workers: a dict {job: [host:port]} or its text form '
      '("worker=h:p,h:p" or JSON). None: TF_CONFIG if set, else this '
      "host's devices.",
    )
    p.Define('worker_job', 'worker', 'The job whose devices run the model.')
    p.Define(
      'worker_split_size', None, 'Devices per model split K (pipeline stages).'
    )
    p.Define('worker_replicas', 1, 'Data-parallel replicas R.')
    p.Define('connect_timeout_s', 30.0, 'Bound on reaching each remote worker.')
    return p

  def __init__(self, params):
    self.params = params.Copy()
    p = self.params
    if p.worker_replicas is None or p.worker_replicas < 1:
      raise ValueError(f'worker_replicas={p.worker_replicas!r} must be >= 1.')
    if p.worker_split_size is not None and p.worker_split_size < 1:
      raise ValueError(
        f'worker_split_size={p.worker_split_size!r} must be >= 1.'
      )
    spec = p.cluster_spec
    if isinstance(spec, str):
      spec = ParseClusterSpec(spec)
    elif isinstance(spec, tf.train.ClusterSpec):
      spec = spec.as_dict()
    if spec is None:
      spec, _, _ = ClusterSpecFromTfConfig()
    self.spec = spec
    if spec is not None and p.worker_job not in spec:
      raise ValueError(
        f'The cluster spec {spec} has no job {p.worker_job!r} (worker_job).'
      )
    self._configured = False

  @property
  def is_remote(self):
    return self.spec is not None

  def Configure(self):
    """Makes the devices exist: splits CPU/GPU, connects to the workers.

    Must run before TensorFlow runs any op (for the splits).
    """
    if self._configured:
      return self
    p = self.params
    if p.run_locally == 'cpu':
      try:
        tf.config.set_visible_devices([], 'GPU')
      except RuntimeError as e:
        logging.warning('Could not hide the GPUs: %s', e)
    elif p.run_locally == 'gpu' and not tf.config.list_physical_devices('GPU'):
      raise RuntimeError(
        '--run_locally=gpu but TensorFlow finds no GPU; use --run_locally=cpu.'
      )
    if p.num_gpu_devices:
      SplitGpu(p.num_gpu_devices, p.gpu_memory_limit_mb)
    if p.num_cpu_devices:
      SplitCpu(p.num_cpu_devices)
    if self.is_remote:
      Connect(self.spec, timeout_s=p.connect_timeout_s)
    self._configured = True
    return self

  def Devices(self):
    """The devices that run the model, in order: accelerators first.

    Remote: the worker job's devices, task by task (GPUs of a task if it has
    any, else its CPUs). Local: TPUs, else GPUs, else CPUs.
    """
    if not self.is_remote:
      return PreferredDevices()
    job = self.params.worker_job
    by_task = {}
    for d in tf.config.list_logical_devices():
      spec = tf.DeviceSpec.from_string(d.name)
      if spec.job == job:
        by_task.setdefault(spec.task, []).append((spec.device_index, d))
    out = []
    for task in sorted(by_task):
      devs = [d for _, d in sorted(by_task[task], key=lambda x: x[0])]
      out.extend(PreferredDevices(devs))
    if not out:
      raise RuntimeError(
        f'No device of job {job!r} is visible; is this '
        'process connected to the cluster (Configure())?'
      )
    return out

  def NumStages(self, default=1):
    return self.params.worker_split_size or default

  def StageDevices(self, num_stages=None):
    """[[device of each stage] for each replica]."""
    k = num_stages or self.NumStages()
    return StageDevices(k, self.params.worker_replicas, self.Devices())

  def UnreachableWorkers(self, timeout_s=2.0):
    if not self.is_remote:
      return []
    return UnreachableWorkers(self.spec, timeout_s)

  def SilentWorkers(self, timeout_s=3.0):
    """The reachable workers that do not answer a gRPC handshake."""
    if not self.is_remote:
      return []
    return SilentWorkers(self.spec, timeout_s)

  def Describe(self, num_stages=None):
    """One line of the cluster's shape, then its devices. `num_stages`: the
    stages of the model's pipeline (default: worker_split_size, or 1)."""
    p = self.params
    where = (
      f'remote job {p.worker_job!r} of {self.spec}'
      if self.is_remote
      else 'this host'
    )
    lines = [
      f'Cluster: {where}; {p.worker_replicas} replica(s) x '
      f'{num_stages or self.NumStages()} stage(s).'
    ]
    try:
      devices = self.Devices()
    except RuntimeError as e:
      return lines[0] + f' {e}'
    lines.append(f'  devices: {devices}')
    return '\n'.join(lines)
