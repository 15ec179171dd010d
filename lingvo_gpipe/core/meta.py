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

__all__ = ['ToSpec', 'ToShape', 'Meta', 'TraceFPropMeta', 'GraphFlops']


def ToSpec(x, dtype=tf.float32):
  """Turns a shape-like (TensorShape, list, TensorSpec) into a TensorSpec.

  NestedMaps, lists and tuples of them are converted leaf by leaf; a tuple or
  list of ints is a single shape.
  """
  if isinstance(x, tf.TensorSpec):
    return x
  if isinstance(x, tf.TensorShape):
    return tf.TensorSpec(x, dtype)
  if isinstance(x, dict):
    return NestedMap({k: ToSpec(v, dtype) for k, v in x.items()})
  if isinstance(x, (list, tuple)):
    if all((isinstance(d, (int, np.integer)) and not isinstance(d, bool))
           or d is None for d in x):
      return tf.TensorSpec(tf.TensorShape(list(x)), dtype)
    return type(x)(ToSpec(v, dtype) for v in x)
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return tf.TensorSpec(x.shape, x.dtype)
  raise TypeError(f'Cannot interpret {x!r} as a shape.')


def ToShape(x):
  """The TensorShape(s) of a spec-like structure."""
  return tf.nest.map_structure(lambda s: tf.TensorShape(s.shape), ToSpec(x))


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
    if op.type in ('Relu', 'Relu6', 'Sigmoid', 'Tanh', 'Exp', 'Log', 'Sqrt',
                   'Rsqrt', 'Square', 'Maximum', 'Minimum', 'Erf', 'Softmax',
                   'Elu', 'Selu', 'Softplus', 'AddV2', 'Mul', 'Sub',
                   'RealDiv'):
      for out in op.outputs:
        n = out.shape.num_elements()
        total += int(n or 0)
  return total


def TraceFPropMeta(p, *args):
  """FPropMeta by tracing `FProp` of an abstractly built layer.

  Args:
    p: layer Params.
    *args: input shapes or specs (NestedMaps allowed).

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

  concrete = tf.function(Fn, autograph=False).get_concrete_function(
      theta_spec, *specs)
  outs = concrete.structured_outputs
  if not isinstance(outs, tuple):
    outs = (outs,)
  shapes = tf.nest.map_structure(
      lambda t: tf.TensorShape(t.shape) if t is not None else None, outs)
  return NestedMap(flops=GraphFlops(concrete.graph), out_shapes=tuple(shapes))
