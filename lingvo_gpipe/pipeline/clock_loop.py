"""The fill-drain schedule as two loops over its clock ticks.

In GPipe's schedule every clock tick t does the same work: cell k runs the
forward of micro-batch t - k (where 0 <= t - k < M), and the backward pass
mirrors it. So the step can hold each cell's call once, in the body of a
`tf.while_loop` over the M + K - 1 ticks, as Lingvo's recurrent GPipe does,
instead of one call per work item:

  forward loop, tick t:   for each cell k (each replica r):
      out[k] = F_k(theta_k, out[k-1] of tick t-1, seed(t-k))  if active
               out[k]                                          otherwise
  backward loop, tick s:  for each cell k, last first:
      acc[k], dx[k] = G_k(theta_k, x_k(m), seed(m), dx[k+1] of tick s-1,
                          acc[k])                             if active
      with m = M - 1 - (s - (K - 1 - k))

Each cell's output of every tick is written to a TensorList (what the next
cell's backward re-materializes from, and the pipeline's outputs and
batch-norm statistics); an idle tick passes the cell's previous output on
without a copy. The weights enter each loop once (each tick's `tf.cond`
then passes them on to the call). The backward loop carries each cell's
running gradient sums packed into one flat tensor per dtype
(`CellFunctions.BackwardPacked`): a loop variable per weight would cost a
few ops per weight at every tick.

What the loops cost (`docs/benchmarks.md`, "The schedule as loops" and
"The loops' ticks"): the control ops, the conds and the list writes of
every tick, about 1.13x a steady step in one process, but 1.5-2.2x over
worker processes (each tick waits for its cells, and the loop's condition
goes to every worker). So `PipeliningLayer.Params().micro_batch_loop` is
off by default. A tick's cells run at once (`_Cond`), each reads what it
needs on the device that holds it (`_Inputs`, `_Placed`) and counts the
ticks itself (`_Loop`).

Why: TensorFlow's graph passes instantiate a called function's body once
per call node (Grappler's function optimizer, the lowering of calls, XLA's
clustering passes), so a step of 2KM calls of K cells pays that per work
item, and the first step grows with M. The loops hold 2K call nodes for any
M: the step's graph, its optimization and its first run do not grow with
the micro-batches (`docs/gpipe.md`, "The shape of the step").

The loops compute exactly what the per-item engine computes (the same
functions on the same tensors, the weights' gradients summed in the same
order, the same seeds), so gradients are bit-identical. They build the step
for schedule='gpipe' with recompute='always' and more than one micro-batch
in a graph; the engine builds every other case item by item.

With `strict_order` each cell's call waits for the previous call on its
device (in the loop: the previous cell on that device in the same tick, or
the device's last cell of the tick before), as the work items do.
"""

import contextlib

import tensorflow as tf

from lingvo_gpipe.cells import cell_function
from lingvo_gpipe.cells import cell_layout
from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import graph_ops
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import schedule as schedule_lib

__all__ = ['ClockLoops', 'PARALLEL_TICKS', 'Stacked']

# Ticks of a loop that may run at once. Each tick runs every cell once, so
# the pipeline's cells run concurrently within one tick; more ticks at once
# let a device run ahead of the schedule. Over worker processes each worker
# runs its own part of a loop, and with every tick allowed at once a
# pipeline-8 AmoebaNet-D (D=40, 24 cells, M=32) peaked at 108-191 MiB on
# one device, run to run, against 26 MiB with 2 ticks (23 MiB with 1),
# for a steady step 4-7% slower than with every tick (9-13% with 1;
# docs/benchmarks.md). The values are the same whatever the number.
PARALLEL_TICKS = 2


def _NonNone(structure):
  return [t for t in tf.nest.flatten(structure) if t is not None]


def _Pack(template, flat):
  """`template`'s structure with its non-None leaves from `flat`."""
  leaves = tf.nest.flatten(template)
  got = iter(flat)
  return tf.nest.pack_sequence_as(
    template, [None if t is None else next(got) for t in leaves]
  )


