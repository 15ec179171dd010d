r"""Benchmarks the GPipe pipeline: step time, throughput, memory, schedule.

  python tools/benchmark_pipeline.py --mode=multi_process --json=/tmp/b.json
  python tools/benchmark_pipeline.py --mode=in_process --model=transformer
  python tools/benchmark_pipeline.py --trace=/tmp/trace   # timeline PNG+JSON
  python tools/benchmark_pipeline.py --schedules=gpipe,1f1b,interleaved \
      --configs=2x4x1,2x16x1 --memory=1 --trace=/tmp/trace

A device stands for an accelerator, which runs one op at a time. In one
process, virtual CPU devices share one thread pool, so TensorFlow's inter-op
parallelism, not the pipeline, could make K=2 look fast. Speed therefore comes
from --mode=multi_process: every device is its own TensorFlow server process on
127.0.0.1 with one intra- and one inter-op thread, driven through TensorFlow's
distributed runtime; the plain baseline runs on one such process.
--mode=in_process (virtual CPU devices, one thread each) reports overhead and
memory (`tf.config.experimental.get_memory_info`).

--jit_compile=1 compiles each cell with XLA (PipeliningLayer.jit_compile;
the plain model's forward likewise); --jit_compile=both gives rows with and
without it, each normalized to the plain model and K=2, M=1 of its own kind.

Configurations (per model): the plain model without the pipeline (stages 0),
K=1 M=1, K=1 M=8 with recompute, K=2 with M in {1, 2, 4, 8, 16}, and R=2
data-parallel replicas of K=1 (one per worker, the same global batch). Beside
each: the ideal speedup K*M/(M+K-1) and the throughput normalized to K=2, M=1
as in the paper's Table 2. Configurations are run interleaved, round by round,
and the median step time over rounds is reported (the machine is noisy).

multi_process also reports the TCP bytes the worker processes send per step
(from `ss -tinp`): to each other (`bytes_between_workers_per_step`: the
tensors a pipeline or the replicas exchange) and to this driving process
(`bytes_to_driver_per_step`: replies and step control).

--schedules runs every pipelined configuration with each schedule (records
carry a `schedule` field; `--trace` draws one timeline per schedule). '1f1b'
computes each micro-batch's share of the loss on the last cell
(`PipeliningLayer.FPropWithLoss`). 'interleaved' puts --virtual_stages cells
on each of the configuration's K devices (cell k on device k mod K), so its
rows have K * virtual_stages cells (`num_cells`) on K devices.

Progress goes to stderr (stdout holds only the table and the notes): a line
at each phase (building, warming up, timing) and, within one, at most one
every --progress_every_s seconds, e.g. "[  42.0 s] transformer: K=2 M=8:
step 3/5".
"""

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from lingvo_gpipe.runners import device_memory  # pylint: disable=g-import-not-at-top


