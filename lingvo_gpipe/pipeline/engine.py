"""The pipeline engine: runs a schedule of cell work items on their devices.

Over 500 lines: the forward pass, the backward pass and the per-micro-batch
loss path all walk one schedule with one ordering of each device's work.

`PipelineEngine` knows nothing of Params or layers: it is given a function
that runs cell k on one micro-batch, a `placement.StagePlacement` and a
schedule, an ordered list of `schedule.WorkItem`s (clock, cell, micro-batch,
forward/backward; `schedule.FillDrain` by default). It builds

  * the forward ops of every FORWARD item, in list order, keeping what the
    backward pass needs (the cell's input, its gradient tape unless the cell
    is recomputed, its output and its seed);
  * one operation on the gradient tape whose gradient builds the BACKWARD
    items, in list order, each re-materializing its cell if it kept no tape.

`ForwardBackwardWithLoss` instead runs both passes in one list, in the
schedule's order: the last cell also computes each micro-batch's loss, so a
micro-batch's backward can start before the other micro-batches' forwards
(the 1F1B schedule). It is recorded on the tape as one operation from the
inputs and weights to the summed loss, whose gradient scales the gradients
it has already built.

With `strict_order`, every work item on a device (the forwards, backwards
and re-materializations of all the cells placed there) runs after the
device's previous item in the list: control dependencies from each item's
input to the previous item's output on that device.

With R data-parallel replicas, every work item runs on each replica's own
devices, replica r on micro-batches r*M .. r*M+M-1 of the mini-batch.
"""

import collections

import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import graph_ops
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import schedule as schedule_lib

__all__ = ['PipelineEngine', 'RECOMPUTE_POLICIES', 'CheckSchedule']

RECOMPUTE_POLICIES = (
  'always',
  'except_last_cell',
  'except_last_micro_batch',
  'never',
)


def _IsFloat(x):
  return py_utils.IsTensor(x) and x.dtype.is_floating


class _CellAndLoss(collections.namedtuple('_CellAndLoss', ['cell', 'loss'])):
  """The last cell's theta with the weights its loss uses (e.g. a softmax
  outside the pipeline): both are differentiated, and their gradients summed
  over the micro-batches, as one cell's weights."""


def CheckSchedule(work, num_cells, num_micro_batches):
  """Raises ValueError unless `work` runs every (cell, micro-batch) once per
  pass, each cell's forward after the previous cell's, each cell's backward
  after the next cell's and after its own forward."""
  done = {}
  for i, w in enumerate(work):
    if w.kind not in (schedule_lib.FORWARD, schedule_lib.BACKWARD):
      raise ValueError(
        f'Schedule item {i} {w} has kind {w.kind!r}; use '
        f'{schedule_lib.FORWARD!r} or '
        f'{schedule_lib.BACKWARD!r}.'
      )
    if not (0 <= w.cell < num_cells and 0 <= w.micro_batch < num_micro_batches):
      raise ValueError(
        f'Schedule item {i} {w} is outside {num_cells} cells '
        f'and {num_micro_batches} micro-batches.'
      )
    key = (w.kind, w.cell, w.micro_batch)
    if key in done:
      raise ValueError(f'Schedule item {i} {w} repeats item {done[key]}.')
    if w.kind == schedule_lib.FORWARD:
      needs = [(schedule_lib.FORWARD, w.cell - 1)] if w.cell > 0 else []
    else:
      needs = [(schedule_lib.FORWARD, w.cell)]
      if w.cell < num_cells - 1:
        needs.append((schedule_lib.BACKWARD, w.cell + 1))
    for kind, k in needs:
      if (kind, k, w.micro_batch) not in done:
        raise ValueError(
          f'Schedule item {i} {w} comes before the {kind} of '
          f'cell {k} on micro-batch {w.micro_batch} it needs.'
        )
    done[key] = i
  missing = num_cells * num_micro_batches * 2 - len(done)
  if missing:
    raise ValueError(
      f'The schedule leaves out {missing} of the '
      f'{2 * num_cells * num_micro_batches} work items of '
      f'{num_cells} cells and {num_micro_batches} '
      'micro-batches.'
    )


