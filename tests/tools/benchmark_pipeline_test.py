"""tools/benchmark_pipeline.py: --jit_compile rows with and without XLA;
--configs that the devices cannot run, refused in one line."""

import json
import os
import pathlib
import sys

import pytest

from lingvo_gpipe.tools import benchmark_pipeline
from tests.testing import warm_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 40 s: 6 configurations, 3 compiled with XLA
def testJitCompileBothGivesRowsWithAndWithout(tmp_path):
  out_json = tmp_path / 'bench.json'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
  res = warm_python.Run(
    [
      sys.executable,
      str(ROOT / 'tools' / 'benchmark_pipeline.py'),
      '--mode=in_process',
      '--model=mlp',
      '--configs=0x1x0,2x1x0,2x2x1',
      '--jit_compile=both',
      '--batch_size=16',
      '--seq_len=1',
      '--dim=8',
      '--num_blocks=4',
      '--steps=1',
      '--warmup=1',
      f'--json={out_json}',
    ],
    env=env,
    timeout=300,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  records = json.loads(out_json.read_text())['records']
  keys = sorted(
    (r['jit_compile'], r['num_stages'], r['num_micro_batches']) for r in records
  )
  assert keys == [
    (False, 0, 1),
    (False, 2, 1),
    (False, 2, 2),
    (True, 0, 1),
    (True, 2, 1),
    (True, 2, 2),
  ]
  for r in records:
    # Normalized within its own kind: K=2, M=1 is 1 in both.
    if r['num_stages'] == 2 and r['num_micro_batches'] == 1:
      assert r['normalized_to_k2m1'] == 1.0
    assert r['speedup_vs_plain'] > 0
  assert 'jit_compile' in res.stdout.splitlines()[0]


@pytest.mark.parametrize(
  'flags,message',
  [
    (
      ['--configs=4x8x0'],
      '--configs item 4x8: K=4 x R=1 needs 4 devices but --num_devices=2; '
      'raise --num_devices to 4',
    ),
    (['--configs=1x1x0x3'], 'K=1 x R=3 needs 3 devices'),
    (['--configs=2x8'], "--configs item '2x8' is not KxMxC or KxMxCxR"),
    (['--configs=2xfourx1'], "'2xfourx1' is not KxMxC"),
  ],
)
def testConfigsTheDevicesCannotRunAreOneLine(flags, message, capsys):
  # Before any worker starts or any model is built.
  with pytest.raises(SystemExit) as e:
    benchmark_pipeline.main(flags)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert 'Traceback' not in err
