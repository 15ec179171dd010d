"""Layers run one after another: `SequentialLayer`, `RepeatLayer`, and
`FeatureExtractionLayer` (Lingvo's name for a pipeline cell).

Each layer's outputs become the next one's inputs: a tuple is unpacked into
positional arguments, anything else (a tensor, a NestedMap) is passed as the
single argument. `LayerMetas` chains the layers' FPropMeta the same way; it
is the one implementation behind every sequence's FPropMeta and the
pipeline's shape checks and balancing.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes

__all__ = [
  'SequentialLayer',
  'RepeatLayer',
  'FeatureExtractionLayer',
  'ChainFPropMeta',
  'LayerMetas',
  'FormatShapes',
]


def FormatShapes(shapes):
  """Shapes (TensorShapes, nested) as plain lists, for error messages."""
  return tf.nest.map_structure(
    lambda s: tf.TensorShape(s).as_list() if s is not None else None, shapes
  )


def LayerMetas(layer_params, *input_shapes):
  """FPropMeta of each layer in sequence, feeding shapes forward.

  Returns:
    A list of (flops, in_shapes, out_shapes) per layer.

  Raises:
    ValueError: naming the first layer that cannot take its input.
  """
  shapes = tuple(input_shapes)
  out = []
  for i, p in enumerate(layer_params):
    p = base_layer.LayerParams(p).Copy()
    if not p.name:
      p.name = f'layer_{i}'
    try:
      m = p.cls.FPropMeta(p, *shapes)
    except (ValueError, TypeError) as e:
      prev = (
        f'the output of layer {i - 1} ({layer_params[i - 1].name or "?"})'
        if i
        else 'the input'
      )
      raise ValueError(
        f'Layer {i} ({p.name}, {p.cls.__name__}) cannot take {prev} with '
        f'shapes {FormatShapes(shapes)}: {e}'
      ) from e
    out.append((m.flops, shapes, m.out_shapes))
    shapes = py_utils.AsTuple(m.out_shapes)
  return out


def ChainFPropMeta(params_list, *input_shapes):
  """The FPropMeta of a sequence: `LayerMetas` summed up.

  Returns:
    meta.Meta(total flops, *out_shapes of the last layer); no layers: zero
    flops and the input shapes.

  Raises:
    ValueError: naming the first layer that cannot take its inputs.
  """
  metas = LayerMetas(list(params_list), *input_shapes)
  shapes = py_utils.AsTuple(metas[-1][2]) if metas else tuple(input_shapes)
  return meta.Meta(sum(m[0] for m in metas), *shapes)


class SequentialLayer(base_layer.BaseLayer):
  """Runs the `sub` layers in order.

  The children are the list `sub`; each is named by its Params' name, or
  `sub_<i>` if it has none (variables `<path>/sub_<i>/...`).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sub', [], 'List of layer Params, run in this order.')
    return p

  @classmethod
  def _Validate(cls, p):
    if not isinstance(p.sub, (list, tuple)) or not p.sub:
      raise ValueError(
        f'{_shapes.LayerName(p)}: p.sub = {p.sub!r}; give it a '
        'non-empty list of layer Params.'
      )
    for sub in p.sub:
      base_layer.LayerParams(sub)

  def __init__(self, params):
    super().__init__(params)
    self._Validate(self.params)
    self.CreateChildren('sub', list(self.params.sub))

  def FProp(self, theta, *args):
    """Runs `sub[0](args) -> sub[1](...) -> ...`; returns the last outputs."""
    for i, layer in enumerate(self.sub):
      args = py_utils.AsTuple(layer.FProp(theta.sub[i], *args))
    return py_utils.Unwrap(args)

  @classmethod
  def FPropMeta(cls, p, *args):
    cls._Validate(p)
    return ChainFPropMeta(list(p.sub), *args)


class RepeatLayer(base_layer.BaseLayer):
  """Runs `repeat` copies of `body` in sequence (children `body_0`, ...).

  Each copy has its own variables (`<path>/body_<i>/...`).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('body', None, 'Params of the repeated layer.')
    p.Define('repeat', 1, 'Number of copies of body.')
    return p

  @classmethod
  def _Validate(cls, p):
    if p.body is None:
      raise ValueError(
        f'{_shapes.LayerName(p)}: p.body is None; set it to '
        'the Params of the layer to repeat.'
      )
    base_layer.LayerParams(p.body)
    _shapes.CheckPositive(p, 'repeat')

  @classmethod
  def _BodyParams(cls, p):
    bodies = []
    for i in range(p.repeat):
      body = p.body.Copy()
      body.name = f'body_{i}'
      bodies.append(body)
    return bodies

  def __init__(self, params):
    super().__init__(params)
    self._Validate(self.params)
    self.CreateChildren('body', self._BodyParams(self.params))

  def FProp(self, theta, *args):
    """Runs `body_0(args) -> body_1(...) -> ...`; returns the last outputs."""
    for i, layer in enumerate(self.body):
      args = py_utils.AsTuple(layer.FProp(theta.body[i], *args))
    return py_utils.Unwrap(args)

  @classmethod
  def FPropMeta(cls, p, *args):
    cls._Validate(p)
    return ChainFPropMeta(cls._BodyParams(p), *args)


class FeatureExtractionLayer(SequentialLayer):
  """A pipeline cell: runs its `sub` layers in sequence (Lingvo's name).

  Lingvo's activation-passing params are accepted only at their defaults:
  every output of a cell is the next cell's input, so there is nothing to
  select.
  """

  _UNSUPPORTED = {
    'num_act_inputs': (0, 'remove it: FProp takes every input.'),
    'num_act_outputs': (0, 'remove it: FProp returns every output.'),
    'act_fetch_layers': (
      [],
      'remove it and return the activations you '
      'need from the last sub layer (e.g. a NestedMap).',
    ),
  }

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'num_act_inputs',
      0,
      'Lingvo compatibility; only 0: FProp takes every input.',
    )
    p.Define(
      'num_act_outputs',
      0,
      'Lingvo compatibility; only 0: FProp returns every output.',
    )
    p.Define(
      'act_fetch_layers',
      [],
      'Lingvo compatibility; only []: the cell returns only its last '
      "layer's outputs.",
    )
    return p

  @classmethod
  def _Validate(cls, p):
    base_layer.RejectUnsupportedParams(p, cls._UNSUPPORTED)
    if not p.sub:
      raise ValueError(
        f'{_shapes.LayerName(p)} has no sub layers; an empty '
        'cell does nothing: give it layers or remove it.'
      )
    super()._Validate(p)
