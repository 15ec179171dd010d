"""Unit tests for lingvo_gpipe.pipeline.microbatch."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import microbatch


def testIsSplittable():
  assert microbatch.IsSplittable(tf.zeros([2]))
  assert microbatch.IsSplittable(tf.Variable(tf.zeros([2, 3])))
  assert not microbatch.IsSplittable(tf.constant(1.0))
  assert not microbatch.IsSplittable(None)
  assert not microbatch.IsSplittable(3)


def testBatchSizeOfFirstSplittableLeaf():
  s = (tf.constant(1.0), None, tf.zeros([6, 2]), tf.zeros([4]))
  assert microbatch.BatchSize(s, 0) == 6
  assert microbatch.BatchSize(s, 1) == 2
  assert microbatch.BatchSize((None, tf.constant(2)), 0) is None
  with pytest.raises(ValueError, match=r'shape \[6\] has no batch_dim=1'):
    microbatch.BatchSize(tf.zeros([6]), 1)


@pytest.mark.parametrize(
  'batch, m, mbs, want',
  [
    (8, None, None, 1),
    (8, 4, None, 4),
    (8, 4, 2, 4),
    (8, None, 8, 1),
    (None, 3, None, 3),
    (12, 1, 3, 4),
  ],
)
def testNumMicroBatches(batch, m, mbs, want):
  assert microbatch.NumMicroBatches(batch, m, mbs) == want


@pytest.mark.parametrize(
  'batch, m, mbs, match',
  [
    (8, 3, None, r'num_micro_batches=3 does not divide .* \[1, 2, 4, 8\]'),
    (8, None, 3, 'micro_batch_size=3 does not divide the batch size 8'),
    (None, None, 2, 'batch size is not known'),
    (8, 0.5, None, r'num_micro_batches=0.5 must be a positive int'),
    (8, -2, None, r'num_micro_batches=-2 must be a positive int'),
  ],
)
def testNumMicroBatchesErrors(batch, m, mbs, match):
  with pytest.raises(ValueError, match=match):
    microbatch.NumMicroBatches(batch, m, mbs)


def testSplitThenConcatRoundTripsANestedMap():
  x = np.arange(24, dtype=np.float32).reshape([2, 6, 2])
  s = py_utils.NestedMap(
    x=tf.constant(x),
    ids=tf.range(6)[None],
    scale=tf.constant(2.0),
    note=None,
    n=5,
  )
  parts = microbatch.Split(s, 3, batch_dim=1)
  assert len(parts) == 3
  for i, p in enumerate(parts):
    np.testing.assert_array_equal(p.x.numpy(), x[:, 2 * i : 2 * i + 2])
    np.testing.assert_array_equal(p.ids.numpy(), [[2 * i, 2 * i + 1]])
    assert p.scale is s.scale and p.note is None and p.n == 5
  for p in parts:  # Scalars go to every micro-batch, cannot be joined back.
    del p.scale
  joined = microbatch.Concat(parts, 1)
  assert joined.note is None and joined.n == 5
  np.testing.assert_array_equal(joined.x.numpy(), x)
  np.testing.assert_array_equal(joined.ids.numpy(), [list(range(6))])


def testSplitIntoOneAndConcatOfOneAreIdentity():
  x = tf.zeros([4, 3])
  (only,) = microbatch.Split((x,), 1, 0)
  assert only[0] is x
  assert microbatch.Concat([only], 0) is only


def testConcatRejectsScalarCellOutputs():
  with pytest.raises(ValueError, match='returned a scalar'):
    microbatch.Concat([tf.constant(1.0), tf.constant(2.0)], 0)
