"""The cluster module: specs, TF_CONFIG, devices of stages and replicas."""

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import tensorflow as tf

from lingvo_gpipe.core import cluster
from tests.testing import warm_python

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


def testParseClusterSpecLingvoAndJsonForms():
  spec = cluster.ParseClusterSpec(
    'worker=127.0.0.1:2222,127.0.0.1:2223@ps=10.0.0.1:1'
  )
  assert spec == {
    'worker': ['127.0.0.1:2222', '127.0.0.1:2223'],
    'ps': ['10.0.0.1:1'],
  }
  assert cluster.ParseClusterSpec(json.dumps(spec)) == spec
  with pytest.raises(ValueError, match="'worker' is not"):
    cluster.ParseClusterSpec('worker')
  with pytest.raises(ValueError, match="Address 'nohost' of job 'worker'"):
    cluster.ParseClusterSpec('worker=nohost')
  with pytest.raises(ValueError, match='not valid JSON'):
    cluster.ParseClusterSpec('{"worker": [}')
  with pytest.raises(ValueError, match='empty'):
    cluster.ParseClusterSpec(' ')


def testTfConfig():
  text = json.dumps(
    {
      'cluster': {'worker': ['a:1', 'b:2']},
      'task': {'type': 'worker', 'index': 1},
    }
  )
  spec, job, task = cluster.ClusterSpecFromTfConfig(text)
  assert spec == {'worker': ['a:1', 'b:2']} and (job, task) == ('worker', 1)
  assert cluster.ClusterSpecFromTfConfig('') == (None, None, None)
  with pytest.raises(ValueError, match='no "cluster"'):
    cluster.ClusterSpecFromTfConfig('{"task": {}}')


def testLocalClusterStageDevices():
  # conftest splits the CPU into 4 devices.
  c = cluster.Cluster(
    cluster.Cluster.Params().Set(worker_split_size=2, worker_replicas=2)
  ).Configure()
  assert not c.is_remote
  stages = c.StageDevices()
  assert [
    [tf.DeviceSpec.from_string(d).device_index for d in r] for r in stages
  ] == [[0, 1], [2, 3]]
  assert '2 replica(s) x 2 stage(s)' in c.Describe()
  c3 = cluster.Cluster(
    cluster.Cluster.Params().Set(worker_split_size=2, worker_replicas=3)
  )
  with pytest.raises(
    ValueError,
    match=r'3 replicas x 2 stages need 6 devices '
    r'but 4 were found: \[.*CPU:3',
  ):
    c3.StageDevices()
  with pytest.raises(ValueError, match='worker_replicas=0'):
    cluster.Cluster(cluster.Cluster.Params().Set(worker_replicas=0))
  with pytest.raises(ValueError, match="no job 'worker'"):
    cluster.Cluster(cluster.Cluster.Params().Set(cluster_spec='ps=a:1'))


def testSplitGpuWithoutGpuNamesTheFix():
  if tf.config.list_physical_devices('GPU'):
    pytest.skip('This host has a GPU.')
  with pytest.raises(RuntimeError, match='no GPU.*--num_cpu_devices'):
    cluster.SplitGpu(2, 1024)


def _RunScript(script, timeout):
  """Runs `script` in a process of its own (connecting to a cluster changes
  the process's TensorFlow context); its CompletedProcess, text captured."""
  return warm_python.Run(
    [sys.executable, '-c', script],
    cwd=ROOT,
    timeout=timeout,
    env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='2'),
  )


_REMOTE_SCRIPT = textwrap.dedent("""
    import time
    from lingvo_gpipe.core import cluster
    from lingvo_gpipe.core import worker_memory
    with cluster.LocalCluster(2, startup_timeout_s=60) as local:
      c = cluster.Cluster(cluster.Cluster.Params().Set(
          cluster_spec='worker=' + ','.join(local.addresses),
          worker_split_size=2)).Configure()
      assert c.is_remote
      devices = c.StageDevices()
      assert devices == [['/job:worker/replica:0/task:0/device:CPU:0',
                          '/job:worker/replica:0/task:1/device:CPU:0']], devices
      assert c.UnreachableWorkers() == []
      # Each worker reads its own memory: its pid, not this process's.
      memory = worker_memory.WorkerMemory(c.spec, kernel_log=lambda: '')
      got = memory.Sample(step=7)
      assert [s.pid for s in got.values()] == local.pids, (got, local.pids)
      assert all(s.rss_peak >= s.rss > 50e6 for s in got.values()), got
      assert all(0 < s.host_available < s.host_total for s in got.values())
      assert memory.Line().startswith(
          'Worker memory (resident, peak): /job:worker/task:0 '), memory.Line()
      local.Kill(1)
      t0 = time.time()
      lost = c.UnreachableWorkers(timeout_s=1.0)
      assert lost == [f'/job:worker/task:1 ({local.addresses[1]})'], lost
      assert time.time() - t0 < 10
      text = memory.Describe(lost[0])
      assert 'its last measured resident memory was' in text, text
      assert 'after step 7' in text, text
      assert memory.Sample(step=8)[lost[0]].step == 7  # kept, no error
      local.Restart(1)
      assert c.UnreachableWorkers() == []
      assert local.Alive() == [True, True]
    print('REMOTE_OK')
""")


