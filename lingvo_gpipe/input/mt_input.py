"""MultilingualMTInput: many parallel corpora -> padded batches on tf.data.

One corpus per language pair (`mt_corpus`: TSV or TFRecord), one shared
sentencepiece vocabulary (`mt_vocab`), and:

  * a target-language token: every source sentence is `<2xx> pieces </s>`
    (xx = the target language), so one model serves every direction;
  * temperature sampling (training): language pair i with n_i examples is
    drawn with probability q_i ~ (n_i / sum n)^(1 / T), T =
    `sampling_temperature` (1: in proportion to the data; larger: flatter,
    over-sampling low-resource languages; the paper uses T = 5);
  * length buckets with static shapes: an example goes to the first bucket
    whose `bucket_upper_bound` holds both of its sides, and every batch is
    padded to its bucket's bound, so a pipeline can split it into
    micro-batches (one bucket: every batch has the same shape);
  * bad input is counted, logged and skipped, never silently: empty lines
    and records with an empty side (`empty`), TSV lines without exactly one
    tab or records without the features (`malformed`), sentences longer than
    the largest bucket (`too_long`, dropped; or `truncated` with
    `long_sentence_policy='truncate'`). `stats` holds the counts per corpus.
    Unknown language codes, a missing corpus, a corpus with no usable
    example and a vocabulary whose size is not the model's `vocab_size` are
    errors that say how to fix them.

Batches (NestedMap):

  src.ids int32 [b, s], src.paddings float32 [b, s]   (s = the bucket bound)
  tgt.ids int32 [b, t]      <s> + target pieces
  tgt.labels int32 [b, t]   target pieces + </s>
  tgt.paddings, tgt.weights float32 [b, t]
  lang int32 [b]            index of the example's pair in `languages`
  src.text, tgt.text        raw sentences (string [b]) if include_text
  weight float32 [b]        eval only: 0 for the padding of the last batch

Training (num_epochs None) samples forever; evaluation (`EvalParams`: one
pass, no shuffling) goes through the pairs in order and pads the last batch.
The corpora are read and tokenized into memory when the dataset is first
built (fast for the demo and for corpora of a few million pairs; for
web-scale data pre-shard and stream instead).

With `demo_corpus=True` and no corpus in `data_dir`, the num2words demo
corpus (`mt_demo`) and its vocabulary are built there first (once; cached).
"""

import collections
import os

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.input import mt_corpus
from lingvo_gpipe.input import mt_demo
from lingvo_gpipe.input import mt_vocab

__all__ = [
  'MultilingualMTInput',
  'TemperatureSamplingProbs',
  'LONG_SENTENCE_POLICIES',
]

LONG_SENTENCE_POLICIES = ('drop', 'truncate')
_STAT_KEYS = ('read', 'kept', 'empty', 'malformed', 'too_long', 'truncated')


def TemperatureSamplingProbs(sizes, temperature):
  """q_i ~ (n_i / sum n)^(1 / temperature), normalized (float64 array)."""
  sizes = np.asarray(sizes, np.float64)
  if not temperature or temperature <= 0:
    raise ValueError(
      f'sampling_temperature = {temperature!r}; use a number '
      "> 0 (1: proportional to the data, 5: the paper's)."
    )
  if sizes.ndim != 1 or not len(sizes) or np.any(sizes < 0) or not sizes.sum():
    raise ValueError(
      f'Corpus sizes {sizes.tolist()} must be >= 0 with a positive sum.'
    )
  q = (sizes / sizes.sum()) ** (1.0 / temperature)
  return q / q.sum()


