"""The schedules of a PipeliningLayer: choice, errors, per-device order and
the loss on the last cell (FPropWithLoss). Their transparency is tested with
every other feature in pipelining_layer_test and pipeline_features_test."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.pipeline import schedule as schedule_lib
from tests.testing import pipeline_layers as plt

DEVICES = plt.DEVICES
P = pipelining_layer.PipeliningLayer.Params


def _Pipe(schedule, num_stages=2, devices=None, **kwargs):
  return (
    P()
    .Set(
      name='pipe',
      layers=plt.DenseLayers(),
      num_stages=num_stages,
      num_micro_batches=4,
      devices=devices or plt.Devices(schedule, num_stages),
      schedule=schedule,
      **kwargs,
    )
    .Instantiate()
  )


def testBadScheduleParams():
  with pytest.raises(
    ValueError,
    match=r"schedule='zigzag'; use one of \('gpipe', '1f1b', 'interleaved'\)",
  ):
    _Pipe('zigzag', devices=DEVICES[:2])
  with pytest.raises(
    ValueError,
    match=r'the 2 devices must divide the number of cells; got 3 cells\. '
    r'Use 2, 4, 6, 8',
  ):
    _Pipe('interleaved', num_stages=3, devices=DEVICES[:2])
  with pytest.raises(ValueError, match=r'runs cell k on device k mod 2.*Use'):
    _Pipe(
      'interleaved',
      num_stages=4,
      devices=[DEVICES[0], DEVICES[0], DEVICES[1], DEVICES[1]],
    )


def testInterleavedPlacesCellsCircularly():
  pipe = _Pipe('interleaved', num_stages=4, devices=DEVICES[:2])
  assert [d[-5:] for d in pipe.devices] == ['CPU:0', 'CPU:1'] * 2
  assert pipe.engine.Work(4) == schedule_lib.Interleaved(4, 4, 2)
  assert 'dev 1' in pipe.ScheduleText()
  assert _Pipe('1f1b').engine.Work(4) == schedule_lib.OneFOneB(2, 4)
  assert _Pipe('gpipe').engine.Work(4) == schedule_lib.FillDrain(2, 4)


def testOneFOneBWithoutALossSaysHowToGiveOne():
  pipe = _Pipe('1f1b')
  x, _ = plt.Inputs()
  with pytest.raises(ValueError, match=r"schedule='1f1b'.*FPropWithLoss"):
    with tf.GradientTape():
      pipe(x)
  # Without a tape (inference) and in eval, FProp runs the forwards.
  plt.AssertClose(
    pipe(x),
    plt.Stack.Params()
    .Set(name='pipe', layers=plt.DenseLayers())
    .Instantiate()(x),
  )
  with py_utils.EvalMode():
    pipe(x)


def testLossFunctionMustReturnAScalar():
  pipe = _Pipe('1f1b')
  x, _ = plt.Inputs()
  with pytest.raises(ValueError, match=r'must return a float scalar'):
    pipe.FPropWithLoss(pipe.theta, x, loss_fn=lambda y: y)
  with pytest.raises(TypeError, match='needs loss_fn'):
    pipe.FPropWithLoss(pipe.theta, x, loss_fn=None)


@pytest.mark.parametrize('num_stages', [1, 2, 4])
def testFPropWithLossOfGPipeEqualsFProp(reference, num_stages):
  """The loss entry point also runs 'gpipe' (forwards, then backwards)."""
  _, x, w, (ref_out, ref_loss, ref_grads, ref_in) = reference
  pipe = _Pipe('gpipe', num_stages=num_stages)

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss, out = pipe.FPropWithLoss(
        pipe.theta, x, loss_fn=plt.WeightedSum, loss_inputs=w
      )
    return out, loss, tape.gradient(loss, (pipe.trainable_variables, x))

  out, loss, (grads, in_grad) = Step(x)
  plt.AssertClose(out, ref_out)
  plt.AssertClose(loss, ref_loss)
  plt.AssertClose(in_grad, ref_in)
  for v, g in zip(pipe.trainable_variables, grads):
    assert plt.MaxRelDiff(g, ref_grads[v.name]) <= 1e-5, v.name


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved'])
def testFPropWithLossWithCompiledCells(reference, schedule):
  """With jit_compile the last cell's loss is differentiated outside its
  compiled backward call, which then takes the outputs' gradients."""
  _, x, w, (ref_out, ref_loss, ref_grads, ref_in) = reference
  num_stages = 4 if schedule == 'interleaved' else 2
  pipe = _Pipe(schedule, num_stages=num_stages, jit_compile=True)

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss, out = pipe.FPropWithLoss(
        pipe.theta, x, loss_fn=plt.WeightedSum, loss_inputs=w
      )
    return out, loss, tape.gradient(loss, (pipe.trainable_variables, x))

  out, loss, (grads, in_grad) = Step(x)
  plt.AssertClose(out, ref_out)
  plt.AssertClose(loss, ref_loss)
  plt.AssertClose(in_grad, ref_in)
  for v, g in zip(pipe.trainable_variables, grads):
    assert plt.MaxRelDiff(g, ref_grads[v.name]) <= 1e-5, v.name


