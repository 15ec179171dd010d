"""Tests of lingvo_gpipe.core.py_utils."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import linears
from lingvo_gpipe.core.py_utils import WeightInit

_SEED = 1234


def _Draw(init, shape, dtype=tf.float32, seed=_SEED):
  return py_utils.InitialValue(init, shape, dtype, seed).numpy()


# -- Weight initializers -------------------------------------------------------


def testWeightInitParams():
  p = WeightInit.Gaussian(2.0, seed=3)
  assert (p.method, p.scale, p.seed) == ('gaussian', 2.0, 3)
  assert not p.IsFrozen()  # writable, as in Lingvo (FromText can set it)
  assert WeightInit.Glorot(0.5).method == 'xavier'
  assert WeightInit.Constant(1.5).method == 'constant'


def testDefaultParamInitIsMarkedXavier():
  p = py_utils.DefaultParamInit()
  assert py_utils.IsDefaultParamInit(p)
  assert not py_utils.IsDefaultParamInit(WeightInit.Xavier(1.0))
  assert not py_utils.IsDefaultParamInit(WeightInit.Xavier(1.000001, seed=1))
  assert not py_utils.IsDefaultParamInit(WeightInit.Gaussian(1.000001))


def testGaussian():
  x = _Draw(WeightInit.Gaussian(2.0), [256, 256])
  assert x.shape == (256, 256) and x.dtype == np.float32
  assert abs(x.mean()) < 0.05
  assert x.std() == pytest.approx(2.0, rel=0.02)
  assert np.abs(x).max() > 6.0  # Not truncated.


def testUniform():
  x = _Draw(WeightInit.Uniform(3.0), [256, 256])
  assert x.min() >= -3.0 and x.max() <= 3.0
  assert x.min() < -2.95 and x.max() > 2.95
  assert abs(x.mean()) < 0.05
  assert x.std() == pytest.approx(3.0 / np.sqrt(3.0), rel=0.02)


@pytest.mark.parametrize(
  'shape,fan_in,fan_out',
  [
    ([200, 300], 200, 300),
    ([3, 3, 16, 32], 144, 288),
    ([500], 500, 500),
  ],
)
def testXavierLimit(shape, fan_in, fan_out):
  x = _Draw(WeightInit.Xavier(2.0), shape)
  limit = 2.0 * np.sqrt(6.0 / (fan_in + fan_out))
  assert np.abs(x).max() <= limit * (1 + 1e-6)
  assert np.abs(x).max() > limit * 0.97
  assert x.std() == pytest.approx(limit / np.sqrt(3.0), rel=0.1)


def testTruncatedGaussianWithinTwoStd():
  scale = 0.5
  x = _Draw(WeightInit.TruncatedGaussian(scale), [256, 256])
  assert np.abs(x).max() <= 2 * scale
  assert np.abs(x).max() > 0.95 * 2 * scale
  assert abs(x.mean()) < 0.02
  # Std of a standard normal truncated at +-2 is 0.8796.
  assert x.std() == pytest.approx(0.8796 * scale, rel=0.02)


def testConstant():
  x = _Draw(WeightInit.Constant(0.25), [3, 4])
  np.testing.assert_array_equal(x, np.full([3, 4], 0.25, np.float32))
  x = _Draw(WeightInit.Constant(2.0), [5], dtype=tf.int32)
  assert x.dtype == np.int32
  np.testing.assert_array_equal(x, [2] * 5)


def testGaussianSqrtDim():
  x = _Draw(WeightInit.GaussianSqrtDim(3.0), [400, 160])
  assert x.std() == pytest.approx(3.0 / np.sqrt(400), rel=0.02)
  assert abs(x.mean()) < 0.01


def testGaussianSqrtFanIn():
  x = _Draw(WeightInit.GaussianSqrtFanIn(1.0), [4, 25, 100])
  assert x.std() == pytest.approx(1.0 / np.sqrt(100), rel=0.03)


def testUniformUnitScaling():
  x = _Draw(WeightInit.UniformUnitScaling(1.5), [300, 200])
  limit = 1.5 * np.sqrt(3.0 / 300)
  assert np.abs(x).max() <= limit * (1 + 1e-6)
  assert np.abs(x).max() > limit * 0.97
  assert x.std() == pytest.approx(limit / np.sqrt(3.0), rel=0.02)


def testUniformSqrtDimUsesLastDim():
  x = _Draw(WeightInit.UniformSqrtDim(1.0), [50, 400])
  limit = 1.0 / np.sqrt(400)
  assert np.abs(x).max() <= limit * (1 + 1e-6)
  assert np.abs(x).max() > limit * 0.97


def testInitialValueCastsToDtype():
  x = py_utils.InitialValue(WeightInit.Gaussian(), [4, 4], tf.bfloat16, 1)
  assert x.dtype == tf.bfloat16


def testUnknownMethodError():
  p = WeightInit.Gaussian().Copy()
  p.method = 'bogus'
  with pytest.raises(
    ValueError, match=r"Unknown weight init method 'bogus'.*xavier"
  ):
    py_utils.InitialValue(p, [2], tf.float32, 0)


def testInitialValueDeterministicPerSeed():
  init = WeightInit.Gaussian()
  a = _Draw(init, [8, 8], seed=7)
  b = _Draw(init, [8, 8], seed=7)
  c = _Draw(init, [8, 8], seed=8)
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


# -- Hashes and seeds ----------------------------------------------------------


def testStableHashHardValues():
  # sha256('\x00'.join(map(str, parts)))[:4] little-endian & 0x7fffffff,
  # computed once outside this library.
  assert py_utils.StableHash(0, 'root/w') == 297417193
  assert py_utils.StableHash('mix', 3) == 878226680
  assert py_utils.StableHash('a') == 310482890
  assert py_utils.StableHash() == 1120186595
  assert 0 <= py_utils.StableHash('x', 1, 2.5) < 2**31
  assert py_utils.StableHash('a', 'b') != py_utils.StableHash('ab')


def testEvalModeNesting():
  assert not py_utils.IsEval()
  with py_utils.EvalMode():
    assert py_utils.IsEval()
    with py_utils.EvalMode(False):
      assert not py_utils.IsEval()
      with py_utils.EvalMode(True):
        assert py_utils.IsEval()
      assert not py_utils.IsEval()
    assert py_utils.IsEval()
  assert not py_utils.IsEval()


def testEvalModeRestoredOnException():
  with pytest.raises(RuntimeError):
    with py_utils.EvalMode():
      raise RuntimeError('boom')
  assert not py_utils.IsEval()


def testStepSeedAndSeedPair():
  pair = py_utils.GenerateStepSeedPair(7)
  assert pair.dtype == tf.int64
  np.testing.assert_array_equal(pair.numpy(), [7, 0])
  with py_utils.StepSeed(42):
    np.testing.assert_array_equal(py_utils.GenerateStepSeedPair(7), [7, 42])
    with py_utils.StepSeed(tf.constant(5, tf.int32)):
      inner = py_utils.GenerateStepSeedPair(9)
      assert inner.dtype == tf.int64
      np.testing.assert_array_equal(inner, [9, 5])
    np.testing.assert_array_equal(py_utils.GenerateStepSeedPair(7), [7, 42])
  np.testing.assert_array_equal(py_utils.GenerateStepSeedPair(7), [7, 0])


def testSameSeedPairSameRandomValues():
  def Draw(step):
    with py_utils.StepSeed(step):
      return tf.random.stateless_uniform(
        [16], py_utils.GenerateStepSeedPair(3)
      ).numpy()

  np.testing.assert_array_equal(Draw(10), Draw(10))
  assert not np.allclose(Draw(10), Draw(11))


def testMixSeed():
  values = [int(py_utils.MixSeed(10, i)) for i in range(100)]
  assert len(set(values)) == 100
  assert values[3] == (10 * 1000003) ^ 878226680
  assert int(py_utils.MixSeed(tf.constant(10), 3)) == values[3]
  assert py_utils.MixSeed(10, 3).dtype == tf.int64
  assert int(py_utils.MixSeed(11, 3)) != values[3]


# -- Deferred updates ----------------------------------------------------------


class _FakeLayer:
  def __init__(self, name, result=None):
    self.name = name
    self.calls = []
    self.result = result

  def ApplyDeferredUpdates(self, stats_list):
    self.calls.append(list(stats_list))
    return self.result


def testUpdateCollectorGroupsPerLayerInFirstSeenOrder():
  a, b = _FakeLayer('a', result='op_a'), _FakeLayer('b')
  with py_utils.UpdateCollector() as updates:
    py_utils.AddDeferredUpdate(b, 1)
    py_utils.AddDeferredUpdate(a, 2)
    py_utils.AddDeferredUpdate(b, 3)
  assert not a.calls and not b.calls  # Nothing applied yet.
  grouped = updates.Grouped()
  assert [(layer.name, stats) for layer, stats in grouped] == [
    ('b', [1, 3]),
    ('a', [2]),
  ]
  ops = updates.Apply()
  assert b.calls == [[1, 3]] and a.calls == [[2]]
  assert ops == ['op_a']  # None results are dropped.


def testAddDeferredUpdateOutsideCollectorAppliesAtOnce():
  a = _FakeLayer('a')
  py_utils.AddDeferredUpdate(a, 'stats')
  assert a.calls == [['stats']]


def testNestedCollectorsInnermostWins():
  a = _FakeLayer('a')
  with py_utils.UpdateCollector() as outer:
    py_utils.AddDeferredUpdate(a, 1)
    with py_utils.UpdateCollector() as inner:
      py_utils.AddDeferredUpdate(a, 2)
    py_utils.AddDeferredUpdate(a, 3)
  assert [s for _, s in inner.updates] == [2]
  assert [s for _, s in outer.updates] == [1, 3]
  py_utils.AddDeferredUpdate(a, 4)
  assert a.calls == [[4]]


def testApplyInATfFunctionIsNotConvertedByAutoGraph():
  # A tf.function converts what it calls with AutoGraph, line by line; the
  # layers' updates are graph-style code, and converting them cost seconds
  # per trace. Converted code runs from a generated file.
  files = []

  class Layer(_FakeLayer):
    def ApplyDeferredUpdates(self, stats_list):
      files.append(inspect.currentframe().f_code.co_filename)
      return tf.add_n(stats_list)

  @tf.function
  def Step(x):
    with py_utils.UpdateCollector() as updates:
      py_utils.AddDeferredUpdate(Layer('a'), x)
      py_utils.AddDeferredUpdate(Layer('b'), 2 * x)
    return updates.Apply()

  assert [float(t) for t in Step(tf.constant(1.0))] == [1.0, 2.0]
  assert files == [__file__, __file__], files


def testNoUpdateCollectionDrops():
  a = _FakeLayer('a')
  with py_utils.UpdateCollector() as outer:
    with py_utils.NoUpdateCollection():
      py_utils.AddDeferredUpdate(a, 1)
  assert not outer.updates and not a.calls


# -- Shapes --------------------------------------------------------------------


def testHasShapeAccepts():
  x = tf.zeros([2, 3, 4])
  assert py_utils.HasShape(x, [2, 3, 4]) is x
  py_utils.HasShape(x, [-1, 3, None])
  py_utils.HasShape(x, tf.TensorShape([2, None, 4]))


def testHasShapeErrorNamesLayerAndShapes():
  x = tf.zeros([2, 3])
  with pytest.raises(ValueError) as e:
    py_utils.HasShape(x, [-1, 5], layer_name='enc/fc', what='inputs')
  msg = str(e.value)
  assert "'enc/fc'" in msg and 'inputs' in msg
  assert '[2, 3]' in msg and '[?, 5]' in msg
  with pytest.raises(ValueError, match=r'\[2, 3\].*\[2, 3, \?\]'):
    py_utils.HasShape(x, [2, 3, None], layer_name='x')


def testHasShapeWithPartiallyKnownShapes():
  @tf.function(input_signature=[tf.TensorSpec([None, 3])])
  def Fn(x):
    py_utils.HasShape(x, [7, 3])  # Unknown dims are not checked.
    with pytest.raises(ValueError):
      py_utils.HasShape(x, [7, 4])
    return x

  Fn.get_concrete_function()

  @tf.function(input_signature=[tf.TensorSpec(None)])
  def Unknown(x):
    py_utils.HasShape(x, [1, 2, 3])  # Unknown rank: nothing to check.
    return x

  Unknown.get_concrete_function()


def testGetShapeStatic():
  shape = py_utils.GetShape(tf.zeros([2, 3, 4]))
  assert shape == [2, 3, 4] and all(isinstance(d, int) for d in shape)
  assert py_utils.GetShape(np.zeros([5, 6]), 1) == [5]


def testStaticShapesMakeNoOpsInATrace():
  """A traced layer holds no Shape or slicing ops for shapes known when it
  is traced (GetShape, and the layers that use it for their reshapes and
  paddings); an unknown dim still reads the tensor's shape."""

  def Ops(fn, spec):
    graph = tf.function(fn).get_concrete_function(spec).graph
    return [op.type for op in graph.get_operations()]

  known = Ops(
    lambda x: tf.constant(py_utils.GetShape(x, 2)), tf.TensorSpec([4, 3, 2])
  )
  assert 'Shape' not in known and 'StridedSlice' not in known, known
  w = tf.ones([2, 5])
  known = Ops(lambda x: linears.ProjectLastDim(x, w), tf.TensorSpec([4, 3, 2]))
  assert 'Shape' not in known and 'StridedSlice' not in known, known
  unknown = Ops(
    lambda x: linears.ProjectLastDim(x, w), tf.TensorSpec([None, 3, 2])
  )
  assert 'Shape' in unknown, unknown
  x = tf.reshape(tf.range(24, dtype=tf.float32), [4, 3, 2])
  np.testing.assert_array_equal(
    linears.ProjectLastDim(x, w), tf.einsum('btd,de->bte', x, w)
  )


