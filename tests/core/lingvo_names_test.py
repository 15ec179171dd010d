"""Lingvo's smaller names: `compat`, `cluster_factory`, `tshape`,
`test_utils.TestCase`, `py_utils.GetOrCreateGlobalStep`,
`base_layer.initializer`."""

import numpy as np
import pytest
import tensorflow as tf

import lingvo_gpipe.compat as compat_tf
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import cluster_factory
from lingvo_gpipe.core import gpipe
from lingvo_gpipe.core import layers
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core import test_utils
from lingvo_gpipe.core import tshape


def testCompatIsTensorFlowAndRefusesTf1InOneLine():
  assert compat_tf.matmul is tf.matmul
  assert compat_tf.float32 == tf.float32
  assert compat_tf.logging is tf.compat.v1.logging
  with pytest.raises(RuntimeError, match='TF1.*remove it') as e:
    compat_tf.disable_v2_behavior()
  assert '\n' not in str(e.value)
  with pytest.raises(RuntimeError, match='FPropDefaultTheta'):
    compat_tf.Session()
  with pytest.raises(AttributeError, match="no 'nope'"):
    _ = compat_tf.nope


def _Pipe():
  cells = [
    gpipe.FeatureExtractionLayer.Params().Set(
      name=f'cell_{k}',
      sub=[
        layers.FCLayer.Params().Set(name=f'fc{k}', input_dim=4, output_dim=4)
      ],
    )
    for k in range(2)
  ]
  return gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells)


def testClusterParamsGiveThePipelineItsDevices():
  p = cluster_factory.Cluster.Params()
  p.worker.cpus_per_replica = 4
  p.worker.devices_per_split = 2
  p.split_id = 1
  with cluster_factory.Cluster(p) as c:
    assert cluster_factory.Current() is c
    assert c.num_devices_per_split == 2
    assert c.WorkerDeviceInModelSplit(0).endswith('CPU:2')
    pipe = _Pipe().Instantiate()
  assert [d.split(':')[-1] for d in pipe.devices] == ['2', '3']
  assert cluster_factory.Top() is None
  with cluster_factory.ForTestingWorker(cpus=2, split_size=2, do_eval=True):
    assert py_utils.IsEval()
  assert not py_utils.IsEval()
  with pytest.raises(ValueError, match='asks for 64 CPU devices'):
    with cluster_factory.ForTestingWorker(cpus=64, split_size=2):
      _Pipe().Instantiate()


def testTShape():
  s = tshape.Shape([2, 3, 4])
  assert s.rank == 3 and s.num_elements() == 24
  assert isinstance(s[:2], tshape.Shape) and s[:2] + [5] == [2, 3, 5]
  assert s.ToTensorShape() == tf.TensorShape([2, 3, 4])
  m = layers.FCLayer.FPropMeta(
    layers.FCLayer.Params().Set(input_dim=4, output_dim=6), s
  )
  assert m.out_shapes[0].as_list() == [2, 3, 6]
  with pytest.raises(TypeError, match='ints or None'):
    tshape.Shape([2.5])


class _Case(test_utils.TestCase):
  def testSeedsAndNoSession(self):
    self.assertAllClose(tf.ones([2]), np.ones([2]))
    with self.assertRaisesRegex(RuntimeError, 'no session'):
      self.session()


def testTestCase():
  case = _Case('testSeedsAndNoSession')
  result = case.run()
  assert result.wasSuccessful(), result.errors + result.failures


def testGlobalStepAndInitializer():
  step = py_utils.GetOrCreateGlobalStep()
  assert step is py_utils.GetOrCreateGlobalStepVar()
  assert step.dtype == tf.int64 and step.name == 'global_step:0'

  def Init(self):
    return self

  assert base_layer.initializer(Init) is Init
