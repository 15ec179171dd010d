r"""Measures what it costs to build a pipelined training step.

  python tools/build_cost.py                       # the default list
  python tools/build_cost.py --mode=multi_process \
      --configs=lm:L=192:K=8:M=32,lm:L=192:K=8:M=32:jit
  python tools/build_cost.py --configs=fc:L=64:K=8:M=32 --json=/tmp/b.json

For each configuration, in a fresh process: a PipeliningLayer of L layers
split into K cells on K devices, M micro-batches, recompute='always', and one
`tf.function` that computes the loss and the gradients of every weight (the
`lm` and `amoebanet` rows also apply Adam, as tools/max_model_size.py does).
It reports

  ops, fn_ops   ops in the step's graph, and in its function library
  trace_s       tracing the step (building its graph)
  first_s       the first call (TensorFlow optimizes and places the graph)
  to_first_s    trace_s + first_s: from the call to the first step's end
  step_s        a steady step (median of --steps calls)
  rss_mb        the peak resident memory of this (driving) process
  cpu_s         the CPU seconds of this process, from the trace to the end
                of the first step (counting the ops between them included;
                more than to_first_s where its threads ran at once)
  workers_cpu_s with --mode=multi_process: the CPU seconds of the K
                workers together, from their start to the end of the
                first step (their compiles of XLA-compiled cells included)

A configuration is `model:L=..:K=..:M=..`, optionally `:jit` (XLA-compiled
cells), `:shared` (share_layer_functions='auto': identical layers of 48 ops
or more as calls of one function), `:inline` (share_layer_functions=False,
the default, named), `:loop` (micro_batch_loop=True: the fill-drain
schedule as two loops over its clock ticks), `:precompile` or
`:noprecompile` (Params precompile True or False: compiled cells compiled
on every device, or none, while the step is traced; default None: on
other processes' devices) and `:B=..` (the batch;
default 2 examples per micro-batch, the capacity models' own batch for lm
and amoebanet). Models:

  transformer  Transformer layers of dim 32, hidden 64, 2 heads, 8 tokens
  fc           fully connected layers of width 32 (tanh)
  lm           tools/max_model_size.py's Transformer LM (dim 64, hidden 256,
               vocab 1024, 32 tokens, batch 32), L layers
  amoebanet    tools/max_model_size.py's AmoebaNet (D=64 filters, 16x16
               images, batch 32), L cells

--mode=in_process runs the cells on K virtual CPU devices of this process;
--mode=multi_process on K TensorFlow server processes on 127.0.0.1, driven
from this process (whose memory is then only the driver's).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from lingvo_gpipe.core import proc_status
from lingvo_gpipe.tools import capacity_trial
from lingvo_gpipe.tools import common

DEFAULT_CONFIGS = (
  'transformer:L=16:K=2:M=2,transformer:L=16:K=2:M=8,'
  'transformer:L=16:K=2:M=32,transformer:L=64:K=2:M=8,'
  'transformer:L=16:K=2:M=32:jit,fc:L=64:K=8:M=2,fc:L=64:K=8:M=32'
)
MODELS = ('transformer', 'fc', 'lm', 'amoebanet')
COLUMNS = (
  'config',
  'mode',
  'ops',
  'fn_ops',
  'trace_s',
  'first_s',
  'to_first_s',
  'step_s',
  'rss_mb',
  'cpu_s',
  'workers_cpu_s',
)


def ParseConfig(text):
  """'model:L=16:K=2:M=8[:jit][:shared|:inline][:loop][:precompile|
  :noprecompile][:B=..]' -> dict."""
  parts = text.strip().split(':')
  if parts[0] not in MODELS:
    raise common.UserError(
      f'Unknown model {parts[0]!r} in --configs item {text!r}; use one of '
      f'{", ".join(MODELS)}.'
    )
  config = dict(
    model=parts[0],
    jit=False,
    B=None,
    inline=False,
    shared=False,
    loop=False,
    precompile=None,
  )
  for part in parts[1:]:
    if part in ('jit', 'inline', 'shared', 'loop'):
      config[part] = True
      continue
    if part in ('precompile', 'noprecompile'):
      config['precompile'] = part == 'precompile'
      continue
    m = re.fullmatch(r'([LKMB])=(\d+)', part)
    if not m or int(m.group(2)) < 1:
      raise common.UserError(
        f'Bad part {part!r} of --configs item {text!r}; write e.g. '
        'transformer:L=16:K=2:M=8 (positive L, K, M, B), and :jit, '
        ':shared or :inline, :loop if wanted.'
      )
    config[m.group(1)] = int(m.group(2))
  for need in 'LKM':
    if need not in config:
      raise common.UserError(
        f'--configs item {text!r} has no {need}=..; write e.g. '
        'transformer:L=16:K=2:M=8.'
      )
  return config


