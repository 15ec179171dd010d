"""Per-device memory figures, measured by each device's own process."""

import textwrap


from lingvo_gpipe.runners import device_memory
from tests.testing import fresh_process


def testTaskOfAndStatusMap():
  devs = [f'/job:worker/replica:0/task:{i}/device:CPU:0' for i in range(3)]
  assert device_memory.TaskOf(devs[2]) == ('worker', 2)
  assert device_memory.TaskOf('/device:CPU:0') is None
  status = device_memory.StatusMap(devs, ['h:1', 'h:2'])
  assert status == {devs[0]: 'h:1', devs[1]: 'h:2'}


def testSharedAllocatorIsSaid():
  note = device_memory.SharedAllocatorNote(['/device:CPU:0', '/device:CPU:1'])
  assert 'shared allocator' in note
  assert not device_memory.SharedAllocatorNote(['/device:CPU:0'])


_WORKERS = textwrap.dedent("""
    import json
    import tensorflow as tf
    from lingvo_gpipe.core import cluster
    from lingvo_gpipe.runners import device_memory
    with cluster.LocalCluster(2, memory_stats=True) as c:
      cluster.Connect(c.cluster_spec)
      status = device_memory.StatusMap(c.devices, c.status_addresses)
      device_memory.ResetPeaks(c.devices, status)
      before = device_memory.DeviceMemory(c.devices, status)
      with tf.device(c.devices[1]):
        v = tf.Variable(tf.zeros([16 * 2**20 // 4]))       # 16 MiB on task 1

      @tf.function
      def Step():
        with tf.device(c.devices[1]):   # a 32 MiB temporary on task 1
          return tf.reduce_sum(tf.ones([32 * 2**20 // 4]) + v[0])
      Step().numpy()
      after = device_memory.DeviceMemory(c.devices, status)
      details = device_memory.DeviceDetails(c.devices, status)
      device_memory.ResetPeaks(c.devices, status)
      reset = device_memory.DeviceMemory(c.devices, status)
      print('RESULT', json.dumps(dict(
          before=list(before.values()), after=list(after.values()),
          reset=list(reset.values()),
          rss=[details[d]['rss_peak'] - details[d]['rss_baseline']
               for d in c.devices],
          pids=[details[d]['pid'] for d in c.devices], workers=c.pids)))
""")


def testAllocationOnWorker1ShowsOnWorker1Only():
  r = fresh_process.Result(_WORKERS, timeout=200)
  mib = 2**20
  (c0, p0), (c1, p1) = r['after']
  # Task 0 holds nothing of the model; task 1 the variable (and eager
  # buffers it may still cache) now, and the step's 32 MiB temporary on top
  # at the peak.
  assert c0 < 1 * mib and p0 < 1 * mib, r
  assert 16 * mib <= c1 < 64 * mib, r
  assert 32 * mib <= p1 - c1 < 34 * mib, r
  assert r['before'][1][1] < 1 * mib, r
  # After a reset the peak is what is held now.
  assert r['reset'][1][1] == r['reset'][1][0], r
  # Figures come from the workers' own processes; the RSS cross-check sees
  # the same allocation on task 1 and far less on task 0.
  assert r['pids'] == r['workers'], r
  assert r['rss'][1] > 40 * mib and r['rss'][1] > 2 * r['rss'][0], r
