"""ImageNetInput on tiny TFRecords written here (never downloaded)."""

import re

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.input import imagenet


def _Example(encoded=None, label=None):
  feature = {}
  if encoded is not None:
    feature[imagenet.IMAGE_KEY] = tf.train.Feature(
      bytes_list=tf.train.BytesList(value=[encoded])
    )
  if label is not None:
    feature[imagenet.LABEL_KEY] = tf.train.Feature(
      int64_list=tf.train.Int64List(value=[label])
    )
  return tf.train.Example(
    features=tf.train.Features(feature=feature)
  ).SerializeToString()


def _Jpeg(h, w, seed):
  img = np.random.RandomState(seed).randint(0, 256, [h, w, 3], np.uint8)
  return tf.io.encode_jpeg(img).numpy()


def _Write(path, records):
  with tf.io.TFRecordWriter(str(path)) as w:
    for r in records:
      w.write(r)
  return str(path)


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp('imagenet')
  train = [
    _Write(
      d / f'train-0000{k}-of-00002',
      [
        _Example(_Jpeg(20 + i, 30 + 2 * i, 10 * k + i), 1 + (5 * k + i) % 5)
        for i in range(5)
      ],
    )
    for k in range(2)
  ]
  val = _Write(
    d / 'validation-00000-of-00001',
    [_Example(_Jpeg(40, 24, 100 + i), 1 + i) for i in range(3)],
  )
  return d, train, val


def _Params(d, **kwargs):
  p = imagenet.ImageNetInput.Params().Set(
    file_pattern=str(d / 'train-*'),
    eval_file_pattern=str(d / 'validation-*'),
    batch_size=4,
    image_size=12,
    num_classes=5,
    seed=3,
  )
  return p.Set(**kwargs)


def _All(p):
  gen = p.Instantiate()
  return gen, list(gen.GetDataset())


def testTrainingBatchesAreAugmentedAndReproducible(files):
  d, _, _ = files
  p = _Params(d, num_epochs=1)
  _, batches = _All(p)
  assert len(batches) == 2  # 10 examples, batches of 4, remainder dropped.
  for b in batches:
    assert b.image.shape == [4, 12, 12, 3] and b.image.dtype == tf.float32
    assert b.label.dtype == tf.int32
    assert (
      -1.0
      <= float(tf.reduce_min(b.image))
      <= float(tf.reduce_max(b.image))
      <= 1.0
    )
    assert set(b.label.numpy()) <= set(range(5))
  _, again = _All(p)
  for a, b in zip(batches, again):
    np.testing.assert_array_equal(a.image.numpy(), b.image.numpy())
  _, other = _All(p.Copy().Set(seed=4))
  assert not np.array_equal(batches[0].image.numpy(), other[0].image.numpy())


def testEvalCentralCropAtAnyResolution(files):
  d, _, val = files
  p = imagenet.ImageNetInput.EvalParams(_Params(d, image_size=20), 'Dev')
  assert p.use_eval_files and not p.augment
  assert p.eval_file_pattern == str(d / 'validation-*')
  _, batches = _All(p)
  (b,) = batches
  assert b.image.shape == [4, 20, 20, 3]
  np.testing.assert_array_equal(b.weight.numpy(), [1, 1, 1, 0])
  np.testing.assert_array_equal(b.label.numpy()[:3], [0, 1, 2])
  # The central 87.5% (35x21 of 40x24) resized to 20x20, scaled to [-1, 1].
  raw = tf.io.decode_jpeg(
    tf.data.TFRecordDataset(val)
    .map(
      lambda r: tf.io.parse_single_example(
        r, {imagenet.IMAGE_KEY: tf.io.FixedLenFeature([], tf.string)}
      )[imagenet.IMAGE_KEY]
    )
    .take(1)
    .get_single_element(),
    channels=3,
  )
  crop = raw[2:37, 1:22]
  want = tf.image.resize(tf.cast(crop, tf.float32), [20, 20]) / 127.5 - 1
  np.testing.assert_allclose(b.image[0].numpy(), want.numpy(), atol=1e-4)
  with pytest.raises(ValueError, match='eval_file_pattern is empty'):
    imagenet.ImageNetInput.EvalParams(_Params(d, eval_file_pattern=''), 'Dev')


