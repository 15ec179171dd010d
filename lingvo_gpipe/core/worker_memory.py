"""What each remote worker process holds in memory, read by the worker itself.

TensorFlow reports allocator figures only for a process's own devices (a
remote worker's device raises "No matching devices"). Every TensorFlow
worker can still read its own `/proc/self/status` and its host's
`/proc/meminfo`: a `tf.io.read_file` placed on the worker's CPU runs in the
worker's process. One small function reads both on every worker, so the
trainer knows each worker's resident memory (now and peak), its process id
and its host's free memory after any step, with no extra server on the
workers, on this host or another.

    memory = worker_memory.WorkerMemory(cluster.spec)
    memory.Sample(step)           # after a step
    memory.Line()                 # 'Worker memory (resident, peak): ...'
    memory.Describe(name)         # for the message about a lost worker

When a worker is lost, `Describe` names its last measured peak and, if the
worker ran on this host, whether the kernel's out-of-memory killer ended it
(the kernel log names the killed process id).

`ReleaseRemoteVariables` frees a process's variables on its workers before
the process ends without destructors (the trainer's `os._exit`): otherwise
the workers keep them until they are restarted.
"""

import collections
import re
import subprocess
import threading
import time

import tensorflow as tf

from lingvo_gpipe.core import cluster as cluster_lib
from lingvo_gpipe.core import proc_status

__all__ = [
  'WorkerMemory',
  'Sample',
  'ParseStatus',
  'OomKilled',
  'ReleaseRemoteVariables',
]

# One reading of one worker: its resident set now and at its peak, its
# process id, its host's available and total memory (bytes), the global step
# after which it was read and when.
Sample = collections.namedtuple(
  'Sample', 'step rss rss_peak pid host_available host_total time'
)

_LOCAL_HOSTS = ('127.0.0.1', 'localhost', '::1', '[::1]')
# A host with less than this fraction of its memory available is reported
# as nearly full.
_NEARLY_FULL = 0.1


def ParseStatus(status_text, meminfo_text):
  """(rss, rss_peak, pid, host_available, host_total) in bytes (pid: an
  int) from the text of /proc/self/status and /proc/meminfo; None where a
  field is missing."""

  return (
    proc_status.Field(status_text, 'VmRSS'),
    proc_status.Field(status_text, 'VmHWM'),
    proc_status.Field(status_text, 'Pid'),
    proc_status.Field(meminfo_text, 'MemAvailable'),
    proc_status.Field(meminfo_text, 'MemTotal'),
  )


def _KernelLog():
  """This host's kernel log (text), or '' where it cannot be read."""
  try:
    res = subprocess.run(
      ['dmesg'], capture_output=True, text=True, timeout=10, check=False
    )
  except (OSError, subprocess.SubprocessError):
    return ''
  return res.stdout if res.returncode == 0 else ''


def OomKilled(pid, kernel_log):
  """The kernel log's line saying that the out-of-memory killer ended
  process `pid`, or None."""
  if pid is None:
    return None
  for line in reversed(kernel_log.splitlines()):
    if re.search(
      rf'(Out of memory|oom_reaper).*[Kk]illed process {pid}\b', line
    ):
      return line.split('] ', 1)[-1].strip()
  return None


def _Gb(n):
  return f'{n / 1e9:.2f} GB'


