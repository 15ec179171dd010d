"""Pipelines across TensorFlow server processes give the in-process result:
K=2 cells on 2 workers, and R=2 data-parallel replicas on 2 workers.

Runs in a subprocess: connecting to a cluster changes this process's
TensorFlow context, which the other tests must not see.
"""

import os
import sys
import textwrap
from tests.testing import warm_python

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

SCRIPT = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    from lingvo_gpipe.core import cluster
    from lingvo_gpipe.core import layers
    from lingvo_gpipe.core import xla_precompile
    from lingvo_gpipe.pipeline import pipelining_layer

    fcs = [layers.FCLayer.Params().Set(name=f'fc_{i}', input_dim=8,
                                       output_dim=8, activation='TANH')
           for i in range(4)]
    x = tf.constant(np.random.RandomState(0).randn(8, 8), tf.float32)

    def Run(devices, num_stages, num_replicas=1, num_micro_batches=4):
      pipe = pipelining_layer.PipeliningLayer.Params().Set(
          name='pipe', layers=fcs, num_stages=num_stages,
          num_replicas=num_replicas, num_micro_batches=num_micro_batches,
          devices=devices).Instantiate()

      @tf.function
      def Step():
        with tf.GradientTape() as tape:
          y = pipe(x)
          loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, pipe.trainable_variables)

      y, grads = Step()
      return y.numpy(), {v.name: g.numpy() for v, g in
                         zip(pipe.trainable_variables, grads)}

    y_ref, g_ref = Run(['/job:localhost/replica:0/task:0/device:CPU:0'], 1)
    with cluster.LocalCluster(2, startup_timeout_s=60) as c:
      cluster.Connect(c.cluster_spec, timeout_s=30)
      # Both workers are other processes, also seen from a cell's scope.
      pre = xla_precompile.Precompiler('pipe', remote_only=True)

      @tf.function
      def InCellScope():
        with tf.device(c.devices[0]):
          assert pre._Remote(c.devices[0]) and pre._Remote(c.devices[1])
        return tf.constant(0)

      InCellScope.get_concrete_function()
      y, g = Run(c.devices, 2)
      # Data parallel: 2 replicas of a 1-cell pipeline, one per worker.
      y_dp, g_dp = Run(c.devices, 1, num_replicas=2, num_micro_batches=2)
    for yy, gg in ((y, g), (y_dp, g_dp)):
      np.testing.assert_allclose(yy, y_ref, rtol=1e-5, atol=1e-6)
      assert sorted(gg) == sorted(g_ref)
      for name in gg:
        np.testing.assert_allclose(gg[name], g_ref[name], rtol=1e-5,
                                   atol=1e-6)
    print('MULTI_PROCESS_OK', len(g))
""")


def testPipelineAcrossTwoWorkerProcessesMatchesOneProcess():
  out = warm_python.Run(
    [sys.executable, '-c', SCRIPT],
    cwd=ROOT,
    timeout=240,
    env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert 'MULTI_PROCESS_OK 8' in out.stdout, out.stderr[-4000:]


def testUnreachableWorkerFailsFastNamingTheAddress():
  script = textwrap.dedent("""
      import time
      from lingvo_gpipe.core import cluster
      port = cluster.FreePorts(1)[0]
      start = time.time()
      try:
        cluster.Connect({'worker': [f'127.0.0.1:{port}']}, timeout_s=2)
      except TimeoutError as e:
        print('TIMEOUT', round(time.time() - start), e)
  """)
  out = warm_python.Run(
    [sys.executable, '-c', script],
    cwd=ROOT,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert 'TIMEOUT' in out.stdout, out.stderr[-3000:]
  assert '127.0.0.1:' in out.stdout
  assert int(out.stdout.split()[1]) <= 10
