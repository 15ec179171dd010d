"""The optimizers' common part: Params, slots, counters and `Apply`.

`optimizer.py` holds the update rules (Lingvo's optimizer names); this is
what every rule shares: slot variables named after their variables and made
on their devices, the step counter, and `Apply`, which orders each
variable's update after its gradient and builds what all the variables'
updates share once.
"""

import re
import weakref

import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import py_utils

__all__ = ['Base', 'VarName']


def VarName(var):
  """A variable's name without the ':0' suffix."""
  return var.name.split(':')[0]


class Base:
  """Base class of optimizers. Subclasses define `_SLOTS` and `_Update`."""

  # Slot name -> initial value (a float), in creation order.
  _SLOTS = {}
  _HAS_COUNTER = False

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define(
      'name',
      cls.__name__,
      'Name of the optimizer; it prefixes its non-slot variables '
      '(e.g. "Adam/iterations").',
    )
    return p

  def __init__(self, params):
    if not isinstance(params, hyperparams.Params):
      raise TypeError(
        f'{type(self).__name__} expects its Params, got '
        f'{type(params).__name__}; build it with '
        f'{type(self).__name__}.Params().Instantiate().'
      )
    self._params = params.Copy().Freeze()
    if not re.match(r'^[A-Za-z_][\w.-]*$', str(self._params.name)):
      raise ValueError(
        f'{type(self).__name__}: name {self._params.name!r} '
        'is not a valid variable name prefix; use e.g. '
        f'"{type(self).__name__}".'
      )
    self._Validate(self._params)
    self._slots = {}  # (var name, slot) -> variable
    self._owners = {}  # var name -> variable (names must be unique)
    self._counter = None  # int64 step counter, if _HAS_COUNTER
    self._per_update = {}  # what every variable's update shares (`_Shared`)
    # {graph: {signature: tf.function}}: the update of one variable, traced
    # once per shape, dtype and slots in each graph (`_UpdateCall`).
    self._update_fns = weakref.WeakKeyDictionary()
    self._slot_override = None  # a traced update's own slots

  @property
  def params(self):
    """The frozen Params."""
    return self._params

  def _Validate(self, p):
    """Raises ValueError on bad hyper-parameters; subclasses extend."""
    del p

  def _Error(self, what, fix):
    return ValueError(
      f'{type(self).__name__} {self.params.name!r}: {what}; {fix}'
    )

  # -- Slots -----------------------------------------------------------------

  def SlotSpecs(self, var):
    """[(slot name, shape, initial value)] of the slots `var` will get.

    Public so that tools can size optimizer state without creating slots.
    """
    return self._SlotSpecs(var)

  def _SlotSpecs(self, var):
    """[(slot name, shape, initial value)] for `var` (subclasses override)."""
    shape = var.shape.as_list()
    return [(name, shape, init) for name, init in self._SLOTS.items()]

  def _CreateCounter(self):
    if self._HAS_COUNTER and self._counter is None:
      with tf.init_scope():
        self._counter = tf.Variable(
          tf.constant(0, tf.int64),
          trainable=False,
          name=f'{self.params.name}/iterations/',
          aggregation=py_utils.REPLICATED_AGGREGATION,
        )

  def CreateSlots(self, variables):
    """Creates the slots of `variables` (idempotent), each on its device."""
    self._CreateCounter()
    for var in variables:
      vname = VarName(var)
      owner = self._owners.setdefault(vname, var)
      if owner is not var:
        raise ValueError(
          f'{type(self).__name__}: two different variables are named '
          f'{vname!r}; slot names derive from variable names, so give the '
          'layers distinct names.'
        )
      for slot, shape, init in self._SlotSpecs(var):
        if (vname, slot) in self._slots:
          continue
        with tf.init_scope(), tf.device(var.device):
          self._slots[(vname, slot)] = tf.Variable(
            tf.fill(shape, tf.constant(init, var.dtype.base_dtype)),
            trainable=False,
            name=f'{vname}/{slot}/',  # '/': absolute name
            aggregation=py_utils.REPLICATED_AGGREGATION,
          )

  def GetSlot(self, var, slot):
    """The slot variable `slot` of `var`."""
    if self._slot_override is not None:
      return self._slot_override[slot]
    key = (VarName(var), slot)
    if key not in self._slots:
      raise KeyError(
        f'{type(self).__name__} has no slot {slot!r} for '
        f'{key[0]!r}; call CreateSlots([var]) first. Its slots '
        f'are {sorted(s for s, _, _ in self._SlotSpecs(var))}.'
      )
    return self._slots[key]

  def slots(self):
    """{variable name: variable} of every slot and non-slot variable."""
    out = {f'{v}/{s}': var for (v, s), var in self._slots.items()}
    if self._counter is not None:
      out[VarName(self._counter)] = self._counter
    return out

  @property
  def iterations(self):
    """The int64 update counter (None for optimizers without one)."""
    return self._counter

  # -- Updates ---------------------------------------------------------------

  # Plain Python over tensors (no control flow on tensors): converting it
  # with AutoGraph, as a tf.function does with what it calls, only costs the
  # trace (about 2 ms per variable, thousands of variables).
  @tf.autograph.experimental.do_not_convert
  def Apply(self, lr, grads_and_vars):
    """Applies one update.

    Args:
      lr: the learning rate, a float or float scalar tensor.
      grads_and_vars: list of (gradient, variable); pairs whose gradient is
        None are skipped. IndexedSlices gradients are densified.

    Returns:
      The grouped update op (None when executing eagerly).
    """
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    self.CreateSlots([v for _, v in pairs])
    self._per_update = {}
    step = None
    if self._counter is not None:
      step = tf.cast(self._counter, tf.float32) + 1.0
    updates = []
    for g, v in pairs:
      with tf.device(v.device):
        dtype = v.dtype.base_dtype
        g = tf.cast(tf.convert_to_tensor(g), dtype)
        lr_v = tf.cast(lr, dtype)
        # Every op of the update waits for the gradient. Otherwise the parts
        # that need only the slots (Adam's beta1 * m and beta2 * v, each the
        # size of the variable) run at the start of the step and stay alive
        # through it, on top of the step's activations.
        with tf.control_dependencies([g]):
          updates.append(self._UpdateOne(v, g, lr_v, step))
    if self._counter is not None:
      with tf.control_dependencies([u for u in updates if u is not None]):
        updates.append(self._counter.assign_add(1))
    return tf.group(*[u for u in updates if u is not None])

  def _UpdateOne(self, var, grad, lr, step):
    """The update of one variable: inline where a call cannot be made (eager,
    XLA, a tf.distribute strategy), else a call of a function traced once
    per (shape, dtype, slots) in each graph, which takes the variable, its
    slots, the gradient and the learning rate. A step updates thousands of
    variables with the same few shapes: its graph then holds one call per
    variable instead of every op of the rule (Adam: about 20), and the time
    to build and optimize it shrinks with it."""
    if (
      tf.executing_eagerly()
      or tf.distribute.has_strategy()
      or _tf_internal.InXlaContext()
    ):
      return self._Update(var, grad, lr, step)
    slots = {
      name: self.GetSlot(var, name) for name, _, _ in self._SlotSpecs(var)
    }
    sig = (
      tuple(var.shape.as_list()),
      var.dtype.base_dtype.name,
      tuple(sorted(slots)),
      step is None,
    )
    fns = self._update_fns.setdefault(tf.compat.v1.get_default_graph(), {})
    args = (var, slots, grad, lr, step)
    if sig not in fns:

      def Update(var, slots, grad, lr, step):
        outer, self._per_update = self._per_update, {}
        self._slot_override = slots
        try:
          self._Update(var, grad, lr, step)
        finally:
          self._per_update, self._slot_override = outer, None

      fns[sig] = py_utils.OutOfLineFunction(Update).get_concrete_function(*args)
    # The call is built directly from the traced function: calling the
    # tf.function binds and matches its arguments again for every variable
    # (about 4 ms each), and the op infers the shapes of its body again.
    flat = [
      a.handle if isinstance(a, tf.Variable) else a
      for a in tf.nest.flatten(args)
      if a is not None
    ]
    return _tf_internal.CallFunction(fns[sig], flat, return_op=True)

  def _Update(self, var, grad, lr, step):
    """Returns the update op of one variable; `step` is t (1 first)."""
    raise NotImplementedError(f'{type(self).__name__}._Update')

  def _Shared(self, key, make, var):
    """make() built once per update, dtype and device for every variable
    that asks for `key` (e.g. Adam's bias-corrected learning rate), outside
    the variable's dependency on its gradient: one scalar for thousands of
    variables instead of one each (the step's graph, and the time to build
    it, grow with every op per variable)."""
    key = (key, var.dtype.base_dtype, var.device)
    if key not in self._per_update:
      with tf.control_dependencies(None):
        self._per_update[key] = make()
    return self._per_update[key]

  @staticmethod
  def _Const(value, dtype):
    """A hyper-parameter as one constant shared by every variable's update:
    made under `_Update`'s dependency on the gradient (e.g. by `beta1 * m`),
    it would be a node of every variable's, each holding a buffer for as
    long as the step function lives (1.5 KiB per variable under Adam)."""
    with tf.control_dependencies(None):
      return tf.constant(value, dtype)
