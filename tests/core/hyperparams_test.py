"""Tests of lingvo_gpipe.core.hyperparams, with two-way Lingvo compatibility."""

import collections
import copy
import dataclasses
import enum
import os
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
from lingvo.core import (
  hyperparams as lingvo_hyperparams,
)  # Not skipped if missing.

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import params_container
from lingvo_gpipe.core import params_text


class Color(enum.Enum):
  RED = 1
  GREEN = 2


class Level(enum.IntEnum):
  LOW = 1
  HIGH = 2


Point = collections.namedtuple('Point', ['x', 'y'])


@dataclasses.dataclass
class Box:
  width: int = 1
  label: str = 'box'


class Widget:
  """A class configured by InstantiableParams."""

  def __init__(self, params, **kwargs):
    self.params = params
    self.kwargs = kwargs


class Gadget:
  """Another class, used as a param value."""


def MakeActivation(x):
  return x


def _Frozen(p):
  return p.Copy().Freeze()


def _TrainParams(lr=0.5):
  p = hyperparams.Params()
  p.Define('learning_rate', lr, 'Learning rate.')
  p.Define('steps', 10, 'Number of steps.')
  return p


def _ModelParams():
  p = hyperparams.Params()
  p.Define('name', 'model', 'Name.')
  p.Define('train', _TrainParams(), 'Training params.')
  return p


# ---- Define / Get / Set ------------------------------------------------------


def testDefineGetSet():
  p = hyperparams.Params()
  p.Define('dim', 8, 'Model dimension.')
  assert p.dim == 8 and p.Get('dim') == 8
  p.dim = 16
  assert p.dim == 16
  assert p.Set(dim=32) is p
  assert p.dim == 32
  assert p.GetDescription('dim') == 'Model dimension.'
  assert p.ParamIsSet('dim')


def testDottedSetGetAndDescription():
  p = _ModelParams()
  p.Set(**{'train.learning_rate': 0.1, 'name': 'm2'})
  assert p.train.learning_rate == 0.1 and p.Get('train.learning_rate') == 0.1
  assert p.name == 'm2'
  assert p.GetDescription('train.steps') == 'Number of steps.'


def testSubscriptedKeysReachParamsInContainers():
  p = hyperparams.Params()
  p.Define('layers', [_TrainParams(), _TrainParams()], 'List of params.')
  p.Define('by_name', {'enc': _TrainParams()}, 'Dict of params.')
  p.Define('pairs', [('dec', _TrainParams())], 'Named params.')
  p.Set(
    **{'layers[1].steps': 3, "by_name['enc'].steps": 4, 'pairs[dec].steps': 5}
  )
  assert [l.steps for l in p.layers] == [10, 3]
  assert p.by_name['enc'].steps == 4 and p.pairs[0][1].steps == 5
  assert p.Get('layers[1]') is p.layers[1]
  with pytest.raises(AttributeError, match=r'\[7\]'):
    p.Get('layers[7].steps')
  with pytest.raises(AttributeError, match='whole list'):
    p.Set(**{'layers[0]': _TrainParams()})
  with pytest.raises(AttributeError, match='Malformed'):
    p.Get('layers..steps')


@pytest.mark.parametrize('action', ['get', 'set', 'Get', 'Set'])
def testUnknownKeysSuggestClosest(action):
  p = _ModelParams()
  # Attribute access on p.train cannot know the 'train.' prefix; Get/Set can.
  expected = (
    "'learning_rate'" if action.islower() else r"'train\.learning_rate'"
  )
  with pytest.raises(AttributeError, match='did you mean ' + expected) as e:
    if action == 'get':
      _ = p.train.lerning_rate
    elif action == 'set':
      p.train.lerning_rate = 1.0
    elif action == 'Get':
      p.Get('train.lerning_rate')
    else:
      p.Set(**{'train.lerning_rate': 1.0})
  assert 'lerning_rate' in str(e.value)


def testUnknownKeyWithoutCloseMatchListsKeys():
  p = _ModelParams()
  with pytest.raises(
    AttributeError, match=r"known parameters: \['name', 'train'\]"
  ):
    _ = p.zzzzzz
  assert not hasattr(p, 'zzzzzz')


def testDescriptionRequired():
  p = hyperparams.Params()
  for bad in ['', '   ', None, 3]:
    with pytest.raises(ValueError, match='non-empty description'):
      p.Define('x', 1, bad)
  assert 'x' not in p


