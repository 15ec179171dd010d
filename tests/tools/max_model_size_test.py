"""tools/max_model_size.py: the search, its records and its errors.

One search runs real trials (each a training step in a process of its own);
the search's logic runs on faked trials, and the flag errors in-process.
"""

import json
import os
import sys

import pytest

from lingvo_gpipe.tools import max_model_size
from tests.testing import warm_python

_TOOL = os.path.join(
  os.path.dirname(__file__), '..', '..', 'tools', 'max_model_size.py'
)


def _Run(*flags, timeout=600):
  return warm_python.Run(
    [sys.executable, _TOOL, *flags],
    timeout=timeout,
  )


def _InProcess(capsys, *flags):
  """main(flags) here: (exit status, stdout, stderr)."""
  try:
    status = max_model_size.main(list(flags))
  except SystemExit as e:  # argparse's errors
    status = e.code
  out = capsys.readouterr()
  return status, out.out, out.err


def testUnknownFamilyAndConfigListTheValidOnes(capsys):
  status, _, err = _InProcess(capsys, '--family=resnet')
  assert status == 2
  assert 'transformer, amoebanet' in err
  status, _, err = _InProcess(capsys, '--configs=naive-1,pipe-2')
  assert status == 2
  assert "'pipe-2'" in err and 'pipeline-K' in err
  status, _, err = _InProcess(capsys, '--balance_by=weights')
  assert status == 2
  assert "'weights'" in err and 'memory, params' in err
  status, _, err = _InProcess(capsys, '--fixed=model_dims=128')
  assert status == 2
  assert "'model_dims'" in err and 'model_dim,' in err
  status, _, err = _InProcess(capsys, '--fixed=model_dim=big')
  assert status == 2
  assert "model_dim='big' is not an integer" in err


def testGpuWithoutAGpuIsOneClearMessage(capsys, monkeypatch):
  monkeypatch.setattr(max_model_size, '_HasGpu', lambda: False)
  status, _, err = _InProcess(capsys, '--device=gpu', '--configs=naive-1')
  assert status == 2, err[-2000:]
  assert 'finds no GPU on this host' in err
  assert '--device=cpu' in err
  status, _, err = _InProcess(capsys, '--device=tpu')
  assert status == 2
  assert 'cpu and gpu' in err


@pytest.mark.slow
def testBudgetBelowTheSmallestModelIsOneClearMessage(tmp_path):
  # A real trial that does not fit (the faked one below covers the search).
  out = _Run(
    '--family=transformer',
    '--budget_mb=1',
    '--configs=naive-1',
    f'--json={tmp_path / "r.json"}',
  )
  assert out.returncode == 1, out.stderr[-2000:]
  assert 'does not fit 1 MiB per device in naive-1' in out.stderr
  assert 'raise --budget_mb' in out.stderr
  trials = json.loads((tmp_path / 'r.json').read_text())['trials']
  assert len(trials) == 1 and not trials[0]['fits']


def testBudgetBelowTheSmallestSizeIsOneLineOnFakedTrials(
  tmp_path, capsys, monkeypatch
):
  trial, tried = _FakeTrial({'naive-1': 0})
  monkeypatch.setattr(max_model_size.Searcher, 'Trial', trial)
  path = tmp_path / 'r.json'
  status, _, err = _InProcess(
    capsys,
    '--family=transformer',
    '--budget_mb=1',
    '--configs=naive-1',
    f'--json={path}',
  )
  assert status == 1, err
  (line,) = [ln for ln in err.splitlines() if 'does not fit' in ln]
  assert 'does not fit 1 MiB per device in naive-1' in line, err
  assert line.endswith('raise --budget_mb.'), line
  assert tried == [('naive-1', 1)]
  trials = json.loads(path.read_text())['trials']
  assert len(trials) == 1 and not trials[0]['fits']


