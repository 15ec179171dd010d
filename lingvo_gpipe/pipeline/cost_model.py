"""A cost model of GPipe's fill-drain (and the 1F1B) schedule, simulated
work item by work item.

Inputs are per-cell costs (forward and backward seconds per micro-batch,
bytes of the activation each cell sends to the next one, weight and stored
input bytes), the number of micro-batches M, whether cells recompute their
forward during the backward pass, and a device spec (link bandwidth and
latency, per-op overhead, memory per device). The simulator follows the
schedule's work items (`schedule.Build`): a cell starts a micro-batch when
its previous task is done and the input has arrived over its own link.

Output per device: step time, peak memory (weights, gradients, optimizer
slots, stored inputs of every micro-batch in flight (all M in GPipe's
schedule, at most K - k in 1F1B's), live activations of the cell being
recomputed, the output gradients that arrived from the next cell before the
device could start their backward, or the optimizer's update temporaries once
the backward is done; plus what the device's allocator rounds up), busy
fraction and bytes sent. The devices' figures (`Device`, the presets) are
in `device_presets`.
"""

import collections

from lingvo_gpipe.pipeline import schedule

__all__ = [
  'DeviceSpec',
  'CellCost',
  'Simulate',
  'PeakMemoryBytes',
  'PeakOfBreakdown',
  'MemoryBreakdown',
  'SIMULATED_SCHEDULES',
]

# allocator_overhead: the fraction of the bytes of the buffers a step
# allocates that the device's allocator adds on top (see `Device`).
DeviceSpec = collections.namedtuple(
  'DeviceSpec',
  [
    'memory_bytes',
    'link_bytes_per_s',
    'link_latency_s',
    'op_overhead_s',
    'allocator_overhead',
  ],
  defaults=[0.0],
)

# Per micro-batch costs of one cell:
#   fprop_s, bprop_s: seconds for the forward / backward of one micro-batch.
#   out_bytes: bytes of the activation sent to the next cell.
#   weight_bytes: bytes of the cell's weights.
#   input_bytes: bytes of the cell's input for one micro-batch (stored for
#     the backward pass when recomputing).
#   activation_bytes: bytes of all intermediate activations of one
#     micro-batch (live while the cell's backward runs, or stored for every
#     micro-batch without recompute).
#   backward_bytes: peak bytes the backward of one micro-batch allocates
#     beyond the activations (gradients of activations, temporaries);
#     optional, 0 by default.
#   max_var_bytes: bytes of the cell's largest variable: the optimizer's
#     update of one variable makes temporaries of its size; optional, 0 by
#     default.
CellCost = collections.namedtuple(
  'CellCost',
  [
    'fprop_s',
    'bprop_s',
    'out_bytes',
    'weight_bytes',
    'input_bytes',
    'activation_bytes',
    'backward_bytes',
    'max_var_bytes',
  ],
  defaults=[0, 0],
)

SimResult = collections.namedtuple(
  'SimResult',
  ['step_s', 'busy_fraction', 'bytes_sent', 'peak_memory', 'events', 'memory'],
)


def _TransferS(nbytes, spec):
  if nbytes == 0:
    return 0.0
  return spec.link_latency_s + nbytes / spec.link_bytes_per_s


