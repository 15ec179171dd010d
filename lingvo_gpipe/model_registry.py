"""The model registry: experiment names -> model params classes (Lingvo's).

Experiments live in the top-level `params` package and register themselves:

  # params/image/digits.py
  @model_registry.RegisterSingleTaskModel
  class MlpDigitsTiny(base_model_params.SingleTaskModelParams):
    ...

The key is the module path without its leading `params.` package, plus the
class name: 'image.digits.MlpDigitsTiny'. A class defined elsewhere keeps its
full module path ('tests.model_registry_test.Foo'); only a leading package
named 'params' is dropped.

Lookups are lazy: `GetClass('image.digits.MlpDigitsTiny')` imports
`params.image.digits` (or `image.digits`) if the key is not registered yet,
so tools need not import every config. `ImportAllParams()` imports every
module under `params` (e.g. to list all experiments). A topic folder under
`params/` is found with an `__init__.py` or without one (a namespace
package): `params/mytopic/mymodel.py` gives keys `mytopic.mymodel.<Class>`.

The trainer's contract:

  p = model_registry.GetParams(key, 'Train')  # SingleTaskModel Params
  model = p.Instantiate()                     # p.input -> task's input
  dev_p = model_registry.GetParams(key, 'Dev')
  # or model_registry.GetClass(key).Dev() -> the input generator Params
"""

import difflib
import importlib
import os
import threading

from absl import logging

from lingvo_gpipe.core import base_model_params

__all__ = [
  'RegisterSingleTaskModel',
  'GetClass',
  'GetParams',
  'GetAllRegisteredClasses',
  'GetRegisteredKeys',
  'ImportAllParams',
  'ModelKey',
  'PARAMS_PACKAGE',
]

PARAMS_PACKAGE = 'params'

_lock = threading.RLock()
_registry = {}  # key -> class


def ModelKey(cls):
  """The registry key of model params class `cls`."""
  module = cls.__module__
  prefix = PARAMS_PACKAGE + '.'
  if module.startswith(prefix):
    module = module[len(prefix) :]
  return f'{module}.{cls.__name__}'


def RegisterSingleTaskModel(cls):
  """Class decorator registering a `SingleTaskModelParams` subclass.

  Returns the class unchanged. Raises TypeError for other classes and
  ValueError if another class already has the same key.
  """
  if not (
    isinstance(cls, type)
    and issubclass(cls, base_model_params.SingleTaskModelParams)
  ):
    raise TypeError(
      f'RegisterSingleTaskModel: {cls!r} is not a subclass of '
      'base_model_params.SingleTaskModelParams; derive the experiment '
      'from it.'
    )
  key = ModelKey(cls)
  with _lock:
    old = _registry.get(key)
    if old is not None and old is not cls:
      raise ValueError(
        f'Duplicate model key {key!r}: {old.__module__}.{old.__qualname__} '
        f'is already registered under it; rename {cls.__qualname__} or '
        'move it to another module.'
      )
    _registry[key] = cls
  logging.debug('Registered model %s', key)
  return cls


def GetRegisteredKeys():
  """Sorted keys of the classes registered so far (no importing)."""
  with _lock:
    return sorted(_registry)


def GetAllRegisteredClasses():
  """{key: class} of the classes registered so far (a copy).

  Call `ImportAllParams()` first to include every experiment under `params`.
  """
  with _lock:
    return dict(_registry)


def _TryImport(module_name):
  """Imports `module_name`; False if it (not a dependency) does not exist."""
  try:
    importlib.import_module(module_name)
    return True
  except ModuleNotFoundError as e:
    missing = e.name or ''
    if module_name == missing or module_name.startswith(missing + '.'):
      return False
    raise  # The module exists but one of its imports is missing.


