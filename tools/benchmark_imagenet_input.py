r"""Benchmarks the ImageNet input pipeline alone: records/s, no model.

  python tools/benchmark_imagenet_input.py --json=/tmp/imagenet_input.json
  python tools/benchmark_imagenet_input.py --file_pattern='/data/train-*'

Without --file_pattern it first writes --records generated JPEGs of
--height x --width (smooth colour fields with noise: at 375x500 about 100 KB
each, near the ~110 KB mean of ImageNet's training JPEGs) into --files
ImageNet-format TFRecord files under
--data_dir (default: a temporary directory, removed at the end).

Two pipelines read the same files and make the same batches (a random
crop of 8%..100% of the area resized to --image_size and a flip, as in
training, or with --augment=0 the central crop of evaluation):

  imagenet_input   lingvo_gpipe.input.imagenet.ImageNetInput: each record
                   parsed and decoded in a one-element dataset of its own,
                   so that a corrupt record is named, counted and skipped
                   (docs/reliability.md), and the iterator checkpointable;
  plain            TFRecordDataset -> parse -> decode_jpeg -> crop/resize,
                   one parallel map: what the same work costs without the
                   per-record guard (a corrupt record stops it).

Each pipeline is read for --warmup batches (filling the shuffle buffer,
starting the threads), then for --batches batches timed; --rounds rounds,
alternating the pipelines, and the median is reported: records/s and
encoded MB/s. tf.data uses every core of the host (AUTOTUNE); the table
names the host's cores, and the figures move with other load on it.
--tf_data_autotune=0 turns tf.data's autotuning off in both pipelines
(`base_input_generator.TF_DATA_AUTOTUNE`).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from lingvo_gpipe.core import base_input_generator  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.input import imagenet  # pylint: disable=g-import-not-at-top

PIPELINES = ('imagenet_input', 'plain')


def _Image(rs, height, width):
  """A smooth random colour field with noise, uint8 [height, width, 3]."""
  low = rs.uniform(0, 255, [1, max(2, height // 48), max(2, width // 48), 3])
  image = tf.image.resize(low.astype(np.float32), [height, width])[0].numpy()
  image += rs.normal(0.0, 20.0, image.shape)
  return np.clip(image, 0, 255).astype(np.uint8)


def _Example(encoded, label):
  return tf.train.Example(
    features=tf.train.Features(
      feature={
        imagenet.IMAGE_KEY: tf.train.Feature(
          bytes_list=tf.train.BytesList(value=[encoded])
        ),
        imagenet.LABEL_KEY: tf.train.Feature(
          int64_list=tf.train.Int64List(value=[label])
        ),
      }
    )
  ).SerializeToString()


def WriteRecords(directory, records, files, height, width, seed=0):
  """Writes `records` generated JPEG examples (labels 1..1000) into `files`
  TFRecord files train-<k>-of-<files>; returns their glob pattern."""
  rs = np.random.RandomState(seed)
  os.makedirs(directory, exist_ok=True)
  writers = [
    tf.io.TFRecordWriter(
      os.path.join(directory, f'train-{k:05d}-of-{files:05d}')
    )
    for k in range(files)
  ]
  try:
    for i in range(records):
      jpeg = tf.io.encode_jpeg(_Image(rs, height, width), quality=90)
      writers[i % files].write(_Example(jpeg.numpy(), 1 + i % 1000))
  finally:
    for w in writers:
      w.close()
  return os.path.join(directory, 'train-*')


def _Params(args, pattern):
  return imagenet.ImageNetInput.Params().Set(
    name='imagenet_input',
    file_pattern=pattern,
    batch_size=args.batch_size,
    image_size=args.image_size,
    num_classes=1000,
    augment=bool(args.augment),
    shuffle_buffer_size=args.shuffle_buffer,
    seed=1,
  )


def PlainDataset(args, pattern):
  """The same batches without the per-record guard."""
  size = args.image_size
  files = sorted(tf.io.gfile.glob(pattern))
  features = {
    imagenet.IMAGE_KEY: tf.io.FixedLenFeature([], tf.string),
    imagenet.LABEL_KEY: tf.io.FixedLenFeature([], tf.int64),
  }

  def Preprocess(index, record):
    ex = tf.io.parse_single_example(record, features)
    image = tf.io.decode_jpeg(ex[imagenet.IMAGE_KEY], channels=3)
    seed = tf.stack([tf.constant(1, tf.int64), index])
    if args.augment:
      begin, crop, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        tf.zeros([0, 0, 4], tf.float32),
        seed=seed,
        min_object_covered=0.0,
        aspect_ratio_range=(3.0 / 4.0, 4.0 / 3.0),
        area_range=(0.08, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
      )
      image = tf.slice(image, begin, crop)
    else:
      shape = tf.shape(image)
      ch = tf.cast(tf.cast(shape[0], tf.float32) * 0.875, tf.int32)
      cw = tf.cast(tf.cast(shape[1], tf.float32) * 0.875, tf.int32)
      image = tf.slice(
        image, [(shape[0] - ch) // 2, (shape[1] - cw) // 2, 0], [ch, cw, 3]
      )
    image = tf.image.resize(tf.cast(image, tf.float32), [size, size])
    if args.augment:
      image = tf.image.stateless_random_flip_left_right(image, seed)
    image = tf.clip_by_value(image / 127.5 - 1.0, -1.0, 1.0)
    label = tf.cast(ex[imagenet.LABEL_KEY], tf.int32) - 1
    return {'image': tf.ensure_shape(image, [size, size, 3]), 'label': label}

  ds = tf.data.TFRecordDataset(
    files, num_parallel_reads=min(8, len(files))
  ).shuffle(args.shuffle_buffer, seed=1)
  ds = ds.repeat().enumerate()
  ds = ds.map(Preprocess, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(args.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  # The same options as the input generators' (main sets the flag's).
  return base_input_generator.WithTfDataOptions(ds)


def _Dataset(name, args, pattern):
  if name == 'plain':
    return PlainDataset(args, pattern)
  return _Params(args, pattern).Instantiate().GetDataset()


def _Time(iterator, warmup, batches):
  for _ in range(warmup):
    next(iterator)
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(iterator)
  # The last batch's values, fetched: its work is done, not just started.
  np.asarray(tf.nest.flatten(batch)[0])
  return time.perf_counter() - start


def Run(args, pattern):
  """{pipeline: record} of records/s over --rounds rounds (median)."""
  files = sorted(tf.io.gfile.glob(pattern))
  # Bytes per record, from the first file (all of them may be large).
  count = sum(1 for _ in tf.data.TFRecordDataset(files[0]))
  bytes_per_record = tf.io.gfile.stat(files[0]).length / max(1, count)
  times = {name: [] for name in args.pipelines}
  # One iterator per pipeline, repeated epochs: every round reads on.
  iterators = {
    name: iter(_Dataset(name, args, pattern)) for name in args.pipelines
  }
  for r in range(args.rounds):
    for name in args.pipelines:
      warmup = args.warmup if r == 0 else 0
      times[name].append(_Time(iterators[name], warmup, args.batches))
  out = {}
  for name in args.pipelines:
    seconds = statistics.median(times[name])
    per_sec = args.batches * args.batch_size / seconds
    out[name] = {
      'pipeline': name,
      'records_per_sec': per_sec,
      'encoded_mb_per_sec': per_sec * bytes_per_record / 2**20,
      'seconds_per_round': times[name],
      'records_timed_per_round': args.batches * args.batch_size,
      'batch_size': args.batch_size,
      'image_size': args.image_size,
      'augment': bool(args.augment),
      'files': len(files),
      'encoded_bytes_per_record': bytes_per_record,
      'tf_data_autotune': bool(args.tf_data_autotune),
    }
  return out


def Table(records, host):
  lines = [
    f'ImageNet input alone on {host["cpus"]} CPU cores ({host["source"]}'
    + ('' if host.get('tf_data_autotune', True) else '; autotuning off')
    + '):',
    f'{"pipeline":<16}{"records/s":>11}{"MB/s":>8}{"KB/record":>11}'
    f'{"batch":>7}{"size":>6}{"augment":>9}',
  ]
  for r in records:
    lines.append(
      f'{r["pipeline"]:<16}{r["records_per_sec"]:>11.0f}'
      f'{r["encoded_mb_per_sec"]:>8.1f}'
      f'{r["encoded_bytes_per_record"] / 1024:>11.1f}'
      f'{r["batch_size"]:>7d}{r["image_size"]:>6d}{str(r["augment"]):>9}'
    )
  if len(records) == 2:
    ratio = records[0]['records_per_sec'] / records[1]['records_per_sec']
    lines.append(
      f'{records[0]["pipeline"]} / {records[1]["pipeline"]}: {ratio:.2f}'
    )
  return '\n'.join(lines)


def _Check(args):
  """The first bad argument, as one line naming it and the fix (or None)."""
  positive = (
    'records',
    'files',
    'height',
    'width',
    'image_size',
    'batch_size',
    'batches',
    'rounds',
    'shuffle_buffer',
  )
  for name in positive:
    value = getattr(args, name)
    if value < 1:
      return f'--{name}={value}: use a positive number.'
  if args.warmup < 0:
    return f'--warmup={args.warmup}: use 0 or more batches.'
  if args.files > args.records:
    return (
      f'--files={args.files} > --records={args.records}: every file needs '
      'a record; use fewer files.'
    )
  if not args.file_pattern and args.records < args.batch_size:
    return (
      f'--records={args.records} < --batch_size={args.batch_size}: no '
      'whole batch; write more records or use smaller batches.'
    )
  unknown = [p for p in args.pipelines if p not in PIPELINES]
  if unknown or not args.pipelines:
    return (
      f'--pipelines={",".join(args.pipelines)}: use a comma list of '
      f'{", ".join(PIPELINES)}.'
    )
  if args.file_pattern and not tf.io.gfile.glob(args.file_pattern):
    return (
      f'--file_pattern={args.file_pattern}: no file matches; give '
      'ImageNet-format TFRecords, or leave it out to generate them.'
    )
  return None


def _Parser():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--file_pattern',
    default='',
    help='Benchmark these TFRecords instead of generated ones.',
  )
  parser.add_argument(
    '--data_dir',
    default='',
    help='Write the generated records here (kept); default: a temporary '
    'directory, removed at the end.',
  )
  parser.add_argument('--records', type=int, default=1024)
  parser.add_argument('--files', type=int, default=8)
  parser.add_argument('--height', type=int, default=375)
  parser.add_argument('--width', type=int, default=500)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--batch_size', type=int, default=32)
  parser.add_argument('--augment', type=int, default=1, choices=(0, 1))
  parser.add_argument('--shuffle_buffer', type=int, default=1024)
  parser.add_argument('--warmup', type=int, default=4)
  parser.add_argument('--batches', type=int, default=24)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument(
    '--tf_data_autotune',
    type=int,
    default=1,
    choices=(0, 1),
    help="0: tf.data's autotuning off (parallel stages of min(16, cores)).",
  )
  parser.add_argument(
    '--pipelines',
    default=','.join(PIPELINES),
    type=lambda s: [x.strip() for x in s.split(',') if x.strip()],
    help=f'Comma list of {", ".join(PIPELINES)}.',
  )
  parser.add_argument('--json', default='', help='Write the records here.')
  return parser


def main(argv=None):
  args = _Parser().parse_args(argv)
  problem = _Check(args)
  if problem:
    print(f'ERROR: {problem}', file=sys.stderr)
    return 1
  base_input_generator.TF_DATA_AUTOTUNE = bool(args.tf_data_autotune)
  temp = None
  if args.file_pattern:
    pattern, source = args.file_pattern, args.file_pattern
  else:
    directory = args.data_dir or tempfile.mkdtemp(prefix='imagenet_input_')
    temp = None if args.data_dir else directory
    start = time.perf_counter()
    pattern = WriteRecords(
      directory, args.records, args.files, args.height, args.width
    )
    source = (
      f'{args.records} generated {args.height}x{args.width} JPEGs in '
      f'{args.files} files'
    )
    print(
      f'Wrote {source} to {directory} in {time.perf_counter() - start:.1f} s.'
    )
  try:
    results = Run(args, pattern)
  finally:
    if temp:
      shutil.rmtree(temp, ignore_errors=True)
  records = [results[name] for name in args.pipelines]
  host = {
    'cpus': os.cpu_count(),
    'source': source,
    'tf_data_autotune': bool(args.tf_data_autotune),
  }
  print(Table(records, host))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'host': host, 'records': records}, f, indent=1)
    print(f'Wrote {args.json}.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
