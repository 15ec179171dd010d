"""ImageNetInput: ImageNet-format TFRecords, at any resolution.

Each record is a `tf.train.Example` with (the format of TensorFlow's
`build_imagenet_data.py` / the TPU `imagenet_to_gcs.py`):

  image/encoded       bytes: the JPEG (PNG, GIF and BMP decode too)
  image/class/label   int64: the class, 1..1000 there (0 = background)

label = image/class/label - `label_offset` (default 1, for those files).

Training (`augment`) preprocessing is Inception-style: a random crop
covering 8%..100% of the area with aspect ratio 3/4..4/3
(`stateless_sample_distorted_bounding_box`), resized to `image_size`, and a
random left-right flip; both seeded per example, so an input position
reproduces its batches. Evaluation takes the central 87.5% and resizes it.
Images come out float32 in [-1, 1]: NestedMap(image [b, s, s, 3],
label int32 [b]).

Bad data, by policy:
  * a record without `image/encoded` or `image/class/label` fails the
    pipeline with an error naming the file, the record index and the
    missing feature (InvalidArgumentError when iterating);
  * a label outside [0, num_classes) fails likewise, naming the file;
  * an image that does not decode (corrupt or truncated) is handled by
    `corrupt_images`: 'skip' (default) drops it, logs a warning naming the
    file and record, and counts it in `corrupt_records`; 'fail' stops with
    an error naming the file and record. Images are decoded in a
    `tf.py_function` for this, so the policy can see the failure.
"""

import threading

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = ['ImageNetInput', 'CORRUPT_POLICIES', 'IMAGE_KEY', 'LABEL_KEY']

IMAGE_KEY = 'image/encoded'
LABEL_KEY = 'image/class/label'
CORRUPT_POLICIES = ('skip', 'fail')


