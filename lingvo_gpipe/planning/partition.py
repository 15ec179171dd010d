"""Per-layer costs and the split of a layer sequence into pipeline cells.

Costs come from one of:
  'flops'   `FPropMeta` flops of each layer on the given input shapes (the way
            Lingvo's `PartitionSequentialLayers` balances); no weights built;
  'params'  the number of weights of each layer (DeepSpeed's 'parameters');
  'time'    the median measured forward+backward time of each layer on a
            device (torchgpipe's `balance_by_time`); layers are built one at a
            time on that device, timed and freed;
  'uniform' every layer costs 1.
`balance.BalancedSplits` then minimizes the variance of the cell costs.

  'memory'  each device's estimated peak bytes (`LayerMemory`): weights x
            (1 + gradient + optimizer slots), the outputs of the cell's
            layers for one micro-batch, internals included (what
            re-materialization keeps live while the cell's backward pass
            runs; `ActivationBytes`), and the cell's input
            stored for every micro-batch. `balance.MemorySplits` minimizes
            the largest device's bytes, which is what limits capacity.
"""

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.planning import balance
from lingvo_gpipe.planning import layer_profile

__all__ = [
  'LayerMetas',
  'ActivationBytes',
  'LayerCosts',
  'LayerMemory',
  'ComputeSplits',
  'FormatShapes',
  'PartitionSequentialLayers',
  'MeasureLayerTimes',
  'Report',
  'BalanceWarnings',
]

BALANCE_BY = ('flops', 'params', 'time', 'uniform', 'memory')

# Bytes held per weight byte: the weight, its gradient (accumulator) and
# Adam's two slots.
DEFAULT_STATE_COPIES = 4

# A partition whose most expensive cell costs more than this times the mean
# cell cost is reported (the pipeline runs at the pace of that cell).
MAX_QUIET_IMBALANCE = 1.5


def _Named(p, i):
  p = p.Copy()
  if not p.name:
    p.name = f'layer_{i}'
  return p


# The one chained FPropMeta, under the names this module always had.
LayerMetas = sequential.LayerMetas
FormatShapes = sequential.FormatShapes


def MeasureLayerTimes(
  layer_params, input_shapes, device=None, repeats=5, dtype=tf.float32
):
  """Median forward+backward seconds of each layer on `device`.

  Each layer is built, its forward and backward (`layer_profile.LayerSteps`,
  the planner's measurement) run `repeats` times on random inputs and freed
  before the next one is built, so only one layer's weights exist at a
  time. A layer's inputs have the shapes of the previous layer's outputs.
  """
  specs = tuple(meta.ToSpec(s, dtype) for s in input_shapes)
  times = []
  for i, p in enumerate(layer_params):
    p = _Named(p, i)
    with tf.device(device), base_layer.DetachedBuild():
      layer = p.Instantiate()
      fwd, step = layer_profile.LayerSteps(
        layer, layer_profile.RandomInputs(specs)
      )
      ys = fwd()
      times.append(layer_profile.TimeSamples(step, repeats))
    specs = tuple(
      tf.nest.map_structure(lambda y: tf.TensorSpec(y.shape, y.dtype), ys)
    )
    del layer, fwd, step
  return balance.CostsFromMeasurements(times)


def _Bytes(shapes):
  """Bytes of a (nested) structure of shapes (float32 unless a spec says)."""
  specs = tf.nest.flatten(meta.ToSpec(shapes))
  total = 0
  for s in specs:
    n = tf.TensorShape(s.shape).num_elements()
    if n is None:
      raise ValueError(
        f'balance_by="memory" needs fully known input shapes, got {s.shape}: '
        'give the batch size too, e.g. input_shapes=[[32, 1024]].'
      )
    total += n * s.dtype.size
  return total


