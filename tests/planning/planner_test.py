"""The planner: profiles from Params, the candidate search and 'auto'."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import layers
from lingvo_gpipe.layers import activations
from lingvo_gpipe.layers import transformer
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.planning import device_presets
from lingvo_gpipe.planning import planner

DEVICES = [f'/device:CPU:{i}' for i in range(4)]
MIB = 2**20


def _Fcs(n, dim=256):
  return [
    layers.FCLayer.Params().Set(
      name=f'fc_{i}', input_dim=dim, output_dim=dim, activation='RELU'
    )
    for i in range(n)
  ]


def testProfileCountsFlopsParamsAndSavedActivations():
  prof = planner.ProfileLayers(_Fcs(3, 64), [[32, 64]])
  assert prof.batch_size == 32 and prof.num_layers == 3
  lp = prof.layers[0]
  assert lp.num_params == 64 * 64 + 64
  assert lp.param_bytes == 4 * lp.num_params
  assert lp.flops >= 2 * 32 * 64 * 64
  assert lp.in_bytes == lp.out_bytes == 32 * 64 * 4
  # The backward of relu(x w + b) reads at least the output of the layer.
  assert lp.activation_bytes >= 32 * 64 * 4
  assert [x.name for x in prof.layers] == ['fc_0', 'fc_1', 'fc_2']


def testSavedActivationsOfATransformerBlock():
  # The saved tensors of one block: dominated by the FFN hidden layer
  # [b, t, 4d] and the attention probabilities [b, h, t, t]; between 4x and
  # 40x the block's output.
  p = transformer.TransformerLayer.Params().Set(
    name='b', source_dim=64, hidden_dim=256, num_attention_heads=2
  )
  prof = planner.ProfileLayers([p], [[8, 16, 64]])
  out = 8 * 16 * 64 * 4
  assert 4 * out <= prof.layers[0].activation_bytes <= 40 * out


def testProfileNeedsTheBatchSize():
  with pytest.raises(ValueError, match='batch size'):
    planner.ProfileLayers(_Fcs(2), [[None, 256]])


def testPlanRanksAndExplainsRejections():
  prof = planner.ProfileLayers(_Fcs(8, 512), [[256, 512]])
  device = device_presets.GetPreset('cpu')
  # 8 layers of 1 MiB weights: 4 MiB each with gradients and Adam slots.
  res = planner.Plan(prof, device, 4, memory_bytes=14 * MIB)
  assert res.feasible
  steps = [c.step_s for c in res.feasible]
  assert steps == sorted(steps)
  for c in res.feasible:
    assert c.num_devices * c.num_replicas <= 4
    assert c.max_peak_bytes <= 14 * MIB
  no_fit = [c for c in res.rejected if c.verdict == 'does not fit']
  assert any(c.num_stages == 1 for c in no_fit)
  assert all('dominate' in c.reason for c in no_fit)
  text = res.ToText()
  assert 'Feasible, best first' in text and 'does not fit' in text


def testOneStageHasNoBubbleAndReMaterializingOneMicroBatchIsFree():
  prof = planner.ProfileLayers(_Fcs(4, 128), [[64, 128]])
  device = device_presets.GetPreset('cpu')
  res = planner.Plan(prof, device, 2, num_stages=1, num_micro_batches=1)
  cands = res.feasible + res.rejected
  # R=2 replicas of one stage idle while their weights and gradients move,
  # but that is no pipeline bubble.
  assert {c.num_replicas for c in cands} == {1, 2}
  assert all(c.bubble == 0.0 for c in cands)
  rows = [
    line.split()
    for line in res.ToText(top=10).splitlines()
    if line.split()[:1] and line.split()[0].isdigit()
  ]
  # '#', R, K, D, M, schedule, recompute, the step (2 words), examples/s,
  # bubble.
  assert rows and all(row[10] == '-' for row in rows), rows
  # K=1, M=1: the recomputed forward pass reuses its own buffers.
  for r in (1, 2):
    peaks = {
      c.recompute: c.max_peak_bytes for c in cands if c.num_replicas == r
    }
    assert peaks[True] == peaks[False], peaks
  two = planner.Plan(prof, device, 2, num_stages=2, num_micro_batches=4)
  assert all(c.bubble > 0 for c in two.feasible + two.rejected)
  assert '-' not in [
    line.split()[8]
    for line in two.ToText().splitlines()
    if line.split()[:1] and line.split()[0].isdigit()
  ]


def testCompiledCellsNeedOneMoreCopyOfTheirGradients():
  # 8 layers of 1 MiB weights on 2 cells: 4 MiB of weights per device.
  prof = planner.ProfileLayers(_Fcs(8, 512), [[256, 512]])
  device = device_presets.GetPreset('cpu')
  kw = dict(num_stages=2, num_micro_batches=4, recompute=True)
  plain = planner.Plan(prof, device, 2, **kw).best
  compiled = planner.Plan(prof, device, 2, compiled=True, **kw).best
  assert compiled.memory['compiled_gradients'] == plain.memory['weights']
  assert compiled.max_peak_bytes > plain.max_peak_bytes
  assert compiled.step_s == plain.step_s


def testModelThatFitsNothingNamesItsSmallestNeed():
  prof = planner.ProfileLayers(_Fcs(2, 512), [[64, 512]])
  res = planner.Plan(prof, device_presets.GetPreset('cpu'), 2, memory_bytes=MIB)
  assert not res.feasible
  text = res.ToText()
  assert 'No configuration fits' in text
  assert 'weights, gradients and optimizer slots dominate' in text


def testBadShapesGiveTheValidRange():
  prof = planner.ProfileLayers(_Fcs(3), [[8, 256]])
  cpu = device_presets.GetPreset('cpu')
  with pytest.raises(ValueError, match=r'3 layers: K must lie in \[1, 3\]'):
    planner.Plan(prof, cpu, 8, num_stages=4)
  with pytest.raises(ValueError, match=r'K=2 x R=2 = 4 devices'):
    planner.Plan(prof, cpu, 2, num_stages=2, num_replicas=2)
  with pytest.raises(ValueError, match='tpu_v3'):
    device_presets.GetPreset('tpu_v9')


def testBubbleBoundIsRejectedWhenBetterExists():
  # 1024 flops per byte sent: compute-bound on a TPU core's link.
  prof = planner.ProfileLayers(_Fcs(4, 2048), [[256, 2048]])
  res = planner.Plan(prof, device_presets.GetPreset('tpu_v3'), 4)
  bubble = [c for c in res.rejected if c.verdict == 'bubble-bound']
  assert any(c.num_stages == 4 and c.num_micro_batches == 1 for c in bubble)
  assert all('idle' in c.reason for c in bubble)


def _AutoPipeline(**kw):
  p = pipelining_layer.PipeliningLayer.Params().Set(
    name='auto',
    layers=_Fcs(8, 512),
    num_stages='auto',
    num_micro_batches='auto',
    devices=DEVICES,
    input_shapes=[[64, 512]],
    planner_device='cpu',
  )
  p.Set(**kw)
  return p.Instantiate()


def testAutoResolvesKForMemoryAndRuns():
  # 8 x 4 MiB of weights, gradients and slots: only K >= 3 fits 14 MiB.
  pipe = _AutoPipeline(planner_memory_per_device=14 * MIB)
  assert pipe.num_stages >= 3
  assert 64 % pipe.num_micro_batches == 0
  text = pipe.PlacementText()
  assert 'planned (num_stages=auto, num_micro_batches=auto' in text
  assert f'K={pipe.num_stages}, M={pipe.num_micro_batches}' in text
  x = tf.random.stateless_normal([64, 512], [1, 2])
  with tf.GradientTape() as tape:
    y = pipe(x)
    loss = tf.reduce_sum(y)
  grads = tape.gradient(loss, pipe.trainable_variables)
  assert all(g is not None for g in grads)
  assert np.isfinite(loss.numpy())


def testAutoMicroBatchesWithFixedStages():
  pipe = _AutoPipeline(num_stages=2, planner_device='tpu_v3')
  assert pipe.num_stages == 2
  # On a TPU core this model is compute-bound: more than one micro-batch
  # shrinks the bubble.
  assert pipe.num_micro_batches > 1
  assert 'num_micro_batches=auto' in pipe.PlacementText()


def testAutoErrors():
  with pytest.raises(ValueError, match='input_shapes'):
    _AutoPipeline(input_shapes=None)
  with pytest.raises(ValueError, match='smallest need'):
    _AutoPipeline(planner_memory_per_device=MIB)
  with pytest.raises(ValueError, match='tpu_v3'):
    _AutoPipeline(planner_device='tpu_v9')
  with pytest.raises(ValueError, match='micro_batch_size'):
    _AutoPipeline(micro_batch_size=8)


def testMeasureTimesEachDistinctLayerOnce():
  layer_params = _Fcs(3, 32)
  prof = planner.ProfileLayers(layer_params, [[16, 32]])
  planner.MeasureProfile(prof, layer_params, repeats=1, time_budget_s=60)
  for lp in prof.layers:
    assert lp.measured is not None and all(t >= 0 for t in lp.measured)
  # Three identical layers on identical inputs: one measurement.
  assert prof.layers[0].measured == prof.layers[2].measured
  device = planner.MeasuredDevice(64 * MIB, link=(1e9, 1e-4))
  cand = planner.Evaluate(prof, device, 2, 4)
  assert cand.step_s > 0 and len(cand.peak_bytes) == 2


@pytest.mark.slow
def testMeasureLinkBetweenTwoLocalWorkers():
  bw, latency = planner.MeasureLink()
  assert bw > 1e6 and latency >= 0


def testBackwardPeakBeyondSavedActivations():
  p = transformer.TransformerLayer.Params().Set(
    name='b', source_dim=64, hidden_dim=256, num_attention_heads=2
  )
  lp = planner.ProfileLayers([p], [[8, 16, 64]]).layers[0]
  # At least the gradient of the block's input is alive at some point.
  assert lp.backward_bytes >= 8 * 16 * 64 * 4
  assert lp.backward_bytes < lp.activation_bytes * 4


def testElementwiseBackwardReusesDyingBuffers():
  # The backward of tanh(tanh(tanh(tanh(x)))): each TanhGrad writes into the
  # buffer of the gradient it reads last, as TensorFlow's kernels do, so
  # only one gradient of the activation's size is alive at a time (two if
  # every op allocated its output).
  seq = layers.SequentialLayer.Params().Set(
    name='s',
    sub=[
      activations.ActivationLayer.Params().Set(name=f'a{i}', activation='TANH')
      for i in range(4)
    ],
  )
  lp = planner.ProfileLayers([seq], [[64, 1024]]).layers[0]
  size = 64 * 1024 * 4
  assert lp.activation_bytes == 4 * size
  assert lp.backward_bytes == size


def testLargestVariableIsProfiled():
  lp = planner.ProfileLayers(_Fcs(1, 64), [[32, 64]]).layers[0]
  assert lp.max_var_bytes == 64 * 64 * 4  # w, not b


def testSlowLinksMakeATransferBoundPipeline():
  prof = planner.ProfileLayers(_Fcs(4, 512), [[512, 512]])
  slow = dataclasses.replace(
    device_presets.GetPreset('tpu_v3'), link_bytes_per_s=1e6, name='slow'
  )
  cand = planner.Evaluate(prof, slow, 2, 8)
  assert cand.verdict == 'transfer-bound'
  assert 'waits for transfers' in cand.reason
  assert cand.free_link_step_s < 0.7 * cand.step_s


def _Unary(name, unary, passthrough):
  return planner.LayerProfile(
    name=name,
    flops=0.0,
    in_bytes=0,
    out_bytes=0,
    activation_bytes=1000,
    num_params=0,
    param_bytes=0,
    num_ops=1,
    input_unary_bytes=unary,
    passthrough=passthrough,
  )


def testReluOfAPassedOnStateCountsOnceInACell():
  # Layer a passes its input 1 on as its output 0; layer b applies the same
  # ReLU to its input 0 (that tensor) as a did: the graph optimizer merges
  # the two, one buffer.
  a = _Unary('a', ((0, 'Relu', 50), (1, 'Relu', 100)), (1, None))
  b = _Unary('b', ((0, 'Relu', 100), (1, 'Relu', 70)), (1, None))
  assert planner.InputDuplicateBytes([a, b]) == 100
  # ... and again two layers on (b passes a's new state on).
  c = _Unary('c', ((0, 'Relu', 70),), ())
  assert planner.InputDuplicateBytes([a, b, c]) == 170
  # Another op of the same tensor, or a layer that passes nothing on: none.
  tanh = _Unary('t', ((0, 'Tanh', 100),), ())
  assert planner.InputDuplicateBytes([a, tanh]) == 0
  assert (
    planner.InputDuplicateBytes([_Unary('x', a.input_unary_bytes, ()), b]) == 0
  )
  # Cells are traced apart: the first layer of the next cell is not merged.
  profile = planner.ModelProfile(name='toy', layers=[a, b], batch_size=1)
  whole = planner.CellCosts(profile, [2], 1, 1, device_presets.GetPreset('cpu'))
  split = planner.CellCosts(
    profile, [1, 2], 1, 1, device_presets.GetPreset('cpu')
  )
  assert whole[0].activation_bytes == 2000 - 100
  assert [c.activation_bytes for c in split] == [1000, 1000]


def testAmoebaNetCellsPassTheirInputOn():
  from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

  net = (
    amoebanet.AmoebaNet.Params()
    .Set(
      num_cells=3,
      num_filters=8,
      image_size=16,
      stem_type='cifar',
      stem_filters=8,
      num_classes=10,
      head_logits=True,
    )
    .Instantiate()
  )
  profile = planner.ProfileLayers(net.Layers(), [net.InputShape(4)])
  # A cell outputs (its new state, its input 0): the next cell's input 1
  # is this cell's input 0, and both apply a ReLU to it.
  layers = profile.layers
  pairs = 0
  for a, b in zip(layers, layers[1:]):
    for j, i in enumerate(a.passthrough):
      if i is None:
        continue
      relu_a = [n for k, op, n in a.input_unary_bytes if (k, op) == (i, 'Relu')]
      relu_b = [n for k, op, n in b.input_unary_bytes if (k, op) == (j, 'Relu')]
      if relu_b:  # the head reads only the new state
        assert relu_a == relu_b, (a.name, b.name)
        pairs += 1
  assert pairs == 4  # into reduction_cell_0, cell_1, reduction_cell_1, cell_2
  dup = planner.InputDuplicateBytes(profile.layers)
  assert dup > 0
  assert dup < sum(lp.activation_bytes for lp in profile.layers) / 4


def testPlannerRanksGPipeAndOneFOneB():
  """Both schedules are predicted; where GPipe's M stored inputs do not fit
  and 1F1B's K - k do, 1F1B is the plan, and the text says so."""
  prof = planner.ProfileLayers(_Fcs(8, 256), [[1024, 256]])
  device = device_presets.GetPreset('cpu')
  both = {
    s: planner.Evaluate(prof, device, 4, 16, True, schedule=s)
    for s in ('gpipe', '1f1b')
  }
  assert both['1f1b'].max_peak_bytes < both['gpipe'].max_peak_bytes
  budget = (both['1f1b'].max_peak_bytes + both['gpipe'].max_peak_bytes) // 2
  res = planner.Plan(
    prof,
    device,
    4,
    memory_bytes=budget,
    num_stages=4,
    num_micro_batches=16,
    recompute=True,
  )
  assert res.best.schedule == '1f1b'
  # A fixed K takes only the replicas that the devices leave room for.
  assert all(c.num_devices * c.num_replicas <= 4 for c in res.rejected)
  assert {c.num_replicas for c in res.feasible + res.rejected} == {1}
  assert any(
    c.schedule == 'gpipe' and c.verdict == 'does not fit' for c in res.rejected
  )
  text = res.ToText()
  assert ' 1f1b ' in text and 'schedule' in text
  with pytest.raises(ValueError, match="schedule 'circular': the planner"):
    planner.Plan(prof, device, 4, schedules=('circular',))


