"""Per-layer profiles for the planner, built without allocating weights.

`ProfileLayers` reads each layer's forward flops, output bytes, parameter
bytes, the bytes its backward pass keeps and the extra peak of its backward
from the layer's abstractly traced `FProp` graph (or its `FPropMeta`).
`MeasureProfile` adds measured per-layer times on this host, `MeasureLink`
the transfer bandwidth between two local TensorFlow server workers, and
`MeasuredDevice` turns both into a `cost_model.DeviceSpec`.
"""

import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.planning import device_presets

__all__ = [
  'LayerProfile',
  'ModelProfile',
  'ProfileLayers',
  'MeasureProfile',
  'MeasureLink',
  'MeasuredDevice',
  'FormatBytes',
  'InputDuplicateBytes',
  'LayerSteps',
  'RandomInputs',
  'TimeSamples',
]

# Op types whose outputs alias their inputs or hold no activation.
_NO_ALLOCATION_OPS = frozenset(
  [
    'Placeholder',
    'Const',
    'Identity',
    'IdentityN',
    'ReadVariableOp',
    'Reshape',
    'Shape',
    'ShapeN',
    'Size',
    'Rank',
    'NoOp',
    'StopGradient',
    'ExpandDims',
    'Squeeze',
    'StridedSlice',
    'Pack',
    'Fill',
    'ZerosLike',
    'OnesLike',
  ]
)

# Ops whose output is a view of their first input.
_ALIAS_OPS = frozenset(
  ['Identity', 'Reshape', 'ExpandDims', 'Squeeze', 'StopGradient']
)

# Element-wise ops whose kernels write their output into the buffer of an
# input that no later op reads (TensorFlow's forward_input_or_allocate_output):
# such an output costs no new memory.
_FORWARDING_OPS = frozenset(
  [
    'Abs',
    'Add',
    'AddV2',
    'Div',
    'DivNoNan',
    'Elu',
    'EluGrad',
    'Erf',
    'Exp',
    'Log',
    'Maximum',
    'Minimum',
    'Mul',
    'Neg',
    'Pow',
    'RealDiv',
    'Reciprocal',
    'ReciprocalGrad',
    'Relu',
    'Relu6',
    'Relu6Grad',
    'ReluGrad',
    'Rsqrt',
    'RsqrtGrad',
    'Select',
    'SelectV2',
    'Selu',
    'SeluGrad',
    'Sigmoid',
    'SigmoidGrad',
    'Sign',
    'Softplus',
    'SoftplusGrad',
    'Sqrt',
    'SqrtGrad',
    'Square',
    'SquaredDifference',
    'Sub',
    'Tanh',
    'TanhGrad',
  ]
)


def FormatBytes(n):
  n = float(n)
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TiB'


# -----------------------------------------------------------------------------
# Per-layer profile.
# -----------------------------------------------------------------------------


@dataclasses.dataclass
class LayerProfile:
  """Costs of one layer for the whole (mini-)batch.

  Attributes:
    name: the layer's name.
    flops: forward flops.
    in_bytes: bytes of the layer's inputs.
    out_bytes: bytes of its outputs.
    activation_bytes: bytes of the forward tensors its backward reads (its
      outputs included): what the backward needs stored.
    backward_bytes: the peak bytes its backward allocates beyond those
      (gradients of activations, temporaries).
    num_params: number of weights.
    param_bytes: bytes of the weights.
    num_ops: ops in the forward graph (each pays a launch overhead).
    max_var_bytes: bytes of its largest variable (the optimizer updates one
      variable at a time; its temporaries have that variable's size).
    in_specs: TensorSpecs of the inputs (for measuring).
    measured: (forward fixed s, forward s per example, backward fixed s,
      backward s per example) measured on this host, or None.
    input_unary_bytes: ((flat input index, op type, bytes), ...) of the
      saved activations that are one element-wise op of one input (a ReLU
      of an input state): the same op of the same tensor in the next layer
      is merged with it by the graph optimizer (see `InputDuplicateBytes`).
    passthrough: per flat output, the flat input it is (a state the layer
      passes on unchanged), or None.
  """

  name: str
  flops: float
  in_bytes: int
  out_bytes: int
  activation_bytes: int
  num_params: int
  param_bytes: int
  num_ops: int
  backward_bytes: int = 0
  max_var_bytes: int = 0
  in_specs: object = None
  measured: tuple = None
  input_unary_bytes: tuple = ()
  passthrough: tuple = ()

  def TimesS(self, frac, batch, device):
    """(forward s, backward s) for `frac` of the batch on `device`."""
    if self.measured:
      a_f, c_f, a_b, c_b = self.measured
      b = frac * batch
      return a_f + c_f * b, a_b + c_b * b
    flops = self.flops * frac
    traffic = self.param_bytes + frac * (
      self.in_bytes + self.out_bytes + self.activation_bytes
    )
    fwd = device.ComputeS(flops, traffic, self.num_ops)
    bwd = device.ComputeS(2 * flops, 2 * traffic, 2 * self.num_ops)
    return fwd, bwd


