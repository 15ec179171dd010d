"""Every registered model's variables match tests/golden/<model key>.json.

The golden files pin the names, shapes and dtypes a checkpoint of each model
holds, across versions. Names do not depend on the number of pipeline
stages, so a checkpoint written with K stages restores with any other K; the
last test trains the tiny digits model in 2 stages and restores it in 1 and
in 3 by the golden names.
"""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.runners import checkpointer

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
  'update_golden', _ROOT / 'tools' / 'update_golden.py'
)
update_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_golden)

_KEYS = update_golden.ModelKeys()
_HOW = (
  'If the change is meant (old checkpoints of this model will no longer '
  'restore), regenerate it on purpose with `python tools/update_golden.py '
  '--model={key}` and say so in the commit message.'
)


def testEveryRegisteredModelHasAGoldenFile():
  files = sorted(
    f[: -len('.json')]
    for f in os.listdir(update_golden.GOLDEN_DIR)
    if f.endswith('.json')
  )
  missing = sorted(set(_KEYS) - set(files))
  stale = sorted(set(files) - set(_KEYS))
  assert not missing, (
    f'No golden file for {missing}: run `python tools/update_golden.py '
    '--model=<key>` and commit tests/golden/<key>.json.'
  )
  assert not stale, (
    f'Golden files of models that are not registered: {stale}; delete '
    'them (`python tools/update_golden.py` removes them).'
  )


@pytest.mark.parametrize('key', _KEYS)
def testModelMatchesItsGoldenFile(key):
  drift = update_golden.Drift(key)
  assert not drift, (
    f'The variables of {key} differ from tests/golden/{key}.json '
    f'(- golden, + model):\n{drift}\n' + _HOW.format(key=key)
  )


def testDriftIsReported(tmp_path):
  key = 'image.digits.MlpDigitsTiny'
  assert update_golden.Drift(key, str(tmp_path)).endswith('does not exist.')
  update_golden.Write(key, str(tmp_path))
  assert update_golden.Drift(key, str(tmp_path)) == ''
  path = update_golden.GoldenPath(key, str(tmp_path))
  with open(path, encoding='utf-8') as f:
    golden = json.load(f)
  golden['variables']['digits/network/fc0/w'] = [[64, 32], 'float32']
  with open(path, 'w', encoding='utf-8') as f:
    f.write(update_golden.GoldenText(key, golden['variables']))
  drift = update_golden.Drift(key, str(tmp_path))
  assert '-    "digits/network/fc0/w": [[64, 32], "float32"]' in drift
  assert '+    "digits/network/fc0/w": [[64, 64], "float32"]' in drift


def _Model(key, num_stages):
  p = model_registry.GetParams(key, 'Train')
  p.task.network.Set(num_stages=num_stages, devices=None)
  return p.Instantiate()


def testCheckpointOfKStagesRestoresWithOtherKByGoldenNames(tmp_path):
  key = 'image.digits.MlpDigitsTiny'
  golden = update_golden.ReadGolden(key)
  trained = _Model(key, 2)
  task = trained.GetTask()
  assert task.network.num_stages == 2
  batches = iter(task.input_generator.GetDataset())
  for _ in range(2):
    task.TrainStep(next(batches))
  before = {n: v.numpy() for n, v in trained.VariablesByName().items()}
  prefix = checkpointer.Checkpointer(
    str(tmp_path), trained.VariablesByName()
  ).Save(2)
  saved = checkpointer.ReadCheckpointVariables(prefix)
  for name, (shape, dtype) in golden.items():
    assert name in saved, f'{name} (golden) is not in the checkpoint'
    assert saved[name][0] == shape, name
    assert tf.as_dtype(saved[name][1]).name == dtype, name
  for num_stages in (1, 3):
    restored = _Model(key, num_stages)
    assert restored.GetTask().network.num_stages == num_stages
    variables = restored.VariablesByName()
    assert set(golden) <= set(variables)
    # Fresh weights differ from the trained ones, so the restore is seen.
    assert any(
      not np.array_equal(variables[n].numpy(), before[n]) for n in golden
    )
    assert checkpointer.Checkpointer(
      str(tmp_path), variables, writable=False
    ).Restore()
    for name in golden:
      np.testing.assert_array_equal(variables[name].numpy(), before[name])
    assert int(restored.global_step.numpy()) == 2


def _Lm(splits):
  p = model_registry.GetParams(
    'lm.one_billion_wds.OneBWdsGPipeTransformerTiny', 'Train'
  )
  p.task.lm.stack.splits = splits
  return p.Instantiate()


def testLingvoStackCheckpointRestoresWithAnotherSplit(tmp_path):
  """A Lingvo-style stack names its layers under cell_<k>/, so its names
  change with the split; a checkpoint of 2 cells still restores into 4 (and
  into 1) by the names without cell_<k>/, in the trainer's strict resume
  and in the evaler's restore of the weights alone."""
  two = _Lm([2, 4])
  before = {n: v.numpy() for n, v in two.VariablesByName().items()}
  checkpointer.Checkpointer(str(tmp_path), two.VariablesByName()).Save(3)
  for splits in ([1, 2, 3, 4], [4]):
    other = _Lm(splits)
    variables = other.VariablesByName()
    assert set(variables) != set(before)
    mapping = checkpointer.SplitIndependentMap(
      variables,
      checkpointer.ReadCheckpointVariables(str(tmp_path / 'ckpt-3')),
    )
    assert mapping and len(mapping) == len(before)
    assert checkpointer.Checkpointer(
      str(tmp_path), variables, writable=False
    ).Restore()
    for name, source in mapping.items():
      np.testing.assert_array_equal(variables[name].numpy(), before[source])
  # The weights alone (an evaler's model has no optimizer slots).
  weights = {
    n: v for n, v in _Lm([4]).VariablesByName().items() if 'step' not in n
  }
  ckpt = checkpointer.Checkpointer(str(tmp_path), weights, writable=False)
  assert ckpt.RestoreFrom(str(tmp_path / 'ckpt-3'), strict=False) == 3


def testNamesThatTwoCellsShareHaveNoSplitIndependentMap():
  variables = {
    'p/cell_0/fc0/w': tf.Variable(tf.zeros([2])),
    'p/cell_1/fc0/w': tf.Variable(tf.zeros([2])),
  }
  ckpt = {
    'p/cell_0/fc0/w': ([2], tf.float32, 'a'),
    'p/cell_0/fc1/w': ([2], tf.float32, 'b'),
  }
  assert checkpointer.SplitIndependentMap(variables, ckpt) is None
