"""Transparency of the pipeline: pipelined == sequential, for every K and M.

The heart of the project's tests. A PipeliningLayer and a plain sequential
stack built from the same layer Params get the same variable names, hence the
same initial weights; their outputs and gradients must agree to float32
rounding for every number of cells K and micro-batches M, and for every
schedule: 'gpipe' through FProp, '1f1b' and 'interleaved' through
FPropWithLoss (the loss on the last cell, forwards and backwards in the
schedule's order).
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.pipeline import pipelining_layer
from tests.testing import pipeline_layers

DEVICES = pipeline_layers.DEVICES
Dense = pipeline_layers.Dense
TwoState = pipeline_layers.TwoState
Stack = pipeline_layers.Stack
DenseLayers = pipeline_layers.DenseLayers
LossAndGrads = pipeline_layers.LossAndGrads
MaxRelDiff = pipeline_layers.MaxRelDiff
AssertClose = pipeline_layers.AssertClose
_Inputs = pipeline_layers.Inputs
SCHEDULES = pipeline_layers.SCHEDULES
Devices = pipeline_layers.Devices
UsesLoss = pipeline_layers.UsesLoss
WeightedSum = pipeline_layers.WeightedSum


@pytest.fixture(scope='module')
def reference():
  return pipeline_layers.Reference()


@pytest.mark.parametrize(
  'schedule, num_micro_batches',
  [(s, m) for s in SCHEDULES for m in [1, 2, 4]]
  + [
    pytest.param(s, 8, marks=pytest.mark.slow if s != 'gpipe' else ())
    for s in SCHEDULES
  ],
)
@pytest.mark.parametrize('num_stages', [1, 2, 4])
def testTransparency(reference, num_stages, num_micro_batches, schedule):
  ref, x, w, (ref_out, ref_loss, ref_grads, ref_in_grads) = reference
  p = pipelining_layer.PipeliningLayer.Params().Set(
    name='pipe',
    layers=DenseLayers(),
    num_stages=num_stages,
    num_micro_batches=num_micro_batches,
    devices=Devices(schedule, num_stages),
    input_shapes=[[8, 6]],
    schedule=schedule,
  )
  pipe = p.Instantiate()
  assert pipe.num_stages == num_stages
  # Split-independent names and initial values.
  assert sorted(pipe.VariablesByName()) == sorted(ref.VariablesByName())
  for name, v in pipe.VariablesByName().items():
    np.testing.assert_array_equal(v.numpy(), ref.VariablesByName()[name])
  out, loss, grads, in_grads = LossAndGrads(pipe, (x,), w)
  AssertClose(out, ref_out)
  AssertClose(loss, ref_loss)
  assert sorted(grads) == sorted(ref_grads)
  for name in grads:
    assert MaxRelDiff(grads[name], ref_grads[name]) <= 1e-5, name
  AssertClose(in_grads, ref_in_grads)


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('policy', pipelining_layer.RECOMPUTE_POLICIES)
def testRecomputePoliciesGiveSameGradients(reference, policy, schedule):
  _, x, w, (ref_out, _, ref_grads, _) = reference
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=DenseLayers(),
      num_stages=2 if schedule != 'interleaved' else 4,
      num_micro_batches=4,
      devices=Devices(schedule, 2 if schedule != 'interleaved' else 4),
      recompute=policy,
      schedule=schedule,
    )
    .Instantiate()
  )
  out, _, grads, _ = LossAndGrads(pipe, (x,), w)
  AssertClose(out, ref_out)
  for name in grads:
    assert MaxRelDiff(grads[name], ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize('schedule', SCHEDULES)
def testCellTplFormAndNestedState(schedule):
  """Lingvo's cell_tpl form with a two-tensor NestedMap state."""
  cells = [
    pipelining_layer.FeatureExtractionLayer.Params().Set(
      name=f'cell_{k}',
      sub=[TwoState.Params().Set(name=f'l{k}_{j}') for j in range(2)],
    )
    for k in range(3)
  ]
  flat = [
    TwoState.Params().Set(name=f'l{k}_{j}') for k in range(3) for j in range(2)
  ]
  rng = np.random.RandomState(1)
  state = NestedMap(
    prev=tf.constant(rng.randn(8, 4), tf.float32),
    cur=tf.constant(rng.randn(8, 4), tf.float32),
  )
  w = NestedMap(
    prev=tf.constant(rng.randn(8, 4), tf.float32),
    cur=tf.constant(rng.randn(8, 4), tf.float32),
  )
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      cell_tpl=cells,
      num_micro_batches=4,
      devices=DEVICES[:3] if schedule != 'interleaved' else DEVICES[:1],
      schedule=schedule,
    )
    .Instantiate()
  )
  flat_pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=flat,
      num_stages=1,
      devices=DEVICES[:1],
      num_micro_batches=1,
    )
    .Instantiate()
  )
  # Copy weights across naming schemes: pipe/cell_k/l{k}_{j} -> pipe/l{k}_{j}.
  for name, v in pipe.VariablesByName().items():
    short = 'pipe/' + name.split('/', 2)[2]
    v.assign(flat_pipe.VariablesByName()[short])
  out, _, grads, in_grads = LossAndGrads(pipe, (state,), w)
  ref_out, _, ref_grads, ref_in = LossAndGrads(flat_pipe, (state,), w)
  AssertClose(out, ref_out)
  AssertClose(in_grads, ref_in)
  for name, g in grads.items():
    short = 'pipe/' + name.split('/', 2)[2].split(':')[0] + ':0'
    assert MaxRelDiff(g, ref_grads[short]) <= 1e-5


