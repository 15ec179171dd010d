"""GPipe on TPUs: device assignment and `tf.distribute.TPUStrategy` set-up.

The concepts live in three modules; this one holds what a pipeline asks of
the strategy it runs under and re-exports the other two, so that
`lingvo_gpipe.core.tpu` gives everything:
* `tpu_topology`: topology, computation-shape and device-assignment
  arithmetic (no TPU needed);
* `tpu_connect`: finding and connecting to a TPU, `CreateTPUStrategy`;
* here: `IsTPUStrategy`, `NumCoresPerReplica`, `LogicalDeviceAssigner`.

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

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import tpu_connect
from lingvo_gpipe.core import tpu_topology

__all__ = [
  'TOPOLOGIES',
  'MakeTopology',
  'ComputationShape',
  'BuildDeviceAssignment',
  'DescribeAssignment',
  'CreateTPUStrategy',
  'HasLocalTPU',
  'IsTPUStrategy',
  'NumCoresPerReplica',
  'LogicalDeviceAssigner',
]

TOPOLOGIES = tpu_topology.TOPOLOGIES
MakeTopology = tpu_topology.MakeTopology
ComputationShape = tpu_topology.ComputationShape
BuildDeviceAssignment = tpu_topology.BuildDeviceAssignment
DescribeAssignment = tpu_topology.DescribeAssignment
CreateTPUStrategy = tpu_connect.CreateTPUStrategy
HasLocalTPU = tpu_connect.HasLocalTPU


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
