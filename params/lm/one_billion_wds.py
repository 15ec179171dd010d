r"""Lingvo's GPipe Transformer LM on the One Billion Words benchmark, and a
tiny one that trains offline.

`OneBWdsGPipeTransformerWPM` has Lingvo's values: a 32k word-piece
vocabulary, d = 2048 (feed-forward 8192), 16 heads, 32 layers split into 4
cells ([8, 16, 24, 32]), 32 micro-batches, batches of 32 rows of 1024
tokens, Adam at learning rate 0.5 with the Transformer schedule (40k warm-up
steps). It reads the benchmark's shards and a sentencepiece model from
CORPUS_DIR (override with --model_params_override="input.file_pattern :
text:/data/news.en-*" and "input.vocab_path : /data/wpm.model"). Size it up
without allocating a weight:

  python tools/inspect_model.py \
      --model=lm.one_billion_wds.OneBWdsGPipeTransformerWPM

`OneBWdsGPipeTransformerTiny` is the same model at d = 64, 4 layers in 2
cells, on the English sentences of the library's num2words demo corpus
(built and cached on first use; no download). It trains on two CPU devices
in about 20 s, its dev perplexity falling from about the vocabulary size
(1000) to under 3:

  python -m lingvo_gpipe.trainer \
      --model=lm.one_billion_wds.OneBWdsGPipeTransformerTiny \
      --logdir=/tmp/lm --num_cpu_devices=2 --mode=sync \
      --job=trainer,evaler_dev
"""

import os

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model_params
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import schedule
from lingvo_gpipe.input import lm_input
from lingvo_gpipe.models import gpipe_lm

__all__ = [
  'OneBWdsGPipeTransformerBase',
  'OneBWdsGPipeTransformerWPM',
  'OneBWdsGPipeTransformerTiny',
  'OneBWdsGPipeTransformerHalfB',
]


class OneBWdsGPipeTransformerBase(base_model_params.SingleTaskModelParams):
  """Unregistered base; subclasses set the constants."""

  CORPUS_DIR = '/tmp/lm1b/1-billion-word-language-modeling-benchmark-r13output'
  VOCAB_SIZE = 32000
  EMBEDDING_DIM = 2048
  HIDDEN_DIM = 8192
  NUM_HEADS = 16
  NUM_LAYERS = 32
  SPLITS = [8, 16, 24, 32]
  NUM_MICRO_BATCHES = 32
  NUM_SHARDS = 16
  BATCH_SIZE = 32
  MAX_TOKENS = 1024
  RESIDUAL_DROPOUT = 0.1
  ATTEN_DROPOUT = 0.1
  LEARNING_RATE = 0.5
  WARMUP_STEPS = 40000
  MAX_STEPS = 4 * 10**6
  DEMO_CORPUS = False
  RANDOM_SEED = 1234
  # None: the trainer's defaults.
  SAVE_INTERVAL_STEPS = None
  SUMMARY_INTERVAL_STEPS = None
  SAVE_MAX_TO_KEEP = None

  def _Input(self):
    p = lm_input.LmTextInput.Params().Set(
      vocab_size=self.VOCAB_SIZE,
      max_tokens=self.MAX_TOKENS,
      batch_size=self.BATCH_SIZE,
      demo_corpus=self.DEMO_CORPUS,
    )
    if not self.DEMO_CORPUS:
      p.file_pattern = 'text:' + os.path.join(
        self.CORPUS_DIR, 'training-monolingual.tokenized.shuffled', 'news.en*'
      )
      p.vocab_path = os.path.join(self.CORPUS_DIR, 'wpm.model')
    return p

  def Train(self):
    return self._Input()

  def Dev(self):
    if self.DEMO_CORPUS:
      return lm_input.LmTextInput.EvalParams(self._Input(), 'Dev')
    p = lm_input.LmTextInput.SetEvalSettings(self._Input())
    p.file_pattern = 'text:' + os.path.join(
      self.CORPUS_DIR,
      'heldout-monolingual.tokenized.shuffled',
      'news.en.heldout-00000-of-00050',
    )
    return p

  def Test(self):
    if self.DEMO_CORPUS:
      return lm_input.LmTextInput.EvalParams(self._Input(), 'Test')
    p = lm_input.LmTextInput.SetEvalSettings(self._Input())
    p.file_pattern = 'text:' + os.path.join(
      self.CORPUS_DIR,
      'heldout-monolingual.tokenized.shuffled',
      'news.en.heldout-00001-of-00050',
    )
    return p

  def Task(self):
    p = gpipe_lm.GPipeTransformerLmTask.Params().Set(
      name='1bwds_wpm_level_lm', random_seed=self.RANDOM_SEED
    )
    p.lm = gpipe_lm.GPipeTransformerLm.CommonParams(
      vocab_size=self.VOCAB_SIZE,
      model_dim=self.EMBEDDING_DIM,
      hidden_dim=self.HIDDEN_DIM,
      num_heads=self.NUM_HEADS,
      num_layers=self.NUM_LAYERS,
      splits=self.SPLITS,
      num_micro_batches=self.NUM_MICRO_BATCHES,
      num_shards=self.NUM_SHARDS,
      residual_dropout_prob=self.RESIDUAL_DROPOUT,
      atten_dropout_prob=self.ATTEN_DROPOUT,
    )
    tp = p.train
    tp.learning_rate = self.LEARNING_RATE
    tp.optimizer = optimizer.Adam.Params()
    tp.lr_schedule = schedule.TransformerSchedule.Params().Set(
      warmup_steps=self.WARMUP_STEPS, model_dim=self.EMBEDDING_DIM
    )
    tp.clip_gradient_norm_to_value = 0.0
    tp.grad_norm_to_clip_to_zero = 0.0
    tp.max_steps = self.MAX_STEPS
    if self.SAVE_INTERVAL_STEPS is not None:
      tp.save_interval_steps = self.SAVE_INTERVAL_STEPS
    if self.SUMMARY_INTERVAL_STEPS is not None:
      tp.summary_interval_steps = self.SUMMARY_INTERVAL_STEPS
    if self.SAVE_MAX_TO_KEEP is not None:
      tp.save_max_to_keep = self.SAVE_MAX_TO_KEEP
    if self.DEMO_CORPUS:  # Its dev and test splits are evaluated whole.
      p.eval.samples_per_summary = 0
    return p


