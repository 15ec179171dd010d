"""Unit tests for lingvo_gpipe.pipeline.placement (virtual CPU devices)."""

import pytest
import tensorflow as tf

from lingvo_gpipe.pipeline import placement

_AVAILABLE = [
  '/job:localhost/replica:0/task:0/device:CPU:0',
  '/job:localhost/replica:0/task:0/device:CPU:1',
  '/job:worker/replica:0/task:1/device:CPU:0',
]


@pytest.mark.parametrize(
  'name, want',
  [
    ('/device:CPU:1', _AVAILABLE[1]),
    ('/cpu:1', _AVAILABLE[1]),
    ('/job:localhost/device:CPU:0', _AVAILABLE[0]),
    ('/job:worker/task:1/device:CPU:0', _AVAILABLE[2]),
    ('/device:CPU:0', _AVAILABLE[0]),  # Local first when jobs differ.
  ],
)
def testCanonicalDevice(name, want):
  assert placement.CanonicalDevice(name, _AVAILABLE) == want


@pytest.mark.parametrize(
  'name, match',
  [
    ('/device:CPU:7', r"'/device:CPU:7' does not exist.*SplitCpu"),
    ('/job:worker/task:2/device:CPU:0', 'does not exist'),
    ('/job:worker', 'names no device type'),
  ],
)
def testCanonicalDeviceErrors(name, match):
  with pytest.raises(ValueError, match=match):
    placement.CanonicalDevice(name, _AVAILABLE)


def testResolveDevicesAgainstTheProcessDevices():
  cpus = [d.name for d in tf.config.list_logical_devices('CPU')]
  assert len(cpus) >= 2, 'tests/conftest.py splits the CPU'
  assert placement.ResolveDevices(['/cpu:1', '/cpu:0'], 2) == [cpus[1], cpus[0]]
  assert placement.ResolveDevices(None, 1) == [
    placement.CanonicalDevice(placement.DefaultDevices()[0])
  ]
  with pytest.raises(ValueError, match='3 stages but only 2 devices'):
    placement.ResolveDevices(['/cpu:0', '/cpu:1'], 3)
  with pytest.raises(ValueError, match='2 replicas x 2 stages need 4'):
    placement.ResolveDevices(['/cpu:0', '/cpu:1'], 4, num_replicas=2)
  with pytest.raises(ValueError, match='must be distinct'):
    placement.ResolveDevices(['/cpu:0', '/cpu:0'], 2, num_replicas=2)


def testStagePlacementOnDevices():
  cpus = [d.name for d in tf.config.list_logical_devices('CPU')]
  sp = placement.StagePlacement(['/cpu:0', '/cpu:1'], 1, 2, 'p')
  assert sp.replica_devices == [[cpus[0]], [cpus[1]]]
  assert sp.devices == [cpus[0]]
  assert sp.Describe(0) == f'{cpus[0]} (replica 0), {cpus[1]} (replica 1)'

  @tf.function
  def Fn():
    with sp.Scope(0, r=1):
      return tf.identity(1.0, name='placed')

  (op,) = [
    o
    for o in Fn.get_concrete_function().graph.get_operations()
    if o.name == 'placed'
  ]
  assert op.device == cpus[1]
  x = tf.constant(1.0)
  with sp.Call():
    assert sp.Place(x, 0) is x  # Not on TPU: nothing to pin.


def testStagePlacementAbstractAndUnderAStrategy():
  sp = placement.StagePlacement(['/cpu:9'], 3, 1, 'p', abstract=True)
  assert sp.devices is None and sp.Describe(0) == 'None'
  strategy = tf.distribute.OneDeviceStrategy('/cpu:0')
  with strategy.scope():
    one = placement.StagePlacement(None, 1, 1, 'p')
    assert one.Describe(0) == "each OneDeviceStrategy replica's device"
    # K cells all run on the replica's device.
    two = placement.StagePlacement(None, 2, 1, 'p')
    assert two.Describe(1) == "each OneDeviceStrategy replica's device"
    with pytest.raises(ValueError, match="'p' has 2 replicas but is built"):
      placement.StagePlacement(None, 1, 2, 'p')
