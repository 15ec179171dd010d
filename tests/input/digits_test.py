"""Tests for DigitsInput and BaseInputGenerator."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.input import digits


def _Gen(**kwargs):
  return digits.DigitsInput.Params().Set(**kwargs).Instantiate()


def _Rows(images, labels):
  return sorted(
    img.tobytes() + bytes([int(lab)]) for img, lab in zip(images, labels)
  )


def testSplitsAreFixedDisjointAndCoverTheData():
  parts = {s: digits.LoadSplit(s) for s in ('train', 'dev', 'test')}
  assert {s: len(p[1]) for s, p in parts.items()} == digits.SPLIT_SIZES
  all_images, all_labels = digits._LoadAll()  # pylint: disable=protected-access
  union = sum((_Rows(*p) for p in parts.values()), [])
  assert sorted(union) == _Rows(all_images[..., None], all_labels)
  again = digits.LoadSplit('dev')
  np.testing.assert_array_equal(again[1], parts['dev'][1])
  other = digits.LoadSplit('dev', split_seed=7)
  assert not np.array_equal(other[1], parts['dev'][1])


def testTrainBatches():
  gen = _Gen(split='train', batch_size=32)
  batch = gen.GetPreprocessedInputBatch()
  assert isinstance(batch, NestedMap)
  assert sorted(batch) == ['image', 'label']
  assert batch.image.shape == (32, 8, 8, 1)
  assert batch.image.dtype == tf.float32 and batch.label.dtype == tf.int32
  assert gen.GetDataset().element_spec.image.shape.as_list() == [32, 8, 8, 1]
  assert 0.0 <= float(tf.reduce_min(batch.image))
  assert float(tf.reduce_max(batch.image)) <= 1.0
  assert gen.InfeedBatchSize() == 32 and gen.GlobalBatchSize() == 32


def testShufflingIsDeterministicBySeed():
  a = _Gen(batch_size=16).GetPreprocessedInputBatch()
  b = _Gen(batch_size=16).GetPreprocessedInputBatch()
  c = _Gen(batch_size=16, seed=5).GetPreprocessedInputBatch()
  np.testing.assert_array_equal(a.label.numpy(), b.label.numpy())
  assert not np.array_equal(a.image.numpy(), c.image.numpy())


def testEvalParamsOnePaddedPass():
  train_p = digits.DigitsInput.Params().Set(batch_size=64, random_translate=2)
  dev_p = digits.DigitsInput.EvalParams(train_p, 'Dev')
  assert (
    dev_p.split,
    dev_p.num_epochs,
    dev_p.shuffle,
    dev_p.remainder,
    dev_p.random_translate,
  ) == ('dev', 1, False, 'pad', 0)
  batches = list(dev_p.Instantiate().GetDataset())
  assert len(batches) == 3
  for b in batches:
    assert b.image.shape == (64, 8, 8, 1) and b.weight.shape == (64,)
  weights = np.concatenate([b.weight.numpy() for b in batches])
  assert weights.sum() == 180
  last = batches[-1]
  assert last.weight.numpy()[:52].all() and not last.weight.numpy()[52:].any()
  assert not last.image.numpy()[52:].any()
  labels = np.concatenate(
    [b.label.numpy()[b.weight.numpy() > 0] for b in batches]
  )
  np.testing.assert_array_equal(labels, digits.LoadSplit('dev')[1])
  with pytest.raises(ValueError, match='no dataset'):
    digits.DigitsInput.EvalParams(train_p, 'Validation')


def testResizeAndTranslate():
  big = _Gen(batch_size=8, image_size=16, shuffle=False)
  assert big.GetPreprocessedInputBatch().image.shape == (8, 16, 16, 1)
  plain = _Gen(batch_size=64, shuffle=False).GetPreprocessedInputBatch()
  moved1 = _Gen(
    batch_size=64, shuffle=False, random_translate=2
  ).GetPreprocessedInputBatch()
  moved2 = _Gen(
    batch_size=64, shuffle=False, random_translate=2
  ).GetPreprocessedInputBatch()
  assert moved1.image.shape == (64, 8, 8, 1)
  np.testing.assert_array_equal(moved1.image.numpy(), moved2.image.numpy())
  np.testing.assert_array_equal(moved1.label.numpy(), plain.label.numpy())
  assert not np.array_equal(moved1.image.numpy(), plain.image.numpy())


def testNumSamplesEpochsAndReset():
  gen = _Gen(
    batch_size=10, num_samples=25, num_epochs=1, shuffle=False, remainder='keep'
  )
  sizes = [int(b.label.shape[0]) for b in gen.GetDataset()]
  assert sizes == [10, 10, 5]
  assert gen.num_examples == 25
  first = gen.GetPreprocessedInputBatch()
  gen.GetPreprocessedInputBatch()
  gen.GetPreprocessedInputBatch()
  with pytest.raises(StopIteration):
    gen.GetPreprocessedInputBatch()
  gen.Reset()
  np.testing.assert_array_equal(
    gen.GetPreprocessedInputBatch().label, first.label
  )


def testIteratorCheckpointRoundTrip(tmp_path):
  gen = _Gen(batch_size=16, random_translate=1)
  ckpt = tf.train.Checkpoint(iterator=gen.iterator)
  gen.GetPreprocessedInputBatch()
  path = ckpt.save(str(tmp_path / 'it'))
  want = gen.GetPreprocessedInputBatch()
  gen.GetPreprocessedInputBatch()
  ckpt.restore(path)
  got = gen.GetPreprocessedInputBatch()
  np.testing.assert_array_equal(got.image.numpy(), want.image.numpy())


def testIteratorNotTrackedByTheLayer(tmp_path):
  gen = _Gen(batch_size=4)
  gen.GetPreprocessedInputBatch()
  assert not gen.variables
  path = tf.train.Checkpoint(layer=gen).save(str(tmp_path / 'layer'))
  names = [name for name, _ in tf.train.list_variables(path)]
  assert not [n for n in names if 'iterator' in n], names


def testErrors():
  with pytest.raises(ValueError, match='split'):
    _Gen(split='validation')
  with pytest.raises(ValueError, match='batch_size'):
    _Gen(batch_size=0)
  with pytest.raises(ValueError, match='remainder'):
    _Gen(remainder='truncate')
  with pytest.raises(ValueError, match='image_size'):
    _Gen(image_size=4)
  base = base_input_generator.BaseInputGenerator.Params().Set(batch_size=2)
  with pytest.raises(NotImplementedError, match='_DataSource'):
    base.Instantiate().GetDataset()
  with pytest.raises(NotImplementedError, match='define Dev'):
    base_input_generator.BaseInputGenerator.EvalParams(base, 'Dev')
