r"""Plans a GPipe pipeline: K, M, replicas, split and re-materialization.

Over 500 lines: one command-line tool: planning, validation and the paper's
tables share its models and its output.

  python tools/plan.py --model=bench.transformer --num_devices=2 --device=cpu
  python tools/plan.py --model=mt.multilingual.TransformerT24x8192x16 \
      --num_devices=8 --device=tpu_v3 --json=/tmp/plan.json
  python tools/plan.py --model=bench.transformer --num_devices=2 \
      --device=measure --timeline=/tmp/plan.png
  python tools/plan.py --validate=/tmp/bench.json --device=measure
  python tools/plan.py --paper_table2 --json=/tmp/table2.json
  python tools/plan.py --paper_table1

--model is a registered model key (its first PipeliningLayer is planned,
with the batch of its training input), or one of the built-in models:
bench.<transformer|mlp|conv|amoebanet> (tools/benchmark_pipeline.py's models,
sized by --num_blocks, --dim, --seq_len, --batch_size), paper.transformer48
and paper.amoebanet_d18_256 (the paper's Table 2 models). The model is built
abstractly: no weight is allocated.

--device is a preset (tpu_v2, tpu_v3, v100, a100, h100, cpu) or `measure`:
this host's per-layer times (one thread, like one benchmark worker) and the
link between two local TensorFlow server workers.

--validate=BENCH_JSON predicts every configuration of a
tools/benchmark_pipeline.py JSON and prints predicted and measured step
time (and peak bytes per device where the JSON has them) with their ratio.
"""

import argparse
import json
import os
import sys

from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

quiet_start.ImportTensorFlow(min_log_level='2')


import tensorflow as tf  # pylint: disable=g-import-not-at-top

from lingvo_gpipe import model_registry  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.planning import cost_model  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.planning import device_presets  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.planning import planner  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import benchmark_pipeline  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import max_model_size  # pylint: disable=g-import-not-at-top

GIB = 2**30

# The paper's Table 2 (throughput normalized to K=2, M=1) and Table 1
# (the largest Transformer per K: layers, with 16 GB per TPU core).
PAPER_TABLE2 = {
  'amoebanet_d18_256': {
    (2, 1): 1.0,
    (4, 1): 1.13,
    (8, 1): 1.38,
    (2, 4): 1.07,
    (4, 4): 1.26,
    (8, 4): 1.72,
    (2, 32): 1.21,
    (4, 32): 1.84,
    (8, 32): 3.48,
  },
  'transformer48': {
    (2, 1): 1.0,
    (4, 1): 1.07,
    (8, 1): 1.3,
    (2, 4): 1.7,
    (4, 4): 3.2,
    (8, 4): 4.8,
    (2, 32): 1.8,
    (4, 32): 3.4,
    (8, 32): 6.3,
  },
}
PAPER_TABLE1_TRANSFORMER = {1: 13, 8: 103, 32: 415, 128: 1663}
PAPER_TABLE1_NAIVE = 3
# The paper's Table 1 Transformer: vocabulary 32k, 1024 tokens, batch 32,
# model dim 2048, FFN 8192, 32 heads.
PAPER_TRANSFORMER = dict(
  model_dim=2048, hidden_dim=8192, num_heads=32, vocab_size=32000
)
PAPER_SEQ_LEN = 1024
PAPER_BATCH = 32
PAPER_AMOEBANET_BATCH = 128


class UserError(Exception):
  pass


def _BenchArgs(args):
  return argparse.Namespace(
    num_blocks=args.num_blocks,
    dim=args.dim,
    seq_len=args.seq_len,
    batch_size=args.batch_size,
  )


def PaperTransformer(num_layers=48, batch=PAPER_BATCH):
  from lingvo_gpipe.models import transformer_lm  # pylint: disable=g-import-not-at-top

  layers = transformer_lm.LayerParams(
    num_layers=num_layers, **PAPER_TRANSFORMER
  )
  return layers, [[batch, PAPER_SEQ_LEN], [batch, PAPER_SEQ_LEN]]


