"""Shape helpers shared by the core layers (private to `lingvo_gpipe.layers`).

`FPropMeta(p, *input_shapes)` receives shapes as `tf.TensorShape`s, lists or
tuples of ints, `tf.TensorSpec`s or tensors; `ToShape` turns any of them into
a `tf.TensorShape`. `CheckShape` raises the ValueError every layer uses for a
shape mismatch: it names the layer, both shapes and the fix.
"""

import numpy as np
import tensorflow as tf

__all__ = ['ToShape', 'Dims', 'NumElements', 'CheckShape', 'LayerName',
           'CastFloat', 'CheckPositive']


def ToShape(x):
  """Returns `x` (a shape, list of dims, TensorSpec or tensor) as TensorShape.

  Unlike `meta.ToShape`, a plain list or tuple of ints is one shape.
  """
  if isinstance(x, tf.TensorShape):
    return x
  if isinstance(x, (list, tuple)) and all(
      d is None or isinstance(d, (int, np.integer)) for d in x):
    return tf.TensorShape([None if d is None else int(d) for d in x])
  if hasattr(x, 'shape'):
    return tf.TensorShape(x.shape)
  raise TypeError(f'Cannot interpret {x!r} as a shape: pass a tf.TensorShape, '
                  'a list of ints, a tf.TensorSpec or a tensor.')


def Dims(shape):
  """The dims of `shape` as a list of ints (None where unknown)."""
  shape = ToShape(shape)
  if shape.rank is None:
    raise ValueError(f'Shape {shape} has unknown rank; FPropMeta needs at '
                     'least the rank of every input.')
  return shape.as_list()


def NumElements(dims):
  """Product of `dims`; unknown (None) dims count as 1.

  FPropMeta flops are then per unit of every unknown dim, which keeps the
  relative costs of layers (what the pipeline balances) right.
  """
  return int(np.prod([1 if d is None else int(d) for d in dims],
                     dtype=np.int64))


def LayerName(layer_or_params):
  """'ClassName 'path'' for a layer, 'ClassName 'name'' for its Params."""
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
    who: the layer, or its Params (named in the message).
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
    if hasattr(who, 'path'):  # A built layer's FProp: nothing to check.
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
    ok = all(e is None or a is None or int(a) == int(e)
             for a, e in zip(dims[len(dims) - len(tail):], tail))
  if not ok:
    shown = _Fmt(tail)
    if any_leading:
      shown = '[..., ' + shown[1:] if tail else '[...]'
    raise ValueError(
        f'{LayerName(who)}: {what} has shape {_Fmt(dims)} but {shown} is '
        f'expected (? = any). {fix}')
  return dims


def CheckPositive(p, *names):
  """Raises ValueError naming the layer unless each `p.<name>` is an int > 0."""
  for name in names:
    value = p.Get(name)
    if not isinstance(value, (int, np.integer)) or isinstance(
        value, bool) or value <= 0:
      raise ValueError(f'{LayerName(p)}: p.{name} = {value!r}; it must be a '
                       f'positive int. Set p.{name} in the layer Params.')


def CastFloat(x, dtype):
  """Casts floating `x` to `dtype` (the layer's fprop_dtype) if it differs."""
  x = tf.convert_to_tensor(x)
  if x.dtype.is_floating and x.dtype != dtype:
    return tf.cast(x, dtype)
  return x
