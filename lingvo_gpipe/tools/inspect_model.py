r"""Sizes up a registered model without allocating a single weight.

  python tools/inspect_model.py --model=image.amoebanet.AmoebaNetD72x512
  python tools/inspect_model.py --model=image.digits.MlpDigitsTiny \
      --json=/tmp/mlp.json
  python tools/inspect_model.py --model=image.digits.MlpDigitsTiny \
      --worker_split_size=3 \
      --model_params_override='task.network.balance_by : params'

Prints the total number of parameters, the pipeline's cells with their
parameters, cost (FPropMeta flops per example, or parameters when the
pipeline has no input_shapes) and imbalance (`balance.MakeReport`), and the
memory the weights and the optimizer's slots take. Everything is computed
from abstractly built layers (`base_layer.AbstractBuild`): shapes only, so
a 2-billion-parameter model is inspected on a laptop.

The PipeliningLayer is found in the model Params tree; a model without one
is reported as a single cell. The split is the one the pipeline would
choose (`partition.ComputeSplits`, with 'time' balancing replaced by flops:
timing would allocate the layers).

--json writes {model, num_params, num_trainable_params, num_stages,
balance_by, splits, imbalance, efficiency, weight_bytes, slot_bytes,
memory_bytes, optimizer, cells: [{index, layers, params, flops,
weight_bytes, slot_bytes}], pipelines: [...]}.
"""

import argparse
import json
import sys

# pylint: disable=g-import-not-at-top
from lingvo_gpipe.core import quiet_start

quiet_start.ImportTensorFlow(min_log_level='2')

from lingvo_gpipe import model_registry
from lingvo_gpipe import trainer_params
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.planning import balance
from lingvo_gpipe.planning import partition
# pylint: enable=g-import-not-at-top

__all__ = ['ApplyOverrides', 'FindPipelines', 'Inspect', 'main']


def FindPipelines(p):
  """[(key, Params)] of the outermost PipeliningLayers in model Params."""
  return trainer_params.PipelineLayers(p, outermost=True)


def _Variables(p):
  """{name: AbstractVariable} of a layer (or model) built abstractly."""
  p = p.Copy()
  if not p.name:
    p.name = 'inspect'
  with base_layer.AbstractBuild(), base_layer.DetachedBuild():
    return p.Instantiate().VariablesByName()


def _Optimizer(model_p):
  """The optimizer (no variables) of the model's task, or None."""
  try:
    tp = model_p.task.train
    op = tp.learner.optimizer if tp.learner is not None else tp.optimizer
    return op.Instantiate()
  except (AttributeError, KeyError, TypeError, ValueError):
    return None


def _SlotElements(optimizer, var):
  """Number of optimizer-slot elements for variable `var`."""
  if optimizer is None or not var.trainable:
    return 0
  specs = optimizer.SlotSpecs(var)
  total = 0
  for spec in specs:
    n = 1
    for d in spec[1]:
      n *= int(d)
    total += n
  return total


class _Stats:
  """Parameters, weight and slot bytes of a set of variables."""

  def __init__(self, variables, optimizer):
    self.params = self.trainable = self.weight_bytes = self.slot_bytes = 0
    for v in variables.values():
      n = int(v.shape.num_elements())
      size = v.dtype.base_dtype.size
      self.params += n
      self.trainable += n if v.trainable else 0
      self.weight_bytes += n * size
      self.slot_bytes += _SlotElements(optimizer, v) * size


def _LayerStats(layers, optimizer):
  """_Stats of each layer Params, building each distinct layer once."""
  cache, out = {}, []
  for i, lp in enumerate(layers):
    lp = lp.Copy()
    lp.name = lp.name or f'layer_{i}'
    key = lp.Copy().Set(name='x').ToText()
    if key not in cache:
      cache[key] = _Stats(_Variables(lp), optimizer)
    out.append(cache[key])
  return out