@pytest.fixture(scope='module')
def reference():
  x, w = plt.Inputs()
  ref = (
    plt.Stack.Params().Set(name='pipe', layers=plt.DenseLayers()).Instantiate()
  )
  return ref, x, w, plt.LossAndGrads(ref, (x,), w)


def testLossScaleMultipliesTheGradients():
  """The tape's output gradient of the loss scales every gradient (what a
  learner's loss scaling does)."""
  pipe = _Pipe('1f1b')
  x, w = plt.Inputs()

  @tf.function
  def Grads(scale):
    with tf.GradientTape() as tape:
      loss, _ = pipe.FPropWithLoss(
        pipe.theta, x, loss_fn=plt.WeightedSum, loss_inputs=w
      )
    return tape.gradient(loss, pipe.trainable_variables, output_gradients=scale)

  one, eight = Grads(tf.constant(1.0)), Grads(tf.constant(8.0))
  for a, b in zip(one, eight):
    np.testing.assert_allclose(8.0 * a.numpy(), b.numpy(), rtol=1e-6)


def _DeviceOrder(pipe, events, num_mb):
  """[device] -> that device's events in the schedule's order."""
  when = {(p[0], k, m): (s, e) for p, k, m, s, e in events}
  per_device = {}
  for w in pipe.engine.Work(num_mb):
    per_device.setdefault(pipe.devices[w.cell], []).append(
      (w.kind[0], w.cell, w.micro_batch)
    )
  return {
    d: [(key, when[key]) for key in keys] for d, keys in per_device.items()
  }


@pytest.mark.parametrize(
  'schedule, num_stages, num_devices',
  [('gpipe', 2, 2), ('1f1b', 2, 2), ('1f1b', 4, 4), ('interleaved', 4, 2)],
)
def testEachDeviceRunsItsWorkInScheduleOrder(schedule, num_stages, num_devices):
  """With strict_order, each device's items (all its cells' forwards and
  backwards, re-materializations included) start after the previous one on
  that device ended, in the schedule's order: seen in a trace."""
  pipe = _Pipe(schedule, num_stages=num_stages, devices=DEVICES[:num_devices])
  x, w = plt.Inputs()
  tracer = schedule_lib.ScheduleTracer()

  @tf.function
  def Step(x):
    with tracer:
      with tf.GradientTape() as tape:
        if plt.UsesLoss(pipe):
          loss, _ = pipe.FPropWithLoss(
            pipe.theta, x, loss_fn=plt.WeightedSum, loss_inputs=w
          )
        else:
          loss = plt.WeightedSum(pipe(x), w)
      grads = tape.gradient(loss, pipe.trainable_variables)
    return grads, tracer.Tensors()

  for _ in range(2):
    events = tracer.Events(Step(x)[1])
    assert len(events) == 2 * num_stages * 4
    for device, items in _DeviceOrder(pipe, events, 4).items():
      assert len(items) == 2 * 4 * num_stages // num_devices
      for (prev, (_, end)), (key, (start, _)) in zip(items, items[1:]):
        assert start >= end - 1e-6, (device, prev, key, start, end)


def testOneFOneBStartsBackwardsBeforeTheLastForwards():
  """In 1F1B the first micro-batch's backward on cell 0 runs before cell 0's
  last forward: seen in a trace (with fill-drain it comes after)."""
  for schedule, before in [('1f1b', True), ('gpipe', False)]:
    pipe = _Pipe(schedule)
    x, w = plt.Inputs()
    tracer = schedule_lib.ScheduleTracer()

    @tf.function
    def Step(x, pipe=pipe, tracer=tracer, w=w):
      with tracer:
        with tf.GradientTape() as tape:
          loss, _ = pipe.FPropWithLoss(
            pipe.theta, x, loss_fn=plt.WeightedSum, loss_inputs=w
          )
        grads = tape.gradient(loss, pipe.trainable_variables)
      return grads, tracer.Tensors()

    events = tracer.Events(Step(x)[1])
    when = {(p[0], k, m): (s, e) for p, k, m, s, e in events}
    assert (when[('b', 0, 0)][1] <= when[('f', 0, 3)][0]) == before, schedule