def PaperAmoebaNet(batch=PAPER_AMOEBANET_BATCH):
  from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

  net = (
    amoebanet.AmoebaNet.Params()
    .Set(num_cells=18, num_filters=256, image_size=224, num_classes=1000)
    .Instantiate()
  )
  return net.Layers(), [net.InputShape(batch)]


def _Registered(key, batch_size):
  """(layers, input shapes, optimizer slots, the Params key of the pipeline)
  of a registered model's first PipeliningLayer with a flat `layers` list."""
  from lingvo_gpipe import trainer  # pylint: disable=g-import-not-at-top

  try:
    p = model_registry.GetParams(key, 'Train')
  except LookupError as e:
    raise UserError(str(e.args[0]) if e.args else str(e)) from e
  pipes = trainer.PipelineLayers(p)
  if not pipes:
    raise UserError(f'--model={key} has no PipeliningLayer to plan.')
  pipe_key, lp = pipes[0]
  layers = list(lp.layers) or list(lp.cell_tpl)
  stack = hasattr(lp.cls, 'PlannerInputs')  # builds its own cells
  if not layers and stack:
    layers = lp.cls.PlannerLayers(lp)
  batch = batch_size or getattr(p.input, 'batch_size', None)
  if lp.input_shapes is None and stack:
    seq_len = getattr(p.input, 'max_tokens', None)
    if not batch or not seq_len:
      raise UserError(
        f'--model={key}: the planner needs the batch size and the sequence '
        f'length of its input (batch_size={batch}, max_tokens={seq_len}).'
      )
    try:
      shapes = lp.cls.PlannerInputs(lp, batch, seq_len)
    except ValueError as e:
      raise UserError(f'--model={key}: {e}') from e
    return layers, shapes, _Slots(p), pipe_key
  if lp.input_shapes is None:
    raise UserError(
      f'--model={key}: its PipeliningLayer has no input_shapes; the planner '
      'needs them (set input_shapes in the model params).'
    )

  def Fill(shape):
    dims = list(shape)
    if dims and dims[0] is None:
      if not batch:
        raise UserError(
          f'--model={key}: the batch size is unknown; give --batch_size.'
        )
      dims[0] = batch
    return dims

  def FillAll(s):
    if isinstance(s, dict):
      out = s.copy()
      for k in out:
        out[k] = FillAll(out[k])
      return out
    return Fill(s)

  shapes = [FillAll(s) for s in lp.input_shapes]
  return layers, shapes, _Slots(p), pipe_key


def _Slots(p):
  """The optimizer slots per weight of registered model Params `p`."""
  opt = getattr(getattr(p.task, 'train', None), 'optimizer', None)
  if opt is not None and 'SGD' in getattr(opt.cls, '__name__', ''):
    return 0
  return 2


# What a TensorFlow worker process holds before any model (measured: 0.62
# GB resident per worker of tools/local_cluster.py), and the trainer
# driving them (1.2 GB for a 608M-parameter LM; docs/scale.md).
_WORKER_RUNTIME_BYTES = int(0.62e9)
_DRIVER_BYTES = int(1.2e9)


def HostMemoryNote(args, host_bytes=None):
  """A line for a CPU plan whose devices, as worker processes of this
  host, would need more than its memory; '' otherwise."""
  budget = ParseBytes(args.memory_per_device)
  if args.device not in ('cpu', 'measure') or not budget:
    return ''
  if host_bytes is None:
    host_bytes = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  n = args.num_devices
  need = n * (budget + _WORKER_RUNTIME_BYTES) + _DRIVER_BYTES
  if need <= host_bytes:
    return ''
  room = (host_bytes - _DRIVER_BYTES) / n - _WORKER_RUNTIME_BYTES
  fmt = planner.FormatBytes
  return (
    f'Note: as worker processes of this host, {n} devices of '
    f'{fmt(budget)} need {fmt(need)} with their TensorFlow runtimes '
    f'(~{fmt(_WORKER_RUNTIME_BYTES)} each) and the trainer, more than its '
    f'{fmt(host_bytes)}: give '
    f'--memory_per_device={max(room, 0) / 2**30:.1f}GiB or less to plan '
    'for this host, or run the workers on several hosts.'
  )


