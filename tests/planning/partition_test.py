"""Unit tests for lingvo_gpipe.planning.partition on tiny projections."""

import logging

import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import gpipe
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import reshape
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.planning import balance
from lingvo_gpipe.planning import partition


def _Proj(i, o, name=''):
  return linears.ProjectionLayer.Params().Set(
    name=name, input_dim=i, output_dim=o
  )


# Parameters 4*64+64, 64*4+4, 4*4+4, 4*4+4: one heavy pair of layers.
_LAYERS = [_Proj(4, 64), _Proj(64, 4), _Proj(4, 4), _Proj(4, 4)]


def testLayerCostsByParamsAndUniform():
  assert partition.LayerCosts(_LAYERS, 'params') == [320.0, 260.0, 20.0, 20.0]
  assert partition.LayerCosts(_LAYERS, 'uniform') == [1.0] * 4


def testLayerCostsByMeasuredTimeChainTheShapes():
  """balance_by='time' runs each layer's forward and backward here, on the
  previous layer's output shapes: the wide layers cost the most, and the
  split puts them apart."""
  wide = [_Proj(256, 1024), _Proj(1024, 256), _Proj(256, 4), _Proj(4, 4)]
  costs = partition.LayerCosts(wide, 'time', [[256, 256]], '/device:CPU:0')
  assert len(costs) == 4 and all(c > 0 for c in costs)
  assert min(costs[:2]) > max(costs[2:])
  splits = partition.ComputeSplits(
    wide, 2, balance_by='time', input_shapes=[[256, 256]]
  )
  assert splits[-1] == 4 and 1 <= splits[0] <= 2


def testLayerCostsByFlopsFollowTheShapes():
  small = partition.LayerCosts(_LAYERS, 'flops', [[2, 4]])
  big = partition.LayerCosts(_LAYERS, 'flops', [[8, 4]])
  assert len(small) == 4 and all(c > 0 for c in small)
  assert small[0] > small[2]
  assert big[0] == pytest.approx(4 * small[0])


def testLayerCostsErrors():
  with pytest.raises(ValueError, match="balance_by='bytes'; use one of"):
    partition.LayerCosts(_LAYERS, 'bytes')
  with pytest.raises(ValueError, match='needs the input shapes'):
    partition.LayerCosts(_LAYERS, 'flops')


def testComputeSplits():
  assert partition.ComputeSplits(_LAYERS, 2, balance_by='params') == [1, 4]
  assert partition.ComputeSplits(_LAYERS, 2, balance_by='uniform') == [2, 4]
  assert partition.ComputeSplits(_LAYERS, splits=[3, 4]) == [3, 4]
  assert partition.ComputeSplits(_LAYERS, splits=2, balance_by='uniform') == [
    2,
    4,
  ]
  assert partition.ComputeSplits(_LAYERS, balance_by='params') == [4]


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (dict(layer_params=[]), 'no layers'),
    (dict(layer_params=_LAYERS, num_stages=5), 'num_stages=5 is more than'),
    (
      dict(layer_params=_LAYERS, num_stages=3, splits=[2, 4]),
      r'num_stages=3 but splits=\[2, 4\] makes 2 cells',
    ),
  ],
)
def testComputeSplitsErrors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    partition.ComputeSplits(**kwargs)


def testPartitionSequentialLayersNamesLayersAndCells():
  seq = sequential.SequentialLayer.Params().Set(sub=_LAYERS)
  cells = partition.PartitionSequentialLayers(seq, 2, [2, 4])
  assert [c.name for c in cells] == ['cell_0', 'cell_1']
  names = [[p.name for p in c.sub] for c in cells]
  assert sum(names, []) == [f'layer_{i}' for i in range(4)]
  assert all(names)
  assert cells == partition.PartitionSequentialLayers(_LAYERS, 2, [2, 4])


def testReportOfASplit():
  r = partition.Report(_LAYERS, [1, 4], balance_by='params')
  assert r.num_layers == 4 and r.num_stages == 2 and r.splits == [1, 4]
  assert r.total_cost == 620.0 and r.max_cost == 320.0
  assert r.total_params == 620


# Few weights and wide outputs first, a stored wide input at layer 1.
_MEMORY_LAYERS = [
  _Proj(4, 64, 'l0'),
  _Proj(64, 4, 'l1'),
  _Proj(4, 32, 'l2'),
  _Proj(32, 32, 'l3'),
]


def testActivationBytesCountsEveryForwardTensor():
  # MatMul, bias add and ReLU outputs: 3 x [8, 64] floats.
  num_bytes, out_specs = partition.ActivationBytes(_Proj(4, 64), [8, 4])
  assert num_bytes == 3 * 8 * 64 * 4
  assert [s.shape.as_list() for s in out_specs] == [[8, 64]]


def testLayerMemoryKnownSizes():
  layer_bytes, input_bytes = partition.LayerMemory(
    _MEMORY_LAYERS, [[64, 4]], num_micro_batches=1, state_copies=4
  )
  # weights x 4 bytes x 4 copies + 3 forward tensors of [64, out] floats.
  assert layer_bytes == [
    320 * 16 + 3 * 64 * 64 * 4,
    260 * 16 + 3 * 64 * 4 * 4,
    160 * 16 + 3 * 64 * 32 * 4,
    1056 * 16 + 3 * 64 * 32 * 4,
  ]
  # A cell starting at layer i stores layer i's input, [64, in] floats.
  assert input_bytes == [64 * 4 * 4, 64 * 64 * 4, 64 * 4 * 4, 64 * 32 * 4]
  # M micro-batches: one micro-batch's activations are live at a time.
  halves, _ = partition.LayerMemory(
    _MEMORY_LAYERS, [[64, 4]], num_micro_batches=2, state_copies=0
  )
  assert halves == [3 * 32 * 64 * 4, 3 * 32 * 4 * 4] + [3 * 32 * 32 * 4] * 2


