"""DigitsInput: scikit-learn's bundled handwritten digits, fully offline.

1,797 grayscale 8x8 images of the digits 0-9 (`sklearn.datasets.load_digits`,
shipped inside scikit-learn, no download). A fixed permutation (seeded by
`split_seed`) splits them into train / dev / test of 1,437 / 180 / 180
examples, the same on every machine and run.

Batches are NestedMap(image=float32 [b, s, s, 1] in [0, 1], label=int32 [b])
with s = `image_size` (8, or larger by bilinear resizing for conv nets), plus
`weight` float32 [b] for eval inputs (see `BaseInputGenerator`). Training can
use a small random translation (`random_translate` pixels, off by default);
there is no random flip, which would turn digits into other symbols.

  p = DigitsInput.Params().Set(split='train', batch_size=64)
  dev = DigitsInput.EvalParams(p, 'Dev')   # split='dev', one padded pass
"""

import functools

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = ['DigitsInput', 'SPLIT_SIZES', 'NUM_CLASSES', 'LoadSplit']

NUM_EXAMPLES = 1797
NUM_CLASSES = 10
SPLIT_SIZES = {'train': 1437, 'dev': 180, 'test': 180}
_RAW_SIZE = 8
_MAX_PIXEL = 16.0


@functools.lru_cache(maxsize=1)
def _LoadAll():
  """(images float32 [1797, 8, 8] in [0, 1], labels int32 [1797])."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top

  digits = datasets.load_digits()
  images = np.asarray(digits.images, np.float32) / _MAX_PIXEL
  labels = np.asarray(digits.target, np.int32)
  if images.shape != (NUM_EXAMPLES, _RAW_SIZE, _RAW_SIZE):
    raise ValueError(
      f'Unexpected digits data of shape {images.shape}; '
      f'expected ({NUM_EXAMPLES}, 8, 8). Check scikit-learn.'
    )
  return images, labels


def LoadSplit(split, split_seed=1234):
  """(images float32 [n, 8, 8, 1], labels int32 [n]) of one split."""
  if split not in SPLIT_SIZES:
    raise ValueError(
      f'Unknown digits split {split!r}; use one of {sorted(SPLIT_SIZES)}.'
    )
  images, labels = _LoadAll()
  perm = np.random.RandomState(split_seed).permutation(NUM_EXAMPLES)
  start = 0
  for name in ('train', 'dev', 'test'):
    if name == split:
      break
    start += SPLIT_SIZES[name]
  idx = perm[start : start + SPLIT_SIZES[split]]
  return images[idx][..., None], labels[idx]


class DigitsInput(base_input_generator.BaseInputGenerator):
  """The handwritten digits data set. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.batch_size = 64
    p.shuffle_buffer_size = 2048
    p.Define('split', 'train', 'Which split: "train", "dev" or "test".')
    p.Define(
      'split_seed',
      1234,
      'Seed of the fixed permutation that defines the splits; keep it '
      'fixed so dev/test never overlap train.',
    )
    p.Define(
      'image_size',
      _RAW_SIZE,
      'Side of the output images; > 8 resizes bilinearly (for conv nets).',
    )
    p.Define(
      'random_translate',
      0,
      'If > 0, shift each image by up to this many pixels (of the '
      '8x8 original) in each direction, zero-filled. Training only.',
    )
    p.Define('num_classes', NUM_CLASSES, 'Number of classes (fixed: 10).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.split not in SPLIT_SIZES:
      raise ValueError(
        f'DigitsInput {self.path!r}: split = {p.split!r}; use '
        f'one of {sorted(SPLIT_SIZES)}.'
      )
    if not isinstance(p.image_size, int) or p.image_size < _RAW_SIZE:
      raise ValueError(
        f'DigitsInput {self.path!r}: image_size = '
        f'{p.image_size!r}; use an int >= 8.'
      )
    if not 0 <= p.random_translate < _RAW_SIZE:
      raise ValueError(
        f'DigitsInput {self.path!r}: random_translate = '
        f'{p.random_translate!r}; use 0 (off) to 7 pixels.'
      )
    if p.num_classes != NUM_CLASSES:
      raise ValueError(
        f'DigitsInput {self.path!r}: num_classes = '
        f'{p.num_classes}; the digits have exactly 10.'
      )

  @classmethod
  def EvalParams(cls, train_params, dataset):
    """Params of the 'Dev'/'Test' split: one pass, unshuffled, padded."""
    split = dataset.lower()
    if split not in SPLIT_SIZES:
      raise ValueError(
        f'DigitsInput has no dataset {dataset!r}; use Train, Dev or Test.'
      )
    p = cls.SetEvalSettings(train_params.Copy())
    p.split = split
    p.random_translate = 0
    return p

  @property
  def num_examples(self):
    """Examples in this split (before num_samples)."""
    n = SPLIT_SIZES[self.params.split]
    return min(n, self.params.num_samples) if self.params.num_samples else n

  def _DataSource(self):
    images, labels = LoadSplit(self.params.split, self.params.split_seed)
    return tf.data.Dataset.from_tensor_slices(
      NestedMap(image=images, label=labels)
    )

  def _Preprocess(self, example):
    p = self.params
    image = example.image
    t = p.random_translate
    if t:
      padded = tf.pad(image, [[t, t], [t, t], [0, 0]])
      offset = tf.random.stateless_uniform(
        [2],
        self.ExampleSeed('translate'),
        minval=0,
        maxval=2 * t + 1,
        dtype=tf.int32,
      )
      image = tf.slice(
        padded, tf.concat([offset, [0]], 0), [_RAW_SIZE, _RAW_SIZE, 1]
      )
    if p.image_size != _RAW_SIZE:
      image = tf.image.resize(
        image, [p.image_size, p.image_size], method='bilinear'
      )
    image = tf.ensure_shape(image, [p.image_size, p.image_size, 1])
    return NestedMap(image=image, label=example.label)
