"""`SequentialLayer` and `RepeatLayer`: layers run one after another.

Each layer's outputs become the next one's inputs: a tuple is unpacked into
positional arguments, anything else (a tensor, a NestedMap) is passed as the
single argument. FPropMeta chains the layers' FPropMeta the same way.
"""

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.layers import _shapes

__all__ = ['SequentialLayer', 'RepeatLayer', 'ChainFPropMeta']


def _AsTuple(x):
  if isinstance(x, tuple) and not hasattr(x, '_fields'):
    return x
  return (x,)


def _Unwrap(xs):
  return xs[0] if len(xs) == 1 else xs


def ChainFPropMeta(params_list, *input_shapes):
  """Feeds `input_shapes` through the FPropMeta of each Params in turn.

  Returns:
    meta.Meta(total flops, *out_shapes of the last layer).

  Raises:
    ValueError: naming the first layer that cannot take its inputs.
  """
  shapes = tuple(input_shapes)
  flops = 0
  for i, p in enumerate(params_list):
    p = base_layer.LayerParams(p).Copy()
    if not p.name:
      p.name = f'layer_{i}'
    try:
      m = p.cls.FPropMeta(p, *shapes)
    except (ValueError, TypeError) as e:
      raise ValueError(f'Layer {i} ({p.name}, {p.cls.__name__}) of the '
                       f'sequence cannot take its inputs: {e}') from e
    flops += m.flops
    shapes = _AsTuple(m.out_shapes)
  return meta.Meta(flops, *shapes)


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
      raise ValueError(f'{_shapes.LayerName(p)}: p.sub = {p.sub!r}; give it a '
                       'non-empty list of layer Params.')
    for sub in p.sub:
      base_layer.LayerParams(sub)

  def __init__(self, params):
    super().__init__(params)
    self._Validate(self.params)
    self.CreateChildren('sub', list(self.params.sub))

  def FProp(self, theta, *args):
    """Runs sub[0](args) -> sub[1](...) -> ...; returns the last outputs."""
    for i, layer in enumerate(self.sub):
      args = _AsTuple(layer.FProp(theta.sub[i], *args))
    return _Unwrap(args)

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
      raise ValueError(f'{_shapes.LayerName(p)}: p.body is None; set it to '
                       'the Params of the layer to repeat.')
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
    """Runs body_0(args) -> body_1(...) -> ...; returns the last outputs."""
    for i, layer in enumerate(self.body):
      args = _AsTuple(layer.FProp(theta.body[i], *args))
    return _Unwrap(args)

  @classmethod
  def FPropMeta(cls, p, *args):
    cls._Validate(p)
    return ChainFPropMeta(cls._BodyParams(p), *args)
