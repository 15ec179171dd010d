r"""The largest model whose full training step fits a memory budget per device.

The GPipe paper's Table 1, measured on this host:

  python tools/max_model_size.py --family=transformer --budget_mb=256 \
      --configs=naive-1,pipeline-1,pipeline-2,pipeline-4,pipeline-8 \
      --json=/tmp/capacity_transformer.json
  python tools/max_model_size.py --family=amoebanet --json=/tmp/amoeba.json

Configurations:
  naive-1     one device, no pipeline, no re-materialization;
  pipeline-1  one device, re-materialization, M micro-batches;
  pipeline-K  K devices, each its own TensorFlow server process, with
              re-materialization and M = max(8, 4K) micro-batches. The
              layers are split so that the fullest device holds the least
              (--balance_by=memory).

Every device is a worker process (`lingvo_gpipe.runners.tf_server`) that
counts its allocations and reports its own current and peak bytes
(`lingvo_gpipe.runners.device_memory`); this process only drives. A full
training step is the forward and backward pass and the Adam update with its
two slots. A model fits when the step succeeds and every device's peak is
within the budget. Each measurement runs in fresh processes, so one model's
memory never leaks into the next; a worker that dies (e.g. killed for
running out of memory) counts as "does not fit", and every process is
stopped on the way out, also on Ctrl-C.

The search: the smallest size first (a budget it does not fit is an error),
then sizes grown by a factor from a starting guess (the previous
configuration's result scaled by its devices) until one does not fit, then
bisection down to --precision. Every size reported was run.

Families (the paper's settings scaled down to a CPU host):
  transformer  Transformer-L (lingvo_gpipe.models.transformer_lm): token
               embedding, L Transformer layers, softmax; model dim 64, FFN
               256, 1 head, vocabulary 1024, 32 sequences of 32 tokens. The
               knob is L. (Paper: 2048, 8192, 32 heads, 32k, 32 x 1024.)
  amoebanet    AmoebaNet-D(L, D) on 16x16 images (CIFAR stem), batch 32. The
               knob is the filters D; L normal cells is 6 for K <= 2 and
               6 * K / 2 beyond, as the paper grew L (18, 36, 72) beyond
               K = 2.

--train_steps=N with --train_config=C --size=S trains one model for N steps
on a fixed batch and reports the loss and every device's peak per step.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

from lingvo_gpipe.core import quiet_start
from lingvo_gpipe.tools import capacity_trial
from lingvo_gpipe.tools import common
from lingvo_gpipe.tools.common import MIB

# The families the search grows (capacity_trial.py builds and trains them).
FAMILIES = capacity_trial.FAMILIES
FixedSettings = capacity_trial.FixedSettings
NumCells = capacity_trial.NumCells

DEFAULT_BUDGET_MB = {'transformer': 40, 'amoebanet': 64}
BALANCE_BY = ('memory', 'params', 'flops', 'uniform')
DEFAULT_CONFIGS = 'naive-1,pipeline-1,pipeline-2,pipeline-4,pipeline-8'


def ParseConfig(name):
  """'naive-1' | 'pipeline-K' -> dict(name, num_stages, num_micro_batches,
  recompute, pipeline)."""
  if name == 'naive-1':
    return dict(
      name=name,
      num_stages=1,
      num_micro_batches=1,
      recompute=False,
      pipeline=False,
    )
  if name.startswith('pipeline-'):
    try:
      k = int(name.split('-', 1)[1])
    except ValueError:
      k = 0
    if k >= 1:
      return dict(
        name=name,
        num_stages=k,
        num_micro_batches=max(8, 4 * k),
        recompute=True,
        pipeline=True,
      )
  raise common.UserError(
    f'Unknown configuration {name!r}: valid ones are naive-1 and '
    'pipeline-K for K >= 1 (e.g. pipeline-1, pipeline-2, pipeline-8).'
  )


# ----------------------------------------------------------------------------
# The search, in this process (no TensorFlow here).
# ----------------------------------------------------------------------------


class Searcher:
  """Runs trials in child processes and searches the largest size."""

  def __init__(self, args):
    self.args = args
    self.records = []
    self._child = None

  def Trial(self, family, config, size, steps=1):
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, 'trial.json')
      config = dict(
        config,
        balance_by=self.args.balance_by,
        jit_compile=bool(getattr(self.args, 'jit_compile', False)),
        micro_batch_loop=bool(getattr(self.args, 'micro_batch_loop', False)),
        share_layer_functions=bool(
          getattr(self.args, 'share_layer_functions', False)
        ),
      )
      spec = dict(
        family=family,
        config=config,
        size=size,
        budget_mb=self.args.budget_mb,
        steps=steps,
        out=out,
        intra_op_threads=self.args.intra_op_threads,
        inter_op_threads=self.args.inter_op_threads,
        device=self.args.device,
        fixed=FixedSettings(family, getattr(self.args, 'fixed', '')),
      )
      cmd = [
        sys.executable,
        '-m',
        'lingvo_gpipe.tools.max_model_size',
        f'--trial={json.dumps(spec)}',
      ]
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
      t0 = time.time()
      # Its own process group: Ctrl-C or a timeout stops it and its workers.
      self._child = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
      )
      try:
        _, err = self._child.communicate(timeout=self.args.trial_timeout_s)
        rc = self._child.returncode
      except subprocess.TimeoutExpired:
        self.Kill()
        rc, err = None, 'timed out'
      finally:
        self.Kill()
        self._child = None
      if os.path.exists(out):
        with open(out) as f:
          record = json.load(f)
      else:
        tail = (err or '').strip().splitlines()[-1:] or ['no output']
        record = dict(
          family=family,
          config=config['name'],
          num_stages=config['num_stages'],
          num_micro_batches=config['num_micro_batches'],
          size=size,
          fits=False,
          error=(
            'timed out' if rc is None else f'exit status {rc}: {tail[0][:300]}'
          ),
          budget_bytes=self.args.budget_mb * MIB,
        )
      record['trial_s'] = round(time.time() - t0, 1)
    self.records.append(record)
    _PrintTrial(record)
    return record

  def Kill(self):
    if self._child is not None and self._child.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self._child.pid, signal.SIGKILL)
      self._child.wait()
    elif self._child is not None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self._child.pid, signal.SIGKILL)

  def Search(self, family, config, guess, check_smallest=True):
    """The largest fitting record for `config` (None if the smallest fails)."""
    fam = FAMILIES[family]
    step, lo_size = fam['step'], fam['min_size']

    cap = self.args.max_size or None

    def Size(x):
      x = max(lo_size, int(round(x / step)) * step)
      return min(x, cap) if cap else x

    best, fail = None, None
    if check_smallest or guess <= lo_size:
      smallest = self.Trial(family, config, lo_size)
      if not smallest['fits']:
        return None, smallest
      best = smallest
    else:
      # Start at the guess; shrink until a size fits.
      size = Size(guess)
      while best is None:
        r = self.Trial(family, config, size)
        if r['fits']:
          best = r
        else:
          fail = r
          if size <= lo_size:
            return None, r
          size = Size(min(size - step, size / self.args.growth))
      guess = (
        (best['size'] + fail['size']) / 2
        if fail is not None
        else best['size'] * self.args.growth
      )
    size = Size(max(guess, lo_size))
    factor = self.args.growth
    while True:
      if cap and best['size'] >= cap:
        break
      if size <= best['size']:
        size = best['size'] + step
      if fail is not None and size >= fail['size']:
        break
      r = self.Trial(family, config, size)
      if r['fits']:
        best = r
        if fail is None:
          size = Size(size * factor)
      else:
        fail = r
      if fail is not None:
        # Bisect between best and fail.
        lo, hi = best['size'], fail['size']
        if hi - lo <= step or hi / lo <= 1 + self.args.precision:
          break
        size = Size((lo + hi) / 2)
        if size in (lo, hi):
          break
    return best, fail


def _PrintTrial(r):
  peaks = r.get('peak_bytes_per_device')
  peak = f'{max(peaks) / MIB:.0f} MiB max peak' if peaks else ''
  verdict = 'fits' if r['fits'] else f'does not fit ({r.get("error") or peak})'
  params = (
    f'{r["num_params"] / 1e6:.2f}M params, ' if r.get('num_params') else ''
  )
  print(
    f'  {r["config"]:>11} size {r["size"]:>4}: {params}{peak} -> '
    f'{verdict} [{r.get("trial_s", 0):.0f} s]',
    flush=True,
  )


def Table(rows, family):
  knob = FAMILIES[family]['knob']
  naive = next((r for r in rows if r['config'] == 'naive-1' and r), None)
  cols = [
    'config',
    'K',
    'M',
    'L' if family == 'amoebanet' else '-',
    knob,
    '# params',
    'param memory',
    'peak activation (max/device)',
    'peak (max/device)',
    'vs naive-1',
  ]
  lines = []
  for r in rows:
    ratio = f'{r["num_params"] / naive["num_params"]:.2f}x' if naive else '-'
    lines.append(
      [
        r['config'],
        str(r['num_stages']),
        str(r['num_micro_batches']),
        str(r.get('num_cells') or '-'),
        str(r['size']),
        f'{r["num_params"] / 1e6:.2f}M',
        f'{r["param_bytes"] / MIB:.1f} MiB',
        f'{r["peak_activation_bytes"] / MIB:.1f} MiB',
        f'{max(r["peak_bytes_per_device"]) / MIB:.1f} MiB',
        ratio,
      ]
    )
  return common.FormatTable(cols, lines)


def Breakdown(r):
  """Per-device lines: weights, slots, other state, step's activations."""
  lines = []
  for i, dev in enumerate(r['devices']):
    w = r['weight_bytes_per_device'][i]
    s = r['slot_bytes_per_device'][i]
    state = r['state_bytes_per_device'][i]
    peak = r['peak_bytes_per_device'][i]
    rss = r['rss_peak_minus_baseline_per_device'][i]
    lines.append(
      f'    device {i}: peak {peak / MIB:7.1f} MiB = weights {w / MIB:6.1f}'
      f' + Adam slots {s / MIB:6.1f}'
      f' + other held {max(0, state - w - s) / MIB:5.1f}'
      f' + step {(peak - state) / MIB:6.1f}   (RSS peak - baseline '
      f'{rss / MIB:6.1f})  [{dev.split("/")[3]}]'
    )
  return '\n'.join(lines)


