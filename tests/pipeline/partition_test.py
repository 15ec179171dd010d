"""Unit tests for lingvo_gpipe.pipeline.partition on tiny projections."""

import pytest

from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.pipeline import partition


def _Proj(i, o, name=''):
  return linears.ProjectionLayer.Params().Set(
    name=name, input_dim=i, output_dim=o
  )


# Parameters 4*64+64, 64*4+4, 4*4+4, 4*4+4: one heavy pair of layers.
_LAYERS = [_Proj(4, 64), _Proj(64, 4), _Proj(4, 4), _Proj(4, 4)]


def testLayerCostsByParamsAndUniform():
  assert partition.LayerCosts(_LAYERS, 'params') == [320.0, 260.0, 20.0, 20.0]
  assert partition.LayerCosts(_LAYERS, 'uniform') == [1.0] * 4


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
