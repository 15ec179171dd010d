"""Tests of the multilingual MT input: corpora, vocab, sampling, buckets."""

import collections
import os

import numpy as np
import pytest

from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.input import mt_corpus
from lingvo_gpipe.input import mt_input
from lingvo_gpipe.input import mt_vocab

VOCAB_SIZE = 32
_WORDS = [
  'alpha',
  'beta',
  'gamma',
  'delta',
  'omega',
  'sigma',
  'kappa',
  'zeta',
  'theta',
  'iota',
]
_SIZES = {'de': 400, 'fr': 40, 'ru': 8}


def _Sentence(rng, n):
  return ' '.join(rng.choice(_WORDS) for _ in range(n))


def _Pairs(seed, count):
  rng = np.random.RandomState(seed)
  return [
    (_Sentence(rng, rng.randint(1, 4)), _Sentence(rng, rng.randint(1, 4)))
    for _ in range(count)
  ]


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """de-en (TSV with bad lines), fr-en (TFRecord), ru-en (TSV), a vocab."""
  d = tmp_path_factory.mktemp('mt_data')
  pairs = {lang: _Pairs(i, n) for i, (lang, n) in enumerate(_SIZES.items())}
  mt_corpus.WriteTsv(str(d / 'de-en.train.tsv'), pairs['de'])
  with open(d / 'de-en.train.tsv', 'a') as f:
    f.write('\n')  # empty line
    f.write('   \n')  # blank line
    f.write('no tab on this line\n')  # malformed
    f.write('a\tb\tc\n')  # malformed: two tabs
    f.write('alpha beta\t  \n')  # empty target
    f.write(' '.join(['omega'] * 40) + '\talpha\n')  # too long
  mt_corpus.WriteTfRecord(str(d / 'fr-en.train.tfrecord'), pairs['fr'])
  mt_corpus.WriteTsv(str(d / 'ru-en.train.tsv'), pairs['ru'])
  mt_corpus.WriteTsv(str(d / 'de-en.dev.tsv'), pairs['de'][:10])
  mt_corpus.WriteTsv(str(d / 'fr-en.dev.tsv'), pairs['fr'][:5])
  texts = [s for p in pairs.values() for pair in p for s in pair]
  mt_vocab.TrainVocabulary(
    texts, str(d / 'spm'), VOCAB_SIZE, target_languages=['en', 'fr']
  )
  return d, pairs


def _Params(data_dir, **kwargs):
  p = mt_input.MultilingualMTInput.Params().Set(
    data_dir=str(data_dir),
    vocab_size=VOCAB_SIZE,
    batch_size=8,
    bucket_upper_bound=[16],
    seed=1,
  )
  return p.Set(**kwargs)


def _Batches(gen, n):
  return list(gen.GetDataset().take(n))


# -- Readers -------------------------------------------------------------------


def testTsvAndTfrecordReadersAgree(data, tmp_path):
  _, pairs = data
  mt_corpus.WriteTsv(str(tmp_path / 'a.tsv'), pairs['fr'])
  mt_corpus.WriteTfRecord(str(tmp_path / 'a.tfrecord'), pairs['fr'])
  tsv = [(s, t) for _, s, t in mt_corpus.ReadPairs(str(tmp_path / 'a.tsv'))]
  rec = [
    (s, t) for _, s, t in mt_corpus.ReadPairs(str(tmp_path / 'a.tfrecord'))
  ]
  assert tsv == rec == pairs['fr']


def testTfrecordWithoutTheFeaturesIsMalformed(tmp_path):
  path = str(tmp_path / 'x.tfrecord')
  mt_corpus.WriteTfRecord(path, [('a', 'b')], source_key='src')
  assert list(mt_corpus.ReadPairs(path)) == [(1, None, None)]
  assert list(mt_corpus.ReadPairs(path, 'src', 'target')) == [(1, 'a', 'b')]


