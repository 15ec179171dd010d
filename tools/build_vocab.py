r"""Builds the shared sentencepiece vocabulary of a multilingual model.

  python tools/build_vocab.py --data_dir=/data --split=train \
      --vocab_size=64000 --output=/data/spm
  python tools/build_vocab.py --corpora='de-en:de-en.tsv,fr-en:fr-en.tsv' \
      --vocab_size=8000 --output=/tmp/spm --target_languages=en

Reads both sides of every corpus (TSV `source<TAB>target` or TFRecord),
learns one sentencepiece model over all languages and writes
OUTPUT.model / OUTPUT.vocab, with the ids the input expects: 0 <pad>,
1 <s>, 2 </s>, 3 <unk>, then one <2xx> token per target language. The model's
vocab_size must equal --vocab_size.
"""

import argparse
import sys

from lingvo_gpipe.core import quiet_start


def Sentences(specs):
  """Yields both sides of every well-formed pair of the corpora."""
  from lingvo_gpipe.input import mt_corpus  # pylint: disable=g-import-not-at-top

  for spec in specs:
    _, _, pattern = mt_corpus.ParseCorpusSpec(spec)
    for path in mt_corpus.ExpandPattern(pattern, spec):
      for _, src, tgt in mt_corpus.ReadPairs(path):
        if src is not None:
          yield src
          yield tgt


def main(argv=None):
  quiet_start.ImportTensorFlow(min_log_level='2')
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--corpora', default='', help='Comma-separated SRC-TGT:FILE_PATTERN specs.'
  )
  parser.add_argument(
    '--data_dir',
    default='',
    help='Or: a directory of <src>-<tgt>.<split>.tsv files.',
  )
  parser.add_argument('--split', default='train')
  parser.add_argument('--vocab_size', type=int, required=True)
  parser.add_argument(
    '--output',
    required=True,
    help='Output prefix (writes PREFIX.model/.vocab).',
  )
  parser.add_argument(
    '--target_languages',
    default='en',
    help='Comma-separated codes that get a <2xx> token.',
  )
  parser.add_argument(
    '--model_type',
    default='unigram',
    choices=['unigram', 'bpe', 'char', 'word'],
  )
  parser.add_argument('--character_coverage', type=float, default=1.0)
  parser.add_argument('--max_sentences', type=int, default=2_000_000)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)

  from lingvo_gpipe.input import mt_corpus  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.input import mt_vocab  # pylint: disable=g-import-not-at-top

  try:
    if args.corpora:
      specs = [s for s in args.corpora.split(',') if s.strip()]
    elif args.data_dir:
      specs = mt_corpus.DiscoverCorpora(args.data_dir, args.split)
    else:
      raise ValueError('Give --corpora or --data_dir.')
    targets = [t.strip() for t in args.target_languages.split(',') if t.strip()]
    for t in targets:
      mt_corpus.CheckLanguage(t, '--target_languages')
    path = mt_vocab.TrainVocabulary(
      Sentences(specs),
      args.output,
      args.vocab_size,
      targets,
      args.model_type,
      args.character_coverage,
      args.max_sentences,
      args.seed,
    )
  except (ValueError, FileNotFoundError) as e:
    print(f'ERROR: {e}', file=sys.stderr)
    return 1
  print(f'Wrote {path} ({args.vocab_size} pieces) from {len(specs)} corpora.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
