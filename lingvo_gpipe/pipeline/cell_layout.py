"""How a pipeline cell's arguments cross a function boundary as flat tensors.

A cell's function takes its weights, inputs, step seed, and (on the last
cell of `FPropWithLoss`) the loss's inputs and weights, as one flat list of
tensors; `Layout` records how that list maps back to the structures, which
of its tensors are differentiated, and a key naming the structure, so that a
function is traced once per structure.
"""

import collections

import tensorflow as tf

from lingvo_gpipe.core import py_utils

__all__ = ['Loss', 'Layout', 'IsFloat', 'Dense']


def IsFloat(t):
  return py_utils.IsTensor(t) and t.dtype.is_floating


def Dense(t):
  """A gradient as a dense tensor (an embedding's gradient comes as
  IndexedSlices, which the running sum and the optimizer densify anyway)."""
  if isinstance(t, tf.IndexedSlices):
    return tf.convert_to_tensor(t)
  return t


class Loss(collections.namedtuple('Loss', ['fn', 'inputs', 'theta'])):
  """The loss of one micro-batch on the last cell.

  fn(outputs, inputs, theta) -> float scalar, the micro-batch's share of the
  loss, given the last cell's outputs (as FProp returns them); `inputs`
  (labels, weights) and `theta` (the loss's own weights, e.g. a softmax
  outside the pipeline) are structures of tensors or None. `theta` is
  differentiated with the cell's weights.
  """


class Layout:
  """How (theta_k, args, seed, loss inputs, loss theta) map to a flat list
  of tensors, and back."""

  def __init__(self, theta_k, args, seed, loss):
    loss_in = None if loss is None else loss.inputs
    loss_th = None if loss is None else loss.theta
    self.structure = (theta_k, tuple(args), seed, loss_in, loss_th)
    parts = [tf.nest.flatten(s) for s in self.structure]
    flat = [t for part in parts for t in part]
    starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
    self.tensor_idx = [i for i, t in enumerate(flat) if py_utils.IsTensor(t)]
    pos = {i: n for n, i in enumerate(self.tensor_idx)}
    self.statics = [None if py_utils.IsTensor(t) else t for t in flat]
    self.tensors = [flat[i] for i in self.tensor_idx]

    def Floats(part):
      a = starts[part]
      return [(i, pos[a + i]) for i, t in enumerate(parts[part]) if IsFloat(t)]

    # (index in the part's flat list, position in `tensors`) of the float
    # tensors of the weights (the cell's, then the loss's) and the inputs.
    self.theta_floats = Floats(0) + [
      (len(parts[0]) + i, p) for i, p in Floats(4)
    ]
    self.num_theta = len(parts[0]) + len(parts[4])
    self.arg_floats = Floats(1)
    self.num_args = len(parts[1])
    self.key = (
      repr(tf.nest.map_structure(lambda _: 0, self.structure)),
      repr([s for s in self.statics if s is not None]),
    )

  def Unpack(self, tensors):
    flat = list(self.statics)
    for i, t in zip(self.tensor_idx, tensors):
      flat[i] = t
    return tf.nest.pack_sequence_as(self.structure, flat)

  def Groups(self):
    """[(dtype, [j])]: the float weights (`theta_floats[j]`) grouped by
    dtype, in order, for running sums packed into one tensor per dtype."""
    groups = {}
    for j, (_, p) in enumerate(self.theta_floats):
      groups.setdefault(self.tensors[p].dtype, []).append(j)
    return list(groups.items())

  def Sources(self, input_grad):
    """[(index, position in `tensors`)] of what is differentiated: the float
    weights (the cell's, then the loss's; index into both flattened one
    after the other) and, with `input_grad`, the float inputs (index into
    the flattened inputs)."""
    return self.theta_floats + (self.arg_floats if input_grad else [])