def testGetShapeDynamic():
  seen = []

  @tf.function(input_signature=[tf.TensorSpec([None, 3])])
  def Fn(x):
    shape = py_utils.GetShape(x)
    seen.append(shape)
    return shape[0] * shape[1]

  assert int(Fn(tf.zeros([4, 3]))) == 12
  (shape,) = seen
  assert isinstance(shape[0], tf.Tensor) and shape[1] == 3

  @tf.function(input_signature=[tf.TensorSpec(None)])
  def Unknown(x):
    return py_utils.GetShape(x)

  np.testing.assert_array_equal(Unknown(tf.zeros([2, 5])), [2, 5])


def testGetShapeNdimsWithUnknownRank():
  @tf.function(input_signature=[tf.TensorSpec(None)])
  def Fn(x):
    return py_utils.GetShape(x, 2)

  np.testing.assert_array_equal(Fn(tf.zeros([2, 5, 7])), [2, 5])


def testNestAliases():
  m = py_utils.NestedMap(b=1, a=[2, 3])
  assert py_utils.Flatten(m) == [2, 3, 1]
  packed = py_utils.Pack(m, [4, 5, 6])
  assert isinstance(packed, py_utils.NestedMap) and packed.a == [4, 5]
  assert py_utils.Transform(lambda x, y: x + y, m, m) == py_utils.NestedMap(
    b=2, a=[4, 6]
  )


def testStackOfAnUnstackIsTheTensorItCameFrom():
  """Statistics a pipeline hands over unstacked are merged from the tensor
  they came from (no op per statistic); anything else is stacked."""

  @tf.function
  def Stacks(x):
    parts = tf.unstack(x)
    whole = py_utils.Stack(parts)
    reordered = py_utils.Stack(parts[::-1])
    fewer = py_utils.Stack(parts[:2])
    return whole, reordered, fewer

  x = tf.reshape(tf.range(12.0), [3, 4])
  graph = Stacks.get_concrete_function(x).graph
  packs = [op for op in graph.get_operations() if op.type == 'Pack']
  assert len(packs) == 2, [op.name for op in packs]
  whole, reordered, fewer = Stacks(x)
  np.testing.assert_array_equal(whole, x.numpy())
  np.testing.assert_array_equal(reordered, x.numpy()[::-1])
  np.testing.assert_array_equal(fewer, x.numpy()[:2])
  np.testing.assert_array_equal(
    py_utils.Stack([tf.constant(1.0), tf.constant(2.0)]), [1.0, 2.0]
  )