def _InspectPipeline(key, pp, optimizer):
  """A dict describing one pipeline's cells."""
  layers = list(pp.layers) if pp.layers else pp.cls.CellParams(pp)
  layers = [
    lp.Copy().Set(name=lp.name or f'layer_{i}') for i, lp in enumerate(layers)
  ]
  shapes = pp.input_shapes
  flops = None
  if shapes is not None:
    flops = [int(m[0]) for m in partition.LayerMetas(layers, *shapes)]
  stats = _LayerStats(layers, optimizer)
  if pp.layers:
    by = pp.balance_by
    if by in ('auto', 'time'):
      by = 'flops' if shapes is not None else 'params'
    num_stages = pp.num_stages or (len(pp.devices) if pp.devices else 1)
    splits = partition.ComputeSplits(layers, num_stages, pp.splits, by, shapes)
  else:
    by = 'flops' if shapes is not None else 'params'
    splits = list(range(1, len(layers) + 1))
  costs = flops if by == 'flops' else [s.params for s in stats]
  if by == 'uniform':
    costs = [1.0] * len(layers)
  report = balance.MakeReport(
    [float(c) for c in costs],
    splits,
    params=[s.params for s in stats],
    names=[lp.name for lp in layers],
  )
  cells = []
  for c in report.cells:
    cells.append(
      {
        'index': c.index,
        'layers': c.names,
        'params': c.params,
        'flops': sum(flops[c.start : c.end]) if flops is not None else None,
        'cost': c.cost,
        'weight_bytes': sum(s.weight_bytes for s in stats[c.start : c.end]),
        'slot_bytes': sum(s.slot_bytes for s in stats[c.start : c.end]),
      }
    )
  return {
    'key': key,
    'num_stages': report.num_stages,
    'splits': report.splits,
    'balance_by': by,
    'num_micro_batches': pp.num_micro_batches,
    'imbalance': report.imbalance,
    'efficiency': report.efficiency,
    'cells': cells,
    'report': report.ToText(),
  }


def ApplyOverrides(p, overrides=None, worker_split_size=None):
  """Applies "a.b : value" lines (a list or ";"-separated) and a number of
  stages K to every flat-`layers` pipeline of model Params `p`, in place, as
  the trainer's --model_params_override and --worker_split_size do (no
  devices needed)."""
  if isinstance(overrides, str):
    overrides = [overrides]
  lines = []
  for chunk in overrides or []:
    lines.extend(chunk.replace(';', '\n').split('\n'))
  text = '\n'.join(lines)
  if text.strip():
    p.FromText(text)
  if worker_split_size:
    for key, pp in FindPipelines(p):
      if pp.cell_tpl:
        if len(pp.cell_tpl) != worker_split_size:
          raise ValueError(
            f'--worker_split_size={worker_split_size}: the pipeline at '
            f'{key} has {len(pp.cell_tpl)} fixed cells (cell_tpl); give it '
            'a flat `layers` list to let the library re-split it.'
          )
        continue
      pp.num_stages = worker_split_size
      pp.devices = None
      if isinstance(pp.splits, int) or (
        pp.splits is not None and len(pp.splits) != worker_split_size
      ):
        pp.splits = None
  return p


def Inspect(model_key, dataset='Train', overrides=None, worker_split_size=None):
  """A dict describing `model_key` (see the module docstring), after
  `ApplyOverrides(p, overrides, worker_split_size)`."""
  p = model_registry.GetParams(model_key, dataset)
  ApplyOverrides(p, overrides, worker_split_size)
  optimizer = _Optimizer(p)
  total = _Stats(_Variables(p), optimizer)
  pipelines = [_InspectPipeline(k, pp, optimizer) for k, pp in FindPipelines(p)]
  if pipelines:
    main_pipe = pipelines[0]
  else:
    main_pipe = {
      'key': None,
      'num_stages': 1,
      'splits': [1],
      'balance_by': None,
      'num_micro_batches': 1,
      'imbalance': 1.0,
      'efficiency': 1.0,
      'cells': [
        {
          'index': 0,
          'layers': [p.task.name],
          'params': total.params,
          'flops': None,
          'cost': None,
          'weight_bytes': total.weight_bytes,
          'slot_bytes': total.slot_bytes,
        }
      ],
      'report': 'No PipeliningLayer: the model is one cell.',
    }
  return {
    'model': model_key,
    'num_params': total.params,
    'num_trainable_params': total.trainable,
    'num_stages': main_pipe['num_stages'],
    'balance_by': main_pipe['balance_by'],
    'splits': main_pipe['splits'],
    'imbalance': main_pipe['imbalance'],
    'efficiency': main_pipe['efficiency'],
    'weight_bytes': total.weight_bytes,
    'slot_bytes': total.slot_bytes,
    'memory_bytes': total.weight_bytes + total.slot_bytes,
    'optimizer': type(optimizer).__name__ if optimizer else None,
    'cells': main_pipe['cells'],
    'pipelines': pipelines,
  }


