"""Unit tests for lingvo_gpipe.pipeline.timeline on hand-made events."""

import json

import pytest

from lingvo_gpipe.pipeline import timeline

# (pass, cell, micro-batch, start_s, end_s): cell 1 idles in [0, 1).
_EVENTS = [
  ('forward', 0, 0, 0.0, 1.0),
  ('forward', 1, 0, 1.0, 2.0),
  ('backward', 1, 0, 2.0, 3.0),
  ('backward', 0, 0, 3.0, 4.0),
]


def testUtilizationIsBusyTimeOverStepSpan():
  assert timeline.Utilization(_EVENTS) == {0: 0.5, 1: 0.5}
  assert timeline.Utilization([('forward', 0, 0, 5.0, 6.0)]) == {0: 1.0}
  assert timeline.Utilization([]) == {}


def testChromeTraceHasOneBoxPerEventAndNamedRows(tmp_path):
  trace = timeline.ToChromeTrace(_EVENTS, devices=['/cpu:0', '/cpu:1'])
  boxes = [e for e in trace['traceEvents'] if e['ph'] == 'X']
  assert [b['name'] for b in boxes] == ['F0', 'F0', 'B0', 'B0']
  assert boxes[1]['ts'] == pytest.approx(1e6)
  assert boxes[1]['dur'] == pytest.approx(1e6)
  assert boxes[1]['tid'] == 1 and boxes[1]['args']['device'] == '/cpu:1'
  names = {
    e['tid']: e['args']['name'] for e in trace['traceEvents'] if e['ph'] == 'M'
  }
  assert names == {0: 'cell 0 (/cpu:0)', 1: 'cell 1 (/cpu:1)'}
  path = timeline.WriteChromeTrace(_EVENTS, str(tmp_path / 't.json'))
  with open(path) as f:
    assert json.load(f) == timeline.ToChromeTrace(_EVENTS)


def testPlotTimelineWritesAPng(tmp_path):
  pytest.importorskip('matplotlib')
  path = timeline.PlotTimeline(_EVENTS, str(tmp_path / 't.png'))
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
