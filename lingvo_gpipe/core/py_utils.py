"""Common utilities, as in Lingvo's `py_utils`.

Holds `NestedMap`, weight parameters and initializers (`WeightParams`,
`WeightInit`), the seed helpers that make randomness addressable (so a
re-materialized forward pass draws exactly the values the first one drew), the
evaluation-mode context and the collector of deferred variable updates (batch
norm moving averages) that lets a pipeline compute statistics per micro-batch
and apply them once per mini-batch.
"""

import contextlib
import hashlib
import threading

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import meta
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = [
  'NestedMap',
  'WeightInit',
  'WeightParams',
  'StableHash',
  'EvalMode',
  'IsEval',
  'StepSeed',
  'GenerateStepSeedPair',
  'UpdateCollector',
  'AddDeferredUpdate',
  'OnDeviceOf',
  'NodeDefs',
  'HasShape',
  'Flatten',
  'Pack',
  'Transform',
  'GetShape',
  'CheckNumerics',
  'REPLICATED_AGGREGATION',
  'CrossReplicaReduce',
  'AsTuple',
  'OutOfLineFunction',
  'Unwrap',
  'IsTensor',
  'Stack',
  'GetOrCreateGlobalStep',
  'GetOrCreateGlobalStepVar',
]

Flatten = tf.nest.flatten
Pack = tf.nest.pack_sequence_as


def Transform(fn, *structures):
  """`tf.nest.map_structure` under Lingvo's name."""
  return tf.nest.map_structure(fn, *structures)


def StableHash(*parts):
  """A 31-bit hash of `parts` that is the same in every process and run."""
  text = '\x00'.join(str(p) for p in parts).encode('utf-8')
  return (
    int.from_bytes(hashlib.sha256(text).digest()[:4], 'little') & 0x7FFFFFFF
  )


# ---------------------------------------------------------------------------
# Weight initialization.
# ---------------------------------------------------------------------------


class WeightInit:
  """Static constructors of weight-initializer Params, as in Lingvo.

  Each returns a Params with `method`, `scale` and `seed`. The draw is a
  stateless function of (seed, variable name), so a variable gets the same
  initial value whatever device it lives on and however a model is split.
  """

  @staticmethod
  def _Params(method, scale, seed):
    p = hyperparams.Params()
    p.Define('method', method, 'Initialization method.')
    p.Define('scale', scale, 'Initialization scale.')
    p.Define('seed', seed, 'Random seed; None: derived from the name.')
    return p

  @staticmethod
  def Gaussian(scale=1.0, seed=None):
    """N(0, scale^2)."""
    return WeightInit._Params('gaussian', scale, seed)

  @staticmethod
  def Uniform(scale=1.0, seed=None):
    """U(-scale, scale)."""
    return WeightInit._Params('uniform', scale, seed)

  @staticmethod
  def TruncatedGaussian(scale=1.0, seed=None):
    """N(0, scale^2) truncated at two standard deviations."""
    return WeightInit._Params('truncated_gaussian', scale, seed)

  @staticmethod
  def Xavier(scale=1.0, seed=None):
    """Glorot uniform: U(-a, a), a = scale * sqrt(6 / (fan_in + fan_out))."""
    return WeightInit._Params('xavier', scale, seed)

  Glorot = Xavier

  @staticmethod
  def GaussianSqrtDim(scale=1.0, seed=None):
    """N(0, (scale / sqrt(shape[0]))^2)."""
    return WeightInit._Params('gaussian_sqrt_dim', scale, seed)

  @staticmethod
  def GaussianSqrtFanIn(scale=1.0, seed=None):
    """N(0, (scale / sqrt(fan_in))^2)."""
    return WeightInit._Params('gaussian_sqrt_fanin', scale, seed)

  @staticmethod
  def UniformSqrtDim(scale=1.0, seed=None):
    """U(-a, a), a = scale / sqrt(shape[-1])."""
    return WeightInit._Params('uniform_sqrt_dim', scale, seed)

  @staticmethod
  def UniformUnitScaling(scale=1.0, seed=None):
    """U(-a, a), a = scale * sqrt(3 / fan_in)."""
    return WeightInit._Params('uniform_unit_scaling', scale, seed)

  @staticmethod
  def Constant(scale=0.0):
    """Every element equals `scale`."""
    return WeightInit._Params('constant', scale, 0)