class _Corpus:
  """One language pair in memory: fixed-width id arrays and counts."""

  def __init__(self, name, index, width):
    self.name = name
    self.index = index
    self.width = width
    self.stats = collections.OrderedDict((k, 0) for k in _STAT_KEYS)
    self.src, self.tgt_in, self.tgt_out = [], [], []
    self.src_len, self.tgt_len = [], []
    self.src_text, self.tgt_text = [], []
    self.first_bad = None

  def Add(self, src_ids, tgt_pieces, src_text, tgt_text):
    w = self.width
    self.src.append(src_ids + [mt_vocab.PAD_ID] * (w - len(src_ids)))
    tgt_in = [mt_vocab.BOS_ID] + tgt_pieces
    tgt_out = tgt_pieces + [mt_vocab.EOS_ID]
    self.tgt_in.append(tgt_in + [mt_vocab.PAD_ID] * (w - len(tgt_in)))
    self.tgt_out.append(tgt_out + [mt_vocab.PAD_ID] * (w - len(tgt_out)))
    self.src_len.append(len(src_ids))
    self.tgt_len.append(len(tgt_out))
    self.src_text.append(src_text)
    self.tgt_text.append(tgt_text)

  def Arrays(self, include_text, rows=None):
    """NestedMap of numpy arrays (rows: an index array, None: all)."""

    def Take(x, dtype):
      a = np.asarray(x, dtype)
      return a if rows is None else a[rows]

    n = len(self.src) if rows is None else len(rows)
    out = NestedMap(
      src=Take(self.src, np.int32).reshape([n, self.width]),
      tgt_in=Take(self.tgt_in, np.int32).reshape([n, self.width]),
      tgt_out=Take(self.tgt_out, np.int32).reshape([n, self.width]),
      src_len=Take(self.src_len, np.int32),
      tgt_len=Take(self.tgt_len, np.int32),
      lang=np.full([n], self.index, np.int32),
    )
    if include_text:
      out.src_text = Take(self.src_text, object)
      out.tgt_text = Take(self.tgt_text, object)
    return out


