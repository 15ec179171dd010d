"""Tests of the pipelined multilingual Transformer (models/mt)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.models.mt import layers as mt_layers
from lingvo_gpipe.planning import partition
from lingvo_gpipe.runners import checkpointer
from tests.testing import mt

B, S, T, D, V = mt.B, mt.S, mt.T, mt.D, mt.V
_Layers = mt.Layers
_TaskParams = mt.TaskParams
_Batch = mt.Batch


def _LossAndGrads(task, batch):
  with py_utils.StepSeed(0), tf.GradientTape() as tape:
    metrics, _ = task.FPropDefaultTheta(batch)
    loss = metrics.loss[0]
  variables = task.VariablesByName()
  grads = tape.gradient(loss, list(variables.values()))
  return float(loss), dict(zip(variables, grads))


def _StateShapes():
  return NestedMap(
    {k: [B, S] if k.startswith('src') else [B, T] for k in mt_layers.INPUT_KEYS}
  )


# -- Structure and shapes -----------------------------------------------------


def testFlatLayerListAndAnalyticFpropMeta():
  layers = _Layers(num_layers=2)
  names = [p.name for p in layers]
  assert names == [
    'emb',
    'enc_0',
    'enc_1',
    'enc_ln',
    'dec_0',
    'dec_1',
    'softmax',
  ]
  metas = partition.LayerMetas(layers, _StateShapes())
  for p, (flops, _, _) in zip(layers, metas):
    # Every layer has its own formula: nothing is traced.
    assert p.cls.FPropMeta.__func__ is not (
      base_layer.BaseLayer.FPropMeta.__func__
    ), p.cls
    assert flops > 0, p.name
  emb_out = metas[0][2][0]
  assert emb_out.src.as_list() == [B, S, D]
  assert emb_out.tgt.as_list() == [B, T, D]
  assert 'src_ids' not in emb_out and emb_out.src_paddings.as_list() == [B, S]
  final = metas[-1][2][0]
  assert sorted(final) == sorted(mt_layers.OUTPUT_KEYS)
  assert all(s.as_list() == [B] for s in final.values())
  # The decoder layers carry the encoder output through to the last cell.
  assert metas[-2][2][0].src.as_list() == [B, S, D]


def testFpropMetaNamesAMissingStateKey():
  layers = _Layers()
  shapes = _StateShapes()
  del shapes['tgt_ids']
  with pytest.raises(ValueError, match='tgt_ids'):
    partition.LayerMetas(layers, shapes)


def testPredictionsAndMetricsShapes():
  task = _TaskParams().Instantiate()
  batch = _Batch()
  preds = task.ComputePredictions(task.theta, batch)
  assert sorted(preds) == sorted(mt_layers.OUTPUT_KEYS)
  assert all(v.shape.as_list() == [B] for v in preds.values())
  metrics, per_example = task.ComputeLoss(task.theta, preds, batch)
  num_tokens = float(tf.reduce_sum(batch.tgt.weights))
  assert float(metrics.num_tokens[0]) == num_tokens
  assert float(metrics.loss[1]) == num_tokens
  # log_pplx ~ log(V) at init; label smoothing makes loss differ from it.
  assert abs(float(metrics.log_pplx[0]) - np.log(V)) < 1.5
  assert float(metrics.loss[0]) != pytest.approx(float(metrics.log_pplx[0]))
  plain = _TaskParams(label_smoothing=0.0).Instantiate()
  m, _ = plain.FPropDefaultTheta(batch)
  assert float(m.loss[0]) == pytest.approx(float(m.log_pplx[0]), rel=1e-6)
  assert per_example.loss.shape.as_list() == [B]
  assert 'mt/network/body' not in ' '.join(task.VariablesByName())


def testTaskRejectsMismatchedVocabSizes():
  p = _TaskParams()
  p.vocab_size = V + 1
  with pytest.raises(ValueError, match='vocab_size'):
    p.Instantiate()


# -- Masking -------------------------------------------------------------------


def _Logits(task, src_ids, src_pad, tgt_ids):
  with py_utils.EvalMode():
    enc = task.Encode(task.theta, src_ids, src_pad)
    return task.DecoderLogits(task.theta, enc, tgt_ids).numpy()


def testCausalMaskingHidesFutureTargetTokens():
  task = _TaskParams(pipelined=False).Instantiate()
  batch = _Batch()
  src, pad = batch.src.ids, batch.src.paddings
  tgt = batch.tgt.ids.numpy()
  base = _Logits(task, src, pad, tgt)
  j = 3
  changed = tgt.copy()
  changed[:, j] = (changed[:, j] + 5) % V
  out = _Logits(task, src, pad, changed)
  np.testing.assert_allclose(out[:, :j], base[:, :j], rtol=1e-5, atol=1e-5)
  assert np.abs(out[:, j:] - base[:, j:]).max() > 1e-3


def testSourcePaddingIsMaskedInSelfAndCrossAttention():
  task = _TaskParams(pipelined=False).Instantiate()
  batch = _Batch()
  src = batch.src.ids.numpy()
  pad = batch.src.paddings.numpy()
  assert pad.sum() > 0
  base = _Logits(task, src, pad, batch.tgt.ids)
  noisy = np.where(pad > 0, (src + 11) % V, src)
  out = _Logits(task, noisy, pad, batch.tgt.ids)
  np.testing.assert_allclose(out, base, rtol=1e-5, atol=1e-5)
  # A real (non-padded) source token does matter.
  real = src.copy()
  real[:, 0] = (real[:, 0] + 11) % V
  assert np.abs(_Logits(task, real, pad, batch.tgt.ids) - base).max() > 1e-3


# -- Tied embedding -----------------------------------------------------------


def testEmbeddingAndSoftmaxAreOneVariableAcrossCells():
  task = _TaskParams(num_stages=2).Instantiate()
  emb = task.network.body[0]
  sm = task.network.body[-1]
  assert emb.emb.wm is sm.softmax.weight_0
  # First and last pipeline cell: the tie crosses cells.
  assert emb in task.network.CellLayers(0)
  assert sm in task.network.CellLayers(task.network.num_stages - 1)
  names = [
    n for n in task.VariablesByName() if n.endswith(('/wm', '/weight_0'))
  ]
  assert names == ['mt/network/emb/emb/wm']


def testTiedGradientSumsBothUses():
  task = _TaskParams(num_stages=2, num_micro_batches=2).Instantiate()
  var = task.network.body[0].emb.wm
  batch = _Batch()

  def Grad(stop_emb=False, stop_softmax=False):
    theta = task.theta
    if stop_emb:
      theta.network.body[0].emb.wm = tf.stop_gradient(var)
    if stop_softmax:
      theta.network.body[-1].softmax.weight_0 = tf.stop_gradient(var)
    with py_utils.StepSeed(0), tf.GradientTape() as tape:
      preds = task.ComputePredictions(theta, batch)
      metrics, _ = task.ComputeLoss(theta, preds, batch)
    return tape.gradient(metrics.loss[0], var)

  total = Grad()
  from_emb = Grad(stop_softmax=True)
  from_softmax = Grad(stop_emb=True)
  assert float(tf.norm(from_emb)) > 0 and float(tf.norm(from_softmax)) > 0
  np.testing.assert_allclose(
    total.numpy(), (from_emb + from_softmax).numpy(), atol=1e-6
  )


def testUntiedSoftmaxHasItsOwnWeight():
  task = _TaskParams(tie_softmax=False).Instantiate()
  assert task.network.body[0].emb.wm is not (
    task.network.body[-1].softmax.weight_0
  )


# -- Pipelining is transparent -------------------------------------------------


def testPipelinedLossAndGradsEqualTheUnpipelinedOnes():
  batch = _Batch(batch=8)
  loss1, grads1 = _LossAndGrads(
    _TaskParams(num_stages=1, num_micro_batches=1).Instantiate(), batch
  )
  loss2, grads2 = _LossAndGrads(
    _TaskParams(num_stages=2, num_micro_batches=2).Instantiate(), batch
  )
  loss4, grads4 = _LossAndGrads(
    _TaskParams(num_stages=2, num_micro_batches=4).Instantiate(), batch
  )
  assert grads1.keys() == grads2.keys() == grads4.keys()
  assert loss1 == pytest.approx(loss2, rel=1e-5)
  assert loss1 == pytest.approx(loss4, rel=1e-5)
  for name in grads1:
    assert grads1[name] is not None, name
    np.testing.assert_allclose(
      grads2[name].numpy(),
      grads1[name].numpy(),
      rtol=1e-4,
      atol=1e-6,
      err_msg=name,
    )
    np.testing.assert_allclose(
      grads4[name].numpy(),
      grads1[name].numpy(),
      rtol=1e-4,
      atol=1e-6,
      err_msg=name,
    )


@pytest.mark.parametrize(
  'schedule, num_stages, devices',
  [
    ('1f1b', 2, None),
    ('1f1b', 4, None),
    ('interleaved', 4, ['/device:CPU:0', '/device:CPU:1']),
  ],
)
def testSchedulesGiveTheSameLossMetricsAndGradients(
  schedule, num_stages, devices
):
  """'1f1b' trains through the loss on the last cell (FPropWithLoss),
  'interleaved' through FProp; both equal the unpipelined task."""
  batch = _Batch(batch=8)
  ref = _TaskParams(num_stages=1, num_micro_batches=1).Instantiate()
  p = _TaskParams(num_stages=num_stages, num_micro_batches=4)
  p.network.Set(schedule=schedule, devices=devices)
  task = p.Instantiate()
  assert task._LossOnLastCell() == (schedule == '1f1b')
  loss1, grads1 = _LossAndGrads(ref, batch)
  loss2, grads2 = _LossAndGrads(task, batch)
  assert loss2 == pytest.approx(loss1, rel=1e-5)
  assert grads1.keys() == grads2.keys()
  for name in grads1:
    np.testing.assert_allclose(
      grads2[name].numpy(),
      grads1[name].numpy(),
      rtol=1e-4,
      atol=1e-6,
      err_msg=name,
    )
  with py_utils.StepSeed(0):
    m1, _ = ref.FPropDefaultTheta(batch)
    m2, _ = task.FPropDefaultTheta(batch)
  for key in ('log_pplx', 'token_accuracy', 'num_tokens'):
    np.testing.assert_allclose(m2[key][0], m1[key][0], rtol=1e-5)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def testTrainStepRunsInATfFunction(schedule):
  model_p = _TaskParams(num_stages=2, num_micro_batches=2)
  model_p.network.schedule = schedule
  task = model_p.Instantiate()
  step = tf.function(task.TrainStep, autograph=False)
  batch = _Batch(batch=8)
  first = float(step(batch).loss)
  for _ in range(5):
    out = step(batch)
  assert float(out.loss) < first
  assert int(task.global_step.numpy()) == 6


# -- Stability options ---------------------------------------------------------


def testFflayerInitScaledDownByTheNumberOfLayers():
  assert mt_layers.FFLayerInitScale(1.0, 'linear', 8) == 0.125
  assert mt_layers.FFLayerInitScale(2.0, 'sqrt', 16) == 0.5
  assert mt_layers.FFLayerInitScale(1.0, 'none', 128) == 1.0
  with pytest.raises(ValueError, match='depth_scaling'):
    mt_layers.FFLayerInitScale(1.0, 'log', 4)
  plain = _TaskParams(num_layers=2).Instantiate()
  scaled = _TaskParams(
    num_layers=2, fflayer_init_depth_scaling='linear'
  ).Instantiate()
  for name in ('enc_0', 'dec_1'):

    def W(task, name=name):
      layer = [lyr for lyr in task.network.body if lyr.params.name == name][0]
      return layer.fflayer.fflayer_1.w.numpy()

    # 2 + 2 layers: Xavier limits and standard deviations are 4x smaller.
    ratio = W(plain).std() / W(scaled).std()
    assert ratio == pytest.approx(4.0, rel=0.1), name
  # Attention weights are not scaled.
  np.testing.assert_allclose(
    plain.network.body[1].self_atten.atten.query.w.numpy(),
    scaled.network.body[1].self_atten.atten.query.w.numpy(),
  )


def testLogitClipping():
  batch = _Batch()
  plain = _TaskParams(pipelined=False).Instantiate()
  clipped = _TaskParams(pipelined=False, logits_abs_max=0.5).Instantiate()
  src, pad, tgt = batch.src.ids, batch.src.paddings, batch.tgt.ids
  assert np.abs(_Logits(plain, src, pad, tgt)).max() > 0.5
  out = _Logits(clipped, src, pad, tgt)
  assert np.abs(out).max() <= 0.5 + 1e-6
  with pytest.raises(ValueError, match='logits_abs_max'):
    _TaskParams(logits_abs_max=-1.0).Instantiate()


# -- Registered sizes ----------------------------------------------------------

# (registry key, L, H, A, cells, the paper's round number of parameters)
_SIZES = [
  ('TransformerT6x8192x16', 6, 8192, 16, 2, 400e6),
  ('TransformerT24x8192x16', 24, 8192, 16, 4, 1.3e9),
  ('TransformerT12x16384x32', 12, 16384, 32, 4, 1.3e9),
  ('TransformerT32x16384x32', 32, 16384, 32, 8, 3e9),
  ('TransformerT64x16384x32', 64, 16384, 32, 16, 6e9),
]


def ExpectedParams(num_layers, hidden, d=1024, vocab=64000):
  """Our count: one tied table + softmax bias, LayerNorms, biases."""
  attention = 2 * d + 4 * (d * d + d)  # LN + q, k, v, post
  ffn = 2 * d + d * hidden + hidden + hidden * d + d
  encoder = attention + ffn
  decoder = 2 * attention + ffn
  return (
    vocab * d + vocab + num_layers * (encoder + decoder) + 2 * (2 * d)
  )  # encoder and final LN


@pytest.mark.parametrize('key,num_layers,hidden,heads,cells,paper', _SIZES)
def testRegisteredSizesCountWithoutAllocating(
  key, num_layers, hidden, heads, cells, paper
):
  p = model_registry.GetParams(f'mt.multilingual.{key}', 'Train')
  net = p.task.network
  assert net.num_stages == cells
  assert len(net.layers) == 2 * num_layers + 3
  assert net.layers[1].hidden_dim == hidden
  assert net.layers[1].num_attention_heads == heads
  assert net.layers[1].source_dim == 1024
  count = base_layer.CountParams(p)
  assert count == ExpectedParams(num_layers, hidden)
  # docs/transformer.md explains the gap to the paper's round numbers (tied
  # embeddings, 1024-wide attention): within 25% below them.
  assert 0.75 * paper < count < 1.05 * paper


def testTinyConfigIsSmallAndPipelined():
  p = model_registry.GetParams('mt.multilingual.TransformerTiny', 'Train')
  assert p.task.network.num_stages == 2
  assert p.task.network.num_micro_batches in (2, 3, 4)
  assert p.task.vocab_size == p.input.vocab_size
  assert base_layer.CountParams(p) < 2_000_000


# -- Checkpoints of another size -----------------------------------------------


def testCheckpointOfAnotherSizeIsRefusedClearly(tmp_path):
  small = _TaskParams(num_layers=1, hidden=32).Instantiate()
  other = _TaskParams(num_layers=2, hidden=48).Instantiate()
  writer = checkpointer.Checkpointer(str(tmp_path), small.VariablesByName())
  prefix = writer.Save(1)
  reader = checkpointer.Checkpointer(
    str(tmp_path), other.VariablesByName(), writable=False
  )
  with pytest.raises(checkpointer.IncompatibleCheckpointError) as e:
    reader.RestoreFrom(prefix)
  text = str(e.value)
  assert 'different model' in text
  assert 'mt/network/dec_1/' in text  # Another number of layers.
  assert 'fflayer_1/w: model [16, 48] float32, checkpoint [16, 32]' in text
  assert '--logdir' in text
