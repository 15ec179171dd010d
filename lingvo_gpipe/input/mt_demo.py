"""An offline many-to-English demo corpus: numbers written out in words.

`num2words` (a pip package that ships its grammars, no download) renders a
number in many languages; the English rendering is the translation:

  de  dreitausendvierhundertzwölf    ->  three thousand, four hundred and twelve
  fr  trois mille quatre cent douze  ->  three thousand, four hundred and twelve

`BuildDemoCorpus(out_dir)` writes, for each source language xx,
`xx-en.train.tsv`, `xx-en.dev.tsv` and `xx-en.test.tsv`, plus the shared
sentencepiece vocabulary `spm.model` and `manifest.json`. It is reproducible
(`seed`), and the numbers are split into disjoint train / dev / test pools
first, so dev and test sentences are held out: the model must compose
translations of numbers it never saw. Languages get unequal amounts of
training data (from `max_train_pairs` down to a tenth of it), like the
high- and low-resource languages of the paper, which is what temperature
sampling is for. A number has d digits (1 to `max_digits`) with probability
proportional to 2^d, so short sentences are common and long ones dominate.

The directory is written atomically (built in a temporary sibling and
renamed), so concurrent builders are safe. `EnsureDemoCorpus(out_dir, ...)`
builds it only when absent and checks that an existing one was made with the
same settings.
"""

import json
import os
import random
import shutil
import tempfile
import time

from absl import logging

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.input import mt_corpus
from lingvo_gpipe.input import mt_vocab

__all__ = [
  'DEMO_LANGUAGES',
  'DefaultDemoDir',
  'BuildDemoCorpus',
  'EnsureDemoCorpus',
  'DemoSettings',
  'DemoParams',
  'EnsureDemoFromParams',
  'MANIFEST',
  'VOCAB_PREFIX',
]

# ISO 639-1 code -> num2words language code.
# In order of decreasing training data ("high" to "low resource").
DEMO_LANGUAGES = {
  'de': 'de',
  'fr': 'fr',
  'es': 'es',
  'ru': 'ru',
  'it': 'it',
  'pt': 'pt',
  'nl': 'nl',
  'pl': 'pl',
  'tr': 'tr',
  'sv': 'sv',
  'cs': 'cs',
  'id': 'id',
  'ro': 'ro',
  'hu': 'hu',
  'da': 'da',
  'fi': 'fi',
  'uk': 'uk',
  'no': 'no',
  'vi': 'vi',
  'sr': 'sr',
  'lt': 'lt',
  'sl': 'sl',
  'lv': 'lv',
  'kk': 'kz',
}
MANIFEST = 'manifest.json'
VOCAB_PREFIX = 'spm'
_FORMAT_VERSION = 1
_SPLITS = ('train', 'dev', 'test')


def DefaultDemoDir():
  """$XDG_CACHE_HOME (or ~/.cache)/lingvo_gpipe/demo_mt."""
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join(
    os.path.expanduser('~'), '.cache'
  )
  return os.path.join(root, 'lingvo_gpipe', 'demo_mt')


