"""Fixed-shape language-model batches from text files, one sentence a line.

Each sentence is split into sentencepiece pieces (`mt_vocab.Vocabulary`) and
becomes one row of `max_tokens` positions, as Lingvo's fixed-shape LM input
gives its GPipe language model:

  ids       int32 [b, T]   <s> + pieces, then pad
  labels    int32 [b, T]   pieces + </s>, then pad (the next piece of ids)
  paddings  float [b, T]   1.0 on padding
  weights   float [b, T]   1.0 on real labels (1 - paddings)

A sentence longer than T - 1 pieces is cut to fit (its first T - 1 pieces
and no </s>); `stats` says how many were.

  p = LmTextInput.Params().Set(file_pattern='text:/data/news.en-*',
                               vocab_path='/data/wpm.model', vocab_size=32000,
                               max_tokens=1024, batch_size=32)

`demo_corpus=True` reads the English side of the library's offline
num2words corpus (`mt_demo`, built and cached on first use; its dev and test
numbers are held out from training) with its sentencepiece vocabulary, so a
language model trains with no download:

  "three thousand, four hundred and twelve"
"""

import glob
import os

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.input import mt_corpus
from lingvo_gpipe.input import mt_demo
from lingvo_gpipe.input import mt_vocab

__all__ = ['LmTextInput', 'ReadSentences']

_SPLITS = ('train', 'dev', 'test')


def ReadSentences(pattern):
  """The lines (stripped, non-empty) of the files matching `pattern`: a glob
  or a comma-separated list, optionally prefixed 'text:' (Lingvo's form)."""
  if pattern.startswith('text:'):
    pattern = pattern[len('text:') :]
  paths = []
  for part in pattern.split(','):
    paths.extend(sorted(glob.glob(part.strip())))
  if not paths:
    raise FileNotFoundError(
      f'No text file matches file_pattern {pattern!r}; give a glob of '
      'files with one sentence per line (e.g. "text:/data/news.en-*").'
    )
  lines = []
  for path in paths:
    with open(path, encoding='utf-8') as f:
      lines.extend(line.strip() for line in f)
  return [line for line in lines if line]