def _Parser():
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__,
  )
  parser.add_argument(
    '--family', default='transformer', help=f'One of {", ".join(FAMILIES)}.'
  )
  parser.add_argument(
    '--budget_mb',
    type=float,
    default=0,
    help=f'Memory per device (MiB); default {DEFAULT_BUDGET_MB}.',
  )
  parser.add_argument('--configs', default=DEFAULT_CONFIGS)
  parser.add_argument('--json', default='', help='Write the records here.')
  parser.add_argument(
    '--precision',
    type=float,
    default=0.08,
    help='Stop bisecting when the bracket is this tight.',
  )
  parser.add_argument(
    '--growth',
    type=float,
    default=1.5,
    help='Growth factor of the size before bisection.',
  )
  parser.add_argument(
    '--max_size',
    type=int,
    default=0,
    help='Search no further than this size (0: no cap); '
    'a result at the cap is a lower bound.',
  )
  parser.add_argument(
    '--start_size',
    type=int,
    default=0,
    help="Start the first configuration's search at this size instead "
    'of at the smallest (0: the smallest first). A start that does not fit '
    'is shrunk by --growth until one fits.',
  )
  parser.add_argument(
    '--device',
    default='cpu',
    help='cpu: each device is a CPU worker process; gpu: K logical GPUs '
    "of this host's first GPU, each capped at 2x the budget + 64 MiB, "
    'read with get_memory_info.',
  )
  parser.add_argument('--trial_timeout_s', type=float, default=900)
  parser.add_argument(
    '--fixed',
    default='',
    help='Override fixed settings of the family, e.g. '
    'model_dim=128,hidden_dim=512,num_heads=2,vocab_size=2048,seq_len=64 '
    '(the Transformer table at 128 MiB in docs/capacity.md).',
  )
  parser.add_argument(
    '--balance_by',
    default='memory',
    help='How pipeline-K splits the layers into cells: memory (the '
    "largest device's estimated bytes, the default), params, flops or "
    'uniform.',
  )
  parser.add_argument(
    '--jit_compile',
    action='store_true',
    help='pipeline-K: XLA-compile each cell (PipeliningLayer jit_compile). '
    "The driver's graph then holds one call per cell and micro-batch "
    'instead of every op of every layer for every micro-batch: about 6x '
    'fewer ops, which is what lets 100+ layers at M=32 fit in the '
    "driver's host memory.",
  )
  parser.add_argument(
    '--micro_batch_loop',
    action='store_true',
    help='pipeline-K: build the fill-drain step as two loops over its '
    'clock ticks (PipeliningLayer micro_batch_loop): a deep pipeline '
    'reaches its first step sooner, so a trial takes less time '
    '(docs/benchmarks.md, "Weights and statistics packed through the '
    'loops").',
  )
  parser.add_argument(
    '--share_layer_functions',
    action='store_true',
    help='pipeline-K: identical layers as calls of one function '
    "(PipeliningLayer share_layer_functions='auto').",
  )
  parser.add_argument(
    '--inter_op_threads',
    type=int,
    default=2,
    help='Ops a worker runs at once (docs/capacity.md compares 1 and 2).',
  )
  parser.add_argument(
    '--intra_op_threads',
    type=int,
    default=0,
    help="Threads one op may use (0: TensorFlow's default).",
  )
  parser.add_argument(
    '--train_steps',
    type=int,
    default=0,
    help='Train --train_config at --size for this many '
    'steps instead of searching.',
  )
  parser.add_argument('--train_config', default='pipeline-1')
  parser.add_argument('--size', type=int, default=0)
  parser.add_argument('--trial', default='', help=argparse.SUPPRESS)
  return parser


