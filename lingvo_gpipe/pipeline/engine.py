"""The pipeline engine: runs a schedule of cell work items on their devices.

`PipelineEngine` knows nothing of Params or layers: it is given the cells as
functions (`cell_function.CellFunctions`: each cell traced once, called once
per work item), a `placement.StagePlacement` and a schedule, an ordered list
of `schedule.WorkItem`s (clock, cell, micro-batch, forward/backward;
`schedule.FillDrain` by default). Its entry points (`Evaluate`,
`ForwardWithGrad`, `WithLoss`) take the whole mini-batch and each cell's
weights: the engine finds the replicas R and micro-batches M for the batch
(`Splits`), reads the weights once per step onto each replica's devices,
splits the batch, and joins the outputs. It builds

  * one call of the cell's forward function for every FORWARD item, in list
    order, keeping what the backward pass needs (the cell's input, its
    gradient tape unless the cell is recomputed, its output and its seed);
  * one operation on the gradient tape whose gradient builds the BACKWARD
    items, in list order: one call of the cell's recompute-and-backward
    function each (the gradient of the forward call where the cell kept its
    tape), which also adds the weights' gradients to their running sums.

So the step's graph holds each cell's ops once per pass, and a few ops per
work item: its size does not grow with the number of micro-batches.

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

With `loop=True` (Params `micro_batch_loop`) the fill-drain schedule with
re-materialization is built instead as two loops over its clock ticks, each
calling every cell once (`clock_loop.ClockLoops`): the same numbers, a
step whose build does not grow with M.
"""

import contextlib

from absl import logging
import tensorflow as tf

from lingvo_gpipe.cells import cell_function
from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import graph_ops
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import clock_loop
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import schedule as schedule_lib

__all__ = ['PipelineEngine', 'RECOMPUTE_POLICIES', 'CheckSchedule']

RECOMPUTE_POLICIES = (
  'always',
  'except_last_cell',
  'except_last_micro_batch',
  'never',
)


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


class _Saved:
  """What a forward work item keeps for its backward.

  Attributes:
    x: the cell's inputs (a tuple).
    tape: the gradient tape of the forward call, or None where the backward
      re-materializes the cell.
    y: the outputs the tape recorded (the cell's, or (loss,) with `loss`).
    seed: the micro-batch's step seed.
    loss: the `cell_function.Loss` computed on the last cell, or None.
  """

  __slots__ = ('x', 'tape', 'y', 'seed', 'loss')

  def __init__(self, x, tape, y, seed, loss):
    self.x, self.tape, self.y, self.seed, self.loss = x, tape, y, seed, loss


class _Walk:
  """One walk over a schedule: what its work items hand each other.

  Attributes:
    thetas: [replica][cell] thetas, each on its device.
    loss_thetas: [replica] weights of the loss on the last cell, or None.
    num_mb: micro-batches per replica M.
    states: [micro-batch j] -> the forward inputs of j's next cell.
    grads: {micro-batch j: the gradient flowing back into j's next cell}.
    saved: {(cell, j): _Saved}, what a forward item keeps for its backward.
    sums: [replica][cell]: the running sum of each weight's gradients over
      the micro-batches done so far (the cell's weights, flattened, then on
      the last cell the loss's), None before the first.
    seeds: {(j, device key): micro-batch j's step seed on that device}.
    last_on_device: {device key: the output of its last item}, what the
      device's next item waits for with `strict_order`.
    updates: [(layer, stats)] collected by the forward items.
    input_grads: compute the gradients of the pipeline's inputs.
    tracer: the active `schedule.ScheduleTracer`, or None.
  """

  def __init__(
    self, thetas, num_mb, states, input_grads=True, loss_thetas=None
  ):
    self.thetas = thetas
    self.loss_thetas = loss_thetas
    self.num_mb = num_mb
    self.states = states
    self.grads = {}
    self.saved = {}
    last = len(thetas[0]) - 1
    self.sums = []
    for r, thetas_r in enumerate(thetas):
      sums_r = []
      for k, th in enumerate(thetas_r):
        n = len(tf.nest.flatten(th))
        if k == last and loss_thetas is not None:
          n += len(tf.nest.flatten(loss_thetas[r]))
        sums_r.append([None] * n)
      self.sums.append(sums_r)
    self.seeds = {}
    self.last_on_device = {}
    self.updates = []
    self.input_grads = input_grads
    self.tracer = schedule_lib.ActiveTracer()
    self.run = None  # The forward loop's `clock_loop._Run`, if it ran.

  def Items(self, work):
    """Yields (item, replica r, micro-batch j of the mini-batch)."""
    for w in work:
      for r in range(len(self.thetas)):
        yield w, r, r * self.num_mb + w.micro_batch