class LmTextInput(base_input_generator.BaseInputGenerator):
  """Language-model batches of fixed shape. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.batch_size = 32
    p.Define(
      'vocab_path',
      '',
      'The sentencepiece .model file (with demo_corpus: "" is the '
      "demo corpus's spm.model).",
    )
    p.Define(
      'vocab_size',
      0,
      "The model's vocabulary size; the vocabulary must have exactly "
      'this many pieces.',
    )
    p.Define('max_tokens', 64, 'T: positions per row (<s> or </s> included).')
    p.Define(
      'demo_corpus',
      False,
      'Read the English sentences of the num2words demo corpus '
      '(mt_demo, cached in data_dir) instead of file_pattern.',
    )
    p.Define('split', 'train', 'Demo corpus split: train, dev or test.')
    p.Define(
      'data_dir',
      '',
      'Where the demo corpus is cached; "": ~/.cache/lingvo_gpipe/demo_mt.',
    )
    p.Define('demo', mt_demo.DemoParams(), 'Settings of the demo corpus.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    who = f'LmTextInput {self.path!r}'
    if not isinstance(p.max_tokens, int) or p.max_tokens < 2:
      raise ValueError(
        f'{who}: max_tokens = {p.max_tokens!r}; use an int >= 2 (<s> or '
        '</s> takes one position).'
      )
    if not isinstance(p.vocab_size, int) or p.vocab_size <= 0:
      raise ValueError(
        f'{who}: vocab_size = {p.vocab_size!r}; set it to the '
        "model's vocabulary size."
      )
    if p.demo_corpus and p.split not in _SPLITS:
      raise ValueError(f'{who}: split = {p.split!r}; use one of {_SPLITS}.')
    if not p.demo_corpus and not p.file_pattern:
      raise ValueError(
        f'{who}: no data; set file_pattern (text files, one sentence a '
        'line) or demo_corpus=True.'
      )
    object.__setattr__(self, '_arrays', None)
    object.__setattr__(self, '_vocab', None)
    object.__setattr__(self, 'stats', {})

  @property
  def data_dir(self):
    return self.params.data_dir or mt_demo.DefaultDemoDir()

  @property
  def vocab(self):
    """The `mt_vocab.Vocabulary`, checked against p.vocab_size."""
    if self._vocab is None:
      p = self.params
      path = p.vocab_path
      if p.demo_corpus:
        self._EnsureDemo()
        path = path or os.path.join(
          self.data_dir, mt_demo.VOCAB_PREFIX + '.model'
        )
      vocab = mt_vocab.Vocabulary(path)
      mt_vocab.CheckVocabSize(vocab, p.vocab_size, f'LmTextInput {self.path!r}')
      object.__setattr__(self, '_vocab', vocab)
    return self._vocab

  def _EnsureDemo(self):
    p = self.params
    mt_demo.EnsureDemoFromParams(self.data_dir, p.demo, p.vocab_size)

  def _Sentences(self):
    p = self.params
    if not p.demo_corpus:
      return ReadSentences(p.file_pattern)
    self._EnsureDemo()
    seen, out = set(), []
    for path in sorted(
      glob.glob(os.path.join(self.data_dir, f'*-en.{p.split}.tsv'))
    ):
      for _, _, target in mt_corpus.ReadPairs(path):
        if target and target not in seen:
          seen.add(target)
          out.append(target)
    return out

  def _Arrays(self):
    """(ids, labels, lengths) numpy arrays of every sentence, built once."""
    if self._arrays is None:
      t = self.params.max_tokens
      sentences = self._Sentences()
      ids = np.zeros([len(sentences), t], np.int32)
      labels = np.zeros([len(sentences), t], np.int32)
      lengths = np.zeros([len(sentences)], np.int32)
      cut = 0
      for i, text in enumerate(sentences):
        pieces = self.vocab.Encode(text)
        if len(pieces) > t - 1:
          pieces, ends = pieces[: t - 1], []
          cut += 1
        else:
          ends = [mt_vocab.EOS_ID]
        row_in = [mt_vocab.BOS_ID] + pieces
        row_out = pieces + ends
        ids[i, : len(row_in)] = row_in
        labels[i, : len(row_out)] = row_out
        lengths[i] = len(row_out)
      self.stats.update(num_sentences=len(sentences), num_cut=cut)
      object.__setattr__(self, '_arrays', (ids, labels, lengths))
    return self._arrays

  def _DataSource(self):
    ids, labels, lengths = self._Arrays()
    if not len(ids):
      raise ValueError(
        f'LmTextInput {self.path!r}: the input has no sentences; check '
        'file_pattern (or the demo corpus split).'
      )
    return tf.data.Dataset.from_tensor_slices(
      NestedMap(ids=ids, labels=labels, length=lengths)
    )

  def _PreprocessBatch(self, batch):
    t = self.params.max_tokens
    pos = tf.range(t)[tf.newaxis, :]
    paddings = tf.cast(pos >= batch.length[:, tf.newaxis], tf.float32)
    out = NestedMap(
      ids=batch.ids,
      labels=batch.labels,
      paddings=paddings,
      weights=1.0 - paddings,
    )
    if 'weight' in batch:
      out.weight = batch.weight
      out.weights *= batch.weight[:, tf.newaxis]
    return out

  @classmethod
  def EvalParams(cls, train_params, dataset):
    """One unshuffled, padded pass over the `dataset` split (demo corpus),
    or over the same files (file_pattern: define Dev() with its own)."""
    p = cls.SetEvalSettings(train_params.Copy())
    if not p.demo_corpus:
      raise NotImplementedError(
        f'LmTextInput cannot derive the {dataset!r} input from the '
        'training file_pattern; define Dev()/Test() in the model params '
        'with their own input.file_pattern.'
      )
    p.split = dataset.lower()
    return p
