"""tools/plan.py: plans, errors, the predicted timeline, validation against
a benchmark JSON and the paper's tables."""

import json
import re
import shlex
import os

import pytest

from lingvo_gpipe.planning import planner
from lingvo_gpipe.tools import plan
from lingvo_gpipe.tools import plan_paper
from lingvo_gpipe.tools import plan_validation

_SMALL = ['--num_blocks=4', '--dim=32', '--seq_len=8', '--batch_size=16']


def testPlanListsFeasibleBestFirstAndWritesJson(tmp_path, capsys):
  path = str(tmp_path / 'plan.json')
  png = str(tmp_path / 'plan.png')
  rc = plan.main(
    [
      '--model=bench.mlp',
      '--num_devices=2',
      '--device=tpu_v3',
      f'--json={path}',
      f'--timeline={png}',
      *_SMALL,
    ]
  )
  out = capsys.readouterr().out
  assert rc == 0
  assert 'Feasible, best first' in out
  with open(path) as f:
    data = json.load(f)
  steps = [c['step_s'] for c in data['feasible']]
  assert steps and steps == sorted(steps)
  for c in data['feasible'] + data['rejected']:
    assert {'num_stages', 'num_micro_batches', 'recompute', 'splits'} <= set(c)
  assert os.path.getsize(png) > 1000


def testNothingFitsSaysTheSmallestNeed(capsys):
  rc = plan.main(
    [
      '--model=bench.mlp',
      '--num_devices=2',
      '--device=cpu',
      '--memory_per_device=16KiB',
      *_SMALL,
    ]
  )
  assert rc == 1
  out = capsys.readouterr().out
  assert 'No configuration fits in 16.0 KiB' in out
  assert 'The smallest need is' in out and 'dominate' in out


@pytest.mark.parametrize(
  'flags,message',
  [
    (['--device=tpu_v9'], "the presets are ['a100', 'cpu'"),
    (['--num_stages=5'], 'K must lie in [1, 2]'),
    (['--num_stages=2', '--num_replicas=2'], 'K=2 x R=2 = 4 devices'),
    (['--memory_per_device=lots'], 'is not a size'),
    (['--model=bench.rnn'], 'the benchmark models are'),
  ],
)
def testBadInputIsOneClearMessage(flags, message, capsys):
  argv = ['--model=bench.mlp', '--num_devices=2', *_SMALL, *flags]
  assert plan.main(argv) == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize(
  'key', ['image.digits.MlpDigitsTiny', 'mt.multilingual.TransformerTiny']
)
def testPlansARegisteredModel(key, capsys):
  # The MT model's pipeline input is a NestedMap of ids, labels, paddings.
  rc = plan.main([f'--model={key}', '--num_devices=2', '--device=cpu'])
  assert rc == 0
  out = capsys.readouterr().out
  assert key in out and 'Feasible, best first' in out


def testValidateOnASmallBenchmarkJson(tmp_path, capsys):
  # Records as tools/benchmark_pipeline.py writes them (multi_process with
  # --memory=1): the measured numbers here are made up; the test checks that
  # every configuration gets its prediction and the ratios.
  bench = dict(
    args=dict(num_blocks=4, dim=32, seq_len=8, batch_size=16),
    records=[
      dict(
        model='mlp',
        num_stages=k,
        num_micro_batches=m,
        recompute=rc,
        replicas=1,
        batch_size=16,
        step_time_s=0.01 * (k + m),
        peak_bytes={f'/job:worker/task:{i}': 2**20 for i in range(max(k, 1))},
      )
      for k, m, rc in [(0, 1, False), (1, 1, False), (2, 4, True)]
    ],
    transfer=dict(bytes_per_s=1e9),
  )
  path = tmp_path / 'bench.json'
  path.write_text(json.dumps(bench))
  out_json = str(tmp_path / 'validation.json')
  rows = plan_validation.Validate(
    plan.ParseArgs([f'--validate={path}', '--device=cpu', f'--json={out_json}'])
  )
  assert len(rows) == 3
  for row, rec in zip(rows, bench['records']):
    assert row['measured_step_s'] == rec['step_time_s']
    assert row['step_ratio'] == pytest.approx(
      row['predicted_step_s'] / row['measured_step_s']
    )
    assert len(row['peak_ratio']) == max(rec['num_stages'], 1)
  # K=2, M=4 with recompute: less per device than the one-device model.
  assert (
    max(rows[2]['predicted_peak_bytes']) < rows[1]['predicted_peak_bytes'][0]
  )
  text = capsys.readouterr().out
  assert 'vs measured' in text and text.count('mlp') >= 3
  with open(out_json) as f:
    assert len(json.load(f)['rows']) == 3
  # A 1F1B record is predicted as 1F1B (fewer micro-batches held); an
  # interleaved one's K are its devices and num_cells its cells.
  one_f = dict(bench['records'][2], schedule='1f1b')
  inter = dict(bench['records'][2], schedule='interleaved', num_cells=4)
  bench['records'] += [one_f, inter]
  path.write_text(json.dumps(bench))
  rows = plan_validation.Validate(
    plan.ParseArgs([f'--validate={path}', '--device=cpu'])
  )
  assert [r['schedule'] for r in rows] == ['gpipe'] * 3 + [
    '1f1b',
    'interleaved',
  ]
  assert max(rows[3]['predicted_peak_bytes']) <= max(
    rows[2]['predicted_peak_bytes']
  )
  assert len(rows[4]['predicted_peak_bytes']) == 2
  text = capsys.readouterr().out
  assert '[1f1b]' in text and '[interleaved]' in text


