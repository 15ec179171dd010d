"""Tests for lingvo_gpipe.core.tpu without a TPU.

Covered: topologies built from mesh shapes, computation shapes, device
assignments and their description, the failure of CreateTPUStrategy where no
TPU answers (fast, clear), and which code path LogicalDeviceAssigner picks
(with TPUStrategy stand-ins whose `extended` is faked). Nothing here runs on
a TPU.
"""

import socket
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import nested_map
from lingvo_gpipe.core import tpu
from tests.testing import fake_tpu


def _AllCoordinates(topology):
  return [tuple(c) for c in topology.device_coordinates.reshape(-1, 4)]


# Topologies.


@pytest.mark.parametrize(
  'name,mesh,tasks',
  [
    ('v2-8', [2, 2, 1, 2], 1),
    ('v3-8', [2, 2, 1, 2], 1),
    ('v3-32', [4, 4, 1, 2], 4),
    ('v4-8', [2, 2, 1, 1], 1),
    ('v4-32', [2, 2, 4, 1], 4),
  ],
)
def testPresetTopologies(name, mesh, tasks):
  t = tpu.MakeTopology(name)
  assert isinstance(t, tf.tpu.experimental.Topology)
  assert list(t.mesh_shape) == mesh
  cores = int(np.prod(mesh))
  assert t.num_tasks == tasks
  assert t.num_tpus_per_task == cores // tasks
  coords = _AllCoordinates(t)
  assert len(set(coords)) == cores  # every core of the mesh exactly once
  assert all(0 <= c[i] < mesh[i] for c in coords for i in range(4))
  assert t.missing_devices.size == 0
  # TF's inverse maps agree with the coordinates given.
  for task in range(tasks):
    for ordinal in range(cores // tasks):
      c = t.device_coordinates[task, ordinal]
      assert t.task_ordinal_at_coordinates(c) == task
      assert t.tpu_device_ordinal_at_coordinates(c) == ordinal
  # What initialize_tpu_system hands over is this topology, serialized.
  again = tf.tpu.experimental.Topology(serialized=t.serialized())
  np.testing.assert_array_equal(again.device_coordinates, t.device_coordinates)
  np.testing.assert_array_equal(again.mesh_shape, t.mesh_shape)


def testV332HostsOwn2x2ChipBlocks():
  t = tpu.MakeTopology('v3-32')
  for task in range(4):
    chips = {tuple(c[:3]) for c in t.device_coordinates[task]}
    xs, ys = {c[0] for c in chips}, {c[1] for c in chips}
    assert len(chips) == 4 and len(xs) == 2 and len(ys) == 2, chips
    assert max(xs) - min(xs) == 1 and max(ys) - min(ys) == 1, chips
    # The cores of a chip are neighbours in ordinal order.
    assert [c[3] for c in t.device_coordinates[task]] == [0, 1] * 4


def testMakeTopologyFromShapes():
  a = tpu.MakeTopology([2, 2, 1], cores_per_chip=2)
  b = tpu.MakeTopology([2, 2, 1, 2])
  np.testing.assert_array_equal(a.device_coordinates, b.device_coordinates)
  assert list(a.mesh_shape) == [2, 2, 1, 2]
  t = tpu.MakeTopology([4, 2, 2, 1], num_tasks=2)
  assert t.device_coordinates.shape == (2, 8, 4)
  assert len(set(_AllCoordinates(t))) == 16
  assert tpu.MakeTopology('v3-32', num_tasks=1).num_tasks == 1


@pytest.mark.parametrize(
  'kwargs,match',
  [
    (dict(mesh_shape=[2, 2, 1]), r'cores_per_chip'),
    (dict(mesh_shape=[2, 2, 1, 2], cores_per_chip=1), r'cores_per_chip=1'),
    (dict(mesh_shape=[2, 2]), r'\[2, 2\]'),
    (dict(mesh_shape=[2, 0, 1, 2]), r'positive integer; got 0'),
    (dict(mesh_shape='v9-8'), r"'v9-8'.*v3-8"),
    (dict(mesh_shape=[2, 2, 1, 2], num_tasks=3), r'num_tasks=3.*4 chips'),
  ],
)
def testMakeTopologyErrors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tpu.MakeTopology(**kwargs)


# Computation shapes.


@pytest.mark.parametrize(
  'name,k,shape',
  [
    ('v3-8', 1, [1, 1, 1, 1]),
    ('v3-8', 2, [1, 1, 1, 2]),
    ('v3-8', 4, [2, 1, 1, 2]),
    ('v3-8', 8, [2, 2, 1, 2]),
    ('v3-32', 1, [1, 1, 1, 1]),
    ('v3-32', 2, [1, 1, 1, 2]),
    ('v3-32', 4, [2, 1, 1, 2]),
    ('v3-32', 8, [2, 2, 1, 2]),
    ('v3-32', 16, [4, 2, 1, 2]),
    ('v3-32', 32, [4, 4, 1, 2]),
    ('v4-8', 2, [2, 1, 1, 1]),
    ('v4-8', 4, [2, 2, 1, 1]),
    ('v4-32', 8, [2, 2, 2, 1]),
  ],
)
def testComputationShape(name, k, shape):
  t = tpu.MakeTopology(name)
  got = tpu.ComputationShape(t, k)
  assert got == shape
  assert int(np.prod(got)) == k
  assert all(m % s == 0 for m, s in zip(t.mesh_shape, got))  # tiles the mesh


@pytest.mark.parametrize(
  'name,k,valid',
  [
    ('v3-8', 3, '[1, 2, 4, 8]'),
    ('v3-8', 16, '[1, 2, 4, 8]'),
    ('v3-32', 6, '[1, 2, 4, 8, 16, 32]'),
    ('v4-8', 8, '[1, 2, 4]'),
  ],
)
def testComputationShapeError(name, k, valid):
  mesh = str(list(tpu.TOPOLOGIES[name]['mesh_shape']))
  with pytest.raises(ValueError) as e:
    tpu.ComputationShape(tpu.MakeTopology(name), k)
  message = str(e.value)
  assert f'num_cores_per_replica={k}' in message
  assert mesh in message and valid in message


def testComputationShapeRejectsNonPositive():
  with pytest.raises(ValueError, match=r'got 0.*\[1, 2, 4, 8\]'):
    tpu.ComputationShape(tpu.MakeTopology('v3-8'), 0)


# Device assignments.


def _ChipDistance(a, b):
  return sum(abs(int(x) - int(y)) for x, y in zip(a[:3], b[:3]))


@pytest.mark.parametrize(
  'name,k,r,want_r',
  [
    ('v3-8', 1, None, 8),
    ('v3-8', 2, None, 4),
    ('v3-8', 2, 2, 2),
    ('v3-8', 4, None, 2),
    ('v3-8', 8, None, 1),
    ('v3-32', 2, None, 16),
    ('v3-32', 4, None, 8),
    ('v3-32', 8, 3, 3),
    ('v3-32', 16, None, 2),
    ('v4-8', 2, None, 2),
    ('v4-32', 4, None, 4),
  ],
)
def testBuildDeviceAssignment(name, k, r, want_r):
  t = tpu.MakeTopology(name)
  da = tpu.BuildDeviceAssignment(t, k, r)
  assert isinstance(da, tf.tpu.experimental.DeviceAssignment)
  assert da.num_replicas == want_r
  assert da.num_cores_per_replica == k
  coords = [da.coordinates(i, c) for i in range(want_r) for c in range(k)]
  assert len(set(coords)) == want_r * k  # no core used twice
  assert set(coords) <= set(_AllCoordinates(t))
  for i in range(want_r):
    replica = [da.coordinates(i, c) for c in range(k)]
    if k == 2 and t.mesh_shape[3] == 2:
      # Two stages: the two cores of one chip.
      assert replica[0][:3] == replica[1][:3]
      assert {replica[0][3], replica[1][3]} == {0, 1}
    if r is None:
      # All replicas: TF orders each replica's cores as a ring, so stage k
      # and stage k + 1 are on one chip or on neighbouring chips.
      for a, b in zip(replica, replica[1:]):
        assert _ChipDistance(a, b) <= 1, (i, replica)
    if name == 'v3-32' and k <= 8:
      # A replica of up to 8 cores stays on one host.
      assert len({da.host_device(i, c) for c in range(k)}) == 1


def testDeviceAssignmentTooLarge():
  t = tpu.MakeTopology('v3-32')
  with pytest.raises(ValueError) as e:
    tpu.BuildDeviceAssignment(t, 8, 5)
  message = str(e.value)
  for part in (
    'num_replicas=5',
    'num_cores_per_replica=8',
    '= 40',
    'has 32 cores',
    'at most 4 replicas',
  ):
    assert part in message, message
  with pytest.raises(ValueError, match=r'num_replicas=3.*= 24.*has 8 cores'):
    tpu.BuildDeviceAssignment(tpu.MakeTopology('v3-8'), 8, 3)
  with pytest.raises(ValueError, match=r'num_replicas must be a positive'):
    tpu.BuildDeviceAssignment(t, 2, 0)
  with pytest.raises(ValueError, match=r'num_cores_per_replica=3'):
    tpu.BuildDeviceAssignment(t, 3)


def testDescribeAssignment():
  da = tpu.BuildDeviceAssignment(tpu.MakeTopology('v3-32'), 2, 3)
  text = tpu.DescribeAssignment(da, job='worker')
  lines = text.splitlines()
  assert lines[0].startswith(
    'TPU device assignment: 3 replicas x 2 logical '
    'cores (pipeline stages) on mesh [4, 4, 1, 2] '
    '(32 cores, 4 tasks)'
  )
  assert lines[1].split() == [
    'replica',
    'core',
    'coordinates',
    'task',
    'ordinal',
    'tpu',
    'device',
    'host',
    'device',
  ]
  rows = lines[2:]
  assert len(rows) == 3 * 2
  for row, (r, c) in zip(rows, [(r, c) for r in range(3) for c in range(2)]):
    coords = '(' + ', '.join(str(int(v)) for v in da.coordinates(r, c)) + ')'
    task = da.topology.task_ordinal_at_coordinates(da.coordinates(r, c))
    want = [
      str(r),
      str(c),
      coords,
      str(task),
      str(da.tpu_ordinal(r, c)),
      da.tpu_device(r, c, job='worker'),
      da.host_device(r, c, job='worker'),
    ]
    got = [v for v in row.split('  ') if v.strip()]
    assert [v.strip() for v in got] == want, row
  assert '/job:worker/task:0/device:TPU:1' in rows[1]


# CreateTPUStrategy without a TPU.


_TPU_ENV = ('TPU_NAME', 'KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS', 'TPU_CONFIG')


@pytest.fixture(name='no_tpu_env')
def _NoTPUEnv(monkeypatch):
  for var in _TPU_ENV:
    monkeypatch.delenv(var, raising=False)
  if tpu.HasLocalTPU():
    pytest.skip('This machine has a TPU.')
  return monkeypatch


def _TimedFailure(match, **kwargs):
  start = time.time()
  with pytest.raises(RuntimeError, match=match) as e:
    tpu.CreateTPUStrategy(**kwargs)
  return time.time() - start, str(e.value)


@pytest.mark.parametrize('name', ['', 'local'])
def testCreateTpuStrategyWithoutTpu(no_tpu_env, name):
  del no_tpu_env
  elapsed, message = _TimedFailure(
    f'No TPU was found for tpu={name!r}', tpu=name, num_cores_per_replica=2
  )
  assert elapsed < 10
  assert 'has no TPU devices' in message
  assert '--run_locally=cpu' in message


def _ClosedPort():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def testCreateTpuStrategyUnreachableGrpc(no_tpu_env):
  del no_tpu_env
  address = f'127.0.0.1:{_ClosedPort()}'
  elapsed, message = _TimedFailure(
    r'No TPU was found', tpu=f'grpc://{address}', timeout_s=5
  )
  assert elapsed < 10
  assert address in message and 'TCP' in message


def testCreateTpuStrategySilentServerFromEnv(no_tpu_env):
  # TCP accepts, nothing answers: TF's own connect would wait for minutes.
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    s.listen(4)
    address = f'127.0.0.1:{s.getsockname()[1]}'
    no_tpu_env.setenv('TPU_NAME', f'grpc://{address}')
    elapsed, message = _TimedFailure(r'No TPU was found', timeout_s=1)
  assert elapsed < 10
  assert address in message and 'no gRPC server answered' in message


def testCreateTpuStrategyBoundsTpuNameLookup(no_tpu_env):
  release = threading.Event()

  class HangingResolver:
    def __init__(self, tpu=None):  # pylint: disable=redefined-outer-name
      del tpu
      release.wait(30)  # like urllib waiting on a metadata server

  no_tpu_env.setattr(
    tf.distribute.cluster_resolver, 'TPUClusterResolver', HangingResolver
  )
  try:
    elapsed, message = _TimedFailure(
      r"No TPU was found for tpu='my-tpu'", tpu='my-tpu', timeout_s=0.5
    )
  finally:
    release.set()
  assert elapsed < 5
  assert 'did not finish within 0.5 s' in message
  assert 'grpc://' in message


# Code-path selection.


def testDefaultStrategyHasNoAssigner():
  assert tpu.LogicalDeviceAssigner() is None
  assert tpu.NumCoresPerReplica() == 1
  assert not tpu.IsTPUStrategy(tf.distribute.get_strategy())


def testMirroredStrategyHasNoAssigner():
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  assert tpu.NumCoresPerReplica(strategy) == 1
  assert tpu.LogicalDeviceAssigner(strategy) is None
  seen = []

  def Step():
    seen.append(
      (
        tpu.LogicalDeviceAssigner(),
        tpu.NumCoresPerReplica(),
        tf.distribute.get_strategy() is strategy,
      )
    )
    return tf.constant(1.0)

  strategy.run(Step)
  assert seen and all(s == (None, 1, True) for s in seen), seen


def testNumCoresPerReplicaOfTpuStrategy():
  da = tpu.BuildDeviceAssignment(tpu.MakeTopology('v3-8'), 4)
  assert tpu.NumCoresPerReplica(fake_tpu.FakeTPUStrategy(2, 4, da)) == 4
  assert tpu.NumCoresPerReplica(fake_tpu.FakeTPUStrategy(8, 1)) == 1
  assert tpu.NumCoresPerReplica(fake_tpu.FakeTPUStrategy(4, 2)) == 2
  assert tpu.IsTPUStrategy(fake_tpu.FakeTPUStrategy(4, 2))


def testTpuAssignerWrapsEveryTensor():
  strategy = fake_tpu.FakeTPUStrategy(2, 4)
  assert tpu.LogicalDeviceAssigner(strategy) is None  # cross-replica context
  x, y, z = tf.ones([2]), tf.zeros([3]), tf.constant(5)
  structure = nested_map.NestedMap(a=x, b=(y, [z, None]), n=3)
  with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
    assert (
      tpu.LogicalDeviceAssigner(tf.distribute.MirroredStrategy(['/cpu:0']))
      is None
    )  # not this replica context's strategy
    assign = tpu.LogicalDeviceAssigner()  # the current strategy
    assert assign is not None
    out = assign(structure, 2)
    with pytest.raises(ValueError, match=r'logical_core=4 .* 4 cores'):
      assign(structure, 4)
  assert isinstance(out, nested_map.NestedMap)
  assert out.n == 3 and out.b[1][1] is None
  assert [id(t) for t, _ in strategy.calls] == [id(x), id(y), id(z)]
  assert [k for _, k in strategy.calls] == [2, 2, 2]
  np.testing.assert_array_equal(out.b[0].numpy(), y.numpy())
  # One core per replica: nothing to assign.
  single = fake_tpu.FakeTPUStrategy(8, 1)
  with tf.distribute.ReplicaContext(single, replica_id_in_sync_group=0):
    assert tpu.LogicalDeviceAssigner() is None


def testTpuAssignerEmitsXlaSharding():
  from tensorflow.compiler.xla import xla_data_pb2  # pylint: disable=g-import-not-at-top

  strategy = fake_tpu.FakeTPUStrategy(2, 4, record=False)

  @tf.function
  def Stage(x):
    with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
      return tpu.LogicalDeviceAssigner()((x, {'y': x * 2}), 3)

  graph = Stage.get_concrete_function(tf.TensorSpec([2])).graph
  shardings = [op for op in graph.get_operations() if op.type == 'XlaSharding']
  assert len(shardings) == 2
  for op in shardings:
    proto = xla_data_pb2.OpSharding()
    proto.ParseFromString(op.get_attr('_XlaSharding'))
    assert proto.type == xla_data_pb2.OpSharding.MAXIMAL
    assert list(proto.tile_assignment_devices) == [3]
  out = Stage(tf.ones([2]))  # an identity on CPU
  np.testing.assert_array_equal(out[1]['y'].numpy(), [2.0, 2.0])
