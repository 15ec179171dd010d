r"""The GPipe paper's multilingual Transformers T(L, H, A), and a tiny demo.

T(L, H, A): L encoder and L decoder layers, feed-forward width H, A attention
heads, model dimension 1024, one shared 64k vocabulary (source and target
embeddings and the softmax are one tied table), 102 languages -> English
with temperature sampling (T = 5). The sizes of the paper, with its numbers
of pipeline cells (docs/transformer.md compares the parameter counts):

  TransformerT6x8192x16    "400M", Transformer Big     2 cells
  TransformerT24x8192x16   "1.3B deep"                 4 cells
  TransformerT12x16384x32  "1.3B wide"                 4 cells
  TransformerT32x16384x32  "3B"                        8 cells
  TransformerT64x16384x32  "6B", 128 layers            16 cells

The deep and wide models use the paper's stability fixes: the feed-forward
initialization scaled down by the number of layers, and logit clipping.
They read corpora <src>-en.<split>.tsv (or .tfrecord) and spm.model from
DATA_DIR (override with --model_params_override="input.data_dir : /data").

`TransformerTiny` trains on CPU in minutes on the num2words demo corpus,
built and cached automatically (no network needed):

  python -m lingvo_gpipe.trainer --model=mt.multilingual.TransformerTiny \
      --logdir=/tmp/mt --num_cpu_devices=2 --mode=sync
  python tools/eval_bleu.py --model=mt.multilingual.TransformerTiny \
      --logdir=/tmp/mt
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model_params
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import schedule
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.input import mt_input
from lingvo_gpipe.models.mt import layers as mt_layers
from lingvo_gpipe.models.mt import model as mt_model
from lingvo_gpipe.pipeline import pipelining_layer

__all__ = [
  'MultilingualTransformerBase',
  'TransformerT6x8192x16',
  'TransformerT24x8192x16',
  'TransformerT12x16384x32',
  'TransformerT32x16384x32',
  'TransformerT64x16384x32',
  'TransformerTiny',
]


class MultilingualTransformerBase(base_model_params.SingleTaskModelParams):
  """Unregistered base of T(L, H, A); subclasses set the constants."""

  NUM_LAYERS = 6  # L: encoder layers = decoder layers.
  HIDDEN_DIM = 8192  # H: feed-forward width.
  NUM_HEADS = 16  # A: attention heads.
  MODEL_DIM = 1024
  VOCAB_SIZE = 64000
  NUM_STAGES = 2  # K: pipeline cells.
  NUM_MICRO_BATCHES = 16  # M.
  DEVICES = None  # None: the first NUM_STAGES accelerators.
  RECOMPUTE = 'always'
  SCHEDULE = 'gpipe'  # Or '1f1b', 'interleaved' (docs/gpipe.md).
  BUCKET_UPPER_BOUND = (32, 64, 128)
  BUCKET_BATCH_LIMIT = (1024, 512, 256)  # ~32k tokens per bucket batch.
  BATCH_SIZE = 256  # Eval batches.
  DATA_DIR = ''
  DEMO_CORPUS = False
  SAMPLING_TEMPERATURE = 5.0
  DROPOUT = 0.1
  LABEL_SMOOTHING = 0.1
  LOGITS_ABS_MAX = None
  FFLAYER_INIT_DEPTH_SCALING = 'none'
  LEARNING_RATE = 1.0
  WARMUP_STEPS = 4000
  MAX_STEPS = 1_000_000
  BEAM_SIZE = 4
  RANDOM_SEED = 1234

  def _Input(self):
    return mt_input.MultilingualMTInput.Params().Set(
      data_dir=self.DATA_DIR,
      split='train',
      vocab_size=self.VOCAB_SIZE,
      batch_size=self.BATCH_SIZE,
      bucket_upper_bound=list(self.BUCKET_UPPER_BOUND),
      bucket_batch_limit=list(self.BUCKET_BATCH_LIMIT),
      sampling_temperature=self.SAMPLING_TEMPERATURE,
      demo_corpus=self.DEMO_CORPUS,
    )

  def Train(self):
    return self._Input()

  def Dev(self):
    return mt_input.MultilingualMTInput.EvalParams(self._Input(), 'Dev')

  def Test(self):
    return mt_input.MultilingualMTInput.EvalParams(self._Input(), 'Test')

  def _InputShapes(self):
    """Shapes of the pipeline input for flops balancing: the largest bucket."""
    b = self.BUCKET_BATCH_LIMIT[-1]
    t = self.BUCKET_UPPER_BOUND[-1]
    return [NestedMap({k: [b, t] for k in mt_layers.INPUT_KEYS})]

  def Task(self):
    layers = mt_layers.TransformerMTLayers(
      num_encoder_layers=self.NUM_LAYERS,
      num_decoder_layers=self.NUM_LAYERS,
      model_dim=self.MODEL_DIM,
      hidden_dim=self.HIDDEN_DIM,
      num_heads=self.NUM_HEADS,
      vocab_size=self.VOCAB_SIZE,
      input_dropout_prob=self.DROPOUT,
      residual_dropout_prob=self.DROPOUT,
      atten_dropout_prob=self.DROPOUT,
      relu_dropout_prob=self.DROPOUT,
      label_smoothing=self.LABEL_SMOOTHING,
      logits_abs_max=self.LOGITS_ABS_MAX,
      fflayer_init_depth_scaling=self.FFLAYER_INIT_DEPTH_SCALING,
    )
    p = mt_model.TransformerMTTask.Params().Set(
      name='mt',
      vocab_size=self.VOCAB_SIZE,
      beam_size=self.BEAM_SIZE,
      random_seed=self.RANDOM_SEED,
    )
    p.network = pipelining_layer.PipeliningLayer.Params().Set(
      name='network',
      layers=layers,
      num_stages=self.NUM_STAGES,
      num_micro_batches=self.NUM_MICRO_BATCHES,
      devices=self.DEVICES,
      recompute=self.RECOMPUTE,
      schedule=self.SCHEDULE,
      input_shapes=self._InputShapes(),
    )
    tp = p.train
    tp.learning_rate = self.LEARNING_RATE
    tp.optimizer = optimizer.Adam.Params().Set(beta1=0.9, beta2=0.98)
    tp.lr_schedule = schedule.TransformerSchedule.Params().Set(
      warmup_steps=self.WARMUP_STEPS, model_dim=self.MODEL_DIM
    )
    tp.clip_gradient_norm_to_value = 1.0
    tp.max_steps = self.MAX_STEPS
    tp.save_interval_steps = 1000
    tp.save_max_to_keep = 5
    tp.summary_interval_steps = 100
    return p


@model_registry.RegisterSingleTaskModel
class TransformerT6x8192x16(MultilingualTransformerBase):
  """T(6, 8192, 16), the paper's "400M" (Transformer Big), 2 cells."""

  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 6, 8192, 16
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 8


