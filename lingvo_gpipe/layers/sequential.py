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
  'FetchLayer',
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


class FetchLayer(base_layer.BaseLayer):
  """Identity; a cell's `act_fetch_layers` names it to return its output.

  `activation` holds the outputs of the latest FProp (Lingvo's attribute).
  """

  def FProp(self, theta, *args):
    del theta
    object.__setattr__(self, '_activation', args)
    return py_utils.Unwrap(args)

  @property
  def activation(self):
    """The inputs (= outputs) of the latest FProp, as a tuple."""
    return self.__dict__.get('_activation')

  @classmethod
  def FPropMeta(cls, p, *args):
    return meta.Meta(0, *args)


def _FirstOf(x):
  """A fetched activation: the first output of a layer with several."""
  return x[0] if isinstance(x, (tuple, list)) else x


class FeatureExtractionLayer(base_layer.BaseLayer):
  """A pipeline cell (Lingvo's): runs its `sub` layers in sequence.

  Each sub layer is a child named `variable_name_prefix + its name` (an
  unnamed one `sub_<i>`): `theta.fc0`, variables `<path>/fc0/w`.

  Activations pass through a cell and can be fetched from inside it:
  FProp(theta, *args) runs the sub layers on args[:-num_act_inputs] and
  returns (their outputs..., args[-num_act_inputs:]..., the output of each
  layer in `act_fetch_layers`...), so num_act_outputs = num_act_inputs +
  len(act_fetch_layers). With neither, it returns the last layer's outputs.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sub', [], 'List of layer Params, run in this order.')
    p.Define(
      'variable_name_prefix',
      '',
      "Prefix of the sub layers' names (and so of their variables).",
    )
    p.Define(
      'num_act_inputs',
      0,
      'Number of trailing inputs passed through to the outputs unchanged '
      '(activations fetched by earlier cells).',
    )
    p.Define(
      'num_act_outputs',
      0,
      "Number of trailing outputs after the last layer's: "
      'num_act_inputs + len(act_fetch_layers).',
    )
    p.Define(
      'act_fetch_layers',
      [],
      'Names of sub layers whose output (the first, if several) is '
      'appended to the outputs.',
    )
    return p

  @classmethod
  def _SubNames(cls, p):
    return [
      p.variable_name_prefix + (sp.name or f'sub_{i}')
      for i, sp in enumerate(p.sub)
    ]

  @classmethod
  def _FetchIndices(cls, p):
    names = cls._SubNames(p)
    plain = [sp.name for sp in p.sub]
    out = []
    for f in p.act_fetch_layers or []:
      if f in names:
        out.append(names.index(f))
      elif f in plain:
        out.append(plain.index(f))
      else:
        raise ValueError(
          f'{_shapes.LayerName(p)}: act_fetch_layers names {f!r}, which is '
          f'not a sub layer; use one of {names}.'
        )
    return out

  @classmethod
  def _Validate(cls, p):
    name = _shapes.LayerName(p)
    if not isinstance(p.sub, (list, tuple)) or not p.sub:
      raise ValueError(
        f'{name} has no sub layers; an empty cell does nothing: give it '
        'layers or remove it.'
      )
    for sp in p.sub:
      base_layer.LayerParams(sp)
    for key in ('num_act_inputs', 'num_act_outputs'):
      v = p.Get(key)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f'{name}: {key}={v!r}; use an int >= 0.')
    fetch = list(p.act_fetch_layers or [])
    if p.num_act_outputs != p.num_act_inputs + len(fetch):
      raise ValueError(
        f'{name}: num_act_outputs={p.num_act_outputs} must be num_act_inputs '
        f'+ len(act_fetch_layers) = {p.num_act_inputs + len(fetch)}.'
      )
    cls._FetchIndices(p)

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self._names = self._SubNames(p)
    self._fetch = self._FetchIndices(p)
    for name, sp in zip(self._names, p.sub):
      self.CreateChild(name, sp.Copy().Set(name=name))

  @property
  def sub(self):
    """The sub layers, in order."""
    return [self.children[n] for n in self._names]

  @classmethod
  def _SplitArgs(cls, p, args):
    n = p.num_act_inputs
    if len(args) <= n:
      raise ValueError(
        f'{_shapes.LayerName(p)} takes {len(args)} inputs but passes '
        f'num_act_inputs={n} of them through; it needs at least one more.'
      )
    return (args[:-n], args[-n:]) if n else (args, ())

  def FProp(self, theta, *args):
    """Runs the sub layers; see the class docstring for the outputs."""
    p = self.params
    args, extra = self._SplitArgs(p, args)
    fetched = {}
    for i, name in enumerate(self._names):
      args = py_utils.AsTuple(self.children[name].FProp(theta[name], *args))
      if i in self._fetch:
        fetched[i] = _FirstOf(py_utils.Unwrap(args))
    extra = tuple(extra) + tuple(fetched[i] for i in self._fetch)
    return args + extra if extra else py_utils.Unwrap(args)

  @classmethod
  def FPropMeta(cls, p, *args):
    cls._Validate(p)
    args, extra = cls._SplitArgs(p, args)
    subs = [sp.Copy().Set(name=n) for sp, n in zip(p.sub, cls._SubNames(p))]
    metas = LayerMetas(subs, *args)
    outs = py_utils.AsTuple(metas[-1][2])
    fetched = tuple(
      _FirstOf(py_utils.Unwrap(py_utils.AsTuple(metas[i][2])))
      for i in cls._FetchIndices(p)
    )
    extra = tuple(extra) + fetched
    flops = sum(m[0] for m in metas)
    return meta.Meta(flops, *(outs + extra if extra else outs))