def testEvalModeForwardOnly(reference):
  ref, x, _, (ref_out, _, _, _) = reference
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=DenseLayers(),
      num_stages=2,
      num_micro_batches=1,
      devices=DEVICES[:2],
    )
    .Instantiate()
  )
  with py_utils.EvalMode():
    out = tf.function(lambda x: pipe(x))(x)
  AssertClose(out, ref_out)


@pytest.mark.parametrize('schedule', SCHEDULES)
def testEagerExecution(reference, schedule):
  _, x, w, (ref_out, _, ref_grads, ref_in) = reference
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=DenseLayers(),
      num_stages=2,
      num_micro_batches=2,
      devices=Devices(schedule, 2),
      schedule=schedule,
    )
    .Instantiate()
  )
  out, _, grads, in_grads = LossAndGrads(pipe, (x,), w, eager=True)
  AssertClose(out, ref_out)
  AssertClose(in_grads, ref_in)
  for name, g in grads.items():
    assert MaxRelDiff(g, ref_grads[name]) <= 1e-5


def testVariablesLiveOnTheirCellsDevice():
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=DenseLayers(4),
      num_stages=2,
      devices=DEVICES[:2],
      splits=[1, 4],
    )
    .Instantiate()
  )
  assert pipe.splits == [1, 4]
  assert pipe.body[0].vars.w.device.endswith('CPU:0')
  for i in range(1, 4):
    assert pipe.body[i].vars.w.device.endswith('CPU:1')
  assert 'cell 1 on' in pipe.PlacementText()


_OVERLAP_SCRIPT = """
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
from lingvo_gpipe.core import cluster
cluster.SplitCpu(2)
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.pipeline import schedule
from tests.testing.pipeline_layers import Dense
dim = 512
layers = [Dense.Params().Set(name=f'fc_{i}', input_dim=dim, output_dim=dim)
          for i in range(4)]
pipe = pipelining_layer.PipeliningLayer.Params().Set(
    name='pipe', layers=layers, num_stages=2, num_micro_batches=8,
    devices=['/device:CPU:0', '/device:CPU:1']).Instantiate()
x = tf.random.normal([1024, dim])
tracer = schedule.ScheduleTracer()

@tf.function
def Step(x):
  with tracer:
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe(x))
    grads = tape.gradient(loss, pipe.trainable_variables)
  return loss, grads, tracer.Tensors()

Step(x)
best = 0.0
for _ in range(3):
  events = tracer.Events(Step(x)[2])
  assert len(events) == 2 * 2 * 8, len(events)
  fwd = {(k, m): (s, e) for (ps, k, m, s, e) in events if ps == 'forward'}
  for m in range(8):  # cell 1 starts micro-batch m after cell 0 ended it
    assert fwd[(1, m)][0] >= fwd[(0, m)][1] - 1e-4, m
  overlap = sum(max(0.0, min(e0, e1) - max(s0, s1))
                for (s0, e0) in [fwd[(0, m)] for m in range(8)]
                for (s1, e1) in [fwd[(1, m)] for m in range(8)])
  busy = sum(e - s for (s, e) in fwd.values())
  best = max(best, overlap / busy)
print('OVERLAP', best)
"""


