"""608M LM, pipeline-8 over 8 workers with allocator statistics: each
worker's allocator peak, RSS peak and baseline after 6 steps and a save."""

import json
import subprocess
import sys
import time
from lingvo_gpipe.core import cluster
from lingvo_gpipe.runners import device_memory

M = 'lm.one_billion_wds.OneBWdsGPipeTransformerHalfB'
with cluster.LocalCluster(
  8,
  intra_op_threads=1,
  inter_op_threads=2,
  memory_stats=True,
  startup_timeout_s=180,
) as c:
  status = device_memory.StatusMap(c.devices, c.status_addresses)
  before = device_memory.DeviceDetails(c.devices, status)
  t0 = time.time()
  r = subprocess.run(
    [
      sys.executable,
      '-m',
      'lingvo_gpipe.trainer',
      f'--model={M}',
      '--logdir=/tmp/halfb/m/logdir',
      '--cluster_spec=worker=' + ','.join(c.addresses),
      '--worker_split_size=8',
      '--max_steps=6',
      '--log_interval_steps=1',
    ],
    capture_output=True,
    text=True,
  )
  wall = time.time() - t0
  after = device_memory.DeviceDetails(c.devices, status)
  out = {'rc': r.returncode, 'wall_s': wall, 'devices': {}}
  for d in c.devices:
    out['devices'][d] = dict(
      peak=after[d]['peak'],
      current=after[d]['current'],
      rss_peak=after[d]['rss_peak'],
      rss_baseline=before[d]['rss_baseline'],
    )
  steps = [
    l for l in r.stderr.splitlines() if 'ms/step' in l or 'first step' in l
  ]
  out['step_lines'] = steps
  json.dump(out, open('/tmp/halfb/m/measured.json', 'w'), indent=1)
  print(json.dumps(out, indent=1))
  print(r.stderr[-1500:])
