"""Lingvo's text format for Params: `ToText` writes it, `FromText` reads it.

`ToText(p)` writes byte-for-byte what `lingvo.core.hyperparams.Params.ToText()`
writes, and `FromText(p, text)` reads it back, typed by the current values of
`p`; `hyperparams.Params.ToText()`/`FromText()` call these. The format, and
where it deliberately differs from Lingvo, is described in `hyperparams`.
"""

import ast
import difflib
import enum
import importlib
import re
import types
from typing import Any

import numpy as np

from lingvo_gpipe.core.params_container import Fields
from lingvo_gpipe.core.params_container import IsDType
from lingvo_gpipe.core.params_container import IsPairList
from lingvo_gpipe.core.params_container import IsProto
from lingvo_gpipe.core.params_container import IsRecord
from lingvo_gpipe.core.params_container import KeySortedDict
from lingvo_gpipe.core.params_container import ModuleName
from lingvo_gpipe.core.params_container import ParamsContainer
from lingvo_gpipe.core.params_container import QuoteString

__all__ = ['FromText', 'ToText']

_QUOTES = ('"', "'")
_ENUM_REPR_RE = re.compile(r'<(\w+\.\w+): [^<>]*>')
_NONE_TEXT = ('NoneType', 'None')
_BOOL_TEXT = ('True', 'true', 'False', 'false')
_MISSING = object()  # Stands for "no old value" when reviving container items.


def ToText(params: ParamsContainer, separator: str = ':') -> str:
  """Returns sorted 'a.b.c : value' lines, exactly as Lingvo's ToText()."""
  lines: dict[str, str] = {}

  def _Leaf(key: str, val: Any) -> None:
    lines[key] = (
      QuoteString(val) if isinstance(val, str) else str(_TextForm(val))
    )

  params.Visit(_Leaf, enter_fn=_EnterForText)
  return ''.join(f'{k} {separator} {lines[k]}\n' for k in sorted(lines))


def FromText(
  params: ParamsContainer, text: str, allow_missing: bool = False
) -> None:
  """Sets values of `params` from ToText()-format text, all or nothing.

  Args:
    params: the Params to update; values are typed like its current values.
    text: 'key : value' lines; blank lines and '#' comments are ignored.
    allow_missing: If True, keys unknown to `params` are skipped.

  Raises:
    AttributeError: on an unknown key, naming the line.
    ValueError: on a bad line or value, naming the line. Nothing is changed.
  """
  updates = []
  for lineno, key, raw in _SplitTextLines(text):
    try:
      old = params.Get(key)
    except AttributeError as e:
      if allow_missing:
        continue
      keys = []
      params.Visit(
        lambda k, v, keys=keys: keys.append(k), enter_fn=_EnterForText
      )
      close = difflib.get_close_matches(key, keys, n=1)
      hint = f"; did you mean '{close[0]}'?" if close else f' ({e})'
      raise AttributeError(
        f'Line {lineno}: unknown parameter {key!r}{hint}'
      ) from None
    try:
      updates.append((key, _ParseValue(old, raw)))
    except Exception as e:  # pylint: disable=broad-except
      expected = 'str' if isinstance(old, str) else type(old).__name__
      raise ValueError(
        f'Line {lineno}: cannot parse {raw!r} for parameter {key!r} as '
        f'{expected} (the type of its current value): {e}'
      ) from e
  for key, new in updates:
    params.Set(**{key: new})


def _ClosesQuote(s: str, quote: str) -> bool:
  """True if `s` ends with `quote` not escaped by a backslash."""
  return s.endswith(quote) and (len(s) - 1 - len(s[:-1].rstrip('\\'))) % 2 == 0


def _UnquoteString(text: str) -> str:
  """Inverse of `QuoteString`; `text` must start and end with one quote."""
  quote = text[0]
  if len(text) < 2 or not _ClosesQuote(text[1:], quote):
    raise ValueError(f'string {text!r} is missing its closing {quote} quote')
  return re.sub(r'\\([\\\'"])', r'\1', text[1:-1])