def testRemoteClusterDevicesAndDeadWorker():
  """Stage devices on 2 workers; a killed worker is named; restart works.

  In a subprocess: connecting changes the process's TensorFlow context.
  """
  out = _RunScript(_REMOTE_SCRIPT, timeout=240)
  assert 'REMOTE_OK' in out.stdout, out.stderr[-4000:]


def testPreferredDevicesTakesTpusThenGpusThenCpus():
  D = tf.config.LogicalDevice
  cpu, gpu, tpu = (
    D('/device:CPU:0', 'CPU'),
    D('/device:GPU:1', 'GPU'),
    D('/device:TPU:0', 'TPU'),
  )
  assert cluster.PreferredDevices([cpu, gpu, tpu]) == ['/device:TPU:0']
  assert cluster.PreferredDevices([cpu, gpu]) == ['/device:GPU:1']
  assert cluster.PreferredDevices([cpu]) == ['/device:CPU:0']
  assert cluster.PreferredDevices([]) == []
  # This process: the 4 virtual CPUs of tests/conftest.py.
  assert len(cluster.PreferredDevices()) == 4


def testLocalWorkersDieWithTheProcessThatStartedThem():
  code = (
    'import os\n'
    'from lingvo_gpipe.core import cluster\n'
    'c = cluster.LocalCluster(1).Start()\n'
    'print(c.pids[0], flush=True)\n'
    'os._exit(0)  # no Stop(): as if killed\n'
  )
  out = warm_python.Run([sys.executable, '-c', code], timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  pid = int(out.stdout.split()[-1])
  deadline = time.time() + 20
  while time.time() < deadline:
    try:
      with open(f'/proc/{pid}/stat') as f:
        state = f.read().split(')')[-1].split()[0]
      if state == 'Z':
        break
    except FileNotFoundError:
      break
    time.sleep(0.2)
  else:
    os.kill(pid, 9)
    raise AssertionError(f'worker {pid} outlived the process that started it')


def testWaitForWorkersNamesTheMissingOnesAndReportsProgress(caplog):
  ports = cluster.FreePorts(2)
  spec = {'worker': [f'127.0.0.1:{p}' for p in ports]}
  with caplog.at_level(logging.INFO):
    with pytest.raises(TimeoutError) as e:
      cluster.WaitForWorkers(spec, timeout_s=1.0, report_every_s=0.3)
  assert str(e.value).startswith(
    f'worker:0: Worker at 127.0.0.1:{ports[0]} is not reachable after 1 s'
  )
  assert f'Also unreachable: worker:1 (127.0.0.1:{ports[1]})' in str(e.value)
  text = '\n'.join(r.getMessage() for r in caplog.records)
  assert 'Waiting for 2 of 2 workers' in text
  # A listening worker, and the skipped one, are not waited for.
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    s.listen()
    port = s.getsockname()[1]
    cluster.WaitForWorkers(
      {'worker': [f'127.0.0.1:{port}', f'127.0.0.1:{ports[1]}']},
      timeout_s=1.0,
      skip=('worker', 1),
    )


_OOM_SCRIPT = textwrap.dedent("""
    import os
    import tensorflow as tf
    from lingvo_gpipe import trainer_errors
    from lingvo_gpipe.core import cluster
    from lingvo_gpipe.core import worker_memory
    total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    chunk = 512 * 1024 * 1024  # bytes
    with cluster.LocalCluster(2, startup_timeout_s=60) as local:
      c = cluster.Cluster(cluster.Cluster.Params().Set(
          cluster_spec='worker=' + ','.join(local.addresses),
          worker_split_size=2)).Configure()
      memory = worker_memory.WorkerMemory(c.spec)
      memory.Sample(step=1)

      # Filled (every page written) from an argument, so that no value is
      # folded into a constant or shared between chunks: fast to write.
      @tf.function
      def MoreThanTheHostHolds(x):
        with tf.device('/job:worker/replica:0/task:1/device:CPU:0'):
          xs = [tf.fill([chunk // 4], x + float(i))
                for i in range(total // chunk + 4)]
          return tf.reduce_sum(tf.concat(xs, 0))

      try:
        MoreThanTheHostHolds(tf.constant(1.0))
      except tf.errors.OpError as e:
        print('STEP_FAILED', type(e).__name__)
      lost = c.UnreachableWorkers()
      print('LOST', lost)
      print('TEXT', trainer_errors.LostWorkers(lost, memory))
""")


@pytest.mark.slow
def testWorkerKilledByTheOutOfMemoryKillerIsReportedAsSuch():
  """A worker asked to hold more than the host's memory is ended by the
  kernel's out-of-memory killer; the trainer's message says so, naming the
  worker, the kernel's line and its last measured peak. Needs a readable
  kernel log (dmesg)."""
  if not subprocess.run(['dmesg'], capture_output=True).returncode == 0:
    pytest.skip('The kernel log (dmesg) cannot be read here.')
  out = _RunScript(_OOM_SCRIPT, timeout=300)
  assert 'STEP_FAILED' in out.stdout, (out.stdout, out.stderr[-3000:])
  lines = [ln for ln in out.stdout.splitlines() if ln.startswith('TEXT ')]
  assert lines, out.stdout
  text = lines[0]
  assert 'Lost worker /job:worker/task:1 (127.0.0.1:' in text, text
  assert (
    "/job:worker/task:1 ran out of memory: the kernel's out-of-memory "
    in (text)
  ), text
  assert 'Killed process' in text, text
  assert 'its last measured resident memory was ' in text, text