def testCorpusSpecsAndDiscovery(data):
  d, _ = data
  assert mt_corpus.ParseCorpusSpec('de-en:/x/*.tsv') == ('de', 'en', '/x/*.tsv')
  assert mt_corpus.DiscoverCorpora(str(d), 'train') == [
    f'de-en:{d}/de-en.train.tsv',
    f'fr-en:{d}/fr-en.train.tfrecord',
    f'ru-en:{d}/ru-en.train.tsv',
  ]
  with pytest.raises(ValueError, match='SRC-TGT:FILE_PATTERN'):
    mt_corpus.ParseCorpusSpec('de-en.tsv')
  with pytest.raises(ValueError, match='No <src>-<tgt>.test.tsv'):
    mt_corpus.DiscoverCorpora(str(d), 'test')


def testUnknownLanguageCodesAreErrors(data):
  d, _ = data
  with pytest.raises(ValueError, match=r"Unknown language code 'xq'"):
    mt_corpus.ParseCorpusSpec('xq-en:/tmp/a.tsv')
  with pytest.raises(ValueError, match=r"Did you mean \['de'"):
    mt_corpus.CheckLanguage('DE')
  with pytest.raises(ValueError, match="Unknown language code 'zz'"):
    _Params(d, corpora=[f'zz-en:{d}/de-en.train.tsv']).Instantiate()


# -- Examples ------------------------------------------------------------------


def testBatchesHaveStaticShapesAndTheTargetLanguageToken(data):
  d, _ = data
  gen = _Params(d).Instantiate()
  batch = _Batches(gen, 1)[0]
  for key, value in batch.FlattenItems():
    assert value.shape[0] == 8, key
  assert batch.src.ids.shape.as_list() == [8, 16]
  assert batch.tgt.labels.shape.as_list() == [8, 16]
  vocab = gen.vocab
  en = vocab.TargetLanguageId('en')
  src = batch.src.ids.numpy()
  src_len = (1 - batch.src.paddings.numpy()).sum(1).astype(int)
  tgt_len = (1 - batch.tgt.paddings.numpy()).sum(1).astype(int)
  ids, labels = batch.tgt.ids.numpy(), batch.tgt.labels.numpy()
  for r in range(8):
    assert src[r, 0] == en  # <2en> first
    assert src[r, src_len[r] - 1] == mt_vocab.EOS_ID
    assert np.all(src[r, src_len[r] :] == mt_vocab.PAD_ID)
    assert ids[r, 0] == mt_vocab.BOS_ID  # decoder input: <s> + y
    assert labels[r, tgt_len[r] - 1] == mt_vocab.EOS_ID  # labels: y + </s>
    np.testing.assert_array_equal(
      ids[r, 1 : tgt_len[r]], labels[r, : tgt_len[r] - 1]
    )
  np.testing.assert_array_equal(
    batch.tgt.weights.numpy(), 1 - batch.tgt.paddings.numpy()
  )
  assert 'text' not in batch.src  # Training batches carry no strings.
  assert en != vocab.TargetLanguageId('fr')


def testBadLinesAreCountedAndSkipped(data):
  d, pairs = data
  gen = _Params(d).Instantiate()
  stats = gen.stats['de-en']
  assert stats == dict(
    read=len(pairs['de']) + 6,
    kept=len(pairs['de']),
    empty=3,
    malformed=2,
    too_long=1,
    truncated=0,
  )
  trunc = _Params(d, long_sentence_policy='truncate').Instantiate()
  assert trunc.stats['de-en']['truncated'] == 1
  assert trunc.stats['de-en']['kept'] == len(pairs['de']) + 1
  limited = _Params(d, max_examples_per_language=5).Instantiate()
  assert limited.stats['de-en']['kept'] == 5


def testTruncatedSentencesKeepTheirEos(data):
  d, _ = data
  gen = _Params(
    d,
    long_sentence_policy='truncate',
    corpora=[f'de-en:{d}/de-en.train.tsv'],
    bucket_upper_bound=[6],
  ).Instantiate()
  batch = _Batches(gen, 1)[0]
  src = batch.src.ids.numpy()
  assert src.shape[1] == 6
  lengths = (1 - batch.src.paddings.numpy()).sum(1).astype(int)
  for row, n in zip(src, lengths):
    assert row[n - 1] == mt_vocab.EOS_ID


