"""Tests of the num2words demo corpus and the vocabulary tool."""

import json
import os
import pathlib
import runpy
import sys

import pytest

from lingvo_gpipe.input import mt_corpus
from lingvo_gpipe.input import mt_demo
from lingvo_gpipe.input import mt_vocab
from tests.testing import warm_python

REPO = pathlib.Path(__file__).resolve().parents[2]
_SMALL = dict(
  languages=['de', 'fr', 'ru'],
  max_train_pairs=300,
  eval_pairs=20,
  max_digits=3,
  vocab_size=150,
)


def _Read(path):
  return [(s, t) for _, s, t in mt_corpus.ReadPairs(str(path))]


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  out = tmp_path_factory.mktemp('demo') / 'corpus'
  manifest = mt_demo.BuildDemoCorpus(str(out), **_SMALL)
  return out, manifest


def testFilesSizesAndManifest(corpus):
  out, manifest = corpus
  names = sorted(os.listdir(out))
  for lang in ('de', 'fr', 'ru'):
    for split in ('train', 'dev', 'test'):
      assert f'{lang}-en.{split}.tsv' in names
  assert {'spm.model', 'spm.vocab', 'manifest.json'} <= set(names)
  # Unequal data, like high- and low-resource languages.
  sizes = mt_demo.TrainSizes(mt_demo.DemoSettings(**_SMALL))
  assert sizes == {'de': 300, 'fr': 95, 'ru': 30}
  assert len(_Read(out / 'ru-en.train.tsv')) == 30
  assert len(_Read(out / 'fr-en.dev.tsv')) == 20
  assert (
    json.loads((out / 'manifest.json').read_text())['counts']
    == (manifest['counts'])
  )
  assert mt_vocab.Vocabulary(str(out / 'spm.model')).size == 150


def testPairsAreNumbersInWordsTranslatedToEnglish(corpus):
  out, _ = corpus
  from num2words import num2words  # pylint: disable=g-import-not-at-top

  english = {num2words(n, lang='en'): n for n in range(1000)}
  for src, tgt in _Read(out / 'de-en.train.tsv')[:50]:
    assert tgt in english
    assert src == num2words(english[tgt], lang='de')


def testDevAndTestNumbersAreHeldOut(corpus):
  out, _ = corpus
  for lang in ('de', 'fr', 'ru'):
    train = {t for _, t in _Read(out / f'{lang}-en.train.tsv')}
    dev = {t for _, t in _Read(out / f'{lang}-en.dev.tsv')}
    test = {t for _, t in _Read(out / f'{lang}-en.test.tsv')}
    assert not train & dev and not train & test and not dev & test


def testReproducibleWithASeed(corpus, tmp_path):
  out, _ = corpus
  again = tmp_path / 'again'
  mt_demo.BuildDemoCorpus(
    str(again), **dict(_SMALL, vocab_size=60, languages=['de', 'fr'])
  )
  # Same seed and languages: the same German and French data.
  assert _Read(again / 'de-en.dev.tsv') == _Read(out / 'de-en.dev.tsv')
  other = tmp_path / 'other'
  mt_demo.BuildDemoCorpus(
    str(other), **dict(_SMALL, seed=5, vocab_size=60, languages=['de'])
  )
  assert _Read(other / 'de-en.train.tsv') != _Read(out / 'de-en.train.tsv')


def testEnsureChecksTheSettings(corpus, tmp_path):
  out, _ = corpus
  assert mt_demo.EnsureDemoCorpus(str(out), **_SMALL)['seed'] == 1234
  with pytest.raises(ValueError, match=r'other settings.*vocab_size.*--force'):
    mt_demo.EnsureDemoCorpus(str(out), **dict(_SMALL, vocab_size=99))
  (tmp_path / 'junk').mkdir()
  (tmp_path / 'junk' / 'x.txt').write_text('x')
  with pytest.raises(ValueError, match='not a demo corpus'):
    mt_demo.EnsureDemoCorpus(str(tmp_path / 'junk'), **_SMALL)
  with pytest.raises(ValueError, match="no language 'xh'"):
    mt_demo.DemoSettings(languages=['xh'])
  with pytest.raises(FileExistsError, match='--force'):
    mt_demo.BuildDemoCorpus(str(out), **_SMALL)


def _InProcess(name, capsys, *args):
  """Runs tools/<name>'s main(args) here: (exit status, stdout, stderr)."""
  module = runpy.run_path(str(REPO / 'tools' / name))
  status = module['main'](list(args))
  out = capsys.readouterr()
  return status, out.out, out.err


def _Tool(name, *args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  return warm_python.Run(
    [sys.executable, str(REPO / 'tools' / name), *args],
    cwd=REPO,
    env=env,
    timeout=120,
  )


def testToolsBuildTheCorpusAndAVocabulary(tmp_path, capsys):
  out = tmp_path / 'cli'
  # The command line once, in a process of its own; the rest in-process.
  res = _Tool(
    'make_demo_corpus.py',
    f'--output={out}',
    '--languages=de,it',
    '--max_train_pairs=100',
    '--eval_pairs=5',
    '--max_digits=2',
    '--vocab_size=60',
  )
  assert res.returncode == 0, res.stderr[-2000:]
  assert '2 languages, 110 train / 10 dev / 10 test pairs' in res.stdout
  status, _, err = _InProcess(
    'make_demo_corpus.py', capsys, f'--output={out}', '--languages=de'
  )
  assert status == 1 and '--force' in err
  status, _, err = _InProcess(
    'build_vocab.py',
    capsys,
    f'--data_dir={out}',
    '--vocab_size=50',
    f'--output={tmp_path}/v/spm',
    '--target_languages=en,de',
  )
  assert status == 0, err[-2000:]
  vocab = mt_vocab.Vocabulary(str(tmp_path / 'v' / 'spm.model'))
  assert vocab.size == 50 and vocab.TargetLanguageId('de') is not None
  status, _, err = _InProcess(
    'build_vocab.py',
    capsys,
    f'--data_dir={out}',
    '--vocab_size=5000',
    f'--output={tmp_path}/v/big',
  )
  assert status == 1 and 'lower --vocab_size' in err
