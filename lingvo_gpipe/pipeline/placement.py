"""Which device runs which pipeline cell: resolution and validation."""

import tensorflow as tf

__all__ = ['AvailableDevices', 'DefaultDevices', 'ResolveDevices',
           'CanonicalDevice']


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
    raise ValueError(f'Device {name!r} names no device type; use e.g. '
                     '"/device:CPU:1" or "/job:worker/task:1/device:CPU:0".')
  matches = [d for d in available if _Matches(want, _Spec(d))]
  if not matches:
    raise ValueError(
        f'Device {name!r} does not exist. Available devices: {available}. '
        'For more CPU devices in one process, split the CPU with '
        'lingvo_gpipe.core.cluster.SplitCpu(n) (trainer flag '
        '--num_cpu_devices) before TensorFlow runs any op.')
  if want.job is None and len({_Spec(d).job for d in matches}) > 1:
    local = [d for d in matches if _Spec(d).job in (None, 'localhost')]
    if local:
      return local[0]
  return matches[0]


def DefaultDevices():
  """Accelerators if there are any (TPU, then GPU), else the CPU devices."""
  available = tf.config.list_logical_devices()
  for kind in ('TPU', 'GPU', 'CPU'):
    found = [d.name for d in available if d.device_type == kind]
    if found:
      return found
  return []


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
      what = (f'{num_replicas} replicas x {num_devices // num_replicas} '
              f'stages need {num_devices} devices')
      fix = 'Use fewer replicas or stages'
    else:
      what = f'The pipeline has {num_devices} stages'
      fix = f'Use at most {len(given)} stages'
    raise ValueError(
        f'{what} but only {len(given)} devices are given: {given} '
        f'(available: {available}). {fix}, pass more devices, or split the '
        'CPU into virtual devices with lingvo_gpipe.core.cluster.SplitCpu(n) '
        '(trainer flag --num_cpu_devices).')
  out = [CanonicalDevice(d, available) for d in given[:num_devices]]
  if num_replicas > 1 and len(set(out)) < len(out):
    raise ValueError(
        f'The devices of {num_replicas} replicas must be distinct; got '
        f'{out}. Give each (replica, cell) its own device.')
  return out