def _Bytes(n):
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if n < 1024 or unit == 'TiB':
      return f'{n:.1f} {unit}' if unit != 'B' else f'{n} B'
    n /= 1024.0
  return str(n)


def _Count(n):
  for div, unit in ((1e9, 'B'), (1e6, 'M'), (1e3, 'K')):
    if n >= div:
      return f'{n / div:.2f}{unit}'
  return str(n)


def Text(info):
  """The human-readable report of `Inspect`'s dict."""
  lines = [
    f'Model {info["model"]} (abstract build: no weight allocated)',
    f'  parameters: {info["num_params"]:,} ({_Count(info["num_params"])}); '
    f'trainable {info["num_trainable_params"]:,}',
    f'  weight memory: weights {_Bytes(info["weight_bytes"])} + '
    f'{info["optimizer"] or "no"} optimizer slots '
    f'{_Bytes(info["slot_bytes"])} = {_Bytes(info["memory_bytes"])}',
  ]
  pipes = info['pipelines']
  if not pipes:
    lines.append('  No PipeliningLayer: the model is one cell.')
  for pipe in pipes:
    lines.append(
      f'Pipeline {pipe["key"]}: {pipe["num_stages"]} cells, '
      f'{pipe["num_micro_batches"]} micro-batches, balanced by '
      f'{pipe["balance_by"]}; imbalance (max/mean cost) '
      f'{pipe["imbalance"]:.3f}'
    )
    lines.append(pipe['report'])
    lines.append('cell  params          flops/example     weights+slots')
    for c in pipe['cells']:
      flops = f'{c["flops"]:.4g}' if c['flops'] is not None else '-'
      lines.append(
        f'{c["index"]:>4}  {c["params"]:<14,}  {flops:<16}  '
        f'{_Bytes(c["weight_bytes"] + c["slot_bytes"])}'
      )
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--model',
    required=True,
    help='Registered model key, e.g. image.amoebanet.AmoebaNetD72x512.',
  )
  parser.add_argument(
    '--dataset',
    default='Train',
    help="Which dataset's model Params (default Train).",
  )
  parser.add_argument(
    '--model_params_override',
    action='append',
    default=[],
    help='"a.b.c : value" lines applied to the model Params, as for the '
    'trainer (repeat the flag or separate lines with ";"), e.g. '
    '"task.network.balance_by : params".',
  )
  parser.add_argument(
    '--worker_split_size',
    type=int,
    default=None,
    help='Preview the split into this many cells (as the trainer flag).',
  )
  parser.add_argument('--json', default='', help='Also write the report here.')
  args = parser.parse_args(argv)
  if args.worker_split_size is not None and args.worker_split_size < 1:
    parser.error(f'--worker_split_size={args.worker_split_size} must be >= 1.')
  try:
    info = Inspect(
      args.model,
      args.dataset,
      args.model_params_override,
      args.worker_split_size,
    )
  except KeyError as e:
    print(f'ERROR: {e.args[0] if e.args else e}', file=sys.stderr)
    return 1
  except (AttributeError, ValueError) as e:
    print(f'ERROR: {e}', file=sys.stderr)
    return 1
  print(Text(info))
  if args.json:
    out = {k: v for k, v in info.items()}
    out['pipelines'] = [
      {k: v for k, v in pipe.items() if k != 'report'}
      for pipe in info['pipelines']
    ]
    with open(args.json, 'w') as f:
      json.dump(out, f, indent=1)
    print(f'Wrote {args.json}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
