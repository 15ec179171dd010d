"""tools/build_cost.py: its records, its table and its errors."""

import json

import pytest

from lingvo_gpipe.tools import build_cost


def testBadConfigsAreOneLineNamingTheFix(capsys):
  assert build_cost.main(['--configs=resnet:L=2:K=2:M=2']) == 2
  err = capsys.readouterr().err
  assert "Unknown model 'resnet'" in err and 'transformer, fc' in err
  assert build_cost.main(['--configs=fc:L=2:K=2']) == 2
  assert 'has no M=..' in capsys.readouterr().err
  assert build_cost.main(['--configs=fc:L=2:K=2:M=0']) == 2
  assert "Bad part 'M=0'" in capsys.readouterr().err
  assert build_cost.ParseConfig('fc:L=2:K=2:M=2:inline')['inline']
  assert build_cost.ParseConfig('fc:L=2:K=2:M=2:shared')['shared']
  assert not build_cost.ParseConfig('fc:L=2:K=2:M=2')['shared']
  assert build_cost.ParseConfig('fc:L=2:K=2:M=2:loop')['loop']
  assert 'loop' in build_cost.Name(
    build_cost.ParseConfig('fc:L=2:K=2:M=2:loop')
  )
  assert build_cost.ParseConfig('fc:L=2:K=2:M=2')['precompile'] is None
  off = build_cost.ParseConfig('fc:L=2:K=2:M=2:jit:noprecompile')
  assert off['precompile'] is False and 'noprecompile' in build_cost.Name(off)
  assert build_cost.ParseConfig('fc:L=2:K=2:M=2:precompile')['precompile']


def testTwoConfigurationsAreMeasuredEachInItsOwnProcess(tmp_path, capsys):
  path = tmp_path / 'b.json'
  rc = build_cost.main(
    [
      '--configs=fc:L=4:K=2:M=2,fc:L=4:K=2:M=8',
      '--steps=1',
      f'--json={path}',
    ]
  )
  out = capsys.readouterr().out
  assert rc == 0, out
  assert 'to_first_s' in out and 'fc L=4 K=2 M=8' in out
  records = json.loads(path.read_text())['records']
  assert [r['M'] for r in records] == [2, 8]
  for r in records:
    assert r['ops'] > 0 and r['fn_ops'] > 0 and r['rss_mb'] > 0
    assert r['to_first_s'] >= r['trace_s'] > 0
    assert r['cpu_s'] > 0 and r['workers_cpu_s'] is None  # In one process.
  # Each cell's functions once, whatever M: the same function library.
  assert records[0]['fn_ops'] == records[1]['fn_ops']
  assert records[1]['ops'] - records[0]['ops'] < 6 * 2 * 2 * 6


@pytest.mark.slow  # about 8 s: two worker processes
def testMultiProcessModeCountsTheWorkersCpu(tmp_path, capsys):
  path = tmp_path / 'b.json'
  rc = build_cost.main(
    [
      '--configs=fc:L=2:K=2:M=2',
      '--mode=multi_process',
      '--steps=1',
      f'--json={path}',
    ]
  )
  assert rc == 0, capsys.readouterr().out
  (record,) = json.loads(path.read_text())['records']
  assert record['mode'] == 'multi_process' and record['ops'] > 0
  # The two workers ran the step: their CPU seconds are counted.
  assert record['workers_cpu_s'] > 0 and record['cpu_s'] > 0
