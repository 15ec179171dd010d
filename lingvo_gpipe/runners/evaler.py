"""The evaler job: evaluates each new checkpoint once on a Dev/Test set.

  evaler = Evaler(model_params_dev, logdir, dataset='dev', max_steps=1000)
  evaler.Run()        # watches <logdir>/train until the final checkpoint

For a checkpoint, `EvalCheckpoint` restores it by variable name (so one
written by any pipeline split works), runs `task.EvalStep(batch)` under
`py_utils.EvalMode()` over one pass of the input, and averages every metric
with its weights: sum(value * weight) / sum(weight). Results go to
`<logdir>/eval_<dataset>/`: TensorBoard scalars at the checkpoint's step and
one JSON line per checkpoint in `metrics.jsonl`:

  {"step": 100, "checkpoint": ".../ckpt-100", "dataset": "dev",
   "metrics": {"loss": 0.31, ...}, "weights": {"loss": 512.0, ...},
   "num_batches": 8, "seconds": 0.4}

Steps already in `metrics.jsonl` are not evaluated again after a restart.
`Run` evaluates the newest checkpoint it has not evaluated, polls every
`interval_seconds`, and returns after evaluating the checkpoint of
`max_steps` or when no new checkpoint came for `timeout_seconds`.

`Decoder` (the decoder_<dataset> job) runs `task.Decode` instead and saves
the outputs of each checkpoint to `<logdir>/decoder_<dataset>/`.
"""

import io
import json
import os
import time

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.runners import batch_norm_check
from lingvo_gpipe.runners import checkpointer as ckpt_lib
from lingvo_gpipe.runners import train_loop
from lingvo_gpipe.runners.trainer_state import TRAINER_STATE_FILE
from lingvo_gpipe.runners.trainer_state import TrainerRunning
from lingvo_gpipe.runners.trainer_state import WriteTrainerState

__all__ = [
  'TRAINER_STATE_FILE',
  'TrainerRunning',
  'WriteTrainerState',
  'Evaler',
  'Decoder',
  'EvalDir',
  'ReadResults',
  'RESULTS_FILE',
  'EvaluateBleuCheckpoint',
]

RESULTS_FILE = 'metrics.jsonl'


def EvalDir(logdir, dataset, kind='eval'):
  """`<logdir>/<kind>_<dataset>` ('Dev' -> eval_dev, decoder_dev)."""
  return os.path.join(logdir, f'{kind}_{dataset.lower()}')


def ReadResults(eval_dir):
  """The JSON records of `<eval_dir>/metrics.jsonl`, in file order."""
  path = os.path.join(eval_dir, RESULTS_FILE)
  if not tf.io.gfile.exists(path):
    return []
  out = []
  with tf.io.gfile.GFile(path, 'r') as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        out.append(json.loads(line))
      except ValueError:
        logging.warning('Skipping a broken line of %s: %r', path, line[:80])
  return out