def testMissingFeatureNamesTheFileAndFeature(tmp_path):
  bad = _Write(
    tmp_path / 'train-bad',
    [_Example(_Jpeg(8, 8, 0), 1), _Example(_Jpeg(8, 8, 1), None)],
  )
  p = _Params(
    tmp_path, file_pattern=bad, num_epochs=1, batch_size=1, shuffle=False
  )
  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    _All(p)
  msg = imagenet.ErrorMessage(e.value)
  assert re.fullmatch(
    r'ImageNetInput: .*train-bad \(record 1, byte offset \d+\) lacks the '
    r'feature "image/class/label".*fix file_pattern or convert the data\.',
    msg,
  ), msg
  no_image = _Write(tmp_path / 'train-noimg', [_Example(None, 1)])
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match='train-noimg .record 0, byte offset 0. lacks the feature '
    r'\\?"image/encoded',
  ):
    _All(p.Copy().Set(file_pattern=no_image))


def testLabelOutOfRangeNamesTheFile(tmp_path):
  path = _Write(tmp_path / 'train-labels', [_Example(_Jpeg(8, 8, 0), 7)])
  p = _Params(tmp_path, file_pattern=path, num_epochs=1, batch_size=1)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=r'train-labels \(record 0, byte offset 0\): label - label_offset '
    r'= 6 is outside \[0, 5\)',
  ):
    _All(p)
  _, batches = _All(p.Copy().Set(num_classes=10))
  assert batches[0].label.numpy().tolist() == [6]


def testCorruptImagesAreSkippedAndLoggedOrFail(tmp_path, capfd):
  path = _Write(
    tmp_path / 'train-corrupt',
    [
      _Example(_Jpeg(8, 8, 0), 1),
      _Example(b'not a jpeg', 2),
      _Example(_Jpeg(8, 8, 1)[:40], 3),
      _Example(_Jpeg(9, 9, 2), 4),
    ],
  )
  p = _Params(
    tmp_path, file_pattern=path, num_epochs=1, batch_size=1, shuffle=False
  )
  capfd.readouterr()
  _, batches = _All(p)
  assert [int(b.label[0]) for b in batches] == [0, 3]
  err = capfd.readouterr().err
  # libjpeg's own complaint may land inside the warning line on stderr.
  assert 'skipping a corrupt record: ' in err, err
  assert re.search(
    r'train-corrupt \(record 1, byte offset '
    r'\d+\): the image does not decode \(corrupt records so far: 1 of 2',
    err,
  ), err
  assert 'record 2, byte offset' in err and 'so far: 2 of 3' in err
  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    _All(p.Copy().Set(corrupt_records='error'))
  assert re.fullmatch(
    r'ImageNetInput: .*train-corrupt \(record 1, byte offset \d+\): the '
    r'image does not decode\. Fix or remove the file, or skip corrupt '
    r"records with input.corrupt_records : 'skip'\.",
    imagenet.ErrorMessage(e.value),
  )