def _TextForm(val: Any) -> Any:
  """Maps `val` to an object whose str() is its value text in ToText()."""
  if isinstance(val, ParamsContainer):
    return KeySortedDict((k, _TextForm(v)) for k, v in val.IterParams())
  if isinstance(val, dict):
    return KeySortedDict((k, _TextForm(v)) for k, v in val.items())
  if isinstance(val, np.ndarray):
    return np.array2string(val, separator=', ')
  if IsRecord(val):
    return KeySortedDict((k, _TextForm(v)) for k, v in Fields(val).items())
  if isinstance(val, (list, tuple)):
    return type(val)(_TextForm(v) for v in val)
  if isinstance(val, (int, float, str, enum.Enum)):
    return val
  if IsDType(val):
    return val.name
  if IsProto(val):
    from google.protobuf import text_format  # pylint: disable=g-import-not-at-top

    proto_text = text_format.MessageToString(val, as_one_line=True)
    return f'proto/{ModuleName(val)}/{type(val).__name__}/{proto_text}'
  if isinstance(val, (type, types.FunctionType)):
    return f'type/{ModuleName(val)}/{val.__name__}'
  return type(val).__name__


def _EnterForText(unused_key: str, val: Any) -> bool:
  """Whether ToText() flattens `val` into per-field lines (Lingvo's rule)."""
  if isinstance(val, ParamsContainer):
    return True
  if isinstance(val, (list, tuple)):
    return all(isinstance(e, ParamsContainer) for e in val) or IsPairList(val)
  return (
    isinstance(val, dict)
    and bool(val)
    and all(
      isinstance(k, str) and isinstance(v, ParamsContainer)
      for k, v in val.items()
    )
  )


def _SplitTextLines(text: str) -> list[tuple[int, str, str]]:
  """Splits ToText() output into (line number, key, raw value text) entries."""
  entries = []
  pending = None  # (lineno, key, quote, [chunks]) of an open multi-line string.
  for lineno, line in enumerate(text.split('\n'), 1):
    if pending is not None:
      if _ClosesQuote(line.rstrip(), pending[2]):
        entries.append(
          (pending[0], pending[1], '\n'.join(pending[3] + [line.rstrip()]))
        )
        pending = None
      else:
        pending[3].append(line)
      continue
    stripped = line.strip()
    if not stripped or stripped.startswith('#'):
      continue
    key, sep, value = line.partition(':')
    key, value = key.strip(), value.lstrip()
    if not sep or not key:
      raise ValueError(
        f'Line {lineno}: expected "<key> : <value>", got {stripped!r}.'
      )
    if value[:1] in _QUOTES and not _ClosesQuote(value[1:].rstrip(), value[0]):
      pending = (lineno, key, value[0], [value])
      continue
    entries.append((lineno, key, value.rstrip()))
  if pending is not None:
    raise ValueError(
      f'Line {pending[0]}: the string value of {pending[1]!r} is missing its '
      f'closing {pending[2]} quote.'
    )
  return entries


def _ParseEnum(cls: Any, text: str) -> Any:
  cls_name, _, member = text.rpartition('.')
  if cls_name in (cls.__name__, '') and member in cls.__members__:
    return cls[member]
  for candidate in cls:
    if str(candidate) == text:
      return candidate
  raise ValueError(
    f'{text!r} is not a member of enum {cls.__name__}; expected one of '
    f'{[f"{cls.__name__}.{n}" for n in cls.__members__]}'
  )


def _ImportObject(text: str) -> Any:
  """Resolves 'type/module.path/Name' or 'proto/module/Cls/text'."""
  kind, _, rest = text.partition('/')
  module_name, _, name = rest.partition('/')
  if kind == 'proto':
    name, _, proto_text = name.partition('/')
  if kind not in ('type', 'proto') or not module_name or not name:
    raise ValueError(f"expected 'type/<module>/<Name>', got {text!r}")
  obj = importlib.import_module(module_name)
  for part in name.split('.'):
    obj = getattr(obj, part)
  if kind == 'type':
    return obj
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top

  return text_format.Parse(proto_text, obj())