def testCalibrateFitsEachModelOnItsOwnPlainRecord(tmp_path, capsys):
  # Two models in one JSON, as `--model=transformer,mlp` writes it: each is
  # calibrated on its own plain record (a flop rate is a property of the
  # model's ops), and the mlp record's batch_size (its rows, batch x
  # sequence) does not scale the mlp model again.
  def Rec(model, k, m, t, batch):
    return dict(
      model=model,
      num_stages=k,
      num_micro_batches=m,
      recompute=False,
      replicas=1,
      batch_size=batch,
      step_time_s=t,
    )

  bench = dict(
    args=dict(num_blocks=4, dim=32, seq_len=8, batch_size=16),
    records=[
      Rec('transformer', 0, 1, 0.5, 16),
      Rec('transformer', 2, 4, 0.3, 16),
      Rec('mlp', 0, 1, 0.02, 128),
      Rec('mlp', 2, 4, 0.012, 128),
    ],
    transfer=dict(bytes_per_s=1e9),
  )
  path = tmp_path / 'bench.json'
  path.write_text(json.dumps(bench))
  rows = plan_validation.Validate(
    plan.ParseArgs([f'--validate={path}', '--calibrate'])
  )
  assert rows[0]['step_ratio'] == pytest.approx(1.0)
  assert rows[2]['step_ratio'] == pytest.approx(1.0)
  # K=2, M=4 of each model: the bubble and split of its own calibration,
  # faster than its plain record but not faster than 2x.
  for plain, piped in ((rows[0], rows[1]), (rows[2], rows[3])):
    speedup = plain['predicted_step_s'] / piped['predicted_step_s']
    assert 1.2 < speedup <= 2.0
  text = capsys.readouterr().out
  assert 'Device for transformer: calibrated' in text
  assert 'Device for mlp: calibrated' in text


@pytest.mark.slow
def testPaperTable2TransformerRowsAtM32(tmp_path):
  path = str(tmp_path / 't2.json')
  records = plan_paper.PaperTable2(
    plan.ParseArgs(['--paper_table2', f'--json={path}'])
  )
  with open(path) as f:
    assert json.load(f) == records
  for r in records:
    assert {
      'model',
      'num_stages',
      'num_micro_batches',
      'predicted_normalized',
      'paper_normalized',
    } <= set(r)
  m32 = [
    r
    for r in records
    if r['model'] == 'transformer48' and r['num_micro_batches'] == 32
  ]
  assert [r['paper_normalized'] for r in m32] == [1.8, 3.4, 6.3]
  for r in m32:
    assert abs(r['predicted_normalized'] / r['paper_normalized'] - 1) < 0.15


def testPaperTable1LargestTransformerPerK():
  device = plan.device_presets.GetPreset('tpu_v3')
  for k, paper in plan_paper.PAPER_TABLE1_TRANSFORMER.items():
    if k > 8:
      continue
    n, m, peak = plan_paper.LargestTransformer(device, k, 16 * 2**30)
    assert abs(n / paper - 1) < 0.2, (k, n, paper)
    assert peak <= 16 * 2**30