def Name(config):
  name = f'{config["model"]} L={config["L"]} K={config["K"]} M={config["M"]}'
  name += ' jit' if config['jit'] else ''
  name += ' shared' if config.get('shared') else ''
  name += ' loop' if config.get('loop') else ''
  if config.get('precompile') is not None:
    name += ' precompile' if config['precompile'] else ' noprecompile'
  return name + (' inline' if config.get('inline') else '')


# ----------------------------------------------------------------------------
# One configuration, in a fresh process (--one=JSON).
# ----------------------------------------------------------------------------


def _Model(config, devices):
  """(pipeline layer, fn() -> (args, labels or None), optimizer or None)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import optimizer  # pylint: disable=g-import-not-at-top

  model, n, m = config['model'], config['L'], config['M']
  batch = config['B'] or 2 * m
  opt = None
  if model == 'transformer':
    from lingvo_gpipe.layers import transformer  # pylint: disable=g-import-not-at-top

    layer_params = [
      transformer.TransformerLayer.Params().Set(
        name=f'block_{i}', source_dim=32, hidden_dim=64, num_attention_heads=2
      )
      for i in range(n)
    ]
    shape = [batch, 8, 32]
  elif model == 'fc':
    layer_params = [
      layers.FCLayer.Params().Set(
        name=f'fc_{i}', input_dim=32, output_dim=32, activation='TANH'
      )
      for i in range(n)
    ]
    shape = [batch, 32]
  else:
    # The capacity search's models (tools/max_model_size.py): the LM by its
    # layers, AmoebaNet-D (D=64) by its cells.
    family = 'transformer' if model == 'lm' else 'amoebanet'
    fixed = dict(capacity_trial.FAMILIES[family]['fixed'])
    fixed['batch_size'] = config['B'] or fixed['batch_size']
    layer_params, family_inputs, _ = capacity_trial.FamilyLayers(
      family,
      n if model == 'lm' else 64,
      fixed,
      num_cells=None if model == 'lm' else n,
    )
    opt = optimizer.Adam.Params().Instantiate()
  pipe = (
    gpipe.PipeliningLayer.Params()
    .Set(
      name='model',
      layers=layer_params,
      num_stages=config['K'],
      num_micro_batches=m,
      devices=devices,
      recompute='always',
      balance_by='params' if model in ('lm', 'amoebanet') else 'uniform',
      jit_compile=config['jit'],
      share_layer_functions='auto' if config.get('shared') else False,
      micro_batch_loop=bool(config.get('loop')),
      precompile=config.get('precompile'),
    )
    .Instantiate()
  )

  def Inputs():
    if model in ('lm', 'amoebanet'):
      return family_inputs()
    return (tf.random.stateless_normal(shape, [7, 11]),), None

  return pipe, Inputs, opt


def _PeakRssMb():
  with open('/proc/self/status', encoding='ascii') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) / 1024
  return None


def RunOne(config, mode, steps):
  """Measures one configuration in this process; returns a record."""
  from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top

  k = config['K']
  local = None
  if mode == 'in_process':
    cluster.SplitCpu(k)
    devices = [f'/device:CPU:{i}' for i in range(k)]
  else:
    local = cluster.LocalCluster(k, intra_op_threads=1, inter_op_threads=2)
    local.Start()
    cluster.Connect(local.cluster_spec)
    devices = local.devices
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import py_utils  # pylint: disable=g-import-not-at-top

  try:
    pipe, inputs_fn, opt = _Model(config, devices)
    variables = pipe.trainable_variables
    if opt is not None:
      opt.CreateSlots(variables)
    first, last = devices[0], devices[-1]

    @tf.function
    def Step():
      with tf.device(first):
        args, labels = inputs_fn()
      with py_utils.UpdateCollector() as updates:
        with tf.GradientTape() as tape:
          out = pipe(*args)
          with tf.device(last):
            if labels is None:
              loss = tf.reduce_mean(tf.square(out))
            else:
              loss = tf.reduce_mean(
                tf.nest.map_structure(
                  lambda o: tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=o
                  ),
                  out,
                )
              )
        with tf.device(last):
          grads = tape.gradient(loss, variables)
      if opt is not None:
        with tf.device(last):
          opt.Apply(tf.constant(1e-3), list(zip(grads, variables)))
        updates.Apply()
        return loss
      updates.Apply()
      return loss, grads

    t0, cpu0 = time.time(), proc_status.CpuSeconds()
    concrete = Step.get_concrete_function()
    trace_s = time.time() - t0
    graph_def = concrete.graph.as_graph_def()
    ops = len(graph_def.node)
    fn_ops = sum(len(f.node_def) for f in graph_def.library.function)
    del graph_def
    t0 = time.time()
    tf.nest.map_structure(lambda t: t.numpy(), Step())
    first_s = time.time() - t0
    cpu_s = proc_status.CpuSeconds() - cpu0
    workers_cpu_s = None
    if local is not None:
      workers_cpu_s = sum(proc_status.CpuSeconds(pid) for pid in local.pids)
    times = []
    for _ in range(steps):
      t0 = time.time()
      tf.nest.map_structure(lambda t: t.numpy(), Step())
      times.append(time.time() - t0)
    return dict(
      config=Name(config),
      mode=mode,
      **config,
      num_params=int(sum(v.shape.num_elements() for v in variables)),
      ops=ops,
      fn_ops=fn_ops,
      trace_s=round(trace_s, 2),
      first_s=round(first_s, 2),
      to_first_s=round(trace_s + first_s, 2),
      step_s=round(statistics.median(times), 4),
      rss_mb=round(_PeakRssMb(), 0),
      cpu_s=round(cpu_s, 1),
      workers_cpu_s=workers_cpu_s and round(workers_cpu_s, 1),
    )
  finally:
    if local is not None:
      local.Stop()


# ----------------------------------------------------------------------------
# The driver: one process per configuration, a table, JSON.
# ----------------------------------------------------------------------------


def Table(records):
  return common.FormatTable(
    COLUMNS,
    [
      [
        str(r.get(c))
        if r.get('error') is None or c in ('config', 'mode')
        else 'failed'
        for c in COLUMNS
      ]
      for r in records
    ],
  )


def _RunChild(config, mode, steps, timeout_s):
  cmd = [
    sys.executable,
    '-m',
    'lingvo_gpipe.tools.build_cost',
    f'--one={json.dumps(config)}',
    f'--mode={mode}',
    f'--steps={steps}',
  ]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  try:
    out = subprocess.run(
      cmd, capture_output=True, text=True, timeout=timeout_s, env=env
    )
  except subprocess.TimeoutExpired:
    return dict(config=Name(config), mode=mode, error=f'over {timeout_s} s')
  for line in out.stdout.splitlines():
    if line.startswith('RESULT '):
      return json.loads(line[len('RESULT ') :])
  tail = (out.stderr.strip().splitlines() or ['no output'])[-1]
  return dict(config=Name(config), mode=mode, error=tail[:300])


def _Run(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--configs', default=DEFAULT_CONFIGS)
  parser.add_argument(
    '--mode', default='in_process', choices=('in_process', 'multi_process')
  )
  parser.add_argument('--steps', type=int, default=5, help='Steady steps.')
  parser.add_argument('--timeout_s', type=int, default=1800)
  parser.add_argument('--json', default='', help='Write the records here.')
  parser.add_argument('--one', default='', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

    quiet_start.ImportTensorFlow(min_log_level='2')
    record = RunOne(json.loads(args.one), args.mode, args.steps)
    print('RESULT ' + json.dumps(record), flush=True)
    return 0
  configs = [ParseConfig(c) for c in args.configs.split(',') if c.strip()]
  records = []
  for config in configs:
    print(f'[{Name(config)}, {args.mode}] ...', file=sys.stderr, flush=True)
    records.append(_RunChild(config, args.mode, args.steps, args.timeout_s))
  print(Table(records))
  for r in records:
    if r.get('error'):
      print(f'{r["config"]}: {r["error"]}')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(dict(records=records, argv=sys.argv[1:]), f, indent=1)
  return 1 if any(r.get('error') for r in records) else 0


def main(argv=None):
  return common.Main('build_cost', _Run, argv)


if __name__ == '__main__':
  sys.exit(main())
