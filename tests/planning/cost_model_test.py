"""Tests of the fill-drain cost model."""

import pytest

from lingvo_gpipe.planning import cost_model
from lingvo_gpipe.planning import device_presets

_FREE_LINKS = cost_model.DeviceSpec(
  memory_bytes=1 << 30,
  link_bytes_per_s=1e12,
  link_latency_s=0.0,
  op_overhead_s=0.0,
)


def _Cell(**kw):
  args = dict(
    fprop_s=1.0,
    bprop_s=2.0,
    out_bytes=0,
    weight_bytes=0,
    input_bytes=0,
    activation_bytes=0,
  )
  args.update(kw)
  return cost_model.CellCost(**args)


@pytest.mark.parametrize('k,m', [(1, 1), (2, 4), (4, 8), (8, 32)])
def testUniformCellsBusyFraction(k, m):
  res = cost_model.Simulate([_Cell()] * k, m, _FREE_LINKS, recompute=False)
  for frac in res.busy_fraction:
    assert frac == pytest.approx(m / (m + k - 1))
  assert res.step_s == pytest.approx(3.0 * (m + k - 1))


def testRecomputeAddsAForwardToEachBackward():
  res = cost_model.Simulate([_Cell()] * 2, 4, _FREE_LINKS, recompute=True)
  assert res.step_s == pytest.approx((1.0 + 3.0) * (4 + 1))


def testTransfersDelayTheNextCellAndCountBytes():
  spec = _FREE_LINKS._replace(link_bytes_per_s=100.0, link_latency_s=0.5)
  cells = [_Cell(out_bytes=100), _Cell(out_bytes=100)]
  res = cost_model.Simulate(cells, 1, spec, recompute=False)
  # F0 1s, send 1.5s, F1 1s, B1 2s, send 1.5s, B0 2s.
  assert res.step_s == pytest.approx(9.0)
  assert res.bytes_sent == [100, 100]


def testTwoCellToyMemoryMatchesHandCount():
  cells = [
    _Cell(weight_bytes=1000, input_bytes=10, activation_bytes=50),
    _Cell(weight_bytes=400, input_bytes=20, activation_bytes=30),
  ]
  res = cost_model.Simulate(cells, 4, _FREE_LINKS, recompute=True)
  # weights + grads + 2 Adam slots; 4 stored inputs; one cell's activations.
  assert res.peak_memory == [4 * 1000 + 4 * 10 + 50, 4 * 400 + 4 * 20 + 30]
  res = cost_model.Simulate(cells, 4, _FREE_LINKS, recompute=False)
  assert res.peak_memory == [4000 + 4 * 60, 1600 + 4 * 50]


def testGradientsCountOnceWhateverM():
  # The engine adds each micro-batch's gradients into the running sum's
  # buffer: one copy of the gradients, at M = 1 as at M = 4.
  cell = _Cell(weight_bytes=1000, input_bytes=10, activation_bytes=50)
  assert cost_model.PeakMemoryBytes(cell, 4, True) == 4 * 1000 + 4 * 10 + 50
  assert cost_model.PeakMemoryBytes(cell, 1, True) == 4 * 1000 + 10 + 50
  parts = cost_model.MemoryBreakdown(cell, 4, False, 0)
  assert parts == dict(
    weights=1000,
    gradients=1000,
    optimizer_slots=0,
    stored_inputs=40,
    activations=200,
  )


def testUpdateTemporariesAreAPhaseOfTheirOwn():
  # Adam's update of the largest variable (300 bytes) makes a new m, a new v
  # and one temporary: 900 bytes, alive after the backward, not beside its
  # activations (the update waits for the gradient).
  cell = _Cell(
    weight_bytes=1000,
    input_bytes=10,
    activation_bytes=50,
    backward_bytes=20,
    max_var_bytes=300,
  )
  parts = cost_model.MemoryBreakdown(cell, 4, True)
  assert parts['update_temporaries'] == 900
  assert cost_model.PeakMemoryBytes(cell, 4, True) == 4 * 1000 + 900
  # Large activations: the forward and backward set the peak.
  big = cell._replace(activation_bytes=5000)
  assert cost_model.PeakMemoryBytes(big, 4, True) == 4000 + 40 + 5000 + 20
  # SGD (no slot): one temporary.
  assert cost_model.MemoryBreakdown(cell, 4, True, 0)['update_temporaries'] == (
    300
  )