def MemoryBreakdown(
  cell,
  num_micro_batches,
  recompute,
  optimizer_slots=2,
  compiled=False,
  received_bytes=0,
  allocator_overhead=0.0,
  held=None,
):
  """The bytes of one device holding `cell`, by part: a dict of 'weights',
  'gradients', 'optimizer_slots', 'stored_inputs', 'activations' and, where
  they apply, 'backward_temporaries', 'compiled_gradients',
  'received_gradients', 'update_temporaries' and 'allocator_rounding'.

  With recompute the device stores the input of every micro-batch and holds
  the activations of the one micro-batch being recomputed; without, it
  stores the activations of every micro-batch. The gradients count once:
  the engine adds each micro-batch's gradients into the running sum's own
  buffer. 'update_temporaries' are what the optimizer's update of one
  variable allocates (a new value per slot and one temporary, each the size
  of the largest variable). The update of a variable waits for its
  gradient, so they are alive after the backward pass, not beside the
  activations: see `PeakMemoryBytes`. A `compiled` cell (XLA,
  `PipeliningLayer.Params().jit_compile`) returns all of its weight
  gradients at once from one call, which are alive beside the running sum
  until added to it: 'compiled_gradients', one more copy of the weights in
  the backward pass when M > 1. 'received_gradients' (`received_bytes`)
  are the output gradients that arrived from the next cell while the device
  was still busy, held beside the backward pass (see `Simulate`). `held`:
  the most micro-batches in flight on the device at once (default M; 1F1B
  holds fewer, see `Simulate`).
  'allocator_rounding' is `allocator_overhead` times the step's share of
  the peak (all but the weights and slots) of a re-materialized cell: its
  buffers are freed and allocated again for every micro-batch, and the
  device's allocator gives them free chunks larger than they are (see
  `Device.allocator_overhead`); a compiled cell's are XLA's buffers of
  each call, which land in such chunks too. Without re-materialization the
  step allocates its activations once, in the order the previous step
  freed them, and they find chunks of their size; so does a
  re-materialized cell of one micro-batch (M=1), whose recomputation
  allocates the forward pass's buffers again in the same order: at M=1,
  re-materialization costs no memory (and saves none).
  """
  m = num_micro_batches
  # The micro-batches whose inputs (or activations) the device holds at
  # once: all M in GPipe's schedule, at most K - k in 1F1B's.
  h = m if held is None else held
  out = {
    'weights': cell.weight_bytes,
    'gradients': cell.weight_bytes,
    'optimizer_slots': cell.weight_bytes * optimizer_slots,
    'stored_inputs': h * cell.input_bytes,
  }
  out['activations'] = cell.activation_bytes * (1 if recompute else h)
  if cell.backward_bytes:
    out['backward_temporaries'] = cell.backward_bytes
  if compiled and m > 1:
    out['compiled_gradients'] = cell.weight_bytes
  if received_bytes:
    out['received_gradients'] = int(received_bytes)
  if cell.max_var_bytes:
    out['update_temporaries'] = cell.max_var_bytes * (optimizer_slots + 1)
  if allocator_overhead and recompute and m > 1:
    held = out['weights'] + out['optimizer_slots']
    out['allocator_rounding'] = int(
      allocator_overhead * (PeakOfBreakdown(out) - held)
    )
  return out


_HELD = ('weights', 'gradients', 'optimizer_slots')


def PeakOfBreakdown(parts):
  """The peak bytes of a `MemoryBreakdown`: what is held through the step
  (weights, gradients, slots) plus the larger of the two phases, the
  forward and backward (stored inputs, activations, backward temporaries,
  received gradients) or the optimizer's update (its temporaries), plus
  the allocator's rounding."""
  held = sum(parts.get(k, 0) for k in _HELD)
  update = parts.get('update_temporaries', 0)
  rounding = parts.get('allocator_rounding', 0)
  step = sum(v for k, v in parts.items() if k not in _HELD) - update - rounding
  return held + max(step, update) + rounding


def PeakMemoryBytes(
  cell,
  num_micro_batches,
  recompute,
  optimizer_slots=2,
  compiled=False,
  received_bytes=0,
  allocator_overhead=0.0,
):
  """Peak bytes of one device holding `cell`.

  Weights + gradients (one per weight) + optimizer slots (Adam: 2 per
  weight), plus the larger of: with recompute, the input of every
  micro-batch and the activations of the one micro-batch being recomputed
  (without recompute, the activations of every micro-batch), with the
  backward's temporaries (and a compiled cell's gradients, and the output
  gradients received ahead of their backward); or the update temporaries of
  the optimizer. A re-materialized cell's step share times
  1 + `allocator_overhead`.
  """
  return PeakOfBreakdown(
    MemoryBreakdown(
      cell,
      num_micro_batches,
      recompute,
      optimizer_slots,
      compiled,
      received_bytes,
      allocator_overhead,
    )
  )


# The schedules `Simulate` times: one cell per device.
SIMULATED_SCHEDULES = ('gpipe', '1f1b')


def _ReceivedAhead(arrivals, starts, ends):
  """The most output gradients a device holds at the start of one of its
  backward tasks: those that have arrived (`arrivals[j]`) and whose backward
  has not ended (`ends[j]`), at each start time `starts[j]`."""
  return max(
    sum(1 for i in arrivals if arrivals[i] <= t and ends[i] > t)
    for t in starts.values()
  )


