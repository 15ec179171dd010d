"""Parallel corpora of the multilingual input: specs, readers, languages.

A corpus is one language pair in one or more files:

  'de-en:/data/de-en.train.tsv'          TSV: `source<TAB>target` per line
  'fr-en:/data/fr-en.train-*.tfrecord'   TFRecord of tf.train.Example with
                                         bytes features 'source' and 'target'

The format is chosen by the extension (.tfrecord / .tfrecords / .tfr:
TFRecord, anything else: TSV). `DiscoverCorpora(data_dir, split)` finds
`<src>-<tgt>.<split>.tsv` (or .tfrecord) files in a directory.

Language codes are ISO 639-1 (two letters) plus the ISO 639-2/3 codes of
languages without one that MT data sets use (ceb, haw, hmn, fil, yue, ...);
an unknown code is an error naming the closest known codes, since a typo
would otherwise make a new language.

`ReadPairs(path)` yields `(line_number, source, target)` for well-formed
records and `(line_number, None, None)` for malformed ones (a TSV line
without exactly one tab), which the input counts and skips.
"""

import difflib
import glob
import os
import re

__all__ = [
  'LANGUAGE_CODES',
  'CheckLanguage',
  'ParseCorpusSpec',
  'DiscoverCorpora',
  'ReadPairs',
  'WriteTsv',
  'WriteTfRecord',
  'IsTfRecord',
  'ExpandPattern',
]

# ISO 639-1, plus 639-2/3 codes used by multilingual MT corpora.
LANGUAGE_CODES = frozenset(
  """
aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co
cr cs cu cv cy da de dv dz ee el en eo es et eu fa ff fi fj fo fr fy ga gd gl
gn gu gv ha he hi ho hr ht hu hy hz ia id ie ig ii ik io is it iu ja jv ka kg
ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk
ml mn mr ms mt my na nb nd ne ng nl nn no nr nv ny oc oj om or os pa pi pl ps
pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su sv sw ta
te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za
zh zu ceb haw hmn fil yue ast ckb kab kmr tet
""".split()
)

_TFRECORD_EXTS = ('.tfrecord', '.tfrecords', '.tfr')
_SPEC_RE = re.compile(r'^([A-Za-z]{2,3})-([A-Za-z]{2,3}):(.+)$')


def CheckLanguage(code, where=''):
  """Returns `code` if it is a known language code, else ValueError."""
  if code in LANGUAGE_CODES:
    return code
  close = difflib.get_close_matches(
    str(code).lower(), sorted(LANGUAGE_CODES), n=3, cutoff=0.5
  )
  hint = f' Did you mean {close}?' if close else ''
  raise ValueError(
    f'Unknown language code {code!r}{" in " + where if where else ""}.'
    f'{hint} Use lower-case ISO 639-1 codes such as "de" or "fr" (ISO '
    '639-3 where a language has no two-letter code, e.g. "ceb"); the '
    'full list is lingvo_gpipe.input.mt_corpus.LANGUAGE_CODES.'
  )


def ParseCorpusSpec(spec):
  """'de-en:/path/*.tsv' -> ('de', 'en', '/path/*.tsv'), languages checked."""
  m = _SPEC_RE.match(spec.strip()) if isinstance(spec, str) else None
  if not m:
    raise ValueError(
      f'Corpus spec {spec!r} is not "SRC-TGT:FILE_PATTERN", e.g. '
      '"de-en:/data/de-en.train.tsv".'
    )
  src, tgt, pattern = m.group(1), m.group(2), m.group(3)
  CheckLanguage(src, f'corpus spec {spec!r}')
  CheckLanguage(tgt, f'corpus spec {spec!r}')
  return src, tgt, pattern


