"""NestedMap: a dict with attribute access, as in Lingvo's `py_utils.NestedMap`.

A NestedMap holds tensors (or anything else) in a tree of NestedMaps, dicts,
lists and tuples. It is a `dict` subclass, so `tf.nest` and `tf.function` treat
it as a structure and rebuild it as a NestedMap. Flattening visits keys in
sorted order, like `tf.nest`, so `Flatten()` and `tf.nest.flatten()` agree.

Example:

  m = NestedMap(x=tf.ones([2]), aux=NestedMap(paddings=tf.zeros([2])))
  m.aux.paddings             # attribute access
  m.Flatten()                # [aux.paddings, x]
  m.FlattenItems()           # [('aux.paddings', ...), ('x', ...)]
  m.Transform(tf.identity)   # same structure, new leaves
"""

import re

__all__ = ['NestedMap']

_KEY_RE = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
_RESERVED = frozenset(dir(dict))


def _IsSequence(x):
  return isinstance(x, (list, tuple)) and not _IsNamedTuple(x)


def _IsNamedTuple(x):
  return isinstance(x, tuple) and hasattr(x, '_fields')


class NestedMap(dict):
  """A dict with attribute access whose values may nest further.

  Keys must be valid Python identifiers that do not shadow a dict method
  (`keys`, `items`, ...), so every key can be read as an attribute.
  """

  # Keep the instance free of a __dict__ so attribute writes go to the dict.
  __slots__ = ()

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    for k in self:
      NestedMap.CheckKey(k)

  @staticmethod
  def CheckKey(key):
    """Raises ValueError if `key` cannot be a NestedMap key."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
      raise ValueError(
        f'Invalid NestedMap key {key!r}: keys must be Python identifiers '
        '(letters, digits and "_", not starting with a digit).'
      )
    if key in _RESERVED:
      raise ValueError(
        f'Invalid NestedMap key {key!r}: it shadows the dict method '
        f'"{key}". Choose another name, e.g. "{key}_".'
      )

  def __setitem__(self, key, value):
    NestedMap.CheckKey(key)
    super().__setitem__(key, value)

  def update(self, *args, **kwargs):  # pylint: disable=invalid-name
    for k, v in dict(*args, **kwargs).items():
      self[k] = v

  def setdefault(self, key, default=None):  # pylint: disable=invalid-name
    if key not in self:
      self[key] = default
    return self[key]

  def __or__(self, other):
    out = NestedMap(self)
    out.update(other)
    return out

  def __ior__(self, other):
    self.update(other)
    return self

  def __setattr__(self, name, value):
    self[name] = value

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError as e:
      keys = ', '.join(sorted(self.keys())) or '(none)'
      raise AttributeError(
        f'NestedMap has no key {name!r}; its keys are: {keys}.'
      ) from e

  def __delattr__(self, name):
    try:
      del self[name]
    except KeyError as e:
      raise AttributeError(f'NestedMap has no key {name!r}.') from e

  def copy(self):
    """Shallow copy that stays a NestedMap."""
    return NestedMap(self)

  def __deepcopy__(self, memo):
    import copy  # pylint: disable=g-import-not-at-top

    return NestedMap({k: copy.deepcopy(v, memo) for k, v in self.items()})

  def DeepCopy(self):
    """Copies the structure; leaves are shared (not copied)."""
    return self.Pack(self.Flatten())

  # -- Dotted access -----------------------------------------------------------

  def GetItem(self, key):
    """Returns the value at dotted `key`, e.g. 'a.b' or 'a.0.c' for lists."""
    current = self
    for part in key.split('.'):
      if isinstance(current, (list, tuple)):
        current = current[int(part)]
      else:
        current = current[part]
    return current

  def Get(self, key, default=None):
    """Like GetItem, returning `default` if the path does not exist."""
    try:
      return self.GetItem(key)
    except (KeyError, IndexError, ValueError, TypeError):
      return default

  def Set(self, key, value):
    """Sets dotted `key`, creating intermediate NestedMaps as needed."""
    parts = key.split('.')
    current = self
    for part in parts[:-1]:
      if part not in current:
        current[part] = NestedMap()
      current = current[part]
      if not isinstance(current, NestedMap):
        raise ValueError(f'Cannot set {key!r}: {part!r} is not a NestedMap.')
    current[parts[-1]] = value
    return self

  # -- Flatten / Pack ----------------------------------------------------------

  def FlattenItems(self):
    """Returns [(dotted_key, leaf)] in the sorted order `Flatten` uses."""
    out = []

    def Visit(prefix, v):
      if isinstance(v, dict):
        for k in sorted(v.keys()):
          Visit(f'{prefix}.{k}' if prefix else k, v[k])
      elif _IsSequence(v) or _IsNamedTuple(v):
        for i, x in enumerate(v):
          Visit(f'{prefix}[{i}]' if prefix else f'[{i}]', x)
      else:
        out.append((prefix, v))

    Visit('', self)
    return out

  def Flatten(self):
    """Returns the leaves in sorted-key order (same as `tf.nest.flatten`)."""
    return [v for _, v in self.FlattenItems()]

  def Pack(self, lst):
    """Returns a copy of this structure with leaves taken from `lst`."""
    it = iter(lst)
    count = [0]

    def Build(v):
      if isinstance(v, dict):
        return type(v)((k, Build(v[k])) for k in sorted(v.keys()))
      if _IsNamedTuple(v):
        return type(v)(*[Build(x) for x in v])
      if _IsSequence(v):
        return type(v)(Build(x) for x in v)
      count[0] += 1
      try:
        return next(it)
      except StopIteration:
        raise ValueError(
          f'Pack: the list has fewer values than the structure has leaves '
          f'({len(self.Flatten())}).'
        ) from None

    result = Build(self)
    leftover = sum(1 for _ in it)
    if leftover:
      raise ValueError(
        f'Pack: the list has {count[0] + leftover} values but the structure '
        f'has {count[0]} leaves.'
      )
    return result

  def Transform(self, fn):
    """Returns a copy with `fn(leaf)` at every leaf."""
    return self.Pack([fn(x) for x in self.Flatten()])

  def TransformWithKey(self, fn):
    """Returns a copy with `fn(dotted_key, leaf)` at every leaf."""
    return self.Pack([fn(k, v) for k, v in self.FlattenItems()])

  def IsCompatible(self, other):
    """True if `other` has the same structure (keys and nesting)."""
    if not isinstance(other, dict):
      return False
    return [k for k, _ in self.FlattenItems()] == [
      k for k, _ in NestedMap(other).FlattenItems()
    ]

  def Filter(self, fn):
    """Returns a NestedMap keeping leaves where `fn(leaf)` is true."""
    return self.FilterKeyVal(lambda _, v: fn(v))

  def FilterKeyVal(self, fn):
    """Returns a NestedMap keeping leaves where `fn(dotted_key, leaf)`."""
    out = NestedMap()
    for k, v in self.FlattenItems():
      if '[' in k:
        raise ValueError('FilterKeyVal does not support lists inside maps.')
      if fn(k, v):
        out.Set(k, v)
    return out

  def DebugString(self):
    """One `key  value` line per leaf, sorted by key."""
    items = self.FlattenItems()
    width = max((len(k) for k, _ in items), default=0)
    return '\n'.join(f'{k:<{width}}  {v}' for k, v in items)

  def __repr__(self):
    return 'NestedMap(' + dict.__repr__(self) + ')'