@pytest.mark.parametrize('name', ['_x', '1a', 'a-b', 'a.b', '', 'Set', 'Copy'])
def testInvalidNames(name):
  with pytest.raises(ValueError, match='Invalid parameter name'):
    hyperparams.Params().Define(name, 1, 'Doc.')


def testRedefineRaises():
  p = _TrainParams()
  with pytest.raises(AttributeError, match="'steps' is already defined"):
    p.Define('steps', 3, 'Again.')


def testDelete():
  p = _ModelParams()
  assert p.Delete('name', 'train.steps') is p
  assert (
    'name' not in p and 'train.steps' not in p and 'train.learning_rate' in p
  )
  with pytest.raises(
    AttributeError, match="did you mean 'train.learning_rate'"
  ):
    p.Delete('train.learning_rat')


def testIterLenContainsKeys():
  p = _ModelParams()
  assert list(p.IterParams()) == [('name', 'model'), ('train', p.train)]
  assert len(p) == 2 and p.GetKeys() == ['name', 'train']
  assert 'train' in p and 'train.steps' in p and 'nope' not in p and 3 not in p


# ---- Copy / Freeze / equality -----------------------------------------------


def testCopyIsDeepAndSharesUncopyables():
  lock = threading.Lock()
  p = _ModelParams()
  p.Define('items', [1, [2]], 'Nested list.')
  p.Define('cls', Gadget, 'A class.')
  p.Define('dtype', tf.bfloat16, 'A dtype.')
  p.Define('lock', lock, 'Not copyable.')
  q = p.Copy()
  assert q == p and q is not p
  q.train.steps = 99
  q.items[1].append(3)
  assert p.train.steps == 10 and p.items == [1, [2]]
  assert q.cls is Gadget and q.dtype is tf.bfloat16 and q.lock is lock
  assert copy.deepcopy(p) == p and copy.deepcopy(p).train is not p.train
  shallow = copy.copy(p)
  shallow.name = 'other'
  assert p.name == 'model' and shallow.train is p.train


def testFreezeBlocksAllWritesRecursively():
  p = _ModelParams()
  p.Define('stack', [_TrainParams()], 'Params in a list.')
  assert p.Freeze() is p
  assert (
    p.IsFrozen()
    and p.IsImmutable()
    and p.train.IsFrozen()
    and p.stack[0].IsFrozen()
  )
  writes = [
    lambda: setattr(p, 'name', 'x'),
    lambda: p.Set(name='x'),
    lambda: p.Define('other', 1, 'Doc.'),
    lambda: p.Delete('name'),
    lambda: p.FromText('name : "x"'),
    lambda: setattr(p.train, 'steps', 1),
    lambda: p.stack[0].Set(steps=1),
  ]
  for write in writes:
    with pytest.raises(TypeError, match=r'frozen.*\.Copy\(\)'):
      write()
  assert p.name == 'model' and p.train.steps == 10
  q = p.Copy()
  assert (
    not q.IsFrozen() and not q.train.IsFrozen() and not q.stack[0].IsFrozen()
  )
  q.train.steps = 1
  q.Define('other', 1, 'Doc.')
  assert q.train.steps == 1 and p.train.steps == 10


def testEquality():
  a, b = _ModelParams(), _ModelParams()
  assert a == b and not a != b  # noqa: SIM202  (tests __ne__)
  b.train.steps = 3
  assert a != b and not a == b  # noqa: SIM201  (tests __eq__)
  c = _ModelParams()
  c.Define('extra', 1, 'Doc.')
  assert a != c and a != 'not params'
  d = hyperparams.Params()
  d.Define('name', 'model', 'A different description.')
  d.Define('train', _TrainParams(), 'Also different.')
  assert a == d  # Descriptions do not take part in equality.
  a.Define('arr', np.arange(3), 'Array.')
  d.Define('arr', np.arange(3), 'Array.')
  assert a == d


def testPickleRoundTrip():
  p = hyperparams.InstantiableParams(Widget)
  p.Define('sub', _TrainParams(), 'Nested.')
  q = pickle.loads(pickle.dumps(p))
  assert q == p and type(q) is hyperparams.InstantiableParams


# ---- InstantiableParams ------------------------------------------------------


