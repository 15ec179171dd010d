"""The planner: chooses K, M, R, the split and re-materialization.

From a model's layer Params and input shapes it builds a per-layer profile
without allocating any weight (`ProfileLayers`): forward flops, output
bytes, parameter bytes, the bytes of the intermediate activations and the
number of ops, all read from the layer's abstractly traced `FProp` graph
(or its `FPropMeta` formula). `MeasureProfile` adds the measured per-layer
times of this host; `MeasureLink` the transfer bandwidth between two local
TensorFlow server workers. For every candidate (R replicas, K cells, M
micro-batches, recompute on or off, cells balanced by time or by memory),
`Plan` groups the layers into `cost_model.CellCost`s and simulates the
fill-drain schedule (`cost_model.Simulate`): predicted step time, peak
memory per device, bubble and bytes sent. Candidates are ranked by step
time; the others are rejected with a reason: does not fit (and what
dominates memory), bubble-bound or transfer-bound.

  profile = planner.ProfileLayers(layers, [[batch, dim]])
  result = planner.Plan(profile, cost_model.GetPreset('tpu_v3'),
                        num_devices=8)
  print(result.ToText())

`PipeliningLayer(num_stages='auto', num_micro_batches='auto')` calls
`Resolve` at build time.
"""

import dataclasses
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
from lingvo_gpipe.pipeline import balance
from lingvo_gpipe.pipeline import cost_model

__all__ = [
  'LayerProfile',
  'ModelProfile',
  'ProfileLayers',
  'MeasureProfile',
  'MeasureLink',
  'MeasuredDevice',
  'CellCosts',
  'CheckShape',
  'Candidate',
  'PlanResult',
  'Plan',
  'Evaluate',
  'Resolve',
  'DetectDevice',
  'FormatBytes',
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

# A fitting configuration whose devices idle more than this share of the
# step is bubble-bound.
BUBBLE_BOUND = 0.5
# ... or whose step would be this much shorter with free links,
# transfer-bound.
TRANSFER_BOUND = 0.3


def FormatBytes(n):
  n = float(n)
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TiB'


def _FormatS(s):
  if s >= 1:
    return f'{s:.3f} s'
  if s >= 1e-3:
    return f'{s * 1e3:.2f} ms'
  return f'{s * 1e6:.1f} us'


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
    in_specs: TensorSpecs of the inputs (for measuring).
    measured: (forward fixed s, forward s per example, backward fixed s,
      backward s per example) measured on this host, or None.
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
  in_specs: object = None
  measured: tuple = None

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
    dims = tf.TensorShape(s.shape).as_list()
    if len(dims) > batch_dim:
      return dims[batch_dim]
  return None


def _WithBatch(specs, batch_dim, batch):
  def Fn(s):
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
        t for t in tf.nest.flatten((theta, inputs)) if t.dtype.is_floating
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
  total = sum(_Bytes(t) for t in saved.values())
  return total, _BackwardExtra(graph, saved, total)


def _Bytes(t):
  n = t.shape.num_elements()
  if not n or t.dtype == tf.resource:
    return 0
  return int(n) * t.dtype.size


def _BackwardExtra(graph, saved, saved_bytes):
  """Peak bytes the backward pass allocates beyond the saved activations:
  the gradients of activations and temporaries, with each tensor freed
  after its last reader (ops in creation order). The weight gradients it
  returns are not counted (the gradients term holds them)."""
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
    if op.type not in _NO_ALLOCATION_OPS and op.type not in _ALIAS_OPS:
      for t in op.outputs:
        if t.ref() in outputs or t.ref() not in last:
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
  """(flops, out specs, activation bytes, num ops, in specs) of `p`'s FProp
  traced abstractly; None if it cannot be traced from shapes alone."""
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
      lambda t: tf.TensorSpec(t.shape, t.dtype), outs
    )
    try:
      act, extra = _SavedBytes(Fn, theta_spec, cand)
    except (ValueError, TypeError, LookupError, NotImplementedError):
      act, extra = 2 * _SpecBytes(out_specs), _SpecBytes(out_specs)
    # The layer's outputs are kept too (the next layer's inputs).
    act = max(act, _SpecBytes(out_specs))
    return meta.GraphFlops(graph), out_specs, act, extra, ops, cand
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
  param_bytes = sum(
    int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size for v in variables
  )
  traced = _TraceLayer(p, specs)
  if traced is not None:
    flops, out_specs, act, extra, ops, in_specs = traced
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
    num_ops=int(ops),
    in_specs=in_specs,
  )
  return prof, tuple(out_specs)


