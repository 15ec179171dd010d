"""Decode a dev/test set and score BLEU per language.

`EvaluateBleu(task)` decodes and scores a built task; restoring a checkpoint
first is the runners' job (`runners.evaler.EvaluateBleuCheckpoint`, used by
tools/eval_bleu.py).

`DecodeColumns(task)` runs `task.Decode` over one pass of the task's input
and gathers the outputs like the trainer's decoder job (padding examples
removed); `task.PostProcessDecodeOut(columns)` turns them into a
`bleu.BleuReport`.
"""

import numpy as np
import tensorflow as tf

__all__ = ['DecodeColumns', 'EvaluateBleu']


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
    raise ValueError(
      'DecodeColumns needs a task whose input makes one pass '
      '(an eval input: num_epochs=1).'
    )
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
