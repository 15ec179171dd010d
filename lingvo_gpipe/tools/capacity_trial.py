"""One trial of the capacity search (`max_model_size.py`): a model family at
one size, built and trained for a few steps in a fresh process, with every
device's peak bytes measured by the device itself.

The search's process runs `python -m lingvo_gpipe.tools.max_model_size
--trial=JSON`, which calls `TrialMain`; the JSON names the family, the
configuration (K, M, re-materialization), the size and the workers.
`FAMILIES` are the models the search grows: a Transformer by its layers, an
AmoebaNet-D by its filters.
"""

import contextlib
import json
import os
import sys
import time

from lingvo_gpipe.tools import common
from lingvo_gpipe.tools.common import MIB

FAMILIES = {
  'transformer': dict(
    knob='num_layers',
    min_size=1,
    step=1,
    start=2,
    fixed=dict(
      model_dim=64,
      hidden_dim=256,
      num_heads=1,
      vocab_size=1024,
      seq_len=32,
      batch_size=32,
    ),
  ),
  'amoebanet': dict(
    knob='num_filters',
    min_size=8,
    step=8,
    start=32,
    fixed=dict(image_size=16, batch_size=32, num_classes=10, base_cells=6),
  ),
}


def NumCells(family, num_stages):
  base = FAMILIES['amoebanet']['fixed']['base_cells']
  if family != 'amoebanet':
    return None
  return base * max(1, num_stages // 2)


def FixedSettings(family, overrides=''):
  """The family's fixed settings with `overrides` ('name=int,...') applied."""
  fixed = dict(FAMILIES[family]['fixed'])
  for item in (x.strip() for x in overrides.split(',')):
    if not item:
      continue
    name, _, value = item.partition('=')
    name = name.strip()
    if name not in fixed:
      raise common.UserError(
        f'Unknown --fixed setting {name!r} for {family}: valid ones are '
        f'{", ".join(sorted(fixed))}.'
      )
    try:
      fixed[name] = int(value)
    except ValueError:
      raise common.UserError(
        f'--fixed {name}={value!r} is not an integer; write e.g. '
        f'{name}={fixed[name]}.'
      ) from None
  return fixed


def FamilyLayers(family, size, fixed=None, num_cells=None):
  """A family's model at `size`: (layer Params, inputs fn, input shapes).

  The inputs fn builds a batch on the current device: (args, labels), with
  labels None where the model's own loss needs none (the Transformer's copy
  task). `num_cells` sets AmoebaNet's cells (default: `NumCells` of K=1).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  f = fixed or FAMILIES[family]['fixed']
  if family == 'transformer':
    from lingvo_gpipe.models import transformer_lm  # pylint: disable=g-import-not-at-top

    layer_params = transformer_lm.LayerParams(
      num_layers=size,
      model_dim=f['model_dim'],
      hidden_dim=f['hidden_dim'],
      num_heads=f['num_heads'],
      vocab_size=f['vocab_size'],
    )

    def Inputs():
      ids = tf.random.stateless_uniform(
        [f['batch_size'], f['seq_len']],
        [7, 11],
        maxval=f['vocab_size'],
        dtype=tf.int32,
      )
      return (ids, ids), None  # the copy task: labels are the inputs

    ids_spec = tf.TensorSpec([f['batch_size'], f['seq_len']], tf.int32)
    return layer_params, Inputs, [ids_spec, ids_spec]

  from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

  s = f['image_size']
  net = (
    amoebanet.AmoebaNet.Params()
    .Set(
      num_cells=num_cells or NumCells(family, 1),
      num_filters=size,
      image_size=s,
      stem_type='cifar',
      stem_filters=size,
      num_classes=f['num_classes'],
      head_logits=True,
    )
    .Instantiate()
  )

  def Inputs():
    images = tf.random.stateless_normal([f['batch_size'], s, s, 3], [7, 11])
    labels = tf.random.stateless_uniform(
      [f['batch_size']], [3, 5], maxval=f['num_classes'], dtype=tf.int32
    )
    return (images,), labels

  return net.Layers(), Inputs, [[f['batch_size'], s, s, 3]]


def _BuildModel(family, size, config, devices, fixed=None):
  """(layer, inputs fn): the family's model at `size`, as `config` says."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top

  k = config['num_stages']
  layer_params, Inputs, input_shapes = FamilyLayers(
    family, size, fixed, NumCells(family, k)
  )
  if config['pipeline']:
    layer = (
      gpipe.PipeliningLayer.Params()
      .Set(
        name='model',
        layers=layer_params,
        num_stages=k,
        num_micro_batches=config['num_micro_batches'],
        devices=devices[:k],
        recompute='always',
        balance_by=config.get('balance_by', 'memory'),
        input_shapes=input_shapes,
        jit_compile=bool(config.get('jit_compile')),
        micro_batch_loop=bool(config.get('micro_batch_loop')),
        share_layer_functions=(
          'auto' if config.get('share_layer_functions') else False
        ),
      )
      .Instantiate()
    )
  else:
    with tf.device(devices[0]):
      layer = (
        layers.SequentialLayer.Params()
        .Set(name='model', sub=layer_params)
        .Instantiate()
      )
  return layer, Inputs


def _DeviceBytes(variables):
  out = {}
  for v in variables:
    out[v.device] = out.get(v.device, 0) + v.shape.num_elements() * v.dtype.size
  return out


def RunTrial(spec):
  """Measures one (family, config, size); returns a JSON-able dict."""
  family, config, size = spec['family'], spec['config'], spec['size']
  k = config['num_stages']
  from lingvo_gpipe.runners import device_memory  # pylint: disable=g-import-not-at-top

  device_memory.EnableCpuStats()  # this driver's own, to check it holds nothing
  from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top

  limit = int(spec['budget_mb'] * spec.get('hard_limit_factor', 2.0)) + 64
  on_gpu = spec.get('device', 'cpu') == 'gpu'
  if on_gpu:
    # K logical GPUs of one physical GPU, each capped at the limit; their
    # allocators are separate, so get_memory_info is per device.
    cluster.SplitGpu(k, memory_limit_mb=limit)
    context = contextlib.nullcontext(None)
  else:
    context = cluster.LocalCluster(
      k,
      memory_stats=True,
      memory_limit_mb=limit,
      intra_op_threads=spec.get('intra_op_threads', 0),
      inter_op_threads=spec.get('inter_op_threads', 2),
    )
  with context as c:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from lingvo_gpipe.core import optimizer  # pylint: disable=g-import-not-at-top
    from lingvo_gpipe.core import py_utils  # pylint: disable=g-import-not-at-top

    # The workers run this process's functions with the thread pools its
    # config asks for (the config travels with the connection).
    tf.config.threading.set_inter_op_parallelism_threads(
      spec.get('inter_op_threads', 2)
    )
    tf.config.threading.set_intra_op_parallelism_threads(
      spec.get('intra_op_threads', 0)
    )
    if on_gpu:
      devices = [
        f'/job:localhost/replica:0/task:0/device:GPU:{i}' for i in range(k)
      ]
      status = {}
    else:
      cluster.Connect(c.cluster_spec)
      devices = c.devices
      status = device_memory.StatusMap(devices, c.status_addresses)
    record = dict(
      family=family,
      config=config['name'],
      balance_by=config.get('balance_by'),
      jit_compile=bool(config.get('jit_compile')),
      micro_batch_loop=bool(config.get('micro_batch_loop')),
      share_layer_functions=bool(config.get('share_layer_functions')),
      num_stages=k,
      num_micro_batches=config['num_micro_batches'],
      recompute=config['recompute'],
      size=size,
      knob=FAMILIES[family]['knob'],
      fixed=dict(spec.get('fixed') or FAMILIES[family]['fixed']),
      num_cells=NumCells(family, k),
      budget_bytes=spec['budget_mb'] * MIB,
      devices=devices,
      inter_op_threads=spec.get('inter_op_threads', 2),
      intra_op_threads=spec.get('intra_op_threads', 0),
    )
    try:
      layer, inputs_fn = _BuildModel(
        family, size, config, devices, record['fixed']
      )
      record['splits'] = getattr(layer, 'splits', None)
      variables = layer.trainable_variables
      record['num_params'] = int(sum(v.shape.num_elements() for v in variables))
      record['param_bytes'] = int(
        sum(v.shape.num_elements() * v.dtype.size for v in variables)
      )
      opt = optimizer.Adam.Params().Instantiate()
      opt.CreateSlots(variables)
      first, last = devices[0], devices[k - 1]
      plain_scope = None if config['pipeline'] else first

      @tf.function
      def Step():
        with tf.device(first):
          args, labels = inputs_fn()
        with py_utils.UpdateCollector() as updates:
          with tf.GradientTape() as tape:
            with tf.device(plain_scope):
              out = layer(*args)
            with tf.device(last):
              if labels is None:
                loss = tf.reduce_mean(out)
              else:
                loss = tf.reduce_mean(
                  tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=out
                  )
                )
          with tf.device(last):  # the loss gradient next to the loss
            grads = tape.gradient(loss, variables)
        with tf.device(last):
          opt.Apply(
            tf.constant(spec.get('learning_rate', 1e-3)),
            list(zip(grads, variables)),
          )
        updates.Apply()
        return loss

      weights = _DeviceBytes(variables)
      slots = _DeviceBytes(list(opt.slots().values()))
      losses, peaks = [], []
      start = time.time()
      losses.append(float(Step().numpy()))  # traces; slots already exist
      record['first_step_s'] = time.time() - start
      before = device_memory.DeviceMemory(devices, status)
      here = '/job:localhost/replica:0/task:0/device:CPU:0'
      for _ in range(max(1, spec.get('steps', 1))):
        device_memory.ResetPeaks(devices + [here], status)
        t0 = time.time()
        losses.append(float(Step().numpy()))
        record['step_s'] = time.time() - t0
        peaks.append(
          [p for _, p in device_memory.DeviceMemory(devices, status).values()]
        )
      # What ran in this driving process instead of on a device (should be
      # nothing but the step's scalars).
      record['driver_peak_bytes'] = device_memory.DeviceMemory([here])[here][1]
      details = device_memory.DeviceDetails(devices, status)
      record['losses'] = losses
      record['peak_bytes_per_step'] = peaks
      record['peak_bytes_per_device'] = [
        max(p[i] for p in peaks) for i in range(k)
      ]
      record['state_bytes_per_device'] = [before[d][0] for d in devices]
      record['weight_bytes_per_device'] = [weights.get(d, 0) for d in devices]
      record['slot_bytes_per_device'] = [slots.get(d, 0) for d in devices]
      record['rss_peak_minus_baseline_per_device'] = [
        details[d]['rss_peak'] - (details[d]['rss_baseline'] or 0)
        for d in devices
      ]
      record['peak_activation_bytes'] = max(
        p - s
        for p, s in zip(
          record['peak_bytes_per_device'], record['state_bytes_per_device']
        )
      )
      record['fits'] = (
        max(record['peak_bytes_per_device']) <= (record['budget_bytes'])
      )
      record['error'] = None
    except (
      tf.errors.ResourceExhaustedError,
      tf.errors.UnavailableError,
      tf.errors.InternalError,
      tf.errors.AbortedError,
      tf.errors.CancelledError,
      device_memory.MemoryStatsUnavailable,
    ) as e:
      dead = [] if c is None else [i for i, a in enumerate(c.Alive()) if not a]
      reason = (
        f'worker(s) {dead} died'
        if dead
        else 'out of memory'
        if isinstance(e, tf.errors.ResourceExhaustedError)
        else type(e).__name__
      )
      record['fits'] = False
      record['error'] = reason
    return record


def TrialMain(spec_json):
  spec = json.loads(spec_json)
  record = RunTrial(spec)
  with open(spec['out'], 'w') as f:
    json.dump(record, f)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown)
