"""Keras 3 layers in a pipeline: `KerasLayer` and `KerasLayersParams`.

(`gpipe_layers/keras_model.py`'s `PipelinedModel` wraps a pipeline of them as a
keras.Model, for compile / fit / evaluate / predict.)

`KerasLayer` wraps one Keras layer, given by its config
(`keras.layers.serialize(layer)`), as a library layer: its variables are the
Keras layer's weights, created with `CreateVariable` (so they live on the
layer's pipeline cell, are named by the layer's path and are checkpointed
like any other), and its `FProp` runs the Keras layer without side effects:

  outputs, new_state = layer.stateless_call(trainable, non_trainable, x)

with `trainable` and `non_trainable` taken from theta. So the pipeline's
gradients, recomputation and micro-batches apply unchanged:

  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', num_stages=2, num_micro_batches=4,
      layers=keras_layer.KerasLayersParams(
          keras.Sequential([...]), input_shape=[None, 16])).Instantiate()
  for layer, k in zip(pipe.body, keras_layer.KerasChain(model)):
    layer.LoadKerasWeights(k)  # CopyWeightsTo(k): the way back

`KerasChain` lists the layers of a keras.Sequential or of a functional model
that is a chain of layers; other models are refused with the reason. A
layer's (and so the pipeline's) `trainable_variables` follow Keras's order:
layer by layer, each layer's as Keras lists them (kernel before bias).
`pipe(x, training=False)` runs in evaluation mode (`py_utils.EvalMode()`).

Keras state other than weights:
  * Random layers (Dropout, GaussianNoise, ...): the seed of each Keras
    `SeedGenerator` is the library's stateless seed (the layer's path and the
    step seed of the micro-batch), so a recomputed forward pass draws the same
    mask and the micro-batches draw different ones.
  * Non-trainable weights a call updates (BatchNormalization's moving mean and
    variance): the new values of every micro-batch are handed to
    `py_utils.AddDeferredUpdate`, and the weights are set once per mini-batch
    to their average over the micro-batches (for the moving mean, exactly the
    update with the mean of the micro-batch means). Batch statistics are
    those of each micro-batch, as in GPipe.
"""

import inspect

import keras
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils

__all__ = ['KerasChain', 'KerasInputShape', 'KerasLayer', 'KerasLayersParams']


def _Serialize(layer):
  if not isinstance(layer, keras.layers.Layer):
    raise TypeError(
      f'Expected a Keras 3 layer (keras.layers.Layer), got '
      f'{type(layer).__name__} {layer!r}.'
    )
  return keras.layers.serialize(layer)


def _IsSeedState(v):
  return v.dtype == 'int64' and 'seed_generator' in v.path


def _VarName(v, taken):
  """A Python-identifier name for Keras variable `v`, unique in `taken`."""
  base = ''.join(c if c.isalnum() else '_' for c in v.name) or 'w'
  if base[0].isdigit():
    base = 'w_' + base
  name, i = base, 1
  while name in taken:
    name = f'{base}_{i}'
    i += 1
  taken.add(name)
  return name