class ImageNetInput(base_input_generator.BaseInputGenerator):
  """ImageNet TFRecords. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.batch_size = 32
    p.shuffle_buffer_size = 20000
    p.Define(
      'eval_file_pattern',
      '',
      'Files of the evaluation split (validation-*), used by '
      'EvalParams for Dev/Test.',
    )
    p.Define('image_size', 224, 'Output height and width.')
    p.Define('num_classes', 1000, 'Number of classes.')
    p.Define(
      'label_offset',
      1,
      'Subtracted from image/class/label (1 for the standard ImageNet '
      'TFRecords, whose labels are 1..1000).',
    )
    p.Define(
      'augment',
      True,
      'Random resized crop and flip (training); False: central crop.',
    )
    p.Define(
      'area_range',
      (0.08, 1.0),
      "Range of the random crop's fraction of the image area.",
    )
    p.Define(
      'aspect_ratio_range',
      (3.0 / 4.0, 4.0 / 3.0),
      "Range of the random crop's aspect ratio.",
    )
    p.Define('random_flip', True, 'Random left-right flip when augmenting.')
    p.Define(
      'eval_crop_fraction',
      0.875,
      'Fraction of the image side kept by the eval central crop.',
    )
    p.Define(
      'corrupt_images',
      'skip',
      f'{CORRUPT_POLICIES}: drop and count images that do not '
      'decode, or stop with an error naming the file.',
    )
    p.Define('num_parallel_reads', 8, 'Files read in parallel.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    name = f'ImageNetInput {self.path!r}'
    if p.corrupt_images not in CORRUPT_POLICIES:
      raise ValueError(
        f'{name}: corrupt_images = {p.corrupt_images!r}; use '
        f'one of {CORRUPT_POLICIES}.'
      )
    if not isinstance(p.image_size, int) or p.image_size < 1:
      raise ValueError(
        f'{name}: image_size = {p.image_size!r}; use a positive int.'
      )
    if not isinstance(p.num_classes, int) or p.num_classes < 1:
      raise ValueError(
        f'{name}: num_classes = {p.num_classes!r}; use a positive int.'
      )
    if not 0 < p.eval_crop_fraction <= 1:
      raise ValueError(
        f'{name}: eval_crop_fraction = '
        f'{p.eval_crop_fraction!r}; use a value in (0, 1].'
      )
    self._lock = threading.Lock()
    self._corrupt = []

  @classmethod
  def EvalParams(cls, train_params, dataset):
    """The eval split (`eval_file_pattern`): one pass, central crop."""
    p = cls.SetEvalSettings(train_params.Copy())
    if not p.eval_file_pattern:
      raise ValueError(
        f'ImageNetInput.EvalParams({dataset!r}): eval_file_pattern is '
        'empty; set it to the validation files (e.g. ".../validation-*") '
        f'or define {dataset}() with its own file_pattern.'
      )
    p.file_pattern = p.eval_file_pattern
    p.augment = False
    return p

  @property
  def corrupt_records(self):
    """[(file, record index)] of the images skipped so far (a copy)."""
    with self._lock:
      return list(self._corrupt)

  @property
  def num_corrupt(self):
    with self._lock:
      return len(self._corrupt)

  def Files(self):
    """The files matching `file_pattern` (comma-separated globs)."""
    p = self.params
    if not p.file_pattern:
      raise ValueError(
        f'ImageNetInput {self.path!r}: file_pattern is empty; '
        'set it to the TFRecord files, e.g. '
        '"/data/imagenet/train-*".'
      )
    files = []
    for pattern in p.file_pattern.split(','):
      files.extend(sorted(tf.io.gfile.glob(pattern.strip())))
    if not files:
      raise ValueError(
        f'ImageNetInput {self.path!r}: no file matches '
        f'file_pattern = {p.file_pattern!r}.'
      )
    return files

  def _DataSource(self):
    p = self.params
    files = tf.data.Dataset.from_tensor_slices(self.Files())
    if p.shuffle:
      files = files.shuffle(1024, seed=self.seed)

    def Records(filename):
      ds = tf.data.TFRecordDataset(filename).enumerate()
      return ds.map(lambda i, r: NestedMap(file=filename, index=i, record=r))

    return files.interleave(
      Records,
      cycle_length=max(1, p.num_parallel_reads),
      num_parallel_calls=tf.data.AUTOTUNE,
      deterministic=True,
    )

  def _Decode(self, encoded, filename, index):
    """Eager: (uint8 [h, w, 3] or [0, 0, 3], ok) — applies the policy."""
    try:
      image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
      return image, True
    except (tf.errors.InvalidArgumentError, ValueError) as e:
      where = f'{filename.numpy().decode()} (record {int(index)})'
      if self.params.corrupt_images == 'fail':
        raise ValueError(
          f'ImageNetInput: the image in {where} does not decode ({e}); '
          'fix or remove the file, or set corrupt_images = "skip".'
        ) from e
      with self._lock:
        self._corrupt.append((filename.numpy().decode(), int(index)))
      logging.warning('ImageNetInput: skipping the corrupt image in %s.', where)
      return tf.zeros([0, 0, 3], tf.uint8), False

  def _Parse(self, example):
    """(encoded, label int32, ok) with the feature and label checks."""
    p = self.params
    feats = tf.io.parse_single_example(
      example.record,
      {
        IMAGE_KEY: tf.io.VarLenFeature(tf.string),
        LABEL_KEY: tf.io.VarLenFeature(tf.int64),
      },
    )
    encoded, label = feats[IMAGE_KEY].values, feats[LABEL_KEY].values
    checks = []
    for key, values in ((IMAGE_KEY, encoded), (LABEL_KEY, label)):
      checks.append(
        tf.debugging.Assert(
          tf.equal(tf.size(values), 1),
          [
            f'ImageNetInput: the record lacks the feature "{key}" (or holds '
            'several values). File and record index:',
            example.file,
            example.index,
          ],
          summarize=3,
        )
      )
    with tf.control_dependencies(checks):
      label = tf.cast(label[0], tf.int32) - p.label_offset
      encoded = encoded[0]
    in_range = tf.logical_and(label >= 0, label < p.num_classes)
    check = tf.debugging.Assert(
      in_range,
      [
        f'ImageNetInput: label - label_offset ({p.label_offset}) is outside '
        f'[0, {p.num_classes}); set num_classes / label_offset to match the '
        'data. Label, file and record index:',
        label,
        example.file,
        example.index,
      ],
      summarize=3,
    )
    with tf.control_dependencies([check]):
      return tf.identity(encoded), tf.identity(label)

  def _Crop(self, image):
    p = self.params
    shape = tf.shape(image)
    if p.augment:
      begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=self.ExampleSeed('crop'),
        min_object_covered=0.1,
        aspect_ratio_range=list(p.aspect_ratio_range),
        area_range=list(p.area_range),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
      )
      return tf.slice(image, begin, size)
    h, w = shape[0], shape[1]
    frac = p.eval_crop_fraction
    ch = tf.cast(tf.cast(h, tf.float32) * frac, tf.int32)
    cw = tf.cast(tf.cast(w, tf.float32) * frac, tf.int32)
    ch, cw = tf.maximum(ch, 1), tf.maximum(cw, 1)
    return tf.slice(image, [(h - ch) // 2, (w - cw) // 2, 0], [ch, cw, 3])

  def GetDataset(self):
    """Batches, as `BaseInputGenerator.GetDataset`, dropping the records
    whose image does not decode ('skip') before batching."""
    p = self.params
    ds = self._DataSource()
    if p.num_samples and p.num_samples > 0:
      ds = ds.take(p.num_samples)
    if p.shuffle:
      ds = ds.shuffle(
        p.shuffle_buffer_size, seed=self.seed, reshuffle_each_iteration=True
      )
    ds = ds.repeat(p.num_epochs).enumerate()

    def Preprocess(index, example):
      with py_utils.StepSeed(index):
        return self._Preprocess(example)

    ds = ds.map(
      Preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    ds = ds.filter(lambda ex: ex.ok)
    ds = ds.map(lambda ex: NestedMap(image=ex.image, label=ex.label))
    ds = ds.batch(p.batch_size, drop_remainder=(p.remainder == 'drop'))
    if p.remainder == 'pad':
      ds = ds.map(self._Pad)
    ds = ds.map(self._PreprocessBatch)
    return ds.prefetch(tf.data.AUTOTUNE)

  def _Preprocess(self, example):
    p = self.params
    encoded, label = self._Parse(example)
    image, ok = tf.py_function(
      self._Decode, [encoded, example.file, example.index], [tf.uint8, tf.bool]
    )
    image.set_shape([None, None, 3])
    ok.set_shape([])
    # A skipped image becomes a 1x1 black one, filtered out in batching.
    image = tf.cond(ok, lambda: image, lambda: tf.zeros([1, 1, 3], tf.uint8))
    image = self._Crop(image)
    image = tf.image.resize(
      tf.cast(image, tf.float32), [p.image_size, p.image_size]
    )
    if p.augment and p.random_flip:
      image = tf.image.stateless_random_flip_left_right(
        image, self.ExampleSeed('flip')
      )
    image = tf.clip_by_value(image / 127.5 - 1.0, -1.0, 1.0)
    image = tf.ensure_shape(image, [p.image_size, p.image_size, 3])
    return NestedMap(image=image, label=label, ok=ok)
