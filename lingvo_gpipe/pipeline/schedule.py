"""Pipeline schedules (fill-drain, 1F1B, interleaved) and a tracer.

With K cells and M micro-batches, at clock c cell k works on micro-batch
m = c - k (forward), and the backward runs the same table mirrored. K=3, M=4:

  clock       0    1    2    3    4    5  |  6    7    8    9   10   11
  cell 0     F0   F1   F2   F3   .    .  |  .    .   B3   B2   B1   B0
  cell 1     .    F0   F1   F2   F3   .  |  .   B3   B2   B1   B0   .
  cell 2     .    .    F0   F1   F2   F3 | B3   B2   B1   B0   .    .

Each pass takes M + K - 1 clocks, of which each cell is idle K - 1: the
bubble, a fraction (K - 1) / (M + K - 1) of the step (GPipe, Huang et al.
2019, section 2.3). It is negligible for M >= 4K.

Two more schedules (`SCHEDULES`; `ScheduleText(K, M, schedule=...)` prints
their tables):

'1f1b' (PipeDream-Flush, `OneFOneB`): cell k runs min(K - 1 - k, M)
warm-up forwards, then alternates one forward and one backward, then drains
its backwards. K=3, M=4 (one clock per pass, for the table):

  clock     0   1   2   3   4   5   6   7   8   9  10  11
  cell 0   F0  F1  F2   .   .  B0  F3  B1   .  B2   .  B3
  cell 1    .  F0  F1   .  B0  F2  B1  F3  B2   .  B3   .
  cell 2    .   .  F0  B0  F1  B1  F2  B2  F3  B3   .   .

Micro-batch m's backward starts as soon as its forward leaves the last cell
(this needs its loss there: `PipeliningLayer.FPropWithLoss`), so cell k
holds at most K - k micro-batches' activations instead of M.

'interleaved' (circular, `Interleaved`): K = v * D cells on D devices, cell
k on device k mod D, each device's forwards in groups of D micro-batches
through its v cells (Megatron's virtual stages), then the mirrored
backward. Every cell does 1/v of a device's work per micro-batch, so the
bubble shrinks from (D - 1) / (M + D - 1) to about (D - 1) / (v M + D - 1).
K=4 cells on D=2 devices, M=4 (a clock is half a fill-drain clock):

  clock            0   1   2   3   4   5   6   7   8   9 ...
  cell 0  dev 0   F0  F1   .   .  F2  F3   .   .   .   .
  cell 1  dev 1    .  F0  F1   .   .  F2  F3   .   .   .
  cell 2  dev 0    .   .  F0  F1   .   .  F2  F3   .   .
  cell 3  dev 1    .   .   .  F0  F1   .   .  F2  F3   .   (then B, mirrored)

Each device is busy 8 of the 9 forward clocks: a bubble of 1/9, against
1/5 for fill-drain with 2 cells and M=4.

`ScheduleTracer` records when each (cell, micro-batch, pass) actually ran,
with `tf.timestamp()` ops that execute on the cell's device right before the
cell's first op and right after its last one, so a trace shows the real
overlap of the cells, not the intended one.
"""

import collections
import threading

import tensorflow as tf

__all__ = [
  'ForwardOrder',
  'BackwardOrder',
  'BubbleFraction',
  'IdealSpeedup',
  'ScheduleTracer',
  'ActiveTracer',
  'ScheduleText',
  'WorkItem',
  'FORWARD',
  'BACKWARD',
  'FillDrain',
  'OneFOneB',
  'Interleaved',
  'SCHEDULES',
  'Build',
  'InFlight',
  'IdleFraction',
  'PerDevice',
  'Times',
]

# The schedules a PipeliningLayer accepts (Params().schedule).
SCHEDULES = ('gpipe', '1f1b', 'interleaved')

FORWARD = 'forward'
BACKWARD = 'backward'