class Evaler:
  """Evaluates checkpoints of `<logdir>/train` on one dataset."""

  KIND = 'eval'

  def __init__(
    self,
    params,
    logdir,
    dataset='dev',
    max_steps=None,
    interval_seconds=10.0,
    timeout_seconds=0.0,
    train_dir=None,
    model=None,
    max_batches=None,
    until_trainer_exits=False,
    idle_timeout_seconds=0.0,
  ):
    """Constructor.

    Args:
      params: the model Params with the dataset's input (e.g.
        `model_registry.GetParams(key, 'Dev')`).
      logdir: the training logdir.
      dataset: 'dev', 'test', ...: names the output directory.
      max_steps: `Run` returns after the checkpoint of this step (default:
        params.task.train.max_steps).
      interval_seconds: seconds between polls for a new checkpoint.
      timeout_seconds: `Run` returns after this long without a new
        checkpoint; 0: no limit.
      train_dir: where the checkpoints are (default `<logdir>/train`).
      model: an already built model (default: built from `params`).
      max_batches: stop a pass after this many batches (the input must
        otherwise be finite: num_epochs=1).
      until_trainer_exits: `Run` also returns once the trainer has exited
        (`TrainerRunning` is False) and its last checkpoint is evaluated,
        e.g. after training to fewer steps than max_steps.
      idle_timeout_seconds: with `until_trainer_exits`, `Run` raises a
        CheckpointError after this long with no checkpoint and no trainer
        running (an empty or mistyped logdir); 0: no limit.
    """
    self._params = params
    self._dataset = dataset.lower()
    self._train_dir = train_dir or os.path.join(logdir, 'train')
    self._eval_dir = EvalDir(logdir, dataset, self.KIND)
    if max_steps is None:
      max_steps = params.task.train.max_steps
    self._max_steps = max_steps
    self._interval = float(interval_seconds)
    self._timeout = float(timeout_seconds or 0)
    self._max_batches = max_batches
    self._until_trainer_exits = until_trainer_exits
    self._idle_timeout = float(idle_timeout_seconds or 0)
    self._bn_checked = self._wait_logged = False
    self._model = model if model is not None else params.Instantiate()
    self._task = self._model.GetTask()
    input_p = self._task.input_generator.params
    if input_p.num_epochs is None and not max_batches:
      raise ValueError(
        f'The {dataset} input of {params.name or "the model"} repeats '
        'forever (num_epochs=None), so one evaluation pass never ends. Set '
        'num_epochs=1 on its input Params (BaseInputGenerator.'
        'SetEvalSettings) or pass max_batches.'
      )
    self._reader = ckpt_lib.Checkpointer(
      self._train_dir, self._model.VariablesByName(), writable=False
    )
    self._step_fn = tf.function(self._EvalStep, autograph=False)
    ckpt_lib.CheckWritableDir(self._eval_dir, what='eval directory')
    self._writer = tf.summary.create_file_writer(self._eval_dir)
    self._done = {r['step'] for r in ReadResults(self._eval_dir) if 'step' in r}

  @property
  def eval_dir(self):
    return self._eval_dir

  @property
  def model(self):
    return self._model

  def _EvalStep(self, batch):
    with py_utils.EvalMode():
      return self._task.EvalStep(batch)

  def EvalOnce(self):
    """One pass over the input with the current weights.

    Returns:
      (metrics {name: mean}, weights {name: total weight}, number of batches).
    """
    sums, weights, num_batches = {}, {}, 0
    for batch in self._task.input_generator.GetDataset():
      if self._max_batches and num_batches >= self._max_batches:
        break
      out = self._step_fn(batch)
      pairs = {}
      for name, value in out.items():
        if isinstance(value, (tuple, list)) and len(value) == 2:
          pairs[name] = value
        else:
          pairs[name] = (value, 1.0)
      for name, (value, weight) in pairs.items():
        value = float(np.asarray(value))
        weight = float(np.asarray(weight))
        sums[name] = sums.get(name, 0.0) + value * weight
        weights[name] = weights.get(name, 0.0) + weight
      num_batches += 1
    if not num_batches:
      raise ValueError(
        f'The {self._dataset} input produced no batch; check '
        'its file_pattern / num_samples / batch_size.'
      )
    # Counts (num_preds, ...) are summed over the batches, the others are
    # weighted means.
    metrics = {
      k: (
        sums[k]
        if base_model.IsCountMetric(k)
        else (sums[k] / weights[k] if weights[k] else float('nan'))
      )
      for k in sums
    }
    return metrics, weights, num_batches

  def _Evaluate(self, step):
    """(metrics, weights, num_batches, extra record fields) of one pass."""
    del step
    metrics, weights, num_batches = self.EvalOnce()
    return metrics, weights, num_batches, {}

  def EvalCheckpoint(self, prefix):
    """Restores `prefix`, evaluates, records; returns the JSON record."""
    start = time.time()
    self._reader.RestoreFrom(prefix, strict=False)
    step = ckpt_lib.StepOf(prefix)
    if step is None:
      step = int(self._model.global_step.numpy())
    if not self._bn_checked:  # Once: the first checkpoint says it.
      self._bn_checked = True
      warning = batch_norm_check.MovingAverageWarning(self._model, step)
      if warning:
        logging.warning('%s', warning)
    metrics, weights, num_batches, extra = self._Evaluate(step)
    record = {
      'step': step,
      'checkpoint': prefix,
      'dataset': self._dataset,
      'metrics': metrics,
      'weights': weights,
      'num_batches': num_batches,
      'seconds': round(time.time() - start, 3),
      'wall_time': time.time(),
    }
    record.update(extra)
    with self._writer.as_default(step=step):
      for name, value in metrics.items():
        train_loop.WriteScalar(name, value, step)
    self._writer.flush()
    with tf.io.gfile.GFile(
      os.path.join(self._eval_dir, RESULTS_FILE), 'a'
    ) as f:
      f.write(json.dumps(record, sort_keys=True) + '\n')
    self._done.add(step)
    shown = '  '.join(f'{k} {v:.6g}' for k, v in sorted(metrics.items()))
    logging.info(
      '%s %s at step %d (%s): %s',
      self.KIND.capitalize(),
      self._dataset,
      step,
      prefix,
      shown,
    )
    return record

  def _Wait(self, stop):
    if stop is not None and hasattr(stop, 'Wait'):
      stop.Wait(self._interval)
    else:
      time.sleep(self._interval)

  def Run(self, stop=None):
    """Evaluates new checkpoints until the final one or the timeout.

    Args:
      stop: optional StopRequest; once it is set, `Run` evaluates the latest
        checkpoint if it is new, then returns.

    Returns:
      The list of records of the checkpoints evaluated.
    """
    records, failures = [], {}
    last_new = idle_since = time.time()
    logging.info(
      '%s %s watching %s (max_steps=%s, timeout=%s).',
      self.KIND.capitalize(),
      self._dataset,
      self._train_dir,
      self._max_steps,
      f'{self._timeout:g} s' if self._timeout else 'none',
    )
    while True:
      stopping = stop is not None and stop.requested
      prefix = ckpt_lib.LatestCheckpoint(self._train_dir)
      step = ckpt_lib.StepOf(prefix) if prefix else None
      if step is not None and step not in self._done:
        try:
          records.append(self.EvalCheckpoint(prefix))
        except ckpt_lib.IncompatibleCheckpointError:
          raise
        except (
          tf.errors.NotFoundError,
          tf.errors.DataLossError,
          ckpt_lib.CheckpointError,
        ) as e:
          # The trainer may delete an old checkpoint while it is read.
          failures[prefix] = failures.get(prefix, 0) + 1
          logging.warning(
            'Could not read %s (try %d): %s',
            prefix,
            failures[prefix],
            str(e).splitlines()[0],
          )
          if failures[prefix] >= 3:
            self._done.add(step)
          self._Wait(stop)
          continue
        last_new = time.time()
      if step is not None and self._max_steps and step >= self._max_steps:
        return self._Done(records)
      if stopping:
        return self._Done(records)
      if (
        self._until_trainer_exits
        and step in self._done
        and not TrainerRunning(self._train_dir)
        and ckpt_lib.LatestCheckpoint(self._train_dir) == prefix
      ):
        logging.info(
          '%s %s: the trainer has exited and its last checkpoint (step %d) '
          'is evaluated; exiting.',
          self.KIND.capitalize(),
          self._dataset,
          step,
        )
        return self._Done(records)
      if self._until_trainer_exits and prefix is None:
        idle_since = self._WaitForATrainer(idle_since)
      if self._timeout and time.time() - last_new > self._timeout:
        logging.warning(
          '%s %s: no new checkpoint in %s for %.0f s; exiting.',
          self.KIND.capitalize(),
          self._dataset,
          self._train_dir,
          self._timeout,
        )
        return self._Done(records)
      self._Wait(stop)

  def _WaitForATrainer(self, idle_since):
    """No checkpoint yet: logs the wait once, and ends it (CheckpointError)
    after the idle timeout without a trainer; returns the new idle_since."""
    now = time.time()
    if TrainerRunning(self._train_dir):
      return now
    if now - idle_since >= self._idle_timeout > 0:
      raise ckpt_lib.CheckpointError(
        f'No checkpoint in {self._train_dir} after {self._idle_timeout:g} '
        's, and no trainer runs there. Check --logdir, start the trainer, or '
        'wait longer with --eval_idle_timeout_s (0: no limit).'
      )
    if not self._wait_logged:
      self._wait_logged = True
      limit = f'{self._idle_timeout:g} s' if self._idle_timeout else 'no limit'
      logging.info(
        '%s %s: no checkpoint in %s yet and no trainer runs there; waiting '
        'for one (%s, --eval_idle_timeout_s).',
        self.KIND.capitalize(),
        self._dataset,
        self._train_dir,
        limit,
      )
    return idle_since

  def _Done(self, records):
    """`records`; when this run evaluated nothing, logs the latest results
    already recorded (a restarted evaler has something to show)."""
    if not records:
      done = [r for r in ReadResults(self._eval_dir) if 'metrics' in r]
      if done:
        last = max(done, key=lambda r: r['step'])
        shown = '  '.join(
          f'{k} {v:.6g}' for k, v in sorted(last['metrics'].items())
        )
        logging.info(
          '%s %s at step %d (evaluated before, %s): %s',
          self.KIND.capitalize(),
          self._dataset,
          last['step'],
          os.path.join(self._eval_dir, RESULTS_FILE),
          shown,
        )
    return records


