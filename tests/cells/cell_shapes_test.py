"""The cell-by-cell shape check names the cell and layer that cannot take
its input."""

import pytest

from lingvo_gpipe.cells import cell_shapes
from lingvo_gpipe.layers import linears


def _Fc(name, din, dout):
  return linears.FCLayer.Params().Set(name=name, input_dim=din, output_dim=dout)


def testMatchingCellsPass():
  cells = [[_Fc('a', 8, 16), _Fc('b', 16, 4)], [_Fc('c', 4, 2)]]
  cell_shapes.Check('p', cells, [[3, 8]], 'input_shapes')


def testThePipelineInputIsNamed():
  cells = [[_Fc('a', 8, 16)], [_Fc('b', 16, 4)]]
  with pytest.raises(ValueError) as e:
    cell_shapes.Check('p', cells, [[3, 5]], 'input_shapes')
  msg = str(e.value)
  assert msg.startswith("Pipeline 'p' cell 0 (a) cannot take the pipeline")
  assert '[3, 5]' in msg and 'first layer a (FCLayer)' in msg
  assert msg.endswith('or fix input_shapes.')


def testACellBoundaryNamesBothCells():
  cells = [[_Fc('a', 8, 16)], [_Fc('b', 12, 4), _Fc('c', 4, 2)]]
  with pytest.raises(ValueError) as e:
    cell_shapes.Check('p', cells, [[3, 8]], 'the first batch')
  msg = str(e.value)
  assert msg.startswith("Pipeline 'p' cell 1 (b, c) cannot take the output")
  assert 'of cell 0 (a), of shapes [3, 16]' in msg
  assert 'what a, the last layer of cell 0, returns.' in msg


def testInsideACellNamesTheLayerBefore():
  cells = [[_Fc('a', 8, 16), _Fc('b', 12, 4)]]
  with pytest.raises(ValueError) as e:
    cell_shapes.Check('p', cells, [[3, 8]], 'input_shapes')
  msg = str(e.value)
  assert msg.startswith("Pipeline 'p' cell 0 (a, b): layer b (FCLayer)")
  assert msg.endswith('Make b accept what a returns.')
