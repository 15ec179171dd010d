r"""The largest model whose full training step fits a memory budget per device.

Over 500 lines: one command-line tool: the families, the search, the trial
child process and the records share one flag set.

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

MIB = 2**20

FAMILIES = {
  'transformer': dict(
    knob='num_layers',
    min_size=1,
    step=1,
    start=2,
    fixed=dict(
      model_dim=64,
      hidden_dim=256,
      num_heads=1,
      vocab_size=1024,
      seq_len=32,
      batch_size=32,
    ),
  ),
  'amoebanet': dict(
    knob='num_filters',
    min_size=8,
    step=8,
    start=32,
    fixed=dict(image_size=16, batch_size=32, num_classes=10, base_cells=6),
  ),
}
DEFAULT_BUDGET_MB = {'transformer': 40, 'amoebanet': 64}
BALANCE_BY = ('memory', 'params', 'flops', 'uniform')
DEFAULT_CONFIGS = 'naive-1,pipeline-1,pipeline-2,pipeline-4,pipeline-8'


class UsageError(ValueError):
  """Bad flags: the message says which and what is valid."""


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
  raise UsageError(
    f'Unknown configuration {name!r}: valid ones are naive-1 and '
    'pipeline-K for K >= 1 (e.g. pipeline-1, pipeline-2, pipeline-8).'
  )


def NumCells(family, num_stages):
  base = FAMILIES['amoebanet']['fixed']['base_cells']
  if family != 'amoebanet':
    return None
  return base * max(1, num_stages // 2)


# ----------------------------------------------------------------------------
# One measurement, in a fresh process (run with --trial=JSON).
# ----------------------------------------------------------------------------


def FixedSettings(family, overrides=''):
  """The family's fixed settings with `overrides` ('name=int,...') applied."""
  fixed = dict(FAMILIES[family]['fixed'])
  for item in (x.strip() for x in overrides.split(',')):
    if not item:
      continue
    name, _, value = item.partition('=')
    name = name.strip()
    if name not in fixed:
      raise UsageError(
        f'Unknown --fixed setting {name!r} for {family}: valid ones are '
        f'{", ".join(sorted(fixed))}.'
      )
    try:
      fixed[name] = int(value)
    except ValueError:
      raise UsageError(
        f'--fixed {name}={value!r} is not an integer; write e.g. '
        f'{name}={fixed[name]}.'
      ) from None
  return fixed


