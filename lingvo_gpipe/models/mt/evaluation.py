"""Decode a dev/test set and score BLEU per language (tools/eval_bleu.py).

  step, report = EvaluateCheckpoint('mt.multilingual.TransformerTiny',
                                    '/tmp/mt', dataset='Test')
  print(report)          # BLEU per language, average, corpus

`DecodeColumns(task)` runs `task.Decode` over one pass of the task's input
and gathers the outputs like the trainer's decoder job (padding examples
removed); `task.PostProcessDecodeOut(columns)` turns them into a
`bleu.BleuReport`.
"""

import os

import numpy as np
import tensorflow as tf

from lingvo_gpipe.runners import checkpointer

__all__ = ['DecodeColumns', 'EvaluateBleu', 'EvaluateCheckpoint']


def DecodeColumns(task, max_batches=None, decode_fn=None):
  """{name: numpy array} of `task.Decode` over one pass of its input.

  Args:
    task: a built TransformerMTTask with a finite input (num_epochs=1).
    max_batches: stop after this many batches.
    decode_fn: a (traced) function batch -> Decode outputs; default
      tf.function(task.Decode).
  """
  gen = task.input_generator
  if gen is None or gen.params.num_epochs is None:
    raise ValueError('DecodeColumns needs a task whose input makes one pass '
                     '(an eval input: num_epochs=1).')
  fn = decode_fn or tf.function(task.Decode, autograph=False)
  columns = {}
  for n, batch in enumerate(gen.GetDataset()):
    if max_batches and n >= max_batches:
      break
    out = fn(batch)
    keep = np.asarray(batch['weight']) > 0 if 'weight' in batch else None
    for key, value in out.FlattenItems():
      value = np.asarray(value)
      if keep is not None and value.ndim and value.shape[0] == len(keep):
        value = value[keep]
      columns.setdefault(key, []).append(value)
  if not columns:
    raise ValueError('The input produced no batch to decode.')
  return {k: np.concatenate(v) for k, v in columns.items()}


def EvaluateBleu(task, max_batches=None):
  """Decodes the task's input and returns its `bleu.BleuReport`."""
  return task.PostProcessDecodeOut(DecodeColumns(task, max_batches))


def EvaluateCheckpoint(model, logdir, dataset='Test', beam_size=None,
                       max_batches=None, checkpoint=None, overrides=None):
  """Restores a checkpoint of `model` and scores BLEU on `dataset`.

  Args:
    model: registry key, e.g. 'mt.multilingual.TransformerTiny'.
    logdir: the training logdir (its train/ holds the checkpoints).
    dataset: 'Dev' or 'Test'.
    beam_size: overrides the task's beam_size (1: greedy).
    max_batches: decode at most this many batches.
    checkpoint: a checkpoint prefix; None: the latest in <logdir>/train.
    overrides: Params text ("a.b : value" lines) applied to the model Params.

  Returns:
    (the checkpoint's step, bleu.BleuReport).
  """
  from lingvo_gpipe import model_registry  # pylint: disable=g-import-not-at-top
  p = model_registry.GetParams(model, dataset)
  if overrides:
    p.FromText(overrides)
  if beam_size is not None:
    p.task.beam_size = beam_size
  train_dir = os.path.join(logdir, 'train')
  prefix = checkpoint or checkpointer.LatestCheckpoint(train_dir)
  if prefix is None:
    raise ValueError(f'No checkpoint in {train_dir}; train the model first '
                     f'(python -m lingvo_gpipe.trainer --model={model} '
                     f'--logdir={logdir}).')
  built = p.Instantiate()
  checkpointer.Checkpointer(train_dir, built.VariablesByName(),
                            writable=False).RestoreFrom(prefix, strict=False)
  report = EvaluateBleu(built.GetTask(), max_batches)
  return checkpointer.StepOf(prefix), report