_INIT_METHODS = (
  'gaussian',
  'uniform',
  'truncated_gaussian',
  'xavier',
  'gaussian_sqrt_dim',
  'gaussian_sqrt_fanin',
  'uniform_sqrt_dim',
  'uniform_unit_scaling',
  'constant',
)


def DefaultParamInit():
  """The default `params_init` of a layer: Xavier with scale 1.000001.

  The odd scale marks "not set by the user", so a child layer inherits its
  parent's initializer unless it was given one (Lingvo's convention).
  """
  return WeightInit.Xavier(1.000001)


def IsDefaultParamInit(p):
  return (
    p.method == 'xavier' and abs(p.scale - 1.000001) < 1e-9 and p.seed is None
  )


def WeightParams(
  shape, init=None, dtype=None, collections=None, shared_name=None
):
  """Describes a variable to `BaseLayer.CreateVariable`.

  Args:
    shape: list of ints.
    init: a `WeightInit` Params; None uses the layer's `params_init`.
    dtype: variable dtype; None uses the layer's `dtype`.
    collections: names of collections the variable belongs to (e.g.
      'skip_weight_decay'); kept for Lingvo compatibility and for
      regularizers to filter on.
    shared_name: when set, every layer that creates a variable with the same
      `shared_name` under one root layer gets the same variable (e.g. an
      embedding tied with a softmax in another pipeline cell). Shapes and
      dtypes must agree.

  Returns:
    A Params.
  """
  p = hyperparams.Params()
  p.Define('shape', list(shape), 'Shape of the variable.')
  p.Define('init', init, 'Initializer Params (WeightInit.*).')
  p.Define('dtype', dtype, 'Variable dtype.')
  p.Define('collections', list(collections or []), 'Collections.')
  p.Define('shared_name', shared_name, 'Name under which to share it.')
  return p


def _Fans(shape):
  if not shape:
    return 1, 1
  if len(shape) == 1:
    return shape[0], shape[0]
  receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
  return shape[-2] * receptive, shape[-1] * receptive


def InitialValue(init, shape, dtype, seed):
  """Computes an initial value tensor. `seed` is a Python int."""
  if init.method not in _INIT_METHODS:
    raise ValueError(
      f'Unknown weight init method {init.method!r}; use one of {_INIT_METHODS}.'
    )
  shape = [int(s) for s in shape]
  scale = float(init.scale)
  seed_pair = tf.constant([seed, StableHash('init', seed)], tf.int64)
  fan_in, fan_out = _Fans(shape)
  m = init.method
  if m == 'constant':
    value = tf.fill(shape, tf.constant(scale, tf.float32))
  elif m in ('gaussian', 'gaussian_sqrt_dim', 'gaussian_sqrt_fanin'):
    std = scale
    if m == 'gaussian_sqrt_dim':
      std = scale / np.sqrt(shape[0] if shape else 1)
    elif m == 'gaussian_sqrt_fanin':
      std = scale / np.sqrt(fan_in)
    value = std * tf.random.stateless_normal(shape, seed_pair)
  elif m == 'truncated_gaussian':
    value = scale * tf.random.stateless_truncated_normal(shape, seed_pair)
  else:
    if m == 'uniform':
      limit = scale
    elif m == 'xavier':
      limit = scale * np.sqrt(6.0 / (fan_in + fan_out))
    elif m == 'uniform_sqrt_dim':
      limit = scale / np.sqrt(shape[-1] if shape else 1)
    else:  # uniform_unit_scaling
      limit = scale * np.sqrt(3.0 / fan_in)
    value = tf.random.stateless_uniform(shape, seed_pair, -limit, limit)
  return tf.cast(value, dtype)


# ---------------------------------------------------------------------------
# Thread-local contexts: eval mode, step seeds, deferred updates.
# ---------------------------------------------------------------------------

_local = threading.local()


def _Stack(name):
  if not hasattr(_local, name):
    setattr(_local, name, [])
  return getattr(_local, name)


@contextlib.contextmanager
def EvalMode(is_eval=True):
  """Layers built or run inside see `IsEval() == is_eval`.

  Dropout is off and batch norm uses its moving averages in eval mode. The
  mode is read when a `tf.function` traces, so trace train and eval steps as
  separate functions.
  """
  stack = _Stack('eval')
  stack.append(bool(is_eval))
  try:
    yield
  finally:
    stack.pop()


def IsEval():
  stack = _Stack('eval')
  return stack[-1] if stack else False


