"""Each pipeline cell as a function: traced once, called per micro-batch.

A step of K cells and M micro-batches runs K*M forward and K*M backward
work items. Building each item from the cell's layers would write every op
of every layer M times into the step's graph: the graph, the time to trace
and optimise it and the memory of the process that builds it would all grow
as layers x micro-batches. Instead each cell is traced into two functions,
and each work item is one call:

  forward:   y = F_k(theta_k, x, seed)                  one call op
  backward:  acc', dx = G_k(theta_k, x, seed, dy, acc)  one call op: the
             re-materialized forward, its gradient, and the weight
             gradients added to the running sum `acc` of the earlier
             micro-batches (no `acc` for the device's first one)
  (a cell whose forward kept its tape, recompute='never' and the like: the
   gradient of the F_k call, which TensorFlow derives from F_k, then one
   `A_k(acc, g)` call for the sum)

so the step's graph grows by a few ops per work item, not by the cell's
ops. The calls are marked `_noinline`, so that TensorFlow's graph
optimizations do not inline them back into one copy per micro-batch. A
function is traced once per (cell, device, pass, input signature, eval
mode) in each graph that calls it, and the runtime optimizes it once.

The functions take the cell's weights, inputs and step seed as flat
tensors; the eval mode and the batch-norm statistics (returned as outputs
and handed to the enclosing `UpdateCollector`) cross the function boundary
explicitly, so a cell computes exactly what its layers compute inline. The
loss of the last cell (`FPropWithLoss`) is part of the last cell's
functions, with the micro-batch's loss inputs as arguments.

With `jit_compile` the same functions are compiled by XLA: one XLA
computation per cell and pass (per input shape), not per micro-batch. A
layer with an op XLA has no kernel for is found when the cell is first
traced (`cell_checks.XlaCheck`) and reported as a ValueError naming the
pipeline, the cell, the layer and the op, with the fix: set
jit_compile=False.

Cells of one kind (`cell_kind`: layers of the same classes and Params, in
order) share their functions where a function traced from one cell's
layers computes exactly what another's would (`_Serves`): a deep stack of
identical cells is traced and optimized once.

Inside an XLA context (the whole step compiled) or a TPU replica, cells run
inline: XLA then builds one computation of the whole step itself.
"""

import collections
import weakref

import tensorflow as tf

from lingvo_gpipe.cells import cell_checks
from lingvo_gpipe.cells import cell_layout
from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import graph_ops
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core import xla_precompile

__all__ = ['CellFunctions', 'Loss']

# The loss of one micro-batch on the last cell (see `cell_layout.Loss`).
Loss = cell_layout.Loss


def _Anchored(flat):
  """The outputs of a compiled call, made safe to be used only as control
  dependencies (`strict_order` chains a device's next work item on them).

  Where the pipeline's outputs are not used (a step that returns only
  gradients), Grappler's dependency optimizer turns a call whose outputs
  feed nothing but control edges into a NoOp, yet keeps its
  `_XlaMustCompile` attribute, and the step then fails with "Function NoOp
  is not defined". A one-element copy of the first output, a stateful op
  that the optimizer keeps, gives the call a data consumer as long as
  anything depends on its first output.
  """
  if not flat or tf.executing_eagerly():
    return flat
  keep = tf.raw_ops.DeepCopy(x=tf.reshape(flat[0], [-1])[:1])
  _tf_internal.RunIndependently(keep.op)
  return [graph_ops.After(flat[0], [keep])] + list(flat[1:])


def _Concrete(f, tensors):
  """f's concrete function for `tensors`' shapes and types."""
  sig = tuple((tuple(t.shape.as_list()), t.dtype) for t in tensors)
  concrete = f.concrete.get(sig)
  if concrete is None:
    concrete = f.concrete[sig] = f.fn.get_concrete_function(*tensors)
    _tf_internal.ReleaseDefinitionCopies(concrete)
  return concrete


