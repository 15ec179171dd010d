"""BaseLayer: the Lingvo layer contract on a `tf.Module`.

A layer is described by its `Params()` and built by `p.Instantiate()`. In
`__init__` it creates its children (`CreateChild`, `CreateChildren`) and its
variables (`CreateVariable`); `FProp(theta, *inputs)` computes with the
weights passed in `theta`, a NestedMap of this layer's variables and its
children's thetas. `FPropMeta(p, *input_shapes)` returns the flops and output
shapes without allocating weights, which the pipeline partitioner needs.

Variable names are hierarchical (`root/child/grandchild/w`) and derived only
from the layer names, never from devices or pipeline cells, so a checkpoint
written by a model split in 8 cells restores into the same model split in 1.
Initial values are a stateless function of (random_seed, variable name), so
the same seed gives the same initial weights however the model is split.

Example:

  class MyLayer(base_layer.BaseLayer):

    @classmethod
    def Params(cls):
      p = super().Params()
      p.Define('dim', 8, 'Width.')
      return p

    def __init__(self, params):
      super().__init__(params)
      p = self.params
      self.CreateVariable('w', py_utils.WeightParams([p.dim, p.dim]))

    def FProp(self, theta, x):
      return tf.matmul(x, theta.w)

  layer = MyLayer.Params().Set(name='my', dim=4).Instantiate()
  y = layer(tf.ones([2, 4]))      # == layer.FProp(layer.theta, ...)
"""

import contextlib
import difflib
import re
import threading

import tensorflow as tf

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap

__all__ = [
  'BaseLayer',
  'AbstractVariable',
  'AbstractBuild',
  'DetachedBuild',
  'IsAbstract',
  'CountParams',
  'LayerParams',
  'initializer',
]

_local = threading.local()


def _ConstructionStack():
  if not hasattr(_local, 'stack'):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def AbstractBuild():
  """Layers built inside create `AbstractVariable`s: shapes, no memory.

  Used to count the parameters of a giant model and to trace `FProp` for
  `FPropMeta` without allocating any weight.
  """
  prev = getattr(_local, 'abstract', False)
  _local.abstract = True
  try:
    yield
  finally:
    _local.abstract = prev


@contextlib.contextmanager
def DetachedBuild():
  """Layers built inside are roots, even while another layer is constructed.

  For temporary layers (counting parameters, tracing FPropMeta, timing) built
  during a parent's `__init__`: they must not become its children nor share
  its variables.
  """
  stack = _ConstructionStack()
  saved = list(stack)
  del stack[:]
  try:
    yield
  finally:
    stack[:] = saved


def IsAbstract():
  return getattr(_local, 'abstract', False)


class AbstractVariable:
  """A variable's name, shape and dtype, created under `AbstractBuild`."""

  def __init__(self, name, shape, dtype, trainable=True):
    self.name = name
    self.shape = tf.TensorShape(shape)
    self.dtype = tf.as_dtype(dtype)
    self.trainable = trainable

  def ToSpec(self):
    return tf.TensorSpec(self.shape, self.dtype, name=self.name)

  def __repr__(self):
    return (
      f'AbstractVariable({self.name!r}, shape={self.shape.as_list()}, '
      f'dtype={self.dtype.name})'
    )


class _LayerMeta(type):
  """Marks a layer as constructed once its outermost `__init__` returns."""

  def __call__(cls, *args, **kwargs):
    stack = _ConstructionStack()
    depth = len(stack)
    try:
      obj = super().__call__(*args, **kwargs)
    finally:
      del stack[depth:]
    object.__setattr__(obj, '_constructed', True)
    return obj


def _Sanitize(name):
  out = re.sub(r'[^A-Za-z0-9_]', '_', name)
  return out if out and not out[0].isdigit() else '_' + out


