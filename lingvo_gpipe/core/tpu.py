"""GPipe on TPUs: device assignment and `tf.distribute.TPUStrategy` set-up.

Over 500 lines: topology arithmetic and TPU set-up, to be split by concept.

A pipeline of K stages runs on TPUs as R data-parallel replicas of K cores
each: stage k of a replica is that replica's *logical core* k, and XLA places
the ops of stage k on the physical core that the `DeviceAssignment` maps
(replica, k) to. The pieces:

* `MakeTopology(mesh_shape, ...)` builds a `tf.tpu.experimental.Topology`
  without a TPU (from a mesh shape, or a preset name of `TOPOLOGIES`), for
  planning and tests. On a real TPU the topology comes from
  `tf.tpu.experimental.initialize_tpu_system`.
* `ComputationShape(topology, K)` is the [x, y, z, core] block of K cores one
  replica occupies: the cores of one chip first, then the most compact block
  of neighbouring chips, with sides that divide the mesh so that the replicas
  tile it.
* `BuildDeviceAssignment(topology, K, R)` maps every (replica, logical core)
  to a physical core with `tf.tpu.experimental.DeviceAssignment.build`, and
  `DescribeAssignment(...)` prints that map (for logging placement).
* `CreateTPUStrategy(tpu, K, R)` is the real path: resolve the TPU, connect,
  initialize the TPU system (which gives the topology), build the assignment
  and return `tf.distribute.TPUStrategy(resolver,
  experimental_device_assignment=...)`. Where no TPU can be found it fails
  within `timeout_s` (at once when there is no TPU on this machine) with a
  RuntimeError, instead of hanging on the GCE metadata server or on gRPC.
* `LogicalDeviceAssigner(strategy)` gives the pipeline a function that pins
  tensors to logical core k (`strategy.experimental_assign_to_logical_device`)
  inside a TPUStrategy replica with more than one core, and None elsewhere
  (CPU/GPU: the pipeline places stages with `tf.device`).

What has run where: the topology, computation-shape and device-assignment
arithmetic, the choice of code path and the failure without a TPU are tested
on CPU (tests/core/tpu_test.py). NOTHING in this module has run on a real TPU:
`CreateTPUStrategy` past the point of finding a TPU, the placement of pipeline
stages on TPU cores by XLA, and the performance are untested.

TensorFlow internals relied on (TF 2.21), see docs/tpu.md:
* `TPUStrategy` has no public number of cores per replica;
  `NumCoresPerReplica` reads `strategy.extended._device_assignment` and
  `strategy.extended._tpu_devices` ([replicas, cores], the array that
  `experimental_assign_to_logical_device` itself checks the core id against).
"""

import glob
import itertools
import json
import os
import socket
import threading
import time

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal

__all__ = [
  'TOPOLOGIES',
  'MakeTopology',
  'ComputationShape',
  'BuildDeviceAssignment',
  'DescribeAssignment',
  'CreateTPUStrategy',
  'IsTPUStrategy',
  'NumCoresPerReplica',
  'LogicalDeviceAssigner',
]

# Cloud TPU slices by name: mesh_shape is [x, y, z, TF cores per chip] and
# num_tasks the TPU hosts (TensorFlow tasks). Shapes as in the Cloud TPU
# documentation: v2 and v3 chips have 2 TensorCores, each a TF device; v4
# chips run both TensorCores as one "megacore" device, and v4 names count
# TensorCores, so v4-8 is 4 chips (2x2x1) and 4 TF devices. Each host owns 4
# chips. The order of TPU ordinals inside a host is this module's convention
# (chips x-first, cores fastest), not necessarily the hardware's.
TOPOLOGIES = {
  'v2-8': dict(mesh_shape=[2, 2, 1, 2], num_tasks=1),
  'v3-8': dict(mesh_shape=[2, 2, 1, 2], num_tasks=1),
  'v3-32': dict(mesh_shape=[4, 4, 1, 2], num_tasks=4),
  'v4-8': dict(mesh_shape=[2, 2, 1, 1], num_tasks=1),
  'v4-32': dict(mesh_shape=[2, 2, 4, 1], num_tasks=4),
}

# Environment variables that name a TPU, as TensorFlow's TPU client reads
# them (tensorflow/python/tpu/client/client.py): _get_tpu_name and
# _get_tpu_node_config.
_TPU_NAME_ENV_VARS = ('KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS', 'TPU_NAME')
_TPU_CONFIG_ENV_VAR = 'TPU_CONFIG'