def _BuildModel(family, size, config, devices, fixed=None):
  """(layer, step fn building inputs on devices[0], num_params)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top

  f = fixed or FAMILIES[family]['fixed']
  k = config['num_stages']
  if family == 'transformer':
    from lingvo_gpipe.models import transformer_lm  # pylint: disable=g-import-not-at-top

    layer_params = transformer_lm.LayerParams(
      num_layers=size,
      model_dim=f['model_dim'],
      hidden_dim=f['hidden_dim'],
      num_heads=f['num_heads'],
      vocab_size=f['vocab_size'],
    )

    def Inputs():
      ids = tf.random.stateless_uniform(
        [f['batch_size'], f['seq_len']],
        [7, 11],
        maxval=f['vocab_size'],
        dtype=tf.int32,
      )
      return (ids, ids), None  # the copy task: labels are the inputs

    ids_spec = tf.TensorSpec([f['batch_size'], f['seq_len']], tf.int32)
    input_shapes = [ids_spec, ids_spec]
  else:
    from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

    net = (
      amoebanet.AmoebaNet.Params()
      .Set(
        num_cells=NumCells(family, k),
        num_filters=size,
        image_size=f['image_size'],
        stem_type='cifar',
        stem_filters=size,
        num_classes=f['num_classes'],
        head_logits=True,
      )
      .Instantiate()
    )
    layer_params = net.Layers()

    def Inputs():
      s = f['image_size']
      images = tf.random.stateless_normal([f['batch_size'], s, s, 3], [7, 11])
      labels = tf.random.stateless_uniform(
        [f['batch_size']], [3, 5], maxval=f['num_classes'], dtype=tf.int32
      )
      return (images,), labels

    s = f['image_size']
    input_shapes = [[f['batch_size'], s, s, 3]]

  if config['pipeline']:
    layer = (
      gpipe.PipeliningLayer.Params()
      .Set(
        name='model',
        layers=layer_params,
        num_stages=k,
        num_micro_batches=config['num_micro_batches'],
        devices=devices[:k],
        recompute='always',
        balance_by=config.get('balance_by', 'memory'),
        input_shapes=input_shapes,
        jit_compile=bool(config.get('jit_compile')),
      )
      .Instantiate()
    )
  else:
    with tf.device(devices[0]):
      layer = (
        layers.SequentialLayer.Params()
        .Set(name='model', sub=layer_params)
        .Instantiate()
      )
  return layer, Inputs


def _DeviceBytes(variables):
  out = {}
  for v in variables:
    out[v.device] = out.get(v.device, 0) + v.shape.num_elements() * v.dtype.size
  return out


def RunTrial(spec):
  """Measures one (family, config, size); returns a JSON-able dict."""
  family, config, size = spec['family'], spec['config'], spec['size']
  k = config['num_stages']
  from lingvo_gpipe.runners import device_memory  # pylint: disable=g-import-not-at-top

  device_memory.EnableCpuStats()  # this driver's own, to check it holds nothing
  from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top

  limit = int(spec['budget_mb'] * spec.get('hard_limit_factor', 2.0)) + 64
  on_gpu = spec.get('device', 'cpu') == 'gpu'
  if on_gpu:
    # K logical GPUs of one physical GPU, each capped at the limit; their
    # allocators are separate, so get_memory_info is per device.
    cluster.SplitGpu(k, memory_limit_mb=limit)
    context = contextlib.nullcontext(None)
  else:
    context = cluster.LocalCluster(
      k,
      memory_stats=True,
      memory_limit_mb=limit,
      intra_op_threads=spec.get('intra_op_threads', 0),
      inter_op_threads=spec.get('inter_op_threads', 2),
    )
  with context as c:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from lingvo_gpipe.core import optimizer  # pylint: disable=g-import-not-at-top
    from lingvo_gpipe.core import py_utils  # pylint: disable=g-import-not-at-top

    # The workers run this process's functions with the thread pools its
    # config asks for (the config travels with the connection).
    tf.config.threading.set_inter_op_parallelism_threads(
      spec.get('inter_op_threads', 2)
    )
    tf.config.threading.set_intra_op_parallelism_threads(
      spec.get('intra_op_threads', 0)
    )
    if on_gpu:
      devices = [
        f'/job:localhost/replica:0/task:0/device:GPU:{i}' for i in range(k)
      ]
      status = {}
    else:
      cluster.Connect(c.cluster_spec)
      devices = c.devices
      status = device_memory.StatusMap(devices, c.status_addresses)
    record = dict(
      family=family,
      config=config['name'],
      balance_by=config.get('balance_by'),
      jit_compile=bool(config.get('jit_compile')),
      num_stages=k,
      num_micro_batches=config['num_micro_batches'],
      recompute=config['recompute'],
      size=size,
      knob=FAMILIES[family]['knob'],
      fixed=dict(spec.get('fixed') or FAMILIES[family]['fixed']),
      num_cells=NumCells(family, k),
      budget_bytes=spec['budget_mb'] * MIB,
      devices=devices,
      inter_op_threads=spec.get('inter_op_threads', 2),
      intra_op_threads=spec.get('intra_op_threads', 0),
    )
    try:
      layer, inputs_fn = _BuildModel(
        family, size, config, devices, record['fixed']
      )
      record['splits'] = getattr(layer, 'splits', None)
      variables = layer.trainable_variables
      record['num_params'] = int(sum(v.shape.num_elements() for v in variables))
      record['param_bytes'] = int(
        sum(v.shape.num_elements() * v.dtype.size for v in variables)
      )
      opt = optimizer.Adam.Params().Instantiate()
      opt.CreateSlots(variables)
      first, last = devices[0], devices[k - 1]
      plain_scope = None if config['pipeline'] else first

      @tf.function
      def Step():
        with tf.device(first):
          args, labels = inputs_fn()
        with py_utils.UpdateCollector() as updates:
          with tf.GradientTape() as tape:
            with tf.device(plain_scope):
              out = layer(*args)
            with tf.device(last):
              if labels is None:
                loss = tf.reduce_mean(out)
              else:
                loss = tf.reduce_mean(
                  tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=out
                  )
                )
          with tf.device(last):  # the loss gradient next to the loss
            grads = tape.gradient(loss, variables)
        with tf.device(last):
          opt.Apply(
            tf.constant(spec.get('learning_rate', 1e-3)),
            list(zip(grads, variables)),
          )
        updates.Apply()
        return loss

      weights = _DeviceBytes(variables)
      slots = _DeviceBytes(list(opt.slots().values()))
      losses, peaks = [], []
      start = time.time()
      losses.append(float(Step().numpy()))  # traces; slots already exist
      record['first_step_s'] = time.time() - start
      before = device_memory.DeviceMemory(devices, status)
      here = '/job:localhost/replica:0/task:0/device:CPU:0'
      for _ in range(max(1, spec.get('steps', 1))):
        device_memory.ResetPeaks(devices + [here], status)
        t0 = time.time()
        losses.append(float(Step().numpy()))
        record['step_s'] = time.time() - t0
        peaks.append(
          [p for _, p in device_memory.DeviceMemory(devices, status).values()]
        )
      # What ran in this driving process instead of on a device (should be
      # nothing but the step's scalars).
      record['driver_peak_bytes'] = device_memory.DeviceMemory([here])[here][1]
      details = device_memory.DeviceDetails(devices, status)
      record['losses'] = losses
      record['peak_bytes_per_step'] = peaks
      record['peak_bytes_per_device'] = [
        max(p[i] for p in peaks) for i in range(k)
      ]
      record['state_bytes_per_device'] = [before[d][0] for d in devices]
      record['weight_bytes_per_device'] = [weights.get(d, 0) for d in devices]
      record['slot_bytes_per_device'] = [slots.get(d, 0) for d in devices]
      record['rss_peak_minus_baseline_per_device'] = [
        details[d]['rss_peak'] - (details[d]['rss_baseline'] or 0)
        for d in devices
      ]
      record['peak_activation_bytes'] = max(
        p - s
        for p, s in zip(
          record['peak_bytes_per_device'], record['state_bytes_per_device']
        )
      )
      record['fits'] = (
        max(record['peak_bytes_per_device']) <= (record['budget_bytes'])
      )
      record['error'] = None
    except (
      tf.errors.ResourceExhaustedError,
      tf.errors.UnavailableError,
      tf.errors.InternalError,
      tf.errors.AbortedError,
      tf.errors.CancelledError,
      device_memory.MemoryStatsUnavailable,
    ) as e:
      dead = [] if c is None else [i for i, a in enumerate(c.Alive()) if not a]
      reason = (
        f'worker(s) {dead} died'
        if dead
        else 'out of memory'
        if isinstance(e, tf.errors.ResourceExhaustedError)
        else type(e).__name__
      )
      record['fits'] = False
      record['error'] = reason
    return record


def _TrialMain(spec_json):
  spec = json.loads(spec_json)
  record = RunTrial(spec)
  with open(spec['out'], 'w') as f:
    json.dump(record, f)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown)


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
  widths = [
    max(len(c), *(len(l[i]) for l in lines)) if lines else len(c)
    for i, c in enumerate(cols)
  ]
  out = ['  '.join(c.rjust(w) for c, w in zip(cols, widths))]
  out.append('-' * len(out[0]))
  out += ['  '.join(v.rjust(w) for v, w in zip(l, widths)) for l in lines]
  return '\n'.join(out)


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


def main(argv=None):
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
  args = parser.parse_args(argv)
  if args.trial:
    # A trial's process runs the model; the search's stays free of
    # TensorFlow (its checks answer at once).
    quiet_start.ImportTensorFlow(min_log_level='2')
    return _TrialMain(args.trial)
  try:
    if args.family not in FAMILIES:
      raise UsageError(
        f'Unknown --family={args.family!r}: valid ones are '
        f'{", ".join(FAMILIES)}.'
      )
    configs = [
      ParseConfig(c.strip()) for c in args.configs.split(',') if c.strip()
    ]
    if args.device not in ('cpu', 'gpu'):
      raise UsageError(
        f'Unknown --device={args.device!r}: valid ones are cpu and gpu.'
      )
    if args.device == 'gpu' and not _HasGpu():
      raise UsageError(
        '--device=gpu but TensorFlow finds no GPU on this host: run with '
        '--device=cpu (worker processes), or on a host with a GPU.'
      )
    if args.balance_by not in BALANCE_BY:
      raise UsageError(
        f'Unknown --balance_by={args.balance_by!r}: valid ones are '
        f'{", ".join(BALANCE_BY)}.'
      )
    if not args.budget_mb:
      args.budget_mb = DEFAULT_BUDGET_MB[args.family]
    FixedSettings(args.family, args.fixed)  # validates --fixed
    if args.budget_mb <= 0:
      raise UsageError(f'--budget_mb={args.budget_mb} must be > 0.')
    if args.train_steps and args.size <= 0:
      raise UsageError(
        '--train_steps needs --size=N (the knob: '
        f'{FAMILIES[args.family]["knob"]}).'
      )
  except UsageError as e:
    print(f'max_model_size: {e}', file=sys.stderr)
    return 2
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
