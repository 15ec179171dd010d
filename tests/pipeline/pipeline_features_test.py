"""Pipeline features beyond plain transparency.

Deterministic re-materialization of random ops, weights shared across cells,
batch norm statistics per micro-batch with moving averages over the whole
mini-batch (each for every schedule), partitioning by every cost source.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.planning import partition
from tests.testing import pipeline_layers

plt = pipeline_layers
DEVICES = plt.DEVICES
SCHEDULES = plt.SCHEDULES
PipeliningLayer = pipelining_layer.PipeliningLayer


def Run(pipe, x, loss_fn):
  """(outputs, loss) of `pipe` on x: FProp then loss_fn for 'gpipe', the
  loss on the last cell (FPropWithLoss) for the other schedules."""
  if plt.UsesLoss(pipe):
    loss, y = pipe.FPropWithLoss(pipe.theta, x, loss_fn=loss_fn)
    return y, loss
  y = pipe(x)
  return y, loss_fn(y)


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('policy', ['always', 'never'])
def testRecomputeDrawsTheForwardRandomValues(policy, schedule):
  """d(sum(y))/dx = u: equal to y / x only if the recompute redraws u."""
  layers = [
    pipeline_layers.RandomScale.Params().Set(name=f'r{i}') for i in range(4)
  ]
  pipe = (
    PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=layers,
      num_stages=4,
      num_micro_batches=4,
      devices=plt.Devices(schedule, 4),
      recompute=policy,
      schedule=schedule,
    )
    .Instantiate()
  )
  x = tf.random.uniform([8, 5], 1.0, 2.0)

  @tf.function
  def Step(x, step):
    with py_utils.StepSeed(step):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y, total = Run(pipe, x, tf.reduce_sum)
      return y, tape.gradient(total, x)

  y, dx = Step(x, tf.constant(7, tf.int64))
  np.testing.assert_allclose(dx.numpy(), (y / x).numpy(), rtol=1e-6)
  # A different step draws different values; the same step the same ones.
  y2, _ = Step(x, tf.constant(8, tf.int64))
  y3, _ = Step(x, tf.constant(7, tf.int64))
  assert not np.allclose(y.numpy(), y2.numpy())
  np.testing.assert_array_equal(y.numpy(), y3.numpy())


class TiedDense(pipeline_layers.Dense):
  """A Dense layer whose weight is shared under `tie` (if set)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('tie', None, 'shared_name of w.')
    return p

  def __init__(self, params):
    base_layer.BaseLayer.__init__(self, params)
    p = self.params
    self.CreateVariable(
      'w', py_utils.WeightParams([p.input_dim, p.output_dim], shared_name=p.tie)
    )
    self.CreateVariable(
      'b',
      py_utils.WeightParams([p.output_dim], py_utils.WeightInit.Constant(0.1)),
    )


def _TiedLayers():
  layers = pipeline_layers.DenseLayers(4)
  layers[0] = TiedDense.Params().Set(
    name='fc_0', input_dim=6, output_dim=6, tie='emb'
  )
  layers[3] = TiedDense.Params().Set(
    name='fc_3', input_dim=6, output_dim=6, tie='emb'
  )
  return layers


