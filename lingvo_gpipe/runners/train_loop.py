"""The training loop: steps, progress lines, summaries, checkpoints, stops.

  loop = TrainLoop(task, global_step, iterator, checkpointer, max_steps=1000,
                   summary_dir=logdir + '/train')
  result = loop.Run()   # -> TrainResult(step, reason)

Each step runs `task.TrainStep(batch)` inside one `tf.function` (under a
tf.distribute strategy: in every replica, through `strategy.run`). Every
`log_interval_steps` a progress line is logged (step, loss, examples/s, step
time, ETA); every `summary_interval_steps` the step's scalars (loss, metrics,
learning_rate, grad_norm) and examples_per_sec and step_time go to
TensorBoard. The loop stops at `max_steps`, when the input ends, or when a
`StopRequest` is set (SIGINT/SIGTERM): it then saves a checkpoint and
returns.

Diverged weights are never kept as the last good model: a NaN or Inf loss
raises `NonFiniteError` naming the step, before anything is saved, and if
the latest checkpoint holds the weights that produced that loss (the step
before), it is removed, so the pointer names the checkpoint before it.
Weights are checked before every save too: a NaN or Inf, or a trainable
weight beyond `max_weight_abs` (finite but diverged, e.g. 1e30 after a far
too high learning rate), stops training without saving them.
"""

import collections
import math
import os
import signal
import sys
import threading
import time

from absl import logging
import numpy as np
import tensorflow as tf

from tensorflow.core.framework import summary_pb2

from lingvo_gpipe.core import distribute
from lingvo_gpipe.core import quiet_start

__all__ = [
  'StopRequest',
  'NonFiniteError',
  'TrainResult',
  'TrainLoop',
  'StepWatchdog',
  'BatchSize',
  'FormatDuration',
  'WriteScalar',
]

# What tf.summary.scalar writes, without needing the tensorboard package.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
  plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='scalars')
)


class NonFiniteError(RuntimeError):
  """The loss or a weight became NaN or Inf."""


class StopRequest:
  """A flag that signal handlers set and the loop checks between steps."""

  def __init__(self):
    self._event = threading.Event()
    self.signal_name = None

  def Set(self, reason='requested'):
    self.signal_name = self.signal_name or reason
    self._event.set()

  @property
  def requested(self):
    return self._event.is_set()

  def Wait(self, timeout):
    """Sleeps up to `timeout` seconds, less if the flag gets set."""
    return self._event.wait(timeout)

  def InstallSignalHandlers(self, signums=(signal.SIGINT, signal.SIGTERM)):
    """SIGINT/SIGTERM set the flag; a second one ends the process at once.

    The signals are counted by a thread that reads the interpreter's signal
    wake-up file, not by the Python handlers, which run only when the main
    thread is back in Python: so the first signal is logged (and the flag
    set) at once, and the second ends the process (status 128 + signal
    number, after one line) within a second, even while the main thread is
    blocked inside a TensorFlow call (a step waiting on a stopped worker).
    Must be called from the main thread.
    """
    signums = tuple(signums)

    def Handler(signum, unused_frame):
      # Replaces the default action (KeyboardInterrupt, termination); the
      # watcher below has already counted and logged this signal.
      self.Set(signal.Signals(signum).name)

    for signum in signums:
      signal.signal(signum, Handler)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def Watch():
      count = 0
      while True:
        data = os.read(read_fd, 64)
        if not data:
          return
        for signum in data:
          if signum not in signums:
            continue
          count += 1
          if count >= 2:
            _ExitNow(signum)
          name = signal.Signals(signum).name
          logging.info(
            '%s received: saving a checkpoint after this step, then '
            'exiting (a second %s exits at once, without saving).',
            name,
            name,
          )
          self.Set(name)

    threading.Thread(target=Watch, name='signal_watch', daemon=True).start()


def _ExitNow(signum):
  """The second SIGINT/SIGTERM: one line, no save, no waiting."""
  name = signal.Signals(signum).name
  logging.flush()
  sys.stderr.flush()
  quiet_start.SyncStderr(timeout=0.5)
  os.write(
    quiet_start.StderrFd(),
    f'ERROR: Second {name}: exiting now without saving; the last checkpoint '
    'stays the one to resume from.\n'.encode(),
  )
  os._exit(128 + signum)  # pylint: disable=protected-access


