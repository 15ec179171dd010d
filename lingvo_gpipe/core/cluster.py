"""Devices and clusters: where pipeline cells and replicas run.

* `Cluster` (Lingvo's cluster, from the trainer's flags) knows the devices of
  this job: local CPUs (split into `num_cpu_devices` virtual devices for
  development), local GPUs (optionally split into logical GPUs), or the
  devices of remote TensorFlow workers (`cluster_spec` or `TF_CONFIG`). It
  hands out the device of each (replica, stage): `StageDevices()`.
* `SplitCpu(n)` / `SplitGpu(n)` split the host CPU / the first GPU into n
  logical devices. Call them before TensorFlow runs any op.
* `Connect(spec)` makes the devices of a cluster's TensorFlow servers
  (`/job:worker/replica:0/task:i/device:CPU:0`) usable from this process,
  through TensorFlow's own distributed runtime.
* The server processes themselves are `core/servers.py`'s (re-exported
  here): `LocalCluster(n)` starts n of them on 127.0.0.1, and
  `UnreachableWorkers(spec)` names the workers that no longer accept
  connections (a worker process that died).
"""

import json
import os

import tensorflow as tf

from absl import logging

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core.servers import Answers
from lingvo_gpipe.core.servers import FreePorts
from lingvo_gpipe.core.servers import LocalCluster
from lingvo_gpipe.core.servers import SilentWorkers
from lingvo_gpipe.core.servers import UnreachableWorkers
from lingvo_gpipe.core.servers import WaitForAddress
from lingvo_gpipe.core.servers import WaitForWorkers
from lingvo_gpipe.core.servers import WorkerDevices
from lingvo_gpipe.core.servers import WorkerName

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
