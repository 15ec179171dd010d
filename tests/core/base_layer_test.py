"""Tests of lingvo_gpipe.core.base_layer."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import layers
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.py_utils import WeightInit


class _Leaf(base_layer.BaseLayer):
  """x [..., 2] -> x @ w, w: [2, dim]. Defines no FPropMeta."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 3, 'Output width.')
    p.Define('shared_name', None, 'Shares w under this name if set.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable(
      'w', py_utils.WeightParams([2, p.dim], shared_name=p.shared_name)
    )

  def FProp(self, theta, x):
    return tf.matmul(x, theta.w)


class _Parent(base_layer.BaseLayer):
  """A bias, one child and a list of children."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('child', _Leaf.Params(), 'Child template.')
    p.Define('stack_names', ['', ''], 'Names of the stacked children.')
    p.Define('devices', None, 'Devices of the stacked children.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable(
      'b', py_utils.WeightParams([3], WeightInit.Constant(0.5))
    )
    self.CreateChild('child', p.child)
    self.CreateChildren(
      'stack',
      [p.child.Copy().Set(name=n) for n in p.stack_names],
      devices=p.devices,
    )

  def FProp(self, theta, x):
    y = self.child.FProp(theta.child, x) + theta.b
    for layer, th in zip(self.stack, theta.stack):
      y = y + layer.FProp(th, x)
    return y


class _Custom(base_layer.BaseLayer):
  """Runs `build_fn(self)` in `__init__`; FProp returns x + 1."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('build_fn', None, 'Called with the layer inside __init__.')
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.build_fn is not None:
      self.params.build_fn(self)

  def FProp(self, theta, x):
    return x + 1.0


def _Build(build_fn, name='root', **kwargs):
  return (
    _Custom.Params().Set(name=name, build_fn=build_fn, **kwargs).Instantiate()
  )


def _Root(**kwargs):
  return _Parent.Params().Set(name='root', **kwargs).Instantiate()


def _Values(layer):
  return {k: v.numpy() for k, v in layer.VariablesByName().items()}


@contextlib.contextmanager
def _CountVariableCreations():
  created = []

  def Creator(next_creator, **kwargs):
    created.append(kwargs.get('name'))
    return next_creator(**kwargs)

  with tf.variable_creator_scope(Creator):
    yield created


# -- Params and construction ---------------------------------------------------


def testBaseParams():
  p = base_layer.BaseLayer.Params()
  assert set(p.GetKeys()) == {
    'cls',
    'name',
    'dtype',
    'fprop_dtype',
    'params_init',
    'random_seed',
    'is_inference',
    'skip_lp_regularization',
  }
  assert p.cls is base_layer.BaseLayer
  assert p.name == '' and p.dtype == tf.float32
  assert p.fprop_dtype is None and p.random_seed is None
  assert p.is_inference is None and p.skip_lp_regularization is None
  assert py_utils.IsDefaultParamInit(p.params_init)
  sub = _Leaf.Params()
  assert sub.cls is _Leaf and sub.dim == 3 and 'params_init' in sub


def testMissingNameError():
  with pytest.raises(ValueError, match='needs a non-empty name'):
    _Leaf.Params().Instantiate()


def testSlashInNameError():
  with pytest.raises(ValueError, match='may not contain "/"'):
    _Leaf.Params().Set(name='a/b').Instantiate()


def testNonParamsArgumentError():
  with pytest.raises(
    TypeError,
    match=r'_Leaf expects a Params object, got '
    r'dict.*Instantiate',
  ):
    _Leaf({'name': 'x'})


def testHierarchicalVariableNamesAndChildrenNaming():
  root = _Root()
  assert sorted(root.VariablesByName()) == [
    'root/b',
    'root/child/w',
    'root/stack_0/w',
    'root/stack_1/w',
  ]
  assert root.vars.child.w.name == 'root/child/w:0'
  assert root.child.path == 'root/child' and root.child.parent is root
  assert [c.path for c in root.stack] == ['root/stack_0', 'root/stack_1']
  assert [c.params.name for c in root.stack] == ['stack_0', 'stack_1']
  assert root.parent is None and root.path == 'root'
  assert set(root.children) == {'child', 'stack'}
  assert root.children.child is root.child