def testBadInput():
  with pytest.raises(ValueError, match='K=0 M=4'):
    cost_model.Simulate([], 4, _FREE_LINKS)


def testSimulatePeakIncludesTheUpdatePhase():
  cells = [_Cell(weight_bytes=1000, input_bytes=10, max_var_bytes=500)] * 2
  res = cost_model.Simulate(cells, 4, _FREE_LINKS, recompute=True)
  assert res.peak_memory == [4 * 1000 + 3 * 500] * 2


def testCompiledCellsHoldOneMoreCopyOfTheGradientsInTheBackward():
  # A compiled cell's backward returns all of its weight gradients at once,
  # alive beside the running sum until added to it (M > 1); not in the
  # update phase, which comes after.
  cell = _Cell(weight_bytes=1000, input_bytes=10, activation_bytes=50)
  parts = cost_model.MemoryBreakdown(cell, 4, True, compiled=True)
  assert parts['compiled_gradients'] == 1000
  assert cost_model.PeakMemoryBytes(cell, 4, True, compiled=True) == (
    4 * 1000 + 1000 + 4 * 10 + 50
  )
  assert 'compiled_gradients' not in cost_model.MemoryBreakdown(
    cell, 1, True, compiled=True
  )
  res = cost_model.Simulate(
    [cell, cell], 4, _FREE_LINKS, recompute=True, compiled=True
  )
  assert res.peak_memory == [5000 + 40 + 50] * 2
  # Large update temporaries set the peak after the backward, as without.
  wide = cell._replace(max_var_bytes=3000)
  assert cost_model.PeakMemoryBytes(wide, 4, True, compiled=True) == (
    4000 + 9000
  )


def _PileCells(bprop0_s):
  return [
    _Cell(fprop_s=1.0, bprop_s=bprop0_s, out_bytes=100),
    _Cell(fprop_s=1.0, bprop_s=1.0),
  ]


def testOutputGradientsPileUpAheadOfASlowerCell():
  # Cell 1's backwards end at 6, 7, 8 and 9 s. Cell 0 takes 4 s each, from
  # 6 s: when it starts its second one (10 s) the other three gradients
  # have arrived and wait beside it.
  res = cost_model.Simulate(_PileCells(4.0), 4, _FREE_LINKS, recompute=False)
  assert res.memory[0]['received_gradients'] == 3 * 100
  assert res.peak_memory[0] == 3 * 100
  assert 'received_gradients' not in res.memory[1]  # the loss's, not sent
  # As fast as cell 1: each gradient is used as it arrives.
  res = cost_model.Simulate(_PileCells(1.0), 4, _FREE_LINKS, recompute=False)
  assert res.memory[0]['received_gradients'] == 100


def testAllocatorRoundsUpTheReMaterializedStep():
  spec = _FREE_LINKS._replace(allocator_overhead=0.1)
  cell = _Cell(weight_bytes=1000, input_bytes=10, activation_bytes=50)
  res = cost_model.Simulate([cell], 4, spec, recompute=True)
  # Weights and slots are not reallocated per micro-batch; the step's share
  # (gradients 1000 + inputs 40 + activations 50) is rounded up by 10%.
  assert res.memory[0]['allocator_rounding'] == 109
  assert res.peak_memory == [3000 + 1090 + 109]
  # A compiled cell's buffers are allocated for each call too.
  res = cost_model.Simulate([cell], 4, spec, recompute=True, compiled=True)
  assert res.memory[0]['allocator_rounding'] == 209  # and its gradients
  # Activations allocated once (no re-materialization): no rounding.
  res = cost_model.Simulate([cell], 4, spec, recompute=False)
  assert 'allocator_rounding' not in res.memory[0]


def testReMaterializingOneMicroBatchCostsNoMemory():
  # At M=1 the recomputation allocates the forward pass's buffers again, in
  # the same order: no rounding, and the same peak as without it.
  spec = _FREE_LINKS._replace(allocator_overhead=0.15)
  cell = _Cell(weight_bytes=1000, input_bytes=10, activation_bytes=50)
  with_rc = cost_model.Simulate([cell], 1, spec, recompute=True)
  without = cost_model.Simulate([cell], 1, spec, recompute=False)
  assert 'allocator_rounding' not in with_rc.memory[0]
  assert with_rc.peak_memory == without.peak_memory
  assert cost_model.PeakMemoryBytes(
    cell, 1, True, allocator_overhead=0.15
  ) == cost_model.PeakMemoryBytes(cell, 1, False, allocator_overhead=0.15)
  # From M=2 on, the buffers are allocated again for every micro-batch.
  rc2 = cost_model.Simulate([cell], 2, spec, recompute=True)
  assert rc2.memory[0]['allocator_rounding'] > 0