@dataclasses.dataclass
class ModelProfile:
  """The profile of a layer sequence: one `LayerProfile` per layer."""

  name: str
  layers: list
  batch_size: int
  batch_dim: int = 0

  @property
  def num_layers(self):
    return len(self.layers)

  @property
  def num_params(self):
    return sum(lp.num_params for lp in self.layers)


def _SpecBytes(structure):
  total = 0
  for s in tf.nest.flatten(structure):
    if s is None:
      continue
    n = tf.TensorShape(s.shape).num_elements()
    total += int(n or 0) * s.dtype.size
  return total


def _BatchOf(specs, batch_dim):
  for s in tf.nest.flatten(specs):
    if s is None:  # An absent input.
      continue
    dims = tf.TensorShape(s.shape).as_list()
    if len(dims) > batch_dim:
      return dims[batch_dim]
  return None


def _WithBatch(specs, batch_dim, batch):
  def Fn(s):
    if s is None:
      return None
    dims = tf.TensorShape(s.shape).as_list()
    if len(dims) > batch_dim:
      dims[batch_dim] = batch
    return tf.TensorSpec(dims, s.dtype)

  return tf.nest.map_structure(Fn, specs)


def _DtypeChoices(specs):
  """Input specs to try: all float32 first, then ints for the inputs (ids
  and labels are ints; shapes alone do not say which)."""
  yield specs
  n = len(specs)
  if n > 4:
    return
  for mask in range(1, 1 << n):
    yield tuple(
      tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, tf.int32), x)
      if mask >> i & 1
      else x
      for i, x in enumerate(specs)
    )


def _SavedBytes(fn, theta_spec, specs):
  """Bytes of the forward tensors that the backward pass reads: the
  activations a device keeps for the backward (traced, nothing runs)."""

  def Grad(theta, *inputs):
    with tf.GradientTape() as tape:
      leaves = [
        t
        for t in tf.nest.flatten((theta, inputs))
        if t is not None and t.dtype.is_floating
      ]
      tape.watch(leaves)
      outs = fn(theta, *inputs)
      total = tf.add_n(
        [
          tf.reduce_sum(tf.cast(y, tf.float32))
          for y in tf.nest.flatten(outs)
          if y is not None and y.dtype.is_floating
        ]
        or [tf.constant(0.0)]
      )
    return tape.gradient(total, leaves)

  graph = (
    tf.function(Grad, autograph=False)
    .get_concrete_function(theta_spec, *specs)
    .graph
  )
  saved = {}
  for op in graph.get_operations():
    if not op.name.startswith('gradient_tape/'):
      continue
    for t in op.inputs:
      # Follow views (reshapes, identities) to the tensor they alias.
      while t.op.type in _ALIAS_OPS and t.op.inputs:
        t = t.op.inputs[0]
      src = t.op
      if src.name.startswith('gradient_tape/') or src.type in (
        _NO_ALLOCATION_OPS
      ):
        continue
      saved[t.ref()] = t
  # The same element-wise op of the same inputs (e.g. one ReLU of a cell's
  # input in several branches) is computed once: the graph optimizer
  # merges such duplicates before the step runs.
  merged = {}
  for ref, t in saved.items():
    if t.op.type in _FORWARDING_OPS:
      key = (t.op.type, t.value_index) + tuple(x.ref() for x in t.op.inputs)
    else:
      key = ref
    merged.setdefault(key, t)
  saved = {t.ref(): t for t in merged.values()}
  total = sum(_Bytes(t) for t in saved.values())
  num_theta = len(tf.nest.flatten(theta_spec))
  inputs = {t.ref(): i for i, t in enumerate(graph.inputs[num_theta:])}
  unary = []
  for t in saved.values():
    if t.op.type in _FORWARDING_OPS and len(t.op.inputs) == 1:
      i = inputs.get(_Unaliased(t.op.inputs[0]).ref())
      if i is not None:
        unary.append((i, t.op.type, _Bytes(t)))
  return total, _BackwardExtra(graph, saved, total), tuple(sorted(unary))