# Ops whose outputs are no activations: inputs, weights, constants, shapes.
_NOT_ACTIVATIONS = frozenset(
  [
    'Placeholder',
    'ReadVariableOp',
    'Const',
    'Shape',
    'ShapeN',
    'Size',
    'Rank',
    'NoOp',
    'Reshape',
    'Identity',
    'ExpandDims',
    'Squeeze',
  ]
)


def ActivationBytes(p, *input_specs):
  """Bytes of the tensors one forward pass of the layer computes.

  The layer is built abstractly (no weights allocated) and its FProp traced;
  the bytes of every floating output of every op are summed, except inputs,
  weights, constants and views (reshapes, identities). This is what the
  backward pass of a re-materialized cell can keep live, counting internals
  that the layer's output shapes do not show (an AmoebaNet cell's branches,
  a Transformer's attention probabilities and FFN hidden layer).

  Args:
    p: the layer's Params.
    *input_specs: its inputs: tf.TensorSpecs (dtype matters, e.g. int32 token
      ids) or shapes (float32), NestedMaps allowed.

  Returns:
    (bytes, output specs): an int and a tuple of the outputs' TensorSpecs,
    the next layer's `input_specs`.
  """
  p = p.Copy()
  if not p.name:
    p.name = 'memory'
  layer = p.cls.AbstractInstance(p)
  theta_spec = layer.vars.Transform(lambda v: v.ToSpec())
  specs = [meta.ToSpec(a) for a in input_specs]

  def Fn(theta, *inputs):
    return layer.FProp(theta, *inputs)

  concrete = tf.function(Fn, autograph=False).get_concrete_function(
    theta_spec, *specs
  )
  total = 0
  for op in concrete.graph.get_operations():
    if op.type in _NOT_ACTIVATIONS:
      continue
    for out in op.outputs:
      if out.dtype.is_floating:
        total += int(out.shape.num_elements() or 0) * out.dtype.size
  outs = py_utils.AsTuple(concrete.structured_outputs)
  out_specs = tf.nest.map_structure(
    lambda t: tf.TensorSpec(t.shape, t.dtype), outs
  )
  return total, tuple(out_specs)


def LayerMemory(
  layer_params,
  input_specs,
  num_micro_batches=1,
  state_copies=DEFAULT_STATE_COPIES,
):
  """Per-layer bytes for `balance.MemorySplits`.

  Args:
    layer_params: the layers' Params.
    input_specs: the whole mini-batch's inputs, one per FProp argument of the
      first layer: tf.TensorSpecs, or shapes (float32).
    num_micro_batches: M; a layer's live activations are those of one
      micro-batch (`ActivationBytes`), i.e. 1/M of the mini-batch's.
    state_copies: bytes held per weight byte (weight, gradient, optimizer
      slots; Adam: 4).

  Returns:
    (layer_bytes, input_bytes): layer_bytes[i] = weight bytes x
    `state_copies` + `ActivationBytes` / M; input_bytes[i] = the bytes of
    layer i's inputs for the whole mini-batch (all M micro-batches), which a
    cell starting at layer i stores.
  """
  if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
    raise ValueError(
      f'num_micro_batches={num_micro_batches!r} must be a positive int.'
    )
  if state_copies < 0:
    raise ValueError(
      f'state_copies={state_copies!r} must be >= 0: bytes held per weight '
      'byte (weight + gradient + optimizer slots; Adam: 4).'
    )
  specs = tuple(meta.ToSpec(s) for s in input_specs)
  # Names the first layer that cannot take its input.
  metas = LayerMetas(layer_params, *(meta.ToShape(s) for s in specs))
  layer_bytes, input_bytes = [], []
  for i, p in enumerate(layer_params):
    p = _Named(p, i)
    dtype = tf.as_dtype(getattr(p, 'dtype', None) or tf.float32)
    weights = base_layer.CountParams(p) * dtype.size
    try:
      activations, out_specs = ActivationBytes(p, *specs)
    except (TypeError, ValueError):
      # FProp cannot run on these specs (e.g. ids given as float32 shapes):
      # count the outputs FPropMeta names.
      out_specs = tuple(meta.ToSpec(s) for s in metas[i][2])
      activations = _Bytes(out_specs)
    layer_bytes.append(
      float(weights * state_copies + activations / num_micro_batches)
    )
    input_bytes.append(float(_Bytes(specs)))
    specs = out_specs
  return layer_bytes, input_bytes


