"""The GPipe (fill-drain) schedule and a tracer that records it as it runs.

With K cells and M micro-batches, at clock c cell k works on micro-batch
m = c - k (forward), and the backward runs the same table mirrored. K=3, M=4:

  clock       0    1    2    3    4    5  |  6    7    8    9   10   11
  cell 0     F0   F1   F2   F3   .    .  |  .    .   B3   B2   B1   B0
  cell 1     .    F0   F1   F2   F3   .  |  .   B3   B2   B1   B0   .
  cell 2     .    .    F0   F1   F2   F3 | B3   B2   B1   B0   .    .

Each pass takes M + K - 1 clocks, of which each cell is idle K - 1: the
bubble, a fraction (K - 1) / (M + K - 1) of the step (GPipe, Huang et al.
2019, section 2.3). It is negligible for M >= 4K.

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
]

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


def BubbleFraction(num_cells, num_micro_batches):
  """Idle fraction of each device in the fill-drain schedule."""
  return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def IdealSpeedup(num_cells, num_micro_batches):
  """Speedup over one device of K perfectly balanced cells: K*M/(M+K-1)."""
  return num_cells * num_micro_batches / (num_micro_batches + num_cells - 1)


def ScheduleText(num_cells, num_micro_batches):
  """The clock-cycle table of the module docstring, for any K and M."""
  fwd = {
    (k, c): f'F{m}' for c, k, m in ForwardOrder(num_cells, num_micro_batches)
  }
  n = num_micro_batches + num_cells - 1
  bwd = {
    (k, c + n): f'B{m}'
    for c, k, m in BackwardOrder(num_cells, num_micro_batches)
  }
  cells = {**fwd, **bwd}
  width = max(4, len(str(num_micro_batches)) + 2)
  header = 'clock  ' + ''.join(f'{c:>{width}}' for c in range(2 * n))
  rows = [header]
  for k in range(num_cells):
    rows.append(
      f'cell {k:<2}'
      + ''.join(f'{cells.get((k, c), "."):>{width}}' for c in range(2 * n))
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