def _Unaliased(t):
  """The tensor `t` is a view of (following reshapes and identities)."""
  while t.op.type in _ALIAS_OPS and t.op.inputs:
    t = t.op.inputs[0]
  return t


def _Passthrough(graph, num_theta):
  """Per flat output of a traced FProp graph: the flat input it is, or
  None."""
  inputs = {t.ref(): i for i, t in enumerate(graph.inputs[num_theta:])}
  return tuple(inputs.get(_Unaliased(t).ref()) for t in graph.outputs)


def InputDuplicateBytes(layers):
  """Bytes of the saved activations of `layers` (consecutive
  `LayerProfile`s, one cell) that repeat one in an earlier layer of the
  same cell: the same element-wise op of the same tensor, which a layer
  passed on unchanged (AmoebaNet's cells take the previous cell's input as
  their own, and both apply a ReLU to it). TensorFlow's graph optimizer
  computes it once; a profile, tracing one layer at a time, counts it in
  both."""
  seen = set()
  dup = 0
  ids = itertools.count()
  origins = {}  # flat input of the current layer -> the tensor it is
  for lp in layers:
    cur = dict(origins)

    def Origin(i, cur=cur):
      if i not in cur:
        cur[i] = next(ids)
      return cur[i]

    for i, op_type, nbytes in lp.input_unary_bytes:
      key = (Origin(i), op_type)
      if key in seen:
        dup += nbytes
      else:
        seen.add(key)
    origins = {
      j: Origin(i) for j, i in enumerate(lp.passthrough) if i is not None
    }
  return dup


def _Bytes(t):
  n = t.shape.num_elements()
  if not n or t.dtype == tf.resource:
    return 0
  return int(n) * t.dtype.size


def _BackwardExtra(graph, saved, saved_bytes):
  """Peak bytes the backward pass allocates beyond the saved activations:
  the gradients of activations and temporaries, with each tensor freed
  after its last reader (ops in creation order). An element-wise op writes
  its output into an input it reads last, of the same size and type, as
  TensorFlow's kernels do. The weight gradients it returns are not counted
  (the gradients term holds them)."""
  ops = [
    op for op in graph.get_operations() if op.name.startswith('gradient_tape/')
  ]
  last = {}
  for i, op in enumerate(ops):
    for t in op.inputs:
      last[t.ref()] = i
  outputs = {t.ref() for t in graph.outputs}
  live = saved_bytes
  peak = live
  alive = {ref: _Bytes(t) for ref, t in saved.items()}
  for i, op in enumerate(ops):
    # Inputs read for the last time here whose buffer an output may take.
    spare = []
    if op.type in _FORWARDING_OPS:
      spare = [
        t
        for t in op.inputs
        if last.get(t.ref()) == i and t.ref() in alive and _Bytes(t)
      ]
    if op.type not in _NO_ALLOCATION_OPS and op.type not in _ALIAS_OPS:
      for t in op.outputs:
        if t.ref() in outputs or t.ref() not in last:
          continue
        same = [
          j
          for j, x in enumerate(spare)
          if x.dtype == t.dtype and _Bytes(x) == _Bytes(t)
        ]
        if same:  # the output takes over the input's buffer
          alive[t.ref()] = alive.pop(spare.pop(same[0]).ref())
          continue
        alive[t.ref()] = _Bytes(t)
        live += alive[t.ref()]
    peak = max(peak, live)
    for t in op.inputs:
      ref = t.ref()
      if last.get(ref) == i and ref in alive:
        live -= alive.pop(ref)
  return max(peak - saved_bytes, 0)


