"""Decode a dev/test set and score BLEU per language.

`EvaluateBleu(task)` decodes and scores a built task; restoring a checkpoint
first is the runners' job (`runners.evaler.EvaluateBleuCheckpoint`, used by
tools/eval_bleu.py).

`DecodeColumns(task)` runs `task.Decode` over one pass of the task's input
and gathers the outputs like the trainer's decoder job (padding examples
removed); `task.PostProcessDecodeOut(columns)` turns them into a
`bleu.BleuReport`.

Decoding a test set takes a while (tens of seconds on a CPU), so both take
`progress`, a function that gets a line such as "decoded batch 3/10 (192
sentences), 12.3 s" at most every `progress_every_s` seconds, and one when
decoding ends.
"""

import time

import numpy as np
import tensorflow as tf

__all__ = ['DecodeColumns', 'EvaluateBleu']


def DecodeColumns(
  task, max_batches=None, decode_fn=None, progress=None, progress_every_s=10.0
):
  """{name: numpy array} of `task.Decode` over one pass of its input.

  Args:
    task: a built TransformerMTTask with a finite input (num_epochs=1).
    max_batches: stop after this many batches.
    decode_fn: a (traced) function batch -> Decode outputs; default
      tf.function(task.Decode).
    progress: None, or a function of one line of progress text.
    progress_every_s: the least seconds between two progress lines (0:
      one after every batch).
  """
  gen = task.input_generator
  if gen is None or gen.params.num_epochs is None:
    raise ValueError(
      'DecodeColumns needs a task whose input makes one pass '
      '(an eval input: num_epochs=1).'
    )
  fn = decode_fn or tf.function(task.Decode, autograph=False)
  dataset = gen.GetDataset()
  total = int(dataset.cardinality())  # Batches; < 0: unknown.
  if max_batches and (total < 0 or max_batches < total):
    total = max_batches
  start = last = time.perf_counter()
  columns = {}
  sentences = batches = 0
  for n, batch in enumerate(dataset):
    if max_batches and n >= max_batches:
      break
    out = fn(batch)
    keep = np.asarray(batch['weight']) > 0 if 'weight' in batch else None
    for key, value in out.FlattenItems():
      value = np.asarray(value)
      if keep is not None and value.ndim and value.shape[0] == len(keep):
        value = value[keep]
      columns.setdefault(key, []).append(value)
    batches = n + 1
    sentences += int(keep.sum()) if keep is not None else _Rows(out)
    now = time.perf_counter()
    if progress and now - last >= progress_every_s:
      last = now
      of = f'/{total}' if total >= 0 else ''
      progress(
        f'decoded batch {batches}{of} ({sentences} sentences), '
        f'{now - start:.1f} s'
      )
  if progress:
    progress(
      f'decoded {sentences} sentences in {batches} batches, '
      f'{time.perf_counter() - start:.1f} s'
    )
  if not columns:
    raise ValueError('The input produced no batch to decode.')
  return {k: np.concatenate(v) for k, v in columns.items()}


def _Rows(out):
  """The batch size of Decode outputs `out` (its first array's rows)."""
  for _, value in out.FlattenItems():
    shape = np.shape(value)
    if shape:
      return shape[0]
  return 0


def EvaluateBleu(task, max_batches=None, progress=None, progress_every_s=10.0):
  """Decodes the task's input and returns its `bleu.BleuReport`; `progress`
  as in `DecodeColumns`."""
  return task.PostProcessDecodeOut(
    DecodeColumns(
      task,
      max_batches,
      progress=progress,
      progress_every_s=progress_every_s,
    )
  )