def testValidateCapacityJsonComparesPeakBytesPerDevice(tmp_path, capsys):
  fixed = dict(
    model_dim=16,
    hidden_dim=32,
    num_heads=1,
    vocab_size=64,
    seq_len=8,
    batch_size=8,
  )
  trial = dict(
    family='transformer',
    config='pipeline-2',
    num_stages=2,
    num_micro_batches=4,
    recompute=True,
    size=4,
    fixed=fixed,
    peak_bytes_per_device=[2**20, 2**19],
  )
  path = tmp_path / 'capacity.json'
  path.write_text(json.dumps(dict(largest=[], trials=[trial])))
  # A record without its sizes gets tools/max_model_size.py's defaults.
  default = dict(trial, size=2)
  del default['fixed']
  path.write_text(json.dumps(dict(largest=[], trials=[trial, default])))
  rows = plan_validation.Validate(plan.ParseArgs([f'--validate={path}']))
  assert len(rows) == 2
  assert rows[1]['predicted_peak_bytes'] != rows[0]['predicted_peak_bytes']
  row = rows[0]
  assert len(row['predicted_peak_bytes']) == 2
  assert row['peak_ratio'] == [
    p / q
    for p, q in zip(row['predicted_peak_bytes'], trial['peak_bytes_per_device'])
  ]
  assert 'predicted vs measured' in capsys.readouterr().out
  # The list that tools/max_model_size.py --train_steps writes.
  path.write_text(json.dumps([trial]))
  assert (
    plan_validation.Validate(plan.ParseArgs([f'--validate={path}']))[0][
      'predicted_peak_bytes'
    ]
    == (row['predicted_peak_bytes'])
  )


def _ApplyLine(out):
  lines = out.splitlines()
  at = next(
    i for i, line in enumerate(lines) if 'To apply the best plan' in line
  )
  return lines[at + 1].strip()


def testPrintsTheTrainerFlagsThatApplyTheBestPlan(tmp_path, capsys):
  from lingvo_gpipe import trainer_params  # pylint: disable=g-import-not-at-top

  key = 'image.digits.MlpDigitsTiny'
  path = tmp_path / 'plan.json'
  # Fixed K=2, M=4 so that the flags set something other than the model's.
  argv = [f'--model={key}', '--num_devices=2', '--device=cpu']
  argv += ['--num_stages=2', '--num_micro_batches=4', f'--json={path}']
  assert plan.main(argv) == 0
  line = _ApplyLine(capsys.readouterr().out)
  assert json.loads(path.read_text())['apply'] == line
  best = json.loads(path.read_text())['feasible'][0]
  args = shlex.split(line)
  assert args[:3] == ['python', '-m', 'lingvo_gpipe.trainer'], line
  flags = dict(a[2:].split('=', 1) for a in args[3:])
  assert flags['model'] == key
  assert flags['num_cpu_devices'] == '2'
  p = trainer_params.BuildParams(
    flags['model'],
    overrides=[flags['model_params_override']],
    worker_split_size=int(flags['worker_split_size']),
    devices=[f'/device:CPU:{i}' for i in range(2)],
  )
  net = p.task.network
  assert net.num_stages == best['num_stages'] == 2
  assert net.num_micro_batches == best['num_micro_batches'] == 4
  assert net.recompute == ('always' if best['recompute'] else 'never')
  assert list(net.splits) == best['splits']
  assert net.schedule == best['schedule']  # 'gpipe' or '1f1b', as planned


def testTheFlagsSetTheScheduleOfAOneFOneBPlan():
  cand = planner.Candidate(
    num_replicas=1,
    num_stages=2,
    num_micro_batches=4,
    recompute=True,
    split_by='time',
    splits=[1, 2],
    schedule='1f1b',
  )
  line = plan.ApplyText(cand, 'image.digits.MlpDigitsTiny', 'network', 'cpu')
  assert "network.schedule : 1f1b'" in line, line
  cand.schedule = 'gpipe'
  line = plan.ApplyText(cand, 'image.digits.MlpDigitsTiny', 'network', 'cpu')
  assert 'schedule' not in line  # the default: nothing to set


def testPrintsThePipelineParamsOfABuiltInModel(capsys):
  argv = ['--model=bench.mlp', '--num_devices=2', '--num_stages=2', *_SMALL]
  assert plan.main(argv) == 0
  line = _ApplyLine(capsys.readouterr().out)
  assert line.startswith('PipeliningLayer.Params().Set(num_stages=2, ')
  assert 'num_micro_batches=' in line and 'splits=[' in line


def testHelpExplainsTheModelFlag(capsys):
  with pytest.raises(SystemExit):
    plan.main(['--help'])
  out = capsys.readouterr().out
  assert 'see above' not in out
  assert 'registered model key' in out and 'bench.transformer' in out
  assert 'examples:\n  python tools/plan.py --model=' in out
  assert 'Over 500 lines' not in out