def _TraceLayer(p, specs):
  """(flops, out specs, activation bytes, backward bytes, num ops, in
  specs, input unary bytes, passthrough) of `p`'s FProp traced abstractly
  (see `LayerProfile`); None if it cannot be traced from shapes alone."""
  layer = p.cls.AbstractInstance(p)
  theta_spec = layer.vars.Transform(lambda v: v.ToSpec())

  def Fn(theta, *inputs):
    return layer.FProp(theta, *inputs)

  for cand in _DtypeChoices(specs):
    try:
      concrete = tf.function(Fn, autograph=False).get_concrete_function(
        theta_spec, *cand
      )
    except (ValueError, TypeError, NotImplementedError, AttributeError):
      continue
    except tf.errors.OpError:
      continue
    graph = concrete.graph
    ops = sum(
      1 for op in graph.get_operations() if op.type not in _NO_ALLOCATION_OPS
    )
    outs = py_utils.AsTuple(concrete.structured_outputs)
    out_specs = tf.nest.map_structure(
      lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype), outs
    )
    unary = ()
    try:
      act, extra, unary = _SavedBytes(Fn, theta_spec, cand)
    except (ValueError, TypeError, LookupError, NotImplementedError):
      act, extra = 2 * _SpecBytes(out_specs), _SpecBytes(out_specs)
    passthrough = _Passthrough(graph, len(tf.nest.flatten(theta_spec)))
    # The layer's outputs are kept too (the next layer's inputs).
    act = max(act, _SpecBytes(out_specs))
    return (
      meta.GraphFlops(graph),
      out_specs,
      act,
      extra,
      ops,
      cand,
      unary,
      passthrough,
    )
  return None


def _Signature(p, specs):
  q = p.Copy()
  q.name = 'layer'
  return q.ToText() + '|' + repr(tf.nest.map_structure(repr, specs))


def ProfileLayers(layer_params, input_shapes, batch_dim=0, name='model'):
  """Profiles a layer sequence abstractly (no weights are allocated).

  Args:
    layer_params: list of layer Params, in order.
    input_shapes: shapes of the first layer's inputs (one per FProp
      argument; NestedMaps allowed), with the batch size.
    batch_dim: the batch axis.
    name: the model's name (for reports).

  Returns:
    A `ModelProfile`. Identical layers on identical inputs are traced once.

  Raises:
    ValueError: if the batch size is unknown or a layer cannot take the
      previous layer's output.
  """
  if not layer_params:
    raise ValueError('The model has no layers; give at least one layer.')
  specs = tuple(meta.ToSpec(s) for s in input_shapes)
  batch = _BatchOf(specs, batch_dim)
  if not batch:
    raise ValueError(
      f'The planner needs the batch size: input_shapes={input_shapes!r} '
      f'has no size along batch_dim={batch_dim}; give it, e.g. '
      '[[64, 1024]].'
    )
  cache = {}
  layers = []
  for i, p in enumerate(layer_params):
    p = base_layer.LayerParams(p).Copy()
    if not p.name:
      p.name = f'layer_{i}'
    key = _Signature(p, specs)
    if key not in cache:
      cache[key] = _ProfileOne(p, specs, i, layer_params)
    prof, out_specs = cache[key]
    layers.append(dataclasses.replace(prof, name=p.name))
    specs = out_specs
  return ModelProfile(
    name=name, layers=layers, batch_size=batch, batch_dim=batch_dim
  )


def _ProfileOne(p, specs, i, layer_params):
  abstract = p.cls.AbstractInstance(p)
  variables = list(abstract.VariablesByName().values())
  num_params = sum(int(v.shape.num_elements()) for v in variables)
  var_bytes = [
    int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size for v in variables
  ]
  param_bytes = sum(var_bytes)
  traced = _TraceLayer(p, specs)
  unary, passthrough = (), ()
  if traced is not None:
    flops, out_specs, act, extra, ops, in_specs, unary, passthrough = traced
  else:
    try:
      m = p.cls.FPropMeta(p, *specs)
    except (ValueError, TypeError) as e:
      prev = f'layer {i - 1}' if i else 'the input'
      raise ValueError(
        f'Layer {i} ({p.name}, {p.cls.__name__}) cannot take the output of '
        f'{prev}: {e}'
      ) from e
    flops = m.flops
    out_specs = tuple(meta.ToSpec(s) for s in py_utils.AsTuple(m.out_shapes))
    # Without a graph: the outputs and as much again inside.
    act = 2 * _SpecBytes(out_specs)
    extra = _SpecBytes(out_specs)
    ops = 10
    in_specs = None
  prof = LayerProfile(
    name=p.name,
    flops=float(flops),
    in_bytes=_SpecBytes(specs),
    out_bytes=_SpecBytes(out_specs),
    activation_bytes=int(act),
    backward_bytes=int(extra),
    num_params=num_params,
    param_bytes=param_bytes,
    max_var_bytes=max(var_bytes, default=0),
    num_ops=int(ops),
    in_specs=in_specs,
    input_unary_bytes=unary,
    passthrough=passthrough,
  )
  return prof, tuple(out_specs)


