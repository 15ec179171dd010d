"""Tests for lingvo_gpipe.model_registry and base_model_params."""

import sys
import textwrap
import uuid

import pytest

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_input_generator
from lingvo_gpipe.core import base_model
from lingvo_gpipe.core import base_model_params
from lingvo_gpipe.input import digits


def _MakeClass(
  name, module, base=base_model_params.SingleTaskModelParams, **attrs
):
  return type(name, (base,), dict(attrs, __module__=module))


def testKeys():
  cls = _MakeClass('AmoebaNetD18x208', 'params.image.amoebanet')
  assert model_registry.ModelKey(cls) == 'image.amoebanet.AmoebaNetD18x208'
  cls = _MakeClass('Foo', 'tests.model_registry_test')
  assert model_registry.ModelKey(cls) == 'tests.model_registry_test.Foo'
  cls = _MakeClass('Bar', 'mypkg.params.lm')  # Only a leading 'params.'.
  assert model_registry.ModelKey(cls) == 'mypkg.params.lm.Bar'


def testRegisterGetAndDuplicates():
  module = f'fake_{uuid.uuid4().hex}'
  cls = _MakeClass('Exp', module, Train=lambda self: 'train-input')
  assert model_registry.RegisterSingleTaskModel(cls) is cls
  assert model_registry.RegisterSingleTaskModel(cls) is cls  # Same class: ok.
  key = f'{module}.Exp'
  assert model_registry.GetClass(key) is cls
  assert model_registry.GetAllRegisteredClasses()[key] is cls
  assert key in model_registry.GetRegisteredKeys()
  with pytest.raises(ValueError, match='Duplicate model key'):
    model_registry.RegisterSingleTaskModel(_MakeClass('Exp', module))
  with pytest.raises(TypeError, match='SingleTaskModelParams'):
    model_registry.RegisterSingleTaskModel(type('NotParams', (), {}))


def testLazyImportOfParamsModule():
  cls = model_registry.GetClass('image.digits.MlpDigitsTiny')
  assert cls.__module__ == 'params.image.digits'
  assert 'image.digits.MlpDigitsTinyBN' in model_registry.GetRegisteredKeys()


def testLazyImportOfOtherModule(tmp_path, monkeypatch):
  pkg = f'lazy_{uuid.uuid4().hex}'
  (tmp_path / pkg).mkdir()
  (tmp_path / pkg / '__init__.py').write_text('')
  (tmp_path / pkg / 'exps.py').write_text(
    textwrap.dedent("""
      from lingvo_gpipe import model_registry
      from lingvo_gpipe.core import base_model_params

      @model_registry.RegisterSingleTaskModel
      class Small(base_model_params.SingleTaskModelParams):
        pass
      """)
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  key = f'{pkg}.exps.Small'
  assert key not in model_registry.GetRegisteredKeys()
  assert model_registry.GetClass(key).__name__ == 'Small'


def testUnknownKeyListsCloseMatches():
  with pytest.raises(KeyError) as e:
    model_registry.GetClass('image.digits.MlpDigitTiny')
  message = str(e.value)
  assert 'image.digits.MlpDigitsTiny' in message
  assert 'ImportAllParams' in message
  with pytest.raises(KeyError, match='non-empty'):
    model_registry.GetClass('')


def testImportAllParams():
  names = model_registry.ImportAllParams()
  assert 'params.image.digits' in names
  assert 'image.digits.MlpDigitsTiny' in model_registry.GetRegisteredKeys()


def testNewParamsTopicFoldersAreFound(tmp_path, monkeypatch):
  """params/<topic>/<module>.py, with an __init__.py or without: found by
  key and by ImportAllParams."""
  import params  # pylint: disable=g-import-not-at-top

  suffix = uuid.uuid4().hex[:8]
  topics = {f'withinit_{suffix}': True, f'bare_{suffix}': False}
  for topic, init in topics.items():
    folder = tmp_path / topic
    folder.mkdir()
    if init:
      (folder / '__init__.py').write_text('')
    (folder / 'mymodel.py').write_text(
      textwrap.dedent("""
        from lingvo_gpipe import model_registry
        from lingvo_gpipe.core import base_model_params

        @model_registry.RegisterSingleTaskModel
        class MyParams(base_model_params.SingleTaskModelParams):
          pass
        """)
    )
  # As if the folders were under the repository's params/.
  monkeypatch.setattr(
    params, '__path__', list(params.__path__) + [str(tmp_path)]
  )
  try:
    bare, with_init = sorted(topics, key=topics.get)
    cls = model_registry.GetClass(f'{bare}.mymodel.MyParams')
    assert cls.__module__ == f'params.{bare}.mymodel'
    names = model_registry.ImportAllParams()
    assert f'params.{with_init}.mymodel' in names
    assert f'params.{bare}.mymodel' in names
    assert 'params.image.digits' in names
    assert f'{with_init}.mymodel.MyParams' in model_registry.GetRegisteredKeys()
  finally:
    for name in list(sys.modules):
      if any(name.startswith(f'params.{t}') for t in topics):
        del sys.modules[name]


def testGetParamsSetsTheDatasetInput():
  key = 'image.digits.MlpDigitsTiny'
  p = model_registry.GetParams(key, 'Train')
  assert p.cls is base_model.SingleTaskModel
  assert p.input.cls is digits.DigitsInput and p.input.split == 'train'
  assert p.task.input == p.input
  assert p.task.train.max_steps == 300
  dev = model_registry.GetParams(key, 'dev')  # Case-insensitive.
  assert (dev.input.split, dev.input.num_epochs, dev.input.remainder) == (
    'dev',
    1,
    'pad',
  )
  assert model_registry.GetParams(key, 'TEST').input.split == 'test'
  with pytest.raises(KeyError, match='available'):
    model_registry.GetParams(key, 'Validation')


def testDatasetMethodsOnClassOrInstance():
  cls = model_registry.GetClass('image.digits.MlpDigitsTiny')
  assert cls.Dev() == cls().Dev()
  assert cls.Test().split == 'test'
  assert cls.Datasets() == ['Dev', 'Test', 'Train']
  assert cls.Model().task.name == 'digits'


def testDefaultDevTestFromTrain():
  exp = _MakeClass(
    'Derived',
    'tests.tmp',
    Train=lambda self: digits.DigitsInput.Params().Set(batch_size=32),
  )
  dev = exp.Dev()
  assert (dev.split, dev.batch_size, dev.shuffle) == ('dev', 32, False)
  no_eval = _MakeClass(
    'NoEval',
    'tests.tmp',
    Train=lambda self: base_input_generator.BaseInputGenerator.Params(),
  )
  with pytest.raises(NotImplementedError, match='define Dev'):
    no_eval().Dev()
  with pytest.raises(NotImplementedError, match='Task'):
    no_eval().Task()
  with pytest.raises(NotImplementedError, match='Train'):
    _MakeClass('Empty', 'tests.tmp').Train()
