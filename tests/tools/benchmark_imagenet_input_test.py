"""tools/benchmark_imagenet_input.py on tiny generated JPEG TFRecords."""

import json
import os
import pathlib
import runpy
import sys
from tests.testing import warm_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / 'tools' / 'benchmark_imagenet_input.py'


def _Run(*args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
  return warm_python.Run(
    [sys.executable, str(TOOL), *args],
    env=env,
    timeout=120,
  )


def testBothPipelinesAreTimedOnGeneratedRecords(tmp_path):
  out_json = tmp_path / 'bench.json'
  data = tmp_path / 'data'
  res = _Run(
    f'--data_dir={data}',
    '--records=24',
    '--files=3',
    '--height=20',
    '--width=28',
    '--image_size=8',
    '--batch_size=4',
    '--warmup=1',
    '--batches=3',
    '--rounds=2',
    f'--json={out_json}',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  # The records it wrote (kept: --data_dir), 8 per file.
  files = sorted(p.name for p in data.iterdir())
  assert files == [f'train-0000{k}-of-00003' for k in range(3)], files
  out = json.loads(out_json.read_text())
  assert out['host']['cpus'] == os.cpu_count()
  assert '24 generated 20x28 JPEGs in 3 files' in out['host']['source']
  records = out['records']
  assert [r['pipeline'] for r in records] == ['imagenet_input', 'plain']
  for r in records:
    assert r['records_timed_per_round'] == 12
    assert len(r['seconds_per_round']) == 2
    assert all(t > 0 for t in r['seconds_per_round'])
    assert r['records_per_sec'] > 0 and r['encoded_mb_per_sec'] > 0
    assert r['encoded_bytes_per_record'] > 100  # A JPEG, not an empty record.
    assert (r['batch_size'], r['image_size'], r['augment']) == (4, 8, True)
    assert r['tf_data_autotune'] is True
  assert 'imagenet_input / plain: ' in res.stdout
  for name in ('imagenet_input', 'plain'):
    assert any(line.startswith(name + ' ') for line in res.stdout.splitlines())
  # Existing files, central crop, one pipeline, no autotuning.
  res = _Run(
    f'--file_pattern={data}/train-*',
    '--pipelines=imagenet_input',
    '--augment=0',
    '--tf_data_autotune=0',
    '--image_size=8',
    '--batch_size=4',
    '--warmup=0',
    '--batches=2',
    '--rounds=1',
    f'--json={out_json}',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  records = json.loads(out_json.read_text())['records']
  assert [
    (r['pipeline'], r['augment'], r['tf_data_autotune']) for r in records
  ] == [('imagenet_input', False, False)]
  assert '; autotuning off):' in res.stdout


def testBadArgumentsFailInOneLine(tmp_path, capsys):
  tool = runpy.run_path(str(TOOL))  # in-process: the errors come first
  cases = [
    (
      ['--records=4', '--files=1', '--batch_size=8'],
      '--records=4 < --batch_size=8',
    ),
    ([f'--file_pattern={tmp_path}/none-*'], 'no file matches'),
  ]
  for args, message in cases:
    status = tool['main'](args)
    err = capsys.readouterr().err
    assert status == 1, (args, err[-2000:])
    errors = [ln for ln in err.splitlines() if ln.startswith('ERROR:')]
    assert len(errors) == 1 and message in errors[0], (args, err)
    assert 'Traceback' not in err
