"""Hyperparameter containers with a Lingvo-compatible API and text format.

`Params` holds named, documented values (possibly nested `Params`);
`InstantiableParams` also records the class it configures. `Params.ToText()`
writes byte-for-byte what `lingvo.core.hyperparams.Params.ToText()` writes, and
`FromText()` reads it back, so configurations move between the two libraries.

Deliberate differences from Lingvo: Freeze() is recursive and Copy() of a
frozen Params is writable; Define() requires a description. FromText() is
all-or-nothing, reports line numbers, unquotes strings exactly (Lingvo strips
every quote char at both ends), keeps quoted '[...]' strings as strings,
accepts only True/true/False/false for bools, reads NoneType into any non-str
param, and restores None, dtypes, classes, enums and Params inside lists,
dicts, namedtuples and dataclasses by using the current value as a template.
Format limits shared with Lingvo: empty lists/tuples and empty nested Params
write no line (so FromText() cannot empty them), and strings with newlines
inside lists/dicts cannot be read back. Not provided: ToProto/FromProto,
ToTextWithTypes/FromTextWithTypes, TextDiff, CopyFieldsSubsetTo.

Layout: the container (Define, Get/Set by dotted keys, Copy, Freeze, Visit,
`CopyFieldsTo`) is `params_container.ParamsContainer`; writing and reading the
text format is `params_text`. Import this module: it exports all of it.
"""

from typing import Any, Generic, Self, TypeVar

from lingvo_gpipe.core import params_container
from lingvo_gpipe.core import params_text

__all__ = ['CopyFieldsTo', 'InstantiableParams', 'Params']

ParamsT = params_container.ParamsT
_ClsT = TypeVar('_ClsT')
CopyFieldsTo = params_container.CopyFieldsTo


class Params(params_container.ParamsContainer):
  """A set of named, documented parameters with attribute-style access.

  Use `Define()` to declare a parameter, then read and write it as an
  attribute (`p.name`, `p.name = value`) or with dotted keys through nested
  Params (`p.Get('a.b')`, `p.Set(**{'a.b': 1})`). `ToText()` and
  `FromText()` write and read Lingvo's text format (`params_text`); the rest
  of the container is `params_container.ParamsContainer`.
  """

  def ToText(self, separator: str = ':') -> str:
    """Returns sorted 'a.b.c : value' lines, exactly as Lingvo's ToText()."""
    return params_text.ToText(self, separator)

  def FromText(self, text: str, allow_missing: bool = False) -> Self:
    """Sets values from ToText()-format text, typed like the current values.

    Args:
      text: 'key : value' lines; blank lines and '#' comments are ignored.
      allow_missing: If True, keys unknown to this Params are skipped.

    Returns:
      self. On an unknown key (AttributeError) or a bad line or value
      (ValueError), naming the line, nothing is changed.
    """
    self._CheckWritable('load FromText')
    params_text.FromText(self, text, allow_missing)
    return self


class InstantiableParams(Params, Generic[_ClsT]):
  """Params that also record `cls`, the class they configure.

  `Instantiate(**kwargs)` returns `cls(params, **kwargs)`.
  """

  def __init__(self, cls: Any = None) -> None:
    super().__init__()
    self.Define(
      'cls',
      cls,
      'Class (or factory) that Instantiate() calls with these params.',
    )

  def Instantiate(self, **kwargs: Any) -> _ClsT:
    """Returns `self.cls(self, **kwargs)`."""
    if self.cls is None:
      raise ValueError(
        'Cannot Instantiate(): cls is None; set p.cls to the class to build.'
      )
    return self.cls(self, **kwargs)