def _Cond(active, on, off):
  """tf.cond(active, on, off) as a list, free to run as soon as its inputs
  are ready.

  tf.function chains each stateful op of a loop's body after the one built
  before it (automatic control dependencies), and a cond is stateful when
  its branch is: a compiled cell's call is (its anchor, `DeepCopy`), and so
  is a user's cell with a stateful op. Chained, the cells of one tick ran
  one after another, never two at once (the compiled 32-layer LM over 4
  devices: a steady step 1.9x that of the same calls item by item). A
  cell's call takes its weights as tensors and touches no variable, and
  its order on its device is `after`'s, so no chaining is needed.
  """
  with graph_ops.OpsMade() as made:
    out = list(tf.cond(active, on, off))
  for op in made:
    if op.type == 'If':
      _tf_internal.RunIndependently(op)
  return out


def _DeviceOfInputs(op):
  """An op's device: its own; an identity without one in a loop's body or
  a cond's branch, its input's. (Not in the cells' functions, traced
  inside the loops: they are placed as a whole on their cell's device.)"""
  if (
    op.device
    or op.type != 'Identity'
    or not getattr(op.graph, 'is_control_flow_graph', False)
  ):
    return op.device
  for t in op.inputs:
    if t.device:
      return t.device
  return ''


def _Placed(compiled):
  """A scope for building a loop of compiled cells, in which each identity
  without a device in the loop's body or a cond's branch goes to the
  device of its input.

  tf.function passes every value a loop's body (and a cond's branch)
  returns through an identity it builds after the body, outside the cells'
  device scopes. Unplaced, those identities went to the first device (the
  driver, over worker processes), and with compiled cells, whose calls
  read their weights from the lists inside the branch, TensorFlow's
  placer left them there: at every tick each cell's state and results
  crossed to that device and back. The compiled 64-layer LM over 8 worker
  processes sent 1.0-1.1 GB per step through the host's loopback, 32 MB with
  the identities placed. Cells that are not compiled do not need it, and
  lose by it (32 MB per step become 670 MB; not understood): their loops
  are built as before.
  """
  if not compiled:
    return contextlib.nullcontext()
  return tf.compat.v1.get_default_graph().device(_DeviceOfInputs)


