"""XLA-compiled cells (`jit_compile=True`): still the sequential model.

The pipeline with compiled cells gives the outputs and gradients of the plain
sequential stack for K=1, 2 and M=1, 2, 4, every recompute policy, dropout
(the same masks: the seed crosses into the compiled function) and batch norm
(the statistics leave it and update the moving averages once per step). The
compiled functions are really there: XLA calls with _XlaMustCompile in the
step's graph. A layer XLA cannot compile is named in a clear error. With
`precompile`, the functions compile on their devices while the step is
traced, and the step computes the same bits.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import normalizations
from lingvo_gpipe.models import transformer_lm
from lingvo_gpipe.core import xla_precompile
from lingvo_gpipe.pipeline import pipelining_layer
from tests.testing import pipeline_layers as plt

DEVICES = plt.DEVICES
ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


def _Pipe(layers, k, m, policy='always', jit=True, devices=None, **params):
  return plt.Pipe(
    layers,
    k,
    num_micro_batches=m,
    devices=devices or DEVICES[:k],
    recompute=policy,
    jit_compile=jit,
    **params,
  )


@pytest.mark.parametrize('k', [1, 2])
@pytest.mark.parametrize('m', [1, 2, 4])
def testTransparencyWithCompiledCells(plt_reference, k, m):
  ref, x, w, (ref_out, ref_loss, ref_grads, ref_in_grads) = plt_reference
  pipe = _Pipe(plt.DenseLayers(), k, m)
  for name, v in pipe.VariablesByName().items():
    np.testing.assert_array_equal(v.numpy(), ref.VariablesByName()[name])
  out, loss, grads, in_grads = plt.LossAndGrads(pipe, (x,), w)
  plt.AssertClose(out, ref_out)
  plt.AssertClose(loss, ref_loss)
  assert sorted(grads) == sorted(ref_grads)
  for name in grads:
    assert plt.MaxRelDiff(grads[name], ref_grads[name]) <= 1e-5, name
  plt.AssertClose(in_grads, ref_in_grads)
  assert 'XLA-compiled cells' in pipe.PlacementText()


@pytest.mark.parametrize('policy', pipelining_layer.RECOMPUTE_POLICIES)
def testRecomputePoliciesWithCompiledCells(plt_reference, policy):
  _, x, w, (ref_out, _, ref_grads, ref_in_grads) = plt_reference
  pipe = _Pipe(plt.DenseLayers(), 2, 4, policy)
  out, _, grads, in_grads = plt.LossAndGrads(pipe, (x,), w)
  plt.AssertClose(out, ref_out)
  for name in grads:
    assert plt.MaxRelDiff(grads[name], ref_grads[name]) <= 1e-5, name
  plt.AssertClose(in_grads, ref_in_grads)


@pytest.fixture(name='plt_reference', scope='module')
def _Reference():
  x, w = plt.Inputs()  # pylint: disable=protected-access
  ref = plt.Stack.Params().Set(name='pipe', layers=plt.DenseLayers())
  ref = ref.Instantiate()
  return ref, x, w, plt.LossAndGrads(ref, (x,), w)


def _Step(pipe, x, w, jit_compile=False):
  variables = pipe.trainable_variables
  # Not a constant: XLA would fold random ops of a constant seed with
  # TensorFlow's kernels, whose bits differ from XLA's own.
  seed = tf.Variable(3, dtype=tf.int64)

  def Step():
    with py_utils.StepSeed(seed.read_value()):
      with py_utils.UpdateCollector() as updates:
        with tf.GradientTape() as tape:
          out = pipe(x)
          loss = tf.reduce_sum(out * w)
        grads = tape.gradient(loss, variables)
      updates.Apply()
    return out, grads

  return tf.function(Step, autograph=False, jit_compile=jit_compile)


def _DropoutBnLayers():
  return [
    plt.Dense.Params().Set(name='fc_0', input_dim=6, output_dim=6),
    dropout.DropoutLayer.Params().Set(name='drop', keep_prob=0.7),
    normalizations.BatchNormLayer.Params().Set(name='bn', dim=6),
    plt.Dense.Params().Set(name='fc_1', input_dim=6, output_dim=6),
  ]


@pytest.mark.parametrize('k', [1, 2])
@pytest.mark.parametrize('policy', ['always', 'never'])
def testDropoutAndBatchNormMatchTheCompiledStep(k, policy):
  """Compiled cells == the same pipeline in one compiled step (XLA's random
  bits differ from TensorFlow's kernels', so both sides use XLA's)."""
  x, w = plt.Inputs()  # pylint: disable=protected-access
  results = []
  for jit_cells in (False, True):
    # One device: XLA compiles a whole step only on one.
    pipe = _Pipe(_DropoutBnLayers(), k, 2, policy, jit_cells, DEVICES[:1] * k)
    step = _Step(pipe, x, w, jit_compile=not jit_cells)
    out, grads = step()
    moving = {
      n: v.numpy() for n, v in pipe.VariablesByName().items() if 'moving' in n
    }
    results.append((out, grads, moving))
    if jit_cells:
      graph = step.get_concrete_function().graph.as_graph_def()
      compiled = [
        f.signature.name
        for f in graph.library.function
        if f.attr['_XlaMustCompile'].b
      ]
      assert compiled, 'no XLA-compiled function in the step'
  (out0, g0, m0), (out1, g1, m1) = results
  plt.AssertClose(out1, out0)
  for a, b in zip(g1, g0):
    plt.AssertClose(a, b)
  assert sorted(m0) == sorted(m1) and m0
  for name in m0:
    np.testing.assert_allclose(m1[name], m0[name], rtol=1e-5, atol=1e-6)
  assert any(
    not np.allclose(v, 0) and not np.allclose(v, 1) for v in m0.values()
  )


class _NoXla(base_layer.BaseLayer):
  """A layer with an op XLA has no kernel for (DeepCopy)."""

  def FProp(self, theta, x):
    del theta
    return tf.raw_ops.DeepCopy(x=x) * 2.0


def testLayerXlaCannotCompileIsNamed():
  x, w = plt.Inputs()  # pylint: disable=protected-access
  layers = plt.DenseLayers(2) + [_NoXla.Params().Set(name='no_xla')]
  pipe = _Pipe(layers, 2, 2)
  with pytest.raises(
    ValueError,
    match=r"Pipeline 'pipe' has jit_compile=True but XLA cannot compile "
    r"cell 1: layer 'pipe/no_xla' uses DeepCopy.*jit_compile=False",
  ):
    plt.LossAndGrads(pipe, (x,), w)


@pytest.mark.parametrize('policy', ['always', 'except_last_micro_batch'])
def testStepThatReturnsOnlyGradients(policy):
  # The pipeline's outputs feed nothing but the order of the next work item
  # on each device. Grappler turned such compiled calls into NoOps that kept
  # their XLA attribute ("Function NoOp is not defined") until they got a
  # data consumer.
  lm = transformer_lm.LayerParams(
    num_layers=1, model_dim=16, hidden_dim=32, num_heads=1, vocab_size=64
  )
  ids = tf.random.stateless_uniform([8, 4], [1, 2], maxval=64, dtype=tf.int32)
  grads = []
  for jit in (True, False):
    pipe = _Pipe(lm, 2, 2, policy, jit)
    variables = pipe.trainable_variables

    @tf.function
    def Step(pipe=pipe, variables=variables):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(pipe(ids, ids))
      return tape.gradient(loss, variables)

    grads.append(dict(zip([v.name for v in variables], Step())))
  assert sorted(grads[0]) == sorted(grads[1]) and grads[0]
  for name, g in grads[1].items():
    np.testing.assert_allclose(grads[0][name], g, rtol=1e-4, atol=1e-7)


class _StatefulRandom(base_layer.BaseLayer):
  """x + an unseeded random draw: a stateful op in the compiled cell."""

  def FProp(self, theta, x):
    del theta
    return x + tf.random.uniform(tf.shape(x)) * 0.0


def testPrecompiledCellsGiveTheSameBits(plt_reference):
  """precompile=True: every compiled function is compiled on every device
  that calls it, once, while the step is traced; the step's outputs and
  gradients are the same bits as without. A function with a stateful
  random op is left to compile in the step (running it once more would
  draw other numbers)."""
  _, x, w, _ = plt_reference
  results = []
  for precompile in (False, True):
    pipe = _Pipe(plt.DenseLayers(), 2, 2, precompile=precompile)
    results.append(plt.LossAndGrads(pipe, (x,), w))
  compiled = pipe._cell_functions._precompiler.Wait()  # pylint: disable=protected-access
  # A forward and a recompute-and-backward function on each device.
  assert sorted(d for _, d in compiled) == sorted(DEVICES[:2] * 2), compiled
  (out0, loss0, g0, in0), (out1, loss1, g1, in1) = results
  np.testing.assert_array_equal(out1, out0)
  np.testing.assert_array_equal(loss1, loss0)
  np.testing.assert_array_equal(in1, in0)
  assert sorted(g1) == sorted(g0)
  for name in g0:
    np.testing.assert_array_equal(g1[name], g0[name])

  layers = plt.DenseLayers(2) + [_StatefulRandom.Params().Set(name='draw')]
  pipe = _Pipe(layers, 2, 2, precompile=True)
  plt.LossAndGrads(pipe, (x,), w)
  compiled = pipe._cell_functions._precompiler.Wait()  # pylint: disable=protected-access
  # Cell 1 holds the draw: only cell 0's functions were compiled ahead.
  assert sorted(d for _, d in compiled) == [DEVICES[0]] * 2, compiled


def testPrecompileByDefaultOnlyOnDevicesOfOtherProcesses():
  pre = xla_precompile.Precompiler('pipe', remote_only=True)
  assert pre._Remote('/job:worker/replica:0/task:1/device:CPU:0')  # pylint: disable=protected-access
  assert not pre._Remote('/device:CPU:1')  # pylint: disable=protected-access
  assert not pre._Remote('/job:localhost/replica:0/task:0/device:CPU:1')  # pylint: disable=protected-access


def testWarmUpsKeepNoGraph():
  """A warm-up waiting for its turn keeps the function the runtime runs,
  not the graph it was traced from (which holds a copy of the compiled
  function it calls)."""
  import gc  # pylint: disable=g-import-not-at-top

  @tf.function(jit_compile=True, autograph=False)
  def Cell(x, w):
    return tf.tanh(x * w)

  concrete = Cell.get_concrete_function(
    tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([3], tf.float32)
  )
  specs = [tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([3], tf.float32)]
  warm = xla_precompile._Warm(concrete, specs, DEVICES[1])  # pylint: disable=protected-access
  gc.collect()
  graphs = [
    o
    for o in gc.get_objects()
    if isinstance(o, tf.Graph) and getattr(o, 'name', '').startswith('Warm')
  ]
  assert not graphs, graphs
  (y,) = warm(tf.constant(0))
  np.testing.assert_array_equal(y, [0.0])


def testWarmUpFillsOneZeroPerShape(monkeypatch):
  """A warm-up makes one zero per distinct shape and dtype of its
  arguments, not one per argument (a deep cell's weights come in a few
  shapes), and the function still compiles and runs on them."""
  fills = []
  fill = tf.fill

  def CountingFill(dims, value):
    fills.append((tuple(dims), value.dtype))
    return fill(dims, value)

  monkeypatch.setattr(tf, 'fill', CountingFill)

  @tf.function(jit_compile=True, autograph=False)
  def Cell(x, w1, w2, w3, n):
    return tf.tanh(x * w1 * w2 * w3) * tf.cast(n + 1, tf.float32)

  specs = [
    tf.TensorSpec([2, 3], tf.float32),
    tf.TensorSpec([3], tf.float32),
    tf.TensorSpec([3], tf.float32),
    tf.TensorSpec([3], tf.float32),
    tf.TensorSpec([], tf.int32),
  ]
  concrete = Cell.get_concrete_function(*specs)
  warm = xla_precompile._Warm(concrete, specs, DEVICES[1])  # pylint: disable=protected-access
  assert sorted(fills, key=str) == sorted(
    [((2, 3), tf.float32), ((3,), tf.float32), ((), tf.int32)], key=str
  ), fills
  (y,) = warm(tf.constant(0))
  np.testing.assert_array_equal(y, [0.0])


@pytest.mark.parametrize(
  'cores, threads', [(None, 1), (1, 1), (2, 1), (3, 2), (5, 4), (64, 4)]
)
def testPrecompilesLeaveTheTraceACore(cores, threads, monkeypatch):
  # On 2 cores, 2 or 4 compiles at once slowed the trace more than they
  # gained (docs/benchmarks.md): one core stays with the trace.
  monkeypatch.setattr(xla_precompile.os, 'cpu_count', lambda: cores)
  assert xla_precompile.NumThreads() == threads


_DUMP_SCRIPT = textwrap.dedent("""
    import glob, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices('CPU')[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tests.testing import pipeline_layers as plt
    x, w = plt.Inputs()
    pipe = plt.Pipe(plt.DenseLayers(), 2, num_micro_batches=2,
                    jit_compile=True, precompile=True)
    variables = pipe.trainable_variables

    @tf.function
    def Step():
      with tf.GradientTape() as tape:
        loss = plt.WeightedSum(pipe(x), w)
      return tape.gradient(loss, variables)

    Step.get_concrete_function()
    pipe._cell_functions._precompiler.Wait()
    def Compiled():
      return len(glob.glob(sys.argv[1] + '/*.before_optimizations.txt'))
    ahead = Compiled()
    Step()
    print('COMPILED', ahead, Compiled())
""")


@pytest.mark.slow
def testPrecompiledFunctionsAreNotCompiledAgainByTheStep(tmp_path):
  # XLA's dump holds one module per compile: the forward and the backward
  # function on each of the 2 devices, all before the step runs, and the
  # step compiles nothing more.
  out = subprocess.run(
    [sys.executable, '-c', _DUMP_SCRIPT, str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=240,
    env=dict(
      os.environ,
      PYTHONPATH=ROOT,
      XLA_FLAGS=f'--xla_dump_to={tmp_path}',
      TF_CPP_MIN_LOG_LEVEL='2',
    ),
    check=False,
  )
  assert 'COMPILED 4 4' in out.stdout, out.stdout + out.stderr[-4000:]


def testPrecompileTakesNoneTrueOrFalse():
  p = pipelining_layer.PipeliningLayer.Params().Set(
    name='pipe', layers=plt.DenseLayers(), num_stages=2, precompile='yes'
  )
  with pytest.raises(ValueError, match=r"precompile='yes'; use None"):
    p.Instantiate()