def DiscoverCorpora(data_dir, split):
  """['src-tgt:path', ...] for the `<src>-<tgt>.<split>.<ext>` files.

  Raises:
    ValueError: the directory is missing or holds no such file.
  """
  if not data_dir or not os.path.isdir(data_dir):
    raise ValueError(
      f'Corpus directory {data_dir!r} does not exist; set '
      'input.data_dir to the directory of '
      f'<src>-<tgt>.{split}.tsv files or list them in '
      'input.corpora.'
    )
  specs = []
  for name in sorted(os.listdir(data_dir)):
    m = re.match(
      rf'^([a-z]{{2,3}})-([a-z]{{2,3}})\.{re.escape(split)}'
      r'\.(tsv|txt|tfrecords?|tfr)$',
      name,
    )
    if m:
      specs.append(f'{m.group(1)}-{m.group(2)}:{os.path.join(data_dir, name)}')
  if not specs:
    raise ValueError(
      f'No <src>-<tgt>.{split}.tsv (or .tfrecord) files in '
      f'{data_dir!r}; list the corpora in input.corpora '
      'instead, or build the demo corpus with '
      'tools/make_demo_corpus.py.'
    )
  return specs


def IsTfRecord(path):
  return path.lower().endswith(_TFRECORD_EXTS)


def ExpandPattern(pattern, spec=''):
  """Sorted files of a glob pattern or comma-separated list; never empty."""
  files = []
  for part in pattern.split(','):
    part = part.strip()
    if part:
      files.extend(
        sorted(glob.glob(part)) if any(c in part for c in '*?[') else [part]
      )
  missing = [f for f in files if not os.path.isfile(f)]
  if not files or missing:
    raise ValueError(
      f'Corpus {spec or pattern!r}: no file matches '
      f'{missing or pattern!r}. Check the path.'
    )
  return files


def _ReadTsv(path):
  with open(path, encoding='utf-8', errors='replace') as f:
    for n, line in enumerate(f, 1):
      line = line.rstrip('\n').rstrip('\r')
      parts = line.split('\t')
      if len(parts) != 2:
        if not line.strip():
          yield n, '', ''  # An empty line: counted as empty.
        else:
          yield n, None, None
        continue
      yield n, parts[0], parts[1]


def _ReadTfRecord(path, source_key, target_key):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  for n, record in enumerate(tf.data.TFRecordDataset(path), 1):
    example = tf.train.Example.FromString(record.numpy())
    feats = example.features.feature
    if source_key not in feats or target_key not in feats:
      yield n, None, None
      continue
    src = feats[source_key].bytes_list.value
    tgt = feats[target_key].bytes_list.value
    if len(src) != 1 or len(tgt) != 1:
      yield n, None, None
      continue
    yield (
      n,
      src[0].decode('utf-8', 'replace'),
      tgt[0].decode('utf-8', 'replace'),
    )


def ReadPairs(path, source_key='source', target_key='target'):
  """Yields (record number, source, target); (n, None, None) if malformed."""
  if IsTfRecord(path):
    yield from _ReadTfRecord(path, source_key, target_key)
  else:
    yield from _ReadTsv(path)


def WriteTsv(path, pairs):
  """Writes (source, target) pairs as `source<TAB>target` lines."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for src, tgt in pairs:
      if '\t' in src or '\t' in tgt or '\n' in src or '\n' in tgt:
        raise ValueError(
          f'WriteTsv: {src!r} / {tgt!r} contains a tab or '
          'newline; TSV cannot hold it (use a TFRecord).'
        )
      f.write(f'{src}\t{tgt}\n')


def WriteTfRecord(path, pairs, source_key='source', target_key='target'):
  """Writes (source, target) pairs as tf.train.Examples."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with tf.io.TFRecordWriter(path) as w:
    for src, tgt in pairs:
      feats = {
        source_key: tf.train.Feature(
          bytes_list=tf.train.BytesList(value=[src.encode('utf-8')])
        ),
        target_key: tf.train.Feature(
          bytes_list=tf.train.BytesList(value=[tgt.encode('utf-8')])
        ),
      }
      w.write(
        tf.train.Example(
          features=tf.train.Features(feature=feats)
        ).SerializeToString()
      )