def testCreateChildrenKeepsExplicitNames():
  root = _Root(stack_names=['first', '', 'third'])
  assert [c.params.name for c in root.stack] == ['first', 'stack_1', 'third']
  assert 'root/first/w' in root.VariablesByName()


def testCreateChildrenDuplicateNamesError():
  with pytest.raises(ValueError, match="two children are named 'x'"):
    _Root(stack_names=['x', 'x'])
  # A generated name may not collide with an explicit one either.
  with pytest.raises(ValueError, match="two children are named 'stack_1'"):
    _Root(stack_names=['stack_1', ''])


def testCreateChildDuplicateLayerNamesError():
  def Build(layer):
    layer.CreateChild('a', _Leaf.Params().Set(name='x'))
    layer.CreateChild('b', _Leaf.Params().Set(name='x'))

  with pytest.raises(ValueError, match="'x'"):
    _Build(Build)


def testCreateAfterInitError():
  root = _Root()
  with pytest.raises(
    ValueError,
    match=r"CreateChild\('late'\).*'root'.*"
    r'after its __init__ returned',
  ):
    root.CreateChild('late', _Leaf.Params())
  with pytest.raises(ValueError, match=r'CreateChildren.*__init__'):
    root.CreateChildren('late', [_Leaf.Params()])
  with pytest.raises(ValueError, match=r"CreateVariable\('v'\).*__init__"):
    root.CreateVariable('v', py_utils.WeightParams([1]))
  # Also on a child, whose parent's __init__ has returned too.
  with pytest.raises(ValueError, match=r"'root/child'.*__init__"):
    root.child.CreateVariable('v', py_utils.WeightParams([1]))


@pytest.mark.parametrize(
  'build',
  [
    lambda l: [
      l.CreateVariable('w', py_utils.WeightParams([1])) for _ in range(2)
    ],
    lambda l: [l.CreateChild('c', _Leaf.Params()) for _ in range(2)],
    lambda l: (
      l.CreateChild('w', _Leaf.Params()),
      l.CreateVariable('w', py_utils.WeightParams([1])),
    ),
    lambda l: (
      l.CreateVariable('c', py_utils.WeightParams([1])),
      l.CreateChildren('c', [_Leaf.Params()]),
    ),
  ],
  ids=['var_var', 'child_child', 'child_var', 'var_children'],
)
def testDuplicateChildOrVariableNameError(build):
  with pytest.raises(ValueError, match='already has a child or variable named'):
    _Build(build)


def testInvalidVariableNameAndShape():
  with pytest.raises(ValueError, match='Invalid child/variable name'):
    _Build(lambda l: l.CreateVariable('a-b', py_utils.WeightParams([1])))
  with pytest.raises(ValueError, match='negative dimension'):
    _Build(lambda l: l.CreateVariable('w', py_utils.WeightParams([2, -1])))
  with pytest.raises(TypeError, match='expects layer Params'):
    _Build(lambda l: l.CreateChild('c', hyperparams.Params()))


def testFailedConstructionLeavesNoParent():
  def Fail(unused_layer):
    raise RuntimeError('boom')

  with pytest.raises(RuntimeError):
    _Build(lambda l: l.CreateChild('c', _Custom.Params().Set(build_fn=Fail)))
  later = _Leaf.Params().Set(name='later').Instantiate()
  assert later.parent is None and later.path == 'later'
  assert later.vars.w.name == 'later/w:0'


# -- Params inheritance and freezing -------------------------------------------


