"""The Params container: definition, access by dotted keys, copy, freeze, visit.

`ParamsContainer` is the part of `hyperparams.Params` that does not know
Lingvo's text format; `hyperparams.Params` adds `ToText()`/`FromText()`
(written and read by `params_text`). Users import `hyperparams`, which
re-exports `CopyFieldsTo`. The public helpers below (`IsRecord`, `Fields`,
...) are shared with `params_text`.
"""

import ast
import copy
import dataclasses
import difflib
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, Self, TypeVar

import numpy as np

__all__ = ['CopyFieldsTo', 'ParamsContainer']


def QuoteString(s: str) -> str:
  """Quotes `s` with whichever quote char needs fewer escapes (ties: ')."""
  delim = "'" if s.count("'") <= s.count('"') else '"'
  body = s.replace('\\', '\\\\').replace(delim, '\\' + delim)
  return delim + body + delim


def IsNamedTuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, '_fields')


def IsRecord(x: Any) -> bool:
  """True for namedtuple and dataclass instances."""
  return IsNamedTuple(x) or (
    dataclasses.is_dataclass(x) and not isinstance(x, type)
  )


def Fields(x: Any) -> dict[str, Any]:
  """Field name -> value of a namedtuple or dataclass instance."""
  if IsNamedTuple(x):
    return dict(x._asdict())
  if hasattr(x, '__dict__'):
    return dict(vars(x))
  return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


def IsPairList(x: Any) -> bool:
  """True for lists/tuples of (str, Params) pairs (including empty ones)."""
  return isinstance(x, (list, tuple)) and all(
    isinstance(e, tuple)
    and len(e) == 2
    and isinstance(e[0], str)
    and isinstance(e[1], ParamsContainer)
    for e in x
  )


def IsDType(x: Any) -> bool:  # TensorFlow is not imported just to check this.
  dtypes = getattr(sys.modules.get('tensorflow'), 'dtypes', None)
  return dtypes is not None and isinstance(x, dtypes.DType)


def IsProto(x: Any) -> bool:
  message = sys.modules.get('google.protobuf.message')
  return message is not None and isinstance(x, message.Message)


def ModuleName(obj: Any) -> str:
  module = inspect.getmodule(obj)
  return module.__name__ if module is not None else obj.__module__


def _ValuesEqual(a: Any, b: Any) -> bool:
  if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
    return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
  return bool(a == b)


class KeySortedDict(dict):
  """A dict whose repr sorts items by key; str values use QuoteString."""

  def __repr__(self) -> str:
    return (
      '{'
      + ', '.join(
        f'{k!r}: ' + (QuoteString(v) if isinstance(v, str) else repr(v))
        for k, v in sorted(self.items(), key=lambda kv: kv[0])
      )
      + '}'
    )


def _DebugForm(val: Any) -> Any:
  """Maps `val` to an object whose str() is its value text in str(Params)."""
  if isinstance(val, (ParamsContainer, dict)):
    items = (
      val.IterParams() if isinstance(val, ParamsContainer) else val.items()
    )
    return KeySortedDict((k, _DebugForm(v)) for k, v in items)
  if isinstance(val, (list, tuple)) and not IsNamedTuple(val):
    return type(val)(_DebugForm(v) for v in val)
  if hasattr(val, 'Repr'):
    return val.Repr()
  return val


def _CopyValue(val: Any, memo: dict[int, Any]) -> Any:
  """Deep-copies nested Params/containers; shares what cannot be copied."""
  if isinstance(val, ParamsContainer):
    return val.Copy()
  if type(val) in (list, tuple):
    return type(val)(_CopyValue(v, memo) for v in val)
  if type(val) is dict:  # pylint: disable=unidiomatic-typecheck
    return {k: _CopyValue(v, memo) for k, v in val.items()}
  if isinstance(val, (type, types.FunctionType, types.ModuleType)) or type(
    val
  ).__module__.startswith('tensorflow'):
    return val  # Classes, functions, tensors, dtypes, variables: shared.
  try:
    return copy.deepcopy(val, memo)
  except Exception:  # noqa: BLE001  # pylint: disable=broad-except
    return val  # Not copyable (locks, generators, ...): share the reference.


def _NestedParams(val: Any) -> Iterator['ParamsContainer']:
  """Yields the Params in `val`, looking through dicts, lists and tuples."""
  if isinstance(val, ParamsContainer):
    yield val
  elif isinstance(val, (dict, list, tuple)):
    for v in val.values() if isinstance(val, dict) else val:
      yield from _NestedParams(v)


