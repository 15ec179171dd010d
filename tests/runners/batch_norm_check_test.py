"""The warning for batch-norm moving averages that have seen too few steps."""

import logging

from lingvo_gpipe import model_registry
from lingvo_gpipe.runners import batch_norm_check
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import evaler

MODEL = 'image.digits.MlpDigitsTinyBN'


def _Dev(model=MODEL):
  p = model_registry.GetParams(model, 'Dev')
  p.task.train.max_steps = 2
  return p


def testSlowLayersAndTheWarning():
  model = _Dev().Instantiate()
  slow = batch_norm_check.SlowLayers(model, 10)
  assert slow, 'the model has batch norm layers'
  decay = slow[0][1]
  assert all(path.startswith('digits/network/') for path, _ in slow)
  # decay ** steps <= 0.1 from this step on.
  needed = next(n for n in range(1, 100000) if decay**n <= 0.1)
  assert batch_norm_check.SlowLayers(model, needed - 1)
  assert not batch_norm_check.SlowLayers(model, needed)
  text = batch_norm_check.MovingAverageWarning(model, 10)
  assert text.startswith(
    f'The batch-norm moving averages of {len(slow)} layer(s) ({slow[0][0]}'
  ), text
  assert f'have had 10 updates: they are still {decay**10:.0%}' in text
  assert f'Train at least {needed} steps, or lower the decay' in text
  assert batch_norm_check.MovingAverageWarning(model, needed) is None
  plain = _Dev('image.digits.MlpDigitsTiny').Instantiate()
  assert batch_norm_check.MovingAverageWarning(plain, 0) is None


def testTheEvalerWarnsOnce(tmp_path, caplog):
  model = model_registry.GetParams(MODEL, 'Train').Instantiate()
  ckpt = checkpointer.Checkpointer(
    str(tmp_path / 'train'), model.VariablesByName()
  )
  prefixes = [ckpt.Save(1), ckpt.Save(2)]
  ev = evaler.Evaler(_Dev(), str(tmp_path), max_batches=1)
  with caplog.at_level(logging.WARNING):
    for prefix in prefixes:
      ev.EvalCheckpoint(prefix)
  warnings = [
    r.getMessage()
    for r in caplog.records
    if 'batch-norm moving averages' in r.getMessage()
  ]
  assert len(warnings) == 1 and 'have had 1 updates' in warnings[0]