def _FakeTrial(fits_up_to):
  """A Searcher.Trial that fits sizes <= fits_up_to[config], in-process."""
  tried = []

  def Trial(self, family, config, size, steps=1):
    del steps
    tried.append((config['name'], size))
    k = config['num_stages']
    params = 1000 * size * size
    r = dict(
      family=family,
      config=config['name'],
      num_stages=k,
      num_micro_batches=config['num_micro_batches'],
      num_cells=None,
      size=size,
      fits=size <= fits_up_to[config['name']],
      num_params=params,
      param_bytes=4 * params,
      peak_activation_bytes=1000,
      peak_bytes_per_device=[16 * params // k + 1000] * k,
      devices=[
        f'/job:localhost/replica:0/task:0/device:CPU:{i}' for i in range(k)
      ],
      weight_bytes_per_device=[4 * params // k] * k,
      slot_bytes_per_device=[8 * params // k] * k,
      state_bytes_per_device=[16 * params // k] * k,
      rss_peak_minus_baseline_per_device=[0] * k,
      budget_bytes=self.args.budget_mb * max_model_size.MIB,
    )
    self.records.append(r)
    return r

  return Trial, tried


def testSearchFindsTheLargestSizeOfEachConfig(tmp_path, capsys, monkeypatch):
  trial, tried = _FakeTrial({'naive-1': 3, 'pipeline-2': 7})
  monkeypatch.setattr(max_model_size.Searcher, 'Trial', trial)
  path = tmp_path / 'r.json'
  status, out, err = _InProcess(
    capsys,
    '--family=transformer',
    '--budget_mb=512',
    '--configs=naive-1,pipeline-2',
    f'--json={path}',
  )
  assert status == 0, err
  data = json.loads(path.read_text())
  largest = {r['config']: r for r in data['largest']}
  assert largest['naive-1']['size'] == 3 and largest['pipeline-2']['size'] == 7
  assert largest['pipeline-2']['next_size_tried'] == 8
  assert not largest['pipeline-2']['capped']
  # Every size the records report was tried, the smallest first.
  assert tried[0] == ('naive-1', 1)
  assert {(r['config'], r['size']) for r in data['trials']} == set(tried)
  # The table compares each configuration with naive-1.
  assert 'vs naive-1' in out and f'{49 / 9:.2f}x' in out
  # A cap: the search stops at --max_size and says the result is capped.
  trial, tried = _FakeTrial({'pipeline-2': 7})
  monkeypatch.setattr(max_model_size.Searcher, 'Trial', trial)
  status, _, err = _InProcess(
    capsys,
    '--family=transformer',
    '--configs=pipeline-2',
    '--max_size=2',
    f'--json={path}',
  )
  assert status == 0, err
  (best,) = json.loads(path.read_text())['largest']
  assert best['size'] == 2 and best['capped']
  assert max(size for _, size in tried) == 2


def testRealTrialRecordsWhatTheSearchReports(tmp_path):
  # One real trial, with XLA-compiled cells: --jit_compile reaches the
  # trial's PipeliningLayer, the record says so, and the compiled cells
  # train (the loss falls) within the budget, each device measured.
  path = tmp_path / 'r.json'
  out = _Run(
    '--family=transformer',
    '--budget_mb=512',
    '--configs=pipeline-2',
    '--start_size=2',
    '--max_size=2',
    '--fixed=seq_len=16',
    '--jit_compile',
    f'--json={path}',
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  data = json.loads(path.read_text())
  (trial,) = data['trials']
  assert trial['jit_compile'] and trial['fits'] and trial['size'] == 2
  assert trial['losses'][1] < trial['losses'][0]  # a real training step
  (r,) = data['largest']
  assert r['size'] == 2 and r['capped']
  for key in (
    'family',
    'num_stages',
    'num_micro_batches',
    'num_params',
    'param_bytes',
    'peak_bytes_per_device',
    'peak_activation_bytes',
    'budget_bytes',
  ):
    assert key in r, key
  assert r['balance_by'] == 'memory'
  assert r['num_micro_batches'] == 8 and len(r['peak_bytes_per_device']) == 2
  assert r['fixed']['seq_len'] == 16 and r['fixed']['model_dim'] == 64
  assert len(r['splits']) == 2  # the cells the trial ran with
  # Each device holds its own cell: both report memory of their own.
  assert min(r['peak_bytes_per_device']) > 0
  assert 'vs naive-1' in out.stdout


def testLoopAndSharedFunctionFlagsReachTheTrialsLayer(monkeypatch):
  """--micro_batch_loop and --share_layer_functions travel in the trial's
  spec to the PipeliningLayer it builds."""
  from lingvo_gpipe.tools import capacity_trial  # pylint: disable=g-import-not-at-top

  specs = []

  class FakeChild:
    returncode = 1

    def __init__(self, cmd, **unused):
      specs.append(json.loads(cmd[-1][len('--trial=') :]))

    def communicate(self, timeout=None):
      del timeout
      return '', 'not run'

  monkeypatch.setattr(max_model_size.subprocess, 'Popen', FakeChild)
  monkeypatch.setattr(max_model_size.Searcher, 'Kill', lambda self: None)
  args = max_model_size._Parser().parse_args(  # pylint: disable=protected-access
    ['--family=transformer', '--micro_batch_loop', '--share_layer_functions']
  )
  searcher = max_model_size.Searcher(args)
  config = dict(
    name='pipeline-2',
    pipeline=True,
    num_stages=2,
    num_micro_batches=2,
    recompute='always',
  )
  searcher.Trial('transformer', config, 2)
  (spec,) = specs
  built = spec['config']
  assert built['micro_batch_loop'] and built['share_layer_functions']
  layer, _ = capacity_trial._BuildModel(  # pylint: disable=protected-access
    'transformer', 2, built, ['/device:CPU:0'] * 2
  )
  assert layer.params.micro_batch_loop
  assert layer.params.share_layer_functions == 'auto'
