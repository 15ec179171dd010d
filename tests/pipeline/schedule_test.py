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