# Item by item, TensorFlow's first call of the step builds the body of each
# cell's function again at every call op (its reference-variable search,
# docs/gpipe.md): from this many work items x layers per cell (a 64-layer
# pipeline-8 step of 32 micro-batches, whose first step took 33 s item by
# item and 13 s as loops on a 2-core host), a pipeline that could run as
# loops says so, once.
LOOP_HINT_LAYER_CALLS = 4096
_hinted = set()  # The pipelines that said so.


class PipelineEngine:
  """Builds the forward and backward calls of a pipeline of cells.

  Args:
    cells: a `cell_function.CellFunctions`, the cells as functions.
    placement: a `placement.StagePlacement` of the cells' devices.
    num_cells: K.
    batch_dim: the batch axis of inputs and outputs.
    recompute: one of RECOMPUTE_POLICIES.
    strict_order: run each device's work items in schedule order.
    name: the pipeline's name in error messages.
    schedule: fn(num_cells, num_micro_batches) -> [schedule.WorkItem].
    loop: build the fill-drain schedule as loops over its clock ticks
      (`clock_loop`) where it applies; False: always one call per work item.
    num_replicas: data-parallel replicas R, each on its own devices.
    num_micro_batches: micro-batches per replica M.
    micro_batch_size: examples per micro-batch; when set, M = the replica's
      batch / this.
  """

  def __init__(
    self,
    cells,
    placement,
    num_cells,
    batch_dim=0,
    recompute='always',
    strict_order=True,
    name='pipeline',
    schedule=schedule_lib.FillDrain,
    loop=False,
    num_replicas=1,
    num_micro_batches=1,
    micro_batch_size=None,
  ):
    if recompute not in RECOMPUTE_POLICIES:
      raise ValueError(
        f'recompute={recompute!r}; use one of {RECOMPUTE_POLICIES}.'
      )
    self._cells = cells
    self._placement = placement
    self._num_cells = num_cells
    self._batch_dim = batch_dim
    self._recompute = recompute
    self._strict_order = strict_order
    self._name = name
    self._schedule = schedule
    self._loop = loop
    self._num_replicas = num_replicas
    self._num_micro_batches = num_micro_batches
    self._micro_batch_size = micro_batch_size

  # -- The mini-batch ----------------------------------------------------------

  def Splits(self, batch, lenient=False):
    """(replicas R, micro-batches per replica M) for a mini-batch of `batch`
    examples (None: not known when the step is built).

    A batch they do not divide is a ValueError naming the pipeline. With
    `lenient` (evaluation and inference: no gradients, so nothing to
    pipeline for memory) such a batch, or one of unknown size (an exported
    model), runs as one micro-batch on replica 0 instead.
    """
    if lenient and batch is None:
      return 1, 1
    try:
      return self._Splits(batch)
    except ValueError as e:
      if lenient:
        return 1, 1
      raise ValueError(f'Pipeline {self._name!r}: {e}') from e

  def _Splits(self, batch):
    r = self._num_replicas
    if r == 1:
      return 1, microbatch.NumMicroBatches(
        batch, self._num_micro_batches, self._micro_batch_size
      )
    if batch is not None and batch % r:
      raise ValueError(
        f'num_replicas={r} does not divide the batch size {batch} of '
        f'pipeline {self._name!r}; use a batch size that is a multiple of '
        f'{r}.'
      )
    per_replica = None if batch is None else batch // r
    try:
      m = microbatch.NumMicroBatches(
        per_replica, self._num_micro_batches, self._micro_batch_size
      )
    except ValueError as e:
      raise ValueError(
        f'{e} (The batch of {batch} is split over {r} '
        f'replicas: {per_replica} each.)'
      ) from e
    return r, m

  def _Start(self, cell_thetas, args, lenient, loss_theta=None):
    """The step's weights and M for the mini-batch `args`: (thetas
    [replica][cell], each cell's weights read once per step onto each
    replica's device; M; the loss's weights [replica] on each replica's last
    device, or None)."""
    batch = microbatch.BatchSize(args, self._batch_dim)
    num_rep, num_mb = self.Splits(batch, lenient)
    per_cell = [
      self._Read(cell_thetas[k], k, num_rep) for k in range(self._num_cells)
    ]
    thetas = [[reads[r] for reads in per_cell] for r in range(num_rep)]
    loss_thetas = None
    if loss_theta is not None:
      loss_thetas = self._Read(loss_theta, self._num_cells - 1, num_rep)
    return thetas, num_mb, loss_thetas

  def _Read(self, structure, k, num_rep):
    """[replica r] `structure` read onto cell k's device of replica r:
    replica 0's copy placed as cell k is, the others' read from it."""
    with self._Device(k):
      first = self._Place(tf.nest.map_structure(tf.identity, structure), k)
    reads = [first]
    for r in range(1, num_rep):
      with self._Device(k, r):
        reads.append(tf.nest.map_structure(tf.identity, first))
    return reads

  def Work(self, num_micro_batches):
    """The checked schedule: [WorkItem] of both passes."""
    work = list(self._schedule(self._num_cells, num_micro_batches))
    CheckSchedule(work, self._num_cells, num_micro_batches)
    return work

  def Loops(self, num_micro_batches):
    """A `clock_loop.ClockLoops` where it builds this step, else None."""
    if not self._loop:
      self._HintLoops(num_micro_batches)
      return None
    if clock_loop.ClockLoops.Applies(self, num_micro_batches):
      return clock_loop.ClockLoops(self)
    return None

  def _HintLoops(self, num_micro_batches):
    """Points out the loops, once per pipeline, where the step built item
    by item would make TensorFlow's first call slow."""
    if self._name in _hinted:
      return
    # The loops build the fill-drain schedule: 2 K M work items.
    items = 2 * self._num_cells * num_micro_batches
    layers = max(self._cells.NumLayers(k) for k in range(self._num_cells))
    if items * layers < LOOP_HINT_LAYER_CALLS or not (
      clock_loop.ClockLoops.Applies(self, num_micro_batches)
    ):
      return
    _hinted.add(self._name)
    logging.info(
      'Pipeline %r: %d work items of cells of up to %d layers, one call '
      "each: TensorFlow's first call of the step builds each cell's layers "
      'again at every call, about %d layer bodies (docs/gpipe.md). '
      'micro_batch_loop=True builds this schedule as two loops whose first '
      'call does not grow with the micro-batches, for a slower steady step.',
      self._name,
      items,
      layers,
      items * layers,
    )

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

  def _Recomputes(self, k, m, num_micro_batches):
    policy = self._recompute
    if policy == 'always':
      return True
    if policy == 'except_last_cell':
      return k != self._num_cells - 1
    if policy == 'except_last_micro_batch':
      return m != num_micro_batches - 1
    return False

  def _Order(self, walk, x, previous):
    """With `strict_order`: (x, control dependencies of the call) so that
    the call on `x` runs after `previous`, the device's previous item.

    The call itself waits where cells are function calls: identities of its
    inputs that wait would be hoisted above the split of the mini-batch by
    the graph optimizer (all the split's outputs then feed the same kind of
    op), which makes the split wait for the calls that consume it: a cycle,
    and the step's graph is left unoptimized. Inline cells and traced steps
    (whose timestamps must see the wait) wait on their inputs instead.
    """
    if self._cells.Inline() or walk.tracer is not None:
      return graph_ops.After(x, previous), None
    return x, previous

  def _Seed(self, walk, seed, j, key):
    """Micro-batch j's step seed, py_utils.MixSeed(seed, j), made once per
    (j, device) from the step seed scaled once per device."""
    if (j, key) not in walk.seeds:
      if 'step' not in walk.seeds:
        walk.seeds['step'] = graph_ops.Opaque(tf.cast(seed, tf.int64))
      if (None, key) not in walk.seeds:
        walk.seeds[(None, key)] = walk.seeds['step'] * 1000003
      walk.seeds[(j, key)] = tf.bitwise.bitwise_xor(
        walk.seeds[(None, key)],
        tf.constant(py_utils.StableHash('mix', j), tf.int64),
      )
    return walk.seeds[(j, key)]

  # -- The forward pass --------------------------------------------------------

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
    # Outside the pipeline's own tape operation (evaluation), a tape
    # differentiates the forward calls themselves: not through a loop.
    loops = None
    if walk is not None or not _tf_internal.CouldPossiblyRecord():
      loops = self.Loops(num_mb)
    run = None if loops is None else loops.Forward(thetas, args, num_mb, seed)
    if run is not None:
      with self._Device(self._num_cells - 1):
        outs = microbatch.Concat(
          [py_utils.Unwrap(y) for y in run.raws], self._batch_dim
        )
      if walk is not None:
        walk.run = run
      return outs, run.updates, walk
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
      shards = microbatch.Split(
        graph_ops.Opaque(args), num_rep, self._batch_dim
      )
    states = []
    for r, shard in enumerate(shards):
      with self._Device(0, r):
        states.extend(
          tuple(mb) for mb in microbatch.Split(shard, num_mb, self._batch_dim)
        )
    return states

  def _ForwardItem(self, walk, w, r, j, seed, train, loss=None):
    """Builds the forward of work item `w` on replica r (micro-batch j).

    Saves what the backward needs in walk.saved[(cell, j)], moves
    walk.states[j] on to the cell's outputs ((loss,) with `loss`, the
    micro-batch's `cell_function.Loss` on the last cell); returns the
    cell's own outputs.
    """
    k, m = w.cell, w.micro_batch
    with self._Device(k, r):
      x = self._Place(walk.states[j], k)
      key = self._DeviceKey(k, r)
      after = None
      if self._strict_order and key in walk.last_on_device:
        x, after = self._Order(walk, x, walk.last_on_device[key])
      start = None
      if walk.tracer is not None:
        start, x = graph_ops.Stamp(x)
      seed_m = self._Seed(walk, seed, j, key)
      theta_k = walk.thetas[r][k]
      tape = None
      if train and not self._Recomputes(k, m, walk.num_mb):
        raw, loss_value, upd, tape = self._cells.TapedForward(
          k, theta_k, x, seed_m, loss, after=after
        )
      else:
        # The pipeline's own tape operation differentiates this item (its
        # backward is a call of its own): the forward call need not be
        # recorded, and a recorded call would run its layers inline.
        with (
          _tf_internal.StopRecording() if train else contextlib.nullcontext()
        ):
          raw, loss_value, upd = self._cells.Forward(
            k, theta_k, x, seed_m, loss, after=after
          )
      y = raw if loss is None else (loss_value,)
      # The backward differentiates the tape's own outputs, not the placed
      # or stamped copies made after the tape stopped recording.
      y_taped = y
      y = self._Place(y, k)
      if walk.tracer is not None:
        end, y = graph_ops.Stamp(y)
        walk.tracer.Record(('forward', r * self._num_cells + k, j), start, end)
      walk.saved[(k, j)] = _Saved(x, tape, y_taped, seed_m, loss)
      walk.last_on_device[key] = y
    walk.updates.extend(upd)
    walk.states[j] = y
    return raw

  # -- The tape ----------------------------------------------------------------

  def _Record(self, op_type, args, thetas, loss_thetas, build):
    """Runs build(input_grads) -> (results, updates, backward) and records
    it on the gradient tape as one operation from the pipeline's input
    tensors and replica 0's weights (the cells', then the loss's) to the
    `results` tensors, with gradient function `backward` (None: nothing
    records). Checks that no layer read a variable directly; hands the
    updates to the enclosing collector."""
    inputs = [x for x in tf.nest.flatten(args) if py_utils.IsTensor(x)]
    # Replica 0's weights: the other replicas' copies are made from them, and
    # their gradients are summed into replica 0's.
    sources = inputs + [t for th in thetas[0] for t in tf.nest.flatten(th)]
    if loss_thetas is not None:
      sources += tf.nest.flatten(loss_thetas[0])
    with _tf_internal.VariableWatcher() as watcher:
      results, updates, backward = build(
        _tf_internal.ShouldRecordBackprop(inputs)
      )
    direct = [v.name for v in watcher.watched_variables() if v.trainable]
    if direct:
      raise ValueError(
        f'A layer inside pipeline {self._name!r} read variables directly in '
        f'FProp ({direct}); layers must compute with the `theta` passed to '
        'FProp, or their gradients would be lost.'
      )
    if backward is not None:
      _tf_internal.RecordOperation(op_type, results, sources, backward)
    for layer, stats in updates:
      # Statistics of calls no tape recorded need no StopGradient (one op
      # per statistic per micro-batch: most of a batch-normalized model's
      # step graph).
      flat = [t for t in tf.nest.flatten(stats) if py_utils.IsTensor(t)]
      if _tf_internal.ShouldRecordBackprop(flat):
        stats = tf.nest.map_structure(tf.stop_gradient, stats)
      py_utils.AddDeferredUpdate(layer, stats)

  def Evaluate(self, cell_thetas, args, seed):
    """The forward schedule on the mini-batch `args` (a batch that R and M
    do not divide runs as one micro-batch, see `Splits`); returns the
    outputs. `cell_thetas`: [cell] each cell's weights."""
    thetas, num_mb, _ = self._Start(cell_thetas, args, lenient=True)
    outs, _, _ = self.Forward(thetas, args, num_mb, seed, train=False)
    return outs

  def ForwardWithGrad(self, cell_thetas, args, seed):
    """Runs the forward schedule and records it on the gradient tape as one
    operation whose gradient is the explicit backward schedule.

    `tf.custom_gradient` would pass every input, output and weight through
    one IdentityN op: a barrier with no device of its own, which in a
    multi-host pipeline drags all weights and activations through the host
    that builds the graph. Recording the operation on the tape directly
    (what tf.custom_gradient does inside) keeps every tensor on its cell's
    device.
    """
    thetas, num_mb, _ = self._Start(cell_thetas, args, lenient=False)
    keep_tapes = _tf_internal.CouldPossiblyRecord()
    got = {}

    def Build(input_grads):
      walk = _Walk(thetas, num_mb, None, input_grads)
      outs, updates, _ = self.Forward(
        thetas, args, num_mb, seed, train=keep_tapes, walk=walk
      )
      flat_out = tf.nest.flatten(outs)
      for x in flat_out:
        if not py_utils.IsTensor(x):
          raise ValueError(f'Pipeline outputs must be tensors; got {x!r}.')
      # New tensors whose producer on the tape is the pipeline operation.
      with self._Device(self._num_cells - 1):
        results = [tf.identity(t) for t in flat_out]
      got['outs'], got['results'] = outs, results

      def Backward(*dys):
        return self.Backward(args, outs, walk, dys)

      return results, updates, (Backward if keep_tapes else None)

    self._Record('GPipe', args, thetas, None, Build)
    return tf.nest.pack_sequence_as(got['outs'], got['results'])

  def WithLoss(
    self,
    cell_thetas,
    args,
    seed,
    loss_fn,
    loss_inputs=None,
    loss_theta=None,
    lenient=False,
  ):
    """`ForwardBackwardWithLoss` on the mini-batch `args`, recorded on the
    gradient tape as one operation from the inputs and weights (the cells',
    then the loss's) to the loss; returns (loss, outputs). Outside a
    gradient tape only the forwards (and losses) run. `cell_thetas`: [cell]
    each cell's weights; `loss_theta`: the loss's, or None; `lenient`: see
    `Splits`."""
    thetas, num_mb, loss_thetas = self._Start(
      cell_thetas, args, lenient, loss_theta
    )
    train = _tf_internal.CouldPossiblyRecord()
    got = {}

    def Build(input_grads):
      loss, outs, updates, grads = self.ForwardBackwardWithLoss(
        thetas,
        args,
        num_mb,
        seed,
        loss_fn,
        train=train,
        input_grads=input_grads,
        loss_inputs=loss_inputs,
        loss_thetas=loss_thetas,
      )
      with self._Device(self._num_cells - 1):
        result = tf.identity(loss)
      got['result'], got['outs'] = result, outs

      def Backward(dloss):
        out = []
        for g in grads:
          if g is None:
            out.append(None)
            continue
          with graph_ops.DeviceOf(g):
            out.append(g * tf.cast(dloss, g.dtype))
        return out

      return [result], updates, (Backward if train else None)

    self._Record('GPipeWithLoss', args, thetas, loss_thetas, Build)
    return got['result'], got['outs']

  def ForwardBackwardWithLoss(
    self,
    thetas,
    args,
    num_mb,
    seed,
    loss_fn,
    train=True,
    input_grads=True,
    loss_inputs=None,
    loss_thetas=None,
  ):
    """Runs the whole schedule, forward and backward items in list order,
    with each micro-batch's loss computed on the last cell.

    Args:
      thetas: [replica][cell] thetas, each on its device.
      args: the pipeline's inputs, batch along `batch_dim`.
      num_mb: micro-batches per replica M.
      seed: the step seed (micro-batch j runs with MixSeed(seed, j)).
      loss_fn: fn(outputs of the last cell on one micro-batch, that
        micro-batch's loss inputs or None, the loss's weights or None) ->
        scalar, the micro-batch's share of the loss (the shares are summed).
        It is traced once into the last cell's functions, so it must take
        what differs between micro-batches from its arguments.
      train: build the backward items; False: the forwards only.
      input_grads: compute the gradients of the inputs (see `Backward`).
      loss_inputs: None, or a structure of tensors with the batch along
        `batch_dim` (labels, weights), split into micro-batches on the last
        device like the inputs.
      loss_thetas: None, or [replica] weights that loss_fn uses besides the
        cells' (e.g. a softmax outside the pipeline), each on its replica's
        last device; differentiated as part of the last cell.

    Returns:
      (loss, outputs of the last cell for the whole mini-batch, updates,
      gradients of [input tensors] + [flat thetas[0]] (the loss's weights
      after the last cell's) or None).
    """
    loops = self.Loops(num_mb)
    run = None
    if loops is not None:
      run = loops.Forward(
        thetas, args, num_mb, seed, loss_fn, loss_inputs, loss_thetas
      )
    if run is not None:
      return self._LoopWithLoss(
        run, thetas, args, num_mb, train, input_grads, loss_thetas
      )
    last = self._num_cells - 1
    num_j = len(thetas) * num_mb
    loss_mbs = [None] * num_j
    if loss_inputs is not None:
      with self._Device(last):
        loss_mbs = microbatch.Split(
          graph_ops.Opaque(loss_inputs), num_j, self._batch_dim
        )
    work = self.Work(num_mb)
    if not train:
      work = self._Pass(work, schedule_lib.FORWARD)
    walk = _Walk(
      thetas,
      num_mb,
      self._SplitInputs(args, len(thetas), num_mb),
      input_grads,
      loss_thetas,
    )
    losses, raws = {}, {}
    for w, r, j in walk.Items(work):
      if w.kind == schedule_lib.BACKWARD:
        if w.cell == last:
          with self._Device(w.cell, r):
            # Opaque: a constant input would make the graph optimizer copy
            # the cell's function for this call.
            walk.grads[j] = (graph_ops.Opaque(tf.ones_like(losses[j])),)
        self._BackwardItem(walk, w, r, j)
        continue
      loss = None
      if w.cell == last:
        loss = cell_function.Loss(
          loss_fn,
          loss_mbs[j],
          None if loss_thetas is None else loss_thetas[r],
        )
      raw = self._ForwardItem(walk, w, r, j, seed, train, loss=loss)
      if loss is not None:
        losses[j] = walk.states[j][0]
        raws[j] = raw
    loss, outs = self._JoinLosses(
      [losses[j] for j in range(num_j)], [raws[j] for j in range(num_j)]
    )
    grads = self._JoinGradients(args, walk) if train else None
    return loss, outs, walk.updates, grads

  def _JoinLosses(self, losses, raws):
    """(the summed loss, the last cell's outputs for the whole mini-batch,
    without gradient) from those of every micro-batch, on the last device."""
    with self._Device(self._num_cells - 1):
      loss = losses[0] if len(losses) == 1 else tf.add_n(losses)
      outs = microbatch.Concat(
        [
          tf.nest.map_structure(tf.stop_gradient, py_utils.Unwrap(y))
          for y in raws
        ],
        self._batch_dim,
      )
    return loss, outs

  def _LoopWithLoss(
    self, run, thetas, args, num_mb, train, input_grads, loss_thetas
  ):
    """`ForwardBackwardWithLoss` after the forward loop `run`."""
    loss, outs = self._JoinLosses(run.losses, run.raws)
    grads = None
    if train:
      walk = _Walk(thetas, num_mb, None, input_grads, loss_thetas)
      walk.run = run
      grads = self._LoopBackward(args, walk)
    return loss, outs, run.updates, grads

  # -- The backward pass -------------------------------------------------------

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
    if walk.run is not None:
      return self._LoopBackward(
        inputs, walk, tf.nest.pack_sequence_as(outs, dys)
      )
    with self._Device(self._num_cells - 1):
      dy_mbs = microbatch.Split(
        graph_ops.Opaque(tf.nest.pack_sequence_as(outs, dys)),
        len(walk.thetas) * num_mb,
        self._batch_dim,
      )
    walk.grads = {j: py_utils.AsTuple(d) for j, d in enumerate(dy_mbs)}
    after, walk.last_on_device = walk.last_on_device, {}
    work = self._Pass(self.Work(num_mb), schedule_lib.BACKWARD)
    for w, r, j in walk.Items(work):
      key = self._DeviceKey(w.cell, r)
      if (
        key not in walk.last_on_device and walk.saved[(w.cell, j)].tape is None
      ):
        # A re-materialized cell needs nothing of the forward pass but its
        # input, so the device's first backward could start before its
        # last forward ended; a cell with a tape waits for it anyway.
        walk.last_on_device[key] = after.get(key)
      self._BackwardItem(walk, w, r, j)
    return self._JoinGradients(inputs, walk)

  def _LoopBackward(self, inputs, walk, dys=None):
    """The backward loop after the forward loop `walk.run`, for the
    gradients `dys` of the pipeline's outputs (None: of the summed loss);
    returns the gradients of (input tensors, thetas[0]), as `Backward`
    does."""
    stacked = None
    if dys is not None:
      with self._Device(self._num_cells - 1):
        shards = microbatch.Split(
          graph_ops.Opaque(dys), len(walk.thetas), self._batch_dim
        )
        stacked = [
          clock_loop.Stacked(s, walk.num_mb, self._batch_dim) for s in shards
        ]
    loops = clock_loop.ClockLoops(self)
    walk.grads, walk.sums = loops.Backward(
      walk.run, walk.thetas, stacked, walk.input_grads
    )
    return self._JoinGradients(inputs, walk)

  def _BackwardItem(self, walk, w, r, j):
    """Builds the backward of work item `w` on replica r (micro-batch j):
    moves walk.grads[j] on to the gradient of the cell's inputs and adds
    the weights' gradients to walk.sums[r][cell]."""
    k = w.cell
    key = self._DeviceKey(k, r)
    saved = walk.saved[(k, j)]
    dy = walk.grads[j]
    input_grad = walk.input_grads or k > 0
    with self._Device(k, r):
      x = saved.x
      after = walk.last_on_device.get(key)
      if self._strict_order and after is not None:
        dy, after = self._Order(walk, dy, after)
      else:
        after = None
      start = None
      if walk.tracer is not None:
        start, (dy, x_after) = graph_ops.Stamp((dy, x))
        if saved.tape is None:
          x = x_after
      sums = walk.sums[r][k]
      theta_k = walk.thetas[r][k]
      if saved.tape is None:
        # Re-materialized: one call, under the forward's seed.
        theta_g, dx = self._cells.Backward(
          k,
          theta_k,
          x,
          saved.seed,
          tf.nest.flatten(dy),
          sums,
          input_grad,
          saved.loss,
          after=after,
        )
      else:
        if after is not None:
          dy = graph_ops.After(dy, after)
        theta_g, dx = self._cells.TapeBackward(
          saved.tape,
          saved.y,
          x,
          theta_k,
          tf.nest.flatten(dy),
          sums,
          input_grad,
          saved.loss,
        )
      walk.sums[r][k] = theta_g
      flat_x = tf.nest.flatten(x)
      computed = [g for g in dx + theta_g if g is not None]
      # An input without a gradient (integer ids, labels) gets a zero made
      # after this micro-batch's gradients: with strict_order the next
      # micro-batch on this device waits for it, so its re-materialization
      # cannot start while this one's activations are alive.
      for i, t in enumerate(flat_x):
        if dx[i] is None and py_utils.IsTensor(t):
          dx[i] = graph_ops.After(tf.zeros_like(t), computed)
      new_dy = self._Place(tf.nest.pack_sequence_as(x, dx), k)
      if walk.tracer is not None:
        end, new_dy = graph_ops.Stamp(new_dy)
        walk.tracer.Record(('backward', r * self._num_cells + k, j), start, end)
      walk.grads[j] = new_dy
      walk.last_on_device[key] = (
        new_dy,
        [g for g in theta_g if g is not None],
      )

  def _JoinGradients(self, inputs, walk):
    """[gradients of the input tensors] + [of thetas[0]], summed."""
    num_rep = len(walk.thetas)
    num_mb, input_grads = walk.num_mb, walk.input_grads
    grads_state = walk.grads
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
    for k in range(self._num_cells):
      for i in range(len(walk.sums[0][k])):
        partial = [
          walk.sums[r][k][i]
          for r in range(num_rep)
          if walk.sums[r][k][i] is not None
        ]
        if len(partial) > 1:
          # The cross-replica sum, on the device of the variables.
          with self._Device(k):
            partial = [tf.add_n(partial)]
        theta_grads.append(partial[0] if partial else None)
    return in_grads + theta_grads
