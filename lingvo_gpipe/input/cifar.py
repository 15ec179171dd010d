"""CifarInput: CIFAR-10 and CIFAR-100 from their standard binary files.

The binary versions (https://www.cs.toronto.edu/~kriz/cifar.html) hold
fixed-length records, images as 3 planes (R, G, B) of 32x32 bytes, row-major:

  CIFAR-10   cifar-10-batches-bin/data_batch_{1..5}.bin, test_batch.bin
             record = <1 byte label 0..9> <3072 bytes image>
  CIFAR-100  cifar-100-binary/train.bin, test.bin
             record = <1 byte coarse 0..19> <1 byte fine 0..99> <3072 bytes>

`data_dir` is the directory holding those files (or set `file_pattern`).
A file whose size is not a multiple of the record size (e.g. a CIFAR-100
file read as CIFAR-10) is refused naming the file; a label outside
[0, num_classes) fails the pipeline with an error naming the file and label.

Batches: NestedMap(image=float32 [b, s, s, c] in [-1, 1] (the ImageNet
input's scaling, so an ImageNet model fine-tunes on them), label=int32 [b])
with s = `image_size` (bilinear resize of the 32x32 images, e.g. 480 to
fine-tune the GPipe paper's AmoebaNet-B) and c = 3 (1 with `grayscale`).
Training augmentation: a random 32x32 crop of the image zero-padded by
`crop_padding` pixels, and a random left-right flip, both stateless and
seeded per example.

  p = CifarInput.Params().Set(dataset='cifar10', data_dir='/data/cifar10',
                              batch_size=128)
  dev = CifarInput.EvalParams(p, 'Dev')   # the test split, one padded pass
"""

import os

import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = ['CifarInput', 'DATASETS', 'RecordLayout']

DATASETS = ('cifar10', 'cifar100')
_SIZE = 32
_IMAGE_BYTES = _SIZE * _SIZE * 3
_FILES = {
  ('cifar10', 'train'): [f'data_batch_{i}.bin' for i in range(1, 6)],
  ('cifar10', 'test'): ['test_batch.bin'],
  ('cifar100', 'train'): ['train.bin'],
  ('cifar100', 'test'): ['test.bin'],
}


def RecordLayout(dataset, label_type='fine'):
  """(record bytes, label byte offset, num_classes) of a dataset."""
  if dataset == 'cifar10':
    return 1 + _IMAGE_BYTES, 0, 10
  if dataset == 'cifar100':
    if label_type == 'coarse':
      return 2 + _IMAGE_BYTES, 0, 20
    return 2 + _IMAGE_BYTES, 1, 100
  raise ValueError(f'Unknown CIFAR dataset {dataset!r}; use one of {DATASETS}.')