# One unit of pipeline work: `cell` runs pass `kind` (FORWARD or BACKWARD) of
# `micro_batch` at `clock`. A schedule is the list of a step's work items in
# the order their ops are built (`engine.PipelineEngine` runs any such list).
WorkItem = collections.namedtuple(
  'WorkItem', ['clock', 'cell', 'micro_batch', 'kind']
)


def ForwardOrder(num_cells, num_micro_batches):
  """[(clock, cell, micro_batch)] of the forward pass, in clock order."""
  out = []
  for clock in range(num_micro_batches + num_cells - 1):
    for k in range(num_cells):
      m = clock - k
      if 0 <= m < num_micro_batches:
        out.append((clock, k, m))
  return out


def BackwardOrder(num_cells, num_micro_batches):
  """[(clock, cell, micro_batch)] of the backward pass, in clock order.

  The last cell starts with the last micro-batch; cell k runs micro-batch
  m at backward clock (K - 1 - k) + (M - 1 - m).
  """
  out = []
  for clock in range(num_micro_batches + num_cells - 1):
    for k in reversed(range(num_cells)):
      m = num_micro_batches - 1 - (clock - (num_cells - 1 - k))
      if 0 <= m < num_micro_batches:
        out.append((clock, k, m))
  return out


def FillDrain(num_cells, num_micro_batches):
  """GPipe's schedule as [WorkItem]: every forward, then every backward.

  Backward clocks continue after the forward ones (as in `ScheduleText`).
  """
  n = num_micro_batches + num_cells - 1
  fwd = [
    WorkItem(c, k, m, FORWARD)
    for c, k, m in ForwardOrder(num_cells, num_micro_batches)
  ]
  bwd = [
    WorkItem(n + c, k, m, BACKWARD)
    for c, k, m in BackwardOrder(num_cells, num_micro_batches)
  ]
  return fwd + bwd


def PerDevice(work, num_cells, num_devices=None):
  """[device] -> the items of `work` that device runs, in `work`'s order
  (cell k on device k mod D; D defaults to K)."""
  num_devices = num_devices or num_cells
  out = [[] for _ in range(num_devices)]
  for w in work:
    out[w.cell % num_devices].append(w)
  return out


def Times(sequences, num_cells, duration, transfer=None):
  """The schedules' one simulator: when each work item starts and ends.

  Each device runs its items in order, each as soon as the device is free
  and what the item needs has ended: a forward needs the previous cell's
  forward of its micro-batch, a backward the cell's own forward and the next
  cell's backward. Unit durations give a schedule's clocks (`OneFOneB`,
  `Interleaved`); the cost model's seconds give a predicted step
  (`planning/cost_model.py`).

  Args:
    sequences: [device] -> [WorkItem] (only cell, micro_batch and kind are
      read) in the order the device runs them.
    num_cells: K.
    duration: item -> its seconds (or clocks).
    transfer: item -> the seconds its input takes to arrive from the cell
      that produced it (the previous cell's output for a forward, the next
      cell's input gradient for a backward); None: 0.

  Returns:
    [(device, item, start, end, arrive)] in the order they were computed;
    `arrive`: when the last of the item's inputs was there (0 for none).

  Raises:
    ValueError: if the orders deadlock (an item waits on one that its own
      device runs later).
  """
  pos = [0] * len(sequences)
  free = [0.0] * len(sequences)
  ends = {}
  out = []
  total = sum(len(s) for s in sequences)
  while len(out) < total:
    progressed = False
    for d, seq in enumerate(sequences):
      while pos[d] < len(seq):
        w = seq[pos[d]]
        k, m = w.cell, w.micro_batch
        if w.kind == FORWARD:
          needs = [(FORWARD, k - 1, m)] if k > 0 else []
        else:
          needs = [(FORWARD, k, m)]
          if k < num_cells - 1:
            needs.append((BACKWARD, k + 1, m))
        if not all(n in ends for n in needs):
          break
        arrive = 0.0
        for n in needs:  # An input from another cell arrives over a link.
          link = transfer(w) if transfer and n[1] != k else 0
          arrive = max(arrive, ends[n] + link)
        start = max(free[d], arrive)
        end = start + duration(w)
        free[d] = end
        ends[(w.kind, k, m)] = end
        out.append((d, w, start, end, arrive))
        pos[d] += 1
        progressed = True
    if not progressed:
      raise ValueError(
        'The per-device orders '
        f'{[[(w.kind, w.cell, w.micro_batch) for w in s] for s in sequences]} '
        'deadlock.'
      )
  return out