def testInstantiate():
  p = hyperparams.InstantiableParams(Widget)
  p.Define('size', 3, 'Size.')
  w = p.Instantiate(extra=1)
  assert isinstance(w, Widget) and w.params is p and w.kwargs == {'extra': 1}
  q = p.Copy()
  assert (
    type(q) is hyperparams.InstantiableParams and q.cls is Widget and q == p
  )
  assert isinstance(
    hyperparams.InstantiableParams[Widget](Widget).Instantiate(), Widget
  )
  with pytest.raises(ValueError, match='cls is None'):
    hyperparams.InstantiableParams(None).Instantiate()


def testCopyFieldsToAndMerge():
  src = hyperparams.InstantiableParams(Widget)
  src.Define('a', 1, 'A.')
  src.Define('sub', _TrainParams(0.25), 'Sub.')
  src.Define('only_src', 2, 'Only here.')
  dst = hyperparams.InstantiableParams(Gadget)
  dst.Define('a', 0, 'A.')
  dst.Define('sub', _TrainParams(), 'Sub.')
  with pytest.raises(AttributeError, match='only_src'):
    hyperparams.CopyFieldsTo(src, dst.Copy())
  out = hyperparams.CopyFieldsTo(src, dst, skip='a', ignore_unknown_keys=True)
  assert out is dst and dst.a == 0 and dst.cls is Gadget
  assert dst.sub == src.sub and dst.sub is not src.sub
  dst.MergeCommonKeysFrom(src)
  assert dst.a == 1


def testVisitKeys():
  p = _ModelParams()
  p.Define('lst', [_TrainParams()], 'List.')
  p.Define('dct', {'k': 1}, 'Dict.')
  seen = []
  p.Visit(lambda k, v: seen.append(k))
  assert sorted(seen) == [
    "dct['k']",
    'lst[0].learning_rate',
    'lst[0].steps',
    'name',
    'train.learning_rate',
    'train.steps',
  ]


# ---- Text format -------------------------------------------------------------


def testToTextAndStrFormat():
  p = _ModelParams()
  p.Define('dtype', tf.float32, 'Dtype.')
  p.Define('opt', None, 'Optional.')
  p.Define('shape', [2, 'a'], 'List.')
  assert p.ToText() == (
    'dtype : float32\n'
    "name : 'model'\n"
    'opt : NoneType\n'
    "shape : [2, 'a']\n"
    'train.learning_rate : 0.5\n'
    'train.steps : 10\n'
  )
  assert str(p) == (
    '{\n  dtype: <dtype: \'float32\'>\n  name: "model"\n  opt: None\n'
    "  shape: [2, 'a']\n  train: {\n    learning_rate: 0.5\n    steps: 10\n"
    '  }\n}'
  )
  assert p.ToText(separator='=').splitlines()[0] == 'dtype = float32'


def _Sub(lr, steps):
  p = _TrainParams(lr)
  p.steps = steps
  return p


# (template value the loading Params holds, value whose text is loaded).
ROUND_TRIP_CASES = {
  'int': (0, -12345678901234567890),
  'float': (0.0, 1.25e-07),
  'float_inf': (0.0, float('inf')),
  'str_plain': ('', 'hello world'),
  'str_quotes': ('', 'it\'s a "test"'),
  'str_more_double': ('', 'a"b"c\'d'),
  'str_backslashes': ('', 'C:\\path\\to\\file\\'),
  'str_newlines': ('', 'line one\n  line two  \n\nline four\n'),
  'str_leading_newline': ('', '\nx'),
  'str_ends_with_escaped_quote': ('', '"x\''),
  'str_empty': ('x', ''),
  'str_list_like': ('', '[1, 2]'),
  'bool_true': (False, True),
  'bool_false': (True, False),
  'none_from_int': (3, None),
  'none_from_none': (None, None),
  'bool_into_none': (None, True),
  'list': ([], [1, 2.5, 'x', [True, None]]),
  'tuple': ((), (1, 'a')),
  'singleton_tuple': ((), (7,)),
  'dict': ({}, {'b': 'q"', 'a': [1, {'z': 2}]}),
  'dict_with_none': ({'k': None}, {'k': None}),
  'nested_params': (_Sub(0.0, 0), _Sub(0.125, 7)),
  'list_of_params': (
    [_Sub(0.0, 0), _Sub(0.0, 0)],
    [_Sub(1.5, 1), _Sub(2.5, 2)],
  ),
  'dict_of_params': ({'enc': _Sub(0.0, 0)}, {'enc': _Sub(3.5, 3)}),
  'pairs_of_params': ([('enc', _Sub(0.0, 0))], [('enc', _Sub(4.5, 4))]),
  'mixed_list_with_params': ([0, _Sub(0.0, 0)], [5, _Sub(5.5, 5)]),
  'class': (Gadget, Widget),
  'class_from_none': (None, Widget),
  'function': (MakeActivation, _TrainParams),
  'function_value': (Gadget, MakeActivation),
  'dtype_float32': (tf.int32, tf.float32),
  'dtype_bfloat16': (tf.float32, tf.bfloat16),
  'enum': (Color.RED, Color.GREEN),
  'int_enum': (Level.LOW, Level.HIGH),
  'list_with_encoded_items': (
    [tf.int32, None, Gadget, Color.RED],
    [tf.bfloat16, None, Widget, Color.GREEN],
  ),
  'namedtuple': (Point(0, ''), Point(3, 'y')),
  'dataclass': (Box(), Box(5, 'wide')),
  'ndarray': (np.zeros(3, np.float32), np.array([1.5, 2, 3], np.float32)),
}