def testChildrenInheritBaseParams():
  init = WeightInit.Gaussian(0.1)
  root = _Root(
    dtype=tf.float64,
    random_seed=5,
    params_init=init,
    is_inference=True,
    skip_lp_regularization=True,
  )
  for child in [root.child] + list(root.stack):
    cp = child.params
    assert cp.dtype == tf.float64 and cp.random_seed == 5
    assert cp.is_inference is True and cp.skip_lp_regularization is True
    assert cp.params_init == init
    assert child.vars.w.dtype == tf.float64
  # Gaussian(0.1) rather than the default Xavier.
  assert np.abs(root.child.vars.w.numpy()).max() < 0.6


def testChildrenKeepWhatTheySet():
  child = _Leaf.Params().Set(
    dtype=tf.float16,
    random_seed=9,
    params_init=WeightInit.Uniform(0.01),
    is_inference=False,
  )
  root = _Root(
    child=child,
    dtype=tf.float64,
    random_seed=5,
    params_init=WeightInit.Gaussian(0.1),
    is_inference=True,
  )
  cp = root.child.params
  assert cp.dtype == tf.float16 and cp.random_seed == 9
  assert cp.is_inference is False and cp.params_init.method == 'uniform'
  assert np.abs(root.child.vars.w.numpy()).max() <= 0.01


def testParamsAreAFrozenCopy():
  p = _Parent.Params().Set(name='root', dtype=tf.float64)
  root = p.Instantiate()
  assert root.params is not p and root.p is root.params
  with pytest.raises(TypeError, match='frozen'):
    root.params.name = 'other'
  with pytest.raises(TypeError, match='frozen'):
    root.child.params.dim = 7
  assert root.params.child.IsFrozen()
  # The caller's Params are unaffected: still writable, and the child
  # template was neither named nor given the parent's dtype.
  assert not p.IsFrozen() and not p.child.IsFrozen()
  assert p.child.name == '' and p.child.dtype == tf.float32
  p.name = 'changed'
  assert root.params.name == 'root'


# -- Weights -------------------------------------------------------------------


def testThetaMirrorsChildren():
  root = _Root(stack_names=['', '', ''])
  theta = root.theta
  assert isinstance(theta, py_utils.NestedMap)
  assert set(theta) == {'b', 'child', 'stack'}
  assert type(theta.stack) is list and len(theta.stack) == 3  # pylint: disable=unidiomatic-typecheck
  assert all(
    isinstance(t, py_utils.NestedMap) and set(t) == {'w'} for t in theta.stack
  )
  assert theta.stack[1].w is root.stack[1].vars.w
  assert theta.child.w is root.child.w
  assert theta.b is root.b
  assert len(theta.Flatten()) == 5


def testFPropDtypeCastsTheta():
  def Build(layer):
    layer.CreateVariable('w', py_utils.WeightParams([2, 2]))
    layer.CreateVariable(
      'step', py_utils.WeightParams([], WeightInit.Constant(0), dtype=tf.int32)
    )
    layer.CreateChild('c', _Leaf.Params())

  layer = _Build(Build, fprop_dtype=tf.bfloat16)
  assert layer.fprop_dtype == tf.bfloat16
  assert layer.vars.w.dtype == tf.float32
  assert layer.theta.w.dtype == tf.bfloat16
  assert layer.theta.step.dtype == tf.int32  # Only floats are cast.
  assert layer.c.params.fprop_dtype == tf.bfloat16
  assert layer.c.theta.w.dtype == tf.bfloat16
  assert layer.theta.c.w.dtype == tf.bfloat16
  y = layer.c(tf.ones([1, 2], tf.bfloat16))
  assert y.dtype == tf.bfloat16
  np.testing.assert_allclose(
    y.numpy().astype(np.float32),
    np.ones([1, 2]) @ layer.c.vars.w.numpy(),
    rtol=2e-2,
    atol=2e-2,
  )
  # Without fprop_dtype theta holds the variables themselves.
  plain = _Leaf.Params().Set(name='plain').Instantiate()
  assert plain.fprop_dtype == tf.float32 and plain.theta.w is plain.vars.w


