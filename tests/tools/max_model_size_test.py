"""tools/max_model_size.py: the search, its records and its errors."""

import json
import os
import subprocess
import sys

_TOOL = os.path.join(
  os.path.dirname(__file__), '..', '..', 'tools', 'max_model_size.py'
)


def _Run(*flags, timeout=600):
  return subprocess.run(
    [sys.executable, _TOOL, *flags],
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def testUnknownFamilyAndConfigListTheValidOnes():
  out = _Run('--family=resnet')
  assert out.returncode == 2
  assert 'transformer, amoebanet' in out.stderr
  out = _Run('--configs=naive-1,pipe-2')
  assert out.returncode == 2
  assert "'pipe-2'" in out.stderr and 'pipeline-K' in out.stderr
  out = _Run('--balance_by=weights')
  assert out.returncode == 2
  assert "'weights'" in out.stderr and 'memory, params' in out.stderr
  out = _Run('--fixed=model_dims=128')
  assert out.returncode == 2
  assert "'model_dims'" in out.stderr and 'model_dim,' in out.stderr
  out = _Run('--fixed=model_dim=big')
  assert out.returncode == 2
  assert "model_dim='big' is not an integer" in out.stderr


def testGpuWithoutAGpuIsOneClearMessage():
  out = _Run('--device=gpu', '--configs=naive-1')
  assert out.returncode == 2, out.stderr[-2000:]
  assert 'finds no GPU on this host' in out.stderr
  assert '--device=cpu' in out.stderr
  out = _Run('--device=tpu')
  assert out.returncode == 2
  assert 'cpu and gpu' in out.stderr


def testBudgetBelowTheSmallestModelIsOneClearMessage(tmp_path):
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


def testTinySearchRunsEverySizeItReports(tmp_path):
  path = tmp_path / 'r.json'
  out = _Run(
    '--family=transformer',
    '--budget_mb=512',
    '--configs=pipeline-2',
    '--max_size=2',
    '--fixed=seq_len=16',
    f'--json={path}',
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  data = json.loads(path.read_text())
  largest = {r['config']: r for r in data['largest']}
  assert set(largest) == {'pipeline-2'}
  assert sorted(r['size'] for r in data['trials']) == [1, 2]
  tried = {(r['config'], r['size']) for r in data['trials']}
  for r in data['largest']:
    assert (r['config'], r['size']) in tried
    assert r['fits'] and r['size'] == 2 and r['capped']
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
  p2 = largest['pipeline-2']
  assert p2['balance_by'] == 'memory'
  assert p2['num_micro_batches'] == 8 and len(p2['peak_bytes_per_device']) == 2
  assert p2['fixed']['seq_len'] == 16 and p2['fixed']['model_dim'] == 64
  assert len(p2['splits']) == 2  # the cells the trial ran with
  # Each device holds its own cell: both report memory of their own.
  assert min(p2['peak_bytes_per_device']) > 0
  assert p2['losses'][1] < p2['losses'][0]  # a real training step
  assert 'vs naive-1' in out.stdout


def testJitCompiledCellsRunATrial(tmp_path):
  # --jit_compile reaches the trial's PipeliningLayer: the record says so and
  # the compiled cells train (the loss falls) within the budget.
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
  (trial,) = json.loads(path.read_text())['trials']
  assert trial['jit_compile'] and trial['fits'] and trial['size'] == 2
  assert trial['losses'][1] < trial['losses'][0]