# -----------------------------------------------------------------------------
# measure: this host.
# -----------------------------------------------------------------------------


def _TimeFns(fns, repeats):
  out = []
  for fn in fns:
    tf.nest.map_structure(lambda t: t.numpy(), fn())  # trace, warm up
    samples = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      tf.nest.map_structure(lambda t: t.numpy(), fn())
      samples.append(time.perf_counter() - t0)
    out.append(statistics.median(samples))
  return out


def _MeasureLayer(p, in_specs, batch_dim, batches, device, repeats):
  """{batch: (forward s, forward+backward s)} of layer `p`."""
  result = {}
  with tf.device(device), base_layer.DetachedBuild():
    layer = p.Instantiate()
    for b in batches:
      specs = _WithBatch(in_specs, batch_dim, b)
      xs = tf.nest.map_structure(
        lambda s: (
          tf.random.normal(s.shape, dtype=s.dtype)
          if s.dtype.is_floating
          else tf.zeros(s.shape, s.dtype)
        ),
        specs,
      )

      @tf.function
      def Fwd(xs=xs, layer=layer):
        return py_utils.AsTuple(layer.FProp(layer.theta, *xs))

      @tf.function
      def Step(xs=xs, layer=layer):
        with tf.GradientTape() as tape:
          floats = [x for x in tf.nest.flatten(xs) if x.dtype.is_floating]
          tape.watch(floats)
          ys = py_utils.AsTuple(layer.FProp(layer.theta, *xs))
          total = tf.add_n(
            [
              tf.reduce_sum(tf.cast(y, tf.float32))
              for y in tf.nest.flatten(ys)
              if y.dtype.is_floating
            ]
            or [tf.constant(0.0)]
          )
        grads = tape.gradient(total, list(layer.trainable_variables) + floats)
        return [g for g in grads if g is not None] or [total]

      result[b] = tuple(_TimeFns([Fwd, Step], repeats))
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
  """The `cost_model.Device` of this host (per-layer times come from
  `MeasureProfile`); `link`: (bytes per s, latency s), else measured."""
  bw, latency = link if link else MeasureLink()
  return cost_model.Device(
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
  )


# -----------------------------------------------------------------------------
# Candidates.
# -----------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
  """One configuration and its prediction."""

  num_replicas: int
  num_stages: int
  num_micro_batches: int
  recompute: bool
  split_by: str
  splits: list
  step_s: float = 0.0
  examples_per_s: float = 0.0
  busy_fraction: list = None
  bubble: float = 0.0
  peak_bytes: list = None
  memory: dict = None  # breakdown of the device with the largest peak
  bytes_sent: list = None
  free_link_step_s: float = 0.0
  fits: bool = True
  verdict: str = 'ok'
  reason: str = ''
  events: list = None

  @property
  def max_peak_bytes(self):
    return max(self.peak_bytes)

  def Dominant(self):
    """(what, bytes): the largest share of the fullest device's memory."""
    groups = {
      'weights, gradients and optimizer slots': self.memory['weights']
      + self.memory['gradients']
      + self.memory['optimizer_slots'],
      'stored micro-batch inputs': self.memory['stored_inputs'],
      'activations': self.memory['activations']
      + self.memory.get('backward_temporaries', 0),
    }
    what = max(groups, key=groups.get)
    return what, groups[what]

  def Label(self):
    rc = 'recompute' if self.recompute else 'no recompute'
    return (
      f'R={self.num_replicas} K={self.num_stages} M={self.num_micro_batches} '
      f'{rc}, split by {self.split_by} {self.splits}'
    )

  def ToDict(self):
    d = dataclasses.asdict(self)
    d.pop('events')
    d['max_peak_bytes'] = self.max_peak_bytes
    d['dominant_memory'] = self.Dominant()[0]
    return d


