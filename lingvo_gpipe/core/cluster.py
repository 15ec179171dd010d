"""Devices and clusters: where pipeline cells run.

* `SplitCpu(n)` splits the host CPU into n virtual devices (development and
  tests: `/device:CPU:0..n-1`). Call it before TensorFlow runs any op.
* `LocalCluster(n)` starts n TensorFlow server processes on 127.0.0.1 (free
  ports, bounded start-up, always cleaned up) and `Connect(spec)` makes their
  devices `/job:worker/replica:0/task:i/device:CPU:0` usable from this
  process, through TensorFlow's own distributed runtime.
* `StageDevices(...)` hands out the device of each pipeline stage.
"""

import json
import os
import socket
import subprocess
import sys
import time

import tensorflow as tf

__all__ = ['SplitCpu', 'FreePorts', 'LocalCluster', 'Connect',
           'WorkerDevices', 'StageDevices', 'WaitForAddress']


def SplitCpu(num_devices):
  """Splits the first physical CPU into `num_devices` logical devices."""
  cpus = tf.config.list_physical_devices('CPU')
  current = tf.config.get_logical_device_configuration(cpus[0])
  if current is not None and len(current) == num_devices:
    return
  try:
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError as e:
    raise RuntimeError(
        f'Cannot split the CPU into {num_devices} devices: TensorFlow has '
        'already initialized its devices. Call SplitCpu (trainer flag '
        '--num_cpu_devices) before running any TensorFlow op.') from e


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
            'address in the cluster spec is right.') from e
      time.sleep(0.1)


def WorkerDevices(num_tasks, job='worker', device='CPU'):
  return [f'/job:{job}/replica:0/task:{i}/device:{device}:0'
          for i in range(num_tasks)]


class LocalCluster:
  """n TensorFlow server processes on 127.0.0.1.

    with cluster.LocalCluster(2, intra_op_threads=1) as c:
      cluster.Connect(c.cluster_spec)
      devices = c.devices   # ['/job:worker/replica:0/task:0/device:CPU:0', ..]
  """

  def __init__(self, num_workers, intra_op_threads=1, inter_op_threads=1,
               startup_timeout_s=120, job='worker', pin_cpus=False):
    """Args:
      num_workers: number of server processes.
      intra_op_threads: threads one op may use in a worker.
      inter_op_threads: ops a worker may run at once (also the threads that
        finish transfers).
      startup_timeout_s: bound on the start-up of each worker.
      job: job name.
      pin_cpus: pin worker i to CPU core i mod cores, so that a worker
        computes on one core like one accelerator, whatever its threads.
    """
    self.num_workers = num_workers
    self._pin = pin_cpus
    self.job = job
    self._threads = (intra_op_threads, inter_op_threads)
    self._timeout = startup_timeout_s
    self._procs = []
    ports = FreePorts(num_workers)
    self.addresses = [f'127.0.0.1:{p}' for p in ports]
    self.cluster_spec = {job: list(self.addresses)}

  @property
  def devices(self):
    return WorkerDevices(self.num_workers, self.job)

  def Start(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    for i in range(self.num_workers):
      cmd = [sys.executable, '-m', 'lingvo_gpipe.runners.tf_server',
             f'--cluster_spec={json.dumps(self.cluster_spec)}',
             f'--job_name={self.job}', f'--task_index={i}',
             f'--intra_op_threads={self._threads[0]}',
             f'--inter_op_threads={self._threads[1]}']
      if self._pin:
        cores = sorted(os.sched_getaffinity(0))
        cmd.append(f'--cpus={cores[i % len(cores)]}')
      self._procs.append(subprocess.Popen(
          cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
      for i, address in enumerate(self.addresses):
        WaitForAddress(address, self._timeout)
        if self._procs[i].poll() is not None:
          err = self._procs[i].stderr.read().decode(errors='replace')[-2000:]
          raise RuntimeError(f'Worker {i} at {address} exited: {err}')
    except BaseException:
      self.Stop()
      raise
    return self

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
  spec = (cluster_spec.as_dict() if isinstance(cluster_spec, tf.train.ClusterSpec)
          else dict(cluster_spec))
  for job, addresses in spec.items():
    for i, address in enumerate(addresses):
      if job == job_name and i == task_index:
        continue
      try:
        WaitForAddress(address, timeout_s)
      except TimeoutError as e:
        raise TimeoutError(f'{job}:{i}: {e}') from e
  kwargs = {}
  if job_name is not None:
    kwargs = dict(job_name=job_name, task_index=task_index)
  tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec),
                                            **kwargs)


def StageDevices(num_stages, num_replicas=1, devices=None):
  """Devices of each replica's stages: [[replica 0 stage devices], ...].

  Args:
    num_stages: K, devices per model split (Lingvo's --worker_split_size).
    num_replicas: R, data-parallel copies of the pipeline.
    devices: the devices to use; None: accelerators if any, else CPUs.

  Raises:
    ValueError: if R * K exceeds the devices found.
  """
  from lingvo_gpipe.pipeline import placement  # pylint: disable=g-import-not-at-top
  devices = list(devices) if devices else placement.DefaultDevices()
  need = num_stages * num_replicas
  if need > len(devices):
    raise ValueError(
        f'{num_replicas} replicas x {num_stages} stages need {need} devices '
        f'but {len(devices)} were found: {devices}. Reduce the stages or '
        'replicas, or add devices (--num_cpu_devices for virtual CPUs).')
  return [devices[r * num_stages:(r + 1) * num_stages]
          for r in range(num_replicas)]