def testCorpusWithoutUsablePairsIsAnError(data, tmp_path):
  d, _ = data
  path = tmp_path / 'de-en.train.tsv'
  path.write_text('\n\nno tab\n')
  with pytest.raises(ValueError, match='no usable pair.*1 malformed'):
    _ = _Params(d, corpora=[f'de-en:{path}']).Instantiate().stats
  with pytest.raises(ValueError, match='no file matches'):
    _ = _Params(d, corpora=[f'de-en:{tmp_path}/nope*.tsv']).Instantiate().stats


# -- Vocabulary ----------------------------------------------------------------


def testVocabularyIdsAndRoundTrip(data):
  d, pairs = data
  vocab = mt_vocab.Vocabulary(str(d / 'spm.model'))
  assert vocab.size == VOCAB_SIZE
  assert vocab.PieceToId('<pad>') == 0 and vocab.PieceToId('</s>') == 2
  text = pairs['de'][0][0]
  ids = vocab.Encode(text)
  assert vocab.Decode(ids) == text
  assert (
    vocab.Decode(
      [vocab.TargetLanguageId('en'), mt_vocab.BOS_ID]
      + ids
      + [mt_vocab.EOS_ID, 0, 0]
    )
    == text
  )


def testVocabSizeMismatchIsAClearError(data):
  d, _ = data
  gen = _Params(d, vocab_size=VOCAB_SIZE + 1).Instantiate()
  with pytest.raises(
    ValueError,
    match=r'has 32 pieces but the model.s '
    r'vocab_size is 33.*build_vocab.py --vocab_size=33',
  ):
    _ = gen.vocab


def testMissingVocabAndTargetTokenAreClearErrors(data, tmp_path):
  d, _ = data
  gen = _Params(d, vocab_path=str(tmp_path / 'none.model')).Instantiate()
  with pytest.raises(FileNotFoundError, match='tools/build_vocab.py'):
    _ = gen.vocab
  gen = _Params(d, corpora=[f'de-ru:{d}/de-en.train.tsv']).Instantiate()
  with pytest.raises(ValueError, match="no token '<2ru>'"):
    _ = gen.stats


# -- Sampling and buckets ------------------------------------------------------


def testTemperatureSamplingProbabilities():
  sizes = [400, 40, 8]
  np.testing.assert_allclose(
    mt_input.TemperatureSamplingProbs(sizes, 1.0), np.array(sizes) / 448
  )
  q5 = mt_input.TemperatureSamplingProbs(sizes, 5.0)
  p = np.array(sizes) / 448
  np.testing.assert_allclose(q5, p**0.2 / (p**0.2).sum())
  flat = mt_input.TemperatureSamplingProbs(sizes, 1e6)
  np.testing.assert_allclose(flat, [1 / 3] * 3, atol=1e-4)
  assert q5[2] > p[2]  # Low-resource languages are over-sampled.
  with pytest.raises(ValueError, match='sampling_temperature'):
    mt_input.TemperatureSamplingProbs(sizes, 0.0)


@pytest.mark.parametrize('temperature', [1.0, 5.0])
def testSampledLanguageFrequencies(data, temperature):
  d, _ = data
  gen = _Params(
    d, sampling_temperature=temperature, batch_size=50
  ).Instantiate()
  counts = collections.Counter()
  for batch in _Batches(gen, 60):
    counts.update(batch.lang.numpy().tolist())
  total = sum(counts.values())
  probs = gen.sampling_probs
  assert list(probs) == gen.languages == ['de-en', 'fr-en', 'ru-en']
  for i, lang in enumerate(gen.languages):
    assert counts[i] / total == pytest.approx(probs[lang], abs=0.025), lang


