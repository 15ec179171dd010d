"""XLA: a pipeline's whole training step under tf.function(jit_compile=True).

K=1 and K=2 cells on one device, every recompute policy: the compiled step
gives the outputs and gradients of the uncompiled one. The pipeline's own
scheduling ops (DeepCopy, the snapshot-separated gradient sum) are replaced:
under XLA the gradients are summed with AddN and the copies are identities.
NestedMap states, batch norm and dropout (32 compilations in all) are slow.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import normalizations
from lingvo_gpipe.pipeline import pipelining_layer
from tests.testing import pipeline_layers

DEVICE = '/device:CPU:0'


def _Step(pipe, weights, jit_compile):
  variables = pipe.trainable_variables

  def Step(inputs):
    with tf.GradientTape() as tape, py_utils.StepSeed(7):
      out = pipe(inputs)
      loss = tf.add_n(
        [
          tf.reduce_sum(o * w)
          for o, w in zip(tf.nest.flatten(out), tf.nest.flatten(weights))
        ]
      )
    return out, loss, tape.gradient(loss, variables)

  return tf.function(Step, jit_compile=jit_compile)


def _AssertSameStep(layer_params, inputs, weights, num_stages, policy):
  pipe = pipeline_layers.Pipe(
    layer_params,
    num_stages,
    num_micro_batches=2,
    devices=[DEVICE] * num_stages,
    recompute=policy,
  )
  expected = _Step(pipe, weights, False)(inputs)
  actual = _Step(pipe, weights, True)(inputs)
  flat_e, flat_a = tf.nest.flatten(expected), tf.nest.flatten(actual)
  assert len(flat_e) == len(flat_a)
  for a, e in zip(flat_a, flat_e):
    assert pipeline_layers.MaxRelDiff(a, e) <= 1e-5, (
      pipeline_layers.MaxRelDiff(a, e),
      a,
      e,
    )


@pytest.mark.parametrize('num_stages', [1, 2])
@pytest.mark.parametrize('policy', pipelining_layer.RECOMPUTE_POLICIES)
def testJitCompiledStepMatches(num_stages, policy):
  x, w = pipeline_layers.Inputs()
  _AssertSameStep(pipeline_layers.DenseLayers(4), x, w, num_stages, policy)


@pytest.mark.slow
@pytest.mark.parametrize('num_stages', [1, 2])
@pytest.mark.parametrize('policy', pipelining_layer.RECOMPUTE_POLICIES)
def testJitCompiledNestedMapState(num_stages, policy):
  rng = np.random.RandomState(1)
  state = NestedMap(
    prev=tf.constant(rng.randn(8, 4), tf.float32),
    cur=tf.constant(rng.randn(8, 4), tf.float32),
  )
  w = NestedMap(
    prev=tf.constant(rng.randn(8, 4), tf.float32),
    cur=tf.constant(rng.randn(8, 4), tf.float32),
  )
  layers = [
    pipeline_layers.TwoState.Params().Set(name=f'l{i}') for i in range(4)
  ]
  _AssertSameStep(layers, state, w, num_stages, policy)


@pytest.mark.slow
@pytest.mark.parametrize('num_stages', [1, 2])
@pytest.mark.parametrize('policy', pipelining_layer.RECOMPUTE_POLICIES)
def testJitCompiledBatchNorm(num_stages, policy):
  x, w = pipeline_layers.Inputs()
  layers = pipeline_layers.DenseLayers(4)
  layers.insert(2, normalizations.BatchNormLayer.Params().Set(name='bn', dim=6))
  _AssertSameStep(layers, x, w, num_stages, policy)


@pytest.mark.slow
@pytest.mark.parametrize('num_stages', [1, 2])
@pytest.mark.parametrize('policy', pipelining_layer.RECOMPUTE_POLICIES)
def testJitCompiledDropout(num_stages, policy):
  x, w = pipeline_layers.Inputs()
  layers = pipeline_layers.DenseLayers(4)
  layers.insert(
    1, dropout.DropoutLayer.Params().Set(name='drop', keep_prob=0.5)
  )
  _AssertSameStep(layers, x, w, num_stages, policy)
