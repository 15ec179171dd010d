"""Lingvo model: a PipeliningLayer with before_tpl layers, and cells that
fetch activations (act_fetch_layers, num_act_outputs > 0) and pass them
through (num_act_inputs), with a variable_name_prefix."""

from lingvo.core import gpipe
from lingvo.core import layers


def _Fc(name, act='RELU'):
  return layers.FCLayer.Params().Set(
    name=name, input_dim=6, output_dim=6, activation=act
  )


def Params():
  cells = [
    gpipe.FeatureExtractionLayer.Params().Set(
      name='cell_0',
      sub=[_Fc('fc0'), layers.FetchLayer.Params().Set(name='f0'), _Fc('fc1')],
      act_fetch_layers=['f0'],
      num_act_outputs=1,
    ),
    gpipe.FeatureExtractionLayer.Params().Set(
      name='cell_1',
      variable_name_prefix='p_',
      sub=[_Fc('fc2', 'TANH'), _Fc('fc3', 'SIGMOID')],
      num_act_inputs=1,
      num_act_outputs=1,
    ),
  ]
  return gpipe.PipeliningLayer.Params().Set(
    name='pipe',
    before_tpl=[_Fc('pre0', 'TANH'), _Fc('pre1')],
    cell_tpl=cells,
    num_micro_batches=3,
  )


def Inputs(rng):
  return [rng.randn(6, 6).astype('float32')]
