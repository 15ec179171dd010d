"""`PipelinedModel`: a Keras model that runs a Keras model as a pipeline.

  model = keras.Sequential([keras.Input((16,)), ...])
  pipelined = keras_model.PipelinedModel(
      model, num_stages=2, num_micro_batches=4)
  pipelined.compile(optimizer='adam', loss='mse')
  pipelined.fit(x, y, batch_size=32)
  pipelined.CopyWeightsTo(model)  # the trained weights back in `model`

The layers of `model` (a keras.Sequential or a functional chain of layers)
become `KerasLayer`s of a `PipeliningLayer` of `num_stages` cells, which
starts from the model's weights. The weights Keras sees (`weights`,
`trainable_variables`, what the optimizer updates and `save_weights` writes)
are the pipeline's own variables, one Keras layer of them per layer of
`model`, in the model's order: `get_weights()` and `set_weights()` take the
same lists as the model's, and the gradients are the model's for every K
and M. Each cell's weights live on its device.

`call(x, training=...)` runs the pipeline: in training, in micro-batches
(the batch must be a multiple of num_micro_batches), with a new step seed
per call for dropout (from the model's `keras.random.SeedGenerator`) and the
batch-norm moving averages updated once per batch, from the statistics of
the micro-batches; otherwise in evaluation mode (dropout off, batch norm on
its moving averages), any batch size.
"""

import math
import re

import keras
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import keras_layer
from lingvo_gpipe.pipeline import pipelining_layer

__all__ = ['PipelinedModel']

# Marks the run-time check of a training batch's size.
_BATCH_ERROR = 'PipelinedModel batch check:'

# PipeliningLayer params that PipelinedModel sets itself.
_OWN_PARAMS = ('name', 'layers', 'cell_tpl', 'num_stages', 'num_micro_batches')


def _KerasName(v):
  """'kernel' of variable 'pipe/dense_0/kernel:0'."""
  return v.name.split(':')[0].split('/')[-1]


class _LayerWeights(keras.layers.Layer):
  """The Keras face of one pipelined layer's variables (Keras order)."""

  def __init__(self, variables, **kwargs):
    super().__init__(**kwargs)
    with keras.name_scope(self.name):  # Paths '<layer>/<weight>'.
      self.pipelined_variables = [
        keras.Variable(v, trainable=v.trainable, name=_KerasName(v))
        for v in variables
      ]
    self.built = True

  def call(self, inputs):
    raise NotImplementedError('Holds weights only; PipelinedModel runs them.')