class _Walk:
  """One walk over a schedule: what its work items hand each other.

  Attributes:
    thetas: [replica][cell] thetas, each on its device.
    num_mb: micro-batches per replica M.
    states: [micro-batch j] -> the forward inputs of j's next cell.
    grads: {micro-batch j: the gradient flowing back into j's next cell}.
    saved: {(cell, j): (input, tape or None, output, seed, finish)}, what a
      forward item keeps for its backward.
    theta_acc: [replica][cell][i]: the micro-batch gradients of the i-th
      weight of the cell.
    last_on_device: {device key: the output of its last item}, what the
      device's next item waits for with `strict_order`.
    updates: [(layer, stats)] collected by the forward items.
    input_grads: compute the gradients of the pipeline's inputs.
    tracer: the active `schedule.ScheduleTracer`, or None.
  """

  def __init__(self, thetas, num_mb, states, input_grads=True):
    self.thetas = thetas
    self.num_mb = num_mb
    self.states = states
    self.grads = {}
    self.saved = {}
    self.theta_acc = [
      [[None] * len(tf.nest.flatten(th)) for th in thetas_r]
      for thetas_r in thetas
    ]
    self.last_on_device = {}
    self.updates = []
    self.input_grads = input_grads
    self.tracer = schedule_lib.ActiveTracer()

  def Items(self, work):
    """Yields (item, replica r, micro-batch j of the mini-batch)."""
    for w in work:
      for r in range(len(self.thetas)):
        yield w, r, r * self.num_mb + w.micro_batch


