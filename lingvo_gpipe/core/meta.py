"""Shape and cost metadata: the machinery behind `FPropMeta`.

`FPropMeta(p, *inputs)` returns `NestedMap(flops=..., out_shapes=(...))`
without allocating weights. Core layers compute it with formulas; any other
layer gets it from `TraceFPropMeta`, which builds the layer abstractly and
traces its `FProp` into a graph whose per-op flop statistics are summed.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = [
  'ToSpec',
  'ToShape',
  'Dims',
  'LayerName',
  'CheckShape',
  'Meta',
  'TraceFPropMeta',
  'GraphFlops',
]


def ToSpec(x, dtype=tf.float32):
  """Turns a shape-like (TensorShape, list, TensorSpec) into a TensorSpec.

  NestedMaps, lists and tuples of them are converted leaf by leaf; a tuple or
  list of ints is a single shape. None (an absent input, e.g. a Lingvo
  stack's unused segment ids) stays None.
  """
  if x is None:
    return None
  if isinstance(x, tf.TensorSpec):
    return x
  if isinstance(x, tf.TensorShape):
    return tf.TensorSpec(x, dtype)
  if isinstance(x, dict):
    return NestedMap({k: ToSpec(v, dtype) for k, v in x.items()})
  if isinstance(x, (list, tuple)):
    if all(
      (isinstance(d, (int, np.integer)) and not isinstance(d, bool))
      or d is None
      for d in x
    ):
      return tf.TensorSpec(tf.TensorShape(list(x)), dtype)
    return type(x)(ToSpec(v, dtype) for v in x)
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return tf.TensorSpec(x.shape, x.dtype)
  raise TypeError(
    f'Cannot interpret {x!r} as a shape: pass a tf.TensorShape, '
    'a list of ints, a tf.TensorSpec or a tensor.'
  )


def ToShape(x):
  """The TensorShape(s) of a spec-like structure."""
  return tf.nest.map_structure(lambda s: tf.TensorShape(s.shape), ToSpec(x))


def Dims(shape):
  """The dims of `shape` as a list of ints (None where unknown)."""
  shape = ToShape(shape)
  if shape.rank is None:
    raise ValueError(
      f'Shape {shape} has unknown rank; FPropMeta needs at '
      'least the rank of every input.'
    )
  return shape.as_list()


def LayerName(layer_or_params):
  """'ClassName 'path'' for a layer, 'ClassName 'name'' for its Params,
  'Layer 'name'' for a name."""
  if isinstance(layer_or_params, str):
    return f'Layer {layer_or_params!r}'
  if hasattr(layer_or_params, 'path'):
    return f'{type(layer_or_params).__name__} {layer_or_params.path!r}'
  p = layer_or_params
  cls = getattr(p.cls, '__name__', str(p.cls))
  return f'{cls} {p.name!r}'


def _Fmt(dims):
  return '[' + ', '.join('?' if d is None else str(d) for d in dims) + ']'


def CheckShape(who, what, actual, expected, fix):
  """Raises ValueError unless `actual` matches `expected`.

  Args:
    who: the layer, its Params, or its name (named in the message).
    what: what the tensor is, e.g. 'inputs'.
    actual: the tensor's shape (anything `ToShape` takes).
    expected: list of ints / None (any); a leading `...` allows any number of
      leading dims, e.g. [..., 8] for "[..., input_dim]".
    fix: a sentence telling how to fix the mismatch.

  Returns:
    `actual` as a list of dims (None in FProp for a tensor of unknown rank).
  """
  actual = ToShape(actual)
  if actual.rank is None:
    if hasattr(who, 'path') or isinstance(who, str):
      # A built layer's FProp: nothing to check.
      return None
    Dims(actual)  # FPropMeta needs the rank: raises.
  dims = actual.as_list()
  exp = list(expected)
  any_leading = bool(exp) and exp[0] is Ellipsis
  tail = exp[1:] if any_leading else exp
  if any_leading:
    ok = len(dims) >= len(tail)
  else:
    ok = len(dims) == len(tail)
  if ok and tail:
    ok = all(
      e is None or a is None or int(a) == int(e)
      for a, e in zip(dims[len(dims) - len(tail) :], tail)
    )
  if not ok:
    shown = _Fmt(tail)
    if any_leading:
      shown = '[..., ' + shown[1:] if tail else '[...]'
    raise ValueError(
      f'{LayerName(who)}: {what} has shape {_Fmt(dims)} but {shown} is '
      f'expected (? = any). {fix}'
    )
  return dims


def Meta(flops, *out_shapes):
  """Builds FPropMeta's result."""
  return NestedMap(flops=int(flops), out_shapes=tuple(out_shapes))


def GraphFlops(graph):
  """Sums TensorFlow's registered 'flops' statistic over `graph`'s ops.

  Ops without a registered statistic (reshapes, casts, ...) count zero;
  elementwise ops count one flop per output element.
  """
  total = 0
  for op in graph.get_operations():
    try:
      flops = _tf_internal.OpFlops(graph, op.node_def)
      if flops:
        total += int(flops)
        continue
    except (ValueError, TypeError):
      pass
    if op.type in (
      'Relu',
      'Relu6',
      'Sigmoid',
      'Tanh',
      'Exp',
      'Log',
      'Sqrt',
      'Rsqrt',
      'Square',
      'Maximum',
      'Minimum',
      'Erf',
      'Softmax',
      'Elu',
      'Selu',
      'Softplus',
      'AddV2',
      'Mul',
      'Sub',
      'RealDiv',
    ):
      for out in op.outputs:
        n = out.shape.num_elements()
        total += int(n or 0)
  return total


def _Concrete(spec, size):
  """`spec` with every unknown dim set to `size` (a rank-unknown spec kept)."""
  shape = tf.TensorShape(spec.shape)
  if shape.rank is None:
    return spec
  dims = [size if d is None else d for d in shape.as_list()]
  return tf.TensorSpec(dims, spec.dtype)


def _HasUnknownDims(specs):
  return any(
    s.shape.rank is not None and None in s.shape.as_list()
    for s in tf.nest.flatten(specs)
  )


def TraceFPropMeta(p, *args, unknown_dim_size=1):
  """FPropMeta by tracing `FProp` of an abstractly built layer.

  TensorFlow counts no flops for an op whose shapes are not fully known, so
  an input with unknown dims (e.g. the batch of `[None, 8, 8, 1]`) is traced
  a second time with those dims set to `unknown_dim_size`: the flops are then
  those of that many examples, while `out_shapes` keep the unknown dims.

  Args:
    p: layer Params.
    *args: input shapes or specs (NestedMaps allowed).
    unknown_dim_size: the size that unknown dims get for counting flops.

  Returns:
    NestedMap(flops, out_shapes): out_shapes is a tuple of the outputs'
    shapes (TensorShapes, or NestedMaps of them).
  """
  p = p.Copy()
  if not p.name:
    p.name = 'meta'
  layer = p.cls.AbstractInstance(p)
  theta_spec = layer.vars.Transform(lambda v: v.ToSpec())
  specs = [ToSpec(a) for a in args]

  def Fn(theta, *inputs):
    return layer.FProp(theta, *inputs)

  def Trace(input_specs):
    return tf.function(Fn, autograph=False).get_concrete_function(
      theta_spec, *input_specs
    )

  concrete = Trace(specs)
  outs = concrete.structured_outputs
  if not isinstance(outs, tuple):
    outs = (outs,)
  shapes = tf.nest.map_structure(
    lambda t: tf.TensorShape(t.shape) if t is not None else None, outs
  )
  graph = concrete.graph
  if _HasUnknownDims(specs):
    known = tf.nest.map_structure(
      lambda s: _Concrete(s, unknown_dim_size), specs
    )
    graph = Trace(known).graph
  return NestedMap(flops=GraphFlops(graph), out_shapes=tuple(shapes))