def testCellsOverlapInTrace():
  """Cell 0 runs micro-batch m+1 while cell 1 runs m: seen in a trace.

  Runs in a process of its own with one intra-op and two inter-op threads,
  so two virtual devices can run one op each at the same time.
  """
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from tests.testing import warm_python  # pylint: disable=g-import-not-at-top

  root = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  out = warm_python.Run(
    [sys.executable, '-c', _OVERLAP_SCRIPT],
    cwd=root,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert 'OVERLAP' in out.stdout, out.stderr[-3000:]
  # A clearly positive share of the forward work ran concurrently.
  assert float(out.stdout.split('OVERLAP')[1]) > 0.05, out.stdout


def testBadInputErrors():
  P = pipelining_layer.PipeliningLayer.Params
  with pytest.raises(ValueError, match='does not divide the batch size 8'):
    pipe = (
      P()
      .Set(
        name='p',
        layers=DenseLayers(2),
        num_stages=2,
        num_micro_batches=3,
        devices=DEVICES[:2],
      )
      .Instantiate()
    )
    pipe(tf.zeros([8, 6]))
  with pytest.raises(ValueError, match='micro_batch_size=3'):
    pipe = (
      P()
      .Set(
        name='p',
        layers=DenseLayers(2),
        num_stages=1,
        micro_batch_size=3,
        devices=DEVICES[:1],
      )
      .Instantiate()
    )
    pipe(tf.zeros([8, 6]))
  with pytest.raises(ValueError, match='more than the 2 layers'):
    P().Set(name='p', layers=DenseLayers(2), num_stages=3).Instantiate()
  with pytest.raises(ValueError, match=r'4 stages but only 2 devices'):
    P().Set(
      name='p', layers=DenseLayers(4), num_stages=4, devices=DEVICES[:2]
    ).Instantiate()
  with pytest.raises(ValueError, match='does not exist. Available devices'):
    P().Set(
      name='p',
      layers=DenseLayers(2),
      num_stages=2,
      devices=['/device:CPU:0', '/device:CPU:9'],
    ).Instantiate()
  with pytest.raises(ValueError, match='cell 1 is empty'):
    P().Set(
      name='p', layers=DenseLayers(3), splits=[2, 2, 3], devices=DEVICES[:3]
    ).Instantiate()
  with pytest.raises(ValueError, match='no sub layers'):
    P().Set(
      name='p',
      cell_tpl=[pipelining_layer.FeatureExtractionLayer.Params()],
      devices=DEVICES[:1],
    ).Instantiate()
  bad = DenseLayers(4)
  bad[2] = Dense.Params().Set(name='fc_2', input_dim=5, output_dim=6)
  with pytest.raises(
    ValueError,
    match=r"Pipeline 'p' cell 1 \(fc_2, fc_3\) cannot take "
    r'the output of cell 0 \(fc_0, fc_1\), of shapes \[8, 6\]: its first '
    r'layer fc_2 \(Dense\) says: .*\. Make fc_2 accept what fc_1, the last '
    r'layer of cell 0, returns\.$',
  ):
    P().Set(
      name='p',
      layers=bad,
      splits=[2, 4],
      devices=DEVICES[:2],
      input_shapes=[[8, 6]],
    ).Instantiate()


def testShapeErrorsNameTheCellAndLayer():
  P = pipelining_layer.PipeliningLayer.Params
  bad = DenseLayers(4)
  bad[0] = Dense.Params().Set(name='fc_0', input_dim=5, output_dim=6)
  with pytest.raises(ValueError) as e:
    P().Set(
      name='p', layers=bad, splits=[2, 4], input_shapes=[[8, 6]]
    ).Instantiate()
  assert str(e.value).startswith(
    "Pipeline 'p' cell 0 (fc_0, fc_1) cannot take the pipeline input, of "
    'shapes [8, 6] (input_shapes): its first layer fc_0 (Dense) says: '
  )
  assert '..' not in str(e.value)
  bad = DenseLayers(4)
  bad[3] = Dense.Params().Set(name='fc_3', input_dim=5, output_dim=6)
  with pytest.raises(ValueError) as e:
    P().Set(
      name='p', layers=bad, splits=[2, 4], input_shapes=[[8, 6]]
    ).Instantiate()
  assert str(e.value).startswith(
    "Pipeline 'p' cell 1 (fc_2, fc_3): layer fc_3 (Dense) cannot take the "
    'output of fc_2, of shapes [8, 6]: '
  )


def testWithoutInputShapesTheFirstBatchIsChecked():
  P = pipelining_layer.PipeliningLayer.Params
  bad = DenseLayers(4)
  bad[2] = Dense.Params().Set(name='fc_2', input_dim=5, output_dim=6)
  pipe = P().Set(name='p', layers=bad, splits=[2, 4]).Instantiate()

  @tf.function
  def Step(x):
    return pipe(x)

  with pytest.raises(
    ValueError,
    match=r"Pipeline 'p' cell 1 \(fc_2, fc_3\) cannot take the output of "
    r'cell 0 \(fc_0, fc_1\), of shapes \[3, 6\]: .* Make fc_2 accept',
  ):
    Step(tf.ones([3, 6]))
  # Eagerly too, and a good pipeline passes the check.
  with pytest.raises(ValueError, match=r"Pipeline 'p' cell 1"):
    P().Set(name='p', layers=bad, splits=[2, 4]).Instantiate()(tf.ones([3, 6]))
  good = P().Set(name='p', layers=DenseLayers(4), splits=[2, 4]).Instantiate()
  assert good(tf.ones([3, 6])).shape == [3, 6]


def testCheckBatchNamesThePipeline():
  P = pipelining_layer.PipeliningLayer.Params
  pipe = (
    P()
    .Set(name='p', layers=DenseLayers(2), num_stages=2, num_micro_batches=3)
    .Instantiate()
  )
  assert pipe.CheckBatch(6) == (1, 3)
  with pytest.raises(
    ValueError, match=r"Pipeline 'p': num_micro_batches=3 does not divide"
  ):
    pipe.CheckBatch(8)


def testEvalRunsBatchesThatMDoesNotDivide(reference):
  _, x, _, _ = reference
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=DenseLayers(),
      num_stages=2,
      num_micro_batches=4,
      devices=DEVICES[:2],
    )
    .Instantiate()
  )
  with py_utils.EvalMode():
    five = tf.function(lambda x: pipe(x))(x[:5])
    unknown = tf.function(
      lambda x: pipe(x), input_signature=[tf.TensorSpec([None, 6], tf.float32)]
    )(x[:3])
  np.testing.assert_allclose(five.numpy()[:3], unknown.numpy(), rtol=1e-6)
  with pytest.raises(ValueError, match='does not divide the batch size 5'):
    pipe(x[:5])