def _Revive(old: Any, new: Any) -> Any:
  """Converts literal_eval output `new` back to the types found in `old`."""
  if isinstance(new, str) and not isinstance(old, str):
    if new == 'NoneType':  # How ToText() writes None inside containers.
      return None
    encoded = (
      IsDType(old)
      or IsProto(old)
      or isinstance(old, (enum.Enum, type, types.FunctionType))
    )
    if not (encoded or (old is None and new.startswith(('type/', 'proto/')))):
      return new
    try:
      return _ParseValue(old, new)
    except (
      ValueError,
      TypeError,
      SyntaxError,
      LookupError,
      ImportError,
      AttributeError,
    ):
      return new  # Not an encoding of old's type: keep the literal string.
  if isinstance(old, ParamsContainer) and isinstance(new, dict):
    res = old.Copy()
    for k, v in new.items():
      res.Set(**{k: _Revive(res.Get(k), v)})
    return res
  if IsRecord(old) and isinstance(new, dict):
    fields = Fields(old)
    unknown = set(new) - set(fields)
    if unknown:
      raise ValueError(f'{type(old).__name__} has no fields {sorted(unknown)}')
    return type(old)(
      **{k: _Revive(v, new[k]) if k in new else v for k, v in fields.items()}
    )
  if type(new) in (list, tuple):
    old = old if isinstance(old, (list, tuple)) else ()
    return type(new)(
      _Revive(old[i] if i < len(old) else _MISSING, v)
      for i, v in enumerate(new)
    )
  if type(new) is dict:  # pylint: disable=unidiomatic-typecheck
    old = old if isinstance(old, dict) else {}
    return {k: _Revive(old.get(k, _MISSING), v) for k, v in new.items()}
  return new


def _ParseValue(old: Any, text: str) -> Any:
  """Parses ToText() value text `text` as a value of the type of `old`."""
  type_name = 'str' if isinstance(old, str) else type(old).__name__
  if type_name == 'str':
    if text[:1] in _QUOTES:
      return _UnquoteString(text)
    if text.startswith('[') and text.endswith(']'):
      try:  # Lingvo accepts an unquoted list literal for a str param.
        return ast.literal_eval(text)
      except (ValueError, SyntaxError):
        pass
    return text
  if text in _NONE_TEXT:
    return None
  if type_name == 'bool' or (old is None and text in _BOOL_TEXT):
    if text not in _BOOL_TEXT:
      raise ValueError(f'{text!r} is not a bool; write True or False')
    return text in ('True', 'true')
  if type_name == 'int':
    return int(text)
  if type_name == 'float':
    return float(text)
  if IsDType(old):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    return tf.as_dtype(text)
  if isinstance(old, enum.Enum):
    return _ParseEnum(type(old), text)
  if isinstance(old, np.ndarray):
    return np.array(ast.literal_eval(text), dtype=old.dtype)
  if isinstance(old, np.generic):
    return type(old)(text)
  if IsRecord(old) or isinstance(old, (list, tuple, dict)):
    try:
      parsed = ast.literal_eval(text)
    except (
      SyntaxError
    ):  # Enum members inside containers print as <Cls.NAME: value>.
      parsed = ast.literal_eval(_ENUM_REPR_RE.sub(r"'\1'", text))
    return _Revive(old, parsed)
  if text.startswith(('type/', 'proto/')):
    return _ImportObject(text)
  if old is None:
    return (
      _UnquoteString(text) if text[:1] in _QUOTES else ast.literal_eval(text)
    )
  raise ValueError(
    f'values of type {type_name} cannot be read from text; set this '
    'parameter in Python instead'
  )