@pytest.mark.parametrize('name', sorted(ROUND_TRIP_CASES))
def testRoundTrip(name):
  template, value = ROUND_TRIP_CASES[name]
  src = hyperparams.Params()
  src.Define('x', value, 'The value.')
  src.Define('y', 1, 'Another value.')
  dst = hyperparams.Params()
  dst.Define('x', copy.deepcopy(template), 'The value.')
  dst.Define('y', 2, 'Another value.')
  text = src.ToText()
  assert dst.FromText(text) is dst
  assert dst == src, (text, dst.x)
  assert dst.ToText() == text


def testFromTextCommentsBlankLinesAndBareStrings():
  p = _ModelParams()
  p.FromText(
    '# A comment.\n\n  train.steps : 4  \nname : bare words\n'
    'train.learning_rate:0.25\n'
  )
  assert (
    p.name == 'bare words'
    and p.train.steps == 4
    and p.train.learning_rate == 0.25
  )


def testFromTextAllowMissing():
  p = _ModelParams()
  p.FromText('nope : 1\ntrain.steps : 2\n', allow_missing=True)
  assert p.train.steps == 2


def testFromTextUnknownKeyNamesLineAndSuggestion():
  p = _ModelParams()
  with pytest.raises(
    AttributeError,
    match=r"Line 3: unknown parameter 'train\.lerning_rate'; "
    r"did you mean 'train\.learning_rate'\?",
  ):
    p.FromText("name : 'x'\n\ntrain.lerning_rate : 0.1\n")
  assert p.name == 'model'  # Nothing applied.


@pytest.mark.parametrize(
  'text,pattern',
  [
    ('train.steps : 1.5', r"Line 1: .*'1\.5'.*'train\.steps' as int"),
    (
      'train.learning_rate : fast',
      r"Line 1: .*'fast'.*'train\.learning_rate' as float",
    ),
    ('\nflag : maybe', r"Line 2: .*'maybe'.*'flag' as bool"),
    ('color : Color.BLUE', r"Line 1: .*'color' as Color.*Color\.RED"),
    ('cls : type/no_such_module_xyz/Foo', r"Line 1: .*'cls' as type"),
    ('dtype : float33', r"Line 1: .*'dtype' as DType"),
    ('items : [1, 2', r"Line 1: .*'items' as list"),
    ('name : just text\nno colon here', r'Line 2: expected "<key> : <value>"'),
    (
      "name : 'unterminated\nstill going",
      r"Line 1: .*'name' is missing its closing ' quote",
    ),
  ],
)
def testFromTextBadValues(text, pattern):
  p = _ModelParams()
  p.Define('flag', False, 'A bool.')
  p.Define('color', Color.RED, 'An enum.')
  p.Define('cls', Gadget, 'A class.')
  p.Define('dtype', tf.float32, 'A dtype.')
  p.Define('items', [], 'A list.')
  before = p.ToText()
  with pytest.raises(ValueError, match=pattern):
    p.FromText(text)
  assert p.ToText() == before


def testModuleDoesNotImportLingvo():
  code = (
    'import sys; import lingvo_gpipe.core.hyperparams; '
    "assert not [m for m in sys.modules if m.split('.')[0] == 'lingvo'], "
    "'lingvo'"
  )
  repo_root = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  subprocess.run([sys.executable, '-c', code], check=True, cwd=repo_root)


# ---- Two-way Lingvo compatibility --------------------------------------------