def testPlannerPlansTheInterleavedScheduleOnFewerDevices():
  """'interleaved' runs K = v * D cells on D devices: its candidates use
  K / v devices, are labelled so, and with M = 2K its smaller bubble makes
  it faster than fill-drain on the same devices (free links)."""
  prof = planner.ProfileLayers(_Fcs(8, 256), [[512, 256]])
  device = device_presets.GetPreset('tpu_v3')
  fill = planner.Evaluate(prof, device, 2, 4, True, schedule='gpipe')
  inter = planner.Evaluate(
    prof, device, 4, 4, True, schedule='interleaved', virtual_stages=2
  )
  assert inter.num_devices == 2 and len(inter.peak_bytes) == 2
  assert inter.free_link_step_s < fill.free_link_step_s
  assert 'interleaved on 2 devices' in inter.Label()
  res = planner.Plan(
    prof, device, 2, num_micro_batches=4, schedules=('interleaved',)
  )
  shapes = {
    (c.num_stages, c.virtual_stages) for c in res.feasible + res.rejected
  }
  assert shapes == {(4, 2), (6, 3), (8, 4)}
  assert all(c.num_devices == 2 for c in res.feasible + res.rejected)
  with pytest.raises(ValueError, match='2 <= K <= 8'):
    planner.Plan(prof, device, 2, num_stages=9, schedules=('interleaved',))