class KerasLayer(base_layer.BaseLayer):
  """A Keras 3 layer whose weights are this layer's theta. See module doc."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'keras_config',
      None,
      'The Keras layer, as keras.layers.serialize(layer) returns it.',
    )
    p.Define(
      'input_shape',
      None,
      'Shape of the Keras layer input, batch first (None = any), e.g. '
      '[None, 16]: the Keras layer is built with it.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not isinstance(p.keras_config, dict):
      raise ValueError(
        f'KerasLayer {p.name!r}: keras_config={p.keras_config!r}; set it to '
        'keras.layers.serialize(layer), or build the Params with '
        'KerasLayersParams([layer, ...], input_shape).'
      )
    if p.input_shape is None:
      raise ValueError(
        f'KerasLayer {p.name!r}: input_shape is None; set the shape the Keras '
        'layer takes, batch first, e.g. [None, 16].'
      )
    self._keras = keras.layers.deserialize(p.keras_config)
    if isinstance(self._keras, keras.Model):
      raise ValueError(
        f'KerasLayer {p.name!r} wraps a Keras model '
        f'({type(self._keras).__name__}); pass its layers instead: '
        'KerasLayersParams(model) splits a keras.Sequential into them.'
      )
    if not self._keras.built:  # A built layer's config rebuilds it.
      self._keras.build(tuple(p.input_shape))
    taken = set()
    self._trainable_names = []
    for v in self._keras.trainable_variables:
      name = _VarName(v, taken)
      self.CreateVariable(name, self._WeightParams(v), trainable=True)
      self._trainable_names.append(name)
    # Per non-trainable Keras variable: the name of ours, or None for the
    # state of a seed generator (fed the library's stateless seed).
    self._non_trainable_names = []
    for v in self._keras.non_trainable_variables:
      if _IsSeedState(v):
        self._non_trainable_names.append(None)
        continue
      name = _VarName(v, taken)
      self.CreateVariable(name, self._WeightParams(v), trainable=False)
      self._non_trainable_names.append(name)
    # tf.Module lists a layer's variables by attribute name (bias before
    # kernel); this tuple, whose name sorts first, lists them in Keras order,
    # so `trainable_variables` of this layer and of a pipeline of such layers
    # follow the Keras model's. Not a tracked attribute: checkpoints name
    # variables by path.
    object.__setattr__(
      self, '_keras_order', tuple(self.KerasOrderedVariables())
    )
    self._seed = py_utils.StableHash(p.random_seed or 0, self.path, 'keras')
    params = inspect.signature(self._keras.call).parameters
    self._has_training_arg = 'training' in params
    if not base_layer.IsAbstract():
      self.LoadKerasWeights(self._keras)
      self._ShareKerasWeights()

  def _ShareKerasWeights(self):
    """Points the wrapped Keras layer's variables at ours, so that each
    weight is held once (the Keras layer only runs stateless, on theta)."""
    for mine, v in self._Pairs(self._keras):
      inner = getattr(v, '_value', None)
      if isinstance(inner, tf.Variable) and inner.dtype == mine.dtype:
        v._value = mine  # pylint: disable=protected-access

  def _WeightParams(self, v):
    return py_utils.WeightParams(list(v.shape), dtype=tf.as_dtype(v.dtype))

  @property
  def keras_layer(self):
    """The wrapped Keras layer; its variables hold this layer's (FProp
    passes theta to it instead)."""
    return self._keras

  def KerasOrderedVariables(self):
    """This layer's variables in the order of the Keras layer's
    `trainable_variables` followed by its `non_trainable_variables` (seed
    states left out)."""
    names = self._trainable_names + [n for n in self._non_trainable_names if n]
    return [self._private_vars[n] for n in names]

  def _Pairs(self, keras_layer):
    """[(our variable, the Keras variable)] of built `keras_layer`."""
    if not isinstance(keras_layer, keras.layers.Layer):
      raise TypeError(
        f'{self.path}: expected a Keras layer, got '
        f'{type(keras_layer).__name__} {keras_layer!r}.'
      )
    ours = self.KerasOrderedVariables()
    theirs = list(keras_layer.trainable_variables) + [
      v for v in keras_layer.non_trainable_variables if not _IsSeedState(v)
    ]
    if len(ours) != len(theirs):
      raise ValueError(
        f'{self.path}: the Keras layer {keras_layer.name!r} has '
        f'{len(theirs)} weights but this layer has {len(ours)}; pass a layer '
        'of the same config.'
      )
    for mine, v in zip(ours, theirs):
      if mine.shape.as_list() != list(v.shape):
        raise ValueError(
          f'{self.path}: weight {mine.name} has shape {mine.shape.as_list()} '
          f'but {v.path} of the Keras layer has {list(v.shape)}; pass a '
          'layer of the same config.'
        )
    return list(zip(ours, theirs))

  def LoadKerasWeights(self, keras_layer):
    """Sets this layer's weights to those of built `keras_layer` (a layer of
    the same config, e.g. one of an unpipelined keras.Sequential)."""
    for mine, v in self._Pairs(keras_layer):
      mine.assign(tf.convert_to_tensor(v.value))

  def CopyWeightsTo(self, keras_layer):
    """Sets the weights of built `keras_layer` (a layer of the same config)
    to this layer's: the way back of `LoadKerasWeights`."""
    for mine, v in self._Pairs(keras_layer):
      v.assign(tf.convert_to_tensor(mine))

  def FProp(self, theta, *args):
    """Runs the Keras layer on `args` with the weights of `theta`."""
    trainable = [theta[n] for n in self._trainable_names]
    seed = None
    non_trainable = []
    for n in self._non_trainable_names:
      if n is None:
        if seed is None:
          seed = py_utils.GenerateStepSeedPair(self._seed)
        non_trainable.append(seed)
      else:
        non_trainable.append(theta[n])
    kwargs = {'training': not self.do_eval} if self._has_training_arg else {}
    outputs, new_state = self._keras.stateless_call(
      trainable, non_trainable, *args, **kwargs
    )
    updates = [
      tf.stop_gradient(new)
      for n, new in zip(self._non_trainable_names, new_state)
      if n is not None
    ]
    if updates and not self.do_eval and not base_layer.IsAbstract():
      py_utils.AddDeferredUpdate(self, updates)
    return outputs

  def ApplyDeferredUpdates(self, stats_list):
    """Sets the non-trainable weights to the average of their new values
    over `stats_list` (one list per micro-batch)."""
    names = [n for n in self._non_trainable_names if n]
    ops = []
    for i, name in enumerate(names):
      var = self._private_vars[name]
      with py_utils.OnDeviceOf(var):
        values = [tf.cast(s[i], var.dtype) for s in stats_list]
        if var.dtype.is_floating:
          value = tf.add_n(values) / len(values)
        else:
          value = values[-1]
        ops.append(var.assign(value))
    return tf.group(ops)