def _Build(module, variant):
  """Same keys and types in `module`'s Params; variants 0 and 1 differ."""
  v = variant

  def Sub(lr):
    s = module.Params()
    s.Define('learning_rate', lr + v, 'Learning rate.')
    s.Define('optimizer', ['sgd', 'adam'][v], 'Optimizer name.')
    return s

  p = module.InstantiableParams([Widget, Gadget][v])
  values = {
    'int': [3, -7][v],
    'float': [0.5, 1e-05][v],
    'str': ['plain', 'it\'s "quoted"\nand multi-line\\'][v],
    'bool': [True, False][v],
    'none': [None, None][v],
    'list': [[1, 'a'], [2.5, 'b', [False, True]]][v],
    'empty_list': [],
    'tuple': [(1,), (2, 'x')][v],
    'dict': [{'b': 1, 'a': 'x'}, {'b': 2, 'a': 'y"z', 'c': [1]}][v],
    'empty_dict': {},
    'nested': Sub(0.1),
    'params_list': [Sub(0.2), Sub(0.3)],
    'params_dict': {'enc': Sub(0.4), 'dec': Sub(0.5)},
    'class': [Gadget, Widget][v],
    'function': [MakeActivation, _Build][v],
    'dtype': [tf.float32, tf.bfloat16][v],
    'dtype_list': [[tf.float32], [tf.int64]][v],
    'enum': [Color.RED, Color.GREEN][v],
    'namedtuple': [Point(1, 'a'), Point(2, 'b')][v],
    'dataclass': [Box(), Box(3, 'c')][v],
  }
  for key, value in values.items():
    p.Define(key, value, f'The {key} value.')
  return p


# Values Lingvo writes but cannot read back itself; ours reads them.
def _BuildLingvoWriteOnly(module, variant):
  v = variant
  sub = module.Params()
  sub.Define('steps', [1, 2][v], 'Steps.')
  p = module.Params()
  values = {
    'int_enum': [Level.LOW, Level.HIGH][v],
    'enum_list': [[Color.RED], [Color.GREEN]][v],
    'dict_none': [{'k': 1}, {'k': None}][v],
    'list_none': [[1], [None, 2]][v],
    'pairs': [('enc', sub.Copy())],
    'mixed': [0, sub.Copy()],
    'str_escaped_end': ['x', '"ab\''][v],
  }
  for key, value in values.items():
    p.Define(key, value, f'The {key} value.')
  return p


@pytest.mark.parametrize('builder', [_Build, _BuildLingvoWriteOnly])
@pytest.mark.parametrize('variant', [0, 1])
def testLingvoWritesTheSameText(builder, variant):
  ours = builder(hyperparams, variant)
  theirs = builder(lingvo_hyperparams, variant)
  assert ours.ToText() == theirs.ToText()
  assert str(ours) == str(theirs)


@pytest.mark.parametrize('builder', [_Build, _BuildLingvoWriteOnly])
def testLingvoTextLoadsIntoOurs(builder):
  theirs_text = builder(lingvo_hyperparams, 1).ToText()
  ours = builder(hyperparams, 0)
  ours.FromText(theirs_text)
  assert ours == builder(hyperparams, 1)
  assert ours.ToText() == theirs_text


def testOurTextLoadsIntoLingvo():
  ours_text = _Build(hyperparams, 1).ToText()
  theirs = _Build(lingvo_hyperparams, 0)
  theirs.FromText(ours_text)
  expected = _Build(lingvo_hyperparams, 1)
  assert theirs.ToText() == expected.ToText() == ours_text
  # Lingvo reads list elements by ast.literal_eval, so dtypes inside lists stay
  # strings there; every other value compares equal.
  assert theirs.dtype_list == ['int64']
  theirs.dtype_list = expected.dtype_list
  assert theirs == expected


def testHyperparamsExportsTheSplitModules():
  assert hyperparams.__all__ == ['CopyFieldsTo', 'InstantiableParams', 'Params']
  assert hyperparams.CopyFieldsTo is params_container.CopyFieldsTo
  p = hyperparams.InstantiableParams(dict)
  p.Define('size', 3, 'A size.')
  assert isinstance(p, hyperparams.Params)
  assert isinstance(p, params_container.ParamsContainer)
  assert (
    p.ToText()
    == params_text.ToText(p)
    == 'cls : type/builtins/dict\n' + ('size : 3\n')
  )
  q = p.Copy()
  params_text.FromText(q, 'size : 5')
  assert q.size == 5 and p.size == 3
  with pytest.raises(TypeError, match='frozen'):
    p.Freeze().FromText('size : 5')
