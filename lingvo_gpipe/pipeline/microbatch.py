"""Splitting a mini-batch into micro-batches and joining them back.

Inputs and outputs of a pipeline are arbitrary structures (tensors, tuples,
NestedMaps). Every tensor leaf of rank >= 1 is split along `batch_dim`; rank-0
leaves and non-tensor leaves (None, Python numbers) are passed unchanged to
every micro-batch.
"""

import numpy as np
import tensorflow as tf

__all__ = [
  'NumMicroBatches',
  'Split',
  'Concat',
  'BatchSize',
  'IsSplittable',
  'ToTensors',
]


def ToTensors(structure):
  """`structure` with its NumPy arrays as tensors (a pipeline's inputs)."""
  return tf.nest.map_structure(
    lambda x: tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x,
    structure,
  )


def IsSplittable(x):
  return isinstance(x, (tf.Tensor, tf.Variable)) and x.shape.rank != 0


def BatchSize(structure, batch_dim):
  """The static batch size of the first splittable leaf, or None."""
  for x in tf.nest.flatten(structure):
    if IsSplittable(x):
      if x.shape.rank is not None and x.shape.rank <= batch_dim:
        raise ValueError(
          f'Pipeline input of shape {x.shape.as_list()} has no batch_dim='
          f'{batch_dim}; set PipeliningLayer.Params().batch_dim to the '
          'batch axis of the inputs.'
        )
      return x.shape[batch_dim]
  return None


def NumMicroBatches(batch_size, num_micro_batches, micro_batch_size):
  """Resolves M from the params; validates divisibility.

  Args:
    batch_size: static batch size (None if unknown).
    num_micro_batches: `p.num_micro_batches` (int >= 1 or None).
    micro_batch_size: `p.micro_batch_size` (int or None); wins when set.

  Returns:
    M, the number of micro-batches.
  """
  if micro_batch_size:
    if batch_size is None:
      raise ValueError(
        'micro_batch_size is set but the batch size is not known when the '
        'graph is built; use num_micro_batches or give the input a static '
        'batch dimension.'
      )
    if batch_size % micro_batch_size:
      raise ValueError(
        f'micro_batch_size={micro_batch_size} does not divide the batch size '
        f'{batch_size}; choose a divisor of {batch_size} or change the '
        'batch size.'
      )
    return batch_size // micro_batch_size
  m = num_micro_batches or 1
  if not isinstance(m, int) or m < 1:
    raise ValueError(f'num_micro_batches={m!r} must be a positive int.')
  if batch_size is not None and batch_size % m:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    raise ValueError(
      f'num_micro_batches={m} does not divide the batch size {batch_size}; '
      f'use one of {divisors} or change the batch size to a multiple of {m}.'
    )
  return m


def Split(structure, num_splits, batch_dim):
  """Returns a list of `num_splits` structures, one per micro-batch."""
  flat = tf.nest.flatten(structure)
  per_leaf = []
  for x in flat:
    if IsSplittable(x) and num_splits > 1:
      per_leaf.append(tf.split(x, num_splits, axis=batch_dim))
    else:
      per_leaf.append([x] * num_splits)
  return [
    tf.nest.pack_sequence_as(structure, [leaf[m] for leaf in per_leaf])
    for m in range(num_splits)
  ]


def Concat(structures, batch_dim):
  """Joins per-micro-batch structures along `batch_dim`."""
  if len(structures) == 1:
    return structures[0]
  flats = [tf.nest.flatten(s) for s in structures]
  out = []
  for leaves in zip(*flats):
    x = leaves[0]
    if isinstance(x, (tf.Tensor, tf.Variable)):
      if x.shape.rank == 0:
        raise ValueError(
          'A pipeline cell returned a scalar; outputs need a batch '
          'dimension so micro-batches can be joined. Return per-example '
          'values (e.g. a loss of shape [batch]) and reduce after the '
          'pipeline.'
        )
      out.append(tf.concat(list(leaves), axis=batch_dim))
    else:
      out.append(x)
  return tf.nest.pack_sequence_as(structures[0], out)