def ImportAllParams(ignore_errors=False):
  """Imports every module under the `params` package; returns their names.

  Args:
    ignore_errors: if True, modules that fail to import are logged and
      skipped; otherwise the first failure raises ImportError naming it.
  """
  try:
    package = importlib.import_module(PARAMS_PACKAGE)
  except ModuleNotFoundError as e:
    raise ImportError(
      f'Cannot import the {PARAMS_PACKAGE!r} package of experiment configs '
      f'({e}); run from the repository root or put it on PYTHONPATH.'
    ) from e
  names = []
  for name in _ModuleNames(package):
    try:
      importlib.import_module(name)
      names.append(name)
    except Exception as e:  # pylint: disable=broad-except
      if not ignore_errors:
        raise ImportError(
          f'Importing experiment module {name!r} failed: '
          f'{type(e).__name__}: {e}'
        ) from e
      logging.warning('Skipping %s: %s', name, e)
  return names


def _ModuleNames(package):
  """Dotted names of the modules and packages under `package`'s folders,
  those without an __init__.py included (pkgutil skips them), tests not."""
  names = set()
  for top in package.__path__:
    for folder, subdirs, files in os.walk(top):
      subdirs[:] = [
        d for d in subdirs if d.isidentifier() and d != '__pycache__'
      ]
      rel = os.path.relpath(folder, top)
      parts = [package.__name__] + ([] if rel == '.' else rel.split(os.sep))
      if rel != '.':
        names.add('.'.join(parts))
      for f in files:
        stem = f[: -len('.py')]
        if (
          f.endswith('.py')
          and stem.isidentifier()
          and stem != '__init__'
          and not stem.endswith('_test')
        ):
          names.add('.'.join(parts + [stem]))
  return sorted(names)


def _LazyImport(key):
  module = key.rpartition('.')[0]
  if not module:
    return
  for candidate in (f'{PARAMS_PACKAGE}.{module}', module):
    if _TryImport(candidate):
      return


def GetClass(key):
  """The model params class registered under `key`.

  Imports `params.<module part of key>` first if `key` is not registered.

  Raises:
    KeyError: listing the closest registered keys.
  """
  if not isinstance(key, str) or not key:
    raise KeyError(
      f'Model key {key!r} must be a non-empty string such as '
      '"image.digits.MlpDigitsTiny".'
    )
  with _lock:
    cls = _registry.get(key)
  if cls is not None:
    return cls
  _LazyImport(key)
  with _lock:
    cls = _registry.get(key)
  if cls is not None:
    return cls
  note = ''
  try:
    ImportAllParams(ignore_errors=True)  # For a helpful list of candidates.
  except ImportError as e:
    note = f' ({e})'
  with _lock:
    cls = _registry.get(key)
    known = sorted(_registry)
  if cls is not None:
    return cls
  close = difflib.get_close_matches(key, known, n=5, cutoff=0.5)
  hint = f' Closest registered keys: {close}.' if close else ''
  raise KeyError(
    f'No model registered under {key!r}.{hint}{note} List all with '
    '`python -c "from lingvo_gpipe import model_registry as m; '
    'm.ImportAllParams(); print(*m.GetRegisteredKeys(), sep=chr(10))"`.'
  )


def GetParams(key, dataset):
  """The `SingleTaskModel` Params of `key` with the input of `dataset`.

  Args:
    key: registry key, e.g. 'image.digits.MlpDigitsTiny'.
    dataset: 'Train', 'Dev', 'Test' or any dataset method of the class
      (case-insensitive).

  Returns:
    A writable copy of `cls().Model()` with `p.input` (and `p.task.input`)
    set to the dataset's input generator Params.
  """
  obj = GetClass(key)()
  cfg = obj.Model()
  input_p = obj.GetDatasetParams(dataset)
  cfg.input = input_p
  if 'task' in cfg and cfg.task is not None and 'input' in cfg.task:
    cfg.task.input = input_p.Copy()
  # A deep copy is writable throughout (e.g. py_utils.WeightInit Params are
  # frozen when created), so FromText overrides can reach every field.
  return cfg.Copy()