@model_registry.RegisterSingleTaskModel
class TransformerT24x8192x16(MultilingualTransformerBase):
  """T(24, 8192, 16), the paper's "1.3B deep", 4 cells."""

  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 24, 8192, 16
  NUM_STAGES = 4
  NUM_MICRO_BATCHES = 16
  LOGITS_ABS_MAX = 20.0
  FFLAYER_INIT_DEPTH_SCALING = 'linear'


@model_registry.RegisterSingleTaskModel
class TransformerT12x16384x32(MultilingualTransformerBase):
  """T(12, 16384, 32), the paper's "1.3B wide", 4 cells."""

  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 12, 16384, 32
  NUM_STAGES = 4
  NUM_MICRO_BATCHES = 16
  LOGITS_ABS_MAX = 20.0
  FFLAYER_INIT_DEPTH_SCALING = 'linear'


@model_registry.RegisterSingleTaskModel
class TransformerT32x16384x32(MultilingualTransformerBase):
  """T(32, 16384, 32), the paper's "3B", 8 cells."""

  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 32, 16384, 32
  NUM_STAGES = 8
  NUM_MICRO_BATCHES = 32
  LOGITS_ABS_MAX = 20.0
  FFLAYER_INIT_DEPTH_SCALING = 'linear'


@model_registry.RegisterSingleTaskModel
class TransformerT64x16384x32(MultilingualTransformerBase):
  """T(64, 16384, 32), the paper's "6B" (128 layers), 16 cells."""

  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 64, 16384, 32
  NUM_STAGES = 16
  NUM_MICRO_BATCHES = 64
  BUCKET_BATCH_LIMIT = (2048, 1024, 512)
  LOGITS_ABS_MAX = 20.0
  FFLAYER_INIT_DEPTH_SCALING = 'linear'


@model_registry.RegisterSingleTaskModel
class TransformerTiny(MultilingualTransformerBase):
  """T(2, 512, 4) with d = 128 and a 1000-piece vocabulary, 2 cells x 2
  micro-batches, on the num2words demo corpus (24 languages -> English).

    python -m lingvo_gpipe.trainer --model=mt.multilingual.TransformerTiny \
        --logdir=/tmp/mt --num_cpu_devices=2 --mode=sync
    python tools/eval_bleu.py --model=mt.multilingual.TransformerTiny \
        --logdir=/tmp/mt
  """

  NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 2, 512, 4
  MODEL_DIM = 128
  VOCAB_SIZE = 1000
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 2
  BUCKET_UPPER_BOUND = (16,)
  BUCKET_BATCH_LIMIT = (64,)
  BATCH_SIZE = 64
  DEMO_CORPUS = True
  DROPOUT = 0.0
  LEARNING_RATE = 0.4  # Peak 2e-3 after the warmup.
  WARMUP_STEPS = 300
  MAX_STEPS = 1200
  BEAM_SIZE = 4

  def Task(self):
    p = super().Task()
    p.train.save_interval_steps = 400
    p.train.summary_interval_steps = 50
    p.train.save_max_to_keep = 3
    return p
