"""The pipeline engine: runs a schedule of cell work items on their devices.

`PipelineEngine` knows nothing of Params or layers: it is given a function
that runs cell k on one micro-batch, a `placement.StagePlacement` and a
schedule, an ordered list of `schedule.WorkItem`s (clock, cell, micro-batch,
forward/backward; `schedule.FillDrain` by default). It builds

  * the forward ops of every FORWARD item, in list order, keeping what the
    backward pass needs (the cell's input, its gradient tape unless the cell
    is recomputed, its output and its seed);
  * one operation on the gradient tape whose gradient builds the BACKWARD
    items, in list order, each re-materializing its cell if it kept no tape.

With R data-parallel replicas, every work item runs on each replica's own
devices, replica r on micro-batches r*M .. r*M+M-1 of the mini-batch.
"""

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
    recompute_fprop: like `cell_fprop`, used for the re-materialization in
      the backward pass (e.g. a function whose gradient recomputes the cell
      and back-propagates in one compiled call); None: `cell_fprop`.
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
    recompute_fprop=None,
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
    self._recompute_fprop = recompute_fprop or cell_fprop

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

  def _RunCell(self, k, theta_k, args, seed, collect=True, fprop=None):
    """Runs cell k; returns (outputs tuple, [(layer, stats)])."""
    collector = py_utils.UpdateCollector()
    with py_utils.StepSeed(seed), collector:
      out = (fprop or self._cell_fprop)(k, theta_k, args)
    return out, (collector.updates if collect else [])

  def _Recomputes(self, k, m, num_micro_batches):
    policy = self._recompute
    if policy == 'always':
      return True
    if policy == 'except_last_cell':
      return k != self._num_cells - 1
    if policy == 'except_last_micro_batch':
      return m != num_micro_batches - 1
    return False

  def Forward(self, thetas, args, num_mb, seed, train=False):
    """The forward schedule of every replica.

    Args:
      thetas: [replica][cell] thetas, each on its device.
      args: the pipeline's inputs, batch along `batch_dim`.
      num_mb: micro-batches per replica M.
      seed: the step seed; micro-batch j runs with MixSeed(seed, j), so R
        replicas of M micro-batches compute what one pipeline of R*M does.
      train: keep gradient tapes for the cells that are not recomputed.

    Returns:
      (outputs, updates, saved contexts keyed by (cell, micro-batch)).
    """
    num_cells = self._num_cells
    num_rep = len(thetas)
    work = self._Pass(self.Work(num_mb), schedule_lib.FORWARD)
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
    tracer = schedule_lib.ActiveTracer()
    saved, updates = {}, []
    last_on_device = {}
    for w in work:
      k, m = w.cell, w.micro_batch
      for r in range(num_rep):
        j = r * num_mb + m
        with self._Device(k, r):
          x = self._Place(states[j], k)
          if self._strict_order and (r, k) in last_on_device:
            x = graph_ops.After(x, last_on_device[(r, k)])
          start = None
          if tracer is not None:
            start, x = graph_ops.Stamp(x)
          seed_m = py_utils.MixSeed(seed, j)
          tape = None
          if train and not self._Recomputes(k, m, num_mb):
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
              tape.watch(
                [t for t in tf.nest.flatten((thetas[r][k], x)) if _IsFloat(t)]
              )
              y, upd = self._RunCell(k, thetas[r][k], x, seed_m)
          else:
            y, upd = self._RunCell(k, thetas[r][k], x, seed_m)
          y = self._Place(y, k)
          if tracer is not None:
            end, y = graph_ops.Stamp(y)
            tracer.Record(('forward', r * num_cells + k, j), start, end)
          saved[(k, j)] = (x, tape, y, seed_m)
          updates.extend(upd)
          states[j] = y
          last_on_device[(r, k)] = y
    with self._Device(num_cells - 1):
      outs = microbatch.Concat(
        [py_utils.Unwrap(s) for s in states], self._batch_dim
      )
    return outs, updates, saved

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
    with _tf_internal.VariableWatcher() as watcher:
      outs, updates, saved = self.Forward(
        thetas, args, num_mb, seed, train=keep_tapes
      )
    direct = [v.name for v in watcher.watched_variables() if v.trainable]
    if direct:
      raise ValueError(
        f'A layer inside pipeline {self._name!r} read variables directly in '
        f'FProp ({direct}); layers must compute with the `theta` passed to '
        'FProp, or their gradients would be lost.'
      )
    flat_out = tf.nest.flatten(outs)
    for x in flat_out:
      if not py_utils.IsTensor(x):
        raise ValueError(f'Pipeline outputs must be tensors; got {x!r}.')
    # New tensors whose producer on the tape is the pipeline operation.
    with self._Device(self._num_cells - 1):
      results = [tf.identity(t) for t in flat_out]
    if keep_tapes:

      def Backward(*dys):
        return self.Backward(thetas, args, outs, saved, dys, num_mb)

      _tf_internal.RecordOperation(
        'GPipe', results, inputs + flat_thetas, Backward
      )
    for layer, stats in updates:
      py_utils.AddDeferredUpdate(
        layer, tf.nest.map_structure(tf.stop_gradient, stats)
      )
    return tf.nest.pack_sequence_as(outs, results)

  def Backward(self, thetas, inputs, outs, saved, dys, num_mb):
    """The backward schedule; returns grads of (input tensors, thetas[0])."""
    num_cells = self._num_cells
    num_rep = len(thetas)
    work = self._Pass(self.Work(num_mb), schedule_lib.BACKWARD)
    tracer = schedule_lib.ActiveTracer()
    flat_outs = tf.nest.flatten(outs)
    dys = [
      tf.zeros_like(y) if dy is None else dy for y, dy in zip(flat_outs, dys)
    ]
    with self._Device(num_cells - 1):
      dy_mbs = [
        py_utils.AsTuple(d)
        for d in microbatch.Split(
          tf.nest.pack_sequence_as(outs, dys), num_rep * num_mb, self._batch_dim
        )
      ]
    grads_state = dict(enumerate(dy_mbs))
    # theta_acc[r][k][i]: the gradients of replica r's micro-batches for the
    # i-th weight of cell k.
    theta_acc = [
      [[None] * len(tf.nest.flatten(th)) for th in thetas[r]]
      for r in range(num_rep)
    ]
    last_on_device = {}
    for w in work:
      k, m = w.cell, w.micro_batch
      for r in range(num_rep):
        j = r * num_mb + m
        with self._Device(k, r):
          new_dy = self.CellBackward(
            k,
            thetas[r][k],
            saved[(k, j)],
            grads_state[j],
            last_on_device.get((r, k)),
            theta_acc[r][k],
            tracer,
            ('backward', r * num_cells + k, j),
          )
          grads_state[j] = new_dy
          last_on_device[(r, k)] = new_dy
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
        if not x.dtype.is_floating or any(t is None for t in parts):
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

  def CellBackward(
    self, k, theta_k, saved, dy, after, theta_acc, tracer, trace_key
  ):
    """Back-propagates one micro-batch through cell k.

    Adds the weight gradients to the lists in `theta_acc`; returns the
    gradient of the cell's input.
    """
    x, tape, y, seed_m = saved
    if self._strict_order and after is not None:
      dy = graph_ops.After(dy, after)
    start = None
    if tracer is not None:
      start, (dy, x_after) = graph_ops.Stamp((dy, x))
      if tape is None:
        x = x_after
    if tape is None:  # Re-materialize: same inputs, same seed.
      # Fresh copies of the inputs and the seed, made once the output
      # gradient has arrived: otherwise the executor would recompute every
      # micro-batch right after the forward pass, and TensorFlow's graph
      # optimizer would merge the recomputation with the forward ops (common
      # subexpression elimination), keeping every forward activation alive
      # until the backward pass.
      x, seed_m = graph_ops.FreshCopies((x, seed_m), dy)
      tape = tf.GradientTape(watch_accessed_variables=False)
      with tape:
        tape.watch([t for t in tf.nest.flatten((theta_k, x)) if _IsFloat(t)])
        y, _ = self._RunCell(
          k, theta_k, x, seed_m, collect=False, fprop=self._recompute_fprop
        )
    flat_y, flat_dy = tf.nest.flatten(y), tf.nest.flatten(dy)
    pairs = [
      (a, b) for a, b in zip(flat_y, flat_dy) if _IsFloat(a) and b is not None
    ]
    flat_th = tf.nest.flatten(theta_k)
    flat_x = tf.nest.flatten(x)
    sources_idx = [('t', i) for i, t in enumerate(flat_th) if _IsFloat(t)]
    sources_idx += [('x', i) for i, t in enumerate(flat_x) if _IsFloat(t)]
    sources = [flat_th[i] if w == 't' else flat_x[i] for w, i in sources_idx]
    if pairs and sources:
      g = tape.gradient(
        [a for a, _ in pairs], sources, output_gradients=[b for _, b in pairs]
      )
    else:
      g = [None] * len(sources)
    dx = [None] * len(flat_x)
    computed = [gi for gi in g if gi is not None]
    for (w, i), gi in zip(sources_idx, g):
      if w == 't':
        if gi is not None:
          acc = theta_acc[i]
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
    return new_dy