def testPlansLingvosLmStackAndItsFlagsBuildThePlannedCells(capsys):
  """A pipeline that builds its own cells (Lingvo's GPipe LM stack): the
  planner profiles its layers (embedding, blocks, softmax) from the input's
  batch and length, and the printed flags set the stack's own `splits`, so
  the model built from them has the planned cells."""
  from lingvo_gpipe import trainer_params  # pylint: disable=g-import-not-at-top

  key = 'lm.one_billion_wds.OneBWdsGPipeTransformerTiny'
  argv = [f'--model={key}', '--num_devices=2', '--device=cpu']
  argv += ['--num_stages=2', '--num_micro_batches=4']
  assert plan.main(argv) == 0
  out = capsys.readouterr().out
  assert f'{key}: 6 layers,' in out, out  # embedding, 4 blocks, softmax
  flags = dict(a[2:].split('=', 1) for a in shlex.split(_ApplyLine(out))[3:])
  assert 'task.lm.stack.splits : [' in flags['model_params_override']
  p = trainer_params.BuildParams(
    key,
    overrides=[flags['model_params_override']],
    worker_split_size=2,
    devices=['/device:CPU:0', '/device:CPU:1'],
  )
  stack = p.task.lm.stack
  # The best plan's split: row 1 of the table, '[end, ...] (by)'.
  planned = re.search(r'^\s+1\s.*?\[([\d, ]+)\] \(', out, re.M).group(1)
  ends = [int(e) for e in planned.split(',')]
  cells = stack.cls.CellParams(stack)
  assert [len(c.sub) for c in cells] == [
    b - a for a, b in zip([0] + ends[:-1], ends)
  ], (ends, stack.splits)
  assert stack.num_micro_batches == 4
  # Its loss comes out of FProp: it trains with GPipe's schedule only.
  assert (
    ' 1f1b ' not in out and 'schedule' not in flags['model_params_override']
  )
  assert plan.main(argv + ['--schedule=1f1b']) == 2
  assert "trains with schedule 'gpipe' only" in capsys.readouterr().err


def testBudgetsThatDoNotFitTogetherOnThisHostAreNoted():
  """8 CPU devices of 3 GiB are more than a 24 GB host once each worker's
  TensorFlow runtime and the trainer are counted: the plan says so, with
  the budget that would fit; a budget that fits, or an accelerator, gets
  no note."""
  args = plan.ParseArgs(
    ['--model=bench.mlp', '--num_devices=8', '--memory_per_device=3GiB']
  )
  host = 24 * 10**9
  note = plan.HostMemoryNote(args, host_bytes=host)
  assert note.startswith(
    'Note: as worker processes of this host, 8 devices of 3.0 GiB need '
  ), note
  assert '--memory_per_device=2.1GiB or less' in note, note
  args.memory_per_device = '2GiB'
  assert plan.HostMemoryNote(args, host_bytes=host) == ''
  args.memory_per_device, args.device = '3GiB', 'tpu_v3'
  assert plan.HostMemoryNote(args, host_bytes=host) == ''


def testTheFlagsOfAnInterleavedPlanPlaceItsCellsOnFewerDevices():
  """An interleaved plan's K cells on D devices: the flags set K and the
  schedule and give the host D devices (no --worker_split_size, which
  gives each cell a device of its own); the pipeline built from them runs
  cell k on device k mod D."""
  from lingvo_gpipe import trainer_params  # pylint: disable=g-import-not-at-top

  key = 'image.amoebanet.AmoebaNetTiny'
  p = trainer_params.BuildParams(key)
  num_layers = len(p.task.network.layers)
  assert num_layers >= 4
  cand = planner.Candidate(
    num_replicas=1,
    num_stages=4,
    num_micro_batches=4,
    recompute=True,
    split_by='time',
    splits=[1, 2, 3, num_layers],
    schedule='interleaved',
    virtual_stages=2,
  )
  line = plan.ApplyText(cand, key, plan.PipelineKey(key), 'cpu')
  flags = dict(a[2:].split('=', 1) for a in shlex.split(line)[3:])
  assert 'worker_split_size' not in flags and flags['num_cpu_devices'] == '2'
  p = trainer_params.BuildParams(
    key, overrides=[flags['model_params_override']]
  )
  net = p.task.network
  assert (net.num_stages, net.schedule) == (4, 'interleaved')
  assert list(net.splits) == cand.splits
  # What --num_cpu_devices=2 gives the layer: the host's 2 devices.
  cpus = [f'/device:CPU:{i}' for i in range(2)]
  layer = net.Copy().Set(devices=cpus).Instantiate()
  assert [device for _, device, _ in layer.Placement()] == cpus * 2