def _CheckArgs(args):
  """Raises a UserError for bad flags; returns the parsed --configs."""
  if args.family not in FAMILIES:
    raise common.UserError(
      f'Unknown --family={args.family!r}: valid ones are {", ".join(FAMILIES)}.'
    )
  configs = [
    ParseConfig(c.strip()) for c in args.configs.split(',') if c.strip()
  ]
  if args.device not in ('cpu', 'gpu'):
    raise common.UserError(
      f'Unknown --device={args.device!r}: valid ones are cpu and gpu.'
    )
  if args.device == 'gpu' and not _HasGpu():
    raise common.UserError(
      '--device=gpu but TensorFlow finds no GPU on this host: run with '
      '--device=cpu (worker processes), or on a host with a GPU.'
    )
  if args.balance_by not in BALANCE_BY:
    raise common.UserError(
      f'Unknown --balance_by={args.balance_by!r}: valid ones are '
      f'{", ".join(BALANCE_BY)}.'
    )
  if not args.budget_mb:
    args.budget_mb = DEFAULT_BUDGET_MB[args.family]
  FixedSettings(args.family, args.fixed)  # validates --fixed
  if args.budget_mb <= 0:
    raise common.UserError(f'--budget_mb={args.budget_mb} must be > 0.')
  if args.train_steps and args.size <= 0:
    raise common.UserError(
      '--train_steps needs --size=N (the knob: '
      f'{FAMILIES[args.family]["knob"]}).'
    )
  return configs