@pytest.mark.parametrize('schedule', SCHEDULES)
def testWeightsSharedAcrossCells(schedule):
  """First and last cell use one variable; gradients from both are summed."""
  x, w = pipeline_layers.Inputs()
  ref = (
    pipeline_layers.Stack.Params()
    .Set(name='pipe', layers=_TiedLayers())
    .Instantiate()
  )
  pipe = (
    PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=_TiedLayers(),
      num_stages=4,
      num_micro_batches=4,
      devices=plt.Devices(schedule, 4),
      schedule=schedule,
    )
    .Instantiate()
  )
  assert pipe.body[0].vars.w is pipe.body[3].vars.w
  assert 'pipe/fc_3/w' not in pipe.VariablesByName()
  assert len(pipe.trainable_variables) == 7
  ref_out, _, ref_grads, _ = pipeline_layers.LossAndGrads(ref, (x,), w)
  out, _, grads, _ = pipeline_layers.LossAndGrads(pipe, (x,), w)
  pipeline_layers.AssertClose(out, ref_out)
  for name, g in grads.items():
    assert pipeline_layers.MaxRelDiff(g, ref_grads[name]) <= 1e-5, name
  # The tied gradient really has two contributions: compare with untied.
  untied = (
    pipeline_layers.Stack.Params()
    .Set(name='pipe', layers=pipeline_layers.DenseLayers(4))
    .Instantiate()
  )
  for name, v in untied.VariablesByName().items():
    v.assign(
      ref.VariablesByName()['pipe/fc_0/w' if name == 'pipe/fc_3/w' else name]
    )
  _, _, untied_grads, _ = pipeline_layers.LossAndGrads(untied, (x,), w)
  np.testing.assert_allclose(
    grads['pipe/fc_0/w:0'],
    untied_grads['pipe/fc_0/w:0'] + untied_grads['pipe/fc_3/w:0'],
    rtol=1e-5,
    atol=1e-6,
  )


def testSharedWeightShapeMismatchIsAnError():
  layers = _TiedLayers()
  layers[3] = TiedDense.Params().Set(
    name='fc_3', input_dim=6, output_dim=5, tie='emb'
  )
  with pytest.raises(ValueError, match='shares .emb. with pipe/fc_0/w'):
    pipeline_layers.Stack.Params().Set(name='pipe', layers=layers).Instantiate()


