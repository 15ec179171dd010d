"""Pipeline timelines: where the bubble is.

Turns the events of a `schedule.ScheduleTracer` — (pass, cell, micro-batch,
start_s, end_s) — into a Chrome trace (chrome://tracing, Perfetto) and a PNG
chart with one row per cell, one box per micro-batch, forward boxes in blue
and backward boxes in orange; idle gaps are the bubble.
"""

import json

__all__ = ['ToChromeTrace', 'WriteChromeTrace', 'PlotTimeline', 'Utilization']


def ToChromeTrace(events, devices=None):
  """Chrome trace-event JSON (a dict) of `events`."""
  trace = []
  for pass_name, cell, mb, start, end in events:
    trace.append(
      {
        'name': f'{pass_name[0].upper()}{mb}',
        'cat': pass_name,
        'ph': 'X',
        'ts': start * 1e6,
        'dur': max(end - start, 0.0) * 1e6,
        'pid': 0,
        'tid': cell,
        'args': {
          'micro_batch': mb,
          'cell': cell,
          'device': devices[cell] if devices else '',
        },
      }
    )
  cells = sorted({e[1] for e in events})
  for cell in cells:
    label = f'cell {cell}' + (f' ({devices[cell]})' if devices else '')
    trace.append(
      {
        'name': 'thread_name',
        'ph': 'M',
        'pid': 0,
        'tid': cell,
        'args': {'name': label},
      }
    )
  return {'traceEvents': trace, 'displayTimeUnit': 'ms'}


def WriteChromeTrace(events, path, devices=None):
  with open(path, 'w') as f:
    json.dump(ToChromeTrace(events, devices), f)
  return path


def Utilization(events):
  """{cell: busy time / span of the step}: 1 - bubble fraction per cell."""
  if not events:
    return {}
  t0 = min(e[3] for e in events)
  t1 = max(e[4] for e in events)
  span = max(t1 - t0, 1e-12)
  out = {}
  for cell in sorted({e[1] for e in events}):
    busy = sum(e[4] - e[3] for e in events if e[1] == cell)
    out[cell] = busy / span
  return out


def PlotTimeline(events, path, title='', devices=None):
  """Writes a PNG chart of the schedule to `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  cells = sorted({e[1] for e in events})
  fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(cells)))
  colors = {'forward': '#4C72B0', 'backward': '#DD8452'}
  util = Utilization(events)
  for pass_name, cell, mb, start, end in events:
    ax.barh(
      cell,
      (end - start) * 1e3,
      left=start * 1e3,
      height=0.6,
      color=colors.get(pass_name, 'gray'),
      edgecolor='black',
      linewidth=0.4,
    )
    if end - start > 0:
      ax.text(
        (start + end) / 2 * 1e3,
        cell,
        f'{"F" if pass_name == "forward" else "B"}{mb}',
        ha='center',
        va='center',
        fontsize=7,
        color='white',
      )
  ax.set_yticks(cells)
  ax.set_yticklabels(
    [
      f'cell {c}'
      + (f'\n{devices[c]}' if devices else '')
      + f'\n{100 * util.get(c, 0):.0f}% busy'
      for c in cells
    ],
    fontsize=7,
  )
  ax.invert_yaxis()
  ax.set_xlabel('time (ms)')
  ax.set_title(
    title
    or 'Pipeline schedule (blue: forward, orange: backward; gaps: bubble)',
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
