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

__all__ = ['Loss', 'Layout', 'PackedWeights', 'IsFloat', 'Dense']


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


class PackedWeights:
  """A cell's weights as one TensorList per dtype, to pass a loop of calls.

  A `tf.while_loop` and a `tf.cond` pass each tensor they take on through
  a few ops of their own (lowered: Enter, Merge, Switch, NextIteration,
  Exit, and an Identity per inlined branch argument), so a cell of
  hundreds of weights called inside the clock loops cost the step's graph
  about 25 ops per weight, and TensorFlow's graph passes walk them all
  before the first step. Packed, the weights cross the loops and the
  conds as one tensor per dtype, and the cell's function unpacks them.
  A list holds its tensors, not copies of them.

  Attributes:
    theta: the weights (the structure the layout is built from).
    lists: [one DT_VARIANT list per dtype], made where this is built.
    key: what a function that unpacks them is traced for.
  """

  def __init__(self, theta_k):
    self.theta = theta_k
    flat = [t for t in tf.nest.flatten(theta_k) if py_utils.IsTensor(t)]
    self.count = len(flat)
    groups = {}
    for i, t in enumerate(flat):
      groups.setdefault(t.dtype.base_dtype, []).append(i)
    self._groups = list(groups.items())
    self._shapes = [t.shape for t in flat]
    self.key = tuple(
      (dtype.name, tuple(tuple(self._shapes[i].as_list()) for i in idx))
      for dtype, idx in self._groups
    )
    self.lists = []
    for dtype, idx in self._groups:
      packed = tf.raw_ops.EmptyTensorList(
        element_shape=tf.constant(-1),
        max_num_elements=len(idx),
        element_dtype=dtype,
      )
      for i in idx:
        packed = tf.raw_ops.TensorListPushBack(
          input_handle=packed, tensor=tf.convert_to_tensor(flat[i])
        )
      self.lists.append(packed)

  def Unpack(self, lists):
    """The weights' tensors, flat, from `lists` (inside a function)."""
    flat = [None] * self.count
    # Two ops for all the indices and one constant per distinct shape: a
    # constant of each per weight would be 2 more ops per weight to build.
    # (The shapes must be known to the graph optimizer, whose rewrites,
    # e.g. fusing a matmul with its bias, depend on them.)
    shapes = {}
    for (dtype, idx), packed in zip(self._groups, lists):
      positions = tf.unstack(tf.range(len(idx)), num=len(idx))
      for j, i in enumerate(idx):
        dims = tuple(self._shapes[i].as_list())
        if dims not in shapes:
          shapes[dims] = tf.constant(dims, tf.int32, shape=[len(dims)])
        t = tf.raw_ops.TensorListGetItem(
          input_handle=packed,
          index=positions[j],
          element_shape=shapes[dims],
          element_dtype=dtype,
        )
        t.set_shape(self._shapes[i])
        flat[i] = t
    return flat