def _Run(argv):
  args = _Parser().parse_args(argv)
  if args.trial:
    # A trial's process runs the model; the search's stays free of
    # TensorFlow (its checks answer at once).
    quiet_start.ImportTensorFlow(min_log_level='2')
    return capacity_trial.TrialMain(args.trial)
  configs = _CheckArgs(args)
  searcher = Searcher(args)
  try:
    if args.train_steps:
      return _Train(searcher, args)
    return _SearchAll(searcher, args, configs)
  except KeyboardInterrupt:
    print('Interrupted; workers stopped.', file=sys.stderr)
    return 130
  finally:
    searcher.Kill()


def main(argv=None):
  return common.Main('max_model_size', _Run, argv)


def _Train(searcher, args):
  config = ParseConfig(args.train_config)
  print(
    f'Training {args.family} {config["name"]} size {args.size} for '
    f'{args.train_steps} steps, budget {args.budget_mb:g} MiB per device:'
  )
  r = searcher.Trial(args.family, config, args.size, steps=args.train_steps)
  if r.get('losses'):
    print('  loss: ' + ' '.join(f'{x:.3f}' for x in r['losses']))
    peaks = r['peak_bytes_per_step']
    print(
      '  max peak per step (MiB): '
      + ' '.join(f'{max(p) / MIB:.0f}' for p in peaks)
    )
    print(Breakdown(r))
  ok = bool(r.get('losses')) and r['losses'][-1] < r['losses'][0] and r['fits']
  print(
    f'  driving process peak: {r.get("driver_peak_bytes", 0) / MIB:.1f} MiB'
  )
  print(
    f'  loss {"went down" if ok else "did NOT go down or did not fit"};'
    f' every peak within {args.budget_mb:g} MiB: {r["fits"]}'
  )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump([r], f, indent=1)
  return 0 if ok else 1


