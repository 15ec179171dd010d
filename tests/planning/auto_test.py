"""'auto' K and M, resolved from a PipeliningLayer's Params alone."""

import pytest

from lingvo_gpipe.layers import linears
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.planning import auto

DEVICES = [f'/device:CPU:{i}' for i in range(4)]
MIB = 2**20


def _Params(**kw):
  fcs = [
    linears.FCLayer.Params().Set(
      name=f'fc_{i}', input_dim=512, output_dim=512, activation='RELU'
    )
    for i in range(8)
  ]
  p = pipelining_layer.PipeliningLayer.Params().Set(
    name='auto',
    layers=fcs,
    num_stages='auto',
    num_micro_batches='auto',
    devices=DEVICES,
    input_shapes=[[64, 512]],
    planner_device='cpu',
  )
  return p.Set(**kw)


def testResolveGivesAFittingKAndADividingM():
  # 8 x 4 MiB of weights, gradients and slots: only K >= 3 fits 14 MiB.
  k, m, text = auto.Resolve(_Params(planner_memory_per_device=14 * MIB))
  assert 3 <= k <= 4
  assert 64 % m == 0
  assert f'K={k}, M={m}' in text


def testAFixedKIsKept():
  k, m, _ = auto.Resolve(_Params(num_stages=2))
  assert k == 2 and m >= 1


@pytest.mark.parametrize(
  'kw, match',
  [
    (dict(num_stages='three'), "num_stages='three'; use an int or 'auto'"),
    (dict(micro_batch_size=8), 'both set M; give one'),
    (
      dict(layers=None, cell_tpl=[_Params().layers[0]] * 2),
      "num_stages='auto' needs a flat `layers`",
    ),
  ],
)
def testBadSettingsAreNamed(kw, match):
  with pytest.raises(ValueError, match=match):
    auto.Resolve(_Params(**kw))
