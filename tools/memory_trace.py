"""What a device's memory peak is made of, from a profiler trace of it.

A worker started with allocator statistics and a profiler port
(`cluster.LocalCluster(..., memory_stats=True, profiler=True)`, or
`python -m lingvo_gpipe.runners.tf_server --allocator_stats
--profiler_port=PORT`) records every allocation while it is traced:

  tf.profiler.experimental.client.trace(
      'grpc://' + cluster.profiler_addresses[i], '/tmp/trace/w1', 8000,
      options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))

This tool replays the allocations of such a trace and prints, at the
allocator's peak, the buffers alive, grouped by the op that allocated them
(digits at the end of op names dropped), with the bytes the allocator counts
and the bytes asked for:

  python tools/memory_trace.py /tmp/trace/w1 [--top=20] [--json=PATH]

Buffers allocated before the trace started are only counted in total
("held before the trace"); buffers a worker received from another device
have no op ('(received)').
"""

import argparse
import collections
import glob
import json
import os
import re
import sys

MIB = 2**20


class UsageError(Exception):
  pass


def _XSpace(path):
  files = sorted(
    glob.glob(os.path.join(path, '**', '*.xplane.pb'), recursive=True)
  )
  if os.path.isfile(path):
    files = [path]
  if not files:
    raise UsageError(
      f'No *.xplane.pb under {path!r}: give the directory a profiler trace '
      'was written to (tf.profiler.experimental.client.trace).'
    )
  from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

  quiet_start.ImportTensorFlow(min_log_level='2')
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top

  space = xplane_pb2.XSpace()
  with open(files[-1], 'rb') as f:
    space.ParseFromString(f.read())
  return space


def Events(path):
  """[(time ps, 'alloc'|'free', stats dict)] of a trace, in time order."""
  out = []
  for plane in _XSpace(path).planes:
    names = plane.event_metadata
    stat_names = plane.stat_metadata
    for line in plane.lines:
      for ev in line.events:
        kind = names[ev.metadata_id].name
        if kind not in ('MemoryAllocation', 'MemoryDeallocation'):
          continue
        stats = {}
        for s in ev.stats:
          key = stat_names[s.metadata_id].name
          if s.ref_value:
            stats[key] = stat_names[s.ref_value].name
          else:
            stats[key] = s.str_value or s.int64_value or s.uint64_value
        t = line.timestamp_ns * 1000 + ev.offset_ps
        out.append(
          (t, 'alloc' if kind == 'MemoryAllocation' else 'free', stats)
        )
  out.sort(key=lambda e: e[0])
  return out


def PeakBreakdown(events):
  """The allocator's peak and the buffers alive at it.

  Returns:
    dict(peak_bytes, held_before_bytes, live_bytes, live_requested_bytes,
    groups=[dict(op, shape, count, bytes, requested_bytes)], largest first).
  """
  if not events:
    raise UsageError(
      'The trace has no allocations: trace a worker started with '
      '--allocator_stats, with ProfilerOptions(host_tracer_level=3).'
    )
  peak_i = max(
    range(len(events)), key=lambda i: events[i][2].get('bytes_allocated', 0)
  )
  t0, kind0, s0 = events[0]
  size0 = s0.get('allocation_bytes', 0)
  held = s0.get('bytes_allocated', 0) - (size0 if kind0 == 'alloc' else -size0)
  live = {}
  for _, kind, stats in events[: peak_i + 1]:
    if kind == 'alloc':
      live[stats.get('addr')] = stats
    else:
      live.pop(stats.get('addr'), None)
  groups = collections.defaultdict(lambda: [0, 0, 0])
  for stats in live.values():
    op = re.sub(r'_\d+$', '', str(stats.get('tf_op') or '(received)'))
    key = (op, str(stats.get('shape', '')))
    g = groups[key]
    g[0] += 1
    g[1] += stats.get('allocation_bytes', 0)
    g[2] += stats.get('requested_bytes', 0)
  rows = [
    dict(op=op, shape=shape, count=c, bytes=b, requested_bytes=r)
    for (op, shape), (c, b, r) in groups.items()
  ]
  rows.sort(key=lambda r: -r['bytes'])
  return dict(
    peak_bytes=events[peak_i][2].get('bytes_allocated', 0),
    held_before_bytes=held,
    live_bytes=sum(r['bytes'] for r in rows),
    live_requested_bytes=sum(r['requested_bytes'] for r in rows),
    groups=rows,
  )


def Table(result, top):
  lines = [
    f'peak {result["peak_bytes"] / MIB:.2f} MiB = held before the trace '
    f'{result["held_before_bytes"] / MIB:.2f} MiB + buffers of the trace '
    f'alive at the peak {result["live_bytes"] / MIB:.2f} MiB '
    f'({result["live_requested_bytes"] / MIB:.2f} MiB asked for; the '
    'allocator rounds buffers up to the chunks it gives them)',
    f'{"count":>6} {"MiB":>8} {"asked":>8}  op [shape]',
  ]
  for r in result['groups'][:top]:
    lines.append(
      f'{r["count"]:>6} {r["bytes"] / MIB:>8.3f} '
      f'{r["requested_bytes"] / MIB:>8.3f}  {r["op"]} {r["shape"]}'
    )
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('trace', help='A trace directory (or .xplane.pb file).')
  parser.add_argument('--top', type=int, default=20)
  parser.add_argument('--json', default='', help='Write the breakdown here.')
  args = parser.parse_args(argv)
  try:
    result = PeakBreakdown(Events(args.trace))
  except UsageError as e:
    print(f'memory_trace: {e}', file=sys.stderr)
    return 2
  print(Table(result, args.top))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
    print(f'Wrote {args.json}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
