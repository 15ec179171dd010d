"""Which device runs which pipeline cell: resolution and validation."""

import contextlib

import tensorflow as tf

from lingvo_gpipe.core import cluster
from lingvo_gpipe.core import cluster_factory
from lingvo_gpipe.core import tpu

__all__ = [
  'AvailableDevices',
  'DefaultDevices',
  'ResolveDevices',
  'CanonicalDevice',
  'StagePlacement',
]


def AvailableDevices():
  """Names of the logical devices TensorFlow knows (local and remote)."""
  return [d.name for d in tf.config.list_logical_devices()]


def _Spec(name):
  return tf.DeviceSpec.from_string(name)


def _Matches(want, have):
  """True if device spec `want` (partially given) matches full spec `have`."""
  local = {'job': 'localhost', 'replica': 0, 'task': 0}
  for field in ('job', 'replica', 'task', 'device_type', 'device_index'):
    w = getattr(want, field)
    if w is None:
      continue
    h = getattr(have, field)
    if h is None and field in local:  # an unqualified local device name
      h = local[field]
    if field == 'device_type':
      w, h = w.upper(), (h or '').upper()
    if w != h:
      return False
  return True


def CanonicalDevice(name, available=None):
  """Returns the full name of the one available device matching `name`.

  Raises:
    ValueError: naming the device and listing the available ones.
  """
  available = AvailableDevices() if available is None else available
  want = _Spec(name)
  if want.device_type is None:
    raise ValueError(
      f'Device {name!r} names no device type; use e.g. '
      '"/device:CPU:1" or "/job:worker/task:1/device:CPU:0".'
    )
  matches = [d for d in available if _Matches(want, _Spec(d))]
  if not matches:
    raise ValueError(
      f'Device {name!r} does not exist. Available devices: {available}. '
      'For more CPU devices in one process, split the CPU with '
      'lingvo_gpipe.core.cluster.SplitCpu(n) (trainer flag '
      '--num_cpu_devices) before TensorFlow runs any op.'
    )
  if want.job is None and len({_Spec(d).job for d in matches}) > 1:
    local = [d for d in matches if _Spec(d).job in (None, 'localhost')]
    if local:
      return local[0]
  return matches[0]


def DefaultDevices():
  """The devices of the model split of the cluster entered with
  `cluster_factory.Cluster(p)`; without one, the accelerators if there are
  any (TPU, then GPU), else the CPU devices."""
  top = cluster_factory.Top()
  if top is not None:
    return top.split_devices
  return cluster.PreferredDevices()


def ResolveDevices(devices, num_devices, num_replicas=1):
  """Validates the devices of a pipeline's cells.

  Args:
    devices: list of device names, or None for `DefaultDevices()`.
    num_devices: devices needed: the number of cells K times num_replicas.
    num_replicas: data-parallel replicas R (for the error message).

  Returns:
    A list of `num_devices` distinct canonical device names.
  """
  available = AvailableDevices()
  given = list(devices) if devices else DefaultDevices()
  if len(given) < num_devices:
    if num_replicas > 1:
      what = (
        f'{num_replicas} replicas x {num_devices // num_replicas} '
        f'stages need {num_devices} devices'
      )
      fix = 'Use fewer replicas or stages'
    else:
      what = f'The pipeline has {num_devices} stages'
      fix = f'Use at most {len(given)} stages'
    raise ValueError(
      f'{what} but only {len(given)} devices are given: {given} '
      f'(available: {available}). {fix}, pass more devices, or split the '
      'CPU into virtual devices with lingvo_gpipe.core.cluster.SplitCpu(n) '
      '(trainer flag --num_cpu_devices).'
    )
  out = [CanonicalDevice(d, available) for d in given[:num_devices]]
  if num_replicas > 1 and len(set(out)) < len(out):
    raise ValueError(
      f'The devices of {num_replicas} replicas must be distinct; got '
      f'{out}. Give each (replica, cell) its own device.'
    )
  return out


class StagePlacement:
  """Where each (replica, cell) of a pipeline runs.

  Three cases:
    * devices: cell k of replica r on `replica_devices[r][k]` (tf.device);
    * TPU: built under a TPUStrategy whose replicas have several cores, cell
      k runs on each replica's logical core k: nothing is placed with
      tf.device, tensors are pinned with `Place` during a call;
    * another tf.distribute strategy (one device per replica): the strategy
      places everything, all K cells on the replica's device; R must be 1
      (the strategy's replicas are the data parallelism).
  Abstract builds (counting, tracing) place nothing.
  """

  def __init__(self, devices, num_stages, num_replicas, path, abstract=False):
    self.num_stages = num_stages
    self.num_replicas = num_replicas
    self._path = path
    self.replica_devices = None
    self.on_tpu = False
    self.strategy_name = None
    self._assign = None  # set during a call on TPU
    if abstract:
      return
    if tpu.NumCoresPerReplica() > 1:
      self.on_tpu = True
      return
    if tf.distribute.has_strategy():
      name = type(tf.distribute.get_strategy()).__name__
      if num_replicas > 1:
        raise ValueError(
          f'Pipeline {path!r} has {num_replicas} replicas but is built '
          f'under {name}, whose replicas are the data parallelism. Set '
          'num_replicas=1 there (trainer: --worker_replicas gives the '
          "strategy's replicas), or use no strategy and num_replicas for "
          'data parallelism of multi-device pipelines.'
        )
      self.strategy_name = name
      return
    flat = ResolveDevices(
      devices, num_stages * num_replicas, num_replicas=num_replicas
    )
    self.replica_devices = [
      flat[i * num_stages : (i + 1) * num_stages] for i in range(num_replicas)
    ]

  @property
  def devices(self):
    """Replica 0's devices (where the variables live), or None."""
    return self.replica_devices[0] if self.replica_devices else None

  def Scope(self, k, r=0):
    """The device scope of cell k of replica r."""
    if self.replica_devices is None or self._assign is not None:
      return contextlib.nullcontext()
    return tf.device(self.replica_devices[r][k])

  def Place(self, structure, k):
    """On TPU (during a call), pins the tensors of `structure` to logical
    core k; elsewhere returns `structure`."""
    if self._assign is None:
      return structure
    return self._assign(structure, k)

  @contextlib.contextmanager
  def Call(self):
    """Wraps one FProp: inside a TPUStrategy replica of several cores, cell
    k's tensors go to logical core k (`tpu.LogicalDeviceAssigner`)."""
    assign = tpu.LogicalDeviceAssigner()
    if assign is not None and self.num_replicas != 1:
      raise ValueError(
        f'Pipeline {self._path!r} runs in a TPUStrategy replica, whose '
        'replicas are the data parallelism; set num_replicas=1 (got '
        f'{self.num_replicas}).'
      )
    self._assign = assign
    try:
      yield
    finally:
      self._assign = None

  def Describe(self, k):
    """Where cell k runs, as text."""
    if self.on_tpu:
      return f'logical core {k} of each TPU replica'
    if self.strategy_name:
      return f"each {self.strategy_name} replica's device"
    if self.replica_devices is None:
      return 'None'
    if self.num_replicas == 1:
      return self.replica_devices[0][k]
    return ', '.join(
      f'{d[k]} (replica {r})' for r, d in enumerate(self.replica_devices)
    )
