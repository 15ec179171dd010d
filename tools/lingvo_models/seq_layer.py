"""Lingvo model: a SeqLayer (no micro-batches) with before_tpl layers and
two FeatureExtractionLayer cells, one of them with a variable_name_prefix."""

from lingvo.core import gpipe
from lingvo.core import layers


def _Fc(name, act='RELU', dim=6):
  return layers.FCLayer.Params().Set(
    name=name, input_dim=dim, output_dim=dim, activation=act
  )


def Params():
  cells = [
    gpipe.FeatureExtractionLayer.Params().Set(
      name='cell_0', sub=[_Fc('fc0', 'TANH'), _Fc('fc1')]
    ),
    gpipe.FeatureExtractionLayer.Params().Set(
      name='cell_1', variable_name_prefix='q_', sub=[_Fc('fc2', 'SIGMOID')]
    ),
  ]
  return gpipe.SeqLayer.Params().Set(
    name='seq', before_tpl=[_Fc('pre', 'TANH')], cell_tpl=cells
  )


def Inputs(rng):
  return [rng.randn(3, 6).astype('float32')]