def _Divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def _CompactBlock(dims, n):
  """The most compact block of `n` cells whose sides divide `dims`.

  Compact: the smallest sum of sides; ties go to the longer side first in x,
  then y (neighbouring replicas then share a host where they can).

  Returns:
    A tuple of len(dims) sides, or None when no such block exists.
  """
  best = None
  for sides in itertools.product(*[_Divisors(int(d)) for d in dims]):
    if int(np.prod(sides)) != n:
      continue
    key = (sum(sides), tuple(-s for s in sides))
    if best is None or key < best[0]:
      best = (key, sides)
  return None if best is None else tuple(int(s) for s in best[1])


def _CheckPositiveInt(name, value):
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, np.integer))
    or value < 1
  ):
    raise ValueError(f'{name} must be a positive integer; got {value!r}.')
  return int(value)


def MakeTopology(mesh_shape, cores_per_chip=None, num_tasks=None):
  """A `tf.tpu.experimental.Topology` of a TPU mesh, without a TPU.

    MakeTopology('v3-8')                      # a preset of TOPOLOGIES
    MakeTopology([2, 2, 1, 2])                # 2x2 chips, 2 cores each
    MakeTopology([4, 4, 1], cores_per_chip=2, num_tasks=4)

  Args:
    mesh_shape: a name in `TOPOLOGIES`, or [x, y, z, cores per chip], or the
      chips [x, y, z] with `cores_per_chip`.
    cores_per_chip: TF TPU devices per chip (2 on v2/v3, 1 on v4 megacore);
      needed when `mesh_shape` has 3 entries, else it must match the 4th.
    num_tasks: TPU hosts; each owns an equal, compact block of chips. None: the
      preset's, or 1.

  Returns:
    A Topology whose `device_coordinates` are [num_tasks, cores per task, 4]:
    task t's TPU ordinal i sits at the (x, y, z, core) coordinates given.

  Raises:
    ValueError: for an unknown preset, a bad shape, or hosts that cannot split
      the chips evenly.
  """
  if isinstance(mesh_shape, str):
    if mesh_shape not in TOPOLOGIES:
      raise ValueError(
        f'Unknown TPU topology {mesh_shape!r}; known: '
        f'{sorted(TOPOLOGIES)}. Or give a mesh shape '
        '[x, y, z, cores per chip].'
      )
    preset = TOPOLOGIES[mesh_shape]
    if num_tasks is None:
      num_tasks = preset['num_tasks']
    mesh_shape = preset['mesh_shape']
  mesh = list(mesh_shape)
  if len(mesh) == 3:
    if cores_per_chip is None:
      raise ValueError(
        f'mesh_shape={mesh} gives the chips only; also give cores_per_chip '
        '(2 for TPU v2/v3, 1 for v4 in megacore mode), or a 4-entry '
        'mesh_shape [x, y, z, cores per chip].'
      )
    mesh.append(cores_per_chip)
  elif len(mesh) != 4:
    raise ValueError(
      f'mesh_shape must be [x, y, z] chips or [x, y, z, cores '
      f'per chip]; got {mesh_shape!r}.'
    )
  elif cores_per_chip is not None and cores_per_chip != mesh[3]:
    raise ValueError(
      f'cores_per_chip={cores_per_chip} contradicts '
      f'mesh_shape={mesh} (last entry = cores per chip).'
    )
  mesh = [_CheckPositiveInt('Each entry of mesh_shape', m) for m in mesh]
  num_tasks = _CheckPositiveInt(
    'num_tasks', 1 if num_tasks is None else num_tasks
  )

  chips, cores = mesh[:3], mesh[3]
  num_chips = int(np.prod(chips))
  host = (
    _CompactBlock(chips, num_chips // num_tasks)
    if num_chips % num_tasks == 0
    else None
  )
  if host is None:
    raise ValueError(
      f'num_tasks={num_tasks} hosts cannot split the {num_chips} chips of '
      f'mesh {mesh} into equal blocks. Use a number of hosts that divides '
      f'{num_chips} into blocks whose sides divide {chips}.'
    )
  grid = [c // h for c, h in zip(chips, host)]
  coords = []
  for hz, hy, hx in itertools.product(*[range(g) for g in reversed(grid)]):
    task = []
    for z, y, x in itertools.product(*[range(h) for h in reversed(host)]):
      for core in range(cores):
        task.append(
          [hx * host[0] + x, hy * host[1] + y, hz * host[2] + z, core]
        )
    coords.append(task)
  return tf.tpu.experimental.Topology(
    mesh_shape=mesh, device_coordinates=np.array(coords, dtype=np.int32)
  )


def _NumCores(topology):
  coords = topology.device_coordinates
  return int(coords.shape[0] * coords.shape[1])


def _ValidCoresPerReplica(mesh):
  return sorted(
    {
      int(np.prod(s))
      for s in itertools.product(*[_Divisors(int(m)) for m in mesh])
    }
  )


def ComputationShape(topology, num_cores_per_replica):
  """The [x, y, z, core] block of cores that one replica occupies.

  The block uses as many cores of one chip as it can, then the most compact
  block of neighbouring chips; its sides divide the mesh, so that replicas of
  this shape tile the whole topology.

  Args:
    topology: a `tf.tpu.experimental.Topology`.
    num_cores_per_replica: K, the cores (pipeline stages) of one replica.

  Returns:
    A list of 4 ints whose product is K.

  Raises:
    ValueError: naming K, the mesh and the values of K that tile it.
  """
  mesh = [int(m) for m in topology.mesh_shape]
  valid = _ValidCoresPerReplica(mesh)
  try:
    k = _CheckPositiveInt('num_cores_per_replica', num_cores_per_replica)
  except ValueError as e:
    raise ValueError(f'{e} Valid values for mesh {mesh}: {valid}.') from None
  for cores in sorted(_Divisors(mesh[3]), reverse=True):
    if k % cores:
      continue
    chips = _CompactBlock(mesh[:3], k // cores)
    if chips is not None:
      return list(chips) + [cores]
  raise ValueError(
    f'num_cores_per_replica={k} cannot tile the TPU mesh {mesh} '
    f'([x, y, z, cores per chip], {_NumCores(topology)} cores): one replica '
    'must be a block of cores whose sides divide the mesh. Valid values: '
    f'{valid}. Choose a number of pipeline stages among them.'
  )


def BuildDeviceAssignment(topology, num_cores_per_replica, num_replicas=None):
  """Maps R replicas x K logical cores onto the TPU cores of `topology`.

  Args:
    topology: a `tf.tpu.experimental.Topology` (from
      `initialize_tpu_system`, or `MakeTopology`).
    num_cores_per_replica: K, pipeline stages per replica; logical core k of a
      replica runs stage k.
    num_replicas: R data-parallel replicas; None: as many as fit.

  Returns:
    A `tf.tpu.experimental.DeviceAssignment`.

  Raises:
    ValueError: if K cannot tile the mesh, or R * K exceeds the cores.
  """
  shape = ComputationShape(topology, num_cores_per_replica)
  k = int(np.prod(shape))
  total = _NumCores(topology)
  mesh = [int(m) for m in topology.mesh_shape]
  fit = int(np.prod([m // s for m, s in zip(mesh, shape)]))
  if num_replicas is None:
    r = fit
  else:
    r = _CheckPositiveInt('num_replicas', num_replicas)
  if r * k > total or r > fit:
    raise ValueError(
      f'num_replicas={r} x num_cores_per_replica={k} = {r * k} TPU cores, '
      f'but the topology (mesh {mesh}) has {total} cores. Use at most '
      f'{min(fit, total // k)} replicas (num_replicas=None takes all that '
      'fit) or fewer cores per replica.'
    )
  return tf.tpu.experimental.DeviceAssignment.build(
    topology, computation_shape=shape, num_replicas=r
  )


def DescribeAssignment(device_assignment, job=None):
  """A text table: where each replica's logical cores (stages) run.

  One row per (replica, logical core): the physical coordinates
  (x, y, z, core), the TF task (TPU host), the TPU ordinal on that host, and
  the TPU and host devices.
  """
  da = device_assignment
  topology = da.topology
  mesh = [int(m) for m in topology.mesh_shape]
  lines = [
    f'TPU device assignment: {da.num_replicas} replicas x '
    f'{da.num_cores_per_replica} logical cores (pipeline stages) on '
    f'mesh {mesh} ({_NumCores(topology)} cores, '
    f'{topology.num_tasks} tasks).'
  ]
  rows = [
    (
      'replica',
      'core',
      'coordinates',
      'task',
      'ordinal',
      'tpu device',
      'host device',
    )
  ]
  for r in range(da.num_replicas):
    for c in range(da.num_cores_per_replica):
      coords = tuple(int(v) for v in da.coordinates(r, c))
      rows.append(
        (
          str(r),
          str(c),
          '(' + ', '.join(map(str, coords)) + ')',
          str(int(topology.task_ordinal_at_coordinates(coords))),
          str(int(da.tpu_ordinal(r, c))),
          da.tpu_device(r, c, job=job),
          da.host_device(r, c, job=job),
        )
      )
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  for row in rows:
    lines.append('  '.join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
  return '\n'.join(lines)


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


def _HasLocalTPU():
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
    if not _HasLocalTPU():
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
  da = BuildDeviceAssignment(topology, num_cores_per_replica, num_replicas)
  logging.info('%s', DescribeAssignment(da))
  return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=da)


def _TPUStrategyTypes():
  types = [tf.distribute.TPUStrategy]
  for owner in (
    tf.distribute.experimental,
    tf.compat.v1.distribute.experimental,
  ):
    cls = getattr(owner, 'TPUStrategy', None)
    if cls is not None:
      types.append(cls)
  return tuple(types)


def IsTPUStrategy(strategy):
  """Whether `strategy` is a TPUStrategy (TF2, experimental or TF1)."""
  return isinstance(strategy, _TPUStrategyTypes())


def NumCoresPerReplica(strategy=None):
  """Logical cores per replica of `strategy` (default: the current one).

  1 for any strategy that is not a TPUStrategy. TPUStrategy exposes no public
  count; this reads its device assignment (`extended._device_assignment`), or
  else the [replicas, cores] array of its TPU devices
  (`extended._tpu_devices`), which `experimental_assign_to_logical_device`
  checks core ids against (tensorflow/python/distribute/tpu_strategy.py).
  """
  if strategy is None:
    strategy = tf.distribute.get_strategy()
  if not IsTPUStrategy(strategy):
    return 1
  extended = strategy.extended
  da = _tf_internal.TPUDeviceAssignment(extended)
  if da is not None:
    return int(da.num_cores_per_replica)
  devices = _tf_internal.TPUDevices(extended)
  if devices is not None and np.ndim(devices) == 2:
    return int(np.shape(devices)[1])
  return 1


def _InReplicaContextOf(strategy):
  context = tf.distribute.get_replica_context()
  return context is not None and context.strategy is strategy


def LogicalDeviceAssigner(strategy=None):
  """A function that pins tensors to a logical core, or None.

    assign = tpu.LogicalDeviceAssigner()
    if assign:                               # TPU, K > 1, in a replica
      outputs = assign(outputs, logical_core=k)
    else:
      ... tf.device(stage_device[k]) ...     # CPU, GPU, default strategy

  Args:
    strategy: default: `tf.distribute.get_strategy()`.

  Returns:
    `assign(structure, logical_core)`, which returns `structure` with every
    tensor passed through `strategy.experimental_assign_to_logical_device(t,
    logical_core)` (other leaves unchanged), when `strategy` is a TPUStrategy
    with more than one core per replica and this runs in its replica context
    (inside `strategy.run`); None otherwise.
  """
  if strategy is None:
    strategy = tf.distribute.get_strategy()
  if not IsTPUStrategy(strategy):
    return None
  num_cores = NumCoresPerReplica(strategy)
  if num_cores <= 1 or not _InReplicaContextOf(strategy):
    return None

  def Assign(structure, logical_core):
    if (
      isinstance(logical_core, bool)
      or not isinstance(logical_core, (int, np.integer))
      or not 0 <= logical_core < num_cores
    ):
      raise ValueError(
        f'logical_core={logical_core!r} is not a logical core of this '
        f'TPUStrategy, whose replicas have {num_cores} cores (0 to '
        f'{num_cores - 1}). Use at most {num_cores} pipeline stages or '
        'build the strategy with more cores per replica.'
      )
    return tf.nest.map_structure(
      lambda t: (
        strategy.experimental_assign_to_logical_device(t, int(logical_core))
        if tf.is_tensor(t)
        else t
      ),
      structure,
    )

  return Assign
