r"""Plans a GPipe pipeline: K, M, replicas, split and re-materialization.

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
bench.<transformer|mlp|conv|amoebanet> (the benchmark's models in
tools/common.py, sized by --num_blocks, --dim, --seq_len, --batch_size),
paper.transformer48 and paper.amoebanet_d18_256 (the paper's Table 2
models). The model is built abstractly: no weight is allocated.

--device is a preset (tpu_v2, tpu_v3, v100, a100, h100, cpu) or `measure`:
this host's per-layer times (one thread, like one benchmark worker) and the
link between two local TensorFlow server workers.

--validate=BENCH_JSON predicts every configuration of a
tools/benchmark_pipeline.py JSON and prints predicted and measured step
time (and peak bytes per device where the JSON has them) with their ratio
(plan_validation.py). --paper_table2 and --paper_table1 predict the paper's
tables (plan_paper.py).
"""

import argparse
import json
import os
import sys

from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

quiet_start.ImportTensorFlow(min_log_level='2')


from lingvo_gpipe import model_registry  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.planning import device_presets  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.planning import planner  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import common  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import plan_paper  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import plan_validation  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools.common import GetDevice  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools.common import OneThread  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools.common import ParseBytes  # pylint: disable=g-import-not-at-top


UserError = common.UserError


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
    if name not in common.MODELS:
      raise UserError(
        f'--model={key}: the benchmark models are '
        f'{["bench." + m for m in common.MODELS]}.'
      )
    layers, shape = common.MODELS[name](args)
    return key, layers, [shape], 2
  if key == 'paper.transformer48':
    layers, shapes = plan_paper.PaperTransformer(48)
    return key, layers, shapes, 2
  if key == 'paper.amoebanet_d18_256':
    layers, shapes = plan_paper.PaperAmoebaNet()
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


def ParseArgs(argv):
  # The help ends with the module docstring's examples and notes (all but
  # its summary).
  notes = __doc__.split('\n\n', 1)[1]
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
  common.AddModelArgs(parser)  # bench.*: benchmark_pipeline's models
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


def _Run(argv):
  args = ParseArgs(argv)
  if args.device == 'measure':
    OneThread()
  if args.paper_table2:
    plan_paper.PaperTable2(args)
  elif args.paper_table1:
    plan_paper.PaperTable1(args)
  elif args.validate:
    plan_validation.Validate(args)
  else:
    return RunPlan(args)
  return 0


def main(argv=None):
  return common.Main('plan', _Run, argv)


if __name__ == '__main__':
  sys.exit(main())
