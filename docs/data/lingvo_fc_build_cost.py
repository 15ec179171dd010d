"""Lingvo 0.12.7's GPipe building an FC pipeline: the reference row of
docs/benchmarks.md ("Building the step").

  python3.10 docs/data/lingvo_fc_build_cost.py 64 8 32   # L, K, M

L FC layers of width 32 (tanh) in K FeatureExtractionLayer cells, M
micro-batches, batch 4M: graph ops, ops in functions, seconds to the end of
the first step and a steady step. Runs under real Lingvo (Python 3.10,
tensorflow-cpu 2.9.3, lingvo 0.12.7, plus matplotlib and scipy), not under
this library.
"""

import sys
import time
import json
import resource

import lingvo.compat as tf  # noqa: E402

tf.disable_v2_behavior()
from lingvo.core import gpipe, layers, py_utils  # noqa: E402

L, K, M = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
B = 4 * M
per = L // K
t0 = time.time()
g = tf.Graph()
with g.as_default():
  py_utils.GetOrCreateGlobalStepVar()
  cells = []
  for k in range(K):
    subs = [
      layers.FCLayer.Params().Set(
        name=f'fc{k * per + i}', input_dim=32, output_dim=32, activation='TANH'
      )
      for i in range(per)
    ]
    cells.append(
      gpipe.FeatureExtractionLayer.Params().Set(name=f'cell_{k}', sub=subs)
    )
  p = gpipe.PipeliningLayer.Params().Set(
    name='pipe', cell_tpl=cells, before_tpl=[], num_micro_batches=M
  )
  pipe = p.Instantiate()
  x = tf.random.stateless_normal([B, 32], [7, 11])
  y = pipe.FPropDefaultTheta(x)
  loss = tf.reduce_mean(tf.square(y))
  vs = pipe.vars.Flatten()
  grads = tf.gradients(loss, vs)
  init = tf.global_variables_initializer()
  gd = g.as_graph_def()
  ops = len(gd.node)
  fn_ops = sum(len(f.node_def) for f in gd.library.function)
t_build = time.time() - t0
with tf.Session(graph=g) as sess:
  sess.run(init)
  t1 = time.time()
  sess.run([loss] + grads)
  t_first = time.time() - t1
  ts = []
  for _ in range(5):
    t2 = time.time()
    sess.run([loss] + grads)
    ts.append(time.time() - t2)
ts.sort()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(
  'RESULT '
  + json.dumps(
    dict(
      config=f'lingvo fc L={L} K={K} M={M}',
      ops=ops,
      fn_ops=fn_ops,
      trace_s=round(t_build, 2),
      first_s=round(t_first, 2),
      to_first_s=round(t_build + t_first, 2),
      step_s=round(ts[2], 4),
      rss_mb=round(rss),
    )
  )
)