def _SearchAll(searcher, args, configs):
  print(
    f'{args.family}: largest model per configuration, budget '
    f'{args.budget_mb:g} MiB per device',
    flush=True,
  )
  results, prev = [], None
  fam = FAMILIES[args.family]
  for config in configs:
    if prev is None:
      guess = args.start_size or fam['start']
    elif args.family == 'transformer':
      guess = (
        prev['size']
        * config['num_stages']
        / prev['num_stages']
        * (1.0 if prev['config'] != 'naive-1' else 3.0)
      )
    else:  # params ~ D^2 * L: D grows ~ sqrt of the devices per cell
      guess = prev['size'] * math.sqrt(
        config['num_stages']
        * (prev['num_cells'] or 1)
        / (
          prev['num_stages']
          * (NumCells(args.family, config['num_stages']) or 1)
        )
      )
      if prev['config'] == 'naive-1':
        guess *= 1.8
    print(
      f'{config["name"]}: K={config["num_stages"]}, '
      f'M={config["num_micro_batches"]}, re-materialization '
      f'{"on" if config["recompute"] else "off"}',
      flush=True,
    )
    best, fail = searcher.Search(
      args.family,
      config,
      guess,
      check_smallest=prev is None and not args.start_size,
    )
    if best is None:
      print(
        f'max_model_size: the smallest {args.family} '
        f'({fam["knob"]}={fam["min_size"]}) does not fit '
        f'{args.budget_mb:g} MiB per device in {config["name"]} '
        f'({fail.get("error") or "peak over budget"}); raise --budget_mb.',
        file=sys.stderr,
      )
      if args.json:
        _WriteJson(args.json, searcher.records, results)
      return 1
    best = dict(
      best,
      largest=True,
      next_size_tried=fail and fail['size'],
      capped=bool(args.max_size and best['size'] >= args.max_size),
    )
    results.append(best)
    prev = best
    print(Breakdown(best), flush=True)
  print()
  print(Table(results, args.family))
  if args.json:
    _WriteJson(args.json, searcher.records, results)
  return 0


def _HasGpu():
  """Whether TensorFlow sees a GPU (asked in a child: this process stays
  free of TensorFlow)."""
  probe = (
    'import tensorflow as tf, sys; '
    "sys.exit(0 if tf.config.list_physical_devices('GPU') else 3)"
  )
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  try:
    rc = subprocess.run(
      [sys.executable, '-c', probe], env=env, capture_output=True, timeout=300
    ).returncode
  except subprocess.TimeoutExpired:
    return False
  return rc == 0


def _WriteJson(path, trials, results):
  with open(path, 'w') as f:
    json.dump(dict(largest=results, trials=trials), f, indent=1)


if __name__ == '__main__':
  sys.exit(main())
