"""Shape helpers shared by the core layers (private to `lingvo_gpipe.layers`).

`FPropMeta(p, *input_shapes)` receives shapes as `tf.TensorShape`s, lists or
tuples of ints, `tf.TensorSpec`s or tensors; `ToShape` (from `core.meta`)
turns any of them into a `tf.TensorShape`. `CheckShape` (from `core.meta`)
raises the ValueError every layer uses for a shape mismatch: it names the
layer, both shapes and the fix.
"""

import numpy as np
import tensorflow as tf

# Shape conversion and checks live in core (py_utils.HasShape uses them too).
from lingvo_gpipe.core import meta

ToShape = meta.ToShape
Dims = meta.Dims
LayerName = meta.LayerName
CheckShape = meta.CheckShape

__all__ = [
  'ToShape',
  'Dims',
  'NumElements',
  'CheckShape',
  'LayerName',
  'CastFloat',
  'CheckPositive',
]


def NumElements(dims):
  """Product of `dims`; unknown (None) dims count as 1.

  FPropMeta flops are then per unit of every unknown dim, which keeps the
  relative costs of layers (what the pipeline balances) right.
  """
  return int(
    np.prod([1 if d is None else int(d) for d in dims], dtype=np.int64)
  )


def CheckPositive(p, *names):
  """Raises ValueError naming the layer unless each `p.<name>` is an int > 0."""
  for name in names:
    value = p.Get(name)
    if (
      not isinstance(value, (int, np.integer))
      or isinstance(value, bool)
      or value <= 0
    ):
      raise ValueError(
        f'{LayerName(p)}: p.{name} = {value!r}; it must be a '
        f'positive int. Set p.{name} in the layer Params.'
      )


def CastFloat(x, dtype):
  """Casts floating `x` to `dtype` (the layer's fprop_dtype) if it differs."""
  x = tf.convert_to_tensor(x)
  if x.dtype.is_floating and x.dtype != dtype:
    return tf.cast(x, dtype)
  return x