def _Clocks(num_cells, sequences):
  """[WorkItem] with clocks, from per-device [(kind, cell, micro_batch)]
  orders: `Times` with each pass one clock, sorted by clock (then device)."""
  seqs = [[WorkItem(0, k, m, kind) for kind, k, m in s] for s in sequences]
  timed = Times(seqs, num_cells, lambda w: 1)
  return [
    w._replace(clock=int(start))
    for _, w, start, _, _ in sorted(timed, key=lambda x: (x[2], x[0]))
  ]


def OneFOneB(num_cells, num_micro_batches):
  """PipeDream-Flush's 1F1B schedule as [WorkItem] (module docstring).

  Cell k runs min(K - 1 - k, M) warm-up forwards, then one forward and one
  backward in turn, then the remaining backwards.
  """
  seqs = []
  for k in range(num_cells):
    warm = min(num_cells - 1 - k, num_micro_batches)
    seq = [(FORWARD, k, m) for m in range(warm)]
    for i in range(num_micro_batches - warm):
      seq += [(FORWARD, k, warm + i), (BACKWARD, k, i)]
    seq += [
      (BACKWARD, k, m)
      for m in range(num_micro_batches - warm, num_micro_batches)
    ]
    seqs.append(seq)
  return _Clocks(num_cells, seqs)


def _CheckInterleaved(num_cells, num_devices):
  if num_devices < 1 or num_cells % num_devices:
    valid = ', '.join(str(num_devices * v) for v in range(1, 5))
    raise ValueError(
      f"schedule='interleaved' places cell k on device k mod D, so the "
      f'{num_devices} devices must divide the number of cells; got '
      f'{num_cells} cells. Use {valid}, ... cells (or another number of '
      'devices).'
    )


def Interleaved(num_cells, num_micro_batches, num_devices):
  """The interleaved (circular) schedule as [WorkItem] (module docstring).

  Cell k runs on device k mod D. Each device runs its forwards in groups of
  D micro-batches: group g through its first cell, then its second, ...;
  the backward pass is the forward table mirrored in time.
  """
  _CheckInterleaved(num_cells, num_devices)
  d_count = num_devices
  seqs = []
  for d in range(d_count):
    cells = list(range(d, num_cells, d_count))
    seq = []
    for g in range(0, num_micro_batches, d_count):
      group = range(g, min(g + d_count, num_micro_batches))
      seq += [(FORWARD, k, m) for k in cells for m in group]
    seqs.append(seq)
  fwd = _Clocks(num_cells, seqs)
  n = fwd[-1].clock + 1
  bwd = sorted(
    (
      WorkItem(2 * n - 1 - w.clock, w.cell, w.micro_batch, BACKWARD)
      for w in fwd
    ),
    key=lambda w: (w.clock, w.cell % d_count),
  )
  return fwd + bwd


def Build(name, num_cells, num_micro_batches, num_devices=None):
  """[WorkItem] of schedule `name` (one of SCHEDULES).

  Args:
    name: 'gpipe', '1f1b' or 'interleaved'.
    num_cells: K.
    num_micro_batches: M.
    num_devices: D for 'interleaved' (cell k on device k mod D); None: K.
  """
  if name == 'gpipe':
    return FillDrain(num_cells, num_micro_batches)
  if name == '1f1b':
    return OneFOneB(num_cells, num_micro_batches)
  if name == 'interleaved':
    return Interleaved(num_cells, num_micro_batches, num_devices or num_cells)
  raise ValueError(f'schedule={name!r}; use one of {SCHEDULES}.')


