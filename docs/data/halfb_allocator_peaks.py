"""608M LM, pipeline-8 over 8 workers with allocator statistics: each
worker's allocator peak, RSS peak and baseline after 6 steps and a save, and
the host's least available memory (sampled every 0.5 s).

    python docs/data/halfb_allocator_peaks.py [LAYERS SPLITS [STEPS]]

LAYERS and SPLITS (e.g. 14 2,4,6,8,10,12,13,14) override the registered
12 layers and their split, to find the largest model this host holds.
"""

import json
import subprocess
import sys
import threading
import time

from lingvo_gpipe.core import cluster
from lingvo_gpipe.core import proc_status
from lingvo_gpipe.runners import device_memory

M = 'lm.one_billion_wds.OneBWdsGPipeTransformerHalfB'
OVERRIDE = []
if len(sys.argv) > 2:
  OVERRIDE = [
    '--model_params_override='
    f'task.lm.stack.num_encoder_layers : {int(sys.argv[1])}; '
    f'task.lm.stack.splits : [{sys.argv[2]}]'
  ]
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 6

least = [float('inf')]
done = threading.Event()


def _Sample():
  while not done.wait(0.5):
    with open('/proc/meminfo') as f:
      avail = proc_status.Field(f.read(), 'MemAvailable')
    if avail is not None:
      least[0] = min(least[0], avail)


with cluster.LocalCluster(
  8,
  intra_op_threads=1,
  inter_op_threads=2,
  memory_stats=True,
  startup_timeout_s=180,
) as c:
  status = device_memory.StatusMap(c.devices, c.status_addresses)
  before = device_memory.DeviceDetails(c.devices, status)
  threading.Thread(target=_Sample, daemon=True).start()
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
      f'--max_steps={STEPS}',
      '--log_interval_steps=1',
      *OVERRIDE,
    ],
    capture_output=True,
    text=True,
  )
  wall = time.time() - t0
  done.set()
  after = device_memory.DeviceDetails(c.devices, status)
  out = {
    'rc': r.returncode,
    'wall_s': wall,
    'override': OVERRIDE,
    'host_least_available_bytes': least[0],
    'devices': {},
  }
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
