"""Lingvo's `tshape.Shape`: a shape for `FPropMeta` formulas.

A list of dims (ints or None) with Lingvo's methods: indexing and slicing
(a slice is a Shape), `+` to concatenate, `rank`, `size`, `num_elements()`
and `ToTensorShape()`. Everywhere a shape is taken, a Shape works (it is a
list of ints).
"""

import tensorflow as tf

__all__ = ['Shape']


class Shape(list):
  """A list of dims; see the module docstring."""

  def __init__(self, dims):
    if isinstance(dims, tf.TensorShape):
      dims = dims.as_list()
    dims = list(dims)
    for d in dims:
      if d is not None and not isinstance(d, int):
        raise TypeError(
          f'tshape.Shape dims must be ints or None; got {d!r} in {dims}.'
        )
    super().__init__(dims)

  @property
  def rank(self):
    return len(self)

  @property
  def size(self):
    return len(self)

  def num_elements(self):  # pylint: disable=invalid-name
    """The product of the dims (None if one is unknown)."""
    n = 1
    for d in self:
      if d is None:
        return None
      n *= d
    return n

  def __getitem__(self, key):
    out = super().__getitem__(key)
    return Shape(out) if isinstance(key, slice) else out

  def __add__(self, other):
    return Shape(list(self) + list(other))

  def __radd__(self, other):
    return Shape(list(other) + list(self))

  def __str__(self):
    return str(list(self))

  def ToTensorShape(self):
    return tf.TensorShape(list(self))
