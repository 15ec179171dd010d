"""Pipelined classifiers of scikit-learn's handwritten digits (offline, CPU).

The data ship with scikit-learn (1,797 8x8 images; 1,437 / 180 / 180 for
train / dev / test), so these run anywhere in seconds and exercise the whole
GPipe stack: a PipeliningLayer split over CPU devices, micro-batches,
re-materialization, the learner and the trainer.

Train on two virtual CPU devices:

  python -m lingvo_gpipe.trainer --model=image.digits.MlpDigitsTiny \
      --logdir=/tmp/digits --num_cpu_devices=2 --mode=sync --job=trainer
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model_params
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import schedule
from lingvo_gpipe.input import digits
from lingvo_gpipe.layers import linears
from lingvo_gpipe.layers import reshape
from lingvo_gpipe.models import classifier
from lingvo_gpipe.pipeline import pipelining_layer

__all__ = ['DigitsMlpBase', 'MlpDigitsTiny', 'MlpDigitsTinyBN']


class DigitsMlpBase(base_model_params.SingleTaskModelParams):
  """Unregistered base: digits input, a pipelined MLP, Adam.

  Subclasses change the UPPER_CASE constants.
  """

  BATCH_SIZE = 64
  IMAGE_SIZE = 8
  RANDOM_TRANSLATE = 0
  HIDDEN_DIMS = (64, 64)
  BATCH_NORM = False
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 4
  DEVICES = None  # None: the first NUM_STAGES accelerators or CPU devices.
  RECOMPUTE = 'always'
  LEARNING_RATE = 1e-3
  WARMUP_STEPS = 0
  LABEL_SMOOTHING = 0.0
  L2_REGULARIZER_WEIGHT = None
  MAX_STEPS = 300
  RANDOM_SEED = 1234

  def Train(self):
    return digits.DigitsInput.Params().Set(
      split='train',
      batch_size=self.BATCH_SIZE,
      image_size=self.IMAGE_SIZE,
      random_translate=self.RANDOM_TRANSLATE,
    )

  def Dev(self):
    return digits.DigitsInput.EvalParams(self.Train(), 'Dev')

  def Test(self):
    return digits.DigitsInput.EvalParams(self.Train(), 'Test')

  def _Layers(self):
    """The flat list of layers the pipeline splits into NUM_STAGES cells."""
    layers = [reshape.FlattenLayer.Params().Set(name='flatten')]
    in_dim = self.IMAGE_SIZE * self.IMAGE_SIZE
    for i, dim in enumerate(self.HIDDEN_DIMS):
      layers.append(
        linears.ProjectionLayer.Params().Set(
          name=f'fc{i}',
          input_dim=in_dim,
          output_dim=dim,
          activation='RELU',
          batch_norm=self.BATCH_NORM,
          has_bias=not self.BATCH_NORM,
        )
      )
      in_dim = dim
    return layers

  def Task(self):
    p = classifier.ClassifierTask.Params().Set(
      name='digits',
      num_classes=digits.NUM_CLASSES,
      label_smoothing=self.LABEL_SMOOTHING,
      random_seed=self.RANDOM_SEED,
    )
    p.network = pipelining_layer.PipeliningLayer.Params().Set(
      name='network',
      layers=self._Layers(),
      num_stages=self.NUM_STAGES,
      num_micro_batches=self.NUM_MICRO_BATCHES,
      devices=self.DEVICES,
      recompute=self.RECOMPUTE,
      input_shapes=[[None, self.IMAGE_SIZE, self.IMAGE_SIZE, 1]],
    )
    p.softmax.input_dim = self.HIDDEN_DIMS[-1]

    tp = p.train
    tp.learning_rate = self.LEARNING_RATE
    tp.optimizer = optimizer.Adam.Params()
    tp.lr_schedule = schedule.LinearWarmup.Params().Set(
      warmup_steps=self.WARMUP_STEPS
    )
    tp.l2_regularizer_weight = self.L2_REGULARIZER_WEIGHT
    tp.max_steps = self.MAX_STEPS
    tp.save_interval_steps = 100
    tp.save_max_to_keep = 3
    tp.summary_interval_steps = 20
    return p


@model_registry.RegisterSingleTaskModel
class MlpDigitsTiny(DigitsMlpBase):
  """Flatten + 2 FC layers in 2 pipeline cells, 4 micro-batches, Adam 1e-3.

  Reaches ~95% dev accuracy in 300 steps (a few seconds on a CPU):

    python -m lingvo_gpipe.trainer --model=image.digits.MlpDigitsTiny \
        --logdir=/tmp/digits --num_cpu_devices=2 --mode=sync --job=trainer
  """


@model_registry.RegisterSingleTaskModel
class MlpDigitsTinyBN(DigitsMlpBase):
  """MlpDigitsTiny with batch norm: moving averages updated once per step
  from the statistics of all micro-batches.

    python -m lingvo_gpipe.trainer --model=image.digits.MlpDigitsTinyBN \
        --logdir=/tmp/digits_bn --num_cpu_devices=2 --mode=sync --job=trainer
  """

  BATCH_NORM = True
  HIDDEN_DIMS = (128, 64)
  L2_REGULARIZER_WEIGHT = 1e-4