class BaseLayer(tf.Module, metaclass=_LayerMeta):
  """Base class of all layers. See the module docstring."""

  @classmethod
  def Params(cls):
    """Returns the layer's Params; subclasses extend `super().Params()`."""
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', '', 'Name of this layer; it names its variables.')
    p.Define('dtype', tf.float32, 'Dtype of the variables.')
    p.Define(
      'fprop_dtype',
      None,
      'Dtype of the computation; None: same as dtype. E.g. bfloat16 '
      'compute with float32 master weights.',
    )
    p.Define(
      'params_init',
      py_utils.DefaultParamInit(),
      'Weight initializer used where WeightParams gives none.',
    )
    p.Define(
      'random_seed',
      None,
      'Seed of initializers and random ops; None: inherited, else 0. '
      'Together with the variable name it fixes every draw.',
    )
    p.Define(
      'is_inference', None, 'True: the layer is built for inference only.'
    )
    p.Define(
      'skip_lp_regularization',
      None,
      "True: no weight decay on this layer's variables.",
    )
    return p

  @staticmethod
  def CopyBaseParams(from_params, to_params):
    """Copies inheritable base params into `to_params` where not set."""
    if to_params.dtype == tf.float32:
      to_params.dtype = from_params.dtype
    if to_params.fprop_dtype is None:
      to_params.fprop_dtype = from_params.fprop_dtype
    if to_params.random_seed is None:
      to_params.random_seed = from_params.random_seed
    if to_params.is_inference is None:
      to_params.is_inference = from_params.is_inference
    if to_params.skip_lp_regularization is None:
      to_params.skip_lp_regularization = from_params.skip_lp_regularization
    if py_utils.IsDefaultParamInit(to_params.params_init):
      to_params.params_init = from_params.params_init.Copy()
    return to_params

  def __init__(self, params):
    if not isinstance(params, hyperparams.Params):
      raise TypeError(
        f'{type(self).__name__} expects a Params object, got '
        f'{type(params).__name__}. Build layers with '
        f'{type(self).__name__}.Params().Set(name=...).Instantiate().'
      )
    if not isinstance(params.name, str) or not params.name:
      raise ValueError(
        f'{type(self).__name__}: params.name is {params.name!r}; every layer '
        'needs a non-empty name, e.g. p.name = "my_layer".'
      )
    if '/' in params.name:
      raise ValueError(f'Layer name {params.name!r} may not contain "/".')
    stack = _ConstructionStack()
    parent = stack[-1] if stack else None
    super().__init__(name=_Sanitize(params.name))
    p = params.Copy()
    p.Freeze()
    object.__setattr__(self, '_params', p)
    object.__setattr__(self, '_parent', parent)
    object.__setattr__(self, '_constructed', False)
    path = f'{parent.path}/{p.name}' if parent is not None else p.name
    object.__setattr__(self, '_path', path)
    store = parent._shared_store if parent is not None else {}
    object.__setattr__(self, '_shared_store', store)
    self._private_vars = {}
    self._private_children = {}
    stack.append(self)

  # -- Properties --------------------------------------------------------------

  @property
  def params(self):
    """The frozen Params this layer was built from."""
    return self._params

  p = params

  @property
  def path(self):
    """The layer's hierarchical name, e.g. 'model/enc/layer_0'."""
    return self._path

  @property
  def parent(self):
    return self._parent

  @property
  def fprop_dtype(self):
    return self.params.fprop_dtype or self.params.dtype

  @property
  def do_eval(self):
    """True in inference or evaluation mode (`py_utils.EvalMode`)."""
    return bool(self.params.is_inference) or py_utils.IsEval()

  @property
  def children(self):
    """NestedMap of child layers (lists for `CreateChildren`)."""
    return NestedMap(self._private_children)

  def __getattr__(self, name):
    # Only called when normal lookup fails: look in children, then vars.
    d = self.__dict__
    if name.startswith('_'):  # tf.Module's internal probes: no suggestions
      raise AttributeError(name)
    if '_private_children' in d and name in d['_private_children']:
      return d['_private_children'][name]
    if '_private_vars' in d and name in d['_private_vars']:
      return d['_private_vars'][name]
    known = list(d.get('_private_children', {})) + list(
      d.get('_private_vars', {})
    )
    hint = difflib.get_close_matches(name, known, n=1)
    extra = f' Did you mean {hint[0]!r}?' if hint else ''
    raise AttributeError(
      f'{type(self).__name__} {d.get("_path", "?")!r} has no attribute, '
      f'child or variable {name!r}.{extra}'
    )

  # -- Construction ------------------------------------------------------------

  def _CheckConstructing(self, what, name):
    if self.__dict__.get('_constructed', True):
      raise ValueError(
        f'{what}({name!r}) called on layer {self.path!r} after its '
        '__init__ returned: create children and variables inside __init__.'
      )
    if name in self._private_children or name in self._private_vars:
      raise ValueError(
        f'Layer {self.path!r} already has a child or variable named '
        f'{name!r}; give each child and variable a distinct name.'
      )
    if not isinstance(name, str) or not re.match(r'^[A-Za-z_]\w*$', name):
      raise ValueError(
        f'Invalid child/variable name {name!r} in layer '
        f'{self.path!r}: use a Python identifier.'
      )

  def _BuildChild(self, p):
    p = self.CopyBaseParams(self.params, p.Copy())
    taken = self.__dict__.setdefault('_child_layer_names', set())
    if p.name in taken:
      raise ValueError(
        f'Layer {self.path!r} already has a child layer named {p.name!r}: '
        'its variables would collide. Give each child a distinct name.'
      )
    taken.add(p.name)
    return p.Instantiate()

  def CreateChild(self, name, params):
    """Creates child layer `name` from `params` (inside `__init__` only)."""
    self._CheckConstructing('CreateChild', name)
    if not isinstance(params, hyperparams.InstantiableParams):
      raise TypeError(
        f'CreateChild({name!r}) in {self.path!r} expects layer '
        f'Params, got {type(params).__name__}.'
      )
    p = params.Copy()
    if not p.name:
      p.name = name
    self._private_children[name] = self._BuildChild(p)
    return self._private_children[name]

  def CreateChildren(self, name, params_list, devices=None):
    """Creates a list of children; unnamed ones become `name_<i>`.

    Args:
      name: attribute name of the list.
      params_list: list of layer Params.
      devices: optional list of device names, one per child: each child's
        variables are created on its device (used by pipelines).
    """
    self._CheckConstructing('CreateChildren', name)
    if not isinstance(params_list, (list, tuple)):
      raise TypeError(
        f'CreateChildren({name!r}) in {self.path!r} expects a '
        f'list of Params, got {type(params_list).__name__}.'
      )
    names, children = set(), []
    for i, params in enumerate(params_list):
      p = params.Copy()
      if not p.name:
        p.name = f'{name}_{i}'
      if p.name in names or p.name in self._private_children:
        raise ValueError(
          f'CreateChildren({name!r}) in {self.path!r}: two children are named '
          f'{p.name!r}; give each a distinct name (or leave names empty).'
        )
      names.add(p.name)
      # No device given: the enclosing device scope (tf.device(None) would
      # clear it).
      scope = tf.device(devices[i]) if devices else contextlib.nullcontext()
      with scope:
        children.append(self._BuildChild(p))
    self._private_children[name] = children
    return children

  def CreateVariable(self, name, var_params, trainable=True):
    """Creates variable `name` (inside `__init__` only).

    Args:
      name: attribute name; the variable's full name is `<path>/<name>`.
      var_params: `py_utils.WeightParams(...)`.
      trainable: whether optimizers update it.

    Returns:
      The tf.Variable (or an AbstractVariable under `AbstractBuild`).
    """
    self._CheckConstructing('CreateVariable', name)
    p = self.params
    init = var_params.init or p.params_init
    dtype = tf.as_dtype(var_params.dtype or p.dtype)
    shape = [int(d) for d in var_params.shape]
    if any(d < 0 for d in shape):
      raise ValueError(
        f'Variable {self.path}/{name}: negative dimension in shape {shape}.'
      )
    full_name = f'{self.path}/{name}'
    shared = var_params.shared_name
    if shared and shared in self._shared_store:
      var = self._shared_store[shared]
      if var.shape.as_list() != shape or var.dtype.base_dtype != dtype:
        raise ValueError(
          f'Variable {full_name} shares {shared!r} with {var.name} but its '
          f'shape/dtype {shape}/{dtype.name} differ from '
          f'{var.shape.as_list()}/{var.dtype.base_dtype.name}.'
        )
    elif IsAbstract():
      var = AbstractVariable(full_name, shape, dtype, trainable)
    else:
      seed = init.seed
      if seed is None:
        seed = py_utils.StableHash(p.random_seed or 0, full_name)
      value = py_utils.InitialValue(init, shape, dtype, seed)
      # The trailing '/' makes the name absolute: an enclosing tf.name_scope
      # must not change checkpoint names.
      var = tf.Variable(
        value,
        name=full_name + '/',
        trainable=trainable,
        aggregation=py_utils.REPLICATED_AGGREGATION,
      )
    if shared and shared not in self._shared_store:
      self._shared_store[shared] = var
    self._private_vars[name] = var
    return var

  # -- Weights -----------------------------------------------------------------

  @property
  def vars(self):
    """NestedMap of this layer's variables and its children's vars."""
    out = NestedMap(self._private_vars)
    for name, child in self._private_children.items():
      if isinstance(child, (list, tuple)):
        out[name] = [c.vars for c in child]
      else:
        out[name] = child.vars
    return out

  @property
  def theta(self):
    """The weights `FProp` computes with: `vars`, cast to `fprop_dtype`."""
    theta = self.vars
    dtype = self.params.fprop_dtype
    if dtype is None or IsAbstract():
      return theta

    def Cast(v):
      if v.dtype.base_dtype.is_floating and v.dtype.base_dtype != dtype:
        return tf.cast(v, dtype)
      return v

    return theta.Transform(Cast)

  def VariablesByName(self):
    """{full variable name: variable}, shared variables listed once."""
    out = {}
    for v in self.vars.Flatten():
      out.setdefault(v.name.split(':')[0], v)
    return out

  # -- Computation -------------------------------------------------------------

  def FProp(self, theta, *args, **kwargs):
    """Forward computation. Subclasses override."""
    raise NotImplementedError(f'{type(self).__name__}.FProp')

  def FPropDefaultTheta(self, *args, **kwargs):
    """`FProp` with this layer's own weights (`self.theta`), as in Lingvo."""
    return self.FProp(self.theta, *args, **kwargs)

  def __call__(self, *args, training=None, **kwargs):
    """`FProp` with this layer's own weights (`theta`).

    `training`, as in Keras: None keeps the current mode; False runs in
    evaluation mode (`py_utils.EvalMode()`: dropout off, batch norm on its
    moving averages), True in training mode.
    """
    if training is None:
      return self.FPropDefaultTheta(*args, **kwargs)
    with py_utils.EvalMode(not training):
      return self.FPropDefaultTheta(*args, **kwargs)

  @classmethod
  def FPropMeta(cls, p, *args):
    """Returns NestedMap(flops=int, out_shapes=tuple) for inputs `args`.

    `args` are shapes (`tf.TensorShape`, lists, `tf.TensorSpec`) or NestedMaps
    of them. Layers override this with a formula; this default builds the
    layer abstractly (no weights) and traces `FProp` into a graph, counting
    flops with TensorFlow's per-op statistics. Deferred updates (batch-norm
    statistics) of the traced FProp are collected and dropped, not handed to
    a caller's collector.
    """
    with py_utils.UpdateCollector():
      return meta.TraceFPropMeta(p, *args)

  @classmethod
  def AbstractInstance(cls, p):
    """The layer of `p` built abstractly (no weights), outside any parent."""
    with AbstractBuild(), DetachedBuild():
      return p.Instantiate()

  def ApplyDeferredUpdates(self, stats_list):
    """Applies statistics collected by `py_utils.AddDeferredUpdate`."""
    raise NotImplementedError(
      f'{type(self).__name__} added deferred updates but does not implement '
      'ApplyDeferredUpdates(stats_list).'
    )

  def __repr__(self):
    return f'{type(self).__name__}({self.path!r})'