def _Schedules(args, stack):
  """The schedules to plan. A Lingvo stack (`stack`) computes its loss in
  the last cell's softmax but returns it through FProp, not FPropWithLoss,
  so it trains with 'gpipe' only (1F1B needs each micro-batch's loss)."""
  if args.schedule != 'search':
    if args.schedule != 'gpipe' and stack:
      raise UserError(
        f'--schedule={args.schedule}: --model={args.model} is a Lingvo '
        "stack, which trains with schedule 'gpipe' only (its loss comes "
        "out of FProp, and 1F1B needs each micro-batch's loss)."
      )
    return (args.schedule,)
  return ('gpipe',) if stack else ('gpipe', '1f1b', 'interleaved')


def _StackSplits(key):
  """For a registered model whose pipeline builds its own cells (Lingvo's
  stacks): a function from the planner's cell ends to the stack's
  `splits`; None otherwise."""
  if key.startswith(('bench.', 'paper.')):
    return None
  from lingvo_gpipe import trainer  # pylint: disable=g-import-not-at-top

  _, lp = trainer.PipelineLayers(model_registry.GetParams(key, 'Train'))[0]
  if not hasattr(lp.cls, 'PlannerSplits'):
    return None
  return lambda ends: lp.cls.PlannerSplits(lp, ends)


def BuildModel(args, key=None):
  """(name, layers, input shapes, optimizer slots) of --model."""
  key = key or args.model
  if not key:
    raise UserError('--model is required, e.g. --model=bench.transformer.')
  if key.startswith('bench.'):
    name = key.split('.', 1)[1]
    if name not in benchmark_pipeline.MODELS:
      raise UserError(
        f'--model={key}: the benchmark models are '
        f'{["bench." + m for m in benchmark_pipeline.MODELS]}.'
      )
    layers, shape = benchmark_pipeline.MODELS[name](_BenchArgs(args))
    return key, layers, [shape], 2
  if key == 'paper.transformer48':
    layers, shapes = PaperTransformer(48)
    return key, layers, shapes, 2
  if key == 'paper.amoebanet_d18_256':
    layers, shapes = PaperAmoebaNet()
    return key, layers, shapes, 2
  layers, shapes, slots, _ = _Registered(key, args.batch_size_override)
  return key, layers, shapes, slots


def PipelineKey(key):
  """The Params key of registered model `key`'s planned PipeliningLayer
  (e.g. 'task.network'); None for the built-in bench.* and paper.* models."""
  if key.startswith(('bench.', 'paper.')):
    return None
  return _Registered(key, None)[3]


_RECOMPUTE = {True: 'always', False: 'never'}


def ApplyText(cand, model, pipe_key, device_name, stack_splits=None):
  """How to apply plan `cand`: the trainer's flags for a registered model
  (`pipe_key`: its pipeline's Params key; `stack_splits`: for a pipeline
  that builds its own cells, its `splits` from the plan's cell ends), else
  PipeliningLayer Params."""
  splits = list(cand.splits)
  if stack_splits is not None:
    splits = stack_splits(splits)
  fields = [
    ('num_micro_batches', cand.num_micro_batches),
    ('recompute', _RECOMPUTE[cand.recompute]),
    ('splits', splits),
  ]
  if cand.schedule != 'gpipe':
    fields.append(('schedule', cand.schedule))
  if pipe_key is None:
    sets = [
      ('num_stages', cand.num_stages),
      *fields,
      ('num_replicas', cand.num_replicas),
    ]
    body = ', '.join(f'{k}={v!r}' for k, v in sets)
    where = ''
    if cand.virtual_stages > 1:
      where = (
        f'  # on {cand.num_devices} devices (devices=[...]): cell k on '
        f'device k mod {cand.num_devices}'
      )
    return f'PipeliningLayer.Params().Set({body}){where}'
  devices = cand.num_devices * cand.num_replicas
  flags = [f'--model={model}']
  if cand.virtual_stages > 1:
    # K cells on the host's D devices, cell k on device k mod D: the
    # pipeline places them itself (--worker_split_size would give each
    # cell a device of its own).
    fields.insert(0, ('num_stages', cand.num_stages))
  else:
    flags.append(f'--worker_split_size={cand.num_stages}')
  if cand.num_replicas > 1:
    flags.append(f'--worker_replicas={cand.num_replicas}')
  if device_name in ('cpu', 'measure'):
    flags.append(f'--num_cpu_devices={devices}')
  prefix = f'{pipe_key}.' if pipe_key else ''
  override = '; '.join(f'{prefix}{k} : {v}' for k, v in fields)
  flags.append(f"--model_params_override='{override}'")
  return 'python -m lingvo_gpipe.trainer ' + ' '.join(flags)


