"""A cost model of the GPipe fill-drain schedule, simulated clock by clock.

Inputs are per-cell costs (forward and backward seconds per micro-batch,
bytes of the activation each cell sends to the next one, weight and stored
input bytes), the number of micro-batches M, whether cells recompute their
forward during the backward pass, and a device spec (link bandwidth and
latency, per-op overhead, memory per device). The simulator follows
schedule.ForwardOrder / BackwardOrder: a cell starts a micro-batch when its
previous task is done and the input has arrived over its own link.

Output per device: step time, peak memory (weights, gradients, optimizer
slots, stored inputs of every micro-batch, live activations of the cell being
recomputed), busy fraction and bytes sent.
"""

import collections

from lingvo_gpipe.pipeline import schedule

__all__ = ['DeviceSpec', 'CellCost', 'Simulate', 'PeakMemoryBytes']

DeviceSpec = collections.namedtuple(
  'DeviceSpec',
  ['memory_bytes', 'link_bytes_per_s', 'link_latency_s', 'op_overhead_s'],
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
CellCost = collections.namedtuple(
  'CellCost',
  [
    'fprop_s',
    'bprop_s',
    'out_bytes',
    'weight_bytes',
    'input_bytes',
    'activation_bytes',
  ],
)

SimResult = collections.namedtuple(
  'SimResult', ['step_s', 'busy_fraction', 'bytes_sent', 'peak_memory']
)


def _TransferS(nbytes, spec):
  if nbytes == 0:
    return 0.0
  return spec.link_latency_s + nbytes / spec.link_bytes_per_s


def PeakMemoryBytes(cell, num_micro_batches, recompute, optimizer_slots=2):
  """Peak bytes of one device holding `cell`.

  Weights + gradients (one per weight) + optimizer slots (Adam: 2 per
  weight) + with recompute: the input of every micro-batch plus the
  activations of the one micro-batch being recomputed; without: the
  activations of every micro-batch.
  """
  static = cell.weight_bytes * (2 + optimizer_slots)
  if recompute:
    acts = num_micro_batches * cell.input_bytes + cell.activation_bytes
  else:
    acts = num_micro_batches * (cell.input_bytes + cell.activation_bytes)
  return static + acts


def Simulate(cells, num_micro_batches, spec, recompute=True, optimizer_slots=2):
  """Simulates one training step; returns a SimResult (lists per device)."""
  k_cells = len(cells)
  m = num_micro_batches
  if k_cells < 1 or m < 1:
    raise ValueError(
      'Simulate needs at least one cell and one micro-batch, '
      'got K=%d M=%d.' % (k_cells, m)
    )
  free = [0.0] * k_cells  # when each device is free
  busy = [0.0] * k_cells
  sent = [0] * k_cells
  fwd_done = {}
  for _, k, mb in schedule.ForwardOrder(k_cells, m):
    ready = free[k]
    if k > 0:
      ready = max(
        ready, fwd_done[(k - 1, mb)] + _TransferS(cells[k - 1].out_bytes, spec)
      )
      sent[k - 1] += cells[k - 1].out_bytes
    dur = cells[k].fprop_s + spec.op_overhead_s
    free[k] = ready + dur
    busy[k] += dur
    fwd_done[(k, mb)] = free[k]
  bwd_done = {}
  for _, k, mb in schedule.BackwardOrder(k_cells, m):
    ready = free[k]
    if k < k_cells - 1:
      # The gradient of the cell's output has the output's size.
      ready = max(
        ready, bwd_done[(k + 1, mb)] + _TransferS(cells[k].out_bytes, spec)
      )
      sent[k + 1] += cells[k].out_bytes
    dur = cells[k].bprop_s + spec.op_overhead_s
    if recompute:
      dur += cells[k].fprop_s
    free[k] = ready + dur
    busy[k] += dur
    bwd_done[(k, mb)] = free[k]
  step = max(free)
  return SimResult(
    step_s=step,
    busy_fraction=[b / step for b in busy],
    bytes_sent=sent,
    peak_memory=[
      PeakMemoryBytes(c, m, recompute, optimizer_slots) for c in cells
    ],
  )