def RejectUnsupportedParams(p, unsupported):
  """Raises for a compatibility param of `p` set to a non-default value.

  Args:
    p: a layer's Params.
    unsupported: {name: (the only supported value, what to do instead)}.
  """
  for name, (default, instead) in unsupported.items():
    value = p.Get(name)
    if value != default:
      raise ValueError(
        f'{p.cls.__name__} {p.name!r}: {name}={_OneLine(value)} is not '
        f'supported (only {default!r}); {instead}'
      )


def _OneLine(value):
  """A value for a one-line message: Params by their class."""
  if isinstance(value, hyperparams.InstantiableParams):
    return f'{getattr(value.cls, "__name__", value.cls)}.Params()'
  text = repr(value)
  return text if '\n' not in text else text.split('\n')[0] + ' ...'


def initializer(func):  # pylint: disable=invalid-name
  """Lingvo's decorator of a layer's `__init__`; nothing to do here."""
  return func


def LayerParams(p):
  """Validates that `p` is the Params of a BaseLayer subclass."""
  if not isinstance(p, hyperparams.InstantiableParams) or not (
    isinstance(p.cls, type) and issubclass(p.cls, BaseLayer)
  ):
    raise TypeError(f'Expected the Params of a BaseLayer subclass, got {p!r}.')
  return p


def CountParams(p):
  """Number of weights a layer built from `p` has, without allocating any."""
  p = p.Copy()
  if not p.name:
    p.name = 'count'
  with AbstractBuild(), DetachedBuild():
    layer = p.Instantiate()
  total = 0
  for v in layer.VariablesByName().values():
    total += int(v.shape.num_elements())
  return total