class MultilingualMTInput(base_input_generator.BaseInputGenerator):
  """Multilingual parallel text input. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.batch_size = 64
    p.Define(
      'data_dir',
      '',
      'Directory of <src>-<tgt>.<split>.tsv (or .tfrecord) corpora '
      'and, by default, the vocabulary spm.model.',
    )
    p.Define('split', 'train', 'Which files of data_dir: train, dev, test.')
    p.Define(
      'corpora',
      [],
      'Explicit corpora "SRC-TGT:FILE_PATTERN" (TSV or TFRecord); '
      'when set, data_dir is not searched.',
    )
    p.Define(
      'vocab_path',
      '',
      'The sentencepiece .model file; "": <data_dir>/spm.model.',
    )
    p.Define(
      'vocab_size',
      0,
      "The model's vocabulary size; the vocabulary must have exactly "
      'this many pieces.',
    )
    p.Define(
      'target_language_token',
      True,
      'Prepend <2xx> (xx = the target language) to each source.',
    )
    p.Define(
      'sampling_temperature',
      5.0,
      'T of the temperature sampling over language pairs (training).',
    )
    p.Define(
      'bucket_upper_bound',
      [32],
      'Increasing max lengths (in pieces, with <2xx>, <s>, </s>) of '
      "the length buckets; batches are padded to their bucket's "
      'bound.',
    )
    p.Define(
      'bucket_batch_limit',
      None,
      'Batch size of each bucket (list as long as bucket_upper_bound); '
      'None: batch_size for all.',
    )
    p.Define(
      'long_sentence_policy',
      'drop',
      'Pairs longer than the largest bucket: "drop" them or '
      '"truncate" them; counted either way.',
    )
    p.Define(
      'max_examples_per_language',
      0,
      'If > 0, use at most this many examples of each pair.',
    )
    p.Define(
      'include_text',
      None,
      'Add src.text / tgt.text (the raw sentences) to the batches; '
      'None: for finite (eval) inputs only.',
    )
    p.Define(
      'tfrecord_keys',
      ['source', 'target'],
      'Feature names of the source and target in TFRecord corpora.',
    )
    p.Define(
      'demo_corpus',
      False,
      'Build the num2words demo corpus (and its vocabulary of '
      'vocab_size pieces) into data_dir (default: '
      '~/.cache/lingvo_gpipe/demo_mt) if it is not there.',
    )
    p.Define('demo', mt_demo.DemoParams(), 'Settings of the demo corpus.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    who = f'MultilingualMTInput {self.path!r}'
    bounds = list(p.bucket_upper_bound or [])
    if (
      not bounds
      or any(not isinstance(b, int) or b < 3 for b in bounds)
      or (bounds != sorted(set(bounds)))
    ):
      raise ValueError(
        f'{who}: bucket_upper_bound = {bounds!r}; use '
        'increasing ints >= 3, e.g. [16, 32, 64].'
      )
    limits = p.bucket_batch_limit
    if limits is not None and (
      len(limits) != len(bounds)
      or any(not isinstance(b, int) or b < 1 for b in limits)
    ):
      raise ValueError(
        f'{who}: bucket_batch_limit = {limits!r}; give one '
        f'positive batch size per bucket ({len(bounds)}).'
      )
    if p.long_sentence_policy not in LONG_SENTENCE_POLICIES:
      raise ValueError(
        f'{who}: long_sentence_policy = '
        f'{p.long_sentence_policy!r}; use one of '
        f'{LONG_SENTENCE_POLICIES}.'
      )
    TemperatureSamplingProbs([1], p.sampling_temperature)  # Validates T.
    if not isinstance(p.vocab_size, int) or p.vocab_size <= 0:
      raise ValueError(
        f'{who}: vocab_size = {p.vocab_size!r}; set it to the '
        "model's vocabulary size."
      )
    for spec in p.corpora:
      mt_corpus.ParseCorpusSpec(spec)  # Bad specs and languages fail early.
    object.__setattr__(self, '_data', None)
    object.__setattr__(self, '_vocab', None)

  # -- Data --------------------------------------------------------------------

  @property
  def data_dir(self):
    p = self.params
    if p.data_dir:
      return p.data_dir
    return mt_demo.DefaultDemoDir() if p.demo_corpus else ''

  def _EnsureDemo(self):
    p = self.params
    if not p.demo_corpus or p.corpora:
      return
    mt_demo.EnsureDemoFromParams(self.data_dir, p.demo, p.vocab_size)

  @property
  def vocab(self):
    """The `mt_vocab.Vocabulary`, checked against p.vocab_size."""
    if self._vocab is None:
      self._EnsureDemo()
      p = self.params
      path = p.vocab_path or (
        os.path.join(self.data_dir, 'spm.model') if self.data_dir else ''
      )
      vocab = mt_vocab.Vocabulary(path)
      mt_vocab.CheckVocabSize(
        vocab, p.vocab_size, f'MultilingualMTInput {self.path!r}'
      )
      object.__setattr__(self, '_vocab', vocab)
    return self._vocab

  def CorpusSpecs(self):
    """The 'src-tgt:pattern' corpora this input reads."""
    p = self.params
    if p.corpora:
      return list(p.corpora)
    self._EnsureDemo()
    return mt_corpus.DiscoverCorpora(self.data_dir, p.split)

  @property
  def languages(self):
    """Names ('de-en', ...) of the pairs, in the order of `lang` ids."""
    return [c.name for c in self._Load()]

  @property
  def stats(self):
    """{pair: {read, kept, empty, malformed, too_long, truncated}}."""
    return {c.name: dict(c.stats) for c in self._Load()}

  @property
  def sampling_probs(self):
    """{pair: probability} of the temperature sampling (training)."""
    corpora = self._Load()
    q = TemperatureSamplingProbs(
      [len(c.src) for c in corpora], self.params.sampling_temperature
    )
    return {c.name: float(x) for c, x in zip(corpora, q)}

  def _Load(self):
    if self._data is not None:
      return self._data
    p = self.params
    vocab = self.vocab
    width = max(p.bucket_upper_bound)
    by_pair = collections.OrderedDict()
    for spec in self.CorpusSpecs():
      src_lang, tgt_lang, pattern = mt_corpus.ParseCorpusSpec(spec)
      files = mt_corpus.ExpandPattern(pattern, spec)
      name = f'{src_lang}-{tgt_lang}'
      if name not in by_pair:
        by_pair[name] = (tgt_lang, [])
      by_pair[name][1].extend(files)
    corpora = []
    for index, (name, (tgt_lang, files)) in enumerate(by_pair.items()):
      lang_tok = (
        [vocab.TargetLanguageId(tgt_lang)] if p.target_language_token else []
      )
      corpus = _Corpus(name, index, width)
      for path in files:
        self._ReadFile(corpus, path, vocab, lang_tok)
      stats = corpus.stats
      logging.info(
        'Corpus %s (%s): %s',
        name,
        ', '.join(files),
        ', '.join(f'{v} {k}' for k, v in stats.items()),
      )
      if stats['malformed']:
        logging.warning(
          'Corpus %s: skipped %d malformed records (first: %s).',
          name,
          stats['malformed'],
          corpus.first_bad,
        )
      if not stats['kept']:
        raise ValueError(
          f'Corpus {name} ({", ".join(files)}) has no usable pair: '
          + ', '.join(f'{v} {k}' for k, v in stats.items())
          + '. Check '
          'the format (source<TAB>target per line, or TFRecords with '
          f'features {list(p.tfrecord_keys)}) and bucket_upper_bound.'
        )
      corpora.append(corpus)
    object.__setattr__(self, '_data', corpora)
    return corpora

  def _ReadFile(self, corpus, path, vocab, lang_tok):
    p = self.params
    width = corpus.width
    stats = corpus.stats
    limit = p.max_examples_per_language
    for n, src, tgt in mt_corpus.ReadPairs(path, *p.tfrecord_keys):
      if limit and stats['kept'] >= limit:
        break
      stats['read'] += 1
      if src is None:
        stats['malformed'] += 1
        corpus.first_bad = corpus.first_bad or f'{path}:{n}'
        continue
      src, tgt = src.strip(), tgt.strip()
      if not src or not tgt:
        stats['empty'] += 1
        continue
      src_ids = lang_tok + vocab.Encode(src) + [mt_vocab.EOS_ID]
      tgt_pieces = vocab.Encode(tgt)
      if len(src_ids) > width or len(tgt_pieces) + 1 > width:
        if p.long_sentence_policy == 'drop':
          stats['too_long'] += 1
          continue
        stats['truncated'] += 1
        src_ids = src_ids[: width - 1] + [mt_vocab.EOS_ID]
        tgt_pieces = tgt_pieces[: width - 1]
      stats['kept'] += 1
      corpus.Add(src_ids, tgt_pieces, src, tgt)

  # -- tf.data -----------------------------------------------------------------

  def _IncludeText(self):
    p = self.params
    return (
      p.num_epochs is not None
      if p.include_text is None
      else bool(p.include_text)
    )

  def _Bucket(self, corpus):
    """Bucket index of each example (by its longer side)."""
    longest = np.maximum(np.asarray(corpus.src_len), np.asarray(corpus.tgt_len))
    return np.searchsorted(
      np.asarray(self.params.bucket_upper_bound), longest, side='left'
    )

  @staticmethod
  def _Slice(arrays, bound):
    out = NestedMap(arrays)
    for k in ('src', 'tgt_in', 'tgt_out'):
      out[k] = out[k][:, :bound]
    return out

  def _TrainDataset(self, corpora):
    p = self.params
    bounds = list(p.bucket_upper_bound)
    limits = list(p.bucket_batch_limit or [p.batch_size] * len(bounds))
    q = TemperatureSamplingProbs(
      [len(c.src) for c in corpora], p.sampling_temperature
    )
    include_text = self._IncludeText()
    buckets, bucket_mass = [], []
    for b, bound in enumerate(bounds):
      parts, weights = [], []
      for i, corpus in enumerate(corpora):
        rows = np.nonzero(self._Bucket(corpus) == b)[0]
        if not len(rows):
          continue
        arrays = self._Slice(corpus.Arrays(include_text, rows), bound)
        ds = tf.data.Dataset.from_tensor_slices(arrays)
        if p.shuffle:
          ds = ds.shuffle(
            min(len(rows), p.shuffle_buffer_size),
            seed=self.seed + 7919 * i + b,
            reshuffle_each_iteration=True,
          )
        parts.append(ds.repeat())
        weights.append(q[i] * len(rows) / len(corpus.src))
      if not parts:
        continue
      mass = float(np.sum(weights))
      ds = (
        parts[0]
        if len(parts) == 1
        else tf.data.Dataset.sample_from_datasets(
          parts, weights=list(np.asarray(weights) / mass), seed=self.seed + b
        )
      )
      buckets.append(ds.batch(limits[b], drop_remainder=True))
      bucket_mass.append(mass / limits[b])
    if len(buckets) == 1:
      return buckets[0]
    return tf.data.Dataset.sample_from_datasets(
      buckets,
      weights=list(np.asarray(bucket_mass) / sum(bucket_mass)),
      seed=self.seed,
    )

  def _EvalDataset(self, corpora):
    p = self.params
    parts = [corpus.Arrays(self._IncludeText()) for corpus in corpora]
    arrays = NestedMap(
      {k: np.concatenate([a[k] for a in parts]) for k in parts[0]}
    )
    ds = tf.data.Dataset.from_tensor_slices(arrays)
    if p.num_samples and p.num_samples > 0:
      ds = ds.take(p.num_samples)
    if p.shuffle:
      ds = ds.shuffle(
        p.shuffle_buffer_size, seed=self.seed, reshuffle_each_iteration=True
      )
    ds = ds.repeat(p.num_epochs)
    ds = ds.batch(p.batch_size, drop_remainder=(p.remainder == 'drop'))
    if p.remainder == 'pad':
      ds = ds.map(self._Pad)
    return ds

  @staticmethod
  def _MakeBatch(elem):
    """Example arrays [b, w] -> the batch NestedMap of the module docstring."""
    width = tf.shape(elem.src)[1]
    pos = tf.range(width)[tf.newaxis, :]
    src_pad = tf.cast(pos >= elem.src_len[:, tf.newaxis], tf.float32)
    tgt_pad = tf.cast(pos >= elem.tgt_len[:, tf.newaxis], tf.float32)
    src = NestedMap(ids=elem.src, paddings=src_pad)
    tgt = NestedMap(
      ids=elem.tgt_in,
      labels=elem.tgt_out,
      paddings=tgt_pad,
      weights=1.0 - tgt_pad,
    )
    if 'src_text' in elem:
      src.text = elem.src_text
      tgt.text = elem.tgt_text
    out = NestedMap(src=src, tgt=tgt, lang=elem.lang)
    if 'weight' in elem:
      out.weight = elem.weight
    return out

  def GetDataset(self):
    """The tf.data.Dataset of batches (see the module docstring)."""
    corpora = self._Load()
    if self.params.num_epochs is None:
      ds = self._TrainDataset(corpora)
    else:
      ds = self._EvalDataset(corpora)
    return self._Finish(ds.map(self._MakeBatch))

  @classmethod
  def EvalParams(cls, train_params, dataset):
    """One unshuffled, padded pass over the `dataset` split of data_dir.

    Over-long eval sentences are truncated, not dropped (the references stay
    whole), so an eval set is always scored entirely.
    """
    p = cls.SetEvalSettings(train_params.Copy())
    p.long_sentence_policy = 'truncate'
    if p.corpora:
      raise NotImplementedError(
        f'MultilingualMTInput cannot derive the {dataset!r} input from '
        'explicit training corpora; define Dev()/Test() in the model '
        'params with their own input.corpora.'
      )
    p.split = dataset.lower()
    p.include_text = True
    return p
