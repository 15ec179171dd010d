"""Lingvo's GPipe Transformer LM: the layer, its task, the registered configs
and the tiny one trained by the trainer on the offline demo corpus."""

import os
import pathlib
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import optimizer
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.models import gpipe_lm
from lingvo_gpipe.tools import inspect_model
from tests.testing import warm_python

REPO = pathlib.Path(__file__).resolve().parents[2]
WPM = 'lm.one_billion_wds.OneBWdsGPipeTransformerWPM'
TINY = 'lm.one_billion_wds.OneBWdsGPipeTransformerTiny'
V, D, B, T = 13, 8, 4, 6


def _Task(splits=(2, 4), num_micro_batches=2):
  p = gpipe_lm.GPipeTransformerLmTask.Params().Set(name='lm', random_seed=3)
  p.lm = gpipe_lm.GPipeTransformerLm.CommonParams(
    vocab_size=V,
    model_dim=D,
    hidden_dim=16,
    num_heads=2,
    num_layers=4,
    splits=list(splits),
    num_micro_batches=num_micro_batches,
    num_shards=1,
    residual_dropout_prob=0.0,
  )
  p.lm.stack.devices = [f'/device:CPU:{i}' for i in range(len(splits))]
  p.train.learning_rate = 1e-2
  p.train.optimizer = optimizer.Adam.Params()
  return p.Instantiate()


def _Batch(seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(4, V, [B, T]).astype(np.int32)
  labels = np.roll(ids, -1, axis=1)
  paddings = np.zeros([B, T], np.float32)
  paddings[1, -2:] = 1.0
  return NestedMap(
    ids=tf.constant(ids),
    labels=tf.constant(labels),
    paddings=tf.constant(paddings),
    weights=tf.constant(1.0 - paddings),
  )


def testRegisteredConfigHasLingvosValues():
  p = model_registry.GetParams(WPM, 'Train')
  s = p.task.lm.stack
  assert p.task.lm.vocab_size == 32000
  assert (s.model_dim, s.num_encoder_layers, s.num_decoder_layers) == (
    2048,
    32,
    0,
  )
  assert list(s.splits) == [8, 16, 24, 32] and s.num_micro_batches == 32
  assert s.encoder_tpl.tr_atten_tpl.num_heads == 16
  assert s.encoder_tpl.tr_fflayer_tpl.hidden_dim == 8192
  assert s.encoder_tpl.mask_self_atten and not s.packed_input
  assert (p.input.batch_size, p.input.max_tokens) == (32, 1024)
  tp = p.task.train
  assert tp.learning_rate == 0.5 and tp.optimizer.cls is optimizer.Adam
  assert tp.lr_schedule.warmup_steps == 40000


def testRegisteredConfigInspectsWithoutAllocating():
  info = inspect_model.Inspect(WPM)
  assert info['num_params'] == 1_742_314_752
  assert info['num_stages'] == 4 and info['optimizer'] == 'Adam'
  assert [c['layers'] for c in info['cells']] == [
    [f'cell_{k}'] for k in range(4)
  ]
  # The embedding and the softmax (32000 x 2048 each) sit in the end cells.
  params = [c['params'] for c in info['cells']]
  assert params[0] == params[1] + 32000 * 2048


@pytest.mark.parametrize(
  'kwargs, needle',
  [
    (dict(micro_batch_size=4), 'micro_batch_size = 4 is not supported'),
    (dict(softmax_max_alloc=1 << 20), 'softmax_max_alloc = 1048576'),
    (dict(num_shards=3), 'num_shards = 3 does not divide vocab_size = 32'),
  ],
)
def testCommonParamsRefusesWhatItLacksInOneLine(kwargs, needle):
  with pytest.raises(ValueError, match=re.escape(needle)) as e:
    gpipe_lm.GPipeTransformerLm.CommonParams(
      vocab_size=32, model_dim=8, **kwargs
    )
  assert '\n' not in str(e.value)


def testOutputsAndMetrics():
  task = _Task()
  out = task.ComputePredictions(task.theta, _Batch())
  assert out.per_example_xent.shape == (B, T)
  assert out.logits.shape == (B, T, V)
  w = _Batch().weights.numpy()
  np.testing.assert_allclose(
    out.avg_xent.numpy(),
    (out.per_example_xent.numpy() * w).sum() / w.sum(),
    rtol=1e-6,
  )
  metrics, per_example = task.FPropDefaultTheta(_Batch())
  assert float(metrics.num_predictions[0]) == w.sum()
  np.testing.assert_allclose(
    metrics.log_pplx[0].numpy(), out.avg_xent.numpy(), rtol=1e-6
  )
  assert per_example.loss.shape == (B,)


def testCausal():
  """Changing a later token leaves the earlier positions' xent unchanged."""
  task = _Task(splits=(4,), num_micro_batches=1)
  batch = _Batch()
  ids = batch.ids.numpy().copy()
  ids[:, -1] = (ids[:, -1] + 1) % V
  other = NestedMap(batch, ids=tf.constant(ids))
  a = task.ComputePredictions(task.theta, batch).per_example_xent.numpy()
  b = task.ComputePredictions(task.theta, other).per_example_xent.numpy()
  np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=1e-5, atol=1e-6)
  assert not np.allclose(a[:, -1], b[:, -1])