def InFlight(work, num_cells):
  """[cell] -> the most micro-batches whose forward ran on the cell and
  whose backward has not: what the cell keeps for its backward pass."""
  live = [0] * num_cells
  most = [0] * num_cells
  for w in work:
    live[w.cell] += 1 if w.kind == FORWARD else -1
    most[w.cell] = max(most[w.cell], live[w.cell])
  return most


def IdleFraction(work, num_cells, num_devices=None):
  """Idle fraction of each device over the table's clocks (cell k on
  device k mod D); with K cells on D < K devices a clock is 1/v of a
  fill-drain clock, so tables of different schedules compare directly
  only at the same K."""
  num_devices = num_devices or num_cells
  clocks = max(w.clock for w in work) + 1
  busy = len(work) / num_devices
  return 1 - busy / clocks


def BubbleFraction(num_cells, num_micro_batches):
  """Idle fraction of each device in the fill-drain schedule."""
  return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def IdealSpeedup(num_cells, num_micro_batches):
  """Speedup over one device of K perfectly balanced cells: K*M/(M+K-1)."""
  return num_cells * num_micro_batches / (num_micro_batches + num_cells - 1)


def ScheduleText(
  num_cells, num_micro_batches, schedule='gpipe', num_devices=None
):
  """The clock-cycle table of a schedule (module docstring), for any K, M.

  With 'interleaved', each row also names the cell's device (k mod D).
  """
  work = Build(schedule, num_cells, num_micro_batches, num_devices)
  cells = {
    (w.cell, w.clock): ('F' if w.kind == FORWARD else 'B') + str(w.micro_batch)
    for w in work
  }
  clocks = max(w.clock for w in work) + 1
  width = max(4, len(str(num_micro_batches)) + 2)
  d_count = num_devices or num_cells
  label = (
    (lambda k: f'cell {k:<2} dev {k % d_count:<2}')
    if schedule == 'interleaved'
    else (lambda k: f'cell {k:<2}')
  )
  pad = len(label(0))
  header = f'{"clock":<{pad}}' + ''.join(f'{c:>{width}}' for c in range(clocks))
  rows = [header]
  for k in range(num_cells):
    rows.append(
      label(k)
      + ''.join(f'{cells.get((k, c), "."):>{width}}' for c in range(clocks))
    )
  return '\n'.join(rows)


_local = threading.local()


class ScheduleTracer:
  """Collects start/end timestamps of every (pass, cell, micro-batch).

  Use around the code that builds a step (inside the `tf.function`), and
  return `tracer.Tensors()` from it:

    tracer = ScheduleTracer()

    @tf.function
    def Step(x):
      with tracer:
        loss, grads = ...  # pipeline forward + backward
      return loss, tracer.Tensors()

    loss, stamps = Step(x)
    events = tracer.Events(stamps)   # [(pass, cell, mb, start_s, end_s)]
  """

  def __init__(self):
    self._keys = []
    self._stamps = []

  def __enter__(self):
    if not hasattr(_local, 'stack'):
      _local.stack = []
    _local.stack.append(self)
    return self

  def __exit__(self, *unused):
    _local.stack.pop()

  def Record(self, key, start, end):
    self._keys.append(key)
    self._stamps.append(tf.stack([start, end]))

  def Tensors(self):
    """A [N, 2] float64 tensor of (start, end) seconds; N = events."""
    if not self._stamps:
      return tf.zeros([0, 2], tf.float64)
    return tf.stack(self._stamps)

  def Events(self, stamps):
    """Pairs the keys with evaluated stamps, times relative to the first."""
    stamps = stamps.numpy() if hasattr(stamps, 'numpy') else stamps
    if len(stamps) == 0:  # pylint: disable=g-explicit-length-test
      return []
    t0 = float(stamps[:, 0].min())
    return [
      (*key, float(s) - t0, float(e) - t0)
      for key, (s, e) in zip(self._keys, stamps)
    ]


def ActiveTracer():
  stack = getattr(_local, 'stack', None)
  return stack[-1] if stack else None