class StepWatchdog:
  """Calls `on_timeout(step, seconds, bound)` if one step runs past a bound.

  A TensorFlow step blocked on a worker that stopped answering (hung, or its
  host unreachable without a closed connection) cannot be interrupted from
  Python; the trainer's `on_timeout` names the workers and ends the process
  (checkpoints are written atomically, so the last one stays good).

  With a fixed `timeout_s` every step gets that bound and the first step
  (tracing, compilation) `first_step_factor` times it. With `timeout_s=None`
  (auto) the bound follows the steps measured so far:
  max(`min_timeout_s`, `median_factor` x the running median step time), and
  the first step gets `first_step_timeout_s`. Either way a step slower than
  `slow_factor` x the median (and over a second) is logged as slow, once
  while it runs and once when it ends.
  """

  def __init__(
    self,
    timeout_s,
    on_timeout,
    first_step_factor=4.0,
    poll_s=0.5,
    min_timeout_s=60.0,
    median_factor=10.0,
    first_step_timeout_s=900.0,
    slow_factor=3.0,
  ):
    self._timeout = None if timeout_s is None else float(timeout_s)
    self._on_timeout = on_timeout
    self._first_factor = float(first_step_factor)
    self._poll = poll_s
    self._min_timeout = float(min_timeout_s)
    self._median_factor = float(median_factor)
    self._first_timeout = float(first_step_timeout_s)
    self._slow_factor = float(slow_factor)
    self._lock = threading.Lock()
    self._current = None  # [step, start time, bound, reported slow]
    self._steps_done = 0
    self._times = collections.deque(maxlen=101)
    self._done = threading.Event()
    self._thread = threading.Thread(
      target=self._Watch, name='step_watchdog', daemon=True
    )
    self._thread.start()

  def Median(self):
    """The median of the recent step times (None before the second step)."""
    with self._lock:
      times = sorted(self._times)
    return times[len(times) // 2] if times else None

  def Bound(self):
    """The bound of the next step, in seconds."""
    if self._timeout is not None:
      factor = self._first_factor if self._steps_done == 0 else 1.0
      return self._timeout * factor
    median = self.Median()
    if median is None:
      return self._first_timeout
    return max(self._min_timeout, self._median_factor * median)

  def StepStarted(self, step):
    bound = self.Bound()
    with self._lock:
      self._current = [step, time.time(), bound, False]

  def StepFinished(self):
    with self._lock:
      current, self._current = self._current, None
      self._steps_done += 1
    if current is None:
      return
    step, start, bound, _ = current
    elapsed = time.time() - start
    median = self.Median()
    if self._steps_done > 1:  # The first step (tracing) is not timed.
      with self._lock:
        self._times.append(elapsed)
    if median and elapsed > max(1.0, self._slow_factor * median):
      logging.warning(
        'Slow step %d: %.1f s, %.0fx the median step time (%.3f s); the '
        'step timeout is %.0f s.',
        step,
        elapsed,
        elapsed / median,
        median,
        bound,
      )

  def Stop(self):
    self._done.set()
    self._thread.join(timeout=5)

  def _Watch(self):
    while not self._done.wait(self._poll):
      with self._lock:
        current = self._current
        if current is None:
          continue
        step, start, bound, reported = current
        elapsed = time.time() - start
        median = self._times and sorted(self._times)[len(self._times) // 2]
        if (
          not reported
          and median
          and elapsed > max(1.0, self._slow_factor * median, bound / 2)
        ):
          current[3] = True
          logging.warning(
            'Step %d has been running for %.0f s (the median step takes '
            '%.3f s); the trainer gives up at %.0f s.',
            step,
            elapsed,
            median,
            bound,
          )
        if elapsed <= bound:
          continue
        self._current = None  # report once
      self._on_timeout(step, elapsed, bound)


class TrainResult:
  """How training ended: the global step and why ('max_steps', ...)."""

  def __init__(self, step, reason, checkpoint=None):
    self.step = step
    self.reason = reason
    self.checkpoint = checkpoint

  def __repr__(self):
    return (
      f'TrainResult(step={self.step}, reason={self.reason!r}, '
      f'checkpoint={self.checkpoint!r})'
    )


def BatchSize(batch):
  """The leading dimension of the first tensor of `batch` (None if unknown)."""
  for t in tf.nest.flatten(batch):
    if hasattr(t, 'shape') and t.shape.rank:
      dim = t.shape[0]
      return int(dim) if dim is not None else int(tf.shape(t)[0])
  return None


def WriteScalar(name, value, step):
  """A TensorBoard scalar summary into the default writer."""
  tf.summary.write(
    name,
    tf.constant(float(value), tf.float32),
    step=step,
    metadata=_SCALAR_METADATA,
  )


def FormatDuration(seconds):
  seconds = int(max(0, seconds))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


def _Scalars(outputs):
  """{name: python float} of the scalar entries of a step's outputs."""
  out = {}
  for name, value in outputs.items():
    if isinstance(value, (tuple, list)) and len(value) == 2:  # (value, weight)
      value = value[0]
    value = np.asarray(value)
    if value.ndim == 0 and (
      np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_
    ):
      out[name] = float(value)
  return out


class TrainLoop:
  """Runs training steps until max_steps, a stop request, or a NaN."""

  def __init__(
    self,
    task,
    global_step,
    iterator,
    checkpointer,
    max_steps,
    summary_dir=None,
    log_interval_steps=10,
    summary_interval_steps=100,
    stop=None,
    batch_size=None,
    train_step_fn=None,
    watchdog=None,
    max_weight_abs=1e6,
    strategy=None,
    worker_memory=None,
  ):
    """Constructor.

    Args:
      task: a BaseTask; `task.TrainStep(batch)` returns a NestedMap of
        scalars including 'loss'.
      global_step: the int64 step variable (TrainStep increments it; if it
        does not, the loop does).
      iterator: the input iterator (NestedMap batches).
      checkpointer: a `checkpointer.Checkpointer`, or None (no saving).
      max_steps: the global step at which training ends.
      summary_dir: TensorBoard event directory, or None.
      log_interval_steps: a progress line every this many steps.
      summary_interval_steps: summaries every this many steps.
      stop: a StopRequest; set it to stop after the current step.
      batch_size: examples per step; None: read from each batch.
      train_step_fn: replaces `task.TrainStep` (tests).
      watchdog: a StepWatchdog told when each step (and its checkpoint)
        starts and ends.
      max_weight_abs: a save refuses trainable weights larger in absolute
        value (diverged); 0 or None: only NaN/Inf are refused.
      strategy: a tf.distribute strategy, or None: each replica runs the
        step (`strategy.run`) on its share of the batch (`iterator` gives
        per-replica batches, see `distribute.DistributeDataset`), and the
        outputs are averaged over the replicas.
      worker_memory: a `worker_memory.WorkerMemory` of the remote workers,
        or None: sampled at every progress line, logged after the first
        one and at the end.
    """
    self._worker_memory = worker_memory
    self._workers_logged = False
    self._max_weight_abs = max_weight_abs
    self._watchdog = watchdog
    self._task = task
    self._global_step = global_step
    self._iterator = iterator
    self._ckpt = checkpointer
    self._max_steps = int(max_steps)
    self._log_every = max(1, int(log_interval_steps or 1))
    self._summary_every = max(1, int(summary_interval_steps or 1))
    self._stop = stop or StopRequest()
    self._batch_size = batch_size
    self._writer = (
      tf.summary.create_file_writer(summary_dir) if summary_dir else None
    )
    fn = train_step_fn or task.TrainStep
    if strategy is not None:
      fn = distribute.ReplicatedStep(strategy, fn)
    self._increments = None  # Whether TrainStep increments the step itself.
    # No autograph: layers use Python control flow on static values only,
    # and tracing then needs no source code (which may change on disk).
    self._step_fn = tf.function(fn, autograph=False)
    self._incr_fn = tf.function(
      lambda: self._global_step.assign_add(1), autograph=False
    )

  @property
  def stop(self):
    return self._stop

  def _Latest(self):
    last = self._ckpt.latest if self._ckpt is not None else None
    return last or 'none (start afresh)'

  def _CheckFinite(self, step, scalars):
    loss = scalars.get('loss')
    if loss is not None and not math.isfinite(loss):
      dropped = ''
      # The loss of `step` was computed with the weights of step - 1.
      if self._ckpt is not None and self._ckpt.last_saved_step == step - 1:
        prefix = self._ckpt.latest
        self._ckpt.Discard(prefix)
        dropped = (
          f' The checkpoint of step {step - 1} ({prefix}), whose weights '
          'gave this loss, was removed.'
        )
      raise NonFiniteError(
        f'The loss is {loss} at step {step}. Training stopped without '
        f'saving.{dropped} The last good model is the last checkpoint: '
        f'{self._Latest()}. Lower the learning rate (e.g. '
        '--model_params_override="task.train.learning_rate : ...") or add '
        'gradient clipping, then rerun with --allow_params_change to resume '
        'from it.'
      )

  def _CheckWeightsFinite(self, step):
    bad, big = [], []
    for v in self._Variables():
      if not v.dtype.is_floating:
        continue
      if not bool(tf.reduce_all(tf.math.is_finite(v))):
        bad.append(v.name)
      elif self._max_weight_abs and v.trainable:
        peak = float(tf.reduce_max(tf.abs(v))) if v.shape.num_elements() else 0
        if peak > self._max_weight_abs:
          big.append((peak, v.name))
    if bad:
      raise NonFiniteError(
        f'NaN or Inf in {len(bad)} variables at step {step} (e.g. '
        f'{bad[:3]}); not saving them. The last good model is the last '
        f'checkpoint: {self._Latest()}.'
      )
    if big:
      peak, name = max(big)
      raise NonFiniteError(
        f'The weights diverged at step {step}: |{name}| reaches {peak:.3g} '
        f'(> --max_weight_abs={self._max_weight_abs:g}); not saving them. '
        f'The last good model is the last checkpoint: {self._Latest()}. '
        'Lower the learning rate or add gradient clipping, then rerun with '
        '--allow_params_change to resume from it (or raise --max_weight_abs '
        'if such weights are expected).'
      )

  def _Variables(self):
    if self._ckpt is not None:
      return list(self._ckpt.variables.values())
    return []

  def _Save(self, step, force):
    if self._ckpt is None:
      return None
    if not force and not self._ckpt.ShouldSave(step):
      return None
    self._CheckWeightsFinite(step)
    return self._ckpt.Save(step)

  def _Summaries(self, step, scalars, examples_per_sec, step_time):
    if self._writer is None:
      return
    with self._writer.as_default(step=step):
      for name, value in scalars.items():
        WriteScalar(name, value, step)
      if examples_per_sec is not None:
        WriteScalar('examples_per_sec', examples_per_sec, step)
      WriteScalar('step_time', step_time, step)
    self._writer.flush()

  def _Log(self, step, scalars, examples_per_sec, step_time, first=False):
    parts = [f'step {step:>7d}/{self._max_steps}']
    parts.append(f'loss {scalars.get("loss", float("nan")):.6g}')
    for key, label in (('learning_rate', 'lr'), ('grad_norm', 'grad_norm')):
      if key in scalars:
        parts.append(f'{label} {scalars[key]:.4g}')
    if first:
      parts.append(f'first step (with tracing) {step_time:.2f} s')
    else:
      if examples_per_sec is not None:
        parts.append(f'{examples_per_sec:.1f} examples/s')
      parts.append(f'{step_time * 1000:.1f} ms/step')
      parts.append(
        'ETA ' + FormatDuration((self._max_steps - step) * step_time)
      )
    logging.info('  '.join(parts))

  def _SampleWorkers(self, step, log):
    if self._worker_memory is None:
      return
    self._worker_memory.Sample(step)
    if log and self._worker_memory.Line():
      logging.info('%s', self._worker_memory.Line())
      self._workers_logged = True

  def Run(self):
    """Trains; returns a TrainResult. Raises NonFiniteError on NaN/Inf."""
    step = int(self._global_step.numpy())
    reason = 'max_steps'
    window_start, window_steps, window_examples = None, 0, 0
    checkpoint = None
    # Before the first step: which processes the workers are (a worker the
    # out-of-memory killer ends in the first step is then named as such).
    self._SampleWorkers(step, log=False)
    if step >= self._max_steps:
      logging.info(
        'Global step %d >= max_steps %d: nothing to train.',
        step,
        self._max_steps,
      )
    while step < self._max_steps:
      if self._stop.requested:
        reason = self._stop.signal_name or 'stop requested'
        break
      try:
        batch = next(self._iterator)
      except StopIteration:
        reason = 'input exhausted'
        logging.warning(
          'The training input ended at step %d, before max_steps=%d.',
          step,
          self._max_steps,
        )
        break
      t0 = time.time()
      if self._watchdog is not None:
        self._watchdog.StepStarted(step + 1)
      outputs = self._step_fn(batch)
      if self._increments is None:
        self._increments = int(self._global_step.numpy()) != step
      if not self._increments:
        self._incr_fn()
      scalars = _Scalars(outputs)
      new_step = int(self._global_step.numpy())
      self._CheckFinite(new_step, scalars)
      now = time.time()
      step_time = now - t0
      batch_size = self._batch_size or BatchSize(batch)
      if window_start is None:  # The first step traces: not timed.
        window_start = now
      else:
        window_steps += new_step - step
        window_examples += (new_step - step) * (batch_size or 0)
      step = new_step
      elapsed = now - window_start
      avg_step = elapsed / window_steps if window_steps else step_time
      eps = (
        window_examples / elapsed if elapsed > 0 and window_examples else None
      )
      if step % self._summary_every == 0 or step >= self._max_steps:
        self._Summaries(step, scalars, eps, avg_step)
      if step % self._log_every == 0 or step >= self._max_steps:
        self._Log(step, scalars, eps, avg_step, first=not window_steps)
        self._SampleWorkers(step, log=not self._workers_logged)
        window_start, window_steps, window_examples = time.time(), 0, 0
      checkpoint = self._Save(step, force=False) or checkpoint
      if self._watchdog is not None:
        self._watchdog.StepFinished()
    checkpoint = self._Save(step, force=True) or checkpoint
    self._SampleWorkers(step, log=True)
    if self._writer is not None:
      self._writer.flush()
    logging.info('Training stopped at step %d (%s).', step, reason)
    return TrainResult(step, reason, checkpoint)