class Decoder(Evaler):
  """The decoder job: saves `task.Decode` outputs of one pass per checkpoint.

  For checkpoint `ckpt-<step>` it writes `<logdir>/decoder_<dataset>/
  decoder_out_<step>.npz`: every prediction (NestedMap key, '.' -> '__')
  concatenated over the pass, padded examples (weight 0) left out, plus the
  inputs' `label` when there is one. `metrics.jsonl` records num_examples
  and the file.
  """

  KIND = 'decoder'

  def _EvalStep(self, batch):
    with py_utils.EvalMode():
      return self._task.Decode(batch)

  def _Evaluate(self, step):
    columns, num_batches, total = {}, 0, 0
    for batch in self._task.input_generator.GetDataset():
      if self._max_batches and num_batches >= self._max_batches:
        break
      out = self._step_fn(batch)
      keep = None
      if 'weight' in batch:
        keep = np.asarray(batch['weight']) > 0
      items = (
        dict(out.FlattenItems())
        if hasattr(out, 'FlattenItems')
        else {'output': out}
      )
      if 'label' in batch and 'label' not in items:
        items['label'] = batch['label']
      for key, value in items.items():
        value = np.asarray(value)
        if keep is not None and value.ndim and value.shape[0] == len(keep):
          value = value[keep]
        columns.setdefault(key.replace('.', '__'), []).append(value)
      total += int(keep.sum()) if keep is not None else BatchRows(batch)
      num_batches += 1
    path = os.path.join(self._eval_dir, f'decoder_out_{step}.npz')
    arrays = {
      k: np.concatenate(v) if v[0].ndim else np.stack(v)
      for k, v in columns.items()
    }
    buf = io.BytesIO()  # np.savez seeks; not every file system can.
    np.savez(buf, **arrays)
    with tf.io.gfile.GFile(path, 'wb') as f:
      f.write(buf.getvalue())
    metrics = {'num_examples': float(total)}
    if hasattr(self._task, 'PostProcessDecodeOut'):
      # Task-specific decode metrics, e.g. BLEU per language.
      metrics.update(self._task.PostProcessDecodeOut(arrays).Metrics())
    return (
      metrics,
      {k: 1.0 for k in metrics},
      num_batches,
      {'decoder_out': path},
    )