@contextlib.contextmanager
def StepSeed(seed):
  """Sets the dynamic part of every random op's seed inside the context.

  Args:
    seed: an int64 scalar tensor (or int), e.g. the global step; the pipeline
      sets one per micro-batch, derived from the step and the micro-batch
      index, and sets the same one again when it recomputes the forward pass.
  """
  stack = _Stack('step_seed')
  stack.append(tf.cast(seed, tf.int64))
  try:
    yield
  finally:
    stack.pop()


def CurrentStepSeed():
  stack = _Stack('step_seed')
  return stack[-1] if stack else tf.constant(0, tf.int64)


def GenerateStepSeedPair(layer_seed):
  """A stateless seed pair for a random op.

  Args:
    layer_seed: Python int identifying the op (from the layer's name and its
      `random_seed` param).

  Returns:
    An int64 [2] tensor: (layer_seed, current step seed). The same layer and
    step seed always give the same random values.
  """
  stack = _Stack('layer_seed_map')
  if stack:
    return tf.stack([stack[-1](layer_seed), CurrentStepSeed()])
  return tf.stack([tf.constant(layer_seed, tf.int64), CurrentStepSeed()])


@contextlib.contextmanager
def LayerSeedMap(fn):
  """Inside, a random op's layer seed is `fn(layer_seed)` (an int64 scalar
  tensor) instead of the constant: one traced function then serves layers
  whose seeds differ (`cells.layer_function`)."""
  stack = _Stack('layer_seed_map')
  stack.append(fn)
  try:
    yield
  finally:
    stack.pop()


def MixSeed(seed, index):
  """Derives a new int64 step seed from `seed` and a Python int `index`."""
  return tf.bitwise.bitwise_xor(
    tf.cast(seed, tf.int64) * 1000003,
    tf.constant(StableHash('mix', index), tf.int64),
  )


class UpdateCollector:
  """Collects deferred variable updates (e.g. batch-norm statistics).

  Layers call `AddDeferredUpdate(layer, stats)` during FProp instead of
  assigning variables. Whoever runs the model decides when to apply them:

    with py_utils.UpdateCollector() as updates:
      loss = model.FProp(theta, batch)
    updates.Apply()   # each layer merges its stats and assigns once

  A pipeline opens one collector per micro-batch and cell, then forwards all
  the statistics to the enclosing collector, so the moving averages are
  updated once per mini-batch from the statistics of all micro-batches.
  Outside any collector, updates are applied at once. `Apply` is not
  converted by AutoGraph: that only slowed the trace (docs/benchmarks.md).
  """

  def __init__(self):
    self.updates = []  # list of (layer, NestedMap of tensors)

  def __enter__(self):
    _Stack('updates').append(self)
    return self

  def __exit__(self, *unused):
    _Stack('updates').pop()

  def Add(self, layer, stats):
    self.updates.append((layer, stats))

  def Grouped(self):
    """Returns [(layer, [stats, ...])] in first-seen order."""
    groups = {}  # id(layer) -> (layer, [stats, ...]), in first-seen order
    for layer, stats in self.updates:
      groups.setdefault(id(layer), (layer, []))[1].append(stats)
    return list(groups.values())

  @tf.autograph.experimental.do_not_convert
  def Apply(self):
    """Applies every layer's updates; returns the list of assign ops."""
    ops = []
    for layer, stats_list in self.Grouped():
      op = layer.ApplyDeferredUpdates(stats_list)
      if op is not None:
        ops.append(op)
    return ops


def OnDeviceOf(variable):
  """A device scope on `variable`'s device, for the ops that compute its
  deferred update (e.g. merging a batch norm's statistics of every
  micro-batch): outside it they run where the caller's scope says (the
  driving process, for a pipeline over worker processes), and every
  statistic goes there and back. No scope under a tf.distribute strategy,
  whose replicas each update their own copy."""
  if tf.distribute.has_strategy() or not getattr(variable, 'device', None):
    return contextlib.nullcontext()
  return tf.device(variable.device)


# Under a tf.distribute strategy (TPUStrategy, MirroredStrategy) every
# replica computes the same update from all-reduced gradients and statistics:
# the first replica's value is written to every copy. Outside a strategy
# this has no effect.
REPLICATED_AGGREGATION = tf.VariableAggregation.ONLY_FIRST_REPLICA


