"""tools/memory_trace.py on a real trace of a worker process."""

import json
import os
import runpy
import sys
import textwrap
from tests.testing import warm_python


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
_TOOL = os.path.join(_ROOT, 'tools', 'memory_trace.py')

# One worker with allocator statistics and a profiler port, traced while a
# step allocates a 24 MiB temporary beside an 8 MiB variable.
_TRACE = textwrap.dedent("""
    import sys, threading, time
    import tensorflow as tf
    from lingvo_gpipe.core import cluster
    with cluster.LocalCluster(1, memory_stats=True, profiler=True) as c:
      cluster.Connect(c.cluster_spec)
      with tf.device(c.devices[0]):
        v = tf.Variable(tf.zeros([8 * 2**20 // 4]))

      @tf.function
      def Step():
        with tf.device(c.devices[0]):
          big = tf.ones([24 * 2**20 // 4], name='big_temporary') * 2.0
          return tf.reduce_sum(big + v[0])
      Step().numpy()
      opts = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3)
      t = threading.Thread(
          target=tf.profiler.experimental.client.trace,
          args=('grpc://' + c.profiler_addresses[0], sys.argv[1], 3000),
          kwargs=dict(options=opts))
      t.start()
      time.sleep(1.0)
      Step().numpy()
      t.join()
""")


def testPeakOfATracedWorker(tmp_path, capsys):
  trace = str(tmp_path / 'trace')
  out = warm_python.Run(
    [sys.executable, '-c', _TRACE, trace],
    timeout=300,
    cwd=_ROOT,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  path = str(tmp_path / 'peak.json')
  status = runpy.run_path(_TOOL)['main']([trace, f'--json={path}'])
  out = capsys.readouterr()
  assert status == 0, out.err[-3000:]
  assert 'held before the trace' in out.out
  with open(path) as f:
    result = json.load(f)
  mib = 2**20
  # The variable was there before the trace; the 24 MiB temporary is the
  # largest buffer alive at the peak.
  assert result['held_before_bytes'] >= 8 * mib
  top = result['groups'][0]
  assert top['requested_bytes'] == 24 * mib, result['groups'][:3]
  assert result['peak_bytes'] >= 32 * mib


def testNoTraceIsAClearError(tmp_path, capsys):
  status = runpy.run_path(_TOOL)['main']([str(tmp_path)])
  err = capsys.readouterr().err
  assert status == 2
  assert 'No *.xplane.pb under' in err
  assert 'Traceback' not in err