def BatchRows(batch):
  return train_loop.BatchSize(batch) or 0


def EvaluateBleuCheckpoint(
  model,
  logdir,
  dataset='Test',
  beam_size=None,
  max_batches=None,
  checkpoint=None,
  overrides=None,
  **decode,
):
  """Restores a checkpoint of an MT `model` and scores BLEU on `dataset`.

    step, report = EvaluateBleuCheckpoint('mt.multilingual.TransformerTiny',
                                          '/tmp/mt', dataset='Test')
    print(report)          # BLEU per language, average, corpus

  Args:
    model: registry key, e.g. 'mt.multilingual.TransformerTiny'.
    logdir: the training logdir (its train/ holds the checkpoints).
    dataset: 'Dev' or 'Test'.
    beam_size: overrides the task's beam_size (1: greedy).
    max_batches: as DecodeColumns' (and **decode: progress, progress_every_s).
    checkpoint: a checkpoint prefix; None: the latest in <logdir>/train.
    overrides: Params text ("a.b : value" lines) applied to the model Params.

  Returns:
    (the checkpoint's step, bleu.BleuReport).
  """
  p = model_registry.GetParams(model, dataset)
  if overrides:
    p.FromText(overrides)
  if beam_size is not None:
    p.task.beam_size = beam_size
  train_dir = os.path.join(logdir, 'train')
  prefix = checkpoint or ckpt_lib.LatestCheckpoint(train_dir)
  if prefix is None:
    raise ValueError(
      f'No checkpoint in {train_dir}; train the model first '
      f'(python -m lingvo_gpipe.trainer --model={model} '
      f'--logdir={logdir}).'
    )
  built = p.Instantiate()
  ckpt_lib.Checkpointer(
    train_dir, built.VariablesByName(), writable=False
  ).RestoreFrom(prefix, strict=False)
  report = built.GetTask().EvaluateDecoder(max_batches, **decode)
  return ckpt_lib.StepOf(prefix), report
