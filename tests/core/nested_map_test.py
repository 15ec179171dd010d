"""Tests of lingvo_gpipe.core.nested_map."""

import collections
import copy

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core.nested_map import NestedMap

Pair = collections.namedtuple('Pair', ['first', 'second'])


def _Sample():
  """A map whose insertion order differs from its sorted order."""
  return NestedMap(
    z=1,
    a=NestedMap(y=2, b=[3, NestedMap(k=4), (5, 6)]),
    m={'q': 7, 'c': 8},
    n=Pair(first=9, second=10),
  )


# -- Attribute access ----------------------------------------------------------


def testAttributeGetSetDel():
  m = NestedMap(x=1)
  assert m.x == 1 and m['x'] == 1
  m.y = 2
  assert m['y'] == 2 and set(m) == {'x', 'y'}
  m['w'] = 3
  assert m.w == 3
  del m.x
  assert 'x' not in m
  with pytest.raises(AttributeError, match=r"no key 'x'"):
    del m.x


def testMissingAttributeListsKeys():
  m = NestedMap(alpha=1, beta=2)
  with pytest.raises(AttributeError, match=r"no key 'gamma'.*alpha, beta"):
    _ = m.gamma
  # hasattr and getattr with a default rely on AttributeError, not KeyError.
  assert not hasattr(m, 'gamma')
  assert getattr(m, 'gamma', 'dflt') == 'dflt'


def testIsADictWithoutInstanceDict():
  m = NestedMap(a=1)
  assert isinstance(m, dict)
  assert not hasattr(m, '__dict__')
  m.b = 2
  assert dict(m) == {'a': 1, 'b': 2}


@pytest.mark.parametrize('key', ['1abc', 'a.b', 'a-b', 'a b', '', 'a[0]'])
def testNonIdentifierKeysRejected(key):
  with pytest.raises(ValueError, match='Python identifiers'):
    NestedMap({key: 1})
  m = NestedMap()
  with pytest.raises(ValueError, match='Invalid NestedMap key'):
    m[key] = 1
  assert not m


def testNonStringKeyRejected():
  with pytest.raises(ValueError, match='Invalid NestedMap key 3'):
    NestedMap({3: 'x'})


@pytest.mark.parametrize(
  'key', ['keys', 'items', 'values', 'get', 'update', 'pop', 'copy']
)
def testKeysShadowingDictMethodsRejected(key):
  with pytest.raises(ValueError, match=f'shadows the dict method "{key}"'):
    NestedMap(**{key: 1})
  m = NestedMap()
  with pytest.raises(ValueError, match='shadows the dict method'):
    setattr(m, key, 1)
  with pytest.raises(ValueError, match='shadows the dict method'):
    m[key] = 1
  assert not m
  # The method itself is still reachable.
  assert callable(getattr(m, key))


def testUpdateRejectsInvalidKeys():
  m = NestedMap(a=1)
  with pytest.raises(ValueError, match='Invalid NestedMap key'):
    m.update({'a-b': 2})
  assert 'a-b' not in m


def testCopyStaysNestedMapAndIsShallow():
  inner = NestedMap(v=1)
  m = NestedMap(inner=inner)
  c = m.copy()
  assert isinstance(c, NestedMap) and c is not m
  assert c.inner is inner
  c.extra = 2
  assert 'extra' not in m


def testCopyModuleDeepcopyCopiesLeaves():
  m = NestedMap(a=NestedMap(l=[1, 2]))
  c = copy.deepcopy(m)
  assert isinstance(c, NestedMap) and isinstance(c.a, NestedMap)
  c.a.l.append(3)
  assert m.a.l == [1, 2]


# -- Flatten / Pack ------------------------------------------------------------


def testFlattenOrderMatchesTfNest():
  m = _Sample()
  assert m.Flatten() == tf.nest.flatten(m)
  assert m.Flatten() == [3, 4, 5, 6, 2, 8, 7, 9, 10, 1]


def testFlattenWithTensorsMatchesTfNest():
  m = NestedMap(
    b=tf.constant(1.0), a=[tf.constant(2.0), None], c=NestedMap(), d=[]
  )
  flat = m.Flatten()
  expected = tf.nest.flatten(m)
  assert len(flat) == len(expected) == 3
  for x, y in zip(flat, expected):
    assert x is y


