"""Identical layers run as calls of one function per kind, with the numbers of
the layers run inline: weights, dropout masks (each layer's own seed),
batch-norm statistics (each layer's own), eval mode, and the fallbacks."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.cells import layer_function
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import normalizations
from tests.testing import graphs
from tests.testing import pipeline_layers

DIM = 6


def _Layers(num_blocks, random_scale=False):
  """num_blocks x [Dense, Dropout, BatchNorm], then a Dense."""
  layers = []
  for i in range(num_blocks):
    layers += [
      pipeline_layers.Dense.Params().Set(
        name=f'fc_{i}', input_dim=DIM, output_dim=DIM
      ),
      dropout.DropoutLayer.Params().Set(name=f'drop_{i}', keep_prob=0.5),
      normalizations.BatchNormLayer.Params().Set(
        name=f'bn_{i}', dim=DIM, decay=0.5
      ),
    ]
    if random_scale:
      layers.append(pipeline_layers.RandomScale.Params().Set(name=f'rs_{i}'))
  layers.append(
    pipeline_layers.Dense.Params().Set(
      name='out', input_dim=DIM, output_dim=DIM
    )
  )
  return layers


def _Pipe(layers, share, num_stages=2, num_mb=2, recompute='always', loop=True):
  return pipeline_layers.Pipe(
    layers,
    num_stages,
    num_micro_batches=num_mb,
    recompute=recompute,
    share_layer_functions=share,
    micro_batch_loop=loop,
  )


def _TrainStep(pipe, is_eval=False):
  """(loss, weight gradients, outputs, moving statistics after the update)."""
  x, w = pipeline_layers.Inputs(batch=8, dim=DIM)
  variables = pipe.trainable_variables

  @tf.function
  def Step(x):
    with py_utils.EvalMode(is_eval), py_utils.StepSeed(7):
      with py_utils.UpdateCollector() as updates:
        with tf.GradientTape() as tape:
          out = pipe(x)
          loss = pipeline_layers.WeightedSum(out, w)
        grads = tape.gradient(loss, variables)
      with tf.control_dependencies(updates.Apply()):
        return loss, grads, out

  loss, grads, out = Step(x)
  stats = {v.name: v.numpy() for v in pipe.variables if 'moving' in v.name}
  return loss.numpy(), [g.numpy() for g in grads], out.numpy(), stats


def _Same(a, b):
  la, ga, oa, sa = a
  lb, gb, ob, sb = b
  np.testing.assert_allclose(la, lb, rtol=1e-6)
  np.testing.assert_allclose(oa, ob, rtol=1e-5, atol=1e-6)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  assert sorted(sa) == sorted(sb)
  for name in sa:
    np.testing.assert_allclose(sa[name], sb[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize('recompute', ['always', 'never'])
def testSharedLayersComputeWhatInlineLayersCompute(recompute):
  # Dropout at keep_prob 0.5: a layer that drew another layer's mask would
  # change the loss by far more than rounding.
  shared = _TrainStep(_Pipe(_Layers(3), True, recompute=recompute))
  inline = _TrainStep(_Pipe(_Layers(3), False, recompute=recompute))
  _Same(shared, inline)
  # Each batch-norm layer updated its own statistics.
  stats = shared[3]
  assert not np.allclose(
    stats['pipe/bn_0/moving_mean:0'], stats['pipe/bn_1/moving_mean:0']
  ), stats
  assert not np.allclose(stats['pipe/bn_0/moving_mean:0'], 0.0), stats


def testEvalModeCrossesTheFunction():
  shared = _TrainStep(_Pipe(_Layers(2), True), is_eval=True)
  inline = _TrainStep(_Pipe(_Layers(2), False), is_eval=True)
  _Same(shared, inline)


def testEachKindIsTracedOnce():
  pipe = _Pipe(_Layers(4), True, num_stages=1)
  shared = pipe._cell_functions._shared
  assert shared.Shared(pipe.body[0]) and shared.Shared(pipe.body[1])
  _TrainStep(pipe)
  (kinds,) = list(shared._graphs.values())
  # Dense, Dropout, BatchNorm: one function each (per eval mode and input
  # signature), whatever the number of layers.
  assert len({key[0] for key in kinds}) == 3, list(kinds)


def _LibraryOps(pipe):
  x, w = pipeline_layers.Inputs(batch=8, dim=DIM)
  variables = pipe.trainable_variables

  @tf.function
  def Step(x):
    with py_utils.UpdateCollector():
      with tf.GradientTape() as tape:
        loss = pipeline_layers.WeightedSum(pipe(x), w)
      return tape.gradient(loss, variables)

  (_, lib) = graphs.GraphSize(Step.get_concrete_function(x).graph)
  return lib


def testFunctionLibraryDoesNotGrowWithIdenticalLayers():
  # The cells' functions alone: built as loops, the loops' bodies would add
  # a few ops per batch-norm statistic they carry out.
  small = _LibraryOps(_Pipe(_Layers(2), True, loop=False))
  deep = _LibraryOps(_Pipe(_Layers(8), True, loop=False))
  inline_small = _LibraryOps(_Pipe(_Layers(2), False, loop=False))
  inline_deep = _LibraryOps(_Pipe(_Layers(8), False, loop=False))
  # Inline, each layer is written into its cell's functions; shared, a layer
  # more is a call more.
  assert inline_deep - inline_small > 300, (inline_small, inline_deep)
  assert deep - small < 0.25 * (inline_deep - inline_small), (
    small,
    deep,
    inline_small,
    inline_deep,
  )


def testSeedsNotHeldByALayerAttributeFallBackToInline():
  # RandomScale derives its seed from its path inside FProp: no attribute
  # holds it, so its kind cannot pass each layer's seed and runs inline.
  layers = _Layers(2, random_scale=True)
  pipe = _Pipe(layers, True)
  shared = _TrainStep(pipe)
  fns = pipe._cell_functions._shared
  scales = [l for l in pipe.body if isinstance(l, pipeline_layers.RandomScale)]
  assert not fns.Shared(scales[0])
  assert fns.Shared(pipe.body[0])
  _Same(shared, _TrainStep(_Pipe(layers, False)))


class _Deep(pipeline_layers.Dense):
  """Dense, then many small ops: a kind worth a call."""

  def FProp(self, theta, x):
    y = super().FProp(theta, x)
    for i in range(layer_function.AUTO_MIN_OPS // 2):
      y = y * 0.99 + 0.01 * i
    return y


class _DirectRead(pipeline_layers.Dense):
  """Reads its weights from the variables, not from theta."""

  def FProp(self, theta, x):
    return tf.tanh(tf.matmul(x, self.vars.w) + self.vars.b)


def testADirectReadIsStillFoundInASharedKind():
  # The kind's trace captures the variables it reads: its layers run inline,
  # where the pipeline's check names each one.
  layers = [
    _DirectRead.Params().Set(name=f'd_{i}', input_dim=DIM, output_dim=DIM)
    for i in range(4)
  ]
  pipe = _Pipe(layers, True)
  x, _ = pipeline_layers.Inputs(batch=8, dim=DIM)
  with pytest.raises(ValueError, match=r'read variables directly.*d_3/w'):
    tf.function(lambda x: pipe(x))(x)
  assert not pipe._cell_functions._shared.Shared(pipe.body[0])


def testAutoSharesOnlyKindsWorthACall():
  # A dense layer, a dropout and a batch norm are a few ops each: inline.
  pipe = _Pipe(_Layers(2), 'auto')
  _TrainStep(pipe)
  shared = pipe._cell_functions._shared
  assert not any(shared.Shared(l) for l in pipe.body)
  # A kind of AUTO_MIN_OPS ops or more is shared.
  layers = [
    _Deep.Params().Set(name=f'deep_{i}', input_dim=DIM, output_dim=DIM)
    for i in range(4)
  ]
  pipe = _Pipe(layers, 'auto')
  got = _TrainStep(pipe)
  assert all(pipe._cell_functions._shared.Shared(l) for l in pipe.body)
  _Same(got, _TrainStep(_Pipe(layers, False)))


def testShareLayerFunctionsRefusesOtherValues():
  with pytest.raises(ValueError, match=r"share_layer_functions='yes'; use"):
    _Pipe(_Layers(1), 'yes')


def testKindKeyIgnoresOnlyTheName():
  a, b, c = (
    pipeline_layers.Dense.Params().Set(name=n, input_dim=DIM, output_dim=d)
    for n, d in (('a', DIM), ('b', DIM), ('c', DIM + 1))
  )
  key = layer_function.KindKey
  assert key(a.Instantiate()) == key(b.Instantiate())
  assert key(a.Instantiate()) != key(c.Instantiate())
