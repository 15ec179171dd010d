"""What the command-line tools share: one user-error type and the way a
tool reports it, one table printer, and the benchmark models with their
flags.

A tool raises `UserError` for bad input; `Main` prints it as one line,
`<tool>: error: <message>` (argparse's own form), and returns exit status
2. `FormatTable` right-aligns columns under a header and a rule. `MODELS`
are the small models that `benchmark_pipeline` times and `plan` plans as
`bench.<name>`, built from the flags that `AddModelArgs` defines. Importing
this module does not import TensorFlow (a model function does), so a
driver that runs its measurements in child processes stays small.
"""

import sys

MIB = 2**20
GIB = 2**30

__all__ = [
  'GIB',
  'MIB',
  'UserError',
  'Main',
  'FormatTable',
  'AddModelArgs',
  'MODELS',
  'TransformerModel',
  'MlpModel',
  'ConvModel',
  'AmoebaNetModel',
  'ParseBytes',
  'GetDevice',
  'OneThread',
]


class UserError(ValueError):
  """Bad input on a tool's command line: the message names the value and
  what to use instead."""


def Main(prog, run, argv=None):
  """`run(argv)`'s exit status; a `UserError` is printed as one line on
  stderr and gives 2."""
  try:
    return run(sys.argv[1:] if argv is None else argv)
  except UserError as e:
    print(f'{prog}: error: {e}', file=sys.stderr)
    return 2


def FormatTable(header, rows):
  """Columns right-aligned to their widest cell, two spaces apart, with a
  rule under the header. `rows`: lists of strings, one per column."""
  widths = [
    max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
    for i, h in enumerate(header)
  ]
  head = '  '.join(str(h).rjust(w) for h, w in zip(header, widths))
  lines = [head, '-' * len(head)]
  lines += ['  '.join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
  return '\n'.join(lines)


# ----------------------------------------------------------------------------
# The benchmark models: (layer Params list, input shape) from the flags.
# ----------------------------------------------------------------------------


def AddModelArgs(parser):
  """The flags of the `MODELS` (benchmark_pipeline's defaults)."""
  group = parser.add_argument_group('the benchmark models')
  group.add_argument('--num_blocks', type=int, default=8)
  group.add_argument('--dim', type=int, default=256)
  group.add_argument('--seq_len', type=int, default=64)
  group.add_argument('--batch_size', type=int, default=64)
  group.add_argument(
    '--amoebanet_filters',
    type=int,
    default=16,
    help='amoebanet: filters of the first cells (and the stem).',
  )
  group.add_argument(
    '--image_size',
    type=int,
    default=32,
    help='amoebanet: input height and width.',
  )
  return group


def TransformerModel(args):
  from lingvo_gpipe.layers import transformer  # pylint: disable=g-import-not-at-top

  d = args.dim
  blocks = [
    transformer.TransformerLayer.Params().Set(
      name=f'block_{i}',
      source_dim=d,
      hidden_dim=4 * d,
      num_attention_heads=max(1, d // 64),
    )
    for i in range(args.num_blocks)
  ]
  return blocks, [args.batch_size, args.seq_len, d]


def MlpModel(args):
  from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top

  d = args.dim * 4
  fcs = [
    layers.FCLayer.Params().Set(
      name=f'fc_{i}', input_dim=d, output_dim=d, activation='RELU'
    )
    for i in range(args.num_blocks)
  ]
  return fcs, [args.batch_size * args.seq_len, d]


def ConvModel(args):
  from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top

  c = max(16, args.dim // 4)
  convs = [
    layers.Conv2DLayer.Params().Set(
      name='conv_0',
      filter_shape=[3, 3, 3, c],
      filter_stride=[1, 1],
      activation='RELU',
    )
  ]
  convs += [
    layers.Conv2DLayer.Params().Set(
      name=f'conv_{i}',
      filter_shape=[3, 3, c, c],
      filter_stride=[1, 1],
      activation='RELU',
    )
    for i in range(1, args.num_blocks)
  ]
  return convs, [args.batch_size, 32, 32, 3]


def AmoebaNetModel(args):
  from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

  return amoebanet.BenchmarkCells(
    args.batch_size,
    filters=getattr(args, 'amoebanet_filters', None) or 16,
    image_size=getattr(args, 'image_size', None) or 32,
  )


MODELS = {
  'transformer': TransformerModel,
  'mlp': MlpModel,
  'conv': ConvModel,
  'amoebanet': AmoebaNetModel,
}


# ----------------------------------------------------------------------------
# Flags the planning tools share.
# ----------------------------------------------------------------------------


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


def GetDevice(args, profile=None, layers=None, link=None):
  """The device of --device: a preset, or 'measure' (this host's per-layer
  times of `profile`, --memory_per_device, the `link`)."""
  from lingvo_gpipe.planning import device_presets  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.planning import planner  # pylint: disable=g-import-not-at-top

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


def OneThread():
  """Time layers with one thread, as one benchmark worker runs them (only
  possible before TensorFlow starts; a process that already ran ops keeps
  its pools)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
  except RuntimeError:
    pass