def testBalanceByMemoryPicksTheSplitWithTheSmallestFullestDevice():
  # By parameters, [l0, l1, l2] | [l3] (1056 weights alone); in bytes that
  # cell holds 89,664 against 49,664. By memory, [l0, l1] | [l2, l3]:
  # 62,528 and 69,632 (the second cell also stores l2's input).
  assert partition.ComputeSplits(_MEMORY_LAYERS, 2, balance_by='params') == [
    3,
    4,
  ]
  splits = partition.ComputeSplits(
    _MEMORY_LAYERS, 2, balance_by='memory', input_shapes=[[64, 4]]
  )
  assert splits == [2, 4]
  layer_bytes, input_bytes = partition.LayerMemory(_MEMORY_LAYERS, [[64, 4]])
  assert balance.MemoryCellBytes(layer_bytes, input_bytes, [3, 4]) == [
    89664,
    49664,
  ]
  assert balance.MemoryCellBytes(layer_bytes, input_bytes, splits) == [
    62528,
    69632,
  ]
  with pytest.raises(ValueError, match='needs the input shapes'):
    partition.ComputeSplits(_MEMORY_LAYERS, 2, balance_by='memory')


def testPipeliningLayerBalancesByMemory():
  layer = (
    gpipe.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=_MEMORY_LAYERS,
      num_stages=2,
      num_micro_batches=1,
      devices=['/device:CPU:0', '/device:CPU:1'],
      balance_by='memory',
      input_shapes=[[64, 4]],
    )
    .Instantiate()
  )
  assert layer.splits == [2, 4]
  out = layer(tf.ones([64, 4]))
  assert out.shape.as_list() == [64, 32]


class _ResMlp(base_layer.BaseLayer):
  """x + relu(x w1) w2, without an FPropMeta of its own (traced)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 64, 'Input and output width.')
    p.Define('einsum', False, 'Use tf.einsum, whose flops TF does not count.')
    return p

  def __init__(self, params):
    super().__init__(params)
    d = self.params.dim
    self.CreateVariable('w1', py_utils.WeightParams([d, 4 * d]))
    self.CreateVariable('w2', py_utils.WeightParams([4 * d, d]))

  def FProp(self, theta, x):
    if self.params.einsum:
      # No elementwise op either: TensorFlow counts no flop at all.
      h = tf.einsum('bi,ij->bj', x, theta.w1)
      return tf.einsum('bj,ji->bi', h, theta.w2)
    return x + tf.matmul(tf.nn.relu(tf.matmul(x, theta.w1)), theta.w2)


def _ResMlpDigits(**kwargs):
  return [reshape.FlattenLayer.Params().Set(name='flatten')] + [
    _ResMlp.Params().Set(name=f'res{i}', **kwargs) for i in range(2)
  ]


def testCustomLayerWithUnknownBatchIsCountedAndBalanced(caplog):
  # The batch of the input shapes is unknown, as in params/image/digits.py.
  layers = _ResMlpDigits()
  costs = partition.LayerCosts(layers, 'flops', [[None, 8, 8, 1]])
  assert costs[0] == 0 and costs[1] > 0 and costs[1] == costs[2]
  with caplog.at_level(logging.WARNING):
    splits = partition.ComputeSplits(
      layers, 2, None, 'flops', [[None, 8, 8, 1]], name='net'
    )
  assert splits == [2, 3]
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def testZeroCostLayersWithWeightsAreWarnedAbout(caplog):
  layers = _ResMlpDigits(einsum=True)
  with caplog.at_level(logging.WARNING):
    splits = partition.ComputeSplits(
      layers, 2, None, 'flops', [[None, 8, 8, 1]], name='net'
    )
  assert splits == [2, 3]  # All costs 0: uniform.
  text = '\n'.join(r.getMessage() for r in caplog.records)
  assert "Pipeline 'net' balanced by 'flops'" in text
  assert 'res0 (_ResMlp), res1 (_ResMlp) is 0 although they have weights' in (
    text
  )
  assert 'FPropMeta' in text and "'time'" in text


def testImbalanceIsWarnedAbout():
  layers = [_Proj(4, 256, name='big'), _Proj(256, 4, name='big2')] + [
    _Proj(4, 4, name=f's{i}') for i in range(2)
  ]
  costs = partition.LayerCosts(layers, 'params')
  warnings = partition.BalanceWarnings(
    layers, costs, [2, 4], 'params', name='net'
  )
  assert len(warnings) == 1
  assert "Pipeline 'net' balanced by 'params' is unbalanced" in warnings[0]
  assert 'costs 1.97x the mean' in warnings[0]
  assert 'cell 0: big, big2 98%; cell 1: s0, s1 2%' in warnings[0]
  assert partition.BalanceWarnings(layers, costs, [1, 4], 'params') == []
