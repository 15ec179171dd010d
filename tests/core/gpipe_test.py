"""Lingvo's GPipe surface (`lingvo_gpipe.core.gpipe`) on tiny models.

Children and theta named by their Params names with `cell_tpl`, `before_tpl`
as Lingvo's SeqLayer runs it, `FPropDefaultTheta`, activations passed
through and fetched by `FeatureExtractionLayer`, and Lingvo's
`PartitionSequentialLayers`.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import gpipe
from lingvo_gpipe.core import layers

DEVICES = [f'/device:CPU:{i}' for i in range(4)]


def _Fc(name, dim=4, activation='TANH'):
  return layers.FCLayer.Params().Set(
    name=name, input_dim=dim, output_dim=dim, activation=activation
  )


def _Cells(num_cells=2, per_cell=2):
  return [
    gpipe.FeatureExtractionLayer.Params().Set(
      name=f'cell_{k}',
      sub=[_Fc(f'fc{k * per_cell + i}') for i in range(per_cell)],
    )
    for k in range(num_cells)
  ]


def _LossAndGrads(layer, *inputs):
  with tf.GradientTape() as tape:
    out = layer.FPropDefaultTheta(*inputs)
    flat = tf.nest.flatten(out)
    loss = tf.add_n([tf.reduce_sum(t * t) for t in flat])
  grads = tape.gradient(loss, layer.vars)
  return out, grads


def _AssertNestedClose(a, b, rtol=1e-5):
  tf.nest.assert_same_structure(a, b)
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=rtol, atol=1e-6)


def testCellTplNamesChildrenAndThetaByParamsNames():
  pipe = (
    gpipe.PipeliningLayer.Params()
    .Set(
      name='pipe',
      cell_tpl=_Cells(),
      before_tpl=[_Fc('pre')],
      num_micro_batches=2,
      devices=DEVICES[:2],
    )
    .Instantiate()
  )
  assert sorted(pipe.VariablesByName()) == sorted(
    f'pipe/{c}/{f}/{v}'
    for c, f in [
      ('cell_0', 'fc0'),
      ('cell_0', 'fc1'),
      ('cell_1', 'fc2'),
      ('cell_1', 'fc3'),
    ]
    for v in 'wb'
  ) + ['pipe/pre/b', 'pipe/pre/w']
  assert pipe.cell_1.fc3.params.name == 'fc3'
  assert pipe.theta.cell_0.fc1.w.shape == [4, 4]
  assert sorted(pipe.theta.keys()) == ['cell_0', 'cell_1', 'pre']
  assert pipe.pre.path == 'pipe/pre'
  assert 'CPU:1' in pipe.cell_1.fc2.vars.w.device


def testFlatLayersKeepSplitIndependentNames():
  names = []
  for k in (1, 2):
    pipe = (
      gpipe.PipeliningLayer.Params()
      .Set(
        name='pipe',
        layers=[_Fc(f'fc{i}') for i in range(4)],
        num_stages=k,
        devices=DEVICES[:k],
      )
      .Instantiate()
    )
    names.append(sorted(pipe.VariablesByName()))
  assert names[0] == names[1]
  assert names[0][0] == 'pipe/fc0/b'


def testFPropDefaultThetaOnEveryLayer():
  fc = _Fc('fc').Instantiate()
  x = tf.ones([2, 4])
  np.testing.assert_allclose(
    fc.FPropDefaultTheta(x).numpy(), fc.FProp(fc.theta, x).numpy()
  )


@pytest.mark.parametrize('num_micro_batches', [1, 2, 4])
def testBeforeTplPipelineEqualsSeqLayer(num_micro_batches):
  """Lingvo's SeqLayer semantics: before_tpl layers, then the cells."""
  params = dict(cell_tpl=_Cells(), before_tpl=[_Fc('pre'), _Fc('pre2')])
  seq = gpipe.SeqLayer.Params().Set(name='pipe', **params).Instantiate()
  pipe = (
    gpipe.PipeliningLayer.Params()
    .Set(
      name='pipe',
      num_micro_batches=num_micro_batches,
      devices=DEVICES[:2],
      **params,
    )
    .Instantiate()
  )
  x = tf.constant(np.random.RandomState(0).randn(8, 4), tf.float32)
  out, grads = _LossAndGrads(pipe, x)
  ref_out, ref_grads = _LossAndGrads(seq, x)
  _AssertNestedClose(out, ref_out)
  _AssertNestedClose(grads, ref_grads)
  assert sorted(grads.keys()) == ['cell_0', 'cell_1', 'pre', 'pre2']