class PipelineEngine:
  """Builds the forward and backward ops of a pipeline of cells.

  Args:
    cell_fprop: fn(k, theta_k, args tuple) -> outputs tuple of cell k.
    placement: a `placement.StagePlacement` of the cells' devices.
    num_cells: K.
    batch_dim: the batch axis of inputs and outputs.
    recompute: one of RECOMPUTE_POLICIES.
    strict_order: run each device's work items in schedule order.
    name: the pipeline's name in error messages.
    schedule: fn(num_cells, num_micro_batches) -> [schedule.WorkItem].
    recompute_backward: fn(k, theta_k, args tuple, output gradients) ->
      (gradients of theta_k, of args), None where there is none: the
      re-materialization and backward pass of cell k in one call (e.g. one
      compiled computation, `jit_cell.JitCells.RecomputeBackward`), run
      under the micro-batch's step seed. None: re-run `cell_fprop` under a
      gradient tape.
  """

  def __init__(
    self,
    cell_fprop,
    placement,
    num_cells,
    batch_dim=0,
    recompute='always',
    strict_order=True,
    name='pipeline',
    schedule=schedule_lib.FillDrain,
    recompute_backward=None,
  ):
    if recompute not in RECOMPUTE_POLICIES:
      raise ValueError(
        f'recompute={recompute!r}; use one of {RECOMPUTE_POLICIES}.'
      )
    self._cell_fprop = cell_fprop
    self._placement = placement
    self._num_cells = num_cells
    self._batch_dim = batch_dim
    self._recompute = recompute
    self._strict_order = strict_order
    self._name = name
    self._schedule = schedule
    self._recompute_backward = recompute_backward

  def Work(self, num_micro_batches):
    """The checked schedule: [WorkItem] of both passes."""
    work = list(self._schedule(self._num_cells, num_micro_batches))
    CheckSchedule(work, self._num_cells, num_micro_batches)
    return work

  def _Pass(self, work, kind):
    return [w for w in work if w.kind == kind]

  def _Device(self, k, r=0):
    return self._placement.Scope(k, r)

  def _Place(self, structure, k):
    return self._placement.Place(structure, k)

  def _DeviceKey(self, k, r):
    """What `strict_order` chains on: the device of cell k of replica r (its
    cell where no device is set, e.g. on TPU)."""
    devices = self._placement.replica_devices
    if devices is None:
      return (r, k)
    return devices[r][k]

  def _RunCell(
    self, k, theta_k, args, seed, collect=True, finish=None, fprop=None
  ):
    """Runs cell k; returns (outputs tuple, [(layer, stats)], raw outputs).

    With `finish` (the last cell with a loss), the outputs tuple is
    (finish(raw outputs, the loss's weights or None),), and raw the cell's
    own outputs.
    """
    loss_theta = None
    if isinstance(theta_k, _CellAndLoss):
      theta_k, loss_theta = theta_k
    collector = py_utils.UpdateCollector()
    with py_utils.StepSeed(seed), collector:
      out = (fprop or self._cell_fprop)(k, theta_k, args)
      raw = out
      if finish is not None:
        out = (finish(out, loss_theta),)
    return out, (collector.updates if collect else []), raw

  def _Recomputes(self, k, m, num_micro_batches):
    policy = self._recompute
    if policy == 'always':
      return True
    if policy == 'except_last_cell':
      return k != self._num_cells - 1
    if policy == 'except_last_micro_batch':
      return m != num_micro_batches - 1
    return False

  def Forward(self, thetas, args, num_mb, seed, train=False, walk=None):
    """The forward schedule of every replica.

    Args:
      thetas: [replica][cell] thetas, each on its device.
      args: the pipeline's inputs, batch along `batch_dim`.
      num_mb: micro-batches per replica M.
      seed: the step seed; micro-batch j runs with MixSeed(seed, j), so R
        replicas of M micro-batches compute what one pipeline of R*M does.
      train: keep gradient tapes for the cells that are not recomputed.
      walk: the `_Walk` to fill (what `Backward` continues from); None: a
        new one.

    Returns:
      (outputs, updates, the walk).
    """
    if walk is None:
      walk = _Walk(thetas, num_mb, None)
    walk.states = self._SplitInputs(args, len(thetas), num_mb)
    work = self._Pass(self.Work(num_mb), schedule_lib.FORWARD)
    for w, r, j in walk.Items(work):
      self._ForwardItem(walk, w, r, j, seed, train)
    with self._Device(self._num_cells - 1):
      outs = microbatch.Concat(
        [py_utils.Unwrap(s) for s in walk.states], self._batch_dim
      )
    return outs, walk.updates, walk

  def _SplitInputs(self, args, num_rep, num_mb):
    """[micro-batch j] -> tuple of its inputs, on its replica's device 0."""
    # Each replica's share goes from where the input is straight to the
    # replica's first device, not through replica 0's (one replica: no op).
    with graph_ops.DeviceOf(args):
      shards = microbatch.Split(args, num_rep, self._batch_dim)
    states = []
    for r, shard in enumerate(shards):
      with self._Device(0, r):
        states.extend(
          tuple(mb) for mb in microbatch.Split(shard, num_mb, self._batch_dim)
        )
    return states

  def _ForwardItem(self, walk, w, r, j, seed, train, finish=None):
    """Builds the forward of work item `w` on replica r (micro-batch j).

    Saves what the backward needs in walk.saved[(cell, j)], moves
    walk.states[j] on to the cell's outputs; returns the raw outputs (see
    `_RunCell`).
    """
    k, m = w.cell, w.micro_batch
    with self._Device(k, r):
      x = self._Place(walk.states[j], k)
      key = self._DeviceKey(k, r)
      if self._strict_order and key in walk.last_on_device:
        x = graph_ops.After(x, walk.last_on_device[key])
      start = None
      if walk.tracer is not None:
        start, x = graph_ops.Stamp(x)
      seed_m = py_utils.MixSeed(seed, j)
      theta_k = walk.thetas[r][k]
      tape = None
      if train and not self._Recomputes(k, m, walk.num_mb):
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
          tape.watch([t for t in tf.nest.flatten((theta_k, x)) if _IsFloat(t)])
          y, upd, raw = self._RunCell(k, theta_k, x, seed_m, finish=finish)
      else:
        y, upd, raw = self._RunCell(k, theta_k, x, seed_m, finish=finish)
      # The backward differentiates the tape's own outputs, not the placed
      # or stamped copies made after the tape stopped recording.
      y_taped = y
      y = self._Place(y, k)
      if walk.tracer is not None:
        end, y = graph_ops.Stamp(y)
        walk.tracer.Record(('forward', r * self._num_cells + k, j), start, end)
      walk.saved[(k, j)] = (x, tape, y_taped, seed_m, finish)
      walk.last_on_device[key] = y
    walk.updates.extend(upd)
    walk.states[j] = y
    return raw

  def ForwardWithGrad(self, thetas, args, num_mb, seed):
    """Runs the forward schedule and records it on the gradient tape as one
    operation whose gradient is the explicit backward schedule.

    `tf.custom_gradient` would pass every input, output and weight through
    one IdentityN op: a barrier with no device of its own, which in a
    multi-host pipeline drags all weights and activations through the host
    that builds the graph. Recording the operation on the tape directly
    (what tf.custom_gradient does inside) keeps every tensor on its cell's
    device.
    """
    flat_args = tf.nest.flatten(args)
    inputs = [x for x in flat_args if py_utils.IsTensor(x)]
    # Replica 0's weights: the other replicas' copies are made from them, and
    # their gradients are summed into replica 0's.
    flat_thetas = [t for th in thetas[0] for t in tf.nest.flatten(th)]
    keep_tapes = _tf_internal.CouldPossiblyRecord()
    walk = _Walk(
      thetas, num_mb, None, _tf_internal.ShouldRecordBackprop(inputs)
    )
    with _tf_internal.VariableWatcher() as watcher:
      outs, updates, _ = self.Forward(
        thetas, args, num_mb, seed, train=keep_tapes, walk=walk
      )
    self._CheckNoDirectReads(watcher)
    flat_out = tf.nest.flatten(outs)
    for x in flat_out:
      if not py_utils.IsTensor(x):
        raise ValueError(f'Pipeline outputs must be tensors; got {x!r}.')
    # New tensors whose producer on the tape is the pipeline operation.
    with self._Device(self._num_cells - 1):
      results = [tf.identity(t) for t in flat_out]
    if keep_tapes:

      def Backward(*dys):
        return self.Backward(args, outs, walk, dys)

      _tf_internal.RecordOperation(
        'GPipe', results, inputs + flat_thetas, Backward
      )
    for layer, stats in updates:
      py_utils.AddDeferredUpdate(
        layer, tf.nest.map_structure(tf.stop_gradient, stats)
      )
    return tf.nest.pack_sequence_as(outs, results)

  def _CheckNoDirectReads(self, watcher):
    direct = [v.name for v in watcher.watched_variables() if v.trainable]
    if direct:
      raise ValueError(
        f'A layer inside pipeline {self._name!r} read variables directly in '
        f'FProp ({direct}); layers must compute with the `theta` passed to '
        'FProp, or their gradients would be lost.'
      )

  def ForwardBackwardWithLoss(
    self,
    thetas,
    args,
    num_mb,
    seed,
    loss_fn,
    train=True,
    input_grads=True,
    loss_thetas=None,
  ):
    """Runs the whole schedule, forward and backward items in list order,
    with each micro-batch's loss computed on the last cell.

    Args:
      thetas: [replica][cell] thetas, each on its device.
      args: the pipeline's inputs, batch along `batch_dim`.
      num_mb: micro-batches per replica M.
      seed: the step seed (micro-batch j runs with MixSeed(seed, j)).
      loss_fn: fn(j, outputs tuple of the last cell on micro-batch j, the
        loss's weights or None) -> scalar, micro-batch j's share of the loss
        (the shares are summed).
      train: build the backward items; False: the forwards only.
      input_grads: compute the gradients of the inputs (see `Backward`).
      loss_thetas: None, or [replica] weights that loss_fn uses besides the
        cells' (e.g. a softmax outside the pipeline), each on its replica's
        last device; differentiated as part of the last cell.

    Returns:
      (loss, outputs of the last cell for the whole mini-batch, updates,
      gradients of [input tensors] + [flat thetas[0]] (the loss's weights
      after the last cell's) or None).
    """
    last = self._num_cells - 1
    if loss_thetas is not None:
      thetas = [
        th[:last] + [_CellAndLoss(th[last], lt)]
        for th, lt in zip(thetas, loss_thetas)
      ]
    work = self.Work(num_mb)
    if not train:
      work = self._Pass(work, schedule_lib.FORWARD)
    walk = _Walk(
      thetas,
      num_mb,
      self._SplitInputs(args, len(thetas), num_mb),
      input_grads,
    )
    losses, raws = {}, {}
    for w, r, j in walk.Items(work):
      if w.kind == schedule_lib.BACKWARD:
        if w.cell == last:
          with self._Device(w.cell, r):
            walk.grads[j] = (tf.ones_like(losses[j]),)
        self._BackwardItem(walk, w, r, j)
        continue
      finish = self._LossOf(j, loss_fn) if w.cell == last else None
      raw = self._ForwardItem(walk, w, r, j, seed, train, finish=finish)
      if finish is not None:
        losses[j] = walk.states[j][0]
        raws[j] = raw
    num_j = len(thetas) * num_mb
    with self._Device(last):
      parts = [losses[j] for j in range(num_j)]
      loss = parts[0] if len(parts) == 1 else tf.add_n(parts)
      outs = microbatch.Concat(
        [
          tf.nest.map_structure(tf.stop_gradient, py_utils.Unwrap(raws[j]))
          for j in range(num_j)
        ],
        self._batch_dim,
      )
    grads = self._JoinGradients(args, walk) if train else None
    return loss, outs, walk.updates, grads

  def _LossOf(self, j, loss_fn):
    def Finish(outputs, loss_theta):
      loss = tf.convert_to_tensor(
        loss_fn(j, py_utils.Unwrap(outputs), loss_theta)
      )
      if loss.shape.rank != 0 or not loss.dtype.is_floating:
        raise ValueError(
          f'The loss function of pipeline {self._name!r} returned '
          f'{loss.dtype.name} {loss.shape}; it must return a float scalar: '
          "the micro-batch's share of the loss."
        )
      return loss

    return Finish

  def WithLoss(self, thetas, args, num_mb, seed, loss_fn, loss_thetas=None):
    """`ForwardBackwardWithLoss`, recorded on the gradient tape as one
    operation from the inputs and weights (the cells', then the loss's) to
    the loss; returns (loss, outputs). Outside a gradient tape only the
    forwards (and losses) run."""
    flat_args = tf.nest.flatten(args)
    inputs = [x for x in flat_args if py_utils.IsTensor(x)]
    flat_thetas = [t for th in thetas[0] for t in tf.nest.flatten(th)]
    if loss_thetas is not None:
      flat_thetas += tf.nest.flatten(loss_thetas[0])
    train = _tf_internal.CouldPossiblyRecord()
    with _tf_internal.VariableWatcher() as watcher:
      loss, outs, updates, grads = self.ForwardBackwardWithLoss(
        thetas,
        args,
        num_mb,
        seed,
        loss_fn,
        train=train,
        input_grads=_tf_internal.ShouldRecordBackprop(inputs),
        loss_thetas=loss_thetas,
      )
    self._CheckNoDirectReads(watcher)
    with self._Device(self._num_cells - 1):
      result = tf.identity(loss)
    if train:
      sources = inputs + flat_thetas

      def Backward(dloss):
        out = []
        for g in grads:
          if g is None:
            out.append(None)
            continue
          with graph_ops.DeviceOf(g):
            out.append(g * tf.cast(dloss, g.dtype))
        return out

      _tf_internal.RecordOperation('GPipeWithLoss', [result], sources, Backward)
    for layer, stats in updates:
      py_utils.AddDeferredUpdate(
        layer, tf.nest.map_structure(tf.stop_gradient, stats)
      )
    return result, outs

  def Backward(self, inputs, outs, walk, dys):
    """The backward schedule after `Forward`'s `walk`; returns the gradients
    of (input tensors, thetas[0]).

    With strict_order each device's first backward item waits for the
    device's last forward output. Unless `walk.input_grads` (False when no
    gradient tape watches the pipeline's inputs, e.g. they come from the
    input pipeline), cell 0 skips the gradient of its input, and the inputs'
    gradients are None.
    """
    num_mb = walk.num_mb
    flat_outs = tf.nest.flatten(outs)
    dys = [
      tf.zeros_like(y) if dy is None else dy for y, dy in zip(flat_outs, dys)
    ]
    with self._Device(self._num_cells - 1):
      dy_mbs = microbatch.Split(
        tf.nest.pack_sequence_as(outs, dys),
        len(walk.thetas) * num_mb,
        self._batch_dim,
      )
    walk.grads = {j: py_utils.AsTuple(d) for j, d in enumerate(dy_mbs)}
    after, walk.last_on_device = walk.last_on_device, {}
    work = self._Pass(self.Work(num_mb), schedule_lib.BACKWARD)
    for w, r, j in walk.Items(work):
      key = self._DeviceKey(w.cell, r)
      if key not in walk.last_on_device and walk.saved[(w.cell, j)][1] is None:
        # A re-materialized cell needs nothing of the forward pass but its
        # input, so the device's first backward could start before its
        # last forward ended; a cell with a tape waits for it anyway.
        walk.last_on_device[key] = after.get(key)
      self._BackwardItem(walk, w, r, j)
    return self._JoinGradients(inputs, walk)

  def _BackwardItem(self, walk, w, r, j):
    """Builds the backward of work item `w` on replica r (micro-batch j)."""
    k = w.cell
    key = self._DeviceKey(k, r)
    with self._Device(k, r):
      new_dy, summed = self.CellBackward(
        k,
        walk.thetas[r][k],
        walk.saved[(k, j)],
        walk.grads[j],
        walk.last_on_device.get(key),
        walk.theta_acc[r][k],
        walk.tracer,
        ('backward', r * self._num_cells + k, j),
        input_grad=walk.input_grads or k > 0,
      )
      walk.grads[j] = new_dy
      walk.last_on_device[key] = (new_dy, summed)

  def _JoinGradients(self, inputs, walk):
    """[gradients of the input tensors] + [of thetas[0]], summed."""
    num_cells = self._num_cells
    num_rep = len(walk.thetas)
    num_mb, input_grads = walk.num_mb, walk.input_grads
    grads_state, theta_acc = walk.grads, walk.theta_acc
    # Gradients of the pipeline's inputs, joined on device 0.
    with self._Device(0):
      per_mb = [
        tf.nest.flatten(grads_state[j]) for j in range(num_rep * num_mb)
      ]
      flat_in = tf.nest.flatten(inputs)
      in_grads = []
      for i, x in enumerate(flat_in):
        if not py_utils.IsTensor(x):
          continue
        parts = [mb[i] for mb in per_mb]
        if (
          not input_grads
          or not x.dtype.is_floating
          or any(t is None for t in parts)
        ):
          in_grads.append(None)
        elif len(parts) == 1:
          in_grads.append(parts[0])
        elif x.shape.rank == 0:
          in_grads.append(tf.add_n(parts))
        else:
          in_grads.append(tf.concat(parts, axis=self._batch_dim))
    theta_grads = []
    for k in range(num_cells):
      for i in range(len(theta_acc[0][k])):
        partial = []
        for r in range(num_rep):
          with self._Device(k, r):
            g = graph_ops.SumGradients(theta_acc[r][k][i])
          if g is not None:
            partial.append(g)
        if len(partial) > 1:
          # The cross-replica sum, on the device of the variables.
          with self._Device(k):
            partial = [tf.add_n(partial)]
        theta_grads.append(partial[0] if partial else None)
    return in_grads + theta_grads

  def _RecomputeBackward(self, k, theta_k, x, seed, dy, finish):
    """`recompute_backward` of cell k on one micro-batch; returns (flat
    gradients of theta_k, of x). With `finish` (the last cell with a loss),
    the cell's outputs are recomputed to differentiate the loss, and their
    gradients go on to `recompute_backward`; the gradients of the loss's
    own weights (a `_CellAndLoss` theta) follow the cell's."""
    loss_theta, loss_g = None, []
    if isinstance(theta_k, _CellAndLoss):
      theta_k, loss_theta = theta_k
    if finish is not None:
      _, _, out = self._RunCell(k, theta_k, x, seed, collect=False)
      flat_out = tf.nest.flatten(out)
      floats = [t for t in flat_out if _IsFloat(t)]
      flat_lt = tf.nest.flatten(loss_theta)
      lt_floats = [t for t in flat_lt if _IsFloat(t)]
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(floats + lt_floats)
        loss = tf.nest.flatten(finish(out, loss_theta))
      pairs = [
        (a, b)
        for a, b in zip(loss, tf.nest.flatten(dy))
        if _IsFloat(a) and b is not None
      ]
      grads = iter(
        tape.gradient(
          [a for a, _ in pairs],
          floats + lt_floats,
          output_gradients=[b for _, b in pairs],
        )
        if pairs and floats + lt_floats
        else [None] * len(floats + lt_floats)
      )
      dy = tf.nest.pack_sequence_as(
        out, [next(grads) if _IsFloat(t) else None for t in flat_out]
      )
      loss_g = [next(grads) if _IsFloat(t) else None for t in flat_lt]
    with py_utils.StepSeed(seed), py_utils.UpdateCollector():
      th_g, x_g = self._recompute_backward(k, theta_k, x, dy)
    return tf.nest.flatten(th_g) + loss_g, tf.nest.flatten(x_g)

  def _SumsAsItGoes(self):
    """Whether each micro-batch's weight gradients are added to the running
    sum before the device's next backward starts (see `CellBackward`)."""
    return (
      self._strict_order
      and self._recompute_backward is not None
      and not tf.executing_eagerly()
    )

  def CellBackward(
    self,
    k,
    theta_k,
    saved,
    dy,
    after,
    theta_acc,
    tracer,
    trace_key,
    input_grad=True,
  ):
    """Back-propagates one micro-batch through cell k.

    Adds the weight gradients to the lists in `theta_acc`; returns (the
    gradient of the cell's input (zeros, without computing it, when
    `input_grad` is False), [running sums the device's next backward waits
    for]).

    A compiled cell (`recompute_backward`) returns all of its weight
    gradients at once, and with `strict_order` they are added to the
    running sum before the device's next backward starts: otherwise an
    executor with one thread ran every micro-batch's backward first and
    kept each one's weight gradients alive until the end.
    """
    x, tape, y, seed_m, finish = saved
    if self._strict_order and after is not None:
      dy = graph_ops.After(dy, after)
    start = None
    if tracer is not None:
      start, (dy, x_after) = graph_ops.Stamp((dy, x))
      if tape is None:
        x = x_after
    flat_th = tf.nest.flatten(theta_k)
    flat_x = tf.nest.flatten(x)
    sources_idx = [('t', i) for i, t in enumerate(flat_th) if _IsFloat(t)]
    if input_grad:
      sources_idx += [('x', i) for i, t in enumerate(flat_x) if _IsFloat(t)]
    if tape is None:  # Re-materialize: same inputs, same seed.
      # Fresh copies of the inputs and the seed, made once the output
      # gradient has arrived: otherwise the executor would recompute every
      # micro-batch right after the forward pass, and TensorFlow's graph
      # optimizer would merge the recomputation with the forward ops (common
      # subexpression elimination), keeping every forward activation alive
      # until the backward pass.
      x, seed_m = graph_ops.FreshCopies((x, seed_m), dy)
      flat_x = tf.nest.flatten(x)
    if tape is None and self._recompute_backward is not None:
      g = self._RecomputeBackward(k, theta_k, x, seed_m, dy, finish)
      g = [g[0][i] if w == 't' else g[1][i] for w, i in sources_idx]
    else:
      if tape is None:
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
          tape.watch(
            [
              t
              for t in tf.nest.flatten((theta_k, x) if input_grad else theta_k)
              if _IsFloat(t)
            ]
          )
          y, _, _ = self._RunCell(
            k, theta_k, x, seed_m, collect=False, finish=finish
          )
      pairs = [
        (a, b)
        for a, b in zip(tf.nest.flatten(y), tf.nest.flatten(dy))
        if _IsFloat(a) and b is not None
      ]
      sources = [flat_th[i] if w == 't' else flat_x[i] for w, i in sources_idx]
      if pairs and sources:
        g = tape.gradient(
          [a for a, _ in pairs],
          sources,
          output_gradients=[b for _, b in pairs],
        )
      else:
        g = [None] * len(sources)
    dx = [None] * len(flat_x)
    computed = [gi for gi in g if gi is not None]
    summed = []
    for (w, i), gi in zip(sources_idx, g):
      if w == 't':
        if gi is not None:
          acc = theta_acc[i]
          if acc is not None and self._SumsAsItGoes():
            # The running sum: the next micro-batch's backward on this
            # device waits for it (`summed`).
            theta_acc[i] = [graph_ops.SumGradients(acc + [gi])]
            summed.append(theta_acc[i][0])
          else:
            theta_acc[i] = [gi] if acc is None else acc + [gi]
      else:
        dx[i] = gi
    # An input without a gradient (integer ids, labels) gets a zero made
    # after this micro-batch's gradients: with strict_order the next
    # micro-batch on this device waits for it, so its re-materialization
    # cannot start while this one's activations are alive.
    for i, t in enumerate(flat_x):
      if dx[i] is None and py_utils.IsTensor(t):
        dx[i] = graph_ops.After(tf.zeros_like(t), computed)
    new_dy = self._Place(tf.nest.pack_sequence_as(x, dx), k)
    if tracer is not None:
      end, new_dy = graph_ops.Stamp(new_dy)
      tracer.Record(trace_key, start, end)
    return new_dy, summed
