"""Tiny classifiers of ImageNet-format TFRecords (any `input.file_pattern`).

The smallest model that reads the ImageNet input through the trainer: point
it at a few TFRecord files of `tf.train.Example`s (image/encoded,
image/class/label 1..10) to check a data set or the input's fault handling:

  python -m lingvo_gpipe.trainer --model=image.imagenet.MlpImageNetTiny \
      --logdir=/tmp/imagenet_tiny --num_cpu_devices=2 \
      --model_params_override='input.file_pattern : /data/tiny/train-*'
"""

from lingvo_gpipe import model_registry
from lingvo_gpipe.input import imagenet
from params.image import digits

__all__ = ['MlpImageNetTiny']


@model_registry.RegisterSingleTaskModel
class MlpImageNetTiny(digits.DigitsMlpBase):
  """MlpDigitsTiny's pipelined MLP on 8x8 RGB crops of ImageNet-format
  TFRecords, 10 classes."""

  IMAGE_SIZE = 8
  NUM_CLASSES = 10
  BATCH_SIZE = 8
  NUM_MICRO_BATCHES = 2
  MAX_STEPS = 100
  IMAGENET_DIR = '/data/imagenet'

  def Train(self):
    return imagenet.ImageNetInput.Params().Set(
      file_pattern=f'{self.IMAGENET_DIR}/train-*',
      eval_file_pattern=f'{self.IMAGENET_DIR}/validation-*',
      batch_size=self.BATCH_SIZE,
      image_size=self.IMAGE_SIZE,
      num_classes=self.NUM_CLASSES,
      shuffle_buffer_size=64,
    )

  def Dev(self):
    return imagenet.ImageNetInput.EvalParams(self.Train(), 'Dev')

  def Test(self):
    return imagenet.ImageNetInput.EvalParams(self.Train(), 'Test')

  def _Layers(self):
    layers = super()._Layers()
    layers[1].input_dim = self.IMAGE_SIZE * self.IMAGE_SIZE * 3
    return layers

  def Task(self):
    p = super().Task()
    p.name = 'imagenet'
    p.num_classes = self.NUM_CLASSES
    p.network.input_shapes = [[None, self.IMAGE_SIZE, self.IMAGE_SIZE, 3]]
    p.train.save_interval_steps = 10
    return p
