"""Unit tests for lingvo_gpipe.pipeline.schedule (no pipeline needed)."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.pipeline import schedule

_SHAPES = [(1, 1), (1, 4), (3, 1), (3, 4), (4, 3), (2, 8)]


@pytest.mark.parametrize('k, m', _SHAPES)
def testForwardOrderRunsEachCellOnEachMicroBatchOnce(k, m):
  order = schedule.ForwardOrder(k, m)
  assert sorted((c, mb) for _, c, mb in order) == [
    (c, mb) for c in range(k) for mb in range(m)
  ]
  for clock, cell, mb in order:
    assert clock == cell + mb
  assert [c for c, _, _ in order] == sorted(c for c, _, _ in order)
  # Micro-batch mb reaches cell k+1 after it left cell k.
  when = {(c, mb): clock for clock, c, mb in order}
  for c in range(k - 1):
    for mb in range(m):
      assert when[(c + 1, mb)] > when[(c, mb)]


@pytest.mark.parametrize('k, m', _SHAPES)
def testBackwardOrderMirrorsForward(k, m):
  order = schedule.BackwardOrder(k, m)
  assert sorted((c, mb) for _, c, mb in order) == [
    (c, mb) for c in range(k) for mb in range(m)
  ]
  for clock, cell, mb in order:
    assert clock == (k - 1 - cell) + (m - 1 - mb)
  assert order[0] == (0, k - 1, m - 1)
  assert order[-1] == (m + k - 2, 0, 0)
  # The gradient of micro-batch mb flows from cell k+1 down to cell k.
  when = {(c, mb): clock for clock, c, mb in order}
  for c in range(k - 1):
    for mb in range(m):
      assert when[(c, mb)] > when[(c + 1, mb)]


def testOrdersK3M4MatchTheTable():
  fwd = schedule.ForwardOrder(3, 4)
  assert fwd[:6] == [
    (0, 0, 0),
    (1, 0, 1),
    (1, 1, 0),
    (2, 0, 2),
    (2, 1, 1),
    (2, 2, 0),
  ]
  bwd = schedule.BackwardOrder(3, 4)
  assert bwd[:3] == [(0, 2, 3), (1, 2, 2), (1, 1, 3)]


@pytest.mark.parametrize('k, m', _SHAPES)
def testFillDrainIsEveryForwardThenEveryBackward(k, m):
  items = schedule.FillDrain(k, m)
  n = m + k - 1
  assert len(items) == 2 * k * m
  assert all(isinstance(w, schedule.WorkItem) for w in items)
  kinds = [w.kind for w in items]
  assert kinds == [schedule.FORWARD] * (k * m) + [schedule.BACKWARD] * (k * m)
  assert [w[:3] for w in items[: k * m]] == schedule.ForwardOrder(k, m)
  assert [
    (w.clock - n, w.cell, w.micro_batch) for w in items[k * m :]
  ] == schedule.BackwardOrder(k, m)
  assert max(w.clock for w in items) == 2 * n - 1


@pytest.mark.parametrize('k, m', _SHAPES)
def testBubbleFractionIsTheIdleShareOfTheTable(k, m):
  busy = collections.Counter(c for _, c, _ in schedule.ForwardOrder(k, m))
  n = m + k - 1
  for cell in range(k):
    assert (n - busy[cell]) / n == pytest.approx(schedule.BubbleFraction(k, m))
  assert schedule.IdealSpeedup(k, m) == pytest.approx(
    k * (1 - schedule.BubbleFraction(k, m))
  )


def testBubbleFractionValues():
  assert schedule.BubbleFraction(1, 8) == 0.0
  assert schedule.BubbleFraction(4, 1) == pytest.approx(3 / 4)
  assert schedule.BubbleFraction(4, 16) == pytest.approx(3 / 19)
  assert schedule.IdealSpeedup(1, 5) == 1.0


def testScheduleTextK3M4():
  text = schedule.ScheduleText(3, 4)
  rows = text.split('\n')
  assert len(rows) == 4
  assert rows[0].split() == ['clock'] + [str(c) for c in range(12)]
  assert rows[1].split() == [
    'cell',
    '0',
    'F0',
    'F1',
    'F2',
    'F3',
    '.',
    '.',
    '.',
    '.',
    'B3',
    'B2',
    'B1',
    'B0',
  ]
  assert rows[3].split() == [
    'cell',
    '2',
    '.',
    '.',
    'F0',
    'F1',
    'F2',
    'F3',
    'B3',
    'B2',
    'B1',
    'B0',
    '.',
    '.',
  ]
  assert len({len(r) for r in rows}) == 1  # Columns align.


def testScheduleTextWidensForTwoDigitMicroBatches():
  rows = schedule.ScheduleText(2, 12).split('\n')
  assert 'F11' in rows[1].split() and 'B11' in rows[2].split()
  assert len({len(r) for r in rows}) == 1


def testTracerRecordsEventsRelativeToFirstStart():
  assert schedule.ActiveTracer() is None
  tracer = schedule.ScheduleTracer()
  assert tracer.Tensors().shape == (0, 2)
  assert tracer.Events(np.zeros([0, 2])) == []
  with tracer:
    assert schedule.ActiveTracer() is tracer
    inner = schedule.ScheduleTracer()
    with inner:
      assert schedule.ActiveTracer() is inner
    assert schedule.ActiveTracer() is tracer
    tracer.Record(
      (schedule.FORWARD, 0, 0),
      tf.constant(10.0, tf.float64),
      tf.constant(11.5, tf.float64),
    )
    tracer.Record(
      (schedule.BACKWARD, 1, 0),
      tf.constant(12.0, tf.float64),
      tf.constant(13.0, tf.float64),
    )
  assert schedule.ActiveTracer() is None
  events = tracer.Events(tracer.Tensors())
  assert events == [
    (schedule.FORWARD, 0, 0, 0.0, 1.5),
    (schedule.BACKWARD, 1, 0, 2.0, 3.0),
  ]


def _CheckOrder(work, k, m):
  from lingvo_gpipe.pipeline import engine  # pylint: disable=g-import-not-at-top

  engine.CheckSchedule(work, k, m)  # Dependencies, each item once.
  assert [w.clock for w in work] == sorted(w.clock for w in work)


@pytest.mark.parametrize('k, m', _SHAPES + [(2, 16), (4, 8)])
def testOneFOneBKeepsAtMostKMinusKMicroBatchesPerCell(k, m):
  work = schedule.OneFOneB(k, m)
  _CheckOrder(work, k, m)
  assert schedule.InFlight(work, k) == [min(k - c, m) for c in range(k)]
  assert schedule.InFlight(schedule.FillDrain(k, m), k) == [m] * k
  # One item per cell per clock.
  assert len({(w.clock, w.cell) for w in work}) == len(work)
  # After the warm-up, cell 0 alternates one forward and one backward.
  kinds = [w.kind[0] for w in work if w.cell == 0]
  warm = min(k - 1, m)
  assert kinds[:warm] == ['f'] * warm
  assert kinds[warm : warm + 2 * (m - warm)] == ['f', 'b'] * (m - warm)


def testOneFOneBK3M4MatchesTheTable():
  rows = schedule.ScheduleText(3, 4, schedule='1f1b').split('\n')
  assert rows[1].split()[2:] == ('F0 F1 F2 . . B0 F3 B1 . B2 . B3'.split())
  assert rows[3].split()[2:] == ('. . F0 B0 F1 B1 F2 B2 F3 B3 . .'.split())
  assert len({len(r) for r in rows}) == 1


@pytest.mark.parametrize(
  'k, m, d', [(4, 4, 2), (4, 1, 2), (6, 5, 3), (8, 8, 2)]
)
def testInterleavedRunsOneItemPerDeviceAndClock(k, m, d):
  work = schedule.Interleaved(k, m, d)
  _CheckOrder(work, k, m)
  assert len({(w.clock, w.cell % d) for w in work}) == len(work)
  # The backward is the forward mirrored.
  fwd = [w for w in work if w.kind == schedule.FORWARD]
  n = fwd[-1].clock + 1
  bwd = {(w.cell, w.micro_batch): w.clock for w in work if w not in fwd}
  for w in fwd:
    assert bwd[(w.cell, w.micro_batch)] == 2 * n - 1 - w.clock


def testInterleavedShrinksTheBubble():
  fwd = [w for w in schedule.Interleaved(4, 4, 2) if w.kind == 'forward']
  assert schedule.IdleFraction(fwd, 4, 2) == pytest.approx(1 / 9)
  gpipe = [w for w in schedule.FillDrain(2, 4) if w.kind == 'forward']
  assert schedule.IdleFraction(gpipe, 2) == pytest.approx(1 / 5)
  assert schedule.BubbleFraction(2, 4) == pytest.approx(1 / 5)
  # Groups of D micro-batches go through a device's first cell, then its
  # second: device 0 runs F0 F1 of cell 0, F0 F1 of cell 2, F2 F3 of cell 0.
  dev0 = [(w.cell, w.micro_batch) for w in fwd if w.cell % 2 == 0]
  assert dev0[:6] == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3)]


def testInterleavedTableNamesDevices():
  rows = schedule.ScheduleText(4, 4, 'interleaved', num_devices=2).split('\n')
  assert rows[1].startswith('cell 0  dev 0') and rows[2].startswith(
    'cell 1  dev 1'
  )
  assert rows[3].split()[4:8] == ['.', '.', 'F0', 'F1']
  assert len({len(r) for r in rows}) == 1


def testScheduleTextOfGPipeIsTheDefault():
  assert schedule.ScheduleText(3, 4) == schedule.ScheduleText(3, 4, 'gpipe')
  assert schedule.Build('gpipe', 3, 4) == schedule.FillDrain(3, 4)


def testBadScheduleNamesAndCounts():
  with pytest.raises(ValueError, match=r"schedule='zigzag'; use one of"):
    schedule.Build('zigzag', 2, 2)
  with pytest.raises(
    ValueError, match=r'2 devices must divide .* got 3 cells. Use 2, 4, 6, 8'
  ):
    schedule.Interleaved(3, 4, 2)
