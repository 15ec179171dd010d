"""`tools/plan.py --validate`: the planner's predictions against measured
records: a `tools/benchmark_pipeline.py` JSON (step time, and each device's
peak where recorded) or a `tools/max_model_size.py` JSON (each trial's
peak per device), with `--calibrate` fitting the flop rate to the JSON's
own one-device record.
"""

import argparse
import json

from lingvo_gpipe.planning import cost_model
from lingvo_gpipe.planning import device_presets
from lingvo_gpipe.planning import planner
from lingvo_gpipe.tools import capacity_trial
from lingvo_gpipe.tools import common
from lingvo_gpipe.tools.common import GIB
from lingvo_gpipe.tools.common import GetDevice
from lingvo_gpipe.tools.common import ParseBytes
from lingvo_gpipe.tools.common import UserError


def Validate(args):
  """Rows of predicted vs measured for every record of a benchmark JSON."""

  try:
    with open(args.validate) as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f'--validate={args.validate}: cannot read it: {e}') from e
  if isinstance(data, dict) and 'trials' in data and 'records' not in data:
    return ValidateCapacity(data, args)
  if (
    isinstance(data, list)
    and data
    and all(isinstance(r, dict) and 'peak_bytes_per_device' in r for r in data)
  ):
    # tools/max_model_size.py --train_steps writes its trials as a list.
    return ValidateCapacity(dict(trials=data), args)
  records = data.get('records') if isinstance(data, dict) else None
  if not records:
    raise UserError(
      f'--validate={args.validate} has no "records"; give the JSON that '
      'tools/benchmark_pipeline.py --json or tools/max_model_size.py --json '
      'writes.'
    )
  bench_args = dict(
    num_blocks=args.num_blocks,
    dim=args.dim,
    seq_len=args.seq_len,
    batch_size=args.batch_size,
  )
  bench_args.update(
    {k: v for k, v in (data.get('args') or {}).items() if k in bench_args}
  )
  link = None
  t = data.get('transfer')
  if t and t.get('bytes_per_s'):
    link = (t['bytes_per_s'], 0.0)
  rows = []
  profiles = {}
  calibrated = {}
  device = None
  for rec in records:
    model = rec['model']
    if model not in common.MODELS:
      raise UserError(
        f'--validate: record of model {model!r}; the benchmark models are '
        f'{sorted(common.MODELS)}.'
      )
    if model not in profiles:
      ns = argparse.Namespace(**bench_args)
      if 'batch_size' not in (data.get('args') or {}):
        # A record's batch_size is its input's first dimension: the batch,
        # except for the mlp model (batch x sequence rows).
        ns.batch_size = rec.get('batch_size') or ns.batch_size
      layers, shape = common.MODELS[model](ns)
      profile = planner.ProfileLayers(layers, [shape], name=model)
      if args.device == 'measure':
        planner.MeasureProfile(
          profile, layers, time_budget_s=args.measure_budget_s
        )
      profiles[model] = profile
    profile = profiles[model]
    if args.calibrate:
      # Each model calibrated on its own one-device record: a flop rate is
      # a property of the model's ops on this host, not of the host alone.
      if model not in calibrated:
        calibrated[model] = CalibratedDevice(
          [r for r in records if r['model'] == model], profile, link
        )
      device = calibrated[model]
    if device is None:
      if args.device == 'measure':
        mem = ParseBytes(args.memory_per_device) or 4 * GIB
        device = planner.MeasuredDevice(mem, link=link)
      else:
        device = GetDevice(args)
    k = max(int(rec['num_stages']), 1)
    m = int(rec['num_micro_batches'])
    r = int(rec.get('replicas') or 1)
    sched = rec.get('schedule') or 'gpipe'
    if sched not in cost_model.SIMULATED_SCHEDULES:
      print(f'Not predicted: {model} K={k} M={m} schedule {sched}.')
      continue
    # An interleaved record's K is its devices; its cells are num_cells.
    cells = int(rec.get('num_cells') or k) if sched == 'interleaved' else k
    cand = planner.Evaluate(
      profile,
      device,
      cells,
      m,
      bool(rec['recompute']),
      r,
      split_by='time',
      schedule=sched,
      virtual_stages=max(1, cells // k),
    )
    measured = float(rec['step_time_s'])
    row = dict(
      model=model,
      num_stages=int(rec['num_stages']),
      num_micro_batches=m,
      recompute=bool(rec['recompute']),
      replicas=r,
      schedule=sched,
      predicted_step_s=cand.step_s,
      measured_step_s=measured,
      step_ratio=cand.step_s / measured,
    )
    peaks = rec.get('peak_bytes')
    if isinstance(peaks, dict) and peaks:
      measured_peaks = list(peaks.values())
      row['predicted_peak_bytes'] = cand.peak_bytes
      row['measured_peak_bytes'] = measured_peaks
      row['peak_ratio'] = [
        p / q if q else None for p, q in zip(cand.peak_bytes, measured_peaks)
      ]
    rows.append(row)
  print(ValidationTable(rows, calibrated or {None: device}))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(device=device.name, rows=rows), f, indent=1)
    print(f'Wrote {args.json}')
  return rows


def CapacityModel(trial):
  """(layers, input shapes) of a tools/max_model_size.py trial."""
  family, fixed = trial['family'], trial['fixed']
  if family not in capacity_trial.FAMILIES:
    raise UserError(
      f'--validate: unknown family {family!r} (transformer, amoebanet).'
    )
  layers, _, _ = capacity_trial.FamilyLayers(
    family, trial['size'], fixed, trial.get('num_cells')
  )
  if family == 'transformer':
    shape = [fixed['batch_size'], fixed['seq_len']]
    return layers, [shape, shape]
  s = fixed['image_size']
  return layers, [[fixed['batch_size'], s, s, 3]]