def testFlattenItemsKeys():
  keys = [k for k, _ in _Sample().FlattenItems()]
  assert keys == [
    'a.b[0]',
    'a.b[1].k',
    'a.b[2][0]',
    'a.b[2][1]',
    'a.y',
    'm.c',
    'm.q',
    'n[0]',
    'n[1]',
    'z',
  ]
  values = [v for _, v in _Sample().FlattenItems()]
  assert values == _Sample().Flatten()


def testPackRoundTrip():
  m = _Sample()
  flat = m.Flatten()
  packed = m.Pack([x * 10 for x in flat])
  assert packed.Flatten() == [x * 10 for x in flat]
  assert isinstance(packed, NestedMap)
  assert isinstance(packed.a, NestedMap)
  assert isinstance(packed.a.b, list) and isinstance(packed.a.b[2], tuple)
  assert isinstance(packed.a.b[1], NestedMap)
  assert type(packed.m) is dict  # pylint: disable=unidiomatic-typecheck
  assert isinstance(packed.n, Pair) and packed.n.second == 100
  assert packed.z == 10 and packed.m['q'] == 70
  # Agrees with tf.nest.
  assert tf.nest.flatten(tf.nest.pack_sequence_as(m, flat)) == flat
  # The original is untouched.
  assert m.Flatten() == flat


def testPackTooFewValues():
  m = NestedMap(a=1, b=[2, 3])
  with pytest.raises(ValueError, match=r'fewer values.*\(3\)'):
    m.Pack([1, 2])


def testPackTooManyValues():
  m = NestedMap(a=1, b=[2, 3])
  with pytest.raises(ValueError, match='has 5 values but the structure has 3'):
    m.Pack([1, 2, 3, 4, 5])


def testTransform():
  m = NestedMap(a=1, b=NestedMap(c=[2, 3]))
  out = m.Transform(lambda x: x + 100)
  assert out == NestedMap(a=101, b=NestedMap(c=[102, 103]))
  assert isinstance(out.b, NestedMap)
  assert m.a == 1


def testTransformWithKey():
  m = NestedMap(a=1, b=NestedMap(c=[2, 3]))
  out = m.TransformWithKey(lambda k, v: f'{k}={v}')
  assert out == NestedMap(a='a=1', b=NestedMap(c=['b.c[0]=2', 'b.c[1]=3']))


# -- Dotted keys ---------------------------------------------------------------


def testGetItemDottedAndListIndex():
  m = NestedMap(a=NestedMap(b=1, l=[NestedMap(c=5), 6]))
  assert m.GetItem('a.b') == 1
  assert m.GetItem('a.l.0.c') == 5
  assert m.GetItem('a.l.1') == 6
  assert m.GetItem('a') is m.a
  with pytest.raises(KeyError):
    m.GetItem('a.zz')


def testGetItemRoundTripsFlattenItemsWithoutLists():
  m = NestedMap(x=NestedMap(y=NestedMap(z=1), w=2), v=3)
  for k, v in m.FlattenItems():
    assert m.GetItem(k) == v


def testGetWithDefault():
  m = NestedMap(a=NestedMap(b=1, l=[1]))
  assert m.Get('a.b') == 1
  assert m.Get('a.c') is None
  assert m.Get('a.c', 7) == 7
  assert m.Get('a.l.5', 'x') == 'x'  # IndexError
  assert m.Get('a.l.q', 'x') == 'x'  # ValueError (not an int)
  assert m.Get('a.b.c', 'x') == 'x'  # TypeError (int is not a map)


def testSetDottedCreatesNestedMaps():
  m = NestedMap()
  assert m.Set('a.b.c', 1) is m
  assert isinstance(m.a, NestedMap) and isinstance(m.a.b, NestedMap)
  assert m.a.b.c == 1
  m.Set('a.d', 2)
  assert m.a.d == 2 and m.a.b.c == 1
  m.Set('e', 3)
  assert m.e == 3


