r"""Prints the BLEU per language of a trained multilingual model.

  python tools/eval_bleu.py --model=mt.multilingual.TransformerTiny \
      --logdir=/tmp/mt [--dataset=Test] [--beam_size=4] [--max_batches=N] \
      [--num_cpu_devices=2] [--show=5]

Without --num_cpu_devices (and without a GPU) the CPU is split into as many
devices as the model's pipelines need.

Restores the latest checkpoint of <logdir>/train (or --checkpoint), decodes
the dataset with the model's beam search (--beam_size=1: greedy) and prints
sacrebleu's BLEU for each source language, their average and the corpus
BLEU. --json=FILE also writes them as JSON. Decoding progress goes to
stderr: "decoded batch 3/10 (192 sentences), 12.3 s" at most every
--progress_every_s seconds, and a last line when decoding ends.
"""

import argparse
import json
import sys

from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

quiet_start.ImportTensorFlow(min_log_level='2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top


def DevicesNeeded(model, dataset='Test', overrides=None):
  """The devices the pipelines of registered `model` are placed on: the
  largest num_stages x num_replicas of its PipeliningLayers (1 if none)."""
  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import model_registry
  from lingvo_gpipe import trainer

  p = model_registry.GetParams(model, dataset)
  if overrides:
    p.FromText(overrides)
  needed = 1
  for _, lp in trainer.PipelineLayers(p):
    stages = (
      len(lp.cell_tpl)
      or lp.num_stages
      or (len(lp.devices) // max(1, lp.num_replicas) if lp.devices else 1)
    )
    needed = max(needed, stages * max(1, lp.num_replicas))
  return needed


def _Parser():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', required=True, help='Registry key.')
  parser.add_argument('--logdir', required=True, help='Training logdir.')
  parser.add_argument('--dataset', default='Test', help='Dev or Test.')
  parser.add_argument(
    '--beam_size',
    type=int,
    default=None,
    help="Beams (1: greedy); default: the model's.",
  )
  parser.add_argument('--max_batches', type=int, default=None)
  parser.add_argument(
    '--checkpoint', default=None, help='Checkpoint prefix; default: the latest.'
  )
  parser.add_argument(
    '--num_cpu_devices',
    type=int,
    default=None,
    help='Split the CPU into N devices (as in training); default: as many '
    "as the model's pipelines need (on a machine without GPUs).",
  )
  parser.add_argument(
    '--model_params_override',
    default=None,
    help='"a.b : value" lines (";"-separated).',
  )
  parser.add_argument(
    '--show', type=int, default=0, help='Also print this many translations.'
  )
  parser.add_argument('--json', default=None, help='Write the scores here.')
  parser.add_argument(
    '--progress_every_s',
    type=float,
    default=10.0,
    help='A decoding progress line on stderr at most this often (0: after '
    'every batch), and one at the end; stdout and --json are unchanged.',
  )
  return parser


def main(argv=None):
  args = _Parser().parse_args(argv)

  from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top

  overrides = (
    args.model_params_override.replace(';', '\n')
    if args.model_params_override
    else None
  )
  num_cpu_devices = args.num_cpu_devices
  if num_cpu_devices is None and not tf.config.list_physical_devices('GPU'):
    try:
      num_cpu_devices = DevicesNeeded(args.model, args.dataset, overrides)
    except (ValueError, KeyError, AttributeError) as e:
      print(f'ERROR: {e}', file=sys.stderr)
      return 1
  if num_cpu_devices and num_cpu_devices > 1:
    cluster.SplitCpu(num_cpu_devices)
  from lingvo_gpipe.runners import evaler  # pylint: disable=g-import-not-at-top

  try:
    step, report = evaler.EvaluateBleuCheckpoint(
      args.model,
      args.logdir,
      args.dataset,
      args.beam_size,
      args.max_batches,
      args.checkpoint,
      overrides,
      progress=lambda line: print(line, file=sys.stderr, flush=True),
      progress_every_s=args.progress_every_s,
    )
  except (ValueError, KeyError, FileNotFoundError) as e:
    print(f'ERROR: {e}', file=sys.stderr)
    return 1
  print(f'{args.model} step {step}, {args.dataset}:')
  print(report)
  for h, r, lang in list(zip(report.hyps, report.refs, report.langs))[
    : args.show
  ]:
    print(f'[{lang}] {h!r}  (reference {r!r})')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(
        dict(step=step, dataset=args.dataset, **report.Metrics()),
        f,
        indent=1,
        sort_keys=True,
      )
  return 0


if __name__ == '__main__':
  sys.exit(main())