def _FetchCells():
  """Cell 0 fetches the output of its first layer; cell 1 passes it through
  and fetches its own: the pipeline returns three tensors."""
  return [
    gpipe.FeatureExtractionLayer.Params().Set(
      name='cell_0',
      sub=[_Fc('fc0'), layers.FetchLayer.Params().Set(name='f0'), _Fc('fc1')],
      act_fetch_layers=['f0'],
      num_act_outputs=1,
    ),
    gpipe.FeatureExtractionLayer.Params().Set(
      name='cell_1',
      variable_name_prefix='p_',
      sub=[_Fc('fc2'), _Fc('fc3')],
      num_act_inputs=1,
      act_fetch_layers=['fc2'],
      num_act_outputs=2,
    ),
  ]


def testActFetchLayersAndPassThroughInputs():
  cells = _FetchCells()
  pipe = (
    gpipe.PipeliningLayer.Params()
    .Set(name='pipe', cell_tpl=cells, num_micro_batches=2, devices=DEVICES[:2])
    .Instantiate()
  )
  assert sorted(pipe.theta.cell_1.keys()) == ['p_fc2', 'p_fc3']
  x = tf.constant(np.random.RandomState(1).randn(4, 4), tf.float32)
  out, grads = _LossAndGrads(pipe, x)
  assert isinstance(out, tuple) and len(out) == 3
  # By hand: the same layers, one after another.
  th = pipe.theta
  c0, c1 = pipe.cell_0, pipe.cell_1
  h0 = c0.fc0.FProp(th.cell_0.fc0, x)
  h1 = c0.fc1.FProp(th.cell_0.fc1, h0)
  h2 = c1.p_fc2.FProp(th.cell_1.p_fc2, h1)
  h3 = c1.p_fc3.FProp(th.cell_1.p_fc3, h2)
  _AssertNestedClose(out, (h3, h0, h2))
  seq = gpipe.SeqLayer.Params().Set(name='pipe', cell_tpl=cells).Instantiate()
  ref_out, ref_grads = _LossAndGrads(seq, x)
  _AssertNestedClose(out, ref_out)
  _AssertNestedClose(grads, ref_grads)
  m = gpipe.PipeliningLayer.FPropMeta(
    pipe.params, tf.TensorShape([4, 4])
  ).out_shapes
  assert [s.as_list() for s in m] == [[4, 4]] * 3


def testFeatureExtractionLayerBadInput():
  cell = gpipe.FeatureExtractionLayer.Params().Set(name='c', sub=[_Fc('fc')])
  with pytest.raises(ValueError, match='num_act_outputs=0 must be .* = 1'):
    cell.Copy().Set(num_act_inputs=1).Instantiate()
  with pytest.raises(ValueError, match='takes 1 inputs but passes'):
    c = cell.Copy().Set(num_act_inputs=1, num_act_outputs=1).Instantiate()
    c.FPropDefaultTheta(tf.ones([2, 4]))


def testPartitionSequentialLayersAsLingvo():
  seq = layers.SequentialLayer.Params().Set(
    name='s', sub=[_Fc('a'), _Fc('b', activation='RELU')] * 2 + [_Fc('c')]
  )
  cells = gpipe.PartitionSequentialLayers(seq, 2, [8, 4])
  assert [c.name for c in cells] == ['d0', 'd1']
  assert [[s.name for s in c.sub] for c in cells] == [
    ['cell_000', 'cell_001'],
    ['cell_002', 'cell_003', 'cell_004'],
  ]
  pipe = (
    gpipe.PipeliningLayer.Params()
    .Set(name='pipe', cell_tpl=cells, devices=DEVICES[:2])
    .Instantiate()
  )
  assert pipe.theta.d1.cell_004.w.shape == [4, 4]
  with pytest.raises(ValueError, match='the shape of one input'):
    gpipe.PartitionSequentialLayers(seq, 2, [8, 4], [8, 4])


def testBeforeTplWithLossOnTheLastCell():
  """FPropWithLoss (every schedule) runs the before_tpl layers too."""
  params = dict(cell_tpl=_Cells(), before_tpl=[_Fc('pre')])
  seq = gpipe.SeqLayer.Params().Set(name='pipe', **params).Instantiate()
  x = tf.constant(np.random.RandomState(2).randn(8, 4), tf.float32)
  with tf.GradientTape() as tape:
    ref = tf.reduce_sum(seq.FPropDefaultTheta(x) ** 2)
  ref_grads = tape.gradient(ref, seq.vars)
  pipe = (
    gpipe.PipeliningLayer.Params()
    .Set(
      name='pipe',
      num_micro_batches=4,
      devices=DEVICES[:2],
      schedule='1f1b',
      **params,
    )
    .Instantiate()
  )
  with tf.GradientTape() as tape:
    loss, _ = pipe.FPropWithLoss(
      pipe.theta, x, loss_fn=lambda y: tf.reduce_sum(y**2)
    )
  grads = tape.gradient(loss, pipe.vars)
  np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-5)
  _AssertNestedClose(grads, ref_grads)
  with pytest.raises(ValueError, match='does not plan before_tpl'):
    gpipe.PipeliningLayer.Params().Set(
      name='p', num_stages='auto', input_shapes=[[8, 4]], **params
    ).Instantiate()
