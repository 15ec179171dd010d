"""How a pipeline cell's values cross a function or loop boundary.

A cell's function takes its weights, inputs, step seed, and (on the last
cell of `FPropWithLoss`) the loss's inputs and weights, as one flat list of
tensors; `Layout` records how that list maps back to the structures, which
of its tensors are differentiated, and a key naming the structure, so that a
function is traced once per structure. Where many tensors would cross a
loop, they cross packed, one tensor per dtype: a cell's weights as lists
(`PackedWeights`), its batch-norm statistics as flat tensors
(`PackedStats`).
"""

import collections

import tensorflow as tf

from lingvo_gpipe.core import py_utils

__all__ = [
  'Loss',
  'Layout',
  'PackedWeights',
  'PackedStats',
  'ByDtype',
  'IsFloat',
  'Dense',
]


def IsFloat(t):
  return py_utils.IsTensor(t) and t.dtype.is_floating


def ByDtype(dtypes):
  """[(dtype, [index])]: the indices of `dtypes` grouped by dtype, each
  group and each group's indices in first-seen order."""
  groups = {}
  for i, dtype in enumerate(dtypes):
    groups.setdefault(dtype, []).append(i)
  return list(groups.items())


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
    return ByDtype([self.tensors[p].dtype for _, p in self.theta_floats])

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
    self._groups = ByDtype([t.dtype.base_dtype for t in flat])
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

  def Unpacked(self):
    """The weights' structure, each tensor read from the lists where this
    is called (in a loop's body the loop then passes only the lists)."""
    flat = iter(self.Unpack(self.lists))
    return tf.nest.map_structure(
      lambda t: next(flat) if py_utils.IsTensor(t) else t, self.theta
    )

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


class PackedStats:
  """A cell's statistics (batch norm's, one set per micro-batch) as the
  forward loop carries them: one flat tensor per dtype.

  Each tensor a loop carries costs it a list, a loop variable and a cond
  output, each a few ops per tick; AmoebaNet's cells hold hundreds of
  statistics. Packing and unpacking only move the values (the same bits).

  Args:
    specs: the `tf.TensorSpec`s of the statistics, flat.
  """

  def __init__(self, specs):
    self._shapes = [s.shape for s in specs]
    self._groups = ByDtype([spec.dtype for spec in specs])
    self._sizes = [s.num_elements() for s in self._shapes]
    # The packed tensors' specs: what the loop carries.
    self.specs = [
      tf.TensorSpec([sum(self._sizes[i] for i in idx)], dtype)
      for dtype, idx in self._groups
    ]

  def Pack(self, flat):
    """[one flat tensor per dtype] of the statistics `flat`."""
    if not self._groups:
      return []
    shape = tf.constant([-1])
    packed = []
    for _, idx in self._groups:
      parts = [tf.reshape(flat[i], shape) for i in idx]
      packed.append(parts[0] if len(parts) == 1 else tf.concat(parts, 0))
    return packed

  def Unpack(self, stacked, num_mb):
    """[statistic] of shape [M] + its shape, from `stacked`: [packed tensor
    of shape [M, size]], one per dtype."""
    flat = [None] * len(self._shapes)
    for (_, idx), t in zip(self._groups, stacked):
      sizes = [self._sizes[i] for i in idx]
      parts = tf.split(t, sizes, axis=1) if len(idx) > 1 else [t]
      for i, part in zip(idx, parts):
        flat[i] = tf.reshape(part, [num_mb] + self._shapes[i].as_list())
    return flat