@keras.saving.register_keras_serializable(package='lingvo_gpipe')
class PipelinedModel(keras.Model):
  """A Keras model running `model` as a GPipe pipeline. See module doc."""

  def __init__(
    self,
    model,
    *,
    num_stages=1,
    num_micro_batches=1,
    devices=None,
    input_shape=None,
    seed=None,
    name=None,
    **pipeline_params,
  ):
    """Builds the pipeline of `model`'s layers, with `model`'s weights.

    Args:
      model: a keras.Sequential, or a functional keras.Model whose layers
        form a chain (each takes the previous one's output alone). Its
        weights are copied; the model itself is not kept.
      num_stages: K, the number of cells (at most the number of layers).
      num_micro_batches: M; a training batch must be a multiple of it.
      devices: the device of each cell; None: the accelerators TensorFlow
        lists, or its CPU devices (`cluster.SplitCpu(K)` makes K of them).
      input_shape: the model's input shape, batch first, e.g. [None, 16];
        None: the shape of the model's input (keras.Input).
      seed: seeds the dropout masks of training calls; None: random.
      name: the Keras model's name; None: 'pipelined_<model name>'.
      **pipeline_params: other PipeliningLayer params, e.g. splits=[2],
        recompute='never', balance_by='uniform', jit_compile=True.
    """
    if not isinstance(model, keras.Model):
      raise TypeError(
        f'PipelinedModel expects a keras.Sequential or functional '
        f'keras.Model, got {type(model).__name__} {model!r}; wrap layers in '
        'keras.Sequential([keras.Input(shape), ...]).'
      )
    super().__init__(name=name or f'pipelined_{model.name}')
    # What get_config returns (the model's architecture, not its weights).
    config = dict(
      model=keras.saving.serialize_keras_object(model),
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      devices=devices,
      input_shape=input_shape,
      seed=seed,
      name=self.name,
      **pipeline_params,
    )
    object.__setattr__(self, '_config', config)
    layers = keras_layer.KerasChain(model)
    if input_shape is None:
      input_shape = keras_layer.KerasInputShape(model)
    if input_shape is None:
      raise ValueError(
        f'PipelinedModel: model {model.name!r} is not built, so its input '
        'shape is unknown; pass input_shape=[None, ...] (batch first) or '
        'start the model with keras.Input(shape).'
      )
    p = pipelining_layer.PipeliningLayer.Params()
    for key, value in pipeline_params.items():
      if key in _OWN_PARAMS or key not in p:
        raise ValueError(
          f'PipelinedModel: {key}={value!r} is not a pipeline param it '
          'accepts; pass the PipeliningLayer params other than '
          f'{", ".join(_OWN_PARAMS)} (see PipeliningLayer.Params()).'
        )
    if pipeline_params.get('schedule') == '1f1b':
      raise ValueError(
        "PipelinedModel: schedule='1f1b' needs the loss on the last cell, "
        "which Keras computes after the model; use schedule='gpipe' or "
        "'interleaved'."
      )
    if num_stages != 'auto' and (
      not isinstance(num_stages, int) or num_stages < 1
    ):
      raise ValueError(
        f'PipelinedModel: num_stages={num_stages!r}; pass a positive int, '
        f'at most the {len(layers)} layers of the model.'
      )
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
      raise ValueError(
        f'PipelinedModel: num_micro_batches={num_micro_batches!r}; pass a '
        'positive int that divides the batch size.'
      )
    p.Set(
      name='pipe',
      layers=keras_layer.KerasLayersParams(layers, input_shape),
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      devices=devices,
      **pipeline_params,
    )
    with tf.init_scope():
      pipe = p.Instantiate()
    # Untracked by Keras: its variables reach Keras through the layers below.
    object.__setattr__(self, '_pipe', pipe)
    self.pipelined_layers = []
    for layer, k in zip(pipe.body, layers):
      layer.LoadKerasWeights(k)
      self.pipelined_layers.append(
        _LayerWeights(layer.KerasOrderedVariables(), name=k.name)
      )
    self._seed_generator = keras.random.SeedGenerator(seed)
    # XLA would compile the whole step as one computation on one device;
    # `jit_compile=True` in pipeline_params compiles each cell instead.
    self.supports_jit = False
    self.built = True

  @property
  def pipeline(self):
    """The PipeliningLayer (its `PlacementText()` shows the cells)."""
    return self._pipe

  @property
  def num_micro_batches(self):
    return self._pipe.num_micro_batches

  def call(self, inputs, training=None):
    """The outputs of the pipelined model on `inputs`. See module doc."""
    if not training:
      with py_utils.EvalMode(), py_utils.NoUpdateCollection():
        return self._pipe(inputs)
    state = tf.cast(self._seed_generator.next(), tf.int64)
    step = state[0] * 1000003 + state[1]
    m = self.num_micro_batches
    first = tf.nest.flatten(inputs)[0]
    if m > 1 and tf.TensorShape(first.shape)[0] is None:
      # Known when run only (a dataset's last batch): a clear error, not
      # tf.split's; `fit` makes it one line.
      batch = tf.shape(first)[0]
      check = tf.debugging.Assert(
        tf.equal(batch % m, 0),
        [f'{_BATCH_ERROR} {self.name!r}: a training batch of', batch, m],
      )
      with tf.control_dependencies([check]):
        inputs = tf.nest.map_structure(tf.identity, inputs)
    with py_utils.EvalMode(False), py_utils.StepSeed(step):
      with py_utils.UpdateCollector() as updates:
        outputs = self._pipe(inputs)
      updates.Apply()
    return outputs

  def compute_output_spec(self, inputs, training=None):
    del training  # The shapes are the same.
    for layer in self._pipe.body:
      inputs = layer.keras_layer.compute_output_spec(inputs)
    return inputs

  def get_config(self):
    """The model's architecture and this pipeline's settings, for
    `save('....keras')` and `keras.models.load_model`."""
    return dict(self._config)

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    model = keras.saving.deserialize_keras_object(config.pop('model'))
    return cls(model, **config)

  def _Chain(self, model):
    layers = keras_layer.KerasChain(model)
    if len(layers) != len(self._pipe.body):
      raise ValueError(
        f'Model {model.name!r} has {len(layers)} layers but '
        f'{self.name!r} pipelines {len(self._pipe.body)}; pass the model '
        'it was built from, or one of the same architecture.'
      )
    return layers

  def CopyWeightsFrom(self, model):
    """Sets the weights to those of Keras `model` (of the architecture this
    was built from)."""
    for layer, k in zip(self._pipe.body, self._Chain(model)):
      layer.LoadKerasWeights(k)

  def CopyWeightsTo(self, model):
    """Sets the weights of Keras `model` (of the architecture this was built
    from) to these, e.g. the trained ones."""
    for layer, k in zip(self._pipe.body, self._Chain(model)):
      layer.CopyWeightsTo(k)

  def fit(self, x=None, y=None, batch_size=None, **kwargs):
    """keras.Model.fit; array inputs are checked to split into
    micro-batches (a dataset's batches are checked when traced)."""
    _CheckFitBatches(
      x, batch_size, kwargs.get('validation_split', 0.0), self.num_micro_batches
    )
    try:
      return super().fit(x, y, batch_size=batch_size, **kwargs)
    except tf.errors.InvalidArgumentError as e:
      found = re.search(
        re.escape(_BATCH_ERROR) + r'(.*?)\] \[(\d+)\] \[(\d+)\]', str(e)
      )
      if not found:
        raise
      what, n, m = found.groups()
      what = what.replace("\\'", "'")  # As the error message escapes it.
      raise ValueError(
        f'PipelinedModel{what} {n} examples is not a multiple of '
        f'num_micro_batches={m}; make every batch one, e.g. '
        f'dataset.batch(size, drop_remainder=True) with size a multiple of '
        f'{m}.'
      ) from None


def _CheckFitBatches(x, batch_size, validation_split, m):
  """Raises unless every training batch of array `x` is a multiple of m."""
  first = tf.nest.flatten(x)[0] if x is not None else None
  if m == 1 or not hasattr(first, 'shape') or not hasattr(first, '__len__'):
    return
  if isinstance(first, (tf.data.Dataset, keras.utils.PyDataset)):
    return
  n = int(first.shape[0])
  if validation_split:
    n = int(math.ceil(n * (1.0 - validation_split)))
  b = batch_size or 32
  if b % m:
    raise ValueError(
      f'PipelinedModel.fit: batch_size={b} is not a multiple of '
      f'num_micro_batches={m}; pass a batch_size that is.'
    )
  if n % b % m:
    raise ValueError(
      f'PipelinedModel.fit: the {n} training examples end in a batch of '
      f'{n % b}, not a multiple of num_micro_batches={m}; use a number of '
      f'examples that is a multiple of batch_size={b} (or of {m}).'
    )