class WorkerMemory:
  """Samples the resident memory of every task of a cluster spec.

  Args:
    spec: {job: [host:port, ...]} (`cluster.Cluster.spec`).
    kernel_log: a callable returning this host's kernel log text (tests).
  """

  def __init__(self, spec, kernel_log=_KernelLog):
    self._spec = spec
    self._kernel_log = kernel_log
    self._tasks = [
      (job, i, address)
      for job, addresses in sorted(spec.items())
      for i, address in enumerate(addresses)
    ]
    self.last = collections.OrderedDict()  # worker name -> Sample
    self._fn = None

  def _Name(self, job, task):
    return cluster_lib.WorkerName(job, task, self._spec)

  def _Read(self):
    texts = []
    for job, task, _ in self._tasks:
      with tf.device(f'/job:{job}/replica:0/task:{task}/device:CPU:0'):
        texts.append(
          (
            tf.io.read_file('/proc/self/status'),
            tf.io.read_file('/proc/meminfo'),
          )
        )
    return texts

  def Sample(self, step):
    """Reads every worker's memory after global step `step`; returns
    {worker name: Sample}. A worker that cannot be read keeps its last
    sample (the error is the step's to report)."""
    if self._fn is None:
      self._fn = tf.function(self._Read, autograph=False)
    try:
      texts = self._fn()
    except tf.errors.OpError:
      return dict(self.last)
    now = time.time()
    for (job, task, _), (status, meminfo) in zip(self._tasks, texts):
      rss, peak, pid, avail, total = ParseStatus(
        status.numpy().decode(errors='replace'),
        meminfo.numpy().decode(errors='replace'),
      )
      self.last[self._Name(job, task)] = Sample(
        int(step), rss, peak, pid, avail, total, now
      )
    return dict(self.last)

  def Line(self):
    """One line: each worker's peak resident memory, or '' before any
    sample."""
    if not self.last:
      return ''
    parts = [
      f'{name.split(" ")[0]} {_Gb(s.rss_peak)}'
      for name, s in self.last.items()
      if s.rss_peak is not None
    ]
    return 'Worker memory (resident, peak): ' + ', '.join(parts) + '.'

  def _IsLocal(self, name):
    address = name.split('(', 1)[-1].rstrip(')')
    return address.rsplit(':', 1)[0] in _LOCAL_HOSTS

  def Describe(self, name):
    """What is known of lost worker `name` (a `cluster.WorkerName`): how
    it ended if the kernel says so, and its last measured memory. '' if
    nothing is known."""
    s = self.last.get(name)
    if s is None:
      return ''
    oom = None
    if self._IsLocal(name):
      oom = OomKilled(s.pid, self._kernel_log())
    parts = []
    if oom:
      parts.append(
        f"{name.split(' ')[0]} ran out of memory: the kernel's "
        f'out-of-memory killer ended it (pid {s.pid}; kernel log: "{oom}")'
      )
    if s.rss_peak is not None:
      text = (
        f'its last measured resident memory was {_Gb(s.rss_peak)} at its '
        f'peak ({_Gb(s.rss)} then) after step {s.step}'
      )
      if s.host_available is not None and s.host_total:
        text += (
          f", with {_Gb(s.host_available)} of its host's "
          f'{_Gb(s.host_total)} available'
        )
        if not oom and s.host_available < _NEARLY_FULL * s.host_total:
          text += (
            ": the host was nearly out of memory, so the kernel's "
            'out-of-memory killer most likely ended it'
          )
      parts.append(text)
    return '; '.join(parts)


def _IsRemote(device):
  job = tf.DeviceSpec.from_string(device or '').job
  return job not in (None, 'localhost')


def ReleaseRemoteVariables(variables, timeout_s=30.0):
  """Frees on their workers the memory of the `variables` of this process
  that live on a remote worker's device; returns how many were emptied.

  A worker frees a client's variable when the client deletes the
  variable's handle (the handle owns it). A process that ends without
  running its destructors (`os._exit`, which the trainer uses so that
  TensorFlow's shutdown cannot hang it) deletes none, and every worker
  keeps that process's weights and optimizer slots until the worker itself
  ends: a trainer rerun against the same workers then holds the model
  twice. This assigns each remote variable an empty value, so its worker
  frees the buffer (the variable is unusable after). A worker that does not
  answer is skipped (its memory goes with it); the whole release is bounded
  by `timeout_s`.
  """
  remote = [
    v
    for v in variables
    if _IsRemote(getattr(v, 'device', None))
    and v.dtype not in (tf.string, tf.variant, tf.resource)
  ]
  if not remote:
    return 0
  by_device = collections.OrderedDict()
  for v in remote:
    by_device.setdefault(v.device, []).append(v)
  emptied = [0]

  def Release():
    for device, vs in by_device.items():
      try:
        with tf.device(device):
          empty = {}
          for v in vs:
            if v.dtype not in empty:
              empty[v.dtype] = tf.zeros([0], v.dtype)
            tf.raw_ops.AssignVariableOp(
              resource=v.handle, value=empty[v.dtype], validate_shape=False
            )
          # Remote ops run asynchronously, in order: reading a result made
          # after them on the same device waits until the worker ran them.
          tf.zeros([]).numpy()
        emptied[0] += len(vs)
      except (tf.errors.OpError, ValueError):
        continue  # A lost worker: nothing to free there.

  thread = threading.Thread(target=Release, name='release-remote', daemon=True)
  thread.start()
  thread.join(timeout_s)
  return emptied[0]