def ParseBytes(text):
  """'16GiB', '512MiB', '8GB', '1e9' -> bytes."""
  if text is None or text == '':
    return None
  t = str(text).strip()
  units = {
    'tib': 2**40,
    'gib': 2**30,
    'mib': 2**20,
    'kib': 2**10,
    'tb': 1e12,
    'gb': 1e9,
    'mb': 1e6,
    'kb': 1e3,
    'b': 1,
  }
  low = t.lower()
  num, scale = low, 1
  for unit, factor in units.items():
    if low.endswith(unit):
      num, scale = low[: -len(unit)].strip(), factor
      break
  try:
    value = float(num) * scale
  except ValueError as e:
    raise UserError(
      f'--memory_per_device={text!r} is not a size; use e.g. 16GiB, 512MiB '
      'or a number of bytes.'
    ) from e
  if value <= 0:
    raise UserError(f'--memory_per_device={text!r} must be positive.')
  return int(value)


def OneThread():
  """Time layers with one thread, as one benchmark worker runs them (only
  possible before TensorFlow starts; a process that already ran ops keeps
  its pools)."""
  try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
  except RuntimeError:
    pass


def GetDevice(args, profile=None, layers=None, link=None):
  if args.device == 'measure':
    if profile is not None:
      planner.MeasureProfile(
        profile, layers, time_budget_s=args.measure_budget_s
      )
    mem = (
      ParseBytes(args.memory_per_device)
      or device_presets.PRESETS['cpu'].memory_bytes
    )
    return planner.MeasuredDevice(mem, link=link)
  try:
    return device_presets.GetPreset(args.device)
  except ValueError as e:
    raise UserError(str(e)) from e


def RunPlan(args):
  name, layers, shapes, slots = BuildModel(args)
  stack_splits = _StackSplits(args.model)
  if args.device != 'measure':
    GetDevice(args)  # an unknown preset fails before any work
  try:
    profile = planner.ProfileLayers(layers, shapes, name=name)
    planner.CheckShape(
      profile.num_layers,
      args.num_devices,
      args.num_stages,
      args.num_replicas,
    )
  except ValueError as e:
    raise UserError(str(e)) from e
  device = GetDevice(args, profile, layers)
  recompute = None if args.recompute == 'search' else args.recompute == 'yes'
  try:
    result = planner.Plan(
      profile,
      device,
      args.num_devices,
      memory_bytes=ParseBytes(args.memory_per_device),
      optimizer_slots=slots
      if args.optimizer_slots is None
      else args.optimizer_slots,
      num_stages=args.num_stages,
      num_micro_batches=args.num_micro_batches,
      num_replicas=args.num_replicas,
      recompute=recompute,
      schedules=_Schedules(args, stack_splits is not None),
      max_micro_batches=args.max_micro_batches,
      compiled=args.jit_compile,
    )
  except ValueError as e:
    raise UserError(str(e)) from e
  print(
    f'{name}: {profile.num_layers} layers, {profile.num_params:,} '
    f'parameters, batch {profile.batch_size}.'
  )
  print(result.ToText(top=args.top))
  note = HostMemoryNote(args)
  if note:
    print(note)
  record = result.ToDict()
  if result.best is not None:
    how = ApplyText(
      result.best,
      args.model,
      PipelineKey(args.model),
      args.device,
      stack_splits,
    )
    record['apply'] = how
    print(
      'To apply the best plan'
      + (' (add --logdir=...):' if how.startswith('python') else ':')
    )
    print('  ' + how)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(record, f, indent=1, default=str)
    print(f'Wrote {args.json}')
  if args.timeline:
    best = result.best or result.SmallestNeed()
    WriteTimeline(best, args.timeline, name, device)
  if result.best is None:
    return 1
  return 0