def DemoSettings(
  languages=None,
  seed=1234,
  max_train_pairs=4000,
  eval_pairs=100,
  max_digits=4,
  vocab_size=1000,
  held_out_fraction=0.1,
):
  """The settings dict a demo corpus is built from (stored in its manifest).

  Args:
    languages: source language codes (keys of DEMO_LANGUAGES), from the
      most to the least training data; None: all, in DEMO_LANGUAGES order.
    seed: seed of every random choice.
    max_train_pairs: training pairs of the first (largest) language; the
      last gets a tenth of it, geometrically in between.
    eval_pairs: dev and test pairs per language.
    max_digits: numbers have 1 .. max_digits digits.
    vocab_size: pieces of the sentencepiece vocabulary.
    held_out_fraction: fraction of the numbers reserved for dev, and the
      same for test.
  """
  languages = list(languages or DEMO_LANGUAGES)
  if len(set(languages)) != len(languages):
    raise ValueError(f'Duplicate demo languages in {languages}.')
  for lang in languages:
    mt_corpus.CheckLanguage(lang)
    if lang not in DEMO_LANGUAGES:
      raise ValueError(
        f'The demo corpus has no language {lang!r}; choose '
        f'from {sorted(DEMO_LANGUAGES)}.'
      )
  if not 1 <= max_digits <= 7:
    raise ValueError(f'max_digits = {max_digits}; use 1 .. 7.')
  if not 0 < held_out_fraction < 0.5:
    raise ValueError(
      f'held_out_fraction = {held_out_fraction}; use a value '
      'in (0, 0.5), e.g. 0.1.'
    )
  return dict(
    version=_FORMAT_VERSION,
    languages=languages,
    seed=int(seed),
    max_train_pairs=int(max_train_pairs),
    eval_pairs=int(eval_pairs),
    max_digits=int(max_digits),
    vocab_size=int(vocab_size),
    held_out_fraction=float(held_out_fraction),
    target='en',
  )


def _NumberPools(settings):
  """{'train' | 'dev' | 'test': sorted list of numbers}, disjoint."""
  rng = random.Random(settings['seed'])
  numbers = list(range(10 ** settings['max_digits']))
  rng.shuffle(numbers)
  k = max(1, int(len(numbers) * settings['held_out_fraction']))
  return {
    'dev': sorted(numbers[:k]),
    'test': sorted(numbers[k : 2 * k]),
    'train': sorted(numbers[2 * k :]),
  }


def _Draw(rng, pool_by_digits, count):
  """`count` numbers of a pool; d digits with probability ~ 2^d."""
  digits = sorted(d for d, nums in pool_by_digits.items() if nums)
  weights = [2.0**d for d in digits]
  return [
    rng.choice(pool_by_digits[rng.choices(digits, weights)[0]])
    for _ in range(count)
  ]


def _ByDigits(pool):
  out = {}
  for n in pool:
    out.setdefault(len(str(n)), []).append(n)
  return out


def _Render(n, lang):
  from num2words import num2words  # pylint: disable=g-import-not-at-top

  return ' '.join(num2words(n, lang=lang).split())


def TrainSizes(settings):
  """{lang: training pairs}: max_train_pairs down to a tenth of it."""
  langs = settings['languages']
  top = settings['max_train_pairs']
  if len(langs) == 1:
    return {langs[0]: top}
  return {
    lang: max(1, round(top * 0.1 ** (i / (len(langs) - 1))))
    for i, lang in enumerate(langs)
  }


def _Write(out_dir, settings):
  pools = {k: _ByDigits(v) for k, v in _NumberPools(settings).items()}
  sizes = TrainSizes(settings)
  counts, texts = {}, []
  for lang in settings['languages']:
    rng = random.Random(f'{settings["seed"]}-{lang}')
    for split in _SPLITS:
      count = sizes[lang] if split == 'train' else settings['eval_pairs']
      numbers = _Draw(rng, pools[split], count)
      pairs = [
        (_Render(n, DEMO_LANGUAGES[lang]), _Render(n, 'en')) for n in numbers
      ]
      mt_corpus.WriteTsv(os.path.join(out_dir, f'{lang}-en.{split}.tsv'), pairs)
      counts[f'{lang}-en.{split}'] = len(pairs)
      if split == 'train':
        texts.extend(s for pair in pairs for s in pair)
  mt_vocab.TrainVocabulary(
    texts,
    os.path.join(out_dir, VOCAB_PREFIX),
    settings['vocab_size'],
    target_languages=['en'],
    seed=settings['seed'],
  )
  manifest = dict(settings, counts=counts)
  with open(os.path.join(out_dir, MANIFEST), 'w') as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
  return manifest


