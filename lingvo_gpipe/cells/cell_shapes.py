"""The cell-by-cell shape check of a pipeline, and its messages.

Before a pipeline runs, its input shapes are fed through each layer's
`FPropMeta`, cell by cell, so that a layer which cannot take what the layer
before it returns is named, with its cell, before any TensorFlow error. The
shapes come from `input_shapes`, or from the first batch when that is unset.
"""

import tensorflow as tf

from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils


def Check(path, cells, shapes, source):
  """Feeds `shapes` through the layers' FPropMeta, cell by cell.

  Args:
    path: the pipeline's name, for the message.
    cells: per cell, the list of its layers' Params.
    shapes: the pipeline's input shapes (a list, one per input).
    source: where `shapes` come from, for the message (e.g. 'input_shapes').

  Raises:
    ValueError: naming the pipeline, the cell and the layer that cannot
      take its input, and what it gets.
  """
  shapes = tuple(None if s is None else meta.ToShape(s) for s in shapes)
  for k, cell in enumerate(cells):
    for j, lp in enumerate(cell):
      try:
        m = lp.cls.FPropMeta(lp, *shapes)
      except (ValueError, TypeError) as e:
        raise ValueError(_Message(path, cells, k, j, shapes, source, e)) from e
      shapes = py_utils.AsTuple(m.out_shapes)


def _Message(path, cells, k, j, shapes, source, error):
  """The message of `Check` for layer j of cell k."""

  def Names(cell):
    return ', '.join(c.name for c in cell)

  lp = cells[k][j]
  layer = f'{lp.name} ({lp.cls.__name__})'
  reason = str(error).strip().rstrip('.')
  got = [
    None
    if x is None
    else tf.nest.map_structure(
      lambda s: s.shape.as_list() if s.shape.rank is not None else '?',
      meta.ToSpec(x),
    )
    for x in shapes
  ]
  got = got[0] if len(got) == 1 else got
  head = f'Pipeline {path!r} cell {k} ({Names(cells[k])})'
  if j == 0 and k == 0:
    return (
      f'{head} cannot take the pipeline input, of shapes {got} '
      f'({source}): its first layer {layer} says: {reason}. Make '
      f'{lp.name} accept the input'
      + (', or fix input_shapes.' if source == 'input_shapes' else '.')
    )
  if j == 0:
    last = cells[k - 1][-1].name
    return (
      f'{head} cannot take the output of cell {k - 1} '
      f'({Names(cells[k - 1])}), of shapes {got}: its first layer '
      f'{layer} says: {reason}. Make {lp.name} accept what {last}, the '
      f'last layer of cell {k - 1}, returns.'
    )
  prev = cells[k][j - 1].name
  return (
    f'{head}: layer {layer} cannot take the output of {prev}, of shapes '
    f'{got}: {reason}. Make {lp.name} accept what {prev} returns.'
  )