def _WantsCpuStats(argv):
  """in_process always measures memory; multi_process with --memory=1."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument('--mode', default='multi_process')
  pre.add_argument('--memory', type=int, default=0)
  known, _ = pre.parse_known_args(argv)
  return known.mode == 'in_process' or bool(known.memory)


if __name__ == '__main__' and _WantsCpuStats(sys.argv[1:]):
  # CPU allocator statistics must be switched on before the first op.
  device_memory.EnableCpuStats()

from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

quiet_start.ImportTensorFlow(min_log_level='2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.pipeline import schedule  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.pipeline import timeline  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import common  # pylint: disable=g-import-not-at-top

# (K, M, recompute, R); K=0: the plain model without the pipeline; R:
# data-parallel replicas (M micro-batches each).
DEFAULT_CONFIGS = [
  (0, 1, False, 1),
  (1, 1, False, 1),
  (1, 8, True, 1),
  (2, 1, False, 1),
  (2, 2, False, 1),
  (2, 4, False, 1),
  (2, 8, False, 1),
  (2, 16, False, 1),
  (2, 8, True, 1),
  (1, 1, False, 2),
]


# The models: tools/common.py (plan.py plans them as bench.<name>).
MODELS = common.MODELS


# ----------------------------------------------------------------------------
# One configuration.
# ----------------------------------------------------------------------------


class Bench:
  """A built model plus its compiled training step."""

  def __init__(
    self,
    model_name,
    args,
    num_stages,
    num_mb,
    recompute,
    devices,
    tracer=None,
    num_replicas=1,
    jit_compile=False,
    schedule_name='gpipe',
  ):
    self.key = (
      model_name,
      num_stages,
      num_mb,
      recompute,
      num_replicas,
      jit_compile,
      schedule_name,
    )
    layer_params, self.input_shape = MODELS[model_name](args)
    self.devices = devices[: max(1, num_stages) * num_replicas]
    self.num_cells = num_stages
    if schedule_name == 'interleaved':
      self.num_cells = num_stages * args.virtual_stages
    if num_stages == 0:
      with tf.device(devices[0]):
        self.layer = (
          layers.SequentialLayer.Params()
          .Set(name='model', sub=layer_params)
          .Instantiate()
        )
    else:
      self.layer = (
        pipelining_layer.PipeliningLayer.Params()
        .Set(
          name='model',
          layers=layer_params,
          num_stages=self.num_cells,
          num_micro_batches=num_mb,
          schedule=schedule_name,
          devices=self.devices,
          num_replicas=num_replicas,
          balance_by='flops',
          input_shapes=[self.input_shape],
          recompute='always' if recompute else 'never',
          strict_order=bool(args.strict_order),
          jit_compile=jit_compile,
        )
        .Instantiate()
      )
    variables = self.layer.trainable_variables
    self.weight_bytes = sum(
      v.shape.num_elements() * v.dtype.size for v in variables
    )
    # Replica 0's first and last cells: the input is made on the first, the
    # loss computed on the last.
    first, last = self.devices[0], self.devices[max(1, num_stages) - 1]
    shape = self.input_shape
    lr = 1e-4

    # The plain model runs entirely on the first device; the pipeline places
    # its cells itself. Nothing may run on the driving process.
    plain_scope = first if num_stages == 0 else None
    forward = self.layer
    if num_stages == 0 and jit_compile:
      # The plain model's forward (and its gradient) as one XLA computation.
      forward = tf.function(lambda x: self.layer(x), jit_compile=True)

    # The loss on the last cell (1F1B): each micro-batch's share of the mean.
    num_parts = num_mb * num_replicas

    def LossShare(y):
      size = tf.cast(tf.size(y), tf.float32) * num_parts
      return tf.reduce_sum(tf.square(y)) / size

    def Step():
      with tf.device(first):
        x = tf.random.stateless_normal(shape, [1, 2])
      with tf.GradientTape() as tape:
        if num_stages and schedule_name == '1f1b':
          loss, _ = self.layer.FPropWithLoss(
            self.layer.theta, x, loss_fn=LossShare
          )
        else:
          with tf.device(plain_scope):
            y = forward(x)
          with tf.device(last):
            loss = tf.reduce_mean(tf.square(y))
      with tf.device(last):  # the loss gradient next to the loss
        grads = tape.gradient(loss, variables)
      for v, g in zip(variables, grads):
        with tf.device(v.device):  # update where the weight lives
          v.assign_sub(lr * g)
      return loss

    if tracer is not None:

      def Traced():
        with tracer:
          loss = Step()
        return loss, tracer.Tensors()

      self.step = tf.function(Traced)
    else:
      self.step = tf.function(Step)

  def Run(self):
    start = time.perf_counter()
    out = self.step()
    tf.nest.map_structure(lambda t: t.numpy(), out)
    return time.perf_counter() - start, out


class SocketBytes:
  """TCP bytes the worker processes send, read from `ss -tinp` (Linux).

  `Snapshot()` returns (bytes sent from one worker to another, bytes sent
  from workers to anyone else, i.e. this driving process), cumulative over
  the connections alive now; the difference of two snapshots around a step is
  that step's traffic (gRPC channels stay open between steps).
  """

  def __init__(self, worker_pids):
    self._pids = set(worker_pids)
    self.available = bool(worker_pids) and self._Read() is not None

  @staticmethod
  def _Read():
    try:
      out = subprocess.run(
        ['ss', '-tinpH', 'state', 'established'],
        capture_output=True,
        text=True,
        timeout=30,
      ).stdout
    except (OSError, subprocess.SubprocessError):
      return None
    socks, current = [], None
    for line in out.splitlines():
      if not line.startswith((' ', '\t')):
        fields = line.split()
        pid = re.search(r'pid=(\d+)', line)
        if len(fields) < 4 or not pid:
          current = None
          continue
        current = dict(
          local=fields[2], peer=fields[3], pid=int(pid.group(1)), sent=0
        )
        socks.append(current)
      elif current is not None:
        sent = re.search(r'bytes_sent:(\d+)', line)
        current['sent'] = int(sent.group(1)) if sent else 0
    return socks

  def Snapshot(self):
    socks = self._Read() or []
    owner = {s['local']: s['pid'] for s in socks}
    between = other = 0
    for s in socks:
      if s['pid'] not in self._pids:
        continue
      peer = owner.get(s['peer'])
      if peer in self._pids and peer != s['pid']:
        between += s['sent']
      else:
        other += s['sent']
    return between, other


def MeasureTransfer(devices, num_bytes=64 * 2**20, rounds=5):
  """Seconds to move `num_bytes` from devices[0] to devices[1] and back
  (median over rounds), and the resulting bytes per second one way."""
  n = num_bytes // 4
  with tf.device(devices[0]):
    x = tf.Variable(tf.zeros([n]))

  def Ops(middle):
    with tf.device(middle):
      y = x + 1.0  # x crosses to `middle` unless it is devices[0]
    with tf.device(devices[0]):
      return tf.reduce_sum(y + 1.0)  # and y crosses back

  local = tf.function(lambda: Ops(devices[0]))  # the same ops, no transfer
  remote = tf.function(lambda: Ops(devices[1]))

  def Median(fn):
    fn().numpy()
    times = []
    for _ in range(rounds):
      t0 = time.perf_counter()
      fn().numpy()
      times.append(time.perf_counter() - t0)
    return statistics.median(times)

  base, trip = Median(local), Median(remote)
  one_way = max(trip - base, 1e-9) / 2
  return dict(
    bytes=num_bytes,
    round_trip_s=trip,
    local_s=base,
    one_way_s=one_way,
    bytes_per_s=num_bytes / one_way,
  )


def _MemoryDevices(devices):
  local = [d for d in devices if '/job:worker' not in d]
  return local


def MeasureMemory(bench):
  """(peak bytes during one step, peak minus the bytes held before it).

  The bytes held before the step are the weights, slots and every other
  persistent tensor, so the difference is what the step itself allocates:
  activations, gradients and temporaries. Virtual CPU devices share one
  allocator, so the figures are host-wide.
  """
  devs = _MemoryDevices(bench.devices)
  if not devs:
    return None, None
  try:
    before = tf.config.experimental.get_memory_info(devs[0])['current']
    tf.config.experimental.reset_memory_stats(devs[0])
    bench.Run()
    peak = tf.config.experimental.get_memory_info(devs[0])['peak']
  except (ValueError, RuntimeError, tf.errors.OpError):
    return None, None
  return peak, peak - before


def MeasureWorkerMemory(bench, status):
  """({device: peak bytes during one step}, {device: peak minus held}).

  Each worker process reports its own allocator (multi_process --memory=1).
  """
  devs = bench.devices
  before = device_memory.DeviceMemory(devs, status)
  device_memory.ResetPeaks(devs, status)
  bench.Run()
  after = device_memory.DeviceMemory(devs, status)
  peak = {d: after[d][1] for d in devs}
  return peak, {d: after[d][1] - before[d][0] for d in devs}


def Table(records):
  cols = [
    'model',
    'mode',
    'schedule',
    'replicas',
    'num_stages',
    'num_cells',
    'num_micro_batches',
    'recompute',
    'jit_compile',
    'batch_size',
    'step_time_s',
    'examples_per_s',
    'ideal_speedup',
    'speedup_vs_plain',
    'normalized_to_k2m1',
    'bytes_between_workers_per_step',
    'bytes_to_driver_per_step',
    'peak_bytes',
    'activation_bytes',
  ]
  return common.FormatTable(
    cols, [[_Fmt(r.get(c), c) for c in cols] for r in records]
  )


def _Fmt(v, col=''):
  if v is None:
    return '-'
  if col.startswith('bytes_'):
    return f'{v / 2**20:.1f}M'
  if isinstance(v, float):
    return f'{v:.3f}' if v < 1e5 else f'{v:.3e}'
  if isinstance(v, dict):
    return '/'.join(f'{x / 2**20:.0f}M' for x in v.values())
  return str(v)


def ParseConfigs(text):
  """'KxMxC[xR],...' (C=1: recompute; R: replicas) -> [(K, M, bool, R)]."""
  out = []
  for c in text.split(','):
    try:
      parts = [int(x) for x in c.split('x')]
    except ValueError:
      parts = []
    if len(parts) not in (3, 4):
      raise ValueError(
        f'--configs item {c!r} is not KxMxC or KxMxCxR (ints), e.g. 2x8x1.'
      )
    k, m, r = parts[:3]
    out.append((k, m, bool(r), parts[3] if len(parts) == 4 else 1))
  return out


class Progress:
  """Progress lines on stderr (stdout keeps the table): one at each phase,
  and within a phase at most one every `every_s` seconds."""

  def __init__(self, every_s, stream=None):
    self.every_s = every_s
    self._stream = stream
    self._start = self._last = time.perf_counter()

  def Say(self, text, force=False):
    now = time.perf_counter()
    if not force and now - self._last < self.every_s:
      return
    self._last = now
    print(
      f'[{now - self._start:6.1f} s] {text}',
      file=self._stream or sys.stderr,
      flush=True,
    )


def ConfigName(key):
  """'K=2 M=8 recompute' for a Bench key; 'plain' for the plain model."""
  _, k, m, recompute, reps, jit, name = key
  if k == 0:
    text = 'plain'
  else:
    text = f'K={k} M={m}'
    text += f' R={reps}' if reps > 1 else ''
    text += ' recompute' if recompute else ''
    text += f' {name}' if name != 'gpipe' else ''
  return text + (' xla' if jit else '')


def RunBenchmark(args, devices, worker_pids=(), status=None, progress=None):
  records = []
  progress = progress or Progress(args.progress_every_s)
  for model_name in args.model.split(','):
    configs = [
      c for c in DEFAULT_CONFIGS if max(c[0], 1) * c[3] <= len(devices)
    ]
    if args.configs:
      configs = ParseConfigs(args.configs)
    jits = {'0': [False], '1': [True], 'both': [False, True]}[
      str(args.jit_compile)
    ]
    benches = []
    progress.Say(f'{model_name}: building the configurations', force=True)
    for j in jits:
      for i, name in enumerate(ParseSchedules(args.schedules)):
        for k, m, r, reps in configs:
          if k == 0 and i:  # The plain model once.
            continue
          if k and name == 'interleaved' and (k < 2 or reps > 1):
            continue  # Needs 2+ devices, one replica.
          benches.append(
            Bench(
              model_name,
              args,
              k,
              m,
              r,
              devices,
              num_replicas=reps,
              jit_compile=j,
              schedule_name=name if k else 'gpipe',
            )
          )
          progress.Say(
            f'{model_name}: built {ConfigName(benches[-1].key)} '
            f'({len(benches)} so far)'
          )
    progress.Say(
      f'{model_name}: compiling and warming up {len(benches)} '
      f'configurations ({args.warmup} steps each)',
      force=True,
    )
    for i, b in enumerate(benches):  # compile and warm up
      for s in range(args.warmup):
        b.Run()
        progress.Say(
          f'{model_name}: warm-up {ConfigName(b.key)}: step '
          f'{s + 1}/{args.warmup} (configuration {i + 1}/{len(benches)})'
        )
    times = {b.key: [] for b in benches}
    sent = {b.key: [] for b in benches}
    sockets = SocketBytes(worker_pids)
    progress.Say(
      f'{model_name}: timing {args.steps} rounds of {len(benches)} '
      'configurations',
      force=True,
    )
    for step in range(args.steps):  # interleaved rounds
      for b in benches:
        before = sockets.Snapshot() if sockets.available else None
        times[b.key].append(b.Run()[0])
        progress.Say(
          f'{model_name}: {ConfigName(b.key)}: step {step + 1}/{args.steps}'
        )
        if before is not None:
          after = sockets.Snapshot()
          sent[b.key].append((after[0] - before[0], after[1] - before[1]))
    batch = benches[0].input_shape[0]
    plain = {}
    for b in benches:
      k, m, reps = b.key[1], b.key[2], b.key[4]
      t = statistics.median(times[b.key])
      rec = dict(
        model=model_name,
        mode=args.mode,
        schedule=b.key[6] if k else None,
        replicas=reps,
        num_stages=k,
        num_cells=b.num_cells,
        num_micro_batches=m,
        recompute=b.key[3],
        jit_compile=b.key[5],
        batch_size=batch,
        step_time_s=t,
        step_times_s=times[b.key],
        examples_per_s=batch / t,
        ideal_speedup=reps * IdealSpeedup(b.key[6], max(k, 1), m, b.num_cells),
        weight_bytes=b.weight_bytes,
        devices=b.devices,
      )
      if sent[b.key]:
        rec['bytes_between_workers_per_step'] = statistics.median(
          x[0] for x in sent[b.key]
        )
        rec['bytes_to_driver_per_step'] = statistics.median(
          x[1] for x in sent[b.key]
        )
      if model_name == 'transformer':
        rec['tokens_per_s'] = batch * args.seq_len / t
      if k == 0:
        plain[b.key[5]] = rec
      if args.mode == 'in_process':
        rec['peak_bytes'], rec['activation_bytes'] = MeasureMemory(b)
        note = device_memory.SharedAllocatorNote(b.devices)
        if note:
          rec['memory_note'] = note
      elif args.memory and status:
        rec['peak_bytes'], rec['activation_bytes'] = MeasureWorkerMemory(
          b, status
        )
        rec['memory_note'] = "per device: each worker process's allocator"
      records.append(rec)
    # Each row against the plain model and K=2, M=1 (gpipe) of its own
    # jit_compile.
    for r in records:
      if r['model'] != model_name:
        continue
      base = plain.get(r['jit_compile'])
      if base:
        r['speedup_vs_plain'] = r['examples_per_s'] / base['examples_per_s']
      k2m1 = [
        x
        for x in records
        if x['model'] == model_name
        and x['num_stages'] == 2
        and x['num_micro_batches'] == 1
        and x['replicas'] == 1
        and x['jit_compile'] == r['jit_compile']
        and x['schedule'] == 'gpipe'
      ]
      if k2m1:
        r['normalized_to_k2m1'] = (
          r['examples_per_s'] / k2m1[0]['examples_per_s']
        )
    del benches
  return records


def IdealSpeedup(name, num_devices, num_mb, num_cells):
  """K*M/(M+K-1) for fill-drain and 1F1B (the same bubble); interleaved:
  each of the K devices busy v*M of v*M+K-1 clocks of 1/v the work."""
  if name == 'interleaved' and num_cells > num_devices:
    v = num_cells // num_devices
    return num_devices * v * num_mb / (v * num_mb + num_devices - 1)
  return schedule.IdealSpeedup(num_devices, num_mb)


def ParseSchedules(text):
  """'gpipe,1f1b' -> ['gpipe', '1f1b'], checked against the valid ones."""
  names = [s.strip() for s in text.split(',') if s.strip()]
  bad = [s for s in names if s not in pipelining_layer.SCHEDULES]
  if bad or not names:
    raise ValueError(
      f'--schedules={text!r}: use a comma list of '
      f'{", ".join(pipelining_layer.SCHEDULES)}.'
    )
  return names


def RunTrace(args, devices):
  """Traced K=2 (or --trace_stages) runs, one per schedule of --schedules:
  a Chrome trace and a PNG each."""
  os.makedirs(args.trace, exist_ok=True)
  out = {}
  for name in ParseSchedules(args.schedules):
    out[name] = _TraceOne(args, devices, name)
  if len(out) == 1:
    return next(iter(out.values()))
  return out


def _TraceOne(args, devices, name):
  model_name = args.model.split(',')[0]
  k = min(args.trace_stages, len(devices))
  tracer = schedule.ScheduleTracer()
  bench = Bench(
    model_name,
    args,
    k,
    args.trace_micro_batches,
    bool(args.trace_recompute),
    devices,
    tracer=tracer,
    jit_compile=args.jit_compile == '1',
    schedule_name=name,
  )
  for _ in range(args.warmup + 1):
    _, (_, stamps) = bench.Run()
  events = tracer.Events(stamps)
  suffix = '' if name == 'gpipe' else f'_{name}'
  base = os.path.join(
    args.trace, f'{model_name}_k{k}_m{args.trace_micro_batches}{suffix}'
  )
  cell_devices = bench.layer.devices
  timeline.WriteChromeTrace(events, base + '.trace.json', cell_devices)
  cells = '' if bench.num_cells == k else f' ({bench.num_cells} cells)'
  timeline.PlotTimeline(
    events,
    base + '.png',
    devices=cell_devices,
    title=(
      f'{model_name}: {name}, K={k}{cells}, M={args.trace_micro_batches}, '
      f'{args.mode} (blue forward, orange backward with recompute; gaps: '
      'bubble)'
    ),
  )
  util = timeline.Utilization(events)
  print(
    f'Timeline: {base}.png, {base}.trace.json; busy fraction per cell: '
    + ', '.join(f'cell {c}: {u:.2f}' for c, u in util.items())
  )
  return dict(
    png=base + '.png',
    trace=base + '.trace.json',
    utilization=util,
    events=events,
  )


def _Parser():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--mode', default='multi_process', choices=['multi_process', 'in_process']
  )
  parser.add_argument(
    '--model', default='transformer', help='Comma list of: ' + ', '.join(MODELS)
  )
  parser.add_argument(
    '--configs',
    default='',
    help='Comma list of KxMxC or KxMxCxR (C=1: recompute; '
    'R: data-parallel replicas), e.g. 0x1x0,2x8x1,1x1x0x2; '
    'default: the standard set.',
  )
  parser.add_argument('--num_devices', type=int, default=2)
  common.AddModelArgs(parser)
  parser.add_argument(
    '--steps',
    type=int,
    default=5,
    help='Timed rounds (each runs every configuration).',
  )
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--json', default='', help='Write records here.')
  parser.add_argument(
    '--trace',
    default='',
    help='Directory: write a timeline (PNG, Chrome trace).',
  )
  parser.add_argument(
    '--schedules',
    default='gpipe',
    help='Comma list of pipeline schedules to run each pipelined '
    'configuration with: gpipe, 1f1b, interleaved.',
  )
  parser.add_argument(
    '--virtual_stages',
    type=int,
    default=2,
    help="'interleaved': cells per device v (K*v cells on K devices).",
  )
  parser.add_argument('--trace_stages', type=int, default=2)
  parser.add_argument('--trace_micro_batches', type=int, default=8)
  parser.add_argument(
    '--trace_recompute',
    type=int,
    default=1,
    help='--trace: re-materialize in the traced run (1) or not (0).',
  )
  parser.add_argument(
    '--worker_inter_op_threads',
    type=int,
    default=2,
    help='multi_process: ops a worker may run at once.',
  )
  parser.add_argument(
    '--pin_workers',
    type=int,
    default=1,
    help='multi_process: pin worker i to core i, so a '
    'worker computes on one core whatever its threads.',
  )
  parser.add_argument(
    '--strict_order', type=int, default=1, help='PipeliningLayer.strict_order.'
  )
  parser.add_argument(
    '--memory',
    type=int,
    default=0,
    help='multi_process: each worker counts its allocations '
    "(TensorFlow's BFC allocator) and reports its own peak "
    'bytes per step (peak_bytes per device).',
  )
  parser.add_argument(
    '--jit_compile',
    default='0',
    choices=['0', '1', 'both'],
    help='PipeliningLayer.jit_compile (XLA-compiled cells; the plain '
    "model's forward and backward compiled likewise): 0, 1, or both (every "
    'configuration twice, rows with and without).',
  )
  parser.add_argument(
    '--no_benchmark', action='store_true', help='Only write the trace.'
  )
  parser.add_argument(
    '--progress_every_s',
    type=float,
    default=10.0,
    help='A progress line on stderr at most this often within a phase '
    '(0: after every step); the table and --json are unchanged.',
  )
  return parser


def _CheckArgs(parser, args):
  """parser.error (one line, exit 2) for bad --schedules or --configs."""
  try:
    ParseSchedules(args.schedules)
    configs = ParseConfigs(args.configs) if args.configs else []
  except ValueError as e:
    parser.error(str(e))
  for k, m, _, reps in configs:
    if max(k, 1) * reps > args.num_devices:
      parser.error(
        f'--configs item {k}x{m}: K={k} x R={reps} needs '
        f'{max(k, 1) * reps} devices but --num_devices={args.num_devices}; '
        f'raise --num_devices to {max(k, 1) * reps} or lower K or R.'
      )


def _Devices(args):
  """(devices, the local cluster or None) of --mode."""
  local = None
  if args.mode == 'in_process':
    cluster.SplitCpu(args.num_devices)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.num_devices)
    devices = [f'/device:CPU:{i}' for i in range(args.num_devices)]
  else:
    # Remote workers execute this process's functions with the thread pools
    # its config asks for (the config travels with the connection), so the
    # one-op-at-a-time setting must be made here as well as in the servers.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(
      args.worker_inter_op_threads
    )
    local = cluster.LocalCluster(
      args.num_devices,
      intra_op_threads=1,
      inter_op_threads=args.worker_inter_op_threads,
      pin_cpus=bool(args.pin_workers),
      memory_stats=bool(args.memory),
    ).Start()
    cluster.Connect(local.cluster_spec)
    devices = local.devices
  return devices, local


def _Report(args, devices, local):
  """Runs the benchmark and the trace; prints the table; the JSON's dict."""
  result = {'records': [], 'trace': None, 'args': vars(args)}
  if not args.no_benchmark:
    status = (
      device_memory.StatusMap(devices, local.status_addresses)
      if local is not None and args.memory
      else None
    )
    result['records'] = RunBenchmark(
      args, devices, local.pids if local is not None else (), status
    )
    print(Table(result['records']))
    notes = sorted(
      {r['memory_note'] for r in result['records'] if r.get('memory_note')}
    )
    for note in notes:
      print(f'Memory: {note}.')
    if local is not None and len(devices) > 1:
      result['transfer'] = MeasureTransfer(devices)
      t = result['transfer']
      print(
        f'Transfer between workers 0 and 1 over gRPC: '
        f'{t["bytes"] / 2**20:.0f} MB one way in {t["one_way_s"]:.3f} s '
        f'({t["bytes_per_s"] / 2**20:.0f} MB/s).'
      )
  if args.trace:
    trace = RunTrace(args, devices)
    if 'events' in trace:  # One schedule.
      trace = {'': trace}
    result['trace'] = {
      name: {k: v for k, v in t.items() if k != 'events'}
      for name, t in trace.items()
    }
    if '' in result['trace']:
      result['trace'] = result['trace']['']
  return result