# -----------------------------------------------------------------------------
# measure: this host.
# -----------------------------------------------------------------------------


def _Fetch(outputs):
  """Waits for every tensor of `outputs` (None: an absent output)."""
  for t in tf.nest.flatten(outputs):
    if t is not None:
      t.numpy()


def TimeSamples(fn, repeats):
  """Seconds of `repeats` calls of `fn` (after one call that traces and
  warms up), each waiting for every output."""
  _Fetch(fn())
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _Fetch(fn())
    samples.append(time.perf_counter() - t0)
  return samples


def _TimeFns(fns, repeats):
  return [statistics.median(TimeSamples(fn, repeats)) for fn in fns]


def RandomInputs(specs):
  """Random floats (zeros for other dtypes; None stays None) of `specs`."""
  return tf.nest.map_structure(
    lambda s: (
      None
      if s is None
      else tf.random.normal(s.shape, dtype=s.dtype)
      if s.dtype.is_floating
      else tf.zeros(s.shape, s.dtype)
    ),
    specs,
  )


def LayerSteps(layer, xs):
  """(forward, forward+backward) of `layer` on inputs `xs`, as functions of
  no arguments: what this module and balancing by measured time
  (`partition.MeasureLayerTimes`) time. The backward computes the
  gradients of the weights and of the float inputs, as a cell's does."""

  @tf.function
  def Fwd():
    return py_utils.AsTuple(layer.FProp(layer.theta, *xs))

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      floats = [
        x for x in tf.nest.flatten(xs) if x is not None and x.dtype.is_floating
      ]
      tape.watch(floats)
      ys = py_utils.AsTuple(layer.FProp(layer.theta, *xs))
      total = tf.add_n(
        [
          tf.reduce_sum(tf.cast(y, tf.float32))
          for y in tf.nest.flatten(ys)
          if y is not None and y.dtype.is_floating
        ]
        or [tf.constant(0.0)]
      )
    grads = tape.gradient(total, list(layer.trainable_variables) + floats)
    return [g for g in grads if g is not None] or [total]

  return Fwd, Step


def _MeasureLayer(p, in_specs, batch_dim, batches, device, repeats):
  """{batch: (forward s, forward+backward s)} of layer `p`."""
  result = {}
  with tf.device(device), base_layer.DetachedBuild():
    layer = p.Instantiate()
    for b in batches:
      xs = RandomInputs(_WithBatch(in_specs, batch_dim, b))
      result[b] = tuple(_TimeFns(LayerSteps(layer, xs), repeats))
  return result