def _CallOp(f, tensors, precompiler=None):
  """f.fn(*tensors) in a graph: where no tape records the call, the call
  op is built without shape inference of the body, which otherwise costs
  the step's trace about 18 us per op of the cell per work item
  (`_tf_internal.CallFunction`), and `precompiler` (if any) compiles the
  function on the call's device ahead of the step."""
  if _tf_internal.ShouldRecordBackprop(tensors):
    out = f.fn(*tensors)
  else:
    concrete = _Concrete(f, tensors)
    out = _tf_internal.CallFunction(concrete, tensors)
    if precompiler is not None and out:
      precompiler.Start(concrete, tensors, out[0].device)
  _Unchained(out)
  return out


def _Unchained(out):
  """Exempts the call that made `out` from tf.function's program order.

  A cell with a stateful op (a stateful random op, a print) makes its call
  stateful, and tf.function chains stateful ops in program order: the
  pipeline's calls then ran one at a time, device after device. A call
  that takes no variable needs no such order: its data and its device's
  order (`after`) are its dependencies.
  """
  flat = [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]
  if not flat or tf.executing_eagerly():
    return
  op = flat[0].op
  if op.type == 'StatefulPartitionedCall' and tf.resource not in {
    t.dtype for t in op.inputs
  }:
    _tf_internal.RunIndependently(op)


def _CallTensors(layout, weights):
  """What a call of a cell's function takes: the layout's tensors, the
  cell's weights as their lists where they are packed."""
  if weights is None:
    return list(layout.tensors)
  return list(weights.lists) + list(layout.tensors[weights.count :])


def _Unpacked(weights, tensors):
  """Inside a function: the layout's tensors from the call's."""
  if weights is None:
    return list(tensors)
  n = len(weights.lists)
  return weights.Unpack(tensors[:n]) + list(tensors[n:])


def _Serves(f):
  """Whether function `f`, traced from one cell's layers, computes exactly
  what another cell of the same kind (layers of the same classes and
  Params, in order) computes when called with that cell's tensors: its
  traces capture nothing (a layer that reads its variables directly would
  read the first cell's), hand on no deferred updates (they name the first
  cell's layers) and hold no random op (its seeds come from the first
  cell's layer names). Known once `f` is traced."""
  concretes = list(f.concrete.values())
  if not concretes:  # Not traced yet (or only for a tape): not known.
    return False
  if 'serves' not in f.meta:
    ok = not f.meta.get('updates')
    for concrete in concretes:
      if not ok:
        break
      ops = {n.op for n in py_utils.NodeDefs(concrete.graph)}
      ok = not concrete.captured_inputs and not any('Random' in o for o in ops)
    f.meta['serves'] = ok
  return f.meta['serves']


class _Function:
  """One traced function and what its trace recorded."""

  def __init__(self):
    self.fn = None
    self.body = None  # The Python function that `fn` traces.
    self.meta = {}
    self.traces = collections.Counter()
    self.concrete = {}  # {input signature: concrete function}