class Scale(base_layer.BaseLayer):
  """Layer without FPropMeta: costs come from the traced default."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w', py_utils.WeightParams([self.params.dim] * 2))

  def FProp(self, theta, x):
    return tf.matmul(x, theta.w)


def _Widths(widths):
  return [
    pipeline_layers.Dense.Params().Set(
      name=f'fc_{i}', input_dim=a, output_dim=b
    )
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))
  ]


def testPartitionByFlopsAndParams():
  # Layer costs 4x4=16, 4x16=64, 16x16=256, 16x4=64, 4x4=16 (x 2 x batch).
  layers = _Widths([4, 4, 16, 16, 4, 4])
  costs = partition.LayerCosts(layers, 'flops', [[8, 4]])
  assert costs == [2 * 8 * c for c in (16, 64, 256, 64, 16)]
  params = partition.LayerCosts(layers, 'params')
  assert params == [20, 80, 272, 68, 20]
  assert partition.ComputeSplits(layers, 3, None, 'flops', [[8, 4]]) == [
    2,
    3,
    5,
  ]
  pipe = (
    PipeliningLayer.Params()
    .Set(
      name='p',
      layers=layers,
      num_stages=3,
      devices=DEVICES[:3],
      input_shapes=[[8, 4]],
    )
    .Instantiate()
  )
  assert pipe.splits == [2, 3, 5]
  report = partition.Report(layers, pipe.splits, 'flops', [[8, 4]])
  assert report.cells[1].params == 272
  assert report.imbalance == pytest.approx(256 / (416 / 3))
  assert 'fc_2' in report.ToText()


def testPartitionByTracedFlopsForLayersWithoutFormula():
  layers = [
    Scale.Params().Set(name=f's{i}', dim=d) for i, d in enumerate([4, 4, 4])
  ]
  metas = partition.LayerMetas(layers, [8, 4])
  # MatMul [8,4]x[4,4]: TF counts 2*8*4*4 flops.
  assert [m[0] for m in metas] == [256, 256, 256]
  assert metas[-1][2][0].as_list() == [8, 4]


def testPartitionByMeasuredTime():
  layers = _Widths([32, 32, 256, 32, 32])
  costs = partition.LayerCosts(
    layers, 'time', [[64, 32]], device='/device:CPU:0'
  )
  assert len(costs) == 4 and all(c > 0 for c in costs)
  splits = partition.ComputeSplits(
    layers, 2, None, 'time', [[64, 32]], device='/device:CPU:0'
  )
  assert len(splits) == 2 and splits[-1] == 4


def testUniformAndExplicitSplitsAndLingvoHelper():
  layers = pipeline_layers.DenseLayers(6)
  assert partition.ComputeSplits(layers, 3, None, 'uniform') == [2, 4, 6]
  assert partition.ComputeSplits(layers, None, [1, 6], 'flops') == [1, 6]
  assert partition.ComputeSplits(layers, None, 3, 'uniform') == [2, 4, 6]
  cells = partition.PartitionSequentialLayers(layers, 2, [8, 6])
  assert [len(c.sub) for c in cells] == [3, 3]
  pipe = (
    PipeliningLayer.Params()
    .Set(name='p', cell_tpl=cells, devices=DEVICES[:2])
    .Instantiate()
  )
  assert pipe.num_stages == 2
  with pytest.raises(ValueError, match='needs the input shapes'):
    partition.ComputeSplits(layers, 2, None, 'flops')


def testFPropMetaOfPipeline():
  p = PipeliningLayer.Params().Set(
    name='p', layers=pipeline_layers.DenseLayers(4), num_stages=2
  )
  meta = PipeliningLayer.FPropMeta(p, [8, 6])
  assert meta.flops == 4 * 2 * 8 * 6 * 6
  assert meta.out_shapes[0].as_list() == [8, 6]
  assert base_layer.CountParams(p) == 4 * (36 + 6)


@pytest.mark.parametrize('schedule', SCHEDULES)
def testBatchNormPerMicroBatchStatsAndWholeBatchMovingAverages(schedule):
  num_mb, batch, dim = 4, 16, 6
  layers = pipeline_layers.NormLayers(dim)
  pipe = (
    PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=layers,
      num_stages=2,
      num_micro_batches=num_mb,
      devices=plt.Devices(schedule, 2),
      splits=[2, 3],
      schedule=schedule,
    )
    .Instantiate()
  )
  ref = (
    pipeline_layers.Stack.Params().Set(name='pipe', layers=layers).Instantiate()
  )
  x = tf.random.normal([batch, dim], seed=3)

  @tf.function
  def Train(x):
    with py_utils.UpdateCollector() as updates:
      with tf.GradientTape() as tape:
        y, loss = Run(pipe, x, lambda y: tf.reduce_sum(y * y))
      grads = tape.gradient(loss, pipe.trainable_variables)
    updates.Apply()
    return y, grads, len(updates.updates)

  # Reference: the plain stack on each micro-batch alone (its statistics),
  # moving averages from the statistics of the whole mini-batch.
  def RefTrain(x):
    ys, losses = [], []
    with tf.GradientTape() as tape:
      with py_utils.UpdateCollector():  # reference updates computed below
        for xm in tf.split(x, num_mb):
          y = ref(xm)
          ys.append(y)
          losses.append(tf.reduce_sum(y * y))
      loss = tf.add_n(losses)
    grads = tape.gradient(loss, ref.trainable_variables)
    h = tf.tanh(tf.matmul(x, ref.body[0].vars.w) + ref.body[0].vars.b)
    mean, var = tf.nn.moments(h, [0])
    return tf.concat(ys, 0), grads, mean, var

  y, grads, num_updates = Train(x)
  assert int(num_updates) == num_mb
  ref_y, ref_grads, mean, var = RefTrain(x)
  pipeline_layers.AssertClose(y, ref_y)
  for g, rg in zip(grads, ref_grads):
    assert pipeline_layers.MaxRelDiff(g, rg) <= 1e-5
  bn = pipe.body[1]
  np.testing.assert_allclose(
    bn.vars.moving_mean.numpy(), 0.1 * mean.numpy(), rtol=1e-5, atol=1e-7
  )
  np.testing.assert_allclose(
    bn.vars.moving_variance.numpy(), 0.9 + 0.1 * var.numpy(), rtol=1e-5
  )
  # Evaluation uses the moving averages, and updates nothing.
  before = bn.vars.moving_mean.numpy().copy()
  with py_utils.EvalMode():
    y_eval = tf.function(lambda x: pipe(x))(x)
  h = tf.tanh(tf.matmul(x, ref.body[0].vars.w) + ref.body[0].vars.b)
  n = (h - bn.vars.moving_mean) * tf.math.rsqrt(bn.vars.moving_variance + 1e-3)
  expected = tf.tanh(tf.matmul(n, ref.body[2].vars.w) + ref.body[2].vars.b)
  pipeline_layers.AssertClose(y_eval, expected)
  np.testing.assert_array_equal(before, bn.vars.moving_mean.numpy())


@pytest.mark.parametrize('dtype', [tf.bfloat16, tf.float16])
def testMixedPrecisionComputeWithFloat32MasterWeights(dtype):
  """fprop_dtype=bfloat16/float16: the cells compute in that type, the
  variables and their gradients stay float32, and the result tracks the
  float32 model."""
  x, w = pipeline_layers.Inputs()
  pipe32 = (
    PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=pipeline_layers.DenseLayers(4),
      num_stages=2,
      num_micro_batches=2,
      devices=DEVICES[:2],
    )
    .Instantiate()
  )
  pipe16 = (
    PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=pipeline_layers.DenseLayers(4),
      num_stages=2,
      num_micro_batches=2,
      devices=DEVICES[:2],
      fprop_dtype=dtype,
    )
    .Instantiate()
  )
  assert all(v.dtype == tf.float32 for v in pipe16.trainable_variables)

  @tf.function
  def Step16(x):
    with tf.GradientTape() as tape:
      y = pipe16(tf.cast(x, dtype))
      loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
    return y, tape.gradient(loss, pipe16.trainable_variables)

  y16, grads16 = Step16(x)
  assert y16.dtype == dtype
  y32, _, grads32, _ = pipeline_layers.LossAndGrads(pipe32, (x,), w)
  np.testing.assert_allclose(
    tf.cast(y16, tf.float32).numpy(), y32.numpy(), atol=0.05
  )
  for v, g in zip(pipe16.trainable_variables, grads16):
    assert g.dtype == tf.float32
    np.testing.assert_allclose(g.numpy(), grads32[v.name], atol=0.1, rtol=0.1)


class WithNone(base_layer.BaseLayer):
  """Returns (2x, None, x + 1), as Lingvo layers return None for an unused
  output."""

  def FProp(self, theta, x):
    del theta
    return 2.0 * x, None, x + 1.0


@pytest.mark.parametrize('schedule', SCHEDULES)
def testLastCellsNoneOutputsKeepTheirPlaces(schedule):
  layers = plt.DenseLayers(4) + [WithNone.Params().Set(name='with_none')]
  pipe = plt.Pipe(
    layers,
    num_stages=4 if schedule == 'interleaved' else 2,
    devices=plt.Devices(schedule, 4 if schedule == 'interleaved' else 2),
    num_micro_batches=2,
    schedule=schedule,
  )
  x = tf.random.stateless_normal([4, 6], [1, 2])
  # The same names, so the same initial weights.
  ref = plt.Stack.Params().Set(name='pipe', layers=layers).Instantiate()
  ref_a, ref_none, ref_b = ref.FProp(ref.theta, x)
  assert ref_none is None
  if schedule == 'gpipe':
    a, none, b = pipe(x)
    assert none is None
    np.testing.assert_allclose(a, ref_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, ref_b, rtol=1e-5, atol=1e-6)
  seen = []

  def LossFn(out):
    # The loss sees the outputs as FProp returns them: None in its place.
    seen.append(out[1])
    return tf.reduce_sum(out[0]) + tf.reduce_sum(out[2])

  loss, (a, none, b) = pipe.FPropWithLoss(pipe.theta, x, loss_fn=LossFn)
  assert seen and all(s is None for s in seen)
  assert none is None
  np.testing.assert_allclose(a, ref_a, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(b, ref_b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    loss, tf.reduce_sum(ref_a) + tf.reduce_sum(ref_b), rtol=1e-5
  )