def testLingvoCompatibilityParamsAreChecked():
  P = pipelining_layer.PipeliningLayer.Params
  cell = pipelining_layer.FeatureExtractionLayer.Params().Set(
    sub=DenseLayers(1)
  )
  with pytest.raises(
    ValueError, match='num_act_outputs=2 must be num_act_inputs.* = 1'
  ):
    cell.Copy().Set(name='c', num_act_inputs=1, num_act_outputs=2).Instantiate()
  with pytest.raises(ValueError, match="names 'nope', which is not a sub"):
    cell.Copy().Set(
      name='c', act_fetch_layers=['nope'], num_act_outputs=1
    ).Instantiate()
  with pytest.raises(
    ValueError, match="PipeliningLayer 'p': state_dtype=int32 cannot carry"
  ):
    P().Set(
      name='p',
      layers=DenseLayers(2),
      num_stages=1,
      devices=DEVICES[:1],
      state_dtype=tf.int32,
    ).Instantiate()
  pipe = (
    P()
    .Set(
      name='p',
      layers=DenseLayers(2),
      num_stages=2,
      devices=DEVICES[:2],
      state_dtype=tf.bfloat16,
      nested_map_fprop=True,
    )
    .Instantiate()
  )
  with pytest.raises(
    ValueError,
    match="Pipeline 'p': state_dtype=bfloat16 cannot carry output 0 of cell "
    '0, a float32 tensor',
  ):
    pipe(tf.ones([2, 6]))
  # The defaults still build.
  P().Set(name='p', cell_tpl=[cell.Copy()], devices=DEVICES[:1]).Instantiate()