def CrossReplicaReduce(tensors, reduce_op):
  """`tensors` (a list) reduced (SUM or MEAN) over the tf.distribute
  replicas, inside a replica of several; unchanged elsewhere."""
  ctx = tf.distribute.get_replica_context()
  if (
    ctx is None
    or not tf.distribute.has_strategy()
    or ctx.num_replicas_in_sync == 1
  ):
    return tensors
  return ctx.all_reduce(reduce_op, list(tensors))


def AddDeferredUpdate(layer, stats):
  """Hands `stats` to the innermost collector, or applies them at once."""
  stack = _Stack('updates')
  if stack:
    stack[-1].Add(layer, stats)
  else:
    layer.ApplyDeferredUpdates([stats])


@contextlib.contextmanager
def NoUpdateCollection():
  """Drops deferred updates inside (used by the recompute pass)."""
  sink = UpdateCollector()
  with sink:
    yield


# ---------------------------------------------------------------------------
# Shapes and small tensor helpers.
# ---------------------------------------------------------------------------


def OutOfLineFunction(fn):
  """`fn` as a tf.function whose calls TensorFlow's graph optimizer keeps
  as calls (`_noinline`): traced once, its ops stand once in the graph's
  function library however often a step calls it (a pipeline cell per
  micro-batch, an optimizer's update per variable)."""
  return tf.function(
    fn, autograph=False, experimental_attributes={'_noinline': True}
  )


def AsTuple(x):
  """`x` as a tuple of layer outputs: a plain tuple stays, anything else
  (a tensor, a NestedMap, a namedtuple) becomes a 1-tuple."""
  if isinstance(x, tuple) and not hasattr(x, '_fields'):
    return x
  return (x,)


def Unwrap(xs):
  """The inverse of `AsTuple` for FProp results: one output is returned bare."""
  return xs[0] if len(xs) == 1 else xs


def Stack(tensors):
  """tf.stack(tensors) along a new first axis; where `tensors` are all the
  outputs, in order, of one unstack along the first axis (a pipeline hands
  its micro-batches' statistics over that way), the tensor they came from:
  the same values, without a copy or an op per statistic."""
  first = tensors[0] if tensors else None
  if isinstance(first, tf.Tensor) and not tf.executing_eagerly():
    op = first.op
    if (
      op.type == 'Unpack'
      and op.get_attr('axis') == 0
      and len(op.outputs) == len(tensors)
      and all(
        isinstance(t, tf.Tensor) and t.op is op and t.value_index == i
        for i, t in enumerate(tensors)
      )
    ):
      return op.inputs[0]
  return tf.stack(tensors)


def NodeDefs(graph):
  """Every NodeDef of `graph` and of the functions it calls (those of its
  function library), as one list."""
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node)
  for fn in graph_def.library.function:
    nodes += fn.node_def
  return nodes


def IsTensor(x):
  """True for a tf.Tensor or tf.Variable."""
  return isinstance(x, (tf.Tensor, tf.Variable))


def GetShape(tensor, ndims=None):
  """Static dims where known, dynamic scalars elsewhere (Lingvo's GetShape).

  Where every dim asked for is static, no op is made: a traced function
  then holds no Shape and slicing ops for shapes known when it is traced.
  """
  tensor = tf.convert_to_tensor(tensor)
  static = tensor.shape.as_list() if tensor.shape.rank is not None else None
  if static is None:
    dynamic = tf.shape(tensor)
    return dynamic if ndims is None else [dynamic[i] for i in range(ndims)]
  static = static[:ndims] if ndims is not None else static
  if None not in static:
    return static
  dynamic = tf.shape(tensor)
  return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


def HasShape(tensor, expected, layer_name='', what='input'):
  """Raises ValueError naming the layer and both shapes when they differ.

  `expected` may contain -1 or None for "any". Checks static shapes only.
  """
  exp = [None if (d is None or d == -1) else int(d) for d in expected]
  meta.CheckShape(
    str(layer_name),
    what,
    tensor.shape,
    exp,
    "Check the layer's Params (e.g. input_dim) against the tensor you pass.",
  )
  return tensor


def CheckNumerics(x, message='NaN or Inf found'):
  return tf.debugging.check_numerics(x, message)


_GLOBAL_STEP = []


def GetOrCreateGlobalStep():
  """Lingvo's process-wide int64 step variable `global_step`, made at the
  first call (a task's trainer keeps its own, `task.global_step`)."""
  if not _GLOBAL_STEP:
    with tf.init_scope():
      _GLOBAL_STEP.append(
        tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
      )
  return _GLOBAL_STEP[0]


GetOrCreateGlobalStepVar = GetOrCreateGlobalStep
