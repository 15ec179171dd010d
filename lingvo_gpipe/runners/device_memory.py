"""Per-device memory: current and peak bytes of every device of a pipeline.

Each device reports what it spends itself:

  * A device of this process (a GPU, a logical GPU, this process's CPU):
    `tf.config.experimental.get_memory_info`, read here.
  * A device of another TensorFlow server process (a worker of a cluster,
    one process per accelerator): the worker serves its own allocator figures
    and its resident set over a small HTTP status endpoint
    (`tf_server --status_port`), because TensorFlow cannot read a remote
    device's allocator ("No matching devices found").

    from lingvo_gpipe.runners import device_memory
    with cluster.LocalCluster(2, memory_stats=True) as c:
      cluster.Connect(c.cluster_spec)
      status = device_memory.StatusMap(c.devices, c.status_addresses)
      device_memory.ResetPeaks(c.devices, status)
      ...one training step...
      device_memory.DeviceMemory(c.devices, status)
      # {'/job:worker/replica:0/task:0/device:CPU:0': (current, peak), ...}

On CPU, TensorFlow keeps allocator statistics only with its BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=1`, set before the first op: `EnableCpuStats()`),
which is also the allocator GPUs and TPUs use; `TF_CPU_BFC_MEM_LIMIT_IN_MB`
then caps the device like an accelerator's memory. Virtual CPU devices of one
process share that one allocator: their figures are the process's, and
`SharedAllocatorNote` says so.
"""

import collections
import http.server
import json
import os
import re
import threading
import urllib.error
import urllib.request

from lingvo_gpipe.core import proc_status

__all__ = [
  'EnableCpuStats',
  'ProcessMemory',
  'StatusServer',
  'StatusMap',
  'DeviceMemory',
  'DeviceDetails',
  'ResetPeaks',
  'SharedAllocatorNote',
  'MemoryStatsUnavailable',
  'TaskOf',
]

_STATUS_TIMEOUT_S = 10.0


class MemoryStatsUnavailable(RuntimeError):
  """A device's memory figures cannot be read (named in the message)."""


def EnableCpuStats(limit_mb=None):
  """Makes CPU allocations countable (and optionally capped) in this process.

  Must run before TensorFlow allocates its first CPU tensor (environment
  variables read when the allocator is made).

  Args:
    limit_mb: if set, the CPU allocator refuses to hold more than this many
      MiB (an allocation beyond it fails with ResourceExhaustedError), like an
      accelerator with that much memory.
  """
  os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = '1'
  if limit_mb:
    os.environ['TF_CPU_BFC_MEM_LIMIT_IN_MB'] = str(int(limit_mb))


def ProcessMemory():
  """(resident bytes now, peak resident bytes) of this process (Linux)."""
  s = proc_status.ReadStatus()
  return s.get('VmRSS'), s.get('VmHWM')