def main(argv=None):
  parser = _Parser()
  args = parser.parse_args(argv)
  _CheckArgs(parser, args)
  devices, local = _Devices(args)
  try:
    result = _Report(args, devices, local)
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(result, f, indent=1, default=str)
      print(f'Wrote {args.json}')
  finally:
    if local is not None:
      _ReleaseFunctions(devices)
      local.Stop()
  return 0


def _ReleaseFunctions(devices):
  """Frees this process's functions while the workers still run.

  Every tf.function is registered on the workers too, and freeing one sends
  them a request to remove it. A Bench's step closes over the Bench (a
  cycle), so only the garbage collector frees it: after `local.Stop()`, at
  interpreter exit, its requests met stopped workers and TensorFlow logged
  "Failed to remove function remotely due to Socket closed". So: collect
  now, then one op on each worker, whose answer comes after the removals
  (requests to a worker are handled in order).
  """
  gc.collect()
  for d in devices:
    with tf.device(d):
      tf.zeros([]).numpy()  # Runs on the worker.


def RunAndExit():
  """The console script `lingvo-gpipe-bench`: main(), then exit."""
  status = main()
  sys.stdout.flush()
  sys.stderr.flush()
  # Without interpreter shutdown: the workers are gone, and freeing what is
  # left of TensorFlow's state would only ask them to remove functions.
  os._exit(status)  # pylint: disable=protected-access


if __name__ == '__main__':
  RunAndExit()
