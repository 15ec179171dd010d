"""The shared subword vocabulary of the multilingual model (sentencepiece).

One sentencepiece model covers every source language and the target
language(s). Its ids are fixed by convention:

  0 <pad>   1 <s>   2 </s>   3 <unk>   4.. <2xx> (one per target language)

`<2xx>` is prepended to every source sentence to say which language to
translate into (the paper translates into English: <2en>). Build one with

  python tools/build_vocab.py --corpora='de-en:data/de-en.train.tsv,...' \
      --vocab_size=64000 --output=data/spm

or `TrainVocabulary(sentences, prefix, vocab_size)`; load it with
`Vocabulary(prefix + '.model')`.
"""

import os
import random

from absl import logging

__all__ = [
  'PAD_ID',
  'BOS_ID',
  'EOS_ID',
  'UNK_ID',
  'Vocabulary',
  'TrainVocabulary',
  'TargetLanguageToken',
  'CheckVocabSize',
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3


def TargetLanguageToken(lang):
  """The token that asks for a translation into `lang`: '<2en>'."""
  return f'<2{lang}>'


def _Spm():
  try:
    import sentencepiece  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
      'The multilingual MT input needs the sentencepiece package: '
      'pip install "sentencepiece>=0.2.0".'
    ) from e
  return sentencepiece


class Vocabulary:
  """A sentencepiece model with the ids of the module docstring."""

  def __init__(self, path):
    if not path or not os.path.exists(path):
      raise FileNotFoundError(
        f'Vocabulary file {path!r} does not exist. Build it with `python '
        'tools/build_vocab.py --corpora=... --vocab_size=N --output=PREFIX` '
        '(it writes PREFIX.model) and set input.vocab_path.'
      )
    spm = _Spm()
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.Load(path)
    except (OSError, RuntimeError) as e:
      raise ValueError(
        f'{path!r} is not a sentencepiece model ({e}); point '
        'input.vocab_path at the .model file that '
        'tools/build_vocab.py wrote.'
      ) from e
    self.path = path
    expected = {PAD_ID: '<pad>', BOS_ID: '<s>', EOS_ID: '</s>', UNK_ID: '<unk>'}
    got = {
      i: self._sp.IdToPiece(i) for i in expected if i < self._sp.GetPieceSize()
    }
    if got != expected:
      raise ValueError(
        f'Vocabulary {path!r} has special pieces {got}; this library '
        f'expects {expected}. Rebuild it with tools/build_vocab.py.'
      )

  @property
  def size(self):
    """Number of pieces (ids 0 .. size - 1)."""
    return self._sp.GetPieceSize()

  def PieceToId(self, piece):
    """The id of `piece`, or None if the vocabulary lacks it."""
    i = self._sp.PieceToId(piece)
    if i == UNK_ID and piece != '<unk>':
      return None
    return i

  def TargetLanguageId(self, lang):
    """The id of '<2lang>'; ValueError naming the fix if it is missing."""
    i = self.PieceToId(TargetLanguageToken(lang))
    if i is None:
      raise ValueError(
        f'Vocabulary {self.path!r} has no token '
        f'{TargetLanguageToken(lang)!r} for target language {lang!r}. '
        'Rebuild it with tools/build_vocab.py --target_languages=... '
        f'including {lang!r}.'
      )
    return i

  def Encode(self, text):
    """The piece ids of `text` (no <s>, </s> or language token)."""
    return list(self._sp.EncodeAsIds(text))

  def Decode(self, ids):
    """Text of piece ids; special ids (pad, <s>, </s>, <2xx>) are dropped."""
    keep = [
      int(i)
      for i in ids
      if int(i) > UNK_ID
      and not self._sp.IsControl(int(i))
      and not self._IsLanguageToken(int(i))
    ]
    return self._sp.DecodeIds(keep)

  def _IsLanguageToken(self, i):
    piece = self._sp.IdToPiece(i)
    return piece.startswith('<2') and piece.endswith('>')


def CheckVocabSize(vocab, vocab_size, who='input'):
  """ValueError unless the vocabulary has exactly the model's vocab_size."""
  if vocab.size != vocab_size:
    raise ValueError(
      f'{who}: the vocabulary {vocab.path!r} has {vocab.size} pieces but the '
      f"model's vocab_size is {vocab_size}. The embedding and softmax are "
      'sized by vocab_size, so they must agree: rebuild the vocabulary with '
      f'`python tools/build_vocab.py --vocab_size={vocab_size} ...`, or set '
      f"the model's vocab_size to {vocab.size}."
    )


def TrainVocabulary(
  sentences,
  prefix,
  vocab_size,
  target_languages=('en',),
  model_type='unigram',
  character_coverage=1.0,
  max_sentences=2_000_000,
  seed=0,
):
  """Trains the shared sentencepiece vocabulary.

  Args:
    sentences: iterable of strings (all sides of all corpora).
    prefix: output path prefix; writes prefix.model and prefix.vocab.
    vocab_size: number of pieces, the specials and <2xx> tokens included.
    target_languages: codes whose <2xx> token the vocabulary reserves.
    model_type: 'unigram' or 'bpe' (or 'char', 'word').
    character_coverage: fraction of characters covered (1.0 for small
      alphabets; 0.9995 for CJK-heavy data).
    max_sentences: at most this many sentences, sampled uniformly (with
      `seed`) if there are more.
    seed: sampling seed.

  Returns:
    The path of the .model file.
  """
  spm = _Spm()
  data = [s.strip() for s in sentences if s and s.strip()]
  if not data:
    raise ValueError(
      'TrainVocabulary: no non-empty sentences to learn the '
      'vocabulary from; check the corpora.'
    )
  if len(data) > max_sentences:
    data = random.Random(seed).sample(data, max_sentences)
  else:
    random.Random(seed).shuffle(data)
  out_dir = os.path.dirname(os.path.abspath(prefix))
  os.makedirs(out_dir, exist_ok=True)
  symbols = [TargetLanguageToken(t) for t in target_languages]
  try:
    spm.SentencePieceTrainer.Train(
      sentence_iterator=iter(data),
      model_prefix=prefix,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      pad_id=PAD_ID,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      unk_id=UNK_ID,
      pad_piece='<pad>',
      bos_piece='<s>',
      eos_piece='</s>',
      unk_piece='<unk>',
      user_defined_symbols=symbols,
      hard_vocab_limit=True,
      num_threads=2,
      minloglevel=2,
    )
  except RuntimeError as e:
    raise ValueError(
      f'sentencepiece could not build a vocabulary of {vocab_size} pieces '
      f'from {len(data)} sentences: {str(e).rstrip(".")}. A small corpus '
      'supports only a '
      "small vocabulary: lower --vocab_size (and the model's)."
    ) from e
  logging.info(
    'Wrote the %d-piece vocabulary %s.model from %d sentences.',
    vocab_size,
    prefix,
    len(data),
  )
  return prefix + '.model'