def testAllocatorOverheadOfThePresets():
  # TensorFlow's BFC allocator (CPU, GPU) rounds buffers up; XLA on TPU
  # assigns them ahead of time.
  assert device_presets.GetPreset('cpu').Spec().allocator_overhead > 0
  assert device_presets.GetPreset('h100').Spec().allocator_overhead > 0
  assert device_presets.GetPreset('tpu_v3').Spec().allocator_overhead == 0


def testOneFOneBTakesAsLongAndHoldsFewerMicroBatches():
  cells = [
    _Cell(weight_bytes=1000, input_bytes=10, activation_bytes=50),
    _Cell(weight_bytes=400, input_bytes=20, activation_bytes=30),
  ]
  gpipe = cost_model.Simulate(cells, 4, _FREE_LINKS, recompute=True)
  res = cost_model.Simulate(
    cells, 4, _FREE_LINKS, recompute=True, schedule_name='1f1b'
  )
  # Uniform cells: the same bubble, so the same step.
  assert res.step_s == pytest.approx(gpipe.step_s)
  # Cell k holds at most K - k micro-batches' inputs (GPipe: all M = 4).
  assert res.peak_memory == [4 * 1000 + 2 * 10 + 50, 4 * 400 + 1 * 20 + 30]
  # Every work item of the schedule ran once, in each device's order.
  assert len(res.events) == 2 * 2 * 4
  for k in range(2):
    mine = [e for e in res.events if e[1] == k]
    assert all(a[4] <= b[3] for a, b in zip(mine, mine[1:]))
  with pytest.raises(ValueError, match="schedule 'circular' is not one of"):
    cost_model.Simulate(cells, 4, _FREE_LINKS, schedule_name='circular')


def testInterleavedRunsKCellsOnDDevicesWithASmallerBubble():
  """K=4 cells on D=2 devices (cell k on device k mod 2): each device's
  figures are its two cells', and the step is shorter than fill-drain's
  over the same devices with each device's two cells as one."""
  halves = [
    _Cell(
      fprop_s=0.5,
      bprop_s=1.0,
      weight_bytes=w,
      input_bytes=10,
      activation_bytes=a,
    )
    for w, a in ((1000, 50), (400, 30), (1000, 50), (400, 30))
  ]
  res = cost_model.Simulate(
    halves, 4, _FREE_LINKS, schedule_name='interleaved', num_devices=2
  )
  merged = [_Cell(fprop_s=1.0, bprop_s=2.0)] * 2
  gpipe = cost_model.Simulate(merged, 4, _FREE_LINKS)
  assert gpipe.step_s == pytest.approx(5 * 1.0 + 5 * 3.0)  # (M+K-1)(f+b+f)
  # Forwards: device 0 busy 8 of 9 half-clocks; the backward mirrors them.
  assert res.step_s == pytest.approx(9 * 0.5 + 9 * 1.5)
  assert res.step_s < gpipe.step_s
  assert len(res.busy_fraction) == len(res.peak_memory) == 2
  assert sum(res.busy_fraction) == pytest.approx(2 * 16 / 18)
  # Device 0 holds cells 0 and 2: weights, gradients and 2 slots of both,
  # the stored inputs of all 4 micro-batches of both, the activations of
  # one cell recomputed at a time.
  assert res.peak_memory[0] == 4 * 2000 + 2 * 4 * 10 + 50
  assert res.peak_memory[1] == 4 * 800 + 2 * 4 * 10 + 30
  # Without re-materialization both cells keep every micro-batch's.
  kept = cost_model.Simulate(
    halves, 4, _FREE_LINKS, False, schedule_name='interleaved', num_devices=2
  )
  assert kept.peak_memory[0] == 4 * 2000 + 2 * 4 * 10 + 2 * 4 * 50
  # Every link crosses devices: device 0 sends cell 0's and cell 2's
  # outputs and cell 2's input gradient, device 1 the mirror.
  sent = cost_model.Simulate(
    [c._replace(out_bytes=100) for c in halves],
    4,
    _FREE_LINKS,
    schedule_name='interleaved',
    num_devices=2,
  ).bytes_sent
  assert sent == [3 * 4 * 100, 3 * 4 * 100]
