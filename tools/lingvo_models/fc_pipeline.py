"""Lingvo model (a): a PipeliningLayer of two FeatureExtractionLayer cells of
FCLayers, before_tpl=[], 2 micro-batches, called with FPropDefaultTheta."""

from lingvo.core import gpipe
from lingvo.core import layers


def Params():
  cells = []
  for k in range(2):
    subs = [
      layers.FCLayer.Params().Set(
        name=f'fc{2 * k + i}', input_dim=8, output_dim=8, activation='TANH'
      )
      for i in range(2)
    ]
    cells.append(
      gpipe.FeatureExtractionLayer.Params().Set(name=f'cell_{k}', sub=subs)
    )
  return gpipe.PipeliningLayer.Params().Set(
    name='pipe', cell_tpl=cells, before_tpl=[], num_micro_batches=2
  )


def Inputs(rng):
  return [rng.randn(4, 8).astype('float32')]