def LayerCosts(layer_params, balance_by, input_shapes=None, device=None):
  """Cost of each layer for `balance_by` in BALANCE_BY.

  For 'memory' it is `LayerMemory`'s layer_bytes at M=1 (without the stored
  cell inputs, which are not a per-layer sum).
  """
  if balance_by not in BALANCE_BY:
    raise ValueError(f'balance_by={balance_by!r}; use one of {BALANCE_BY}.')
  if balance_by == 'uniform':
    return [1.0] * len(layer_params)
  if balance_by == 'params':
    return [
      float(base_layer.CountParams(_Named(p, i)))
      for i, p in enumerate(layer_params)
    ]
  if input_shapes is None:
    raise ValueError(
      f'balance_by={balance_by!r} needs the input shapes: set '
      'PipeliningLayer.Params().input_shapes (e.g. [[batch, dim]]), or '
      'balance by "params" or "uniform".'
    )
  if balance_by == 'flops':
    shapes = [meta.ToShape(s) for s in input_shapes]
    return [float(m[0]) for m in LayerMetas(layer_params, *shapes)]
  if balance_by == 'memory':
    return LayerMemory(layer_params, input_shapes)[0]
  return MeasureLayerTimes(layer_params, input_shapes, device)


def ComputeSplits(
  layer_params,
  num_stages=None,
  splits=None,
  balance_by='flops',
  input_shapes=None,
  device=None,
  num_micro_batches=1,
  state_copies=DEFAULT_STATE_COPIES,
  name=None,
):
  """End indices of the cells (Lingvo's convention: last == num layers).

  `num_micro_batches` and `state_copies` matter only to
  balance_by='memory' (see `LayerMemory`). When the split is balanced by
  estimated costs, `BalanceWarnings` are logged: layers with weights whose
  cost estimate is zero, and an imbalance above `MAX_QUIET_IMBALANCE`.
  `name` (the pipeline's) is named in them.
  """
  n = len(layer_params)
  if not n:
    raise ValueError('The pipeline has no layers; give at least one layer.')
  if isinstance(splits, int) and not isinstance(splits, bool):
    num_stages, splits = splits, None
  if splits:
    splits = balance.ValidateSplits(list(splits), n)
    if num_stages and num_stages != len(splits):
      raise ValueError(
        f'num_stages={num_stages} but splits={splits} makes '
        f'{len(splits)} cells; give one of the two.'
      )
    return splits
  num_stages = num_stages or 1
  if num_stages > n:
    raise ValueError(
      f'num_stages={num_stages} is more than the {n} layers; use at most '
      f'{n} stages or split the model into more layers.'
    )
  if balance_by == 'memory':
    if input_shapes is None:
      raise ValueError(
        'balance_by="memory" needs the input shapes of the whole mini-batch:'
        ' set PipeliningLayer.Params().input_shapes (e.g. [[batch, dim]]), '
        'or balance by "params" or "uniform".'
      )
    layer_bytes, input_bytes = LayerMemory(
      layer_params, input_shapes, num_micro_batches, state_copies
    )
    return balance.MemorySplits(layer_bytes, input_bytes, num_stages)
  costs = LayerCosts(layer_params, balance_by, input_shapes, device)
  splits = balance.BalancedSplits(costs, num_stages)
  if balance_by != 'uniform':
    for warning in BalanceWarnings(
      layer_params, costs, splits, balance_by, name
    ):
      logging.warning('%s', warning)
  return splits