def testSameSeedSameValuesDifferentSeedDifferent():
  a, b = _Values(_Root(random_seed=3)), _Values(_Root(random_seed=3))
  c = _Values(_Root(random_seed=4))
  assert a.keys() == b.keys() == c.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  for k in ('root/child/w', 'root/stack_0/w'):
    assert not np.allclose(a[k], c[k])
  # Same shape, different names: different values.
  assert not np.allclose(a['root/child/w'], a['root/stack_0/w'])
  # The constant bias is the same for every seed.
  np.testing.assert_array_equal(c['root/b'], [0.5] * 3)


def testInitialValuesDoNotDependOnDevice():
  ref = _Values(_Root(random_seed=1))
  with tf.device('/CPU:1'):
    moved = _Root(random_seed=1, devices=['/CPU:2', '/CPU:3'])
  assert moved.vars.child.w.device.endswith('CPU:1')
  assert moved.vars.stack[0].w.device.endswith('CPU:2')
  assert moved.vars.stack[1].w.device.endswith('CPU:3')
  for k, v in _Values(moved).items():
    np.testing.assert_array_equal(v, ref[k])


def testCallIsFPropOfTheta():
  root = _Root()
  x = tf.constant(np.arange(8, dtype=np.float32).reshape([4, 2]))
  np.testing.assert_allclose(root(x).numpy(), root.FProp(root.theta, x).numpy())
  w = [root.child.vars.w] + [c.vars.w for c in root.stack]
  expected = sum(x.numpy() @ v.numpy() for v in w) + 0.5
  np.testing.assert_allclose(root(x).numpy(), expected, rtol=1e-5)


def testDoEval():
  layer = _Leaf.Params().Set(name='l').Instantiate()
  assert not layer.do_eval
  with py_utils.EvalMode():
    assert layer.do_eval
  assert not layer.do_eval
  infer = _Leaf.Params().Set(name='i', is_inference=True).Instantiate()
  assert infer.do_eval


class _Mode(base_layer.BaseLayer):
  def FProp(self, theta, x):
    return x + (1.0 if self.do_eval else 0.0)


def testCallTakesKerasTrainingArgument():
  layer = _Mode.Params().Set(name='m').Instantiate()
  assert layer(0.0) == 0.0
  assert layer(0.0, training=False) == 1.0
  assert layer(0.0, training=True) == 0.0
  with py_utils.EvalMode():
    assert layer(0.0) == 1.0
    assert layer(0.0, training=True) == 0.0
  assert not py_utils.IsEval()


# -- Shared variables ----------------------------------------------------------


def _TiedParams(shapes):
  def Build(layer):
    layer.CreateChildren(
      'towers', [_Leaf.Params().Set(dim=d, shared_name='tied') for d in shapes]
    )

  return _Custom.Params().Set(name='root', build_fn=Build)


def testSharedVariables():
  root = _TiedParams([3, 3]).Instantiate()
  t0, t1 = root.towers
  assert t0.vars.w is t1.vars.w
  assert list(root.VariablesByName()) == ['root/towers_0/w']
  assert len(root.vars.Flatten()) == 2
  assert base_layer.CountParams(_TiedParams([3, 3])) == 6
  # Another root does not share with this one.
  other = _TiedParams([3, 3]).Instantiate()
  assert other.towers[0].vars.w is not t0.vars.w


def testSharedVariableShapeMismatchError():
  with pytest.raises(
    ValueError,
    match=r"root/towers_1/w shares 'tied' with "
    r'root/towers_0/w.*\[2, 4\].*\[2, 3\]',
  ):
    _TiedParams([3, 4]).Instantiate()


# -- Abstract and detached builds ----------------------------------------------


