"""Connecting to a TPU: finding it, within a time bound, and its TPUStrategy.

`CreateTPUStrategy(tpu, K, R)` resolves the TPU, connects, initializes the
TPU system (which gives the topology), builds the device assignment
(`tpu_topology.BuildDeviceAssignment`) and returns
`tf.distribute.TPUStrategy(resolver, experimental_device_assignment=...)`.
Where no TPU can be found it fails within `timeout_s` (at once when there is
no TPU on this machine) with a RuntimeError that says what was looked for and
how to point it at a TPU, instead of hanging on the GCE metadata server or on
gRPC.

What has run where: the failure without a TPU is tested on CPU
(tests/core/tpu_test.py). Past the point of finding a TPU, nothing here has
run on a real TPU.
"""

import glob
import json
import os
import socket
import threading
import time

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import tpu_topology

__all__ = ['CreateTPUStrategy', 'HasLocalTPU']

# Environment variables that name a TPU, as TensorFlow's TPU client reads
# them (tensorflow/python/tpu/client/client.py): _get_tpu_name and
# _get_tpu_node_config.
_TPU_NAME_ENV_VARS = ('KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS', 'TPU_NAME')
_TPU_CONFIG_ENV_VAR = 'TPU_CONFIG'


def _CallWithDeadline(fn, timeout_s, what):
  """Runs fn() in a daemon thread; raises TimeoutError after `timeout_s`.

  Only for work that touches no TensorFlow state (e.g. TPU name look-ups over
  HTTP, which TensorFlow makes without a timeout): a call that overruns is
  abandoned, not stopped.
  """
  result = {}

  def Run():
    try:
      result['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      result['error'] = e

  thread = threading.Thread(target=Run, daemon=True, name=what)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise TimeoutError(f'{what} did not finish within {timeout_s:g} s.')
  if 'error' in result:
    raise result['error']
  return result.get('value')


def _ProbeAddress(address, deadline):
  """Raises RuntimeError unless a gRPC server answers at host:port in time."""
  import grpc  # pylint: disable=g-import-not-at-top

  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise RuntimeError(f'the TPU worker address {address!r} is not host:port')
  try:
    with socket.create_connection(
      (host, int(port)), timeout=max(0.1, deadline - time.time())
    ):
      pass
  except OSError as e:
    raise RuntimeError(f'cannot open a TCP connection to {address}: {e}') from e
  channel = grpc.insecure_channel(address)
  try:
    grpc.channel_ready_future(channel).result(
      timeout=max(0.1, deadline - time.time())
    )
  except grpc.FutureTimeoutError:
    raise RuntimeError(
      f'{address} accepts TCP connections but no gRPC server answered '
      'there within timeout_s; it is not a TPU worker '
      '(port 8470) or it is not ready'
    ) from None
  finally:
    channel.close()


def _TPUName(tpu):
  """`tpu`, else the TPU that the environment names, else ''."""
  if tpu:
    return tpu
  for var in _TPU_NAME_ENV_VARS:
    if os.environ.get(var):
      return os.environ[var]
  config = os.environ.get(_TPU_CONFIG_ENV_VAR)
  if config:
    try:
      return json.loads(config).get('tpu_node_name') or ''
    except (ValueError, AttributeError):
      return ''
  return ''


def HasLocalTPU():
  """Whether this machine shows a TPU (a TPU VM), without initializing one."""
  for kind in ('TPU', 'TPU_SYSTEM'):
    if tf.config.list_physical_devices(kind):
      return True
  # TPU VM device files: /dev/accel* (v2-v4), /dev/vfio/<n> (v5 and later).
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def _NoTPU(tpu, reason):
  return RuntimeError(
    f'No TPU was found for tpu={tpu!r}: {reason}. On a TPU VM pass '
    "tpu='' or 'local'; for a TPU node pass its name or "
    "'grpc://<ip>:8470' (or set TPU_NAME). Without a TPU run on CPU or "
    'GPU instead (trainer flag --run_locally=cpu or --run_locally=gpu).'
  )


def _ResolveTPU(tpu, timeout_s):
  """A TPUClusterResolver for `tpu` whose workers answer, or RuntimeError."""
  resolver_cls = tf.distribute.cluster_resolver.TPUClusterResolver
  name = _TPUName(tpu)
  if name in ('', 'local'):
    if not HasLocalTPU():
      raise _NoTPU(
        tpu,
        (
          'this machine has no TPU devices'
          if name == 'local'
          else 'no TPU is named (by the argument, TPU_NAME, '
          'KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS or TPU_CONFIG) and this machine '
          'has no TPU devices'
        ),
      )
    return resolver_cls(tpu='local')
  deadline = time.time() + timeout_s

  def Resolve():
    # A Cloud TPU name is looked up through the GCE metadata server and the
    # Cloud TPU API, by urllib calls without a timeout.
    resolver = resolver_cls(tpu=name)
    return resolver, resolver.cluster_spec()

  try:
    resolver, spec = _CallWithDeadline(
      Resolve, timeout_s, f'Looking up TPU {name!r}'
    )
  except TimeoutError as e:
    raise _NoTPU(
      tpu,
      f'{str(e).rstrip(".")}; a Cloud TPU name is resolved '
      'through the GCE metadata server and the Cloud TPU API, so '
      "off Google Cloud give 'grpc://<ip>:8470'",
    ) from None
  except ImportError as e:
    raise _NoTPU(
      tpu,
      f'looking up a Cloud TPU name needs {e.name} (pip '
      'install google-api-python-client), or give '
      "'grpc://<ip>:8470'",
    ) from e
  except Exception as e:  # pylint: disable=broad-except
    raise _NoTPU(
      tpu,
      f'looking up the TPU {name!r} failed '
      f'({type(e).__name__}: {e}); a Cloud TPU name is resolved '
      'through the GCE metadata server and the Cloud TPU API, so '
      "off Google Cloud give 'grpc://<ip>:8470'",
    ) from e
  for job in spec.jobs:
    for address in spec.job_tasks(job):
      try:
        _ProbeAddress(address, deadline)
      except RuntimeError as e:
        raise _NoTPU(tpu, f'job {job!r}: {e}') from None
  return resolver


def CreateTPUStrategy(
  tpu='', num_cores_per_replica=1, num_replicas=None, timeout_s=30.0
):
  """A TPUStrategy of R replicas with K cores (pipeline stages) each.

  Resolves and connects to the TPU, initializes the TPU system (which gives
  its topology), builds the device assignment with `BuildDeviceAssignment`,
  logs it with `DescribeAssignment`, and returns
  `tf.distribute.TPUStrategy(resolver, experimental_device_assignment=da)`.

  NOT RUN ON A REAL TPU: only the failure without a TPU is tested.

  Args:
    tpu: '' or 'local': the TPU of this TPU VM (or the one the environment
      names: TPU_NAME, KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS, TPU_CONFIG); a Cloud
      TPU node name; or 'grpc://<ip>:8470'.
    num_cores_per_replica: K, the pipeline stages of one replica.
    num_replicas: R; None: as many as fit on the remaining cores.
    timeout_s: bound on finding the TPU and reaching its workers. (TPU system
      initialization itself is not bounded: on a pod slice it may take long.)

  Returns:
    A `tf.distribute.TPUStrategy`.

  Raises:
    RuntimeError: no TPU answers for `tpu` (at once when this machine has
      none and no TPU is named), or TPU system initialization fails.
    ValueError: K and R do not fit the TPU topology.
  """
  resolver = _ResolveTPU(tpu, timeout_s)
  try:
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
  except tf.errors.OpError as e:
    raise RuntimeError(
      f'Initializing the TPU system for tpu={tpu!r} failed: '
      f'{type(e).__name__}: {e.message.splitlines()[0] if e.message else e}'
      '. Check that the TPU exists, is healthy and that no other process '
      'holds it; without a TPU use --run_locally=cpu.'
    ) from e
  da = tpu_topology.BuildDeviceAssignment(
    topology, num_cores_per_replica, num_replicas
  )
  logging.info('%s', tpu_topology.DescribeAssignment(da))
  return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=da)
