"""tools/inspect_model.py: sizes registered models without allocating."""

import json

import pytest

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import base_model_params
from lingvo_gpipe.input import digits
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import reshape
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.models import classifier
from lingvo_gpipe.tools import inspect_model


@model_registry.RegisterSingleTaskModel
class NoPipelineDigits(base_model_params.SingleTaskModelParams):
  """A classifier without a PipeliningLayer (reported as one cell)."""

  def Train(self):
    return digits.DigitsInput.Params().Set(batch_size=8)

  def Task(self):
    p = classifier.ClassifierTask.Params().Set(name='nopipe', num_classes=10)
    p.network = sequential.SequentialLayer.Params().Set(
      name='net',
      sub=[
        reshape.FlattenLayer.Params().Set(name='flat'),
        linears.ProjectionLayer.Params().Set(
          name='fc', input_dim=64, output_dim=16
        ),
      ],
    )
    p.softmax.input_dim = 16
    return p


def _Run(tmp_path, model, capsys):
  out = tmp_path / 'out.json'
  assert inspect_model.main([f'--model={model}', f'--json={out}']) == 0
  text = capsys.readouterr().out
  return json.loads(out.read_text()), text


def testTinyAmoebanet(tmp_path, capsys):
  key = 'image.amoebanet.AmoebaNetTiny'
  info, text = _Run(tmp_path, key, capsys)
  p = model_registry.GetParams(key, 'Train')
  assert info['model'] == key
  assert info['num_params'] == base_layer.CountParams(p)
  assert info['num_stages'] == 2 and len(info['cells']) == 2
  network = base_layer.CountParams(p.task.network)
  assert sum(c['params'] for c in info['cells']) == network
  assert all(c['flops'] > 0 for c in info['cells'])
  assert info['cells'][0]['layers'][0] == 'stem'
  assert info['cells'][-1]['layers'][-1] == 'head'
  assert info['optimizer'] == 'RMSProp'
  # float32 weights; RMSProp keeps 2 slots per trainable weight.
  assert info['weight_bytes'] == 4 * info['num_params']
  assert info['slot_bytes'] == 2 * 4 * info['num_trainable_params']
  assert info['imbalance'] >= 1.0
  assert 'imbalance (max/mean)' in text and 'parameters:' in text


def testBigAmoebanetIsInspectedWithoutMemory(tmp_path, capsys):
  info, text = _Run(tmp_path, 'image.amoebanet.AmoebaNetD18x544', capsys)
  assert abs(info['num_params'] / 542e6 - 1) < 0.05
  assert info['num_stages'] == 2 and info['balance_by'] == 'flops'
  assert sum(c['params'] for c in info['cells']) < info['num_params']
  assert info['memory_bytes'] > 6e9  # 2.2 GB weights + 4.3 GB slots.
  assert 'GiB' in text


def testModelWithoutPipelineIsOneCell(tmp_path, capsys):
  info, text = _Run(
    tmp_path, 'tests.tools.inspect_model_test.NoPipelineDigits', capsys
  )
  assert info['num_stages'] == 1 and len(info['cells']) == 1
  assert (
    info['cells'][0]['params']
    == info['num_params']
    == 64 * 16 + 16 + 16 * 10 + 10
  )
  assert info['pipelines'] == [] and 'No PipeliningLayer' in text


def testUnknownModel(capsys):
  assert inspect_model.main(['--model=image.amoebanet.AmoebaNetD18x2080']) == 1
  assert 'AmoebaNetD18x208' in capsys.readouterr().err


@pytest.mark.parametrize('key', ['image.digits.MlpDigitsTiny'])
def testFindPipelines(key):
  found = inspect_model.FindPipelines(model_registry.GetParams(key, 'Train'))
  assert [k for k, _ in found] == ['task.network']


def testOverridesAndWorkerSplitSize(tmp_path, capsys):
  out = tmp_path / 'out.json'
  assert (
    inspect_model.main(
      [
        '--model=image.digits.MlpDigitsTiny',
        '--worker_split_size=3',
        '--model_params_override=task.network.balance_by : params',
        f'--json={out}',
      ]
    )
    == 0
  )
  info = json.loads(out.read_text())
  assert info['num_stages'] == 3 and info['balance_by'] == 'params'
  assert [c['layers'] for c in info['cells']] == [['flatten'], ['fc0'], ['fc1']]
  capsys.readouterr()
  assert (
    inspect_model.main(
      [
        '--model=image.digits.MlpDigitsTiny',
        '--model_params_override=task.network.balance_bi : params',
      ]
    )
    == 1
  )
  assert 'task.network.balance_bi' in capsys.readouterr().err