def testAbstractBuildCreatesNoVariables():
  with _CountVariableCreations() as created:
    with base_layer.AbstractBuild():
      assert base_layer.IsAbstract()
      root = _Root(dtype=tf.float64)
    assert not base_layer.IsAbstract()
  assert not created
  flat = root.vars.Flatten()
  assert len(flat) == 4
  assert all(isinstance(v, base_layer.AbstractVariable) for v in flat)
  assert not any(isinstance(v, tf.Variable) for v in flat)
  w = root.vars.child.w
  assert w.name == 'root/child/w' and w.shape == [2, 3]
  assert w.dtype == tf.float64 and w.trainable
  assert w.ToSpec() == tf.TensorSpec([2, 3], tf.float64, name='root/child/w')
  assert sorted(root.VariablesByName()) == [
    'root/b',
    'root/child/w',
    'root/stack_0/w',
    'root/stack_1/w',
  ]


def testCountParamsAllocatesNothing():
  p = _Parent.Params().Set(stack_names=['', '', ''])  # No name: allowed here.
  with _CountVariableCreations() as created:
    count = base_layer.CountParams(p)
  assert count == 3 + 4 * 6
  assert not created
  assert not base_layer.IsAbstract()
  assert p.name == ''  # The caller's Params are untouched.


def testDetachedBuild():
  temps = []

  def Build(layer):
    layer.CreateVariable('w', py_utils.WeightParams([1]))
    with base_layer.DetachedBuild():
      temps.append(_TiedParams([3]).Set(name='tmp').Instantiate())
    layer.CreateChild('c', _Leaf.Params().Set(shared_name='tied'))

  root = _Build(Build)
  (tmp,) = temps
  assert tmp.parent is None and tmp.path == 'tmp'
  assert tmp.towers[0].path == 'tmp/towers_0'
  assert set(root.children) == {'c'}
  assert sorted(root.VariablesByName()) == ['root/c/w', 'root/w']
  # The parent's construction goes on after the detached build.
  assert root.c.parent is root
  # No sharing with the detached layer.
  assert root.c.vars.w is not tmp.towers[0].vars.w


def testGetattrErrorSuggestsCloseName():
  root = _Root()
  assert root.child is root.children.child and root.b is root.vars.b
  with pytest.raises(
    AttributeError,
    match=r"'root' has no attribute, child "
    r"or variable 'chlid'.*Did you mean 'child'\?",
  ):
    _ = root.chlid
  with pytest.raises(AttributeError) as e:
    _ = root.zzzzz
  assert 'Did you mean' not in str(e.value)


def testVariableNamesIgnoreEnclosingNameScope():
  with tf.name_scope('outer'):
    layer = _Leaf.Params().Set(name='l').Instantiate()
  assert list(layer.VariablesByName()) == ['l/w']


# -- FPropMeta -----------------------------------------------------------------


def testDefaultFPropMetaIsTraced():
  p = _Leaf.Params().Set(name='leaf', dim=4)
  with _CountVariableCreations() as created:
    meta = _Leaf.FPropMeta(p, tf.TensorShape([5, 2]))
  assert not created
  assert meta.flops == 2 * 5 * 2 * 4
  assert meta.out_shapes == (tf.TensorShape([5, 4]),)
  # Works without a name, and composes through children.
  meta = _Parent.FPropMeta(_Parent.Params(), [5, 2])
  assert meta.out_shapes == (tf.TensorShape([5, 3]),)
  # 3 matmuls [5,2]x[2,3], plus 3 adds of [5,3].
  assert meta.flops == 3 * (2 * 5 * 2 * 3) + 3 * 15


def testChildrenWithoutDevicesKeepTheEnclosingDeviceScope():
  p = layers.SequentialLayer.Params().Set(
    name='seq',
    sub=[layers.FCLayer.Params().Set(name='fc', input_dim=2, output_dim=2)],
  )
  with tf.device('/device:CPU:1'):
    seq = p.Instantiate()
  for v in seq.variables:
    assert v.device.endswith('CPU:1'), v.device
