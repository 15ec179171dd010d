"""base_input_generator.CheckMessage: an input's own in-graph check, found
in a TensorFlow error by the generator's class name (the trainer reports it
in one line, knowing no input in particular); TF_DATA_AUTOTUNE."""

import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_input_generator


class RowCheckedInput(base_input_generator.BaseInputGenerator):
  """An input generator whose checks name it."""


class CountingInput(base_input_generator.BaseInputGenerator):
  """0, 1, 2, ... as examples."""

  def _DataSource(self):
    return tf.data.Dataset.range(10).map(lambda i: {'x': i})


@pytest.mark.parametrize('autotune', [True, False])
def testAutotuneFollowsTheProcessSetting(monkeypatch, autotune):
  monkeypatch.setattr(base_input_generator, 'TF_DATA_AUTOTUNE', autotune)
  p = CountingInput.Params().Set(
    name='counting', batch_size=4, shuffle=False, num_epochs=1
  )
  ds = p.Instantiate().GetDataset()
  # Unset is tf.data's default: autotuned. Either way the same batches.
  assert ds.options().autotune.enabled is (None if autotune else False)
  assert [b['x'].numpy().tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _Failed(message, *more):
  """The error of a failed check in a graph, as in an input pipeline."""

  @tf.function
  def Check(ok):
    tf.debugging.Assert(ok, [message, *more])
    return ok

  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    Check(tf.constant(False))
  return e.value


def testAGeneratorsCheckIsItsMessage():
  error = _Failed("RowCheckedInput: row 3 of 'a.txt' is empty")
  assert (
    base_input_generator.CheckMessage(error)
    == "RowCheckedInput: row 3 of 'a.txt' is empty"
  )


def testOtherErrorsAreNotInputChecks():
  assert base_input_generator.CheckMessage(_Failed('x > 0 failed')) is None
  # Another check that merely names the generator.
  error = _Failed('expected a RowCheckedInput: got none')
  assert base_input_generator.CheckMessage(error) is None
  assert base_input_generator.CheckMessage(ValueError('no assertion')) is None


def testAMultiItemCheckIsLeftToTheGeneralReport():
  error = _Failed('RowCheckedInput: bad label', tf.constant(17))
  assert base_input_generator.CheckMessage(error) is None