def testOneFOneBWithDataParallelReplicas(reference):
  """R=2 replicas of a 2-cell 1F1B pipeline: the sequential gradients."""
  _, x, w, (ref_out, ref_loss, ref_grads, ref_in) = reference
  pipe = _Pipe('1f1b', devices=DEVICES, num_replicas=2)
  out, loss, grads, in_grads = plt.LossAndGrads(pipe, (x,), w)
  plt.AssertClose(out, ref_out)
  plt.AssertClose(loss, ref_loss)
  plt.AssertClose(in_grads, ref_in)
  for name, g in grads.items():
    assert plt.MaxRelDiff(g, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
@pytest.mark.parametrize('recompute', ['never', 'always'])
def testATracedStepKeepsTheGradients(reference, schedule, recompute):
  """Tracing a step (the timeline's stamps) changes no gradient, also when
  the forward tapes are kept (no re-materialization)."""
  _, x, w, (_, ref_loss, ref_grads, _) = reference
  pipe = _Pipe(schedule, recompute=recompute)
  tracer = schedule_lib.ScheduleTracer()

  @tf.function
  def Step(x):
    with tracer:
      with tf.GradientTape() as tape:
        if plt.UsesLoss(pipe):
          loss, _ = pipe.FPropWithLoss(
            pipe.theta, x, loss_fn=plt.WeightedSum, loss_inputs=w
          )
        else:
          loss = plt.WeightedSum(pipe(x), w)
      grads = tape.gradient(loss, pipe.trainable_variables)
    return loss, grads, tracer.Tensors()

  loss, grads, stamps = Step(x)
  assert len(tracer.Events(stamps)) == 2 * 2 * 4
  plt.AssertClose(loss, ref_loss)
  assert all(g is not None for g in grads)
  plt.AssertClose(grads, ref_grads)


@pytest.mark.parametrize(
  'schedule, recompute, jit, num_replicas',
  [
    ('1f1b', 'always', False, 1),
    ('1f1b', 'never', False, 1),
    ('1f1b', 'always', True, 1),
    ('gpipe', 'except_last_cell', False, 1),
    ('interleaved', 'always', False, 1),
    ('1f1b', 'always', False, 2),
  ],
)
def testLossThetaGetsTheGradientsOfTheSequentialModel(
  schedule, recompute, jit, num_replicas
):
  """Weights the loss uses outside the cells (a softmax after the pipeline)
  are differentiated on the last cell and summed over the micro-batches."""
  x, w = plt.Inputs()
  head = tf.Variable(
    np.random.RandomState(3).randn(6, 5).astype(np.float32), name='head'
  )
  labels = tf.constant(np.arange(8) % 5, tf.int32)
  ref = plt.Stack.Params().Set(name='pipe', layers=plt.DenseLayers())
  ref = ref.Instantiate()

  def Loss(out, labels, head_w):
    logits = tf.matmul(out, head_w)
    return (
      tf.reduce_sum(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
      )
      / 8.0
    )

  with tf.GradientTape() as tape:
    ref_loss = Loss(ref(x), labels, head)
  ref_grads = tape.gradient(ref_loss, list(ref.trainable_variables) + [head])
  ref_by_name = {
    v.name: g for v, g in zip(list(ref.trainable_variables) + [head], ref_grads)
  }
  num_stages = 4 if schedule == 'interleaved' else 2
  devices = plt.Devices(schedule, num_stages)
  if num_replicas == 2:
    devices = DEVICES[:4]
  pipe = _Pipe(
    schedule,
    num_stages=num_stages,
    devices=devices,
    recompute=recompute,
    jit_compile=jit,
    num_replicas=num_replicas,
  )

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      loss, _ = pipe.FPropWithLoss(
        pipe.theta,
        x,
        loss_fn=lambda out, li, lt: Loss(out, li, lt.w),
        loss_inputs=labels,
        loss_theta=py_utils.NestedMap(w=tf.convert_to_tensor(head)),
      )
    return loss, tape.gradient(loss, list(pipe.trainable_variables) + [head])

  loss, grads = Step()
  plt.AssertClose(loss, ref_loss)
  for v, g in zip(list(pipe.trainable_variables) + [head], grads):
    assert g is not None, v.name
    assert plt.MaxRelDiff(g, ref_by_name[v.name]) <= 1e-5, v.name
