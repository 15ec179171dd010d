"""TPU topology arithmetic, without a TPU: meshes, replica blocks, assignments.

A pipeline of K stages runs on TPUs as R data-parallel replicas of K cores
each: stage k of a replica is that replica's *logical core* k, and XLA places
the ops of stage k on the physical core that the `DeviceAssignment` maps
(replica, k) to.

* `MakeTopology(mesh_shape, ...)` builds a `tf.tpu.experimental.Topology`
  without a TPU (from a mesh shape, or a preset name of `TOPOLOGIES`), for
  planning and tests. On a real TPU the topology comes from
  `tf.tpu.experimental.initialize_tpu_system` (see `tpu_connect`).
* `ComputationShape(topology, K)` is the [x, y, z, core] block of K cores one
  replica occupies: the cores of one chip first, then the most compact block
  of neighbouring chips, with sides that divide the mesh so that the replicas
  tile it.
* `BuildDeviceAssignment(topology, K, R)` maps every (replica, logical core)
  to a physical core with `tf.tpu.experimental.DeviceAssignment.build`, and
  `DescribeAssignment(...)` prints that map (for logging placement).

Tested on CPU (tests/core/tpu_test.py); none of it needs a TPU.
"""

import itertools

import numpy as np
import tensorflow as tf

__all__ = [
  'TOPOLOGIES',
  'MakeTopology',
  'ComputationShape',
  'BuildDeviceAssignment',
  'DescribeAssignment',
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
