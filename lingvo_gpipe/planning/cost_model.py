"""A cost model of the pipeline's schedules (GPipe's fill-drain, 1F1B and
the interleaved one), simulated work item by work item.

Inputs are per-cell costs (forward and backward seconds per micro-batch,
bytes of the activation each cell sends to the next one, weight and stored
input bytes), the number of micro-batches M, whether cells recompute their
forward during the backward pass, and a device spec (link bandwidth and
latency, per-op overhead, memory per device). The simulator follows the
schedule's work items (`schedule.Build`), timed by the schedules' own
simulator (`schedule.Times`): a device starts its next item when its
previous one is done and the input has arrived over its link. With the
interleaved schedule a device holds several cells (cell k on device
k mod D), and its figures are theirs together.

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
  if recompute and m > 1:
    _AddRounding(out, allocator_overhead)
  return out


def _AddRounding(parts, allocator_overhead):
  """Adds 'allocator_rounding' to `parts` (see `MemoryBreakdown`): the
  overhead's share of the peak but the weights and slots."""
  if allocator_overhead:
    kept = parts['weights'] + parts['optimizer_slots']
    parts['allocator_rounding'] = int(
      allocator_overhead * (PeakOfBreakdown(parts) - kept)
    )


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


# The schedules `Simulate` times ('interleaved': K cells on D devices).
SIMULATED_SCHEDULES = schedule.SCHEDULES


def _ReceivedAhead(arrivals, starts, ends, nbytes):
  """The most bytes of output gradients a device holds at the start of one
  of its backward tasks: those that have arrived (`arrivals[j]`) and whose
  backward has not ended (`ends[j]`), at each start time `starts[j]`;
  `nbytes[j]`: the size of gradient j."""
  return max(
    sum(nbytes[i] for i in arrivals if arrivals[i] <= t and ends[i] > t)
    for t in starts.values()
  )


def _DeviceBreakdown(cells, held, recompute, m, optimizer_slots, compiled):
  """The `MemoryBreakdown` of a device that holds several cells (the
  interleaved schedule), before received gradients and rounding: what each
  cell holds through the step adds up (weights, gradients, slots, stored
  inputs, and without re-materialization its activations); what one cell's
  pass holds at a time (a recomputed cell's activations, the backward's
  temporaries, a compiled cell's gradients, the update's) is the largest of
  the cells'."""
  parts = [
    MemoryBreakdown(c, m, r, optimizer_slots, compiled, held=h)
    for c, h, r in zip(cells, held, recompute)
  ]
  out = {}
  for key in dict.fromkeys(k for p in parts for k in p):  # in a fixed order
    values = [p.get(key, 0) for p in parts]
    one_at_a_time = key in (
      'backward_temporaries',
      'compiled_gradients',
      'update_temporaries',
    ) or (key == 'activations' and all(recompute))
    out[key] = max(values) if one_at_a_time else sum(values)
  return out


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
  num_devices=None,
):
  """Simulates one training step; returns a SimResult (lists per device).

  Args:
    cells: one `CellCost` per cell, in pipeline order.
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
    schedule_name: 'gpipe' (fill-drain), '1f1b' or 'interleaved'; each
      device runs its work items in the schedule's order (`schedule.Build`),
      each as soon as the device is free and its inputs have arrived
      (`schedule.Times`, the schedules' one simulator). A 1F1B device
      holds at most K - k micro-batches in flight, against M in GPipe's.
    num_devices: D for 'interleaved' (cell k on device k mod D); None: one
      cell per device.

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
      f'schedule {schedule_name!r} is not one of '
      f'{", ".join(SIMULATED_SCHEDULES)}.'
    )
  d_count = num_devices if schedule_name == 'interleaved' else None
  d_count = d_count or k_cells
  if isinstance(recompute, (list, tuple)):
    per_cell = [bool(r) for r in recompute]
  else:
    per_cell = [bool(recompute)] * k_cells
  work = schedule.Build(schedule_name, k_cells, m, d_count)
  held = schedule.InFlight(work, k_cells)

  def Duration(w):
    c = cells[w.cell]
    if w.kind == schedule.FORWARD:
      return c.fprop_s + spec.op_overhead_s
    return (
      c.bprop_s + spec.op_overhead_s + (c.fprop_s if per_cell[w.cell] else 0)
    )

  def Sent(w):
    """(sending device, bytes) of the input `w` waits for; None: local."""
    k = w.cell
    src = k - 1 if w.kind == schedule.FORWARD else k + 1
    if not 0 <= src < k_cells or src % d_count == k % d_count:
      return None
    # The gradient of a cell's output has the output's size.
    nbytes = cells[min(k, src)].out_bytes
    return src % d_count, nbytes

  def Transfer(w):
    sent = Sent(w)
    return _TransferS(sent[1], spec) if sent else 0.0

  timed = schedule.Times(
    schedule.PerDevice(work, k_cells, d_count), k_cells, Duration, Transfer
  )
  order = {(w.kind, w.cell, w.micro_batch): i for i, w in enumerate(work)}
  timed.sort(key=lambda x: order[(x[1].kind, x[1].cell, x[1].micro_batch)])
  busy = [0.0] * d_count
  sent = [0] * d_count
  last = [float(start_s)] * d_count
  events = []
  # Per device: when each output gradient it receives arrived, and when
  # each of its backward tasks started and ended, and the gradients' sizes.
  arrived = [{} for _ in range(d_count)]
  started = [{} for _ in range(d_count)]
  ended = [{} for _ in range(d_count)]
  sizes = [{} for _ in range(d_count)]
  for d, w, start, end, arrive in timed:
    start, end, arrive = start + start_s, end + start_s, arrive + start_s
    busy[d] += end - start
    last[d] = max(last[d], end)
    events.append((w.kind, w.cell, w.micro_batch, start, end))
    s = Sent(w)
    if s:
      sent[s[0]] += s[1]
    if w.kind != schedule.BACKWARD:
      continue
    key = (w.cell, w.micro_batch)
    started[d][key] = start
    ended[d][key] = end
    if w.cell < k_cells - 1:
      # Its last input: the next cell's gradient (its own forward ended
      # before that cell's forward began).
      arrived[d][key] = arrive
      sizes[d][key] = cells[w.cell].out_bytes
  step = max(last) + end_s
  memory = []
  for d in range(d_count):
    mine = list(range(d, k_cells, d_count))
    received = (
      _ReceivedAhead(arrived[d], started[d], ended[d], sizes[d])
      if arrived[d]
      else 0
    )
    if len(mine) == 1:
      (k,) = mine
      parts = MemoryBreakdown(
        cells[k],
        m,
        per_cell[k],
        optimizer_slots,
        compiled,
        received,
        spec.allocator_overhead,
        held=held[k],
      )
    else:
      parts = _DeviceBreakdown(
        [cells[k] for k in mine],
        [held[k] for k in mine],
        [per_cell[k] for k in mine],
        m,
        optimizer_slots,
        compiled,
      )
      if received:
        parts['received_gradients'] = int(received)
      if all(per_cell[k] for k in mine) and m > 1:
        _AddRounding(parts, spec.allocator_overhead)
    memory.append(parts)
  return SimResult(
    step_s=step,
    busy_fraction=[b / step for b in busy],
    bytes_sent=sent,
    peak_memory=[PeakOfBreakdown(x) for x in memory],
    events=events,
    memory=memory,
  )