def CellCosts(profile, splits, m, r, device):
  """One `cost_model.CellCost` per cell of `splits` for a micro-batch of
  batch / (m * r) examples on `device`."""
  frac = 1.0 / (m * r)
  batch = profile.batch_size
  cells = []
  start = 0
  for end in splits:
    lps = profile.layers[start:end]
    fwd = bwd = 0.0
    for lp in lps:
      f, b = lp.TimesS(frac, batch, device)
      fwd += f
      bwd += b
    cells.append(
      cost_model.CellCost(
        fprop_s=fwd,
        bprop_s=bwd,
        out_bytes=int(lps[-1].out_bytes * frac),
        weight_bytes=sum(lp.param_bytes for lp in lps),
        input_bytes=int(lps[0].in_bytes * frac),
        activation_bytes=int(sum(lp.activation_bytes for lp in lps) * frac),
        backward_bytes=int(max(lp.backward_bytes for lp in lps) * frac),
      )
    )
    start = end
  return cells


def Evaluate(
  profile,
  device,
  num_stages,
  num_micro_batches,
  recompute=True,
  num_replicas=1,
  splits=None,
  split_by='time',
  memory_bytes=None,
  optimizer_slots=2,
):
  """Predicts one configuration; returns a `Candidate`."""
  k, m, r = num_stages, num_micro_batches, num_replicas
  if splits is None:
    splits = _Splits(profile, k, split_by, device, optimizer_slots)
  spec = device.Spec(memory_bytes)
  cells = CellCosts(profile, splits, m, r, device)
  sync_s = 0.0
  if r > 1:
    # Replicas 1..R-1 read each cell's weights from replica 0 before the
    # step and send their gradients back after it, one link per cell.
    sync_s = (r - 1) * max(
      spec.link_latency_s + c.weight_bytes / spec.link_bytes_per_s
      for c in cells
    )
  # The engine adds each micro-batch's gradients to a running sum
  # (AccumulateNV2): both exist while one is added.
  sim = cost_model.Simulate(
    cells,
    m,
    spec,
    recompute,
    optimizer_slots,
    start_s=sync_s,
    end_s=sync_s,
    micro_batch_gradients=True,
  )
  free = cost_model.Simulate(
    cells,
    m,
    spec._replace(link_bytes_per_s=float('inf'), link_latency_s=0.0),
    recompute,
    optimizer_slots,
  )
  peaks = list(sim.peak_memory)
  worst = max(range(k), key=lambda i: peaks[i])
  cand = Candidate(
    num_replicas=r,
    num_stages=k,
    num_micro_batches=m,
    recompute=bool(recompute),
    split_by=split_by,
    splits=list(splits),
    step_s=sim.step_s,
    examples_per_s=profile.batch_size / sim.step_s,
    busy_fraction=list(sim.busy_fraction),
    bubble=1.0 - sum(sim.busy_fraction) / k,
    peak_bytes=peaks,
    memory=cost_model.MemoryBreakdown(
      cells[worst], m, recompute, optimizer_slots, micro_batch_gradients=True
    ),
    bytes_sent=list(sim.bytes_sent),
    free_link_step_s=free.step_s,
    events=sim.events,
  )
  limit = spec.memory_bytes
  if cand.max_peak_bytes > limit:
    what, nbytes = cand.Dominant()
    cand.fits = False
    cand.verdict = 'does not fit'
    cand.reason = (
      f'needs {FormatBytes(cand.max_peak_bytes)} on device {worst} > '
      f'{FormatBytes(limit)}; {what} dominate ({FormatBytes(nbytes)})'
    )
  elif (cand.step_s - free.step_s) > TRANSFER_BOUND * cand.step_s:
    cand.verdict = 'transfer-bound'
    cand.reason = (
      f'{100 * (cand.step_s - free.step_s) / cand.step_s:.0f}% of the step '
      'waits for transfers between devices'
    )
  elif cand.bubble > BUBBLE_BOUND:
    cand.verdict = 'bubble-bound'
    cand.reason = (
      f'devices idle {100 * cand.bubble:.0f}% of the step (fill-drain '
      f'bubble (K-1)/(M+K-1) and imbalance); use M >= 4K'
    )
  return cand


