"""BaseInputGenerator: batches of NestedMaps from a tf.data pipeline.

A subclass describes its examples and `GetDataset()` does the rest:

  _DataSource()          -> tf.data.Dataset of single examples (NestedMaps)
  num_samples            -> .take(num_samples) if > 0
  shuffle                -> .shuffle(shuffle_buffer_size, seed)
  num_epochs             -> .repeat(num_epochs)  (None: forever, training)
  _Preprocess(example)   -> per example, deterministic order
  remainder              -> .batch(batch_size, ...) with a static batch dim
  _PreprocessBatch(b)    -> per batch

Batches have a static batch dimension so a pipeline can split them into
micro-batches: with remainder='drop' (training) a final partial batch is
dropped; with 'pad' (evaluation) it is padded with zeros to batch_size and
every batch carries `weight`, float32 [batch_size], 1 for real examples and 0
for padding, so a weighted metric over one pass covers the whole set exactly.

Randomness is reproducible: shuffling uses `seed`, and inside `_Preprocess`
each example runs under `py_utils.StepSeed(<its index in the stream>)`, so
`self.ExampleSeed('what')` gives stateless random ops a seed pair that
depends only on (seed, layer path, 'what', example index).

`GetPreprocessedInputBatch()` returns the next batch of an iterator the
generator keeps (`self.iterator`). The iterator is deliberately not a tracked
dependency of the model; checkpoint it explicitly, where the dataset allows:

  tf.train.Checkpoint(iterator=task.input_generator.iterator)

tf.data autotunes the parallel stages and buffers of every pipeline
`GetDataset()` builds (a model thread per iterator), unless
`TF_DATA_AUTOTUNE` is False in this process.

Eval input Params are usually derived from the training ones with the
classmethod `EvalParams(train_params, 'Dev')` (one pass, no shuffling,
padded); the base class cannot know how to switch to other data and raises
NotImplementedError, subclasses such as `DigitsInput` override it.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = [
  'BaseInputGenerator',
  'CheckMessage',
  'REMAINDER_MODES',
  'TF_DATA_AUTOTUNE',
  'WithTfDataOptions',
]

REMAINDER_MODES = ('drop', 'pad', 'keep')

# Whether the datasets that input generators build in this process let
# tf.data autotune them: a model thread per iterator that sets each parallel
# stage's calls in flight and each buffer's size. False: a parallel stage
# runs min(16, cores) calls at once and a prefetch buffer grows while its
# consumer waits; the batches are the same (every stage is deterministic).
#
# TensorFlow 2.21 can block the thread that deletes an autotuned iterator,
# holding the GIL, until the iterator's model thread next wakes: up to its
# optimization period, which doubles with the iterator's age up to 60 s.
# Measured (docs/reliability.md): iterators made and deleted at random
# took up to 6.6 s (16.5 s in another run) to delete; without autotuning,
# 4 ms. A trainer keeps one iterator for its run and did not stall at
# exit; the tests set False (tests/conftest.py): their models' iterators
# are collected long after their tests, in whatever test runs then.
TF_DATA_AUTOTUNE = True


def WithTfDataOptions(ds):
  """`ds` with this process's tf.data options (`TF_DATA_AUTOTUNE`)."""
  if TF_DATA_AUTOTUNE:
    return ds
  options = tf.data.Options()
  options.autotune.enabled = False
  return ds.with_options(options)


# The class names of every input generator, which begin the messages of
# their in-graph checks (see `CheckMessage`).
_GENERATOR_NAMES = set()


def CheckMessage(error):
  """The message of an input generator's own in-graph check inside a
  TensorFlow error, or None.

  A generator checks its data with `tf.debugging.Assert(ok, [message])`,
  one string that begins with the generator's class name and a colon, e.g.
  "ImageNetInput: record 12 of ... is not a JPEG". The error then holds
  "assertion failed: [<message>]", and the trainer reports the message in
  one line. (A check with several data items is left to the trainer's
  general report of a failed assertion.)
  """
  text = str(getattr(error, 'message', None) or error)
  marker = 'assertion failed: ['
  i = text.find(marker)
  if i < 0:
    return None
  line = text[i + len(marker) :].split('\n')[0]
  if line.split(':', 1)[0] not in _GENERATOR_NAMES or '] [' in line:
    return None
  j = line.rfind(']')
  line = (line[:j] if j >= 0 else line).strip()
  return line.replace("\\'", "'").replace('\\"', '"')