@model_registry.RegisterSingleTaskModel
class OneBWdsGPipeTransformerWPM(OneBWdsGPipeTransformerBase):
  """Lingvo's GPipe Transformer LM on One Billion Words (1.7B parameters)."""


@model_registry.RegisterSingleTaskModel
class OneBWdsGPipeTransformerTiny(OneBWdsGPipeTransformerBase):
  """d = 64, 4 layers in 2 cells x 2 micro-batches, on the English side of
  the num2words demo corpus with its 1000-piece vocabulary."""

  VOCAB_SIZE = 1000
  EMBEDDING_DIM = 64
  HIDDEN_DIM = 256
  NUM_HEADS = 2
  NUM_LAYERS = 4
  SPLITS = [2, 4]
  NUM_MICRO_BATCHES = 2
  NUM_SHARDS = 1
  BATCH_SIZE = 32
  MAX_TOKENS = 24
  RESIDUAL_DROPOUT = 0.0
  ATTEN_DROPOUT = 0.0
  LEARNING_RATE = 0.2  # Peak 2.5e-3 after the warm-up.
  WARMUP_STEPS = 100
  MAX_STEPS = 300
  DEMO_CORPUS = True

  SAVE_INTERVAL_STEPS = 100
  SUMMARY_INTERVAL_STEPS = 50
  SAVE_MAX_TO_KEEP = 3


@model_registry.RegisterSingleTaskModel
class OneBWdsGPipeTransformerHalfB(OneBWdsGPipeTransformerBase):
  """Lingvo's width (d = 2048, hidden 8192, 16 heads) at 12 layers, about
  608M parameters, in 8 cells (pipeline-8) on the English side of the
  num2words demo corpus: a model of real size that one host with 24 GB can
  train when each cell runs in its own worker process (`docs/scale.md`).

  Few tokens per step (8 rows of 16) keep a step well under a minute on
  two cores; weights, gradient sums and Adam's two slots take about 16
  bytes per parameter, about 1.2 GB on each of the 8 workers.
  """

  VOCAB_SIZE = 1000
  EMBEDDING_DIM = 2048
  HIDDEN_DIM = 8192
  NUM_HEADS = 16
  NUM_LAYERS = 12
  SPLITS = [2, 3, 5, 6, 8, 9, 11, 12]
  NUM_MICRO_BATCHES = 4
  NUM_SHARDS = 1
  BATCH_SIZE = 8
  MAX_TOKENS = 16
  RESIDUAL_DROPOUT = 0.0
  ATTEN_DROPOUT = 0.0
  LEARNING_RATE = 0.5  # Peak 3.5e-3 after the warm-up.
  WARMUP_STEPS = 10
  MAX_STEPS = 20
  DEMO_CORPUS = True

  SAVE_INTERVAL_STEPS = 10
  SUMMARY_INTERVAL_STEPS = 1
  SAVE_MAX_TO_KEEP = 2


@model_registry.RegisterSingleTaskModel
class OneBWdsGPipeTransformerHalfBMini(OneBWdsGPipeTransformerHalfB):
  """`OneBWdsGPipeTransformerHalfB` at about 1/100 of its parameters (d =
  192, hidden 768, 4 heads; 5.7M parameters): the same 12 layers in the same
  8 cells and 4 micro-batches, the same input and schedule. Runs the scale
  path (8 worker processes, checkpoints, a killed trainer resumed) in about
  a minute (`docs/scale.md`)."""

  EMBEDDING_DIM = 192
  HIDDEN_DIM = 768
  NUM_HEADS = 4
  SAVE_INTERVAL_STEPS = 5