def WriteTimeline(cand, path, name, device):
  from lingvo_gpipe.pipeline import timeline  # pylint: disable=g-import-not-at-top

  timeline.PlotTimeline(
    cand.events,
    path,
    devices=[f'{device.name} {k}' for k in range(cand.num_stages)],
    title=(
      f'{name}: predicted, {cand.Label()} on {device.name} (blue forward, '
      'orange backward'
      + (' with recompute' if cand.recompute else '')
      + '; gaps: bubble)'
    ),
  )
  print(f'Predicted timeline: {path}')
  return path


# -----------------------------------------------------------------------------
# --validate
# -----------------------------------------------------------------------------


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
    if model not in benchmark_pipeline.MODELS:
      raise UserError(
        f'--validate: record of model {model!r}; the benchmark models are '
        f'{sorted(benchmark_pipeline.MODELS)}.'
      )
    if model not in profiles:
      ns = argparse.Namespace(**bench_args)
      if 'batch_size' not in (data.get('args') or {}):
        # A record's batch_size is its input's first dimension: the batch,
        # except for the mlp model (batch x sequence rows).
        ns.batch_size = rec.get('batch_size') or ns.batch_size
      layers, shape = benchmark_pipeline.MODELS[model](ns)
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
  fixed = trial['fixed']
  if trial['family'] == 'transformer':
    from lingvo_gpipe.models import transformer_lm  # pylint: disable=g-import-not-at-top

    layers = transformer_lm.LayerParams(
      num_layers=trial['size'],
      model_dim=fixed['model_dim'],
      hidden_dim=fixed['hidden_dim'],
      num_heads=fixed['num_heads'],
      vocab_size=fixed['vocab_size'],
    )
    shape = [fixed['batch_size'], fixed['seq_len']]
    return layers, [shape, shape]
  if trial['family'] == 'amoebanet':
    from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

    net = (
      amoebanet.AmoebaNet.Params()
      .Set(
        num_cells=trial['num_cells'],
        num_filters=trial['size'],
        image_size=fixed['image_size'],
        stem_type='cifar',
        stem_filters=trial['size'],
        num_classes=fixed['num_classes'],
        head_logits=True,
      )
      .Instantiate()
    )
    return net.Layers(), [net.InputShape(fixed['batch_size'])]
  raise UserError(
    f'--validate: unknown family {trial["family"]!r} (transformer, amoebanet).'
  )


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
        families = max_model_size.FAMILIES
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


# -----------------------------------------------------------------------------
# The paper's tables.
# -----------------------------------------------------------------------------


def PaperTable2(args):
  """Records of the paper's Table 2 predicted with the TPU preset."""
  device = device_presets.GetPreset(args.paper_device)
  records = []
  for model, builder in (
    ('transformer48', lambda: PaperTransformer(48)),
    ('amoebanet_d18_256', PaperAmoebaNet),
  ):
    layers, shapes = builder()
    profile = planner.ProfileLayers(layers, shapes, name=model)
    preds = {}
    for (k, m), _ in PAPER_TABLE2[model].items():
      cand = planner.Evaluate(profile, device, k, m, True, 1, split_by='time')
      preds[(k, m)] = cand
    base = preds[(2, 1)].examples_per_s
    for (k, m), paper in PAPER_TABLE2[model].items():
      c = preds[(k, m)]
      records.append(
        dict(
          model=model,
          device=device.name,
          num_stages=k,
          num_micro_batches=m,
          batch_size=profile.batch_size,
          predicted_step_s=c.step_s,
          bubble=c.bubble,
          predicted_normalized=c.examples_per_s / base,
          paper_normalized=paper,
          ratio=c.examples_per_s / base / paper,
          peak_bytes_per_device=c.max_peak_bytes,
        )
      )
  lines = [
    f"The paper's Table 2 predicted on {device.name} ({device.description}), "
    'throughput normalized to K=2, M=1:',
    f'{"model":>18} {"K":>2} {"M":>3} {"predicted":>9} {"paper":>6} '
    f'{"ratio":>6} {"bubble":>6}',
  ]
  for r in records:
    lines.append(
      f'{r["model"]:>18} {r["num_stages"]:>2} {r["num_micro_batches"]:>3} '
      f'{r["predicted_normalized"]:>9.2f} {r["paper_normalized"]:>6.2f} '
      f'{r["ratio"]:>6.2f} {100 * r["bubble"]:>5.0f}%'
    )
  print('\n'.join(lines))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(records, f, indent=1)
    print(f'Wrote {args.json}')
  return records


