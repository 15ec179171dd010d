"""SingleTaskModelParams: one experiment's configuration (Lingvo's).

A subclass returns the task Params from `Task()` and the input generator
Params of each dataset from a method named after it (`Train()`, `Dev()`,
`Test()`, or any other capitalized name). `Model()` wraps the task into
`SingleTaskModel.Params`. Register it with
`@model_registry.RegisterSingleTaskModel` (see `lingvo_gpipe.model_registry`).

  class MyExperiment(base_model_params.SingleTaskModelParams):
    def Train(self):
      return digits.DigitsInput.Params().Set(split='train', batch_size=64)
    def Task(self):
      return classifier.ClassifierTask.Params().Set(...)

`Dev()` and `Test()` default to the training input made an evaluation
input by the input generator class (`EvalParams(train_params, 'Dev')`: one
pass, no shuffling, padded final batch, and the other split where the class
knows how to pick it); a generator that cannot raises NotImplementedError
saying to define the method.

Every other capitalized public method counts as a dataset (Lingvo treats all
public methods so): name helper methods with a leading underscore.

Dataset methods (and Task/Model) may be called on an instance, as in Lingvo,
or directly on the class: `MyExperiment.Dev()` calls it on a fresh instance.
"""

import functools
import types

from lingvo_gpipe.core import base_model

__all__ = ['SingleTaskModelParams', 'DatasetError']

# Capitalized methods that are not datasets (Lingvo's list, plus Datasets).
# Helpers of a config class should be private (`_Layers`), as in Lingvo.
_NOT_DATASETS = frozenset(
  [
    'Task',
    'Model',
    'GetDatasetParams',
    'Datasets',
    'ProgramSchedule',
    'GetAllDatasetParams',
    'Search',
    'UpdateParamsFromSpec',
    'CreateDynamicDatasetMethods',
  ]
)


class DatasetError(KeyError):
  """A model params class has no method for the requested dataset."""

  def __str__(self):
    return str(self.args[0]) if self.args else ''


class _InstanceOrClassMethod:
  """A method that binds to a fresh instance when accessed on the class."""

  def __init__(self, fn):
    self._fn = fn
    functools.update_wrapper(self, fn)

  def __get__(self, obj, objtype=None):
    if obj is None:
      obj = objtype()
    return types.MethodType(self._fn, obj)


def _WrapMethods(cls):
  for name, value in list(vars(cls).items()):
    if name[:1].isupper() and isinstance(value, types.FunctionType):
      setattr(cls, name, _InstanceOrClassMethod(value))


class _BaseModelParams:
  """Base class of the model params classes."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _WrapMethods(cls)

  @classmethod
  def Datasets(cls):
    """Names of the dataset methods, e.g. ['Dev', 'Test', 'Train']."""
    names = set()
    for klass in cls.__mro__:
      for name, value in vars(klass).items():
        if (
          name[:1].isupper()
          and name not in _NOT_DATASETS
          and not name.startswith('Task_')
          and isinstance(value, (_InstanceOrClassMethod, types.FunctionType))
        ):
          names.add(name)
    return sorted(names)

  def GetDatasetParams(self, dataset):
    """Input Params of `dataset` (case-insensitive: 'dev' finds Dev())."""
    if not isinstance(dataset, str) or not dataset:
      raise DatasetError(
        f'Dataset name {dataset!r} must be a non-empty string such as "Train".'
      )
    available = self.Datasets()
    name = dataset if dataset in available else None
    if name is None:
      matches = [d for d in available if d.lower() == dataset.lower()]
      name = matches[0] if matches else None
    if name is None:
      raise DatasetError(
        f'{type(self).__name__} has no dataset {dataset!r}; available: '
        f'{available}. Define a method {dataset}(self) returning its input '
        'generator Params.'
      )
    return getattr(self, name)()


class SingleTaskModelParams(_BaseModelParams):
  """Model Params for a `SingleTaskModel`. See the module docstring."""

  def Task(self):
    """Returns the task Params (e.g. `ClassifierTask.Params()`)."""
    raise NotImplementedError(
      f'{type(self).__name__}.Task() must return the task Params, e.g. '
      'classifier.ClassifierTask.Params().Set(...).'
    )

  def Train(self):
    """Returns the input generator Params of the training data."""
    raise NotImplementedError(
      f'{type(self).__name__}.Train() must return the training input '
      'generator Params, e.g. DigitsInput.Params().Set(split="train").'
    )

  def _EvalInput(self, dataset):
    train = self.Train()
    make = getattr(train.cls, 'EvalParams', None)
    if make is None:
      raise NotImplementedError(
        f'{type(self).__name__} defines no {dataset}() and its training '
        f'input {train.cls!r} has no EvalParams(); define {dataset}().'
      )
    return make(train, dataset)

  def Dev(self):
    """Input Params of the dev set; default: derived from Train()."""
    return self._EvalInput('Dev')

  def Test(self):
    """Input Params of the test set; default: derived from Train()."""
    return self._EvalInput('Test')

  def Model(self):
    """`SingleTaskModel.Params` wrapping `Task()`."""
    return base_model.SingleTaskModel.Params(self.Task())


_WrapMethods(SingleTaskModelParams)
