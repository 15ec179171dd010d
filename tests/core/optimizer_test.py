"""Tests for lingvo_gpipe.core.optimizer: NumPy references, slot names."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import optimizer

_LR = 0.1
_STEPS = 4


def _Grads(shape, seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randn(*shape).astype(np.float32) for _ in range(_STEPS)]


def _Run(opt_params, init, grads, name='layer/w', use_function=False):
  var = tf.Variable(init, name=name)
  opt = opt_params.Instantiate()
  opt.CreateSlots([var])

  def Step(g):
    opt.Apply(tf.constant(_LR), [(g, var)])

  step = tf.function(Step) if use_function else Step
  for g in grads:
    step(tf.constant(g))
  return var.numpy(), opt


# NumPy references of TF1's update rules -----------------------------------


def _NpSGD(w, grads):
  for g in grads:
    w = w - _LR * g
  return w


def _NpMomentum(w, grads, alpha, nesterov):
  accum = np.zeros_like(w)
  for g in grads:
    accum = alpha * accum + g
    w = w - _LR * (g + alpha * accum if nesterov else accum)
  return w


def _NpRMSProp(w, grads, decay, momentum, eps, centered):
  ms, mom, mg = np.ones_like(w), np.zeros_like(w), np.zeros_like(w)
  for g in grads:
    ms = decay * ms + (1 - decay) * g * g
    denom = ms
    if centered:
      mg = decay * mg + (1 - decay) * g
      denom = ms - mg * mg
    mom = momentum * mom + _LR * g / np.sqrt(denom + eps)
    w = w - mom
  return w


def _NpAdam(w, grads, b1, b2, eps):
  m, v = np.zeros_like(w), np.zeros_like(w)
  for t, g in enumerate(grads, 1):
    lr_t = _LR * np.sqrt(1 - b2**t) / (1 - b1**t)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w = w - lr_t * m / (np.sqrt(v) + eps)
  return w


def _Rms(x):
  return np.sqrt(np.mean(x * x))


def _NpAdafactor(w, grads, factored, beta1, clip, mbps, eps1=1e-30, eps2=1e-3):
  vr = np.zeros(w.shape[:-1])
  vc = np.zeros(w.shape[:-2] + w.shape[-1:])
  v, m = np.zeros_like(w), np.zeros_like(w)
  for t, g in enumerate(grads, 1):
    decay = 1.0 - t**-0.8
    g2 = g * g + eps1
    if factored:
      vr = decay * vr + (1 - decay) * g2.mean(-1)
      vc = decay * vc + (1 - decay) * g2.mean(-2)
      r = 1 / np.sqrt(vr / vr.mean(-1, keepdims=True))
      c = 1 / np.sqrt(vc)
      u = g * r[..., None] * c[..., None, :]
    else:
      v = decay * v + (1 - decay) * g2
      u = g / np.sqrt(v)
    if clip:
      u = u / max(1.0, _Rms(u) / clip)
    u = u * _LR * (max(_Rms(w), eps2) if mbps else 1.0)
    if beta1:
      m = beta1 * m + (1 - beta1) * u
      u = m
    w = w - u
  return w


# Tests ----------------------------------------------------------------------


def _Init(shape):
  return np.random.RandomState(42).randn(*shape).astype(np.float32)


@pytest.mark.parametrize('use_function', [False, True])
def testSgd(use_function):
  w0, grads = _Init([3, 2]), _Grads([3, 2])
  got, _ = _Run(optimizer.SGD.Params(), w0, grads, use_function=use_function)
  np.testing.assert_allclose(got, _NpSGD(w0, grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('nesterov', [False, True])
def testMomentum(nesterov):
  w0, grads = _Init([4]), _Grads([4])
  p = optimizer.Momentum.Params().Set(alpha=0.8, use_nesterov=nesterov)
  got, opt = _Run(p, w0, grads)
  np.testing.assert_allclose(
    got, _NpMomentum(w0, grads, 0.8, nesterov), rtol=1e-5, atol=1e-6
  )
  assert sorted(opt.slots()) == ['layer/w/momentum']


@pytest.mark.parametrize(
  'momentum, centered', [(0.0, False), (0.9, False), (0.9, True)]
)
def testRmsprop(momentum, centered):
  w0, grads = _Init([3, 2]), _Grads([3, 2])
  p = optimizer.RMSProp.Params().Set(
    decay=0.9, momentum=momentum, epsilon=1e-3, centered=centered
  )
  got, opt = _Run(p, w0, grads)
  want = _NpRMSProp(w0, grads, 0.9, momentum, 1e-3, centered)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  slots = {'layer/w/rms', 'layer/w/momentum'} | (
    {'layer/w/mg'} if centered else set()
  )
  assert set(opt.slots()) == slots
  # TF1 starts the mean square at 1.
  fresh = optimizer.RMSProp.Params().Instantiate()
  v = tf.Variable(tf.zeros([2]), name='fresh/w')
  fresh.CreateSlots([v])
  np.testing.assert_array_equal(fresh.GetSlot(v, 'rms').numpy(), [1.0, 1.0])


@pytest.mark.parametrize('use_function', [False, True])
def testAdam(use_function):
  w0, grads = _Init([3, 2]), _Grads([3, 2])
  p = optimizer.Adam.Params().Set(beta1=0.8, beta2=0.99, epsilon=1e-7)
  got, opt = _Run(p, w0, grads, use_function=use_function)
  np.testing.assert_allclose(
    got, _NpAdam(w0, grads, 0.8, 0.99, 1e-7), rtol=1e-5, atol=1e-6
  )
  assert sorted(opt.slots()) == ['Adam/iterations', 'layer/w/m', 'layer/w/v']
  assert int(opt.iterations.numpy()) == _STEPS


@pytest.mark.parametrize(
  'shape, factored, beta1, clip, mbps',
  [
    ([3, 4], True, 0.0, 1.0, False),
    ([2, 3, 4], True, 0.9, None, True),
    ([5], True, 0.0, 1.0, False),  # rank 1: never factored
    ([3, 4], False, 0.0, 1.0, True),
  ],
)
def testAdafactor(shape, factored, beta1, clip, mbps):
  w0, grads = _Init(shape), _Grads(shape, seed=3)
  p = optimizer.Adafactor.Params().Set(
    factored=factored,
    beta1=beta1,
    clipping_threshold=clip,
    multiply_by_parameter_scale=mbps,
    min_dim_size_to_factor=1,
  )
  got, opt = _Run(p, w0, grads)
  use_factored = factored and len(shape) >= 2
  want = _NpAdafactor(
    w0.astype(np.float64), grads, use_factored, beta1, clip, mbps
  )
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  names = set(opt.slots()) - {'Adafactor/iterations'}
  expected = {'layer/w/vr', 'layer/w/vc'} if use_factored else {'layer/w/v'}
  if beta1:
    expected.add('layer/w/m')
  assert names == expected
  if use_factored:
    assert opt.slots()['layer/w/vr'].shape.as_list() == shape[:-1]
    assert opt.slots()['layer/w/vc'].shape.as_list() == shape[:-2] + shape[-1:]


def testAdafactorMinDimSizeKeepsSmallVarsUnfactored():
  var = tf.Variable(tf.ones([4, 4]), name='small/w')
  opt = optimizer.Adafactor.Params().Instantiate()  # min dim 128
  opt.CreateSlots([var])
  assert sorted(opt.slots()) == ['Adafactor/iterations', 'small/w/v']


@pytest.mark.parametrize(
  'params',
  [
    optimizer.SGD.Params(),
    optimizer.Momentum.Params(),
    optimizer.RMSProp.Params().Set(centered=True),
    optimizer.Adam.Params(),
    optimizer.Adafactor.Params().Set(beta1=0.5, min_dim_size_to_factor=1),
  ],
)
def testSlotsNamedAfterVariableAndOnItsDevice(params):
  with tf.device('/device:CPU:2'):
    var = tf.Variable(tf.ones([2, 3]), name='cell/fc/w')
  opt = params.Instantiate()
  opt.CreateSlots([var])
  opt.CreateSlots([var])  # idempotent
  for name, slot in opt.slots().items():
    if name.endswith('/iterations'):
      continue
    assert name.startswith('cell/fc/w/')
    assert slot.name.split(':')[0] == name
    assert slot.device.endswith('CPU:2'), (name, slot.device)
    assert not slot.trainable
  opt.Apply(0.1, [(tf.ones([2, 3]), var)])


def testSlotsCreatedLazilyInsideFunction():
  var = tf.Variable(tf.ones([2]), name='lazy/w')
  opt = optimizer.Adam.Params().Instantiate()

  @tf.function
  def Step():
    opt.Apply(0.1, [(tf.ones([2]), var)])

  Step()
  Step()
  assert sorted(opt.slots()) == ['Adam/iterations', 'lazy/w/m', 'lazy/w/v']
  assert int(opt.iterations.numpy()) == 2


def testNoneGradientsAreSkipped():
  a = tf.Variable([1.0], name='a')
  b = tf.Variable([1.0], name='b')
  opt = optimizer.SGD.Params().Instantiate()
  opt.Apply(1.0, [(tf.constant([1.0]), a), (None, b)])
  assert a.numpy()[0] == 0.0 and b.numpy()[0] == 1.0


def testErrors():
  with pytest.raises(ValueError, match='alpha'):
    optimizer.Momentum.Params().Set(alpha=1.5).Instantiate()
  with pytest.raises(ValueError, match='beta1'):
    optimizer.Adam.Params().Set(beta1=1.0).Instantiate()
  with pytest.raises(TypeError, match='Params'):
    optimizer.Adam({'beta1': 0.9})
  opt = optimizer.Adam.Params().Instantiate()
  v1 = tf.Variable([1.0], name='same')
  v2 = tf.Variable([2.0], name='same')
  opt.CreateSlots([v1])
  with pytest.raises(ValueError, match='two different variables'):
    opt.CreateSlots([v2])
  with pytest.raises(KeyError, match='CreateSlots'):
    opt.GetSlot(tf.Variable([1.0], name='other'), 'm')


@pytest.mark.parametrize(
  'params',
  [
    optimizer.SGD.Params(),
    optimizer.Momentum.Params(),
    optimizer.RMSProp.Params().Set(centered=True),
    optimizer.Adam.Params(),
    optimizer.Adafactor.Params().Set(beta1=0.9),
  ],
)
def testSlotSpecsPredictCreatedSlots(params):
  opt = params.Instantiate()
  var = tf.Variable(tf.zeros([4, 3]), name='spec/w')
  specs = opt.SlotSpecs(var)
  assert not opt.slots()  # SlotSpecs creates nothing.
  opt.CreateSlots([var])
  for slot, shape, init in specs:
    got = opt.GetSlot(var, slot).numpy()
    assert list(got.shape) == shape, slot
    np.testing.assert_array_equal(got, np.full(shape, init, np.float32))
  assert {f'spec/w/{s}' for s, _, _ in specs} == {
    k for k in opt.slots() if k.startswith('spec/w/')
  }


def _Ancestors(op):
  """Names of the ops `op` waits for, through data and control inputs."""
  seen, todo = set(), [op]
  while todo:
    cur = todo.pop()
    for dep in [t.op for t in cur.inputs] + list(cur.control_inputs):
      if dep.name not in seen:
        seen.add(dep.name)
        todo.append(dep)
  return seen


@pytest.mark.parametrize(
  'params',
  [
    optimizer.Adam.Params(),
    optimizer.Momentum.Params(),
    optimizer.RMSProp.Params().Set(momentum=0.9, centered=True),
    optimizer.Adafactor.Params().Set(beta1=0.9, min_dim_size_to_factor=2),
  ],
  ids=lambda p: p.name,
)
def testSlotReadsWaitForTheGradient(params):
  # The update's temporaries that need only the slots (Adam's beta1 * m)
  # must not be made before the gradient exists: they would be held through
  # the whole step, on top of its activations.
  var = tf.Variable(tf.ones([4, 4]), name='order/w')
  opt = params.Instantiate()
  opt.CreateSlots([var])

  @tf.function
  def Step(x):
    grad = tf.identity(x * 2.0, name='the_grad')
    opt.Apply(0.1, [(grad, var)])

  graph = Step.get_concrete_function(tf.TensorSpec([4, 4])).graph
  slot_handles = {
    id(opt.GetSlot(var, name).handle) for name, _, _ in opt.SlotSpecs(var)
  }
  internal = {
    inner.op.name
    for outer, inner in graph.captures
    if id(outer) in slot_handles
  }
  reads = [
    op
    for op in graph.get_operations()
    if op.type == 'ReadVariableOp' and op.inputs[0].op.name in internal
  ]
  # The update is one call of a function that reads the slots (it starts
  # once all of its inputs, the gradient too, are there), or inline ops.
  calls = [op for op in graph.get_operations() if op.type.endswith('Call')]
  assert reads or calls, 'no slot is read in the update'
  for op in reads + calls:
    assert 'the_grad' in _Ancestors(op), (
      f'{op.name} reads a slot before the gradient is ready'
    )


def _ConstantsWaitingForTheGradient(params, num_vars):
  """The constants of an update that have a control input."""
  variables = [
    tf.Variable(tf.ones([8, 8]), name=f'consts{num_vars}/w{i}')
    for i in range(num_vars)
  ]
  opt = params.Instantiate()
  opt.CreateSlots(variables)

  @tf.function
  def Step():
    opt.Apply(0.1, [(tf.identity(v * 2.0), v) for v in variables])

  graph = Step.get_concrete_function().graph
  return [
    op.name
    for op in graph.get_operations()
    if op.type == 'Const' and op.control_inputs
  ]


@pytest.mark.parametrize(
  'params',
  [
    optimizer.SGD.Params(),
    optimizer.Momentum.Params().Set(use_nesterov=True),
    optimizer.RMSProp.Params().Set(momentum=0.9, centered=True),
    optimizer.Adam.Params(),
    optimizer.Adafactor.Params().Set(
      beta1=0.9, min_dim_size_to_factor=2, multiply_by_parameter_scale=True
    ),
    optimizer.Adafactor.Params().Set(decay_exponent_pow=None),
  ],
  ids=lambda p: p.name,
)
def testHyperParametersAreSharedConstants(params):
  # A constant made under the gradient's control dependency is a node of its
  # own for every variable, and each keeps a buffer for as long as the step
  # function lives (Adam's: 1.5 KiB per variable). The only one allowed is
  # the step counter's increment, once per step.
  two = _ConstantsWaitingForTheGradient(params, 2)
  five = _ConstantsWaitingForTheGradient(params, 5)
  assert len(two) == len(five) <= 1, (two, five)


def testApplyInATfFunctionIsNotConvertedByAutoGraph():
  # The update rule is graph-style code; converted with AutoGraph (as a
  # tf.function converts what it calls) it cost about 2 ms per variable of
  # every trace. Converted code runs from a generated file.
  files = []

  class Sgd(optimizer.SGD):
    def _UpdateOne(self, var, grad, lr, step):
      files.append(inspect.currentframe().f_code.co_filename)
      return super()._UpdateOne(var, grad, lr, step)

  var = tf.Variable([1.0, 2.0])
  opt = Sgd.Params().Instantiate()

  @tf.function
  def Step(g):
    opt.Apply(tf.constant(_LR), [(g, var)])

  Step(tf.constant([1.0, 1.0]))
  np.testing.assert_allclose(var.numpy(), [0.9, 1.9])
  assert files and set(files) == {__file__}, files
