"""Tests of lingvo_gpipe.core.meta."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap


# -- ToSpec / ToShape ----------------------------------------------------------


def testToSpecFromTensorShape():
  assert meta.ToSpec(tf.TensorShape([2, None])) == tf.TensorSpec([2, None])
  assert meta.ToSpec(tf.TensorShape([3]), tf.int32) == tf.TensorSpec(
    [3], tf.int32
  )


def testToSpecFromListsAndTuplesOfInts():
  assert meta.ToSpec([4, 5]) == tf.TensorSpec([4, 5], tf.float32)
  assert meta.ToSpec((4, None), tf.bfloat16) == tf.TensorSpec(
    [4, None], tf.bfloat16
  )
  assert meta.ToSpec([]) == tf.TensorSpec([], tf.float32)


def testToSpecKeepsTensorSpec():
  spec = tf.TensorSpec([2], tf.int64, name='ids')
  assert meta.ToSpec(spec) is spec
  assert meta.ToSpec(spec, tf.float32).dtype == tf.int64


def testToSpecFromTensorLike():
  assert meta.ToSpec(tf.zeros([2, 3], tf.int32)) == tf.TensorSpec(
    [2, 3], tf.int32
  )
  assert meta.ToSpec(np.zeros([4], np.float64)) == tf.TensorSpec(
    [4], tf.float64
  )


def testToSpecFromNestedMap():
  out = meta.ToSpec(NestedMap(x=[2, 3], aux=NestedMap(p=tf.TensorShape([2]))))
  assert isinstance(out, NestedMap) and isinstance(out.aux, NestedMap)
  assert out.x == tf.TensorSpec([2, 3]) and out.aux.p == tf.TensorSpec([2])


def testToSpecFromTupleOfShapes():
  out = meta.ToSpec(([2, 3], tf.TensorShape([4]), (5,)))
  assert isinstance(out, tuple) and len(out) == 3
  assert out == (tf.TensorSpec([2, 3]), tf.TensorSpec([4]), tf.TensorSpec([5]))
  out = meta.ToSpec([[1], [2, 2]], tf.int32)
  assert out == [tf.TensorSpec([1], tf.int32), tf.TensorSpec([2, 2], tf.int32)]
  # An absent input (None) stays absent, alone or among others.
  assert meta.ToSpec(None) is None
  assert meta.ToSpec(([2], None)) == (tf.TensorSpec([2]), None)


def testToSpecRejectsOtherValues():
  with pytest.raises(TypeError, match="Cannot interpret 'abc' as a shape"):
    meta.ToSpec('abc')


def testToSpecAcceptsNumpyIntDims():
  assert meta.ToSpec([np.int64(4), 8]) == tf.TensorSpec([4, 8])


def testToShape():
  out = meta.ToShape(
    NestedMap(a=tf.TensorShape([2, 3]), b=tf.TensorSpec([1], tf.int32))
  )
  assert out == NestedMap(a=tf.TensorShape([2, 3]), b=tf.TensorShape([1]))
  assert isinstance(out.a, tf.TensorShape) and isinstance(out.b, tf.TensorShape)
  assert meta.ToShape(tf.zeros([4, 1])) == tf.TensorShape([4, 1])


def testToShapeOfListShapes():
  assert meta.ToShape([2, 3]) == tf.TensorShape([2, 3])
  assert meta.ToShape(NestedMap(a=[2, 3])) == NestedMap(
    a=tf.TensorShape([2, 3])
  )


def testMeta():
  out = meta.Meta(12.0, tf.TensorShape([2]), tf.TensorShape([3]))
  assert out == NestedMap(
    flops=12, out_shapes=(tf.TensorShape([2]), tf.TensorShape([3]))
  )
  assert isinstance(out.flops, int)


# -- GraphFlops ----------------------------------------------------------------


def _Graph(fn, *specs):
  return tf.function(fn, autograph=False).get_concrete_function(*specs).graph


def testGraphFlopsMatMul():
  m, k, n = 3, 5, 7
  graph = _Graph(tf.matmul, tf.TensorSpec([m, k]), tf.TensorSpec([k, n]))
  assert meta.GraphFlops(graph) == 2 * m * n * k


def testGraphFlopsMatMulPlusElementwise():
  m, k, n = 4, 6, 2
  graph = _Graph(
    lambda a, b: tf.nn.relu(tf.matmul(a, b)),
    tf.TensorSpec([m, k]),
    tf.TensorSpec([k, n]),
  )
  assert meta.GraphFlops(graph) == 2 * m * n * k + m * n


def testGraphFlopsIgnoresShapeOps():
  graph = _Graph(
    lambda a: tf.reshape(tf.cast(a, tf.float64), [-1]), tf.TensorSpec([4, 4])
  )
  assert meta.GraphFlops(graph) == 0


def testGraphFlopsUnknownShapesCountZero():
  graph = _Graph(tf.matmul, tf.TensorSpec([None, 3]), tf.TensorSpec([3, 2]))
  assert meta.GraphFlops(graph) == 0


# -- TraceFPropMeta ------------------------------------------------------------


class _MapLayer(base_layer.BaseLayer):
  """NestedMap(x [b, in], paddings [b]) -> NestedMap(y [b, out], paddings)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 4, 'Input width.')
    p.Define('output_dim', 3, 'Output width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', py_utils.WeightParams([p.input_dim, p.output_dim]))

  def FProp(self, theta, inputs):
    assert isinstance(inputs, NestedMap)
    y = tf.matmul(inputs.x, theta.w)
    return NestedMap(y=y, paddings=inputs.paddings)


