"""What the trainer knows of a worker's memory, and how a lost worker is
described: parsing, the kernel's out-of-memory line, a nearly full host.

A real sample of worker processes is in cluster_test (remote cluster).
"""

import subprocess
import sys

from lingvo_gpipe import trainer_errors
from lingvo_gpipe.core import proc_status
from lingvo_gpipe.core import worker_memory

STATUS = 'Name:\tpython\nPid:\t4242\nVmHWM:\t 3276800 kB\nVmRSS:\t 2097152 kB\n'
MEMINFO = 'MemTotal:       24684084 kB\nMemAvailable:     512000 kB\n'
SPEC = {'worker': ['127.0.0.1:5000', '127.0.0.1:5001']}
LOST = '/job:worker/task:1 (127.0.0.1:5001)'
KERNEL_LOG = (
  '[37029.49] oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=4242\n'
  '[37029.50] Out of memory: Killed process 4242 (python) total-vm:744kB, '
  'anon-rss:3792168kB\n'
)


def _Memory(kernel_log='', meminfo=MEMINFO, spec=SPEC):
  memory = worker_memory.WorkerMemory(spec, kernel_log=lambda: kernel_log)
  rss, peak, pid, avail, total = worker_memory.ParseStatus(STATUS, meminfo)
  name = worker_memory.cluster_lib.WorkerName('worker', 1, spec)
  memory.last[name] = worker_memory.Sample(20, rss, peak, pid, avail, total, 0)
  return memory, name


def testParseStatus():
  assert worker_memory.ParseStatus(STATUS, MEMINFO) == (
    2097152 * 1024,
    3276800 * 1024,
    4242,
    512000 * 1024,
    24684084 * 1024,
  )
  assert worker_memory.ParseStatus('', '') == (None,) * 5


def testOomKilledFindsTheLineOfThatProcessOnly():
  line = worker_memory.OomKilled(4242, KERNEL_LOG)
  assert line.startswith('Out of memory: Killed process 4242 (python)'), line
  assert worker_memory.OomKilled(424, KERNEL_LOG) is None
  assert worker_memory.OomKilled(None, KERNEL_LOG) is None
  assert worker_memory.OomKilled(4242, '') is None


def testAnOutOfMemoryKillIsReportedWithTheLastPeak():
  memory, name = _Memory(kernel_log=KERNEL_LOG)
  assert name == LOST
  text = trainer_errors.LostWorkers([LOST], memory)
  assert text.startswith(
    f'Lost worker {LOST} during training: it no longer accepts connections'
  ), text
  assert (
    "/job:worker/task:1 ran out of memory: the kernel's out-of-memory "
    'killer ended it (pid 4242; kernel log: "Out of memory: Killed process '
    '4242 (python)'
  ) in text, text
  assert (
    'its last measured resident memory was 3.36 GB at its peak (2.15 GB '
    "then) after step 20, with 0.52 GB of its host's 25.28 GB available"
  ) in text, text
  # The generic hint is not repeated when the cause is known.
  assert 'most often the kernel' not in text, text


def testNearlyFullHostWithoutAKernelLineIsTheLikelyCause():
  memory, _ = _Memory(kernel_log='')
  text = memory.Describe(LOST)
  assert 'ran out of memory' not in text
  assert (
    "the host was nearly out of memory, so the kernel's out-of-memory "
    'killer most likely ended it'
  ) in text, text


def testAHostWithRoomIsNotBlamed():
  memory, _ = _Memory(
    meminfo='MemTotal: 24684084 kB\nMemAvailable: 20000000 kB\n'
  )
  text = trainer_errors.LostWorkers([LOST], memory)
  assert 'nearly out of memory' not in text, text
  assert 'most often the kernel' in text, text
  assert 'Its last measured resident memory was 3.36 GB' in text, text


def testARemoteHostsKernelLogIsNotRead():
  spec = {'worker': ['10.0.0.1:5000', '10.0.0.2:5001']}
  memory, name = _Memory(kernel_log=KERNEL_LOG, spec=spec)
  # pid 4242 on another host is not this host's process 4242.
  assert 'ran out of memory' not in memory.Describe(name)


def testNothingKnownKeepsTheOldMessage():
  memory = worker_memory.WorkerMemory(SPEC, kernel_log=lambda: '')
  assert memory.Line() == ''
  assert memory.Describe(LOST) == ''
  assert trainer_errors.LostWorkers([LOST], memory) == (
    trainer_errors.LostWorkers([LOST])
  )


def testProcStatusReadsThisProcessWithoutTensorFlow():
  # The parser device_memory uses before TensorFlow is imported.
  out = subprocess.run(
    [
      sys.executable,
      '-c',
      'import sys; from lingvo_gpipe.core import proc_status; '
      's = proc_status.ReadStatus(); '
      'assert 0 < s["VmRSS"] <= s["VmHWM"], s; '
      'assert "tensorflow" not in sys.modules; '
      'assert proc_status.ReadStatus(pid=0) == {}',
    ],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert out.returncode == 0, out.stderr[-2000:]


def testCpuSecondsOfThisProcessGrowWithWork():
  before = proc_status.CpuSeconds()
  sum(i * i for i in range(3_000_000))
  assert proc_status.CpuSeconds() > before >= 0