def Simulate(
  cells,
  num_micro_batches,
  spec,
  recompute=True,
  optimizer_slots=2,
  start_s=0.0,
  end_s=0.0,
  compiled=False,
  schedule_name='gpipe',
):
  """Simulates one training step; returns a SimResult (lists per device).

  Args:
    cells: one `CellCost` per device, in pipeline order.
    num_micro_batches: M.
    spec: a `DeviceSpec`.
    recompute: a bool, or a list of bools (one per cell): whether the
      cell's backward re-runs its forward first.
    optimizer_slots: optimizer slots per weight (Adam: 2).
    start_s: seconds before the first forward (e.g. replicas reading the
      weights).
    end_s: seconds after the last backward (e.g. replicas returning their
      gradients).
    compiled: XLA-compiled cells (memory only; see `MemoryBreakdown`).
    schedule_name: 'gpipe' (fill-drain) or '1f1b'; each device runs its
      work items in the schedule's order (`schedule.Build`), each as soon
      as the device is free and its inputs have arrived. A 1F1B device
      holds at most K - k micro-batches in flight, against M in GPipe's.

  Returns:
    SimResult: step_s, and per device busy_fraction, bytes_sent,
    peak_memory and its `MemoryBreakdown` (memory); events: (pass, cell,
    micro-batch, start_s, end_s) of every task, as `timeline.PlotTimeline`
    takes them.
  """
  k_cells = len(cells)
  m = num_micro_batches
  if k_cells < 1 or m < 1:
    raise ValueError(
      'Simulate needs at least one cell and one micro-batch, '
      'got K=%d M=%d.' % (k_cells, m)
    )
  if schedule_name not in SIMULATED_SCHEDULES:
    raise ValueError(
      f'The cost model simulates one cell per device: schedule '
      f'{schedule_name!r} is not one of {", ".join(SIMULATED_SCHEDULES)}.'
    )
  if isinstance(recompute, (list, tuple)):
    per_cell = [bool(r) for r in recompute]
  else:
    per_cell = [bool(recompute)] * k_cells
  free = [float(start_s)] * k_cells  # when each device is free
  busy = [0.0] * k_cells
  sent = [0] * k_cells
  events = []
  fwd_done = {}
  bwd_done = {}
  # Per device: when each micro-batch's output gradient arrived, and when
  # its backward started and ended.
  arrived = [{} for _ in cells]
  started = [{} for _ in cells]
  work = schedule.Build(schedule_name, k_cells, m)
  held = schedule.InFlight(work, k_cells)
  # Work items in clock order: what an item needs ran at an earlier clock.
  for w in work:
    k, mb = w.cell, w.micro_batch
    if w.kind == schedule.FORWARD:
      ready = free[k]
      if k > 0:
        ready = max(
          ready,
          fwd_done[(k - 1, mb)] + _TransferS(cells[k - 1].out_bytes, spec),
        )
        sent[k - 1] += cells[k - 1].out_bytes
      dur = cells[k].fprop_s + spec.op_overhead_s
      free[k] = ready + dur
      busy[k] += dur
      fwd_done[(k, mb)] = free[k]
      events.append(('forward', k, mb, ready, free[k]))
      continue
    ready = free[k]
    if k < k_cells - 1:
      # The gradient of the cell's output has the output's size.
      arrived[k][mb] = bwd_done[(k + 1, mb)] + _TransferS(
        cells[k].out_bytes, spec
      )
      ready = max(ready, arrived[k][mb])
      sent[k + 1] += cells[k].out_bytes
    dur = cells[k].bprop_s + spec.op_overhead_s
    if per_cell[k]:
      dur += cells[k].fprop_s
    free[k] = ready + dur
    busy[k] += dur
    bwd_done[(k, mb)] = free[k]
    started[k][mb] = ready
    events.append(('backward', k, mb, ready, free[k]))
  step = max(free) + end_s
  memory = []
  for k, (c, r) in enumerate(zip(cells, per_cell)):
    received = 0
    if arrived[k]:
      ends = {mb: bwd_done[(k, mb)] for mb in arrived[k]}
      received = c.out_bytes * _ReceivedAhead(arrived[k], started[k], ends)
    memory.append(
      MemoryBreakdown(
        c,
        m,
        r,
        optimizer_slots,
        compiled,
        received,
        spec.allocator_overhead,
        held=held[k],
      )
    )
  return SimResult(
    step_s=step,
    busy_fraction=[b / step for b in busy],
    bytes_sent=sent,
    peak_memory=[PeakOfBreakdown(x) for x in memory],
    events=events,
    memory=memory,
  )
