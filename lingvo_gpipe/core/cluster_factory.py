"""Lingvo's `cluster_factory`: a script's cluster Params give the devices.

  p = cluster_factory.Cluster.Params()
  p.worker.gpus_per_replica = 2        # or cpus_per_replica for CPU devices
  p.worker.devices_per_split = 2
  with cluster_factory.Cluster(p):
    pipe = gpipe_params.Instantiate()  # cells on the split's 2 devices

Inside the `with`, a `PipeliningLayer` or `SeqLayer` without `devices` places
its cells on the devices of the current model split (`split_id`), and
`do_eval=True` puts layers in eval mode (`py_utils.EvalMode`). Outside, the
pipeline uses the accelerators TensorFlow lists, as without a cluster. The
devices are this process's logical devices (`cluster.SplitCpu` makes more
CPU devices); remote workers are the trainer's `--cluster_spec`
(`docs/scaleout.md`).
"""

import contextlib
import copy
import threading

import tensorflow as tf

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import py_utils

__all__ = [
  'Cluster',
  'Current',
  'ForTestingWorker',
  'SetEval',
  'SetModelSplit',
  'Top',
]

_local = threading.local()


def _Stack():
  if not hasattr(_local, 'clusters'):
    _local.clusters = []
  return _local.clusters


def _JobSpec(replicas):
  p = hyperparams.Params()
  p.Define('name', '/job:localhost', "The job's TensorFlow name.")
  p.Define('replicas', replicas, 'Number of tasks of the job.')
  p.Define('targets', '', "Lingvo's session targets; unused (no sessions).")
  p.Define('cpus_per_replica', 1, 'CPU devices per replica.')
  p.Define('gpus_per_replica', 0, 'GPU devices per replica (0: CPUs).')
  p.Define('devices_per_split', 1, 'Devices of one model split.')
  p.Define('tpus_per_replica', 0, 'TPU cores per replica.')
  p.Define('num_tpu_hosts', 0, 'TPU hosts.')
  p.Define('additional_worker_names', [], "Lingvo's; unused.")
  return p


class Cluster:
  """A cluster description; `with Cluster(p):` makes it the current one."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('mode', 'async', "Training: 'sync' or 'async'.")
    p.Define('job', 'trainer', 'The role of this process.')
    p.Define('task', 0, 'This process is the task-th of its job.')
    p.Define('logdir', '', 'The log directory.')
    p.Define('worker', _JobSpec(1), 'The worker job.')
    p.Define('do_eval', None, 'True: layers built and run inside evaluate.')
    p.Define('in_unit_test', None, 'Running in a unit test.')
    p.Define('split_id', 0, 'The model split this process drives.')
    return p

  def __init__(self, params):
    self._params = params.Copy()

  @property
  def params(self):
    return self._params

  @property
  def job(self):
    return self._params.job

  @property
  def mode(self):
    return self._params.mode

  @property
  def synchronous(self):
    return self._params.mode == 'sync'

  @property
  def do_eval(self):
    return bool(self._params.do_eval)

  @property
  def num_replicas(self):
    return self._params.worker.replicas

  @property
  def num_devices_per_split(self):
    return self._params.worker.devices_per_split

  def _WorkerDevices(self):
    w = self._params.worker
    if w.tpus_per_replica:
      kind, count = 'TPU', w.tpus_per_replica
    elif w.gpus_per_replica:
      kind, count = 'GPU', w.gpus_per_replica
    else:
      kind, count = 'CPU', w.cpus_per_replica
    devices = [d.name for d in tf.config.list_logical_devices(kind)]
    if len(devices) < count:
      raise ValueError(
        f'The cluster asks for {count} {kind} devices per replica but this '
        f'process has {len(devices)} ({devices}); lower it, or split the '
        'host (lingvo_gpipe.core.cluster.SplitCpu / SplitGpu).'
      )
    return devices[:count]

  @property
  def split_devices(self):
    """The devices of the current model split (`split_id`)."""
    devices = self._WorkerDevices()
    n = self.num_devices_per_split
    k = self._params.split_id
    if n < 1 or (k + 1) * n > len(devices):
      raise ValueError(
        f'Model split {k} of {n} devices does not fit in the {len(devices)} '
        f'devices of a replica ({devices}); set worker.devices_per_split '
        'and split_id to fit.'
      )
    return devices[k * n : (k + 1) * n]

  def WorkerDeviceInModelSplit(self, device_index):
    """The device `device_index` of the current model split."""
    devices = self.split_devices
    return devices[device_index % len(devices)]

  @classmethod
  def Top(cls):
    return Top()

  def __enter__(self):
    stack = _Stack()
    stack.append(self)
    self._eval = contextlib.ExitStack()
    if self._params.do_eval is not None:
      self._eval.enter_context(py_utils.EvalMode(self.do_eval))
    return self

  def __exit__(self, *unused):
    self._eval.close()
    _Stack().pop()


def Top():
  """The innermost cluster entered with `with`, or None."""
  stack = _Stack()
  return stack[-1] if stack else None


def Current():
  """The current cluster: the innermost entered, else the default one."""
  return Top() or Cluster(Cluster.Params())


def ForTestingWorker(
  mode=None,
  job=None,
  gpus=None,
  split_size=None,
  tpus=None,
  add_summary=None,
  cpus=None,
  do_eval=None,
  num_tpu_hosts=None,
):
  """A copy of the current cluster with these worker settings."""
  del add_summary
  p = copy.deepcopy(Current().params)
  for value, setter in [
    (mode, lambda v: p.Set(mode=v)),
    (job, lambda v: p.Set(job=v)),
    (gpus, lambda v: p.worker.Set(gpus_per_replica=v)),
    (tpus, lambda v: p.worker.Set(tpus_per_replica=v, num_tpu_hosts=1)),
    (cpus, lambda v: p.worker.Set(cpus_per_replica=v)),
    (split_size, lambda v: p.worker.Set(devices_per_split=v)),
    (do_eval, lambda v: p.Set(do_eval=v)),
    (num_tpu_hosts, lambda v: p.worker.Set(num_tpu_hosts=v)),
  ]:
    if value is not None:
      setter(value)
  return Cluster(p)


def SetEval(mode):
  """A copy of the current cluster with do_eval = mode (use with `with`)."""
  p = copy.deepcopy(Current().params)
  p.do_eval = mode
  return Cluster(p)


def SetModelSplit(split_id):
  """A copy of the current cluster driving model split `split_id`."""
  p = copy.deepcopy(Current().params)
  p.split_id = split_id
  return Cluster(p)