def LargestTransformer(device, num_stages, memory_bytes, recompute=True):
  """The most Transformer layers (the paper's Table 1 model) whose
  predicted peak fits `memory_bytes` on every one of `num_stages` devices,
  over M in the divisors of the batch; (layers, M, peak bytes)."""
  layers, shapes = PaperTransformer(2)
  profile = planner.ProfileLayers(layers, shapes, name='transformer')
  first, block, last = profile.layers[0], profile.layers[1], profile.layers[-1]
  ms = [1] if not recompute else [1, 2, 4, 8, 16, 32]

  def Peak(num_blocks, m):
    prof = planner.ModelProfile(
      'transformer', [first] + [block] * num_blocks + [last], PAPER_BATCH
    )
    base, extra = divmod(num_blocks, num_stages)
    splits, end = [], 1
    for k in range(num_stages):
      end += base + (1 if k < extra else 0)
      splits.append(end)
    splits[-1] += 1  # the loss layer joins the last cell
    cells = planner.CellCosts(prof, splits, m, 1, device)
    return max(cost_model.PeakMemoryBytes(c, m, recompute, 2) for c in cells)

  best = (0, None, None)
  for m in ms:
    lo, hi = 0, num_stages
    if Peak(max(hi, 1), m) > memory_bytes:
      hi = 0
    else:
      while Peak(hi * 2, m) <= memory_bytes:
        hi *= 2
      lo, hi = hi, hi * 2
      while hi - lo > 1:
        mid = (lo + hi) // 2
        if Peak(mid, m) <= memory_bytes:
          lo = mid
        else:
          hi = mid
      hi = lo
    if hi > best[0]:
      best = (hi, m, Peak(hi, m))
  return best