def _ShortNames(names):
  if len(names) <= 3:
    return ', '.join(names)
  return f'{names[0]} .. {names[-1]} ({len(names)} layers)'


def BalanceWarnings(layer_params, costs, splits, balance_by, name=None):
  """What is suspect about a partition balanced by estimated costs.

  Args:
    layer_params: the layers' Params.
    costs: their costs, as `LayerCosts(layer_params, balance_by, ...)`.
    splits: the cells' end indices.
    balance_by: how `costs` were estimated (named in the warnings).
    name: the pipeline's name, or None.

  Returns:
    A list of one-paragraph warnings (empty if nothing is suspect):
    layers with weights whose cost is zero (their cost is unknown, e.g. a
    custom layer whose ops TensorFlow counts no flops for), and a largest
    cell that costs more than `MAX_QUIET_IMBALANCE` times the mean.
  """
  who = f'Pipeline {name!r}' if name else 'Pipeline'
  fix = (
    'give these layers an FPropMeta (see docs/add_a_model.md), balance by '
    "'time' (measured) or 'params', or set `splits` explicitly"
  )
  out = []
  names = [_Named(p, i).name for i, p in enumerate(layer_params)]
  if balance_by in ('flops', 'time'):
    unknown = [
      f'{names[i]} ({layer_params[i].cls.__name__})'
      for i, c in enumerate(costs)
      if c == 0 and base_layer.CountParams(_Named(layer_params[i], i)) > 0
    ]
    if unknown:
      out.append(
        f'{who} balanced by {balance_by!r}: the estimated cost of '
        f'{", ".join(unknown)} is 0 although they have weights, so their '
        f'cost is unknown and the cells may be unbalanced; {fix}.'
      )
  if len(splits) > 1:
    report = balance.MakeReport(costs, splits, names=names)
    if report.imbalance > MAX_QUIET_IMBALANCE:
      cells = '; '.join(
        f'cell {c.index}: {_ShortNames(c.names)} {100 * c.share:.0f}%'
        for c in report.cells
      )
      bound = (
        ' (a single layer costs that much: split it finer)'
        if report.ideal_max_cost / report.mean_cost > MAX_QUIET_IMBALANCE
        else ''
      )
      out.append(
        f'{who} balanced by {balance_by!r} is unbalanced: its largest cell '
        f'costs {report.imbalance:.2f}x the mean{bound} ({cells}). If the '
        f'estimates are wrong, {fix}.'
      )
  return out


def PartitionSequentialLayers(params, num_partitions, *shapes):
  """Lingvo's helper: splits a sequence of layers into balanced cells.

  Args:
    params: a `SequentialLayer` Params (its `sub`) or a list of layer Params.
    num_partitions: K.
    *shapes: input shapes of the first layer.

  Returns:
    A list of K `FeatureExtractionLayer` Params, usable as
    `PipeliningLayer.Params().cell_tpl`.
  """
  layers = list(params.sub) if hasattr(params, 'sub') else list(params)
  splits = ComputeSplits(layers, num_partitions, None, 'flops', shapes)
  cells = []
  for k, (a, b) in enumerate(balance.SplitsToRanges(splits)):
    cells.append(
      sequential.FeatureExtractionLayer.Params().Set(
        name=f'cell_{k}',
        sub=[_Named(p, i) for i, p in enumerate(layers[a:b], a)],
      )
    )
  return cells


def Report(
  layer_params, splits, balance_by='flops', input_shapes=None, device=None
):
  """A `balance.PartitionReport` of a split: costs, params, imbalance."""
  costs = LayerCosts(layer_params, balance_by, input_shapes, device)
  params = [
    base_layer.CountParams(_Named(p, i)) for i, p in enumerate(layer_params)
  ]
  names = [_Named(p, i).name for i, p in enumerate(layer_params)]
  return balance.MakeReport(
    np.asarray(costs, np.float64).tolist(), splits, params=params, names=names
  )
