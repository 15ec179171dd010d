"""LmTextInput: fixed-shape LM rows from text files or the demo corpus."""

import re

import numpy as np
import pytest

from lingvo_gpipe.input import lm_input
from lingvo_gpipe.input import mt_demo
from lingvo_gpipe.input import mt_vocab


@pytest.fixture(scope='module')
def demo_dir(tmp_path_factory):
  """A small demo corpus (and its vocabulary), built once for the module."""
  d = tmp_path_factory.mktemp('demo')
  mt_demo.EnsureDemoCorpus(
    str(d),
    languages=['de', 'fr'],
    max_train_pairs=300,
    eval_pairs=20,
    vocab_size=200,
  )
  return d


def _Params(demo_dir, **kw):
  p = lm_input.LmTextInput.Params().Set(
    vocab_path=str(demo_dir / 'spm.model'),
    vocab_size=200,
    batch_size=4,
    max_tokens=8,
    shuffle=False,
  )
  return p.Set(**kw)


def testRowsAreShiftedPiecesWithPaddings(demo_dir, tmp_path):
  text = tmp_path / 'a.txt'
  text.write_text(
    'three hundred\n\n  twelve  \nnine thousand, four hundred\none\n'
  )
  inp = _Params(
    demo_dir, file_pattern=f'text:{text}', max_tokens=4
  ).Instantiate()
  batch = next(iter(inp.GetDataset()))
  vocab = inp.vocab
  ids, labels = batch.ids.numpy(), batch.labels.numpy()
  assert ids.shape == labels.shape == (4, 4)
  for row, sentence in enumerate(
    ['three hundred', 'twelve', 'nine thousand, four hundred', 'one']
  ):
    pieces = vocab.Encode(sentence)[:3]
    n = len(pieces) + 1
    assert list(ids[row, :n]) == [mt_vocab.BOS_ID] + pieces
    want = pieces + (
      [mt_vocab.EOS_ID] if len(vocab.Encode(sentence)) <= 3 else []
    )
    assert list(labels[row, : len(want)]) == want
    np.testing.assert_array_equal(
      batch.paddings.numpy()[row], [0.0] * len(want) + [1.0] * (4 - len(want))
    )
  np.testing.assert_array_equal(batch.weights, 1.0 - batch.paddings.numpy())
  assert inp.stats['num_sentences'] == 4 and inp.stats['num_cut'] >= 1


def _Demo(demo_dir, split):
  p = lm_input.LmTextInput.Params().Set(
    demo_corpus=True,
    data_dir=str(demo_dir),
    split=split,
    vocab_size=200,
    batch_size=4,
    max_tokens=32,
  )
  p.demo.Set(languages=['de', 'fr'], max_train_pairs=300, eval_pairs=20)
  return p


def _Texts(inp):
  ids, _, lengths = inp._Arrays()  # pylint: disable=protected-access
  return {inp.vocab.Decode(row[1:n]) for row, n in zip(ids, lengths)}


def testDemoCorpusIsTheEnglishSideWithDevHeldOut(demo_dir):
  train = _Demo(demo_dir, 'train').Instantiate()
  dev_p = lm_input.LmTextInput.EvalParams(_Demo(demo_dir, 'train'), 'Dev')
  dev = dev_p.Instantiate()
  assert dev.params.split == 'dev' and dev.params.num_epochs == 1
  train_texts, dev_texts = _Texts(train), _Texts(dev)
  assert len(train_texts) > 100 and len(dev_texts) > 10
  assert not train_texts & dev_texts
  words = ' '.join(train_texts).replace(',', ' ').replace('-', ' ').split()
  assert set(words) <= {
    'and',
    'hundred',
    'thousand',
    'one',
    'two',
    'three',
    'four',
    'five',
    'six',
    'seven',
    'eight',
    'nine',
    'ten',
    'eleven',
    'twelve',
    'thirteen',
    'fourteen',
    'fifteen',
    'sixteen',
    'seventeen',
    'eighteen',
    'nineteen',
    'twenty',
    'thirty',
    'forty',
    'fifty',
    'sixty',
    'seventy',
    'eighty',
    'ninety',
    'zero',
  }, set(words)
  # Other demo settings than the cached corpus's are refused.
  other = _Demo(demo_dir, 'train')
  other.demo.max_train_pairs = 301
  with pytest.raises(ValueError):
    _ = other.Instantiate().vocab


def testEvalPassIsPaddedAndWeighted(demo_dir, tmp_path):
  text = tmp_path / 'a.txt'
  text.write_text('one\ntwo\nthree\nfour\nfive\n')
  train = _Params(demo_dir, file_pattern=str(text))
  p = lm_input.LmTextInput.SetEvalSettings(train.Copy())
  batches = list(p.Instantiate().GetDataset())
  assert len(batches) == 2
  np.testing.assert_array_equal(batches[1].weight, [1, 0, 0, 0])
  assert batches[1].weights.numpy()[1:].sum() == 0
  with pytest.raises(NotImplementedError, match='define Dev'):
    lm_input.LmTextInput.EvalParams(train, 'Dev')


@pytest.mark.parametrize(
  'kw, needle',
  [
    (dict(max_tokens=1), 'max_tokens = 1'),
    (dict(vocab_size=0), 'vocab_size = 0'),
    (dict(file_pattern=''), 'no data; set file_pattern'),
    (dict(demo_corpus=True, split='valid'), "split = 'valid'"),
  ],
)
def testBadParamsFailInOneLine(demo_dir, kw, needle):
  p = _Params(demo_dir, file_pattern='x.txt').Set(**kw)
  with pytest.raises(ValueError, match=re.escape(needle)) as e:
    p.Instantiate()
  assert '\n' not in str(e.value)


def testMissingFilesNameThePattern(demo_dir, tmp_path):
  inp = _Params(demo_dir, file_pattern=f'text:{tmp_path}/none*').Instantiate()
  with pytest.raises(FileNotFoundError, match='none'):
    inp.GetDataset()