def testSetThroughLeafOrInvalidKeyFails():
  m = NestedMap(a=1)
  with pytest.raises(ValueError, match="'a' is not a NestedMap"):
    m.Set('a.b', 2)
  with pytest.raises(ValueError, match='shadows the dict method'):
    m.Set('x.keys', 2)


# -- Structure checks, filtering, printing -------------------------------------


def testIsCompatible():
  m = NestedMap(a=1, b=NestedMap(c=[1, 2]))
  assert m.IsCompatible(NestedMap(a='x', b=NestedMap(c=['y', 'z'])))
  assert m.IsCompatible({'b': {'c': [0, 0]}, 'a': 0})
  assert not m.IsCompatible(NestedMap(a=1, b=NestedMap(c=[1])))
  assert not m.IsCompatible(NestedMap(a=1, b=NestedMap(d=[1, 2])))
  assert not m.IsCompatible(NestedMap(a=1))
  assert not m.IsCompatible(NestedMap(a=NestedMap(x=1), b=NestedMap(c=[1, 2])))
  assert not m.IsCompatible([1, 2, 3])


def testFilter():
  m = NestedMap(a=1, b=NestedMap(c=2, d=3), e=NestedMap(f=4))
  out = m.Filter(lambda v: v % 2 == 1)
  assert out == NestedMap(a=1, b=NestedMap(d=3))
  assert isinstance(out.b, NestedMap)
  assert 'e' not in out  # Emptied sub-maps are dropped.


def testFilterKeyVal():
  m = NestedMap(a=1, b=NestedMap(c=2, d=3))
  out = m.FilterKeyVal(lambda k, v: k.startswith('b.') and v > 2)
  assert out == NestedMap(b=NestedMap(d=3))


def testFilterRejectsLists():
  m = NestedMap(a=[1, 2])
  with pytest.raises(ValueError, match='lists'):
    m.Filter(lambda v: True)


def testDebugString():
  m = NestedMap(bb=2, a=NestedMap(c=1), l=[3])
  assert m.DebugString() == 'a.c   1\nbb    2\nl[0]  3'
  assert NestedMap().DebugString() == ''


def testRepr():
  assert repr(NestedMap(a=1)) == "NestedMap({'a': 1})"


def testDeepCopyIsStructurallyIndependent():
  leaf = np.zeros([2])
  m = NestedMap(a=NestedMap(b=leaf), l=[1, NestedMap(c=2)])
  c = m.DeepCopy()
  assert c == m and c.Flatten()[0] is leaf  # leaves shared
  assert c.a is not m.a and c.l is not m.l and c.l[1] is not m.l[1]
  c.a.b = 'changed'
  c.a.new = 1
  c.l[1].c = 'changed'
  c.l.append(5)
  assert m.a.b is leaf and 'new' not in m.a
  assert m.l == [1, NestedMap(c=2)]


# -- TensorFlow integration ----------------------------------------------------


def testTfNestMapStructureKeepsNestedMap():
  m = NestedMap(a=tf.constant(1.0), b=NestedMap(c=tf.constant([2.0, 3.0])))
  out = tf.nest.map_structure(lambda t: t * 2, m)
  assert isinstance(out, NestedMap) and isinstance(out.b, NestedMap)
  np.testing.assert_allclose(out.b.c.numpy(), [4.0, 6.0])
  assert float(out.a) == 2.0
  tf.nest.assert_same_structure(m, out)


def testTfFunctionArgumentAndReturnValue():
  seen_types = []

  @tf.function(autograph=False)
  def Fn(m):
    seen_types.append((type(m), type(m.sub)))
    return NestedMap(y=m.x * 2.0, sub=NestedMap(z=m.sub.a + 1.0))

  m = NestedMap(x=tf.constant([1.0, 2.0]), sub=NestedMap(a=tf.constant(3.0)))
  out = Fn(m)
  assert seen_types == [(NestedMap, NestedMap)]
  assert isinstance(out, NestedMap) and isinstance(out.sub, NestedMap)
  np.testing.assert_allclose(out.y.numpy(), [2.0, 4.0])
  assert float(out.sub.z) == 4.0
  # Same structure and specs: no retrace.
  Fn(NestedMap(x=tf.constant([5.0, 6.0]), sub=NestedMap(a=tf.constant(0.0))))
  assert len(seen_types) == 1