def _ByLayer(task):
  """{path without the task, LM and cell prefixes: variable}."""
  return {
    re.sub(r'^.*?/cell_\d+/', '', n): v
    for n, v in task.VariablesByName().items()
  }


def testPipelinedGradientsEqualOneCells():
  """1, 2 and 4 cells, with micro-batches, given the same weights: one set
  of gradients (cells are named by their Params, so each split has its own
  variable paths and initial values)."""
  batch = _Batch()
  grads, ref = [], None
  for splits, m in (((4,), 1), ((2, 4), 2), ((1, 2, 3, 4), 4)):
    task = _Task(splits, m)
    by_layer = _ByLayer(task)
    if ref is None:
      ref = {k: v.numpy() for k, v in by_layer.items()}
    assert sorted(by_layer) == sorted(ref)
    for k, v in by_layer.items():
      v.assign(ref[k])
    with tf.GradientTape() as tape:
      metrics, _ = task.FPropDefaultTheta(batch)
    keys = sorted(by_layer)
    g = tape.gradient(metrics.loss[0], [by_layer[k] for k in keys])
    grads.append(dict(zip(keys, g)))
  for other in grads[1:]:
    for k, g in grads[0].items():
      np.testing.assert_allclose(other[k], g, rtol=1e-4, atol=1e-6, err_msg=k)


def testTrainStepInATfFunctionLowersTheLoss():
  """The cells pass Lingvo's 7-tuple with None entries between devices."""
  task = _Task()
  step = tf.function(task.TrainStep, autograph=False)
  batch = _Batch()
  first = float(step(batch).loss)
  for _ in range(8):
    out = step(batch)
  assert float(out.loss) < first


@pytest.mark.slow
def testTinyTrainsThroughTheTrainerAndPerplexityFalls(tmp_path):
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL='2',
    XDG_CACHE_HOME=str(tmp_path / 'cache'),
    PYTHONPATH=str(REPO),
  )

  def Run(logdir, steps):
    res = warm_python.Run(
      [
        sys.executable,
        '-m',
        'lingvo_gpipe.trainer',
        f'--model={TINY}',
        f'--logdir={logdir}',
        '--num_cpu_devices=2',
        '--mode=sync',
        '--job=trainer,evaler_dev',
        f'--max_steps={steps}',
      ],
      cwd=REPO,
      env=env,
      timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(
      r'Eval dev at step \d+ .*?log_pplx ([0-9.]+)', res.stderr
    )
    assert found, res.stderr[-3000:]
    return float(found[-1])

  untrained = Run(tmp_path / 'a', 1)
  trained = Run(tmp_path / 'b', 300)
  # About ln(1000) = 6.9 at the start; under ln(3) after 300 steps.
  assert untrained > 6.0 and trained < 1.1, (untrained, trained)


def testHasNoDecoderEvaluationAndSaysWhatToUse():
  with pytest.raises(ValueError, match='has no decoder evaluation') as e:
    _Task(splits=(4,), num_micro_batches=1).EvaluateDecoder()
  assert '\n' not in str(e.value) and '--job=evaler_dev' in str(e.value)