class CellFunctions:
  """The forward and recompute-and-backward functions of every cell.

  Args:
    cell_fprop: fn(k, theta_k, args tuple, mark) -> outputs tuple of cell k;
      `mark(layer)` is called before each of the cell's layers runs (to tell
      which layer made which op).
    cell_layers: fn(k) -> the layers of cell k.
    name: the pipeline's path, for messages.
    jit_compile: compile the functions with XLA.
    inline: fn() -> whether cells must run inline where built now (e.g. in a
      TPU replica, whose computation XLA compiles as a whole); inside an XLA
      context they always do.
    shared: a `layer_function.SharedLayers`: inside the cells' functions,
      its layers of a shared kind run as calls of their kind's function
      (not with `jit_compile`: XLA compiled such cells slower, and took
      longer to, than cells of their layers inline; docs/benchmarks.md).
    cell_kind: fn(k) -> a hashable naming what cell k computes (the same for
      cells whose layers have the same classes and Params, in order), or
      None: cells of one kind share their functions where `_Serves` allows,
      so a deep stack of identical cells is traced and optimized as one
      cell (with XLA, each device still compiles its own).
    precompile: with `jit_compile`, compile each function on each device
      while the step is traced (`core/xla_precompile.py`): True on every
      device, None on devices of other processes, False never.
  """

  def __init__(
    self,
    cell_fprop,
    cell_layers,
    name,
    jit_compile=False,
    inline=None,
    shared=None,
    cell_kind=None,
    precompile=None,
  ):
    self._shared = None if jit_compile else shared
    self._cell_kind = cell_kind
    self._kinds = {}  # {k: cell_kind(k)}
    self._inline = inline
    self._cell_fprop = cell_fprop
    self._cell_layers = cell_layers
    self._name = name
    self._jit = jit_compile
    # {graph: {key: _Function}}: a graph's functions may capture its
    # tensors, so each graph that calls a cell traces its own.
    self._graphs = weakref.WeakKeyDictionary()
    self._traces = cell_checks.TraceCounter(name)
    self._xla_check = (
      cell_checks.XlaCheck(cell_layers, name) if jit_compile else None
    )
    self._precompiler = (
      xla_precompile.Precompiler(name, remote_only=precompile is None)
      if jit_compile and precompile is not False
      else None
    )

  def Inline(self):
    """Whether cells run inline (no function calls) where built now: inside
    an XLA context, which compiles the whole step as one computation, or
    where `inline` says so."""
    if self._inline is not None and self._inline():
      return True
    return _tf_internal.InXlaContext()

  def NumLayers(self, k):
    """The number of layers of cell k."""
    return len(self._cell_layers(k))

  def PacksWeights(self):
    """Whether calls take weights packed (`cell_layout.PackedWeights`)
    where they come so: not compiled cells (XLA takes no lists; they are
    unpacked before the call)."""
    return not self._jit

  # -- What the engine calls ---------------------------------------------------

  def Forward(self, k, theta_k, args, seed, loss=None, after=None, taped=False):
    """Cell k on one micro-batch (and its loss, with `loss`).

    `after`: tensors the call waits for (control dependencies). `taped`: a
    tape records the call (its layers then run inline: the gradient of a call
    of calls takes a zero gradient for every intermediate of every layer).

    Returns:
      (outputs tuple, the loss or None, [(layer, stats)] of the deferred
      updates, e.g. batch-norm statistics).
    """
    is_eval = py_utils.IsEval()
    layout, weights = self._Layout(theta_k, args, seed, loss)
    loss_fn = None if loss is None else loss.fn
    if self.Inline():
      collector = py_utils.UpdateCollector()
      out, loss_value = self._Run(
        k, layout, layout.tensors, is_eval, collector, loss_fn
      )
      return out, loss_value, collector.updates
    # A call that a tape records is differentiated through its body, where
    # the layers then run inline.
    taped = taped or _tf_internal.ShouldRecordBackprop(layout.tensors)
    if taped:
      weights = None
    f = self._Forward(k, layout, is_eval, loss_fn, taped, weights)
    self._Check(k, f, layout.tensors, ('forward', f.meta['cell'], is_eval))
    flat = list(self._Call(f, _CallTensors(layout, weights), after))
    if self._jit:
      flat = _Anchored(flat)
    # None outputs (Lingvo's layers pass some on) are not returned by calls.
    out_flat = tf.nest.flatten(f.meta['out'])
    n = sum(t is not None for t in out_flat)
    got = iter(flat[:n])
    out = tf.nest.pack_sequence_as(
      f.meta['out'], [None if t is None else next(got) for t in out_flat]
    )
    rest = flat[n:]
    loss_value = None
    if loss is not None:
      loss_value, rest = rest[0], rest[1:]
    updates = []
    for layer, stats in f.meta['updates']:
      n = len(tf.nest.flatten(stats))
      updates.append((layer, tf.nest.pack_sequence_as(stats, rest[:n])))
      rest = rest[n:]
    return out, loss_value, updates

  def TapedForward(self, k, theta_k, args, seed, loss=None, after=None):
    """`Forward` recorded by a gradient tape of its own, for a cell whose
    backward is the gradient of its forward (a recompute policy that keeps
    the cell's activations); returns `Forward`'s results and the tape, what
    `TapeBackward` takes."""
    tape = tf.GradientTape(watch_accessed_variables=False)
    watched = (theta_k, args, None if loss is None else loss.theta)
    with tape:
      tape.watch(
        [t for t in tf.nest.flatten(watched) if cell_layout.IsFloat(t)]
      )
      out = self.Forward(k, theta_k, args, seed, loss, after=after, taped=True)
    return out + (tape,)

  def ForwardSpecs(self, k, theta_k, args, seed, loss=None):
    """The `tf.TensorSpec`s of the flat results of cell k's forward call on
    these arguments (its outputs but None, the loss, the updates'
    statistics), from the function's trace (nothing runs)."""
    layout, weights = self._Layout(theta_k, args, seed, loss, unpack=False)
    loss_fn = None if loss is None else loss.fn
    is_eval = py_utils.IsEval()
    f = self._Forward(k, layout, is_eval, loss_fn, False, weights)
    self._Check(k, f, layout.tensors, ('forward', f.meta['cell'], is_eval))
    concrete = _Concrete(f, _CallTensors(layout, weights))
    return [tf.TensorSpec(t.shape, t.dtype) for t in concrete.outputs]

  def ForwardTemplate(self, k, theta_k, args, seed, loss=None):
    """(outputs, whether there is a loss, [(layer, statistics)]) of cell
    k's traced forward on these arguments: the structures its flat results
    unflatten into (the leaves are the trace's tensors). After
    `ForwardSpecs`."""
    layout, weights = self._Layout(theta_k, args, seed, loss, unpack=False)
    loss_fn = None if loss is None else loss.fn
    f = self._Forward(k, layout, py_utils.IsEval(), loss_fn, False, weights)
    return f.meta['out'], loss is not None, list(f.meta['updates'])

  def Backward(
    self, k, theta_k, args, seed, dys, sums, input_grad, loss=None, after=None
  ):
    """Re-materializes cell k on one micro-batch and back-propagates `dys`.

    The forward values live only inside the call.

    Args:
      k: the cell.
      theta_k, args, seed: as for `Forward`.
      dys: the gradients of the outputs (flat, None where there is none);
        with `loss`, [the gradient of the loss].
      sums: [running sum or None] of the weights' gradients, one per tensor
        of the flattened weights (the cell's, then the loss's).
      input_grad: also compute the gradients of the float inputs.
      loss: the `Loss` of the last cell, or None.
      after: tensors the call waits for (control dependencies).

    Returns:
      (the weights' gradients added to `sums`, flat like `sums`; the
      inputs' gradients, flat like args), None where there is none.
    """
    if self.Inline():
      # Inline, the recomputation is made of fresh copies of the inputs and
      # the seed, made once the output gradient has arrived: otherwise the
      # executor would recompute every micro-batch right after the forward
      # pass, and the graph optimizer would merge the recomputation with
      # the forward ops (common subexpression elimination), keeping every
      # forward activation alive until the backward pass.
      args, seed = graph_ops.FreshCopies((args, seed), dys)
    is_eval = py_utils.IsEval()
    layout, weights = self._Layout(theta_k, args, seed, loss)
    loss_fn = None if loss is None else loss.fn
    present = tuple(dy is not None and cell_layout.IsFloat(dy) for dy in dys)
    sources = layout.Sources(input_grad)
    given = [dy for dy, p in zip(dys, present) if p]
    if self.Inline():
      grads = self._Differentiate(
        k, layout, layout.tensors, is_eval, given, present, sources, loss_fn
      )
    elif not any(present):
      grads = [None] * len(sources)
    else:
      f = self._Backward(
        k, layout, is_eval, present, input_grad, loss_fn, weights=weights
      )
      # The device's first backward adds to zeros: one function for every
      # micro-batch (0 + g is g). The zeros are made once the output
      # gradient is there: made at the start of the step, they would hold a
      # copy of the weights through the forward pass. They are computed
      # from a weight: constant zeros would make the graph optimizer copy
      # and optimize the function again for that call.
      with tf.control_dependencies(given):
        zero = None
        if any(s is None for s in sums):
          zero = graph_ops.RuntimeZero(
            [layout.tensors[p] for _, p in layout.theta_floats]
          )
        running = [
          graph_ops.Zeros(layout.tensors[p], zero)
          if sums[i] is None
          else cell_layout.Dense(sums[i])
          for i, p in layout.theta_floats
        ]
      call_inputs = _CallTensors(layout, weights) + given + running
      self._Check(k, f, call_inputs, ('backward',) + f.meta['key'])
      got = list(self._Call(f, call_inputs, after))
      if self._jit:
        got = _Anchored(got)
      grads = [got.pop(0) if p else None for p in f.meta['present']]
      return self._Split(layout, sources, grads, sums, summed=True)
    return self._Split(layout, sources, grads, sums, summed=False)

  def BackwardPacked(
    self, k, theta_k, args, seed, dys, packed, input_grad, loss=None, after=None
  ):
    """`Backward` with the running sums packed: one flat tensor per dtype
    group of the float weights (`cell_layout.Layout.Groups`), so that a loop
    carries one sum per dtype, not one per weight.

    Returns:
      (the new packed sums; the inputs' gradients, flat like args, None
      where there is none; [whether each float weight had a gradient]).
    """
    is_eval = py_utils.IsEval()
    layout, weights = self._Layout(theta_k, args, seed, loss)
    loss_fn = None if loss is None else loss.fn
    present = tuple(dy is not None and cell_layout.IsFloat(dy) for dy in dys)
    given = [dy for dy, p in zip(dys, present) if p]
    f = self._Backward(
      k,
      layout,
      is_eval,
      present,
      input_grad,
      loss_fn,
      packed=True,
      weights=weights,
    )
    call_inputs = _CallTensors(layout, weights) + given + list(packed)
    self._Check(k, f, call_inputs, ('backward',) + f.meta['key'])
    got = list(self._Call(f, call_inputs, after))
    if self._jit:
      got = _Anchored(got)
    n = len(packed)
    sums, rest = got[:n], iter(got[n:])
    dx = [None] * layout.num_args
    x_sources = layout.Sources(input_grad)[len(layout.theta_floats) :]
    for (i, _), has in zip(x_sources, f.meta['present_x']):
      if has:
        dx[i] = next(rest)
    return sums, dx, f.meta['present']

  def TapeBackward(
    self, tape, outs, args, theta_k, dys, sums, input_grad, loss
  ):
    """The backward of a `TapedForward` call: `tape`'s gradient of the
    call's outputs `outs` (the cell's, or (loss,)) for `dys` (flat, None
    where there is none), the weights' gradients added to `sums` in one
    call (`_Accumulate`). Takes and returns what `Backward` does."""
    layout = cell_layout.Layout(theta_k, args, None, loss)
    sources = layout.Sources(input_grad)
    pairs = [
      (a, b)
      for a, b in zip(tf.nest.flatten(outs), dys)
      if cell_layout.IsFloat(a) and b is not None
    ]
    if pairs and sources:
      grads = tape.gradient(
        [a for a, _ in pairs],
        [layout.tensors[p] for _, p in sources],
        output_gradients=[b for _, b in pairs],
      )
    else:
      grads = [None] * len(sources)
    # Placed where they belong; summed below, in one call.
    theta_g, dx = self._Split(
      layout, sources, grads, [None] * layout.num_theta, summed=True
    )
    return self._Accumulate(sums, theta_g), dx

  def _Accumulate(self, sums, grads):
    """[sum + gradient] for each pair (the gradient where the sum is None,
    None where both are), as one call: the running sums of the weights'
    gradients of a cell whose backward came from its forward's tape."""
    pairs = [
      i
      for i, (s, g) in enumerate(zip(sums, grads))
      if s is not None and g is not None
    ]
    out = [g if s is None else s for s, g in zip(sums, grads)]
    if not pairs:
      return out
    a = [cell_layout.Dense(sums[i]) for i in pairs]
    b = [cell_layout.Dense(grads[i]) for i in pairs]
    if self.Inline() or tf.executing_eagerly():
      added = [x + y for x, y in zip(a, b)]
    else:
      sig = tuple((tuple(t.shape.as_list()), t.dtype.name) for t in a)
      f = self._Get(('sum', sig), self._MakeSum)
      added = _CallOp(f, a + b)
    for i, t in zip(pairs, added):
      out[i] = t
    return out

  def _Layout(self, theta_k, args, seed, loss, unpack=True):
    """(the `cell_layout.Layout`, the `PackedWeights` the calls pass or
    None): weights come packed from the clock loops; they are passed
    flat where cells run inline. Compiled cells take them one by one (XLA
    takes no lists): they are unpacked here, next to the call, so that the
    loops and their conds still pass one list per dtype, not each weight
    (a few ops per weight and tick, run at every tick). `unpack=False`:
    no call follows (a trace for shapes), so nothing is read."""
    weights = None
    if isinstance(theta_k, cell_layout.PackedWeights):
      weights, theta_k = theta_k, theta_k.theta
      if self.Inline() or tf.executing_eagerly():
        weights = None
      elif not self.PacksWeights():
        if unpack:
          theta_k = weights.Unpacked()
        weights = None
    return cell_layout.Layout(theta_k, args, seed, loss), weights

  def _Call(self, f, tensors, after):
    deps = [t for t in tf.nest.flatten(after) if py_utils.IsTensor(t)]
    if tf.executing_eagerly():
      return f.fn(*tensors)
    with tf.control_dependencies(deps):
      return _CallOp(f, tensors, self._precompiler)

  # -- Running a cell ----------------------------------------------------------

  def _Run(
    self, k, layout, tensors, is_eval, collector, loss_fn, mark=None, fprop=None
  ):
    """(outputs tuple, the loss or None) of cell k on `tensors`; `fprop`
    runs each layer (default: its FProp, inline)."""
    theta_k, args, seed, loss_in, loss_th = layout.Unpack(tensors)
    with py_utils.EvalMode(is_eval), py_utils.StepSeed(seed), collector:
      out = py_utils.AsTuple(
        self._cell_fprop(k, theta_k, args, mark, fprop=fprop)
      )
      loss = None
      if loss_fn is not None:
        loss = tf.convert_to_tensor(
          loss_fn(py_utils.Unwrap(out), loss_in, loss_th)
        )
        if loss.shape.rank != 0 or not loss.dtype.is_floating:
          raise ValueError(
            f'The loss function of pipeline {self._name!r} returned '
            f'{loss.dtype.name} {loss.shape}; it must return a float '
            "scalar: the micro-batch's share of the loss."
          )
    return out, loss

  def _LayerFProp(self, f, first_inline=False):
    """How the layers of function `f` run: shared kinds as calls (not in
    the XLA check's trace, which looks for the layer of each op, nor in a
    forward that a tape records).

    `first_inline`: the cell's first layer runs inline (a backward that
    needs no input gradient: a call's gradient computes every input's).
    """
    if self._shared is None or 'mark' in f.meta or f.meta.get('taped'):
      return None
    if not first_inline:
      return self._shared.FProp
    calls = []

    def FProp(layer, theta, args):
      calls.append(layer)
      if len(calls) == 1:
        return layer.FProp(theta, *args)
      return self._shared.FProp(layer, theta, args)

    return FProp

  def _Differentiate(
    self,
    k,
    layout,
    tensors,
    is_eval,
    given,
    present,
    sources,
    loss_fn,
    fprop=None,
  ):
    """Gradients of cell k's outputs (or loss) on `tensors` for the output
    gradients `given` (those of the outputs marked in `present`), w.r.t.
    tensors[position] for each (index, position) of `sources`."""
    xs = [tensors[p] for _, p in sources]
    # Layers inline in an uncompiled function: each layer's backward waits
    # for the one above (graph_ops.BackwardOrder; XLA orders its own).
    order = None
    if (
      fprop is None
      and not self._jit
      and not self.Inline()
      and not tf.executing_eagerly()
    ):
      order = graph_ops.BackwardOrder()
      fprop = order.FProp
    # (The XLA check traces this inside tf.init_scope, which stops tapes.)
    with (
      _tf_internal.RecordingOn(),
      tf.GradientTape(watch_accessed_variables=False) as tape,
    ):
      tape.watch(xs)
      out, loss = self._Run(
        k,
        layout,
        tensors,
        is_eval,
        py_utils.UpdateCollector(),
        loss_fn,
        fprop=fprop,
      )
    ys = [loss] if loss is not None else tf.nest.flatten(out)
    given = list(given)
    pairs = [(y, given.pop(0)) for y, p in zip(ys, present) if p]
    pairs = [(y, dy) for y, dy in pairs if cell_layout.IsFloat(y)]
    if not pairs or not xs:
      return [None] * len(xs)
    if order is not None:
      order.Start()
    grads = list(
      tape.gradient(
        [y for y, _ in pairs], xs, output_gradients=[dy for _, dy in pairs]
      )
    )
    if order is not None:
      order.Apply()
    return grads

  def _Split(self, layout, sources, grads, sums, summed):
    """(weight gradients flat like `sums`, input gradients flat like the
    inputs) from the gradients of `sources`; adds them to `sums` unless the
    call already did (`summed`)."""
    theta_g = [None] * layout.num_theta
    arg_g = [None] * layout.num_args
    n_theta = len(layout.theta_floats)
    for j, ((i, _), g) in enumerate(zip(sources, grads)):
      if j < n_theta:
        theta_g[i] = g
      else:
        arg_g[i] = g
    if not summed:
      theta_g = [
        g if s is None else (s if g is None else graph_ops.AddTo(s, g))
        for s, g in zip(sums, theta_g)
      ]
    else:
      theta_g = [s if g is None else g for s, g in zip(sums, theta_g)]
    return theta_g, arg_g

  # -- The functions -----------------------------------------------------------

  def _Check(self, k, f, tensors, key):
    if self._xla_check is not None:
      self._xla_check.Check(k, f, tensors, key)
    if key[0] == 'backward' and not tf.executing_eagerly():
      cell_checks.WarnStatefulRandom(
        self._name, k, f, lambda: _Concrete(f, tensors)
      )

  def _Get(self, key, make):
    # A loop's or a branch's body graph calls the functions of the step it
    # is part of.
    graph = _tf_internal.OutermostOfControlFlow(
      tf.compat.v1.get_default_graph()
    )
    fns = self._graphs.setdefault(graph, {})
    if key not in fns:
      fns[key] = make()
    return fns[key]

  def _OfCell(self, k, key, make):
    """The function `make(k)` makes for cell k under `key(k)`; or, where
    an earlier cell of the same kind (`cell_kind`) has one that can serve
    cell k (`_Serves`), that one: each distinct cell is traced once."""
    if self._cell_kind is not None and k not in self._kinds:
      self._kinds[k] = self._cell_kind(k)
    kind = self._kinds.get(k)
    if kind is not None:
      f = self._Get(key(('kind', kind)), lambda: make(k))
      if f.meta['cell'] == k or _Serves(f):
        return f
    return self._Get(key(k), lambda: make(k))

  def _Wrap(self, body):
    if self._jit:
      return tf.function(body, jit_compile=True, autograph=False)
    return py_utils.OutOfLineFunction(body)

  def _MakeSum(self):
    f = _Function()

    def Sum(*tensors):
      n = len(tensors) // 2
      return [s + g for s, g in zip(tensors[:n], tensors[n:])]

    f.fn = self._Wrap(Sum)
    return f

  def _Forward(self, k, layout, is_eval, loss_fn, taped, weights=None):
    wkey = None if weights is None else weights.key

    def Key(cell):
      return ('forward', cell, is_eval, layout.key, loss_fn, taped, wkey)

    def Make(k):
      f = _Function()
      f.meta['cell'] = k
      f.meta['taped'] = taped

      @_tf_internal.WithSharedConstants
      def Forward(*tensors):
        self._traces.Count(f, k, 'forward', Key(k), tensors)
        tensors = _Unpacked(weights, tensors)
        collector = py_utils.UpdateCollector()
        out, loss = self._Run(
          k,
          layout,
          tensors,
          is_eval,
          collector,
          loss_fn,
          f.meta.get('mark'),
          fprop=self._LayerFProp(f),
        )
        f.meta['out'] = out
        f.meta['updates'] = list(collector.updates)
        flat = [t for t in tf.nest.flatten(out) if t is not None]
        if loss is not None:
          flat = flat + [loss]
        return flat + tf.nest.flatten([s for _, s in collector.updates])

      f.body, f.fn = Forward, self._Wrap(Forward)
      return f

    return self._OfCell(k, Key, Make)

  @staticmethod
  def _AddPacked(f, layout, inputs, grads, running):
    """In a packed backward function: [the running sum of each dtype group
    plus the group's gradients, flattened and joined] + the inputs'
    gradients that there are."""
    n_th = len(layout.theta_floats)
    theta_g, x_g = grads[:n_th], grads[n_th:]
    f.meta['present'] = [g is not None for g in theta_g]
    f.meta['present_x'] = [g is not None for g in x_g]
    sums = []
    for (_, js), s in zip(layout.Groups(), running):
      parts = []
      for j in js:
        g = theta_g[j]
        if g is None:
          # Zeros computed from the weight: tf.zeros_like of a known shape
          # would be folded into a constant held as long as the function.
          w = inputs[layout.theta_floats[j][1]]
          g = tf.math.multiply_no_nan(w, tf.zeros([], w.dtype))
        parts.append(tf.reshape(g, [-1]))  # one [-1]: SharedConstants
      # Element by element the same sums as one add per weight.
      sums.append(s + (parts[0] if len(parts) == 1 else tf.concat(parts, 0)))
    return sums + [g for g in x_g if g is not None]

  def _Backward(
    self,
    k,
    layout,
    is_eval,
    present,
    input_grad,
    loss_fn,
    packed=False,
    weights=None,
  ):
    """The recompute-and-backward of cell k: takes the inputs, the output
    gradients marked in `present` and the running sum of each float
    weight's gradient; returns the new sums (of the weights that have a
    gradient) and the inputs' gradients.

    `packed`: the running sums are one flat tensor per dtype of the weights
    (`Layout.Groups`), and so are the new sums (zeros added for a weight
    without a gradient). `weights`: the call passes the cell's weights as
    these `cell_layout.PackedWeights`' lists."""
    wkey = None if weights is None else weights.key

    def Key(cell):
      return (
        cell,
        is_eval,
        layout.key,
        present,
        input_grad,
        loss_fn,
        packed,
        wkey,
      )

    def Make(k):
      f = _Function()
      f.meta['cell'] = k
      f.meta['key'] = Key(k)
      sources = layout.Sources(input_grad)
      n_in, n_dy = len(_CallTensors(layout, weights)), sum(present)

      @_tf_internal.WithSharedConstants
      def Backward(*tensors):
        self._traces.Count(f, k, 'backward', ('backward',) + Key(k), tensors)
        inputs = _Unpacked(weights, tensors[:n_in])
        grads = self._Differentiate(
          k,
          layout,
          inputs,
          is_eval,
          tensors[n_in : n_in + n_dy],
          present,
          sources,
          loss_fn,
          fprop=self._LayerFProp(f, first_inline=not input_grad),
        )
        running = list(tensors[n_in + n_dy :])
        grads = [None if g is None else cell_layout.Dense(g) for g in grads]
        if packed:
          return self._AddPacked(f, layout, inputs, grads, running)
        for j, s in enumerate(running):
          # The same sum, in the same order, as adding micro-batch by
          # micro-batch outside. A weight without a gradient keeps its sum
          # (the engine's), None where it never had one.
          if grads[j] is not None:
            grads[j] = s + grads[j]
        f.meta['present'] = [g is not None for g in grads]
        return [g for g in grads if g is not None]

      f.body, f.fn = Backward, self._Wrap(Backward)
      return f

    return self._OfCell(k, Key, Make)