def PaperTable1(args):
  device = device_presets.GetPreset(args.paper_device)
  memory = ParseBytes(args.memory_per_device) or 16 * GIB
  records = []
  rows = [('naive-1', 1, False, PAPER_TABLE1_NAIVE)] + [
    (f'pipeline-{k}', k, True, n) for k, n in PAPER_TABLE1_TRANSFORMER.items()
  ]
  for label, k, rc, paper in rows:
    n, m, peak = LargestTransformer(device, k, memory, recompute=rc)
    records.append(
      dict(
        config=label,
        num_stages=k,
        num_micro_batches=m,
        predicted_layers=n,
        paper_layers=paper,
        ratio=n / paper,
        peak_bytes_per_device=peak,
      )
    )
  print(
    f"The paper's Table 1 (largest Transformer, {planner.FormatBytes(memory)}"
    f' per {device.name}):'
  )
  print(f'{"config":>13} {"M":>3} {"predicted":>9} {"paper":>6} {"ratio":>6}')
  for r in records:
    print(
      f'{r["config"]:>13} {r["num_micro_batches"] or "-":>3} '
      f'{r["predicted_layers"]:>9} {r["paper_layers"]:>6} {r["ratio"]:>6.2f}'
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(records, f, indent=1)
    print(f'Wrote {args.json}')
  return records


def ParseArgs(argv):
  # The help ends with the module docstring's examples and notes (all but
  # its summary and the reason for its length).
  notes = __doc__.split('\n\n', 2)[2]
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog='examples:\n' + notes,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--model',
    default='',
    help='A registered model key (e.g. image.digits.MlpDigitsTiny: its '
    'first PipeliningLayer is planned, with the batch of its training '
    'input), or a built-in model: bench.transformer, bench.mlp, '
    "bench.conv, bench.amoebanet (benchmark_pipeline's models, sized by "
    '--num_blocks, --dim, --seq_len, --batch_size), paper.transformer48 '
    "or paper.amoebanet_d18_256 (the paper's Table 2 models).",
  )
  parser.add_argument('--num_devices', type=int, default=2)
  parser.add_argument(
    '--device',
    default='cpu',
    help=f'Preset ({", ".join(sorted(device_presets.PRESETS))}) or measure.',
  )
  parser.add_argument(
    '--memory_per_device',
    default='',
    help="e.g. 16GiB; default: the preset's (measure: 4 GiB).",
  )
  parser.add_argument('--num_stages', type=int, default=None, help='Fix K.')
  parser.add_argument(
    '--num_micro_batches', type=int, default=None, help='Fix M.'
  )
  parser.add_argument('--num_replicas', type=int, default=None, help='Fix R.')
  parser.add_argument(
    '--recompute', default='search', choices=['search', 'yes', 'no']
  )
  parser.add_argument(
    '--schedule',
    default='search',
    choices=['search', 'gpipe', '1f1b', 'interleaved'],
    help="Fix the schedule; 'search' predicts GPipe's fill-drain, 1F1B and "
    'the interleaved schedule (K cells on K/v devices, v = 2..4).',
  )
  parser.add_argument('--max_micro_batches', type=int, default=64)
  parser.add_argument(
    '--jit_compile',
    action='store_true',
    help='The cells are XLA-compiled (PipeliningLayer jit_compile): their '
    'backward holds one more copy of the gradients.',
  )
  parser.add_argument(
    '--optimizer_slots',
    type=int,
    default=None,
    help="Slots per weight (Adam 2, SGD 0); default: the model's.",
  )
  parser.add_argument('--top', type=int, default=10)
  parser.add_argument('--json', default='')
  parser.add_argument(
    '--timeline', default='', help='PNG of the best plan, predicted.'
  )
  parser.add_argument('--validate', default='', help='A benchmark JSON.')
  parser.add_argument(
    '--calibrate',
    action='store_true',
    help="--validate: take the flop rate from the JSON's one-device "
    'record instead of --device.',
  )
  parser.add_argument('--paper_table2', action='store_true')
  parser.add_argument('--paper_table1', action='store_true')
  parser.add_argument('--paper_device', default='tpu_v3')
  parser.add_argument(
    '--measure_budget_s',
    type=float,
    default=60.0,
    help='measure: bound on the per-layer timing.',
  )
  # bench.* models (tools/benchmark_pipeline.py's flags and defaults).
  parser.add_argument('--num_blocks', type=int, default=8)
  parser.add_argument('--dim', type=int, default=256)
  parser.add_argument('--seq_len', type=int, default=64)
  parser.add_argument('--batch_size', type=int, default=64)
  parser.add_argument(
    '--batch_size_override',
    type=int,
    default=None,
    help="Registered models: the batch size (default: the model's input).",
  )
  args = parser.parse_args(argv)
  if args.device != 'measure' and args.device not in device_presets.PRESETS:
    raise UserError(
      f'Unknown --device={args.device!r}; the presets are '
      f"{sorted(device_presets.PRESETS)}, or 'measure' to profile this host."
    )
  return args


def main(argv=None):
  try:
    args = ParseArgs(sys.argv[1:] if argv is None else argv)
    if args.device == 'measure':
      OneThread()
    if args.paper_table2:
      PaperTable2(args)
      return 0
    if args.paper_table1:
      PaperTable1(args)
      return 0
    if args.validate:
      Validate(args)
      return 0
    return RunPlan(args)
  except UserError as e:
    print(f'plan.py: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