def _FunctionalChain(model):
  """The layers of functional `model` from input to output; raises unless
  each takes the previous one's output alone."""
  where = f'The functional model {model.name!r}'
  fix = (
    'a pipeline runs one layer after the other, each on the output of the '
    'one before; write the branches as one custom Keras layer, or pipeline '
    'a keras.Sequential.'
  )
  inputs, outputs = list(model.inputs), list(model.outputs)
  if len(inputs) != 1 or len(outputs) != 1:
    raise ValueError(
      f'{where} takes {len(inputs)} inputs and returns {len(outputs)} '
      f'outputs, not 1 and 1: {fix}'
    )
  chain, tensor = [], outputs[0]
  while True:
    op, node_index, _ = tensor._keras_history  # pylint: disable=protected-access
    if isinstance(op, keras.layers.InputLayer):
      break
    if not isinstance(op, keras.layers.Layer):
      raise ValueError(
        f'{where} applies {type(op).__name__} {op.name!r}, an operation, '
        'not a Keras layer: use a layer (keras.layers.Activation, '
        'keras.layers.Lambda or a custom one) instead.'
      )
    node = op._inbound_nodes[node_index]  # pylint: disable=protected-access
    ins = list(node.input_tensors)
    if len(ins) != 1 or len(node.output_tensors) != 1:
      raise ValueError(
        f'{where} is not a chain of layers: layer {op.name!r} takes '
        f'{len(ins)} inputs and returns {len(node.output_tensors)} '
        f'outputs; {fix}'
      )
    kwargs = sorted(
      k for k, v in node.arguments.kwargs.items() if v is not None
    )
    if kwargs:
      raise ValueError(
        f'{where} calls layer {op.name!r} with arguments {kwargs}, which a '
        'pipeline does not keep: '
        'call it on its input alone (the pipeline passes training= itself).'
      )
    if any(op is other for other in chain):
      raise ValueError(
        f'{where} calls layer {op.name!r} twice (shared weights); a '
        'pipeline gives each call its own weights: use two layers.'
      )
    chain.append(op)
    tensor = ins[0]
  return chain[::-1]