_KEY_TOKEN_RE = re.compile(
  r"""(?P<dot>\.)?(?P<attr>[A-Za-z_]\w*)"""
  r"""|\[(?P<item>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\]]*)\]"""
)


def _SplitKey(key: str) -> list[tuple[str, str]]:
  """Splits 'a.b[0].c' into [('attr','a'), ('attr','b'), ('item','0'), ...]."""
  tokens, pos = [], 0
  while pos < len(key):
    m = _KEY_TOKEN_RE.match(key, pos)
    if m is None or (m.group('attr') and bool(m.group('dot')) != bool(tokens)):
      raise AttributeError(
        f'Malformed parameter key {key!r} (problem at character {pos}); '
        'use names '
        'joined by "." with optional [index] subscripts, e.g. "a.b[0].c".'
      )
    tokens.append(
      ('attr', m.group('attr'))
      if m.group('attr')
      else ('item', m.group('item'))
    )
    pos = m.end()
  if not tokens or tokens[0][0] != 'attr':
    raise AttributeError(
      f'Malformed parameter key {key!r}; it must start with a name.'
    )
  return tokens


def Subscript(container: Any, raw: str, where: str) -> Any:
  """Looks up `container[raw]` the way Visit() names container elements."""
  try:
    if isinstance(container, dict):
      try:
        key = ast.literal_eval(raw)
      except (ValueError, SyntaxError):
        key = raw
      return container[key]
    if IsRecord(container):
      return getattr(container, raw)
    if IsPairList(container) and container:
      return next(v for k, v in container if k == raw)
    return container[int(raw)]
  except (
    KeyError,
    IndexError,
    ValueError,
    TypeError,
    AttributeError,
    StopIteration,
  ):
    raise AttributeError(
      f'Cannot resolve [{raw}] in {where!r}: it holds a '
      f'{type(container).__name__} '
      'without such an element; check the key against ToText() output.'
    ) from None


class _Param:
  """A single parameter: its value and description."""

  __slots__ = ('description', 'value')

  def __init__(self, value: Any, description: str) -> None:
    self.value = value
    self.description = description


ParamsT = TypeVar('ParamsT', bound='ParamsContainer')


