r"""Builds the offline num2words demo corpus (many languages -> English).

  python tools/make_demo_corpus.py [--output=~/.cache/lingvo_gpipe/demo_mt] \
      [--languages=de,fr,ru] [--seed=1234] [--max_train_pairs=4000] \
      [--eval_pairs=100] [--max_digits=4] [--vocab_size=1000] [--force]

Writes <xx>-en.{train,dev,test}.tsv for each language (numbers written out
in xx, paired with English; dev/test numbers never occur in train), the
sentencepiece vocabulary spm.model and manifest.json. The same settings give
the same files. mt.multilingual.TransformerTiny builds it itself when
missing (with its vocab_size); use this tool to inspect or customize it.
"""

import argparse
import sys

from lingvo_gpipe.core import quiet_start


def main(argv=None):
  quiet_start.ImportTensorFlow(min_log_level='2')
  from lingvo_gpipe.input import mt_demo  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--output', default=mt_demo.DefaultDemoDir())
  parser.add_argument(
    '--languages',
    default='',
    help='Comma-separated source languages; default all '
    f'{len(mt_demo.DEMO_LANGUAGES)}: ' + ','.join(mt_demo.DEMO_LANGUAGES),
  )
  parser.add_argument('--seed', type=int, default=1234)
  parser.add_argument('--max_train_pairs', type=int, default=4000)
  parser.add_argument('--eval_pairs', type=int, default=100)
  parser.add_argument('--max_digits', type=int, default=4)
  parser.add_argument('--vocab_size', type=int, default=1000)
  parser.add_argument(
    '--force', action='store_true', help='Replace an existing output directory.'
  )
  args = parser.parse_args(argv)
  languages = [x.strip() for x in args.languages.split(',') if x.strip()]
  try:
    manifest = mt_demo.BuildDemoCorpus(
      args.output,
      force=args.force,
      languages=languages or None,
      seed=args.seed,
      max_train_pairs=args.max_train_pairs,
      eval_pairs=args.eval_pairs,
      max_digits=args.max_digits,
      vocab_size=args.vocab_size,
    )
  except (ValueError, FileExistsError) as e:
    print(f'ERROR: {e}', file=sys.stderr)
    return 1
  counts = manifest['counts']
  total = {
    s: sum(v for k, v in counts.items() if k.endswith('.' + s))
    for s in ('train', 'dev', 'test')
  }
  print(
    f'Wrote {args.output}: {len(manifest["languages"])} languages, '
    f'{total["train"]} train / {total["dev"]} dev / {total["test"]} test '
    'pairs, vocabulary spm.model.'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