def KerasChain(model):
  """The Keras layers `model` applies one after the other.

  Args:
    model: a keras.Sequential, or a functional keras.Model that is a chain
      of layers (one input; each layer takes the previous layer's output
      alone; one output). Nested models of either kind are expanded.

  Returns:
    The list of Keras layers, first to last.
  """
  if isinstance(model, keras.Sequential):
    layers = list(model.layers)
  elif isinstance(model, keras.Model):
    try:
      functional = bool(model.inputs) and bool(model.outputs)
    except (AttributeError, ValueError):
      functional = False
    if not functional:
      raise ValueError(
        f'Model {model.name!r} ({type(model).__name__}) is a subclassed '
        'keras.Model, whose call() a pipeline cannot split: build it as a '
        'keras.Sequential or a functional chain of layers.'
      )
    layers = _FunctionalChain(model)
  else:
    raise TypeError(
      f'Expected a keras.Sequential or a functional keras.Model, got '
      f'{type(model).__name__} {model!r}.'
    )
  out = []
  for layer in layers:
    out.extend(KerasChain(layer) if isinstance(layer, keras.Model) else [layer])
  return out


def KerasInputShape(model):
  """The input shape of Keras `model`, batch first, or None if unbuilt."""
  try:
    inputs = model.inputs
  except (AttributeError, ValueError):
    inputs = None
  if inputs and len(inputs) == 1:
    return list(inputs[0].shape)
  try:
    shape = model.input_shape
  except (AttributeError, ValueError):
    return None
  return list(shape) if isinstance(shape, (list, tuple)) else None


def KerasLayersParams(layers, input_shape, name_prefix=None):
  """`KerasLayer` Params for Keras layers or a model that chains them.

  Args:
    layers: a list of Keras 3 layers, a keras.Sequential, or a functional
      keras.Model that is a chain of layers (see `KerasChain`).
    input_shape: the first layer's input shape, batch first, e.g. [None, 16].
    name_prefix: names the layers f'{name_prefix}{i}'; None: the Keras
      class in snake case and the index, e.g. 'dense_0' (not the Keras
      layers' own names, which depend on how many layers the process made
      before, while checkpoints need stable names).

  Returns:
    A list of KerasLayer Params, e.g. for PipeliningLayer.Params().layers.
    Each gets the input shape the previous layer outputs.
  """
  if isinstance(layers, keras.Model):
    layers = KerasChain(layers)
  if not isinstance(layers, (list, tuple)) or not layers:
    raise ValueError(
      f'layers={layers!r}: pass a non-empty list of Keras layers, a '
      'keras.Sequential or a functional chain of layers.'
    )
  if input_shape is None:
    raise ValueError(
      'input_shape is None: give the shape of the first layer input, batch '
      'first, e.g. [None, 16].'
    )
  shape = tuple(input_shape)
  out = []
  for i, layer in enumerate(layers):
    config = _Serialize(layer)
    if name_prefix is None:
      cls = type(layer).__name__
      snake = ''.join(
        f'_{c.lower()}' if c.isupper() and j else c.lower()
        for j, c in enumerate(cls)
      )
      name = f'{snake}_{i}'
    else:
      name = f'{name_prefix}{i}'
    out.append(
      KerasLayer.Params().Set(
        name=name, keras_config=config, input_shape=list(shape)
      )
    )
    try:
      shape = tuple(layer.compute_output_shape(shape))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(
        f'Keras layer {i} ({layer.name}) cannot take an input of shape '
        f'{list(shape)}: {e}'
      ) from e
  return out