def testLingvoLmStackProfilesWithAbsentInputsAndIds():
  """The layers of Lingvo's GPipe LM stack take the stack's 8 inputs: ids,
  paddings, four absent (None) and labels. They profile from shapes: the
  embedding's ids and the labels are ints, and the parameter counts are the
  model's."""
  from lingvo_gpipe import model_registry  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import trainer  # pylint: disable=g-import-not-at-top

  p = model_registry.GetParams(
    'lm.one_billion_wds.OneBWdsGPipeTransformerTiny', 'Train'
  )
  _, lp = trainer.PipelineLayers(p)[0]
  layer_params = [s for c in lp.cls.CellParams(lp) for s in c.sub]
  b, t = 4, 8
  ids = tf.TensorSpec([b, t], tf.int32)
  pads = tf.TensorSpec([b, t], tf.float32)
  prof = planner.ProfileLayers(
    layer_params, [ids, pads, None, None, None, None, ids, pads]
  )
  assert prof.batch_size == b
  assert [x.name for x in prof.layers][0] == 'emb'
  assert prof.layers[-1].name == 'softmax'
  model = p.Instantiate()
  assert sum(x.num_params for x in prof.layers) == sum(
    int(np.prod(v.shape)) for v in model.GetTask().vars.Flatten()
  )
  blocks = prof.layers[1:-1]
  assert all(x.flops > 0 and x.activation_bytes > 0 for x in blocks)