class ParamsContainer:
  """A set of named, documented parameters with attribute-style access.

  Use `Define()` to declare a parameter, then read and write it as an
  attribute (`p.name`, `p.name = value`) or with dotted keys through nested
  Params (`p.Get('a.b')`, `p.Set(**{'a.b': 1})`). Use `hyperparams.Params`,
  which adds Lingvo's text format.
  """

  def __init__(self) -> None:
    self.__dict__['_params'] = {}  # name -> _Param, in definition order.
    self.__dict__['_frozen'] = False

  def __getattr__(self, name: str) -> Any:
    if '_params' not in self.__dict__ or name.startswith('__'):
      raise AttributeError(
        name
      )  # Unpickling, or a protocol probe like __deepcopy__.
    return self._Lookup(name, '').value

  def __setattr__(self, name: str, value: Any) -> None:
    self._CheckWritable(f'set {name!r}')
    self._Lookup(name, '').value = value

  def __contains__(self, name: Any) -> bool:
    try:
      self.Get(name)
      return True
    except (AttributeError, TypeError):
      return False

  def __len__(self) -> int:
    return len(self._params)

  def __eq__(self, other: object) -> bool:
    if (
      not isinstance(other, ParamsContainer)
      or self._params.keys() != other._params.keys()
    ):
      return False
    return all(
      _ValuesEqual(p.value, other._params[k].value)
      for k, p in self._params.items()
    )

  def __ne__(self, other: object) -> bool:
    return not self == other

  __hash__ = None  # Mutable, so unhashable (as in Lingvo).

  def __str__(self) -> str:
    return self._DebugString(0)

  def __repr__(self) -> str:
    return f'{type(self).__name__}{self._DebugString(0)}'

  def __copy__(self) -> Self:
    res = self._NewEmpty()
    res._params.update(
      {k: _Param(p.value, p.description) for k, p in self._params.items()}
    )
    return res

  def __deepcopy__(self, memo: dict[int, Any]) -> Self:
    return self.Copy()

  def _CheckWritable(self, action: str) -> None:
    if self._frozen:
      raise TypeError(
        f'Cannot {action}: this Params is frozen (immutable). Call .Copy() '
        'to get a writable copy.'
      )

  def _Lookup(self, name: str, prefix: str) -> _Param:
    """Returns the _Param `name`; `prefix` is its parent's key, for errors."""
    if name in self._params:
      return self._params[name]
    close = difflib.get_close_matches(name, list(self._params), n=1)
    hint = (
      f"; did you mean '{prefix}{close[0]}'?"
      if close
      else f'; known parameters: {sorted(self._params)}'
    )
    raise AttributeError(
      f"Unknown parameter '{prefix}{name}'{hint} "
      '(use Define() to add a new parameter).'
    )

  def _Resolve(self, key: str, action: str = '') -> tuple[Any, str, str]:
    """Walks a dotted key; returns (container, kind, text) of its last part.

    If `action` is given, the last part must be a parameter name ('attr').
    """
    tokens = _SplitKey(key)
    cur: Any = self
    prefix = ''  # The part of `key` already walked.
    for i, (kind, text) in enumerate(tokens):
      if kind == 'attr':
        if not isinstance(cur, ParamsContainer):
          raise AttributeError(
            f'Cannot look up {text!r} in {key!r}: {prefix!r} holds a '
            f'{type(cur).__name__}, not a Params.'
          )
        param = cur._Lookup(text, prefix + '.' if prefix else '')
      elif action and i == len(tokens) - 1:
        raise AttributeError(
          f'Cannot {action} {key!r}: only named parameters of a Params '
          'can be; assign the whole list/dict/tuple instead.'
        )
      if i == len(tokens) - 1:
        return cur, kind, text
      cur = param.value if kind == 'attr' else Subscript(cur, text, prefix)
      prefix += (
        (('.' if prefix else '') + text) if kind == 'attr' else f'[{text}]'
      )

  def _NewEmpty(self) -> Self:
    res = object.__new__(type(self))
    res.__dict__.update(self.__dict__)
    res.__dict__['_params'] = {}
    res.__dict__['_frozen'] = False
    return res

  def _DebugString(self, depth: int) -> str:
    indent = '  ' * (depth + 1)
    lines = []
    for name, param in sorted(self._params.items()):
      value = param.value
      if isinstance(value, ParamsContainer):
        lines.append(f'{indent}{name}: {value._DebugString(depth + 1)}')
      elif isinstance(value, str):
        lines.append(f'{indent}{name}: "{value}"')
      else:
        lines.append(f'{indent}{name}: {_DebugForm(value)}')
    return '{\n' + '\n'.join(lines) + '\n' + '  ' * depth + '}'

  def Define(self, name: str, default_value: Any, description: str) -> None:
    """Defines a new parameter.

    Args:
      name: A Python identifier not starting with '_' and not already defined.
      default_value: The initial (and default) value; may be None.
      description: A non-empty string saying what the parameter controls.
    """
    self._CheckWritable(f'define {name!r}')
    if (
      not isinstance(name, str)
      or not name.isidentifier()
      or name.startswith('_')
    ):
      raise ValueError(
        f'Invalid parameter name {name!r}: use a Python identifier that does '
        'not start with "_", e.g. "learning_rate".'
      )
    if hasattr(type(self), name):
      raise ValueError(
        f'Invalid parameter name {name!r}: it clashes with the '
        f'{type(self).__name__}.{name} attribute; choose another name.'
      )
    if name in self._params:
      raise AttributeError(
        f'Parameter {name!r} is already defined; assign p.{name} = value '
        f'to change it, or Delete({name!r}) before redefining it.'
      )
    if not isinstance(description, str) or not description.strip():
      raise ValueError(
        f'Parameter {name!r} needs a non-empty description string, got '
        f'{description!r}; pass a short sentence saying what it controls.'
      )
    self._params[name] = _Param(default_value, description)

  def Set(self, **kwargs: Any) -> Self:
    """Sets parameters; dotted keys ('a.b', 'a.l[0].c') reach nested Params."""
    self._CheckWritable(f'set {sorted(kwargs)}')
    for key, value in kwargs.items():
      parent, _, name = self._Resolve(key, 'set')
      parent._CheckWritable(f'set {key!r}')
      parent._params[name].value = value
    return self

  def Get(self, name: str) -> Any:
    """Returns the value of a parameter; dotted/subscripted names allowed."""
    parent, kind, text = self._Resolve(name)
    return (
      parent._params[text].value
      if kind == 'attr'
      else Subscript(parent, text, name)
    )

  def GetDescription(self, name: str) -> str:
    """Returns the description of a (possibly dotted) parameter."""
    parent, _, text = self._Resolve(name, 'describe')
    return parent._params[text].description

  def ParamIsSet(self, key: str) -> bool:
    """True if the (possibly dotted) parameter `key` is not None."""
    return self.Get(key) is not None

  def Delete(self, *names: str) -> Self:
    """Deletes parameters; dotted names reach nested Params. Returns self."""
    self._CheckWritable(f'delete {list(names)}')
    for key in names:
      parent, _, name = self._Resolve(key, 'delete')
      parent._CheckWritable(f'delete {key!r}')
      del parent._params[name]
    return self

  def IterParams(self) -> Iterator[tuple[str, Any]]:
    """Yields (name, value) of the top-level parameters in definition order."""
    for name, param in self._params.items():
      yield name, param.value

  def GetKeys(self) -> list[str]:
    """Returns the top-level parameter names in definition order."""
    return list(self._params)

  def Copy(self) -> Self:
    """Returns a writable deep copy (same class; shares classes and tensors)."""
    res = self._NewEmpty()
    memo: dict[int, Any] = {}
    for name, param in self._params.items():
      res._params[name] = _Param(
        _CopyValue(param.value, memo), param.description
      )
    return res

  def Freeze(self) -> Self:
    """Makes this Params and all Params nested in it read-only. Returns self."""
    self.__dict__['_frozen'] = True
    for param in self._params.values():
      for nested in _NestedParams(param.value):
        nested.Freeze()
    return self

  def IsFrozen(self) -> bool:
    """Returns whether Freeze() was called on this Params (or a parent)."""
    return self._frozen

  IsImmutable = IsFrozen  # Lingvo's name.

  def MergeCommonKeysFrom(self, other: 'ParamsContainer') -> Self:
    """Copies values of keys that both `other` and self define."""
    return CopyFieldsTo(other, self, ignore_unknown_keys=True)

  def Visit(
    self,
    visit_fn: Callable[[str, Any], None],
    enter_fn: Callable[[str, Any], bool] | None = None,
    exit_fn: Callable[[str, Any], None] | None = None,
  ) -> None:
    """Walks nested Params, dicts, lists, tuples, namedtuples and dataclasses.

    Keys look like 'a.b' (Params), "a['k']" (dicts), 'a[0]' (lists/tuples) and
    'a[field]' (namedtuples, dataclasses, lists of (name, Params) pairs).

    Args:
      visit_fn: visit_fn(key, value) for leaves and containers not entered.
      enter_fn: enter_fn(key, container) -> whether to walk in (default: yes).
      exit_fn: exit_fn(key, container) after walking a container.
    """
    enter_fn = enter_fn or (lambda key, value: True)
    exit_fn = exit_fn or (lambda key, value: None)

    def _Children(key: str, val: Any) -> list[tuple[str, Any]] | None:
      if isinstance(val, ParamsContainer):
        return [(f'{key}.{k}' if key else k, v) for k, v in val.IterParams()]
      if isinstance(val, dict):
        return [(f"{key}['{k}']", v) for k, v in val.items()]
      if IsRecord(val):
        return [(f'{key}[{k}]', v) for k, v in Fields(val).items()]
      if IsPairList(val):
        return [(f'{key}[{k}]', v) for k, v in val]
      if isinstance(val, (list, tuple, range)):
        return [(f'{key}[{i}]', v) for i, v in enumerate(val)]
      return None

    def _Walk(key: str, val: Any) -> None:
      children = _Children(key, val)
      if children is None or not enter_fn(key, val):
        visit_fn(key, val)
        return
      for child_key, child in children:
        _Walk(child_key, child)
      exit_fn(key, val)

    _Walk('', self)


def CopyFieldsTo(
  from_p: ParamsContainer,
  to_p: ParamsT,
  skip: Any = None,
  ignore_unknown_keys: bool = False,
) -> ParamsT:
  """Copies values (nested Params deep) from from_p into to_p; returns to_p.

  `skip` is a name or list of names not to copy ('cls' is never copied). With
  `ignore_unknown_keys`, names to_p does not define are skipped, not errors.
  """
  skip_set = {skip} if isinstance(skip, str) else set(skip or ())
  skip_set.add('cls')
  for key, value in from_p.IterParams():
    if key in skip_set or (ignore_unknown_keys and key not in to_p.GetKeys()):
      continue
    to_p.Set(
      **{key: value.Copy() if isinstance(value, ParamsContainer) else value}
    )
  return to_p
