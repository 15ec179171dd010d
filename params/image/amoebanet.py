"""AmoebaNet image classifiers of the GPipe paper, and a tiny one for CPUs.

Table 1 (AmoebaNet-D (L, D), 224x224, 1000 classes; L = normal cells in
all, D = filters; K = pipeline cells as in the paper):

  AmoebaNetD18x208   82M params   K=1      AmoebaNetD36x544   1.05B   K=4
  AmoebaNetD18x416   318M         K=1      AmoebaNetD72x512   1.8B    K=8
  AmoebaNetD18x544   542M         K=2

AmoebaNet-B (18, 512): 557M parameters at 480x480 in 4 cells, 84.4% top-1
on ImageNet (AmoebaNetB18x512ImageNet480), fine-tuned to CIFAR-10 (99.0%)
and CIFAR-100 (91.3%) (AmoebaNetB18x512Cifar10/100). Their inputs point at
file patterns under IMAGENET_DIR / CIFAR10_DIR / CIFAR100_DIR; override
with e.g. --model_params_override='input.file_pattern : /data/train-*'.
Count their parameters without memory:

  python tools/inspect_model.py --model=image.amoebanet.AmoebaNetD72x512

AmoebaNetTiny trains on the bundled digits on two CPU devices:

  python -m lingvo_gpipe.trainer --model=image.amoebanet.AmoebaNetTiny \
      --logdir=/tmp/amoeba --num_cpu_devices=2 --mode=sync \
      --job=trainer,evaler_dev

Fine-tuning (the paper's transfer learning): train the ImageNet model, then
start the CIFAR one from its checkpoint, restoring the body (the network)
and not the classifier, whose number of classes differs:

  python -m lingvo_gpipe.trainer \
      --model=image.amoebanet.AmoebaNetB18x512Cifar10 --logdir=/tmp/c10 \
      --restore_from=/tmp/amoeba_b_imagenet/train \
      --restore_map='amoebanet/network/(.*)=>amoebanet/network/\\1'

AmoebaNetTinyCifar100 does the same at tiny scale from AmoebaNetTiny (the
digits standing in for ImageNet; CIFAR-100 in grayscale at 16x16).
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model_params
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core import schedule
from lingvo_gpipe.input import cifar
from lingvo_gpipe.input import digits
from lingvo_gpipe.input import imagenet
from lingvo_gpipe.models import amoebanet

__all__ = [
  'AmoebaNetBase',
  'AmoebaNetD18x208',
  'AmoebaNetD18x416',
  'AmoebaNetD18x544',
  'AmoebaNetD36x544',
  'AmoebaNetD72x512',
  'AmoebaNetB18x512ImageNet480',
  'AmoebaNetCifarFineTuneBase',
  'AmoebaNetB18x512Cifar10',
  'AmoebaNetB18x512Cifar100',
  'AmoebaNetTiny',
  'AmoebaNetTinyCifar100',
]


class AmoebaNetBase(base_model_params.SingleTaskModelParams):
  """Unregistered base: ImageNet, AmoebaNet-D, TF AmoebaNet's recipe.

  RMSProp (decay 0.9, momentum 0.9, epsilon 1.0), 3 epochs of linear
  warm-up then x0.97 every 2.4 epochs, label smoothing 0.1, L2 4e-5,
  drop-path 0.7, dropout 0.5, the auxiliary head (weight 0.4), gradient
  clipping at 10. Subclasses change the UPPER_CASE constants.
  """

  TASK_NAME = 'amoebanet'
  GENOTYPE = 'amoeba_net_d'
  NUM_CELLS = 18
  NUM_FILTERS = 208
  IMAGE_SIZE = 224
  IMAGE_CHANNELS = 3
  NUM_CLASSES = 1000
  STEM_TYPE = 'imagenet'
  STEM_FILTERS = 32
  USE_AUX_HEAD = True
  DROP_PATH_KEEP_PROB = 0.7
  DENSE_DROPOUT_KEEP_PROB = 0.5
  NUM_STAGES = 1
  NUM_MICRO_BATCHES = None  # None: 4 per cell (the paper's M >= 4K).
  DEVICES = None  # None: the first NUM_STAGES accelerators or CPU devices.
  RECOMPUTE = 'always'
  BATCH_SIZE = 128
  LABEL_SMOOTHING = 0.1
  L2_REGULARIZER_WEIGHT = 4e-5
  LEARNING_RATE = 2.56 * 128 / 1024  # TF's 2.56 at batch 1024, scaled.
  NUM_TRAIN_IMAGES = 1281167
  WARMUP_EPOCHS = 3.0
  DECAY_EPOCHS = 2.4
  DECAY_RATE = 0.97
  NUM_EPOCHS = 100
  CLIP_GRADIENT_NORM = 10.0
  BN_DECAY = 0.9997
  RANDOM_SEED = 1234
  IMAGENET_DIR = '/data/imagenet'

  def _StepsPerEpoch(self):
    return max(1, self.NUM_TRAIN_IMAGES // self.BATCH_SIZE)

  def Train(self):
    return imagenet.ImageNetInput.Params().Set(
      file_pattern=f'{self.IMAGENET_DIR}/train-*',
      eval_file_pattern=f'{self.IMAGENET_DIR}/validation-*',
      batch_size=self.BATCH_SIZE,
      image_size=self.IMAGE_SIZE,
      num_classes=self.NUM_CLASSES,
    )

  def Dev(self):
    return imagenet.ImageNetInput.EvalParams(self.Train(), 'Dev')

  def Test(self):
    return imagenet.ImageNetInput.EvalParams(self.Train(), 'Test')

  def _Net(self):
    """The AmoebaNet builder."""
    return (
      amoebanet.AmoebaNet.Params()
      .Set(
        genotype=self.GENOTYPE,
        num_cells=self.NUM_CELLS,
        num_filters=self.NUM_FILTERS,
        image_size=self.IMAGE_SIZE,
        image_channels=self.IMAGE_CHANNELS,
        stem_type=self.STEM_TYPE,
        stem_filters=self.STEM_FILTERS,
        drop_path_keep_prob=self.DROP_PATH_KEEP_PROB,
        dense_dropout_keep_prob=self.DENSE_DROPOUT_KEEP_PROB,
        use_aux_head=self.USE_AUX_HEAD,
        num_classes=self.NUM_CLASSES,
        bn_decay=self.BN_DECAY,
      )
      .Instantiate()
    )

  def _Learner(self, tp):
    """Sets the optimizer and schedule on task.train `tp`."""
    tp.learning_rate = self.LEARNING_RATE
    tp.optimizer = optimizer.RMSProp.Params().Set(
      decay=0.9, momentum=0.9, epsilon=1.0
    )
    steps = self._StepsPerEpoch()
    tp.lr_schedule = schedule.WarmupExponentialDecay.Params().Set(
      warmup_steps=int(self.WARMUP_EPOCHS * steps),
      decay_steps=max(1, int(self.DECAY_EPOCHS * steps)),
      decay_rate=self.DECAY_RATE,
      min_value=1e-4,
    )
    tp.max_steps = int(self.NUM_EPOCHS * steps)

  def Task(self):
    net = self._Net()
    num_stages = self.NUM_STAGES
    m = self.NUM_MICRO_BATCHES or 4 * num_stages
    p = amoebanet.AmoebaNetTask.Params().Set(
      name=self.TASK_NAME,
      num_classes=self.NUM_CLASSES,
      label_smoothing=self.LABEL_SMOOTHING,
      random_seed=self.RANDOM_SEED,
    )
    p.network = net.PipelineParams(
      num_stages=num_stages,
      num_micro_batches=m,
      devices=self.DEVICES,
      recompute=self.RECOMPUTE,
    )
    p.softmax.input_dim = net.FeatureDim()
    tp = p.train
    self._Learner(tp)
    tp.l2_regularizer_weight = self.L2_REGULARIZER_WEIGHT
    tp.clip_gradient_norm_to_value = self.CLIP_GRADIENT_NORM
    tp.save_interval_steps = 1000
    tp.save_max_to_keep = 5
    tp.summary_interval_steps = 100
    return p


@model_registry.RegisterSingleTaskModel
class AmoebaNetD18x208(AmoebaNetBase):
  """AmoebaNet-D (18, 208): 82M parameters, one cell (Table 1, Naive-1)."""


@model_registry.RegisterSingleTaskModel
class AmoebaNetD18x416(AmoebaNetBase):
  """AmoebaNet-D (18, 416): 318M parameters, one cell (Pipeline-1)."""

  NUM_FILTERS = 416


@model_registry.RegisterSingleTaskModel
class AmoebaNetD18x544(AmoebaNetBase):
  """AmoebaNet-D (18, 544): 542M parameters, 2 cells (Pipeline-2)."""

  NUM_FILTERS = 544
  NUM_STAGES = 2


@model_registry.RegisterSingleTaskModel
class AmoebaNetD36x544(AmoebaNetBase):
  """AmoebaNet-D (36, 544): 1.05B parameters, 4 cells (Pipeline-4)."""

  NUM_CELLS = 36
  NUM_FILTERS = 544
  NUM_STAGES = 4


@model_registry.RegisterSingleTaskModel
class AmoebaNetD72x512(AmoebaNetBase):
  """AmoebaNet-D (72, 512): 1.8B parameters, 8 cells (Pipeline-8)."""

  NUM_CELLS = 72
  NUM_FILTERS = 512
  NUM_STAGES = 8


@model_registry.RegisterSingleTaskModel
class AmoebaNetB18x512ImageNet480(AmoebaNetBase):
  """AmoebaNet-B (18, 512) at 480x480 in 4 cells: 557M parameters.

  The paper's ImageNet model (84.4% top-1, 97.0% top-5).
  """

  GENOTYPE = 'amoeba_net_b'
  NUM_FILTERS = 512
  IMAGE_SIZE = 480
  NUM_STAGES = 4
  BATCH_SIZE = 64
  LEARNING_RATE = 2.56 * 64 / 1024


class AmoebaNetCifarFineTuneBase(AmoebaNetB18x512ImageNet480):
  """Unregistered base: fine-tunes AmoebaNet-B (18, 512) on CIFAR.

  CIFAR images are upsampled to the ImageNet model's 480x480; all layers
  are trained, with SGD + momentum 0.9 at a constant rate, starting from the
  ImageNet checkpoint (--restore_from, restoring amoebanet/network/*; the
  softmax starts fresh).
  """

  DATASET = 'cifar10'
  NUM_CLASSES = 10
  CIFAR_DIR = '/data/cifar-10-batches-bin'
  BATCH_SIZE = 64
  LEARNING_RATE = 0.01
  MAX_STEPS = 20000
  GRAYSCALE = False

  def Train(self):
    return cifar.CifarInput.Params().Set(
      dataset=self.DATASET,
      data_dir=self.CIFAR_DIR,
      batch_size=self.BATCH_SIZE,
      image_size=self.IMAGE_SIZE,
      grayscale=self.GRAYSCALE,
    )

  def Dev(self):
    return cifar.CifarInput.EvalParams(self.Train(), 'Dev')

  def Test(self):
    return cifar.CifarInput.EvalParams(self.Train(), 'Test')

  def _Learner(self, tp):
    tp.learning_rate = self.LEARNING_RATE
    tp.optimizer = optimizer.Momentum.Params().Set(alpha=0.9)
    tp.lr_schedule = schedule.ConstantOne.Params()
    tp.max_steps = self.MAX_STEPS


@model_registry.RegisterSingleTaskModel
class AmoebaNetB18x512Cifar10(AmoebaNetCifarFineTuneBase):
  """AmoebaNet-B (18, 512) fine-tuned on CIFAR-10 (paper: 99.0%)."""


@model_registry.RegisterSingleTaskModel
class AmoebaNetB18x512Cifar100(AmoebaNetCifarFineTuneBase):
  """AmoebaNet-B (18, 512) fine-tuned on CIFAR-100 (paper: 91.3%)."""

  DATASET = 'cifar100'
  NUM_CLASSES = 100
  CIFAR_DIR = '/data/cifar-100-binary'


class _TinyMixin:
  """The tiny AmoebaNet-D body shared by the tiny configs."""

  NUM_CELLS = 3
  NUM_FILTERS = 16
  IMAGE_SIZE = 16
  IMAGE_CHANNELS = 1
  STEM_TYPE = 'cifar'
  STEM_FILTERS = 16
  USE_AUX_HEAD = False
  DROP_PATH_KEEP_PROB = 1.0
  DENSE_DROPOUT_KEEP_PROB = 1.0
  NUM_STAGES = 2
  NUM_MICRO_BATCHES = 2
  BATCH_SIZE = 64
  BN_DECAY = 0.99
  L2_REGULARIZER_WEIGHT = 1e-5


@model_registry.RegisterSingleTaskModel
class AmoebaNetTiny(_TinyMixin, AmoebaNetBase):
  """A tiny AmoebaNet-D on the bundled digits (16x16), 2 pipeline cells.

  L=3 (one normal cell per stack), D=16, CIFAR stem, batch norm, 2
  micro-batches of 32; RMSProp with warm-up and exponential decay. 600 steps
  take about 2 minutes on 2 CPU cores and reach 98.3% dev accuracy (100%
  on test).

    python -m lingvo_gpipe.trainer --model=image.amoebanet.AmoebaNetTiny \
        --logdir=/tmp/amoeba --num_cpu_devices=2 --mode=sync \
        --job=trainer,evaler_dev
  """

  NUM_CLASSES = 10
  LEARNING_RATE = 0.05
  MAX_STEPS = 600

  def Train(self):
    return digits.DigitsInput.Params().Set(
      split='train',
      batch_size=self.BATCH_SIZE,
      image_size=self.IMAGE_SIZE,
      random_translate=1,
    )

  def Dev(self):
    return digits.DigitsInput.EvalParams(self.Train(), 'Dev')

  def Test(self):
    return digits.DigitsInput.EvalParams(self.Train(), 'Test')

  def _Learner(self, tp):
    tp.learning_rate = self.LEARNING_RATE
    tp.optimizer = optimizer.RMSProp.Params().Set(
      decay=0.9, momentum=0.9, epsilon=1.0
    )
    tp.lr_schedule = schedule.WarmupExponentialDecay.Params().Set(
      warmup_steps=50, decay_steps=100, decay_rate=0.8, min_value=0.05
    )
    tp.max_steps = self.MAX_STEPS

  def Task(self):
    p = super().Task()
    p.train.save_interval_steps = 200
    p.train.summary_interval_steps = 20
    return p


@model_registry.RegisterSingleTaskModel
class AmoebaNetTinyCifar100(_TinyMixin, AmoebaNetCifarFineTuneBase):
  """AmoebaNetTiny's body fine-tuned on CIFAR-100 (grayscale, 16x16).

  The tiny stand-in of AmoebaNetB18x512Cifar100: start it from an
  AmoebaNetTiny checkpoint, restoring the network and not the softmax (10
  digit classes there, 100 here):

    python -m lingvo_gpipe.trainer \
        --model=image.amoebanet.AmoebaNetTinyCifar100 \
        --logdir=/tmp/amoeba_c100 --num_cpu_devices=2 --mode=sync \
        --restore_from=/tmp/amoeba/train \
        --restore_map='amoebanet/network/(.*)=>amoebanet/network/\\1' \
        --model_params_override='input.data_dir : /data/cifar-100-binary'
  """

  GENOTYPE = 'amoeba_net_d'
  DATASET = 'cifar100'
  NUM_CLASSES = 100
  CIFAR_DIR = '/data/cifar-100-binary'
  GRAYSCALE = True
  LEARNING_RATE = 0.01
  MAX_STEPS = 200