class CifarInput(base_input_generator.BaseInputGenerator):
  """CIFAR-10/100 binary files. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.batch_size = 128
    p.shuffle_buffer_size = 10000
    p.Define('dataset', 'cifar10', f'One of {DATASETS}.')
    p.Define(
      'data_dir',
      '',
      'Directory of the standard binary files; used when '
      'file_pattern is empty.',
    )
    p.Define('split', 'train', '"train" or "test" (selects the files).')
    p.Define(
      'label_type',
      'fine',
      'CIFAR-100 only: "fine" (100 classes) or "coarse" (20).',
    )
    p.Define(
      'num_classes',
      None,
      "None: the dataset's (10, 100 or 20); if set it must match.",
    )
    p.Define('image_size', _SIZE, 'Output height and width (resized).')
    p.Define('grayscale', False, 'True: 1-channel grayscale images.')
    p.Define(
      'augment',
      True,
      'Random crop (after padding) and flip; EvalParams turns it off.',
    )
    p.Define('crop_padding', 4, 'Zero padding before the random 32x32 crop.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    name = f'CifarInput {self.path!r}'
    if p.dataset not in DATASETS:
      raise ValueError(
        f'{name}: dataset = {p.dataset!r}; use one of {DATASETS}.'
      )
    if p.split not in ('train', 'test'):
      raise ValueError(f'{name}: split = {p.split!r}; use "train" or "test".')
    if p.label_type not in ('fine', 'coarse'):
      raise ValueError(
        f'{name}: label_type = {p.label_type!r}; use "fine" or "coarse".'
      )
    self._record_bytes, self._label_offset, n = RecordLayout(
      p.dataset, p.label_type
    )
    if p.num_classes is not None and p.num_classes != n:
      raise ValueError(
        f'{name}: num_classes = {p.num_classes} but '
        f'{p.dataset} ({p.label_type}) has {n}; leave it None.'
      )
    self._num_classes = n
    if not isinstance(p.image_size, int) or p.image_size < 1:
      raise ValueError(
        f'{name}: image_size = {p.image_size!r}; use a positive int.'
      )
    if not p.file_pattern and not p.data_dir:
      raise ValueError(
        f'{name}: set data_dir (the directory of the CIFAR '
        'binary files) or file_pattern.'
      )

  @property
  def num_classes(self):
    return self._num_classes

  @classmethod
  def EvalParams(cls, train_params, dataset):
    """The test split, one pass, unshuffled, padded ('Dev' and 'Test')."""
    if dataset.lower() not in ('dev', 'test'):
      raise ValueError(
        f'CifarInput has no dataset {dataset!r}; CIFAR has a '
        'train and a test split: use Train, Dev or Test.'
      )
    p = cls.SetEvalSettings(train_params.Copy())
    p.split = 'test'
    p.augment = False
    if p.file_pattern:
      raise ValueError(
        'CifarInput.EvalParams: the training input sets file_pattern = '
        f'{p.file_pattern!r}, so the test files are unknown; set data_dir '
        'instead, or define Dev()/Test() with their own file_pattern.'
      )
    return p

  def Files(self):
    """The data files, checked to exist and to hold whole records."""
    p = self.params
    if p.file_pattern:
      files = []
      for pattern in p.file_pattern.split(','):
        files.extend(sorted(tf.io.gfile.glob(pattern.strip())))
      where = f'file_pattern = {p.file_pattern!r}'
    else:
      files = [
        os.path.join(p.data_dir, f) for f in _FILES[(p.dataset, p.split)]
      ]
      missing = [f for f in files if not tf.io.gfile.exists(f)]
      if missing:
        raise ValueError(
          f'CifarInput: {missing} not found; data_dir = {p.data_dir!r} must '
          f'hold the {p.dataset} binary files {_FILES[(p.dataset, p.split)]}'
          ' (e.g. the extracted cifar-10-batches-bin / cifar-100-binary).'
        )
      where = f'data_dir = {p.data_dir!r}'
    if not files:
      raise ValueError(f'CifarInput: no file matches {where}.')
    for f in files:
      size = tf.io.gfile.stat(f).length
      if size == 0 or size % self._record_bytes:
        raise ValueError(
          f'CifarInput: {f} has {size} bytes, not a positive multiple of '
          f'the {self._record_bytes}-byte {p.dataset} record; is it a '
          f'{"CIFAR-100" if p.dataset == "cifar10" else "CIFAR-10"} file? '
          'Set p.dataset to match the files.'
        )
    return files

  def _DataSource(self):
    files = self.Files()
    record_bytes = self._record_bytes

    def Records(filename):
      ds = tf.data.FixedLengthRecordDataset(filename, record_bytes)
      return ds.map(lambda r: NestedMap(file=filename, record=r))

    return tf.data.Dataset.from_tensor_slices(files).interleave(
      Records, cycle_length=1, num_parallel_calls=1, deterministic=True
    )

  def _Preprocess(self, example):
    p = self.params
    raw = tf.io.decode_raw(example.record, tf.uint8)
    label = tf.cast(raw[self._label_offset], tf.int32)
    ok = tf.debugging.Assert(
      label < self._num_classes,
      [
        f'CifarInput: label out of [0, {self._num_classes}) for {p.dataset} '
        f'({p.label_type}); the file holds other data (set p.dataset / '
        'p.label_type). Label and file:',
        label,
        example.file,
      ],
      summarize=2,
    )
    start = self._record_bytes - _IMAGE_BYTES
    image = tf.reshape(raw[start:], [3, _SIZE, _SIZE])
    image = tf.transpose(image, [1, 2, 0])
    image = tf.cast(image, tf.float32) / 127.5 - 1.0
    if p.augment:
      pad = p.crop_padding
      if pad:
        image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
      image = tf.image.stateless_random_crop(
        image, [_SIZE, _SIZE, 3], self.ExampleSeed('crop')
      )
      image = tf.image.stateless_random_flip_left_right(
        image, self.ExampleSeed('flip')
      )
    if p.grayscale:
      image = tf.image.rgb_to_grayscale(image)
    if p.image_size != _SIZE:
      image = tf.image.resize(image, [p.image_size, p.image_size])
    channels = 1 if p.grayscale else 3
    image = tf.ensure_shape(image, [p.image_size, p.image_size, channels])
    with tf.control_dependencies([ok]):
      label = tf.identity(label)
    return NestedMap(image=image, label=label)