class BaseInputGenerator(base_layer.BaseLayer):
  """Base class of input generators. See the module docstring."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _GENERATOR_NAMES.add(cls.__name__)

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'input'
    p.Define('batch_size', 0, 'Examples per batch (> 0).')
    p.Define(
      'num_epochs',
      None,
      'Passes over the data; None: repeat forever (training). Eval '
      'inputs use 1.',
    )
    p.Define('shuffle', True, 'Whether to shuffle the examples.')
    p.Define('shuffle_buffer_size', 10000, 'Size of the shuffle buffer.')
    p.Define(
      'seed',
      None,
      'Seed of shuffling and augmentation; None: p.random_seed, else '
      '0. The same seed gives the same batches.',
    )
    p.Define(
      'file_pattern',
      '',
      'Data files, for generators that read files (glob pattern or '
      'comma-separated list).',
    )
    p.Define(
      'num_samples', 0, 'If > 0, only the first num_samples examples are used.'
    )
    p.Define(
      'remainder',
      'drop',
      'Final partial batch of a finite pass: "drop" it, "pad" it to '
      'batch_size (batches then carry a float32 `weight`, 0 on '
      'padding) or "keep" it (the batch dim is then not static).',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not isinstance(p.batch_size, int) or p.batch_size <= 0:
      raise ValueError(
        f'{type(self).__name__} {self.path!r}: batch_size = '
        f'{p.batch_size!r}; set p.batch_size to a positive '
        'int.'
      )
    if p.remainder not in REMAINDER_MODES:
      raise ValueError(
        f'{type(self).__name__} {self.path!r}: remainder = '
        f'{p.remainder!r}; use one of {REMAINDER_MODES}.'
      )
    if p.num_epochs is not None and p.num_epochs <= 0:
      raise ValueError(
        f'{type(self).__name__} {self.path!r}: num_epochs = '
        f'{p.num_epochs!r}; use None (forever) or >= 1.'
      )
    # Not tracked by tf.Module/Checkpoint on purpose: see the module doc.
    object.__setattr__(self, '_iterator', None)

  # -- Overridable -------------------------------------------------------------

  def _DataSource(self):
    """Returns a tf.data.Dataset of single examples (NestedMaps)."""
    raise NotImplementedError(
      f'{type(self).__name__} must implement _DataSource() (a dataset of '
      'single examples) or override GetDataset().'
    )

  def _Preprocess(self, example):
    """Transforms one example (in a tf.data map). Default: identity."""
    return example

  def _PreprocessBatch(self, batch):
    """Transforms one batch (in a tf.data map). Default: identity."""
    return batch

  @classmethod
  def SetEvalSettings(cls, p):
    """Sets one pass, no shuffling, padded final batch on `p`; returns it."""
    p.num_epochs = 1
    p.shuffle = False
    p.remainder = 'pad'
    return p

  @classmethod
  def EvalParams(cls, train_params, dataset):
    """Input Params of `dataset` ('Dev', 'Test', ...) from the training ones.

    Subclasses that know how to select other data override this (usually
    `cls.SetEvalSettings(train_params.Copy())` plus the data switch).
    """
    del train_params
    raise NotImplementedError(
      f'{cls.__name__} cannot derive the {dataset!r} input from the '
      f'training input: define {dataset}() in the model params class, or '
      f'override {cls.__name__}.EvalParams.'
    )

  # -- Public ------------------------------------------------------------------

  @property
  def seed(self):
    """The effective seed (int)."""
    p = self.params
    if p.seed is not None:
      return int(p.seed)
    return int(p.random_seed or 0)

  def ExampleSeed(self, name):
    """Stateless seed pair for a random op `name` inside `_Preprocess`."""
    return py_utils.GenerateStepSeedPair(
      py_utils.StableHash(self.seed, self.path, name)
    )

  def InfeedBatchSize(self):
    """Examples per batch this generator produces."""
    return self.params.batch_size

  def GlobalBatchSize(self):
    """Examples per training step (one host, no replicas: the batch size)."""
    return self.params.batch_size

  def _Pad(self, batch):
    b = self.params.batch_size
    leaves = [x for x in tf.nest.flatten(batch) if x.shape.rank]
    if not leaves:
      raise ValueError(
        f'{type(self).__name__}: remainder="pad" needs batched '
        'tensors with a batch dimension.'
      )
    n = tf.shape(leaves[0])[0]

    def PadLeaf(x):
      if not x.shape.rank:
        return x
      pads = [[0, b - n]] + [[0, 0]] * (x.shape.rank - 1)
      y = tf.pad(x, pads)
      y.set_shape([b] + x.shape.as_list()[1:])
      return y

    out = tf.nest.map_structure(PadLeaf, batch)
    if not isinstance(out, dict):
      raise TypeError(
        f'{type(self).__name__}: remainder="pad" adds a '
        '`weight` key; examples must be NestedMaps.'
      )
    out = NestedMap(out)
    if 'weight' in out:
      raise ValueError(
        f'{type(self).__name__}: examples already have a '
        '`weight` key; remainder="pad" would overwrite it. '
        'Rename it or use remainder="drop".'
      )
    out.weight = tf.concat(
      [tf.ones([n], tf.float32), tf.zeros([b - n], tf.float32)], 0
    )
    return out

  def GetDataset(self):
    """Returns the tf.data.Dataset of batches (NestedMaps)."""
    p = self.params
    ds = self._DataSource()
    if not isinstance(ds, tf.data.Dataset):
      raise TypeError(
        f'{type(self).__name__}._DataSource() returned '
        f'{type(ds).__name__}; return a tf.data.Dataset.'
      )
    if p.num_samples and p.num_samples > 0:
      ds = ds.take(p.num_samples)
    if p.shuffle:
      ds = ds.shuffle(
        p.shuffle_buffer_size, seed=self.seed, reshuffle_each_iteration=True
      )
    ds = ds.repeat(p.num_epochs)
    ds = ds.enumerate()

    def Preprocess(index, example):
      with py_utils.StepSeed(index):
        return self._Preprocess(example)

    ds = ds.map(
      Preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    ds = ds.batch(p.batch_size, drop_remainder=(p.remainder == 'drop'))
    if p.remainder == 'pad':
      ds = ds.map(self._Pad)
    ds = ds.map(self._PreprocessBatch)
    return self._Finish(ds)

  def _Finish(self, ds):
    """`ds` prefetched, with this process's tf.data options
    (`TF_DATA_AUTOTUNE`): the last step of every `GetDataset()`."""
    return WithTfDataOptions(ds.prefetch(tf.data.AUTOTUNE))

  @property
  def iterator(self):
    """The iterator `GetPreprocessedInputBatch` reads (created on first use)."""
    if self._iterator is None:
      object.__setattr__(self, '_iterator', iter(self.GetDataset()))
    return self._iterator

  def GetPreprocessedInputBatch(self):
    """The next batch (NestedMap). Raises StopIteration after a finite pass
    (tf.errors.OutOfRangeError inside a tf.function); then call Reset()."""
    return next(self.iterator)

  def Reset(self):
    """Starts over: the next batch is the first one of a new iterator.

    A tf.train.Checkpoint holding the old iterator does not follow; build
    the checkpoint after Reset() if it must track the new one.
    """
    object.__setattr__(self, '_iterator', None)

  def FProp(self, theta, *args):
    del theta, args
    raise NotImplementedError(
      f'{type(self).__name__} is an input generator; call '
      'GetPreprocessedInputBatch() or GetDataset(), not FProp.'
    )