def BuildDemoCorpus(out_dir=None, force=False, **settings):
  """Builds the demo corpus into `out_dir` (default `DefaultDemoDir()`).

  Args:
    out_dir: target directory (created; must not exist unless `force`).
    force: replace an existing directory.
    **settings: `DemoSettings` arguments.

  Returns:
    The manifest dict (the settings plus the pair counts per file).
  """
  out_dir = os.path.abspath(out_dir or DefaultDemoDir())
  settings = DemoSettings(**settings)
  if os.path.exists(out_dir) and not force:
    raise FileExistsError(
      f'{out_dir} exists; pass force=True (--force) to rebuild it.'
    )
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  start = time.time()
  tmp = tempfile.mkdtemp(prefix='.demo_mt-', dir=parent)
  try:
    manifest = _Write(tmp, settings)
    if force and os.path.exists(out_dir):
      shutil.rmtree(out_dir)
    try:
      os.rename(tmp, out_dir)
    except OSError:
      if not os.path.exists(os.path.join(out_dir, MANIFEST)):
        raise
      logging.info('Another process built %s meanwhile; using it.', out_dir)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
  logging.info(
    'Built the demo corpus %s (%d languages) in %.1f s.',
    out_dir,
    len(settings['languages']),
    time.time() - start,
  )
  return manifest


def ReadManifest(out_dir):
  path = os.path.join(out_dir, MANIFEST)
  with open(path) as f:
    return json.load(f)


def EnsureDemoCorpus(out_dir=None, **settings):
  """Builds the demo corpus if `out_dir` has none; checks its settings.

  Returns:
    The manifest dict.

  Raises:
    ValueError: `out_dir` holds a demo corpus built with other settings.
  """
  out_dir = os.path.abspath(out_dir or DefaultDemoDir())
  wanted = DemoSettings(**settings)
  if not os.path.exists(os.path.join(out_dir, MANIFEST)):
    if os.path.exists(out_dir) and os.listdir(out_dir):
      raise ValueError(
        f'{out_dir} is not empty but has no {MANIFEST}; it is '
        'not a demo corpus. Point data_dir elsewhere.'
      )
    if os.path.isdir(out_dir):
      os.rmdir(out_dir)
    logging.info('Building the demo corpus in %s (once; cached).', out_dir)
    return BuildDemoCorpus(out_dir, **settings)
  manifest = ReadManifest(out_dir)
  have = {k: manifest.get(k) for k in wanted}
  if have != wanted:
    diff = {k: (have[k], wanted[k]) for k in wanted if have[k] != wanted[k]}
    raise ValueError(
      f'The demo corpus in {out_dir} was built with other settings '
      f'(cached, wanted): {diff}. Rebuild it with `python '
      f'tools/make_demo_corpus.py --output={out_dir} --force` and the '
      'settings you want, or use another data_dir.'
    )
  return manifest


def DemoParams():
  """The `demo` Params of an input that reads the demo corpus: the
  settings `EnsureDemoCorpus` takes (but the vocabulary size, which is the
  model's)."""
  d = hyperparams.Params()
  d.Define(
    'languages',
    [],
    'Source languages (DEMO_LANGUAGES keys); []: all.',
  )
  d.Define('seed', 1234, 'Seed of the demo corpus.')
  d.Define('max_train_pairs', 4000, 'Training pairs of the largest language.')
  d.Define('eval_pairs', 100, 'Dev and test pairs per language.')
  d.Define('max_digits', 4, 'Numbers have up to this many digits.')
  return d


def EnsureDemoFromParams(out_dir, demo, vocab_size):
  """`EnsureDemoCorpus` with the settings of `demo` (`DemoParams`)."""
  return EnsureDemoCorpus(
    out_dir,
    languages=list(demo.languages) or None,
    seed=demo.seed,
    max_train_pairs=demo.max_train_pairs,
    eval_pairs=demo.eval_pairs,
    max_digits=demo.max_digits,
    vocab_size=vocab_size,
  )
