"""CifarInput on tiny CIFAR-10/100 binary files written here."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.input import cifar


def _Images(n, seed):
  return np.random.RandomState(seed).randint(0, 256, [n, 3, 32, 32], np.uint8)


def WriteCifar10(path, labels, seed=0):
  """Writes a CIFAR-10 binary file; returns the images [n, 32, 32, 3]."""
  images = _Images(len(labels), seed)
  with open(path, 'wb') as f:
    for label, img in zip(labels, images):
      f.write(bytes([label]) + img.tobytes())
  return images.transpose(0, 2, 3, 1)


def WriteCifar100(path, coarse, fine, seed=0):
  images = _Images(len(fine), seed)
  with open(path, 'wb') as f:
    for c, label, img in zip(coarse, fine, images):
      f.write(bytes([c, label]) + img.tobytes())
  return images.transpose(0, 2, 3, 1)


def testCifar10LayoutAndEvalSplit(tmp_path):
  for i in range(1, 6):
    WriteCifar10(tmp_path / f'data_batch_{i}.bin', [i, i + 1], seed=i)
  test_images = WriteCifar10(tmp_path / 'test_batch.bin', [3, 9, 0], seed=9)
  p = cifar.CifarInput.Params().Set(
    data_dir=str(tmp_path), batch_size=4, num_epochs=1, seed=1
  )
  batches = list(p.Instantiate().GetDataset())
  assert len(batches) == 2  # 10 examples, remainder dropped.
  labels = sorted(np.concatenate([b.label.numpy() for b in batches]))
  assert set(labels) <= set(range(1, 7))
  assert batches[0].image.shape == [4, 32, 32, 3]
  dev = cifar.CifarInput.EvalParams(p, 'Dev')
  assert dev.split == 'test' and not dev.augment and not dev.shuffle
  (b,) = list(dev.Instantiate().GetDataset())
  np.testing.assert_array_equal(b.label.numpy(), [3, 9, 0, 0])
  np.testing.assert_array_equal(b.weight.numpy(), [1, 1, 1, 0])
  # Planes R, G, B -> HWC, scaled to [-1, 1], not augmented.
  np.testing.assert_allclose(
    b.image.numpy()[:3], test_images / 127.5 - 1.0, atol=1e-6
  )


def testCifar100FineCoarseResizeGrayscale(tmp_path):
  images = WriteCifar100(tmp_path / 'train.bin', [1, 19], [42, 99])
  p = cifar.CifarInput.Params().Set(
    dataset='cifar100',
    data_dir=str(tmp_path),
    batch_size=2,
    num_epochs=1,
    augment=False,
    shuffle=False,
    image_size=48,
    grayscale=True,
  )
  gen = p.Instantiate()
  assert gen.num_classes == 100
  (b,) = list(gen.GetDataset())
  np.testing.assert_array_equal(b.label.numpy(), [42, 99])
  assert b.image.shape == [2, 48, 48, 1]
  gray = tf.image.rgb_to_grayscale(images / 127.5 - 1.0)
  want = tf.image.resize(tf.cast(gray, tf.float32), [48, 48])
  np.testing.assert_allclose(b.image.numpy(), want.numpy(), atol=1e-4)
  coarse = p.Copy().Set(label_type='coarse').Instantiate()
  assert coarse.num_classes == 20
  (b,) = list(coarse.GetDataset())
  np.testing.assert_array_equal(b.label.numpy(), [1, 19])


def testTrainingAugmentationIsSeeded(tmp_path):
  WriteCifar10(tmp_path / 'train.bin', list(range(8)))
  p = cifar.CifarInput.Params().Set(
    file_pattern=str(tmp_path / 'train.bin'),
    batch_size=8,
    num_epochs=1,
    shuffle=False,
    seed=5,
  )
  a = next(iter(p.Instantiate().GetDataset())).image.numpy()
  b = next(iter(p.Instantiate().GetDataset())).image.numpy()
  c = next(iter(p.Copy().Set(seed=6).Instantiate().GetDataset())).image
  plain = next(iter(p.Copy().Set(augment=False).Instantiate().GetDataset()))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c.numpy())
  assert not np.array_equal(a, plain.image.numpy())


def testErrorsNameTheFile(tmp_path):
  path = tmp_path / 'train.bin'
  WriteCifar100(path, [0, 1, 2], [3, 4, 5])
  p = cifar.CifarInput.Params().Set(file_pattern=str(path), batch_size=1)
  with pytest.raises(
    ValueError,
    match=r'train.bin has 9222 bytes, not a '
    r'positive multiple of the 3073-byte cifar10 record; is '
    r'it a CIFAR-100 file\?',
  ):
    p.Instantiate().GetDataset()
  bad = tmp_path / 'labels.bin'
  WriteCifar10(bad, [1, 200])
  p = cifar.CifarInput.Params().Set(
    file_pattern=str(bad), batch_size=1, num_epochs=1, shuffle=False
  )
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r'label out of \[0, 10\).*labels.bin'
  ):
    list(p.Instantiate().GetDataset())
  with pytest.raises(
    ValueError,
    match=r'not found; data_dir = .* must hold '
    r"the cifar10 binary files \['test_batch.bin'\]",
  ):
    cifar.CifarInput.EvalParams(
      cifar.CifarInput.Params().Set(data_dir=str(tmp_path)), 'Test'
    ).Instantiate().GetDataset()
  with pytest.raises(ValueError, match='set data_dir'):
    cifar.CifarInput.Params().Instantiate()
  with pytest.raises(ValueError, match="dataset = 'cifar1000'"):
    cifar.CifarInput.Params().Set(
      dataset='cifar1000', data_dir='x'
    ).Instantiate()