class _TwoOutputs(base_layer.BaseLayer):
  def FProp(self, theta, a, b):
    return tf.matmul(a, b), tf.reduce_sum(a, axis=1)


def testTraceFPropMetaWithNestedMaps():
  p = _MapLayer.Params().Set(name='m', input_dim=4, output_dim=3)
  created = []

  def Creator(next_creator, **kwargs):
    created.append(kwargs)
    return next_creator(**kwargs)

  with tf.variable_creator_scope(Creator):
    out = meta.TraceFPropMeta(p, NestedMap(x=[8, 4], paddings=[8]))
  assert not created
  assert out.flops == 2 * 8 * 4 * 3
  (shapes,) = out.out_shapes
  assert isinstance(shapes, NestedMap)
  assert shapes.y == tf.TensorShape([8, 3])
  assert shapes.paddings == tf.TensorShape([8])
  assert p.name == 'm'  # The caller's Params are untouched.


def testTraceFPropMetaWithoutNameAndPartialShapes():
  out = meta.TraceFPropMeta(
    _MapLayer.Params(), NestedMap(x=[None, 4], paddings=[None])
  )
  assert out.out_shapes[0].y.as_list() == [None, 3]


def testTraceFPropMetaCountsFlopsOfAnUnknownBatch():
  # A batch of None, as in `input_shapes=[[None, 8, 8, 1]]`: the flops are
  # those of one example (TensorFlow counts none for unknown shapes), the
  # output shapes keep the unknown batch.
  p = _MapLayer.Params().Set(input_dim=4, output_dim=3)
  out = meta.TraceFPropMeta(p, NestedMap(x=[None, 4], paddings=[None]))
  assert out.flops == 2 * 1 * 4 * 3
  assert out.out_shapes[0].y.as_list() == [None, 3]
  out = meta.TraceFPropMeta(
    p, NestedMap(x=[None, 4], paddings=[None]), unknown_dim_size=8
  )
  assert out.flops == 2 * 8 * 4 * 3


def testTraceFPropMetaMultipleOutputsNoWeights():
  out = meta.TraceFPropMeta(_TwoOutputs.Params(), [2, 3], tf.TensorSpec([3, 5]))
  assert out.out_shapes == (tf.TensorShape([2, 5]), tf.TensorShape([2]))
  assert out.flops >= 2 * 2 * 3 * 5


def testTraceFPropMetaInsideInitDoesNotAddChildren():
  metas = []

  class Outer(base_layer.BaseLayer):
    def __init__(self, params):
      super().__init__(params)
      metas.append(
        _MapLayer.FPropMeta(
          _MapLayer.Params().Set(name='probe'),
          NestedMap(x=[2, 4], paddings=[2]),
        )
      )
      self.CreateChild('inner', _MapLayer.Params())

  outer = Outer.Params().Set(name='outer').Instantiate()
  assert metas[0].flops == 2 * 2 * 4 * 3
  assert set(outer.children) == {'inner'}
  assert list(outer.VariablesByName()) == ['outer/inner/w']
  assert not base_layer.IsAbstract()