def MeasureProfile(
  profile,
  layer_params,
  device=None,
  repeats=3,
  time_budget_s=60.0,
):
  """Adds this host's measured per-layer times to `profile` (in place).

  Each distinct layer is built on `device` (one at a time, freed after),
  its forward and forward+backward timed at the full batch and at 1/8 of it
  (median of `repeats`); a line a + c * batch through the two gives the
  time of any micro-batch. Layers left when `time_budget_s` is spent, or
  that cannot run from shapes alone, get the flop rate the measured layers
  reached.

  Returns:
    `profile`.
  """
  batch = profile.batch_size
  small = max(1, batch // 8)
  batches = sorted({batch, small})
  deadline = time.perf_counter() + time_budget_s
  cache = {}
  rates = []
  for i, (lp, p) in enumerate(zip(profile.layers, layer_params)):
    if lp.in_specs is None or time.perf_counter() > deadline:
      continue
    p = p.Copy()
    if not p.name:
      p.name = f'layer_{i}'
    key = _Signature(p, lp.in_specs)
    if key not in cache:
      t = _MeasureLayer(
        p, lp.in_specs, profile.batch_dim, batches, device, repeats
      )
      fb, fs = t[batch], t[small]
      bb = max(fb[1] - fb[0], 0.0)
      bs = max(fs[1] - fs[0], 0.0)
      if batch == small:
        cache[key] = (0.0, fb[0] / batch, 0.0, bb / batch)
      else:
        c_f = max((fb[0] - fs[0]) / (batch - small), 0.0)
        c_b = max((bb - bs) / (batch - small), 0.0)
        cache[key] = (
          max(fb[0] - c_f * batch, 0.0),
          c_f,
          max(bb - c_b * batch, 0.0),
          c_b,
        )
      if lp.flops > 0 and fb[1] > 0:
        rates.append(3 * lp.flops / fb[1])
    lp.measured = cache[key]
  rate = statistics.median(rates) if rates else 1e10
  for lp in profile.layers:
    if lp.measured is None:
      per_example = lp.flops / batch / rate
      lp.measured = (0.0, per_example, 0.0, 2 * per_example)
  return profile


_LINK_PROBE = r"""
import json, statistics, time
import tensorflow as tf
from lingvo_gpipe.core import cluster
local = cluster.LocalCluster(2, intra_op_threads=1, inter_op_threads=2).Start()
try:
  cluster.Connect(local.cluster_spec)
  d0, d1 = local.devices[:2]
  out = {}
  for nbytes in (1024, 32 * 2**20):
    with tf.device(d0):
      x = tf.Variable(tf.zeros([nbytes // 4]))
    def Ops(mid, x=x):
      with tf.device(mid):
        y = x + 1.0
      with tf.device(d0):
        return tf.reduce_sum(y + 1.0)
    def Med(fn):
      fn().numpy()
      ts = []
      for _ in range(5):
        t0 = time.perf_counter()
        fn().numpy()
        ts.append(time.perf_counter() - t0)
      return statistics.median(ts)
    base = Med(tf.function(lambda: Ops(d0)))
    trip = Med(tf.function(lambda: Ops(d1)))
    out[nbytes] = max(trip - base, 1e-7) / 2
  print('LINK ' + json.dumps(out))
finally:
  local.Stop()
"""


def MeasureLink(timeout_s=180):
  """(bytes per s, latency s) one way between two TensorFlow server worker
  processes on this host (`cluster.LocalCluster`), from moving 1 KiB and
  32 MiB there and back."""
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  try:
    out = subprocess.run(
      [sys.executable, '-c', _LINK_PROBE],
      capture_output=True,
      text=True,
      timeout=timeout_s,
      env=env,
    )
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(
      f'Measuring the link between two local workers took over '
      f'{timeout_s} s; the host is too loaded, or use a preset.'
    ) from e
  lines = [ln for ln in out.stdout.splitlines() if ln.startswith('LINK ')]
  if out.returncode or not lines:
    raise RuntimeError(
      'Measuring the link between two local workers failed: '
      + (out.stderr.strip().splitlines() or ['no output'])[-1]
    )
  t = {int(k): v for k, v in json.loads(lines[-1][5:]).items()}
  small, big = sorted(t)
  bw = (big - small) / max(t[big] - t[small], 1e-9)
  return bw, max(t[small] - small / bw, 0.0)


def MeasuredDevice(memory_bytes, link=None):
  """The `device_presets.Device` of this host (per-layer times come from
  `MeasureProfile`); `link`: (bytes per s, latency s), else measured."""
  bw, latency = link if link else MeasureLink()
  return device_presets.Device(
    name='measure',
    description=(
      f'this host, measured: link {bw / 2**20:.0f} MiB/s one way, latency '
      f'{latency * 1e6:.0f} us between two local TensorFlow workers'
    ),
    peak_flops=1e11,
    memory_bytes=int(memory_bytes),
    memory_bytes_per_s=1e10,
    link_bytes_per_s=bw,
    link_latency_s=latency,
    op_overhead_s=0.0,
    flops_efficiency=1.0,
    allocator_overhead=device_presets.BFC_OVERHEAD,
  )
