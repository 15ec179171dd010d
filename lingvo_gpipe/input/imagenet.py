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

The whole pipeline is TensorFlow ops (no `tf.py_function`), so its
iterator is saved in every checkpoint: a resumed run reads the records the
uninterrupted run would have read.

Bad data, by policy. Every message names the file, the record index (and
byte offset where the file itself is damaged), what is wrong and the fix:
  * a record without `image/encoded` or `image/class/label`, or with a label
    outside [0, num_classes), fails the pipeline (InvalidArgumentError when
    iterating): the data and the Params disagree, skipping cannot help;
  * a corrupt record is one whose bytes are damaged: a TFRecord whose
    framing or checksum is broken (a truncated file, a bit flip, a file
    that is not a TFRecord; the rest of that file is unreadable), a record
    that is not a `tf.train.Example`, or an image that does not decode.
    `corrupt_records` = 'skip' (default) drops it and logs one line per
    corrupt record with the running count (the first 20, then at every
    doubling of the count, so the log stays small); 'error' fails with the
    message instead. Skipping is bounded: the pipeline fails once more than
    `max_corrupt_records` records were corrupt and more than
    `max_corrupt_fraction` of the records read so far.
"""

import os

import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = [
  'ImageNetInput',
  'CORRUPT_POLICIES',
  'IMAGE_KEY',
  'LABEL_KEY',
  'ErrorMessage',
]

IMAGE_KEY = 'image/encoded'
LABEL_KEY = 'image/class/label'
CORRUPT_POLICIES = ('skip', 'error')

# Record status codes inside the pipeline.
_OK, _BAD_FRAMING, _NOT_EXAMPLE, _BAD_IMAGE = 0, 1, 2, 3
# Corrupt records logged one by one before the log thins out.
_LOG_FIRST = 20


def ErrorMessage(error):
  """The message of an ImageNetInput check inside a TensorFlow error (the
  text between 'assertion failed: [' and its ']'), or None."""
  message = base_input_generator.CheckMessage(error)
  return message if message and 'ImageNetInput' in message else None


def _Try(fn, arg, fallback):
  """A dataset of one element: fn(arg) + (True,) if `fn` succeeds, else
  fallback + (False,). Only tf.data isolates an op's error this way (and
  keeps the pipeline checkpointable)."""
  fallback = fallback if isinstance(fallback, tuple) else (fallback,)
  return (
    tf.data.Dataset.from_tensors(arg)
    .map(lambda x: tf.nest.flatten(fn(x)) + [tf.constant(True)])
    .ignore_errors()
    .map(lambda *xs: tuple(xs))
    .concatenate(tf.data.Dataset.from_tensors(fallback + (False,)))
    .take(1)
  )


def _Str(x):
  return tf.strings.as_string(x) if x.dtype != tf.string else x


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
    p.Define(
      'use_eval_files',
      False,
      'Read eval_file_pattern instead of file_pattern (set by EvalParams, '
      'so that an override of one pattern changes one split).',
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
      'corrupt_records',
      'skip',
      f'{CORRUPT_POLICIES}: drop, log and count corrupt records (damaged '
      'TFRecord bytes, not a tf.train.Example, an image that does not '
      'decode), or stop with an error naming the file and record.',
    )
    p.Define(
      'max_corrupt_records',
      100,
      "With corrupt_records 'skip': this many corrupt records are always "
      'tolerated; beyond it, max_corrupt_fraction bounds them.',
    )
    p.Define(
      'max_corrupt_fraction',
      0.01,
      "With corrupt_records 'skip': stop with an error once more than "
      'max_corrupt_records records and more than this fraction of the '
      'records read so far were corrupt.',
    )
    p.Define('num_parallel_reads', 8, 'Files read in parallel.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    name = f'ImageNetInput {self.path!r}'
    if p.corrupt_records not in CORRUPT_POLICIES:
      raise ValueError(
        f'{name}: corrupt_records = {p.corrupt_records!r}; use '
        f'one of {CORRUPT_POLICIES}.'
      )
    if not isinstance(p.max_corrupt_records, int) or p.max_corrupt_records < 0:
      raise ValueError(
        f'{name}: max_corrupt_records = {p.max_corrupt_records!r}; use an '
        'int >= 0.'
      )
    if not 0 <= p.max_corrupt_fraction <= 1:
      raise ValueError(
        f'{name}: max_corrupt_fraction = {p.max_corrupt_fraction!r}; use a '
        'value in [0, 1].'
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
    p.use_eval_files = True
    p.augment = False
    return p

  def Files(self):
    """The files matching `file_pattern` (`eval_file_pattern` with
    use_eval_files; comma-separated globs)."""
    p = self.params
    name = 'eval_file_pattern' if p.use_eval_files else 'file_pattern'
    value = p.eval_file_pattern if p.use_eval_files else p.file_pattern
    if not value:
      raise ValueError(
        f'ImageNetInput {self.path!r}: {name} is empty; '
        'set it to the TFRecord files, e.g. '
        '"/data/imagenet/train-*".'
      )
    files = []
    for pattern in value.split(','):
      files.extend(sorted(tf.io.gfile.glob(pattern.strip())))
    if not files:
      raise ValueError(
        f'ImageNetInput {self.path!r}: no file matches {name} = {value!r}.'
      )
    return files

  def _DataSource(self):
    """NestedMap(file, index, offset, record, status) per record.

    A file is read up to its first damaged byte (`ignore_errors`); if the
    records read do not reach the file's size, one extra element with
    status _BAD_FRAMING and the offset of the damage stands for the rest.
    """
    p = self.params
    files = self.Files()
    sizes = [tf.io.gfile.stat(f).length for f in files]
    ds = tf.data.Dataset.from_tensor_slices(
      (files, tf.constant(sizes, tf.int64))
    )
    if p.shuffle:
      ds = ds.shuffle(1024, seed=self.seed)

    def Records(filename, size):
      def Offsets(offset, record):
        # A TFRecord: length (8 bytes), its CRC (4), data, data CRC (4).
        end = offset + 16 + tf.cast(tf.strings.length(record), tf.int64)
        return end, (offset, end, record)

      recs = tf.data.TFRecordDataset(filename).scan(
        tf.constant(0, tf.int64), Offsets
      )
      recs = recs.ignore_errors()
      recs = recs.concatenate(
        tf.data.Dataset.from_tensors(
          (tf.constant(-1, tf.int64), tf.constant(-1, tf.int64), '')
        )
      )

      def Check(state, elem):
        index, end = state
        offset, rec_end, record = elem
        last = tf.equal(offset, -1)
        status = tf.where(
          tf.logical_and(last, tf.not_equal(end, size)), _BAD_FRAMING, _OK
        )
        status = tf.where(last, status, _OK)
        out = NestedMap(
          file=filename,
          index=index,
          offset=tf.where(last, end, offset),
          record=record,
          status=status,
          drop=tf.logical_and(last, tf.equal(status, _OK)),
        )
        return (index + 1, tf.where(last, end, rec_end)), out

      recs = recs.scan(
        (tf.constant(0, tf.int64), tf.constant(0, tf.int64)), Check
      )
      return recs.filter(lambda ex: tf.logical_not(ex.drop)).map(
        lambda ex: NestedMap(
          file=ex.file,
          index=ex.index,
          offset=ex.offset,
          record=ex.record,
          status=ex.status,
        )
      )

    return ds.interleave(
      Records,
      cycle_length=max(1, p.num_parallel_reads),
      num_parallel_calls=tf.data.AUTOTUNE,
      deterministic=True,
    )

  def _Where(self, ex):
    return [
      ex.file,
      ' (record ',
      _Str(ex.index),
      ', byte offset ',
      _Str(ex.offset),
      ')',
    ]

  def _Parse(self, ex):
    """A dataset of one (encoded, label int32, status): a record that is not
    a tf.train.Example gets status _NOT_EXAMPLE, a missing feature or a
    label out of range fails the pipeline."""

    def ParseRaw(record):
      feats = tf.io.parse_single_example(
        record,
        {
          IMAGE_KEY: tf.io.VarLenFeature(tf.string),
          LABEL_KEY: tf.io.VarLenFeature(tf.int64),
        },
      )
      return feats[IMAGE_KEY].values, feats[LABEL_KEY].values

    return _Try(
      ParseRaw,
      ex.record,
      (tf.zeros([0], tf.string), tf.zeros([0], tf.int64)),
    ).map(lambda encoded, label, ok: self._CheckParsed(ex, encoded, label, ok))

  def _CheckParsed(self, ex, encoded, label, parsed_ok):
    p = self.params
    status = tf.where(
      tf.logical_and(tf.equal(ex.status, _OK), tf.logical_not(parsed_ok)),
      _NOT_EXAMPLE,
      ex.status,
    )
    good = tf.equal(status, _OK)
    checks = []
    for key, values in ((IMAGE_KEY, encoded), (LABEL_KEY, label)):
      checks.append(
        tf.debugging.Assert(
          tf.logical_or(tf.logical_not(good), tf.equal(tf.size(values), 1)),
          [
            tf.strings.join(
              ['ImageNetInput: ']
              + self._Where(ex)
              + [
                f' lacks the feature "{key}" (or holds several values); '
                'the files are not ImageNet-format tf.train.Examples: fix '
                'file_pattern or convert the data.'
              ]
            )
          ],
        )
      )
    with tf.control_dependencies(checks):
      label = tf.cast(
        tf.concat([label, tf.zeros([1], tf.int64)], 0)[0], tf.int32
      )
      label -= p.label_offset
      encoded = tf.concat([encoded, tf.constant([''])], 0)[0]
    in_range = tf.logical_and(label >= 0, label < p.num_classes)
    check = tf.debugging.Assert(
      tf.logical_or(tf.logical_not(good), in_range),
      [
        tf.strings.join(
          ['ImageNetInput: ']
          + self._Where(ex)
          + [
            ': label - label_offset = ',
            _Str(label),
            f' is outside [0, {p.num_classes}); set num_classes / '
            f'label_offset (now {p.label_offset}) to match the data.',
          ]
        )
      ],
    )
    with tf.control_dependencies([check]):
      return tf.identity(encoded), tf.identity(label), tf.identity(status)

  def _Decode(self, encoded, status):
    """A dataset of one (uint8 image [h, w, 3], status): _BAD_IMAGE if the
    image does not decode."""

    def Decode(e):
      return tf.io.decode_image(e, channels=3, expand_animations=False)

    return _Try(Decode, encoded, tf.zeros([1, 1, 3], tf.uint8)).map(
      lambda image, ok: self._CheckDecoded(image, ok, status)
    )

  def _CheckDecoded(self, image, ok, status):
    status = tf.where(
      tf.logical_and(tf.equal(status, _OK), tf.logical_not(ok)),
      _BAD_IMAGE,
      status,
    )
    image = tf.cond(
      tf.equal(status, _OK),
      lambda: image,
      lambda: tf.zeros([1, 1, 3], tf.uint8),
    )
    return image, status

  def _Problem(self, ex, status):
    """The string tensor saying what is wrong with a corrupt record."""
    framing = tf.strings.join(
      [
        ex.file,
        ': damaged TFRecord data at byte offset ',
        _Str(ex.offset),
        tf.where(
          tf.equal(ex.index, 0),
          ' (before the first record',
          tf.strings.join([' (after record ', _Str(ex.index - 1)]),
        ),
        tf.where(
          tf.equal(ex.offset, 0),
          '; this file is not a TFRecord of tf.train.Example',
          '; the file is truncated or corrupt, the rest of it is unreadable',
        ),
        ')',
      ]
    )
    where = tf.strings.join(self._Where(ex))
    not_example = tf.strings.join(
      [
        where,
        ' is not a tf.train.Example (this file is not a TFRecord of '
        'tf.train.Example)',
      ]
    )
    bad_image = tf.strings.join([where, ': the image does not decode'])
    return tf.switch_case(
      tf.cast(status, tf.int32) - 1,
      [lambda: framing, lambda: not_example, lambda: bad_image],
    )

  def _Account(self, state, ex):
    """The scan over every record: counts, logs and bounds corrupt ones."""
    p = self.params
    seen, bad = state
    seen += 1
    corrupt = tf.not_equal(ex.status, _OK)
    bad += tf.cast(corrupt, tf.int64)
    ops = []
    if p.corrupt_records == 'error':
      ops.append(
        tf.debugging.Assert(
          tf.logical_not(corrupt),
          [
            tf.strings.join(
              [
                'ImageNetInput: ',
                self._Problem(ex, tf.maximum(ex.status, 1)),
                '. Fix or remove the file, or skip corrupt records with '
                "input.corrupt_records : 'skip'.",
              ]
            )
          ],
        )
      )
    else:
      frac = p.max_corrupt_fraction
      too_many = tf.logical_and(
        bad > p.max_corrupt_records,
        tf.cast(bad, tf.float64) > frac * tf.cast(seen, tf.float64),
      )
      ops.append(
        tf.debugging.Assert(
          tf.logical_not(too_many),
          [
            tf.strings.join(
              [
                'ImageNetInput: ',
                _Str(bad),
                ' of the ',
                _Str(seen),
                ' records read are corrupt, more than max_corrupt_records ('
                f'{p.max_corrupt_records}) and max_corrupt_fraction '
                f'({frac:g}); the last: ',
                self._Problem(ex, tf.maximum(ex.status, 1)),
                '. Fix the data (or file_pattern), or raise '
                'input.max_corrupt_fraction.',
              ]
            )
          ],
        )
      )
      is_pow2 = tf.equal(tf.bitwise.bitwise_and(bad, bad - 1), 0)
      log = tf.logical_and(corrupt, tf.logical_or(bad <= _LOG_FIRST, is_pow2))

      def Log():
        tf.print(
          tf.strings.join(
            [
              'W ImageNetInput: skipping a corrupt record: ',
              self._Problem(ex, tf.maximum(ex.status, 1)),
              ' (corrupt records so far: ',
              _Str(bad),
              ' of ',
              _Str(seen),
              '; logged one by one up to ',
              str(_LOG_FIRST),
              ', then at every doubling).',
            ]
          ),
          output_stream='file:///dev/stderr',
        )
        return tf.constant(True)

      ops.append(tf.cond(log, Log, lambda: tf.constant(False)))
    with tf.control_dependencies(ops):
      return (seen, bad), tf.logical_not(corrupt)

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
    """Batches, as `BaseInputGenerator.GetDataset`, with the corrupt records
    counted and dropped ('skip') before batching."""
    p = self.params
    ds = self._DataSource()
    if p.num_samples and p.num_samples > 0:
      ds = ds.take(p.num_samples)
    if p.shuffle:
      ds = ds.shuffle(
        p.shuffle_buffer_size, seed=self.seed, reshuffle_each_iteration=True
      )
    ds = ds.repeat(p.num_epochs).enumerate()

    def Examine(index, ex):
      where = NestedMap(file=ex.file, index=ex.index, offset=ex.offset)
      return self._Parse(ex).flat_map(
        lambda encoded, label, status: self._Decode(encoded, status).map(
          lambda image, status: (index, where, image, label, status)
        )
      )

    # Each record is parsed and decoded in one-element datasets of its own,
    # whose `ignore_errors` turns a failure into a status; the deterministic
    # interleave keeps the order.
    ds = ds.interleave(
      Examine,
      cycle_length=max(4, os.cpu_count() or 1),  # Records decoded at once.
      num_parallel_calls=tf.data.AUTOTUNE,
      deterministic=True,
    )

    def Account(state, elem):
      index, ex, image, label, status = elem
      ex = NestedMap(
        file=ex.file, index=ex.index, offset=ex.offset, status=status
      )
      state, keep = self._Account(state, ex)
      return state, (index, image, label, keep)

    ds = ds.scan((tf.constant(0, tf.int64), tf.constant(0, tf.int64)), Account)
    ds = ds.filter(lambda index, image, label, keep: keep)

    def Preprocess(index, image, label, keep):
      del keep
      with py_utils.StepSeed(index):
        return self._Preprocess(image, label)

    ds = ds.map(
      Preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    ds = ds.batch(p.batch_size, drop_remainder=(p.remainder == 'drop'))
    if p.remainder == 'pad':
      ds = ds.map(self._Pad)
    ds = ds.map(self._PreprocessBatch)
    return self._Finish(ds)

  def _Preprocess(self, image, label):
    p = self.params
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
    return NestedMap(image=image, label=label)