def testLengthBuckets(data):
  d, _ = data
  gen = _Params(
    d,
    bucket_upper_bound=[4, 16],
    bucket_batch_limit=[8, 4],
    long_sentence_policy='drop',
  ).Instantiate()
  shapes = collections.Counter()
  for batch in _Batches(gen, 40):
    b, w = batch.src.ids.shape.as_list()
    assert (b, w) in ((8, 4), (4, 16))
    assert batch.tgt.ids.shape.as_list() == [b, w]
    longest = np.maximum(
      (1 - batch.src.paddings.numpy()).sum(1),
      (1 - batch.tgt.paddings.numpy()).sum(1),
    )
    if w == 16:
      assert longest.max() > 4  # Only what does not fit the small bucket.
    shapes[w] += 1
  assert shapes[4] and shapes[16]


def testBadBucketParamsAreErrors(data):
  d, _ = data
  with pytest.raises(ValueError, match='bucket_upper_bound'):
    _Params(d, bucket_upper_bound=[16, 8]).Instantiate()
  with pytest.raises(ValueError, match='bucket_batch_limit'):
    _Params(d, bucket_upper_bound=[8, 16], bucket_batch_limit=[4]).Instantiate()
  with pytest.raises(ValueError, match='long_sentence_policy'):
    _Params(d, long_sentence_policy='cut').Instantiate()


# -- Evaluation input ----------------------------------------------------------


def testEvalInputIsOnePaddedPassWithText(data):
  d, pairs = data
  p = mt_input.MultilingualMTInput.EvalParams(_Params(d), 'Dev')
  assert p.split == 'dev' and p.num_epochs == 1 and not p.shuffle
  gen = p.Instantiate()
  batches = list(gen.GetDataset())
  assert len(batches) == 2  # 15 examples, batches of 8.
  weight = np.concatenate([b.weight.numpy() for b in batches])
  assert weight.sum() == 15 and weight.tolist()[-1] == 0
  text = [
    t.decode()
    for b in batches
    for t, w in zip(b.tgt.text.numpy(), b.weight.numpy())
    if w
  ]
  assert text == [t for _, t in pairs['de'][:10] + pairs['fr'][:5]]
  langs = np.concatenate([b.lang.numpy() for b in batches])[:15]
  assert langs.tolist() == [0] * 10 + [1] * 5
  assert gen.languages == ['de-en', 'fr-en']
  with pytest.raises(NotImplementedError, match='Dev'):
    mt_input.MultilingualMTInput.EvalParams(
      _Params(d, corpora=[f'de-en:{d}/de-en.train.tsv']), 'Dev'
    )


def testInputParamsRoundTripAsText(data):
  d, _ = data
  p = _Params(d, corpora=[f'de-en:{d}/de-en.train.tsv'])
  fresh = mt_input.MultilingualMTInput.Params()
  fresh.FromText(p.ToText())
  assert fresh.ToText() == p.ToText()


def testDemoCorpusIsBuiltWhenMissing(tmp_path):
  d = tmp_path / 'demo'
  p = _Params(d, demo_corpus=True, vocab_size=120)
  p.demo.Set(
    languages=['de', 'fr'], max_train_pairs=150, eval_pairs=10, max_digits=3
  )
  gen = p.Instantiate()
  assert not os.path.exists(d)  # Nothing happens before the data is read.
  batch = _Batches(gen, 1)[0]
  assert batch.src.ids.shape.as_list() == [8, 16]
  assert gen.languages == ['de-en', 'fr-en']
  assert os.path.exists(d / 'spm.model')
  dev = mt_input.MultilingualMTInput.EvalParams(p, 'Dev').Instantiate()
  assert sum(float(b.weight.numpy().sum()) for b in dev.GetDataset()) == 20


@pytest.mark.parametrize('autotune', [True, False])
def testAutotuneFollowsTheProcessSetting(data, monkeypatch, autotune):
  monkeypatch.setattr(base_input_generator, 'TF_DATA_AUTOTUNE', autotune)
  ds = _Params(data[0]).Instantiate().GetDataset()
  assert ds.options().autotune.enabled is (None if autotune else False)