def ValidateCapacity(data, args):
  """Predicted vs measured peak bytes per device of the models of a
  tools/max_model_size.py JSON (Adam; the cells of the trial's `splits`,
  else balanced by parameters as older records were)."""
  from lingvo_gpipe.core import base_layer  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.planning import balance  # pylint: disable=g-import-not-at-top

  device = device_presets.GetPreset('cpu')
  rows = []
  families = None
  for trial in data['trials']:
    if not trial.get('peak_bytes_per_device'):
      continue
    if 'fixed' not in trial:  # older records: the tool's default sizes
      if families is None:
        families = capacity_trial.FAMILIES
      trial = dict(trial, fixed=families[trial['family']]['fixed'])
    layers, shapes = CapacityModel(trial)
    profile = planner.ProfileLayers(layers, shapes, name=trial['family'])
    k = int(trial['num_stages'])
    splits = trial.get('splits')
    if not splits:  # older records: the split by parameters they used
      params = [float(base_layer.CountParams(p)) for p in layers]
      splits = balance.BalancedSplits(params, k)
    cand = planner.Evaluate(
      profile,
      device,
      k,
      int(trial['num_micro_batches']),
      bool(trial['recompute']),
      1,
      splits=splits,
      split_by='params',
      memory_bytes=2**40,
      compiled=bool(trial.get('jit_compile')),
    )
    measured = list(trial['peak_bytes_per_device'])
    predicted = list(cand.peak_bytes)
    if trial.get('peak_is_max_over_devices'):
      predicted = [max(predicted)]
    rows.append(
      dict(
        family=trial['family'],
        config=trial['config'],
        size=trial['size'],
        num_micro_batches=int(trial['num_micro_batches']),
        inter_op_threads=trial.get('inter_op_threads'),
        predicted_peak_bytes=predicted,
        measured_peak_bytes=measured,
        peak_ratio=[p / q for p, q in zip(predicted, measured)],
        predicted_memory=cand.memory,
      )
    )
  lines = ['Peak bytes per device, predicted vs measured:']
  lines.append(
    f'{"family":>11} {"config":>11} {"size":>5} {"threads":>7}  '
    'predicted / measured (ratio) per device'
  )
  for r in rows:
    lines.append(
      f'{r["family"]:>11} {r["config"]:>11} {r["size"]:>5} '
      f'{str(r["inter_op_threads"] or "default"):>7}  '
      + ', '.join(
        f'{planner.FormatBytes(p)} / {planner.FormatBytes(q)} ({x:.2f})'
        for p, q, x in zip(
          r['predicted_peak_bytes'], r['measured_peak_bytes'], r['peak_ratio']
        )
      )
    )
  print('\n'.join(lines))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(rows=rows), f, indent=1)
    print(f'Wrote {args.json}')
  return rows


def CalibratedDevice(records, profile, link):
  """A device whose flop rate makes the one-device record (the plain
  model, else K=1 M=1) take its measured time; the link from the JSON.
  Every other configuration is then a prediction of the schedule, the
  transfers, recompute and the split."""
  base = [r for r in records if int(r['num_stages']) == 0] or [
    r
    for r in records
    if int(r['num_stages']) == 1
    and int(r['num_micro_batches']) == 1
    and not r['recompute']
  ]
  if not base:
    raise UserError(
      '--calibrate needs a one-device record (num_stages 0, or 1 with one '
      'micro-batch and no recompute) in the benchmark JSON.'
    )
  flops = 3 * sum(lp.flops for lp in profile.layers)
  rate = flops / float(base[0]['step_time_s'])
  bw = link[0] if link else 1e9
  return device_presets.Device(
    name='calibrated',
    description=(
      f'{rate / 1e9:.1f} GFLOP/s from the measured one-device step of '
      f'{base[0]["step_time_s"]:.3f} s, link {bw / 2**20:.0f} MiB/s from the '
      'JSON'
    ),
    peak_flops=rate,
    memory_bytes=4 * GIB,
    memory_bytes_per_s=float('inf'),
    link_bytes_per_s=bw,
    link_latency_s=0.0,
    op_overhead_s=0.0,
    flops_efficiency=1.0,
  )


def ValidationTable(rows, devices):
  """The rows as a table; `devices`: {model or None: the device used}."""
  lines = [
    f'Device{f" for {model}" if model else ""}: {device.name} '
    f'({device.description})'
    for model, device in devices.items()
  ]
  lines += [
    'Predicted vs measured:',
    f'{"model":>12} {"K":>2} {"M":>3} {"rc":>3} {"R":>2} '
    f'{"predicted":>10} {"measured":>10} {"ratio":>6}  peak/device '
    'predicted / measured (ratio)',
  ]
  for r in rows:
    line = (
      f'{r["model"]:>12} {r["num_stages"]:>2} {r["num_micro_batches"]:>3} '
      f'{"yes" if r["recompute"] else "no":>3} {r["replicas"]:>2} '
      f'{r["predicted_step_s"]:>9.3f}s {r["measured_step_s"]:>9.3f}s '
      f'{r["step_ratio"]:>6.2f}'
    )
    if 'peak_ratio' in r:
      line += '  ' + ', '.join(
        f'{planner.FormatBytes(p)} / {planner.FormatBytes(q)} ({x:.2f})'
        for p, q, x in zip(
          r['predicted_peak_bytes'], r['measured_peak_bytes'], r['peak_ratio']
        )
        if x is not None
      )
    if r.get('schedule', 'gpipe') != 'gpipe':
      line += f'  [{r["schedule"]}]'
    lines.append(line)
  return '\n'.join(lines)