class Stacked:
  """A structure of micro-batches held as one tensor per leaf.

  Leaves that split along the batch are stacked [M, ...] (a reshape where
  the batch axis is the first: no copy); the others (scalars, None) are the
  same for every micro-batch. `At(m)` is micro-batch m, as
  `microbatch.Split` would give it.
  """

  def __init__(self, structure, num_mb, batch_dim):
    self.structure = structure
    self.leaves = []
    for x in tf.nest.flatten(structure):
      if not (microbatch.IsSplittable(x) and num_mb > 1):
        self.leaves.append((False, x))
        continue
      shape = x.shape.as_list()
      if batch_dim == 0 and None not in shape:
        leaf = tf.reshape(x, [num_mb, shape[0] // num_mb] + shape[1:])
      else:
        leaf = tf.stack(tf.split(x, num_mb, axis=batch_dim))
      self.leaves.append((True, leaf))

  def At(self, m):
    return tf.nest.pack_sequence_as(
      self.structure,
      [tf.gather(leaf, m) if split else leaf for split, leaf in self.leaves],
    )


class _Run:
  """What the forward loop leaves for the backward loop and the caller.

  Attributes:
    num_mb: M.
    inputs: [replica] `Stacked` inputs of cell 0.
    loss_inputs: [replica] `Stacked` loss inputs, or None.
    loss_fn: the loss function on the last cell, or None.
    loss_thetas: [replica] the loss's weights, or None.
    lists: {(r, k): [TensorList] of cell k's flat results, one per tick}.
    templates: {(r, k): (outputs, has loss, [(layer, stats)])}: how a flat
      result of cell k unflattens.
    stats: {(r, k): the `cell_layout.PackedStats` of cell k's
      statistics}: a flat result is the outputs, the loss, then the packed
      statistics.
    seeds: {(r, k): [M] seeds of cell k's micro-batches, on its device}.
    weights: {(r, k): cell k's weights as its calls take them (packed
      into lists, `_PackWeights`)}.
    outs: the last cell's outputs for the whole mini-batch.
    raws: [micro-batch j] the last cell's outputs (with a loss).
    losses: [micro-batch j] the losses, or None.
    updates: [(layer, stats)] in the work items' order.
  """


class ClockLoops:
  """Builds a `PipelineEngine`'s fill-drain step as two while loops.

  Args:
    engine: the `engine.PipelineEngine` (its cells, placement, K, batch
      axis, `strict_order`).
  """

  def __init__(self, engine):
    self._e = engine
    self._cells = engine._cells  # pylint: disable=protected-access
    self._num_cells = engine._num_cells  # pylint: disable=protected-access
    self._batch_dim = engine._batch_dim  # pylint: disable=protected-access
    self._strict = engine._strict_order  # pylint: disable=protected-access

  @staticmethod
  def Applies(engine, num_mb):
    """Whether the loops build this step (see the module's docstring)."""
    cells = engine._cells  # pylint: disable=protected-access
    if (
      num_mb < 2
      or tf.executing_eagerly()
      or cells.Inline()
      or schedule_lib.ActiveTracer() is not None
      or engine._recompute != 'always'  # pylint: disable=protected-access
    ):
      return False
    k = engine._num_cells  # pylint: disable=protected-access
    return engine.Work(num_mb) == schedule_lib.FillDrain(k, num_mb)

  def _Device(self, k, r):
    return self._e._Device(k, r)  # pylint: disable=protected-access

  def _Key(self, k, r):
    return self._e._DeviceKey(k, r)  # pylint: disable=protected-access

  def _Order(self, order):
    """{(r, k): the (r', k') whose call the call of (r, k) waits for}: the
    previous cell on its device in `order`, else the device's last cell in
    `order` (of the tick before)."""
    last, waits = {}, {}
    for rk in order:
      key = self._Key(rk[1], rk[0])
      if key in last:
        waits[rk] = (last[key], True)
      last[key] = rk
    for rk in order:
      if rk not in waits:
        waits[rk] = (last[self._Key(rk[1], rk[0])], False)
    return waits

  def _Loop(self, num_ticks, body, state, lists, cells):
    """(state, lists) after `body(ticks, state, lists)` ran for each tick,
    at most `PARALLEL_TICKS` at once; `ticks` holds the tick once per
    (r, k) of `cells`, counted on that cell's device. (From the loop's one
    counter, which lives with the loop's condition on the driver, every
    worker fetched the tick at every tick: the pipeline-8 LM's loop step
    was 7% slower.)"""
    ticks = {}
    for r, k in cells:
      with self._Device(k, r):
        ticks[(r, k)] = tf.constant(0)

    def Body(t, ticks, state, lists):
      state, lists = body(ticks, state, lists)
      after = {}
      for r, k in cells:
        with self._Device(k, r):
          after[(r, k)] = ticks[(r, k)] + 1
      return t + 1, after, state, lists

    with graph_ops.OpsMade() as made, _Placed(not self._cells.PacksWeights()):
      _, _, state, lists = tf.while_loop(
        lambda t, *_: t < num_ticks,
        Body,
        (tf.constant(0), ticks, state, lists),
        parallel_iterations=min(PARALLEL_TICKS, num_ticks),
      )
    # No tape records the loop (the engine differentiates it by a loop of
    # its own): its body's and branches' graphs, each with copies of the
    # cell functions it calls, are not needed once it is built.
    _tf_internal.ReleaseControlFlowGraphs(made)
    return state, lists

  # -- The forward loop --------------------------------------------------------

  def Forward(
    self,
    thetas,
    args,
    num_mb,
    seed,
    loss_fn=None,
    loss_inputs=None,
    loss_thetas=None,
  ):
    """The forward loop; returns a `_Run` (see its attributes), or None
    where a cell's results have shapes unknown when the step is built.

    No gradient tape records it: the engine records the pipeline as one
    operation whose gradient is the backward loop."""
    with _tf_internal.StopRecording():
      return self._Forward(
        thetas, args, num_mb, seed, loss_fn, loss_inputs, loss_thetas
      )

  def _Forward(
    self, thetas, args, num_mb, seed, loss_fn, loss_inputs, loss_thetas
  ):
    num_k, num_r = self._num_cells, len(thetas)
    last = num_k - 1
    run = _Run()
    run.num_mb, run.loss_fn, run.loss_thetas = num_mb, loss_fn, loss_thetas
    for x in tf.nest.flatten(args):
      if py_utils.IsTensor(x) and not x.shape.is_fully_defined():
        return None
    with graph_ops.DeviceOf(args):
      shards = microbatch.Split(graph_ops.Opaque(args), num_r, self._batch_dim)
    run.inputs = []
    for r in range(num_r):
      with self._Device(0, r):
        run.inputs.append(Stacked(tuple(shards[r]), num_mb, self._batch_dim))
    run.loss_inputs = None
    if loss_fn is not None and loss_inputs is not None:
      with self._Device(last, 0):
        parts = microbatch.Split(
          graph_ops.Opaque(loss_inputs), num_r, self._batch_dim
        )
        run.loss_inputs = [Stacked(p, num_mb, self._batch_dim) for p in parts]
    run.seeds = self._Seeds(seed, num_r, num_mb)
    run.weights = {}
    for r in range(num_r):
      for k in range(num_k):
        with self._Device(k, r):
          run.weights[(r, k)] = self._PackWeights(thetas[r][k])

    # The first tick's arguments: from them each cell's function is traced
    # (the shapes of its results) and the loop's state starts as zeros.
    order = [(r, k) for k in range(num_k) for r in range(num_r)]
    init, run.templates, run.stats = {}, {}, {}
    zero = tf.constant(0)
    for r, k in order:
      with self._Device(k, r):
        if k == 0:
          x = run.inputs[r].At(zero)
        else:
          x = self._Outputs(run, r, k - 1, init[(r, k - 1)])
        loss = self._Loss(run, r, k, zero)
        seed_m = run.seeds[(r, k)][0]
        specs = self._cells.ForwardSpecs(
          k, run.weights[(r, k)], x, seed_m, loss
        )
        if not all(s.shape.is_fully_defined() for s in specs):
          return None  # The loop's state needs static shapes.
        run.templates[(r, k)] = self._cells.ForwardTemplate(
          k, run.weights[(r, k)], x, seed_m, loss
        )
        n = self._NumHead(run, r, k)
        run.stats[(r, k)] = cell_layout.PackedStats(specs[n:])
        specs = specs[:n] + run.stats[(r, k)].specs
        zero_k = graph_ops.RuntimeZero((thetas[r][k], x))
        init[(r, k)] = [graph_ops.Zeros(s, zero_k) for s in specs]
    waits = self._Order(order)
    num_ticks = num_mb + num_k - 1

    def Body(ticks, state, lists):
      new, lists = dict(state), dict(lists)
      for r, k in order:
        with self._Device(k, r):
          t = ticks[(r, k)]
          m = t - k
          active = tf.logical_and(m >= 0, m < num_mb)
          mc = tf.clip_by_value(m, 0, num_mb - 1)
          if k == 0:
            x = run.inputs[r].At(mc)
          else:
            x = self._Outputs(run, r, k - 1, state[(r, k - 1)])
          wait, this_tick = waits[(r, k)]
          after = (new if this_tick else state)[wait] if self._strict else None
          loss = self._Loss(run, r, k, mc)
          seed_m = tf.gather(run.seeds[(r, k)], mc)

          def On(r=r, k=k, x=x, seed_m=seed_m, loss=loss, after=after):
            out, loss_value, upd = self._cells.Forward(
              k, run.weights[(r, k)], x, seed_m, loss, after=after
            )
            flat = self._Flatten(out, loss_value, upd)
            n = self._NumHead(run, r, k)
            return flat[:n] + run.stats[(r, k)].Pack(flat[n:])

          def Off(r=r, k=k):
            return list(state[(r, k)])

          new[(r, k)] = _Cond(active, On, Off)
          lists[(r, k)] = [
            ta.write(t, v) for ta, v in zip(lists[(r, k)], new[(r, k)])
          ]
      return new, lists

    lists0 = {}
    for r, k in order:
      with self._Device(k, r):
        lists0[(r, k)] = [
          tf.TensorArray(v.dtype, size=num_ticks, element_shape=v.shape)
          for v in init[(r, k)]
        ]
    _, lists = self._Loop(num_ticks, Body, init, lists0, order)
    run.lists = lists
    self._Results(run, num_r, num_k)
    return run

  def _PackWeights(self, theta_k):
    """The weights of a cell as the loops pass them: packed into lists
    (`cell_layout.PackedWeights`: a loop or cond passes each tensor it
    takes through ops of its own); compiled cells unpack them before each
    call."""
    return cell_layout.PackedWeights(theta_k)

  def _Seeds(self, seed, num_r, num_mb):
    """{(r, k): [M] the step seeds of cell k's micro-batches}: micro-batch
    j = r*M + m runs with the seed the work items use,
    (seed * 1000003) ^ StableHash('mix', j), made once per device."""
    step = graph_ops.Opaque(tf.cast(seed, tf.int64))
    scaled, seeds = {}, {}
    for r in range(num_r):
      hashes = [
        py_utils.StableHash('mix', r * num_mb + m) for m in range(num_mb)
      ]
      for k in range(self._num_cells):
        key = self._Key(k, r)
        with self._Device(k, r):
          if key not in scaled:
            scaled[key] = step * 1000003
          seeds[(r, k)] = tf.bitwise.bitwise_xor(
            scaled[key], tf.constant(hashes, tf.int64)
          )
    return seeds

  def _Loss(self, run, r, k, m):
    if run.loss_fn is None or k != self._num_cells - 1:
      return None
    inputs = None if run.loss_inputs is None else run.loss_inputs[r].At(m)
    theta = None if run.loss_thetas is None else run.loss_thetas[r]
    return cell_function.Loss(run.loss_fn, inputs, theta)

  @staticmethod
  def _Flatten(out, loss_value, updates):
    flat = _NonNone(out)
    if loss_value is not None:
      flat.append(loss_value)
    return flat + tf.nest.flatten([s for _, s in updates])

  @staticmethod
  def _NumHead(run, r, k):
    """How many of cell k's flat results come before the statistics: its
    outputs but None, and the loss on the last cell of a loss."""
    out_t, has_loss, _ = run.templates[(r, k)]
    return len(_NonNone(out_t)) + int(has_loss)

  def _Outputs(self, run, r, k, flat):
    """Cell k's outputs (a tuple) from its flat results."""
    out_t = run.templates[(r, k)][0]
    return _Pack(out_t, flat[: len(_NonNone(out_t))])

  def _Read(self, run, r, k, tick, stats, outputs=True):
    """(outputs or None, loss or None, [(layer, stats)]) of cell k at
    `tick`: the outputs and loss read from the forward loop's lists (unless
    not `outputs`), the statistics from `stats` (see `_StatsOf`)."""
    out_t, has_loss, upd_t = run.templates[(r, k)]
    n = self._NumHead(run, r, k)
    with self._Device(k, r):
      flat = [
        ta.read(tick) if outputs else None for ta in run.lists[(r, k)][:n]
      ]
    flat += [stat[tick - k] for stat in stats]
    out = _Pack(out_t, flat[: len(_NonNone(out_t))])
    rest = flat[len(_NonNone(out_t)) :]
    loss = None
    if has_loss:
      loss, rest = rest[0], rest[1:]
    updates = []
    for layer, stat in upd_t:
      n = len(tf.nest.flatten(stat))
      updates.append((layer, tf.nest.pack_sequence_as(stat, rest[:n])))
      rest = rest[n:]
    return out, loss, updates

  def _StatsOf(self, run, r, k):
    """[statistic][micro-batch m] cell k's statistics (flat) of every
    micro-batch: each packed list read whole (the ticks k .. k + M - 1),
    split into the statistics and unstacked, a few ops per statistic
    instead of a read per micro-batch (a batch-normalized model has many
    statistics per cell)."""
    n = self._NumHead(run, r, k)
    lists = run.lists[(r, k)][n:]
    with self._Device(k, r):
      ticks = tf.range(k, k + run.num_mb)
      stacked = run.stats[(r, k)].Unpack(
        [ta.gather(ticks) for ta in lists], run.num_mb
      )
      return [tf.unstack(t, num=run.num_mb) for t in stacked]

  def _Results(self, run, num_r, num_k):
    """The outputs, losses and updates of every micro-batch, read from the
    loop's lists in the work items' order."""
    last = num_k - 1
    num_mb = run.num_mb
    run.updates, finals, stats = [], {}, {}
    for _, k, m in schedule_lib.ForwardOrder(num_k, num_mb):
      for r in range(num_r):
        if k != last and not run.templates[(r, k)][2]:
          continue
        if (r, k) not in stats:
          stats[(r, k)] = self._StatsOf(run, r, k)
        got = self._Read(run, r, k, m + k, stats[(r, k)], outputs=k == last)
        run.updates.extend(got[2])
        if k == last:
          finals[r * num_mb + m] = got
    finals = [finals[j] for j in range(num_r * num_mb)]
    run.raws = [f[0] for f in finals]
    run.losses = [f[1] for f in finals] if run.loss_fn is not None else None

  # -- The backward loop -------------------------------------------------------

  def Backward(self, run, thetas, dys, input_grads):
    """The backward loop after the forward loop `run`.

    Args:
      run: the `_Run` of `Forward`.
      thetas: [replica][cell] thetas, as for `Forward`.
      dys: [replica] `Stacked` gradients of the last cell's outputs (a
        tuple), or None with a loss (whose gradient is 1).
      input_grads: compute the gradients of cell 0's float inputs.

    Returns:
      ({micro-batch j: flat gradients of the pipeline's inputs, None where
      there is none}, [replica][cell] the weights' gradients summed over the
      micro-batches, flat (the cell's, then on the last cell the loss's),
      None where there is none).
    """
    num_k, num_r, num_mb = self._num_cells, len(thetas), run.num_mb
    last = num_k - 1
    order = [(r, k) for k in reversed(range(num_k)) for r in range(num_r)]
    waits = self._Order(order)
    num_ticks = num_mb + num_k - 1
    zero = tf.constant(0)
    # The loop's state of each cell: the running sums of its float weights'
    # gradients, packed into one flat tensor per dtype (a loop variable per
    # weight would cost the loop a few ops per weight at every tick), then
    # the gradients of its float inputs (what the cell before it
    # back-propagates next).
    if dys is not None:
      ready = [leaf for split, leaf in dys[0].leaves if split][:1]
    else:
      ready = run.losses[-1:]
    init, info = {}, {}
    for r, k in order:
      with self._Device(k, r):
        x = self._Inputs(run, r, k, zero)
        layout = cell_layout.Layout(
          thetas[r][k], x, None, self._Loss(run, r, k, zero)
        )
        # [(dtype, [(index in the flat weights, shape, j)])]: j indexes
        # layout.theta_floats.
        groups = [
          (
            dtype,
            [
              (
                layout.theta_floats[j][0],
                layout.tensors[layout.theta_floats[j][1]].shape,
                j,
              )
              for j in js
            ],
          )
          for dtype, js in layout.Groups()
        ]
        flat_x = tf.nest.flatten(x)
        x_idx = [i for i, t in enumerate(flat_x) if cell_layout.IsFloat(t)]
        if k == 0 and not input_grads:
          x_idx = []
        num_th = len(tf.nest.flatten(thetas[r][k]))
        if k == last and run.loss_thetas is not None:
          num_th += len(tf.nest.flatten(run.loss_thetas[r]))
        info[(r, k)] = (num_th, groups, len(flat_x), x_idx)
        # Made once the output gradients are there: made at the start of
        # the step, they would hold a copy of the weights through the
        # forward pass.
        zero_k = graph_ops.RuntimeZero((thetas[r][k], ready))
        with tf.control_dependencies(ready):
          init[(r, k)] = [
            graph_ops.Zeros(
              tf.TensorSpec(
                [sum(shape.num_elements() for _, shape, _ in parts)], dtype
              ),
              zero_k,
            )
            for dtype, parts in groups
          ] + [
            graph_ops.Zeros(
              tf.TensorSpec(flat_x[i].shape, flat_x[i].dtype), zero_k
            )
            for i in x_idx
          ]
    present = {}

    def Body(ticks, state, lists):
      new, lists = dict(state), dict(lists)
      for r, k in order:
        _, groups, _, x_idx = info[(r, k)]
        with self._Device(k, r):
          s = ticks[(r, k)]
          m = num_mb - 1 - (s - (last - k))
          active = tf.logical_and(m >= 0, m < num_mb)
          mc = tf.clip_by_value(m, 0, num_mb - 1)
          x = self._Inputs(run, r, k, mc)
          loss = self._Loss(run, r, k, mc)
          seed_m = tf.gather(run.seeds[(r, k)], mc)
          if k == last:
            if dys is None:
              # Opaque: a constant input would make the graph optimizer
              # copy the cell's function for this call.
              dy = [graph_ops.Opaque(tf.ones([], run.losses[0].dtype))]
            else:
              dy = tf.nest.flatten(dys[r].At(mc))
          else:
            # The gradients of this cell's outputs: those of the next
            # cell's inputs, from the tick before.
            _, groups_next, n_next, x_next = info[(r, k + 1)]
            dy = [None] * n_next
            for i, g in zip(x_next, state[(r, k + 1)][len(groups_next) :]):
              dy[i] = g
          wait, this_tick = waits[(r, k)]
          after = (new if this_tick else state)[wait] if self._strict else None
          packed = state[(r, k)][: len(groups)]

          def On(
            r=r,
            k=k,
            x=x,
            seed_m=seed_m,
            dy=dy,
            loss=loss,
            after=after,
            packed=packed,
            x_idx=x_idx,
          ):
            sums, dx, present[(r, k)] = self._cells.BackwardPacked(
              k,
              run.weights[(r, k)],
              x,
              seed_m,
              dy,
              packed,
              input_grads or k > 0,
              loss,
              after=after,
            )
            flat_x = tf.nest.flatten(x)
            return list(sums) + [
              tf.zeros_like(flat_x[i]) if dx[i] is None else dx[i]
              for i in x_idx
            ]

          def Off(r=r, k=k):
            return list(state[(r, k)])

          new[(r, k)] = _Cond(active, On, Off)
          if k == 0:
            lists[r] = [
              ta.write(s, v)
              for ta, v in zip(lists[r], new[(r, k)][len(groups) :])
            ]
      return new, lists

    lists0 = {}
    for r in range(num_r):
      with self._Device(0, r):
        lists0[r] = [
          tf.TensorArray(v.dtype, size=num_ticks, element_shape=v.shape)
          for v in init[(r, 0)][len(info[(r, 0)][1]) :]
        ]
    state, lists = self._Loop(num_ticks, Body, init, lists0, order)
    in_grads = {}
    for r in range(num_r):
      _, _, n_x, x_idx = info[(r, 0)]
      with self._Device(0, r):
        for m in range(num_mb):
          # Cell 0 back-propagated micro-batch m at tick K-1 + M-1-m.
          tick = last + (num_mb - 1 - m)
          flat = [None] * n_x
          for i, ta in zip(x_idx, lists[r]):
            flat[i] = ta.read(tick)
          in_grads[r * num_mb + m] = flat
    # Each cell's sums unpacked on its device: unplaced, a cell's whole
    # packed sum went to the device of the caller's scope (the last cell's,
    # in the tools' steps) and back, for the optimizer on the weights'.
    sums = [[None] * num_k for _ in range(num_r)]
    for r, k in order:
      with self._Device(k, r):
        sums[r][k] = self._Unpack(info[(r, k)], state[(r, k)], present[(r, k)])
    return in_grads, sums

  @staticmethod
  def _Unpack(info, state, present):
    """The weights' gradient sums, flat (None where a weight had no
    gradient), from a cell's packed sums (the loop's final state)."""
    num_th, groups, _, _ = info
    flat = [None] * num_th
    for (_, parts), packed in zip(groups, state):
      # Splits along the first axis share the packed buffer: no copy.
      sizes = [shape.num_elements() for _, shape, _ in parts]
      pieces = tf.split(packed, sizes) if len(sizes) > 1 else [packed]
      for (i, shape, j), piece in zip(parts, pieces):
        if present[j]:
          flat[i] = tf.reshape(piece, shape)
    return flat

  def _Inputs(self, run, r, k, m):
    """Cell k's inputs on micro-batch m (a tensor): cell 0's from the
    pipeline's inputs, the others' the previous cell's outputs, read from
    its list on its device (read on cell k's, the whole list would cross
    between the devices at every tick: over worker processes, every
    micro-batch's outputs, sent again at each tick)."""
    if k == 0:
      return run.inputs[r].At(m)
    out_t = run.templates[(r, k - 1)][0]
    lists = run.lists[(r, k - 1)][: len(_NonNone(out_t))]
    with self._Device(k - 1, r):
      return _Pack(out_t, [ta.read(m + k - 1) for ta in lists])