def _ResetRssPeak():
  """Resets this process's VmHWM to its current RSS (Linux >= 4.0)."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def _LocalInfo(device):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  try:
    info = tf.config.experimental.get_memory_info(device)
  except ValueError as e:
    hint = (
      ' On CPU, call device_memory.EnableCpuStats() before the first '
      'op (or set TF_CPU_ALLOCATOR_USE_BFC=1).'
      if 'CPU' in device.upper()
      else ''
    )
    raise MemoryStatsUnavailable(
      f'No allocator figures for {device}: {e}.{hint}'
    ) from e
  return info['current'], info['peak']


def _LocalReset(device):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  try:
    tf.config.experimental.reset_memory_stats(device)
  except ValueError as e:
    raise MemoryStatsUnavailable(f'Cannot reset {device}: {e}') from e


class StatusServer:
  """The worker's side: serves this process's memory figures over HTTP.

    GET  /memory -> {"device": ..., "current": B, "peak": B, "rss": B,
                     "rss_peak": B, "rss_baseline": B, "pid": ...}
    POST /reset  -> resets the allocator peak and the RSS peak, returns
                    /memory's answer after the reset.

  `rss_baseline` is the resident set when `MarkBaseline` was called (by
  tf_server once TensorFlow and its server are up, before any model), so
  `rss_peak - rss_baseline` cross-checks the allocator's peak.
  """

  def __init__(self, port, host='127.0.0.1', device='/device:CPU:0'):
    self.device = device
    self.rss_baseline = ProcessMemory()[0]
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def _Reply(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def do_GET(self):  # pylint: disable=invalid-name
        if self.path.rstrip('/') != '/memory':
          self._Reply({'error': f'unknown path {self.path}'}, 404)
          return
        self._Reply(outer.Snapshot())

      def do_POST(self):  # pylint: disable=invalid-name
        if self.path.rstrip('/') != '/reset':
          self._Reply({'error': f'unknown path {self.path}'}, 404)
          return
        outer.Reset()
        self._Reply(outer.Snapshot())

      def log_message(self, *unused):  # quiet
        pass

    self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
    self.port = self._httpd.server_address[1]
    self._thread = threading.Thread(
      target=self._httpd.serve_forever, name='memory-status', daemon=True
    )

  def Start(self):
    self._thread.start()
    return self

  def MarkBaseline(self):
    """Records the resident set now as the one before any model."""
    self.rss_baseline = ProcessMemory()[0]

  def Stop(self):
    self._httpd.shutdown()
    self._httpd.server_close()

  def Snapshot(self):
    rss, rss_peak = ProcessMemory()
    out = dict(
      device=self.device,
      pid=os.getpid(),
      rss=rss,
      rss_peak=rss_peak,
      rss_baseline=self.rss_baseline,
    )
    try:
      out['current'], out['peak'] = _LocalInfo(self.device)
    except MemoryStatsUnavailable as e:
      out['current'] = out['peak'] = None
      out['error'] = str(e)
    return out

  def Reset(self):
    try:
      _LocalReset(self.device)
    except MemoryStatsUnavailable:
      pass
    _ResetRssPeak()


def TaskOf(device):
  """(job, task) of a device name, or None for a device without a job."""
  m = re.search(r'/job:([^/]+)/replica:\d+/task:(\d+)', device)
  return (m.group(1), int(m.group(2))) if m else None


def StatusMap(devices, status_addresses, job='worker'):
  """{device: 'host:port' of its worker's status endpoint}.

  Args:
    devices: device names, e.g. '/job:worker/replica:0/task:1/device:CPU:0'.
    status_addresses: the status endpoints of tasks 0, 1, ... of `job`
      (`LocalCluster.status_addresses`), or a dict task -> address.
    job: the job the addresses belong to.
  """
  if not isinstance(status_addresses, dict):
    status_addresses = dict(enumerate(status_addresses))
  out = {}
  for d in devices:
    t = TaskOf(d)
    if t and t[0] == job and t[1] in status_addresses:
      out[d] = status_addresses[t[1]]
  return out


def _IsLocal(device):
  """Whether `device` belongs to this process (no job, or this process's)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if TaskOf(device) is None:
    return True
  try:
    tf.config.experimental.get_memory_info(device)
    return True
  except ValueError as e:
    return 'No matching devices' not in str(e)


def _Http(address, path, method='GET'):
  req = urllib.request.Request(
    f'http://{address}{path}',
    method=method,
    data=b'' if method == 'POST' else None,
  )
  try:
    with urllib.request.urlopen(req, timeout=_STATUS_TIMEOUT_S) as r:
      return json.loads(r.read())
  except (urllib.error.URLError, OSError, ValueError) as e:
    raise MemoryStatsUnavailable(
      f'The memory status endpoint {address} did not answer ({e}). Start '
      'the worker with --status_port (LocalCluster(memory_stats=True)).'
    ) from e


def DeviceDetails(devices, status=None):
  """{device: dict(current, peak, rss, rss_peak, rss_baseline, source)}.

  Args:
    devices: device names (a pipeline's `devices`, or `replica_devices`
      flattened).
    status: {device: 'host:port'} of remote devices' status endpoints
      (`StatusMap`). A device in it is read from its endpoint; any other must
      belong to this process.

  Raises:
    MemoryStatsUnavailable: naming the device whose figures cannot be read.
  """
  status = status or {}
  out = collections.OrderedDict()
  local = [d for d in devices if d not in status]
  for d in devices:
    if d in status:
      snap = _Http(status[d], '/memory')
      if snap.get('current') is None:
        raise MemoryStatsUnavailable(
          f'{d} (status {status[d]}): {snap.get("error")}. Start the worker '
          'with --allocator_stats.'
        )
      snap['source'] = f'worker allocator via {status[d]}'
      out[d] = snap
    else:
      if not _IsLocal(d):
        raise MemoryStatsUnavailable(
          f'{d} is a remote device and no status endpoint is given for it: '
          'pass status=device_memory.StatusMap(devices, '
          'cluster.status_addresses).'
        )
      current, peak = _LocalInfo(d)
      rss, rss_peak = ProcessMemory()
      out[d] = dict(
        current=current,
        peak=peak,
        rss=rss,
        rss_peak=rss_peak,
        rss_baseline=None,
        pid=os.getpid(),
        source='local allocator',
      )
  note = SharedAllocatorNote(local)
  if note:
    for d in local:
      if 'CPU' in d.upper():
        out[d]['source'] = note
  return out


def DeviceMemory(devices, status=None):
  """{device: (current bytes, peak bytes)} for `devices` (see DeviceDetails)."""
  return collections.OrderedDict(
    (d, (v['current'], v['peak']))
    for d, v in DeviceDetails(devices, status).items()
  )


def ResetPeaks(devices, status=None):
  """Resets the peak of every device in `devices` (and remote RSS peaks)."""
  status = status or {}
  done = set()
  for d in devices:
    if d in status:
      if status[d] not in done:
        _Http(status[d], '/reset', method='POST')
        done.add(status[d])
    else:
      _LocalReset(d)
  _ResetRssPeak()


def SharedAllocatorNote(devices):
  """A note if several of `devices` are virtual CPUs of one allocator."""
  cpus = sorted({d for d in devices if 'CPU' in d.upper()})
  if len(cpus) > 1:
    return (
      f'shared allocator: the {len(cpus)} virtual CPU devices of this '
      'process share one allocator; each figure is the whole '
      "process's, not the device's"
    )
  return ''
