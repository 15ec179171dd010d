"""Every registered experiment under `params/` has sound, cheap-to-build Params.

For each class registered from the `params` package: its Train/Dev/Test model
Params build, survive a ToText/FromText round trip, and count their weights
abstractly (no memory). Only small models are instantiated for real.
"""

import pytest

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import base_model

model_registry.ImportAllParams()
_KEYS = sorted(
  key
  for key, cls in model_registry.GetAllRegisteredClasses().items()
  if cls.__module__.startswith(model_registry.PARAMS_PACKAGE + '.')
)

# Models up to this many weights are also built with real variables.
_MAX_WEIGHTS_TO_BUILD = 200_000


def testThereAreExperiments():
  assert 'image.digits.MlpDigitsTiny' in _KEYS


@pytest.mark.parametrize('key', _KEYS)
def testParams(key):
  cls = model_registry.GetClass(key)
  assert model_registry.ModelKey(cls) == key
  datasets = cls.Datasets()
  assert 'Train' in datasets
  for dataset in datasets:
    p = model_registry.GetParams(key, dataset)
    assert issubclass(p.cls, base_model.SingleTaskModel)
    assert p.input is not None and p.task.name
    text = p.ToText()
    fresh = model_registry.GetParams(key, dataset)
    fresh.FromText(text)
    assert fresh.ToText() == text
    assert fresh == p
  p = model_registry.GetParams(key, 'Train')
  assert p.task.train.max_steps > 0
  assert p.task.input.batch_size > 0
  num_weights = base_layer.CountParams(p)
  assert num_weights > 0
  if num_weights <= _MAX_WEIGHTS_TO_BUILD:
    model = p.Instantiate()
    assert 'global_step' in model.VariablesByName()
    assert model.GetTask().input_generator is not None