def _Splits(profile, k, split_by, device, optimizer_slots):
  if split_by == 'time':
    costs = [
      sum(lp.TimesS(1.0, profile.batch_size, device)) for lp in profile.layers
    ]
  elif split_by == 'memory':
    costs = [
      lp.param_bytes * (2 + optimizer_slots) + lp.activation_bytes
      for lp in profile.layers
    ]
  else:
    raise ValueError(f'split_by={split_by!r}; use time or memory.')
  return balance.BalancedSplits(costs, k)


def _Divisors(n, limit):
  return [m for m in range(1, min(n, limit) + 1) if n % m == 0]


@dataclasses.dataclass
class PlanResult:
  """The ranked feasible candidates and the rejected ones."""

  model: str
  device: object
  num_devices: int
  memory_bytes: int
  feasible: list
  rejected: list

  @property
  def best(self):
    return self.feasible[0] if self.feasible else None

  def SmallestNeed(self):
    """The candidate that needs the least memory on its fullest device."""
    everything = self.feasible + self.rejected
    return min(everything, key=lambda c: c.max_peak_bytes)

  def ToText(self, top=10, rejected_per_reason=3):
    d = self.device
    lines = [
      f'Plan for {self.model} on {self.num_devices} x {d.name} '
      f'({FormatBytes(self.memory_bytes)} each): {d.description}.'
    ]
    if not self.feasible:
      need = self.SmallestNeed()
      what, nbytes = need.Dominant()
      lines.append(
        f'No configuration fits in {FormatBytes(self.memory_bytes)} per '
        f'device. The smallest need is {FormatBytes(need.max_peak_bytes)} '
        f'({need.Label()}); {what} dominate it ({FormatBytes(nbytes)}). '
        'Give devices more memory (--memory_per_device), more devices, or '
        'a smaller model or batch.'
      )
    else:
      head = (
        f'{"#":>3} {"R":>2} {"K":>3} {"M":>4} {"recompute":>9} '
        f'{"step":>10} {"examples/s":>11} {"bubble":>6} '
        f'{"peak/device":>12}  splits (by)'
      )
      lines += ['Feasible, best first:', head, '-' * len(head)]
      for i, c in enumerate(self.feasible[:top]):
        note = '' if c.verdict == 'ok' else f'  [{c.verdict}]'
        lines.append(
          f'{i + 1:>3} {c.num_replicas:>2} {c.num_stages:>3} '
          f'{c.num_micro_batches:>4} {"yes" if c.recompute else "no":>9} '
          f'{_FormatS(c.step_s):>10} {c.examples_per_s:>11.4g} '
          f'{100 * c.bubble:>5.0f}% '
          f'{FormatBytes(c.max_peak_bytes):>12}  {c.splits} '
          f'({c.split_by}){note}'
        )
      if len(self.feasible) > top:
        lines.append(f'... and {len(self.feasible) - top} more feasible.')
    by_reason = {}
    for c in self.rejected:
      by_reason.setdefault(c.verdict, []).append(c)
    if by_reason:
      lines.append('Rejected:')
    for verdict, cands in by_reason.items():
      lines.append(f'  {verdict}: {len(cands)} configurations, e.g.')
      for c in sorted(cands, key=lambda c: c.step_s)[:rejected_per_reason]:
        lines.append(f'    {c.Label()}: {c.reason}.')
    return '\n'.join(lines)

  def ToDict(self):
    return dict(
      model=self.model,
      device=dataclasses.asdict(self.device),
      num_devices=self.num_devices,
      memory_bytes=self.memory_bytes,
      feasible=[c.ToDict() for c in self.feasible],
      rejected=[c.ToDict() for c in self.rejected],
    )