def _Damage(tmp_path, name, how):
  good = [_Example(_Jpeg(8, 8, i), 1 + i % 5) for i in range(6)]
  path = _Write(tmp_path / name, good)
  data = bytearray(open(path, 'rb').read())
  if how == 'truncate':
    data = data[: len(data) * 2 // 3]
  elif how == 'flip':
    data[len(data) // 2] ^= 0xFF
  else:  # garbage
    data = bytearray(np.random.RandomState(0).bytes(3000))
  with open(path, 'wb') as f:
    f.write(bytes(data))
  return path


@pytest.mark.parametrize('how', ['truncate', 'flip', 'garbage'])
def testDamagedFilesAreNamedWithTheOffset(tmp_path, how, capfd):
  path = _Damage(tmp_path, 'train-damaged', how)
  p = _Params(
    tmp_path,
    file_pattern=path,
    num_epochs=1,
    batch_size=1,
    shuffle=False,
    corrupt_records='error',
  )
  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    _All(p)
  msg = imagenet.ErrorMessage(e.value)
  want = (
    'this file is not a TFRecord of tf.train.Example'
    if how == 'garbage'
    else 'the file is truncated or corrupt'
  )
  assert re.fullmatch(
    r'ImageNetInput: .*train-damaged: damaged TFRecord data at byte offset '
    r'\d+ \((after record \d+|before the first record); '
    rf'{want}.*\)\. Fix or remove the file, or skip corrupt records with '
    r"input.corrupt_records : 'skip'\.",
    msg,
  ), msg
  # Skipped: the records before the damage are read.
  _, batches = _All(p.Copy().Set(corrupt_records='skip'))
  if how == 'garbage':
    assert not batches
  else:
    assert 1 <= len(batches) < 6
  assert 'skipping a corrupt record' in capfd.readouterr().err


def testNotAnExampleIsNamed(tmp_path):
  path = _Write(tmp_path / 'train-text', [b'\xff\xfe plain bytes'])
  p = _Params(
    tmp_path,
    file_pattern=path,
    num_epochs=1,
    batch_size=1,
    corrupt_records='error',
  )
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=r'train-text \(record 0, byte offset 0\) is not a tf.train.Example'
    r' \(this file is not a TFRecord of tf.train.Example\)',
  ):
    _All(p)


def testSkippingIsBoundedAndLogsLittle(tmp_path, capfd):
  path = _Write(
    tmp_path / 'train-allbad',
    [_Example(b'not an image %d' % i, 1) for i in range(10)],
  )
  p = _Params(
    tmp_path,
    file_pattern=path,
    batch_size=2,
    max_corrupt_records=3,
    max_corrupt_fraction=0.5,
    shuffle=False,
  )  # num_epochs None: forever, as in training.
  capfd.readouterr()
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=r'ImageNetInput: 4 of the 4 records read are corrupt, more than '
    r'max_corrupt_records \(3\) and max_corrupt_fraction \(0\.5\); the last: '
    r'.*train-allbad \(record 3, .*raise input.max_corrupt_fraction',
  ):
    _All(p)
  err = capfd.readouterr().err
  assert err.count('skipping a corrupt record') == 3
  # Below the bound a few corrupt records are skipped over many epochs, and
  # the log thins out: 20 lines, then one at each doubling.
  ok = _Write(
    tmp_path / 'train-mixed',
    [_Example(_Jpeg(8, 8, 0), 1), _Example(b'bad', 1)],
  )
  p = _Params(tmp_path, file_pattern=ok, batch_size=1, num_epochs=100)
  _, batches = _All(p.Set(max_corrupt_records=1000, shuffle=False))
  assert len(batches) == 100
  err = capfd.readouterr().err
  assert err.count('skipping a corrupt record') == 20 + 2  # and at 32, 64
  assert 'corrupt records so far: 64 of 128' in err


def testIteratorIsCheckpointable(files, tmp_path):
  d, _, _ = files
  gen = _Params(d).Instantiate()
  it = iter(gen.GetDataset())
  next(it)
  ckpt = tf.train.Checkpoint(iterator=it)
  path = ckpt.write(str(tmp_path / 'ckpt'))
  want = [next(it).label.numpy() for _ in range(3)]
  ckpt.read(path).assert_consumed()
  got = [next(it).label.numpy() for _ in range(3)]
  np.testing.assert_array_equal(want, got)


def testParamErrors(tmp_path):
  with pytest.raises(ValueError, match="corrupt_records = 'drop'"):
    _Params(tmp_path, corrupt_records='drop').Instantiate()
  with pytest.raises(ValueError, match='max_corrupt_fraction = 2'):
    _Params(tmp_path, max_corrupt_fraction=2).Instantiate()
  with pytest.raises(ValueError, match='no file matches'):
    _All(_Params(tmp_path, file_pattern=str(tmp_path / 'none-*')))
  with pytest.raises(ValueError, match='file_pattern is empty'):
    _All(_Params(tmp_path, file_pattern=''))


@pytest.mark.parametrize('autotune', [True, False])
def testAutotuneFollowsTheProcessSetting(files, monkeypatch, autotune):
  monkeypatch.setattr(base_input_generator, 'TF_DATA_AUTOTUNE', autotune)
  d, _, _ = files
  ds = _Params(d, num_epochs=1).Instantiate().GetDataset()
  assert ds.options().autotune.enabled is (None if autotune else False)