def CheckShape(num_layers, num_devices, num_stages=None, num_replicas=None):
  """Raises ValueError for K or R that the layers or devices cannot take."""
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(
      f'num_devices={num_devices!r}: give a positive number of devices.'
    )
  if num_stages is not None:
    if num_stages < 1 or num_stages > num_layers:
      raise ValueError(
        f'num_stages={num_stages} but the model has {num_layers} layers: '
        f'K must lie in [1, {min(num_layers, num_devices)}] (every cell '
        'needs a layer and a device).'
      )
  r = num_replicas or 1
  k = num_stages or 1
  if k * r > num_devices:
    if num_stages and num_replicas:
      fix = (
        f'with R={r}, K must lie in [1, {max(1, num_devices // r)}]; with '
        f'K={k}, R in [1, {max(1, num_devices // k)}]'
      )
    elif num_stages:
      fix = f'K must lie in [1, {min(num_layers, num_devices)}]'
    else:
      fix = f'R must lie in [1, {num_devices}]'
    raise ValueError(
      f'K={k} x R={r} = {k * r} devices, but only {num_devices} are given: '
      f'{fix}.'
    )


def Plan(
  profile,
  device,
  num_devices,
  memory_bytes=None,
  optimizer_slots=2,
  num_stages=None,
  num_micro_batches=None,
  num_replicas=None,
  recompute=None,
  max_micro_batches=64,
  split_by=('time', 'memory'),
):
  """Predicts every candidate; returns a `PlanResult`.

  Args:
    profile: a `ModelProfile`.
    device: a `cost_model.Device`.
    num_devices: devices available; candidates use K * R <= num_devices.
    memory_bytes: memory per device (default: the device's).
    optimizer_slots: optimizer slots per weight (Adam 2, SGD 0).
    num_stages, num_micro_batches, num_replicas, recompute: fix one of them
      (None: search).
    max_micro_batches: the largest M tried.
    split_by: how cells are balanced: by 'time' and/or by 'memory'.
  """
  num_layers = profile.num_layers
  CheckShape(num_layers, num_devices, num_stages, num_replicas)
  memory_bytes = int(memory_bytes or device.memory_bytes)
  batch = profile.batch_size
  reps = [num_replicas] if num_replicas else range(1, num_devices + 1)
  recomputes = [recompute] if recompute is not None else [True, False]
  splits_cache = {}
  cands = []
  for r in reps:
    if batch % r:
      continue
    max_k = min(num_layers, num_devices // r)
    ks = [num_stages] if num_stages else range(1, max_k + 1)
    for k in ks:
      if num_micro_batches:
        ms = (
          [num_micro_batches] if (batch // r) % num_micro_batches == 0 else []
        )
      else:
        ms = _Divisors(batch // r, max_micro_batches)
      bys = split_by if k > 1 else split_by[:1]
      for by in bys:
        key = (k, by)
        if key not in splits_cache:
          splits_cache[key] = _Splits(profile, k, by, device, optimizer_slots)
        splits = splits_cache[key]
        if by != bys[0] and splits == splits_cache[(k, bys[0])]:
          continue
        for m in ms:
          for rc in recomputes:
            cands.append(
              Evaluate(
                profile,
                device,
                k,
                m,
                rc,
                r,
                splits,
                by,
                memory_bytes,
                optimizer_slots,
              )
            )
  if not cands:
    raise ValueError(
      f'No configuration: the batch of {batch} is not divisible by '
      f'num_replicas={num_replicas} or num_micro_batches='
      f'{num_micro_batches}; use divisors of {batch}.'
    )
  cands.sort(key=lambda c: (c.step_s, c.max_peak_bytes))
  fitting = [c for c in cands if c.fits]
  any_ok = any(c.verdict == 'ok' for c in fitting)
  feasible = [c for c in fitting if c.verdict == 'ok' or not any_ok]
  rejected = [c for c in cands if c not in feasible]
  return PlanResult(
    model=profile.name,
    device=device,
    num_devices=num_devices,
    memory_bytes=memory_bytes,
    feasible=feasible,
    rejected=rejected,
  )


# -----------------------------------------------------------------------------
# 'auto' in PipeliningLayer.
# -----------------------------------------------------------------------------


def DetectDevice(devices):
  """The preset that best describes `devices` (TensorFlow device names):
  the GPU preset named in the GPU's name, else 'cpu'."""
  name = (devices or [''])[0] or ''
  if 'GPU' in name.upper():
    try:
      gpus = tf.config.list_physical_devices('GPU')
      details = tf.config.experimental.get_device_details(gpus[0])
      model = details.get('device_name', '').lower()
    except (IndexError, ValueError, RuntimeError):
      model = ''
    for key in ('h100', 'a100', 'v100'):
      if key in model:
        return cost_model.PRESETS[key]
    return cost_model.PRESETS['v100']
  if 'TPU' in name.upper():
    return cost_model.PRESETS['tpu_v3']
  return cost_model.PRESETS['cpu']


def Resolve(
  layer_params,
  input_shapes,
  num_devices,
  num_stages='auto',
  num_micro_batches='auto',
  num_replicas=1,
  recompute=True,
  device=None,
  memory_bytes=None,
  batch_dim=0,
  name='pipeline',
  split_by=('time',),
):
  """Chooses K and/or M for a pipeline; returns (K, M, Candidate, text).

  `num_stages` / `num_micro_batches` are 'auto' or fixed ints; K * R is at
  most `num_devices`; M divides the per-replica batch.
  """
  if input_shapes is None:
    raise ValueError(
      f"Pipeline {name!r}: num_stages/num_micro_batches='auto' need "
      'input_shapes with the batch size (e.g. [[64, 1024]]) so that the '
      'planner can predict time and memory; set input_shapes or give '
      'num_stages and num_micro_batches.'
    )
  if isinstance(device, str):
    device = cost_model.GetPreset(device)
  profile = ProfileLayers(layer_params, input_shapes, batch_dim, name)
  k = None if num_stages == 'auto' else num_stages
  m = None if num_micro_batches == 'auto' else num_micro_batches
  result = Plan(
    profile,
    device,
    num_devices,
    memory_bytes=memory_bytes,
    num_stages=k,
    num_micro_batches=m,
    num_replicas=num_replicas,
    recompute=recompute,
    split_by=split_by,
  )
  best = result.best
  if best is None:
    need = result.SmallestNeed()
    what, nbytes = need.Dominant()
    raise ValueError(
      f'Pipeline {name!r}: no K (<= {num_devices // num_replicas}) and M '
      f'fit in {FormatBytes(result.memory_bytes)} per device '
      f'({device.name}); the smallest need is '
      f'{FormatBytes(need.max_peak_bytes)} ({need.Label()}), dominated by '
      f'{what} ({FormatBytes(nbytes)}). Use more devices or '
      'planner_memory_per_device if the devices have more memory.'
    )
  auto = [
    n
    for n, v in (
      ('num_stages', num_stages),
      ('num_micro_batches', num_micro_batches),
    )
    if v == 'auto'
  ]
  text = (
    f'planned ({", ".join(a + "=auto" for a in auto)}; device preset '
    f'{device.name}, {FormatBytes(result.memory_bytes)} per device): '
    f'K={best.num_stages}, M={best.num_micro_batches}; predicted step '
    f'{_FormatS(best.step_s)}, bubble {100 * best.bubble:.0f}%, peak '
    f'{FormatBytes(best.max_peak_bytes)} per device, '
    f'{len(result.feasible)} feasible of '
    f'{len(result.feasible) + len(result.rejected)} configurations'
  )
  return best.num_stages, best.num_micro_batches, best, text
