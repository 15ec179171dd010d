"""Cells of one kind (layers of the same classes and Params, in order) share
one traced function: each distinct cell is traced and optimized once."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import normalizations
from tests.testing import pipeline_layers

DIM = 6


def _Dense(i):
  return pipeline_layers.Dense.Params().Set(
    name=f'fc_{i}', input_dim=DIM, output_dim=DIM
  )


def _Pipe(layers, num_stages=4, loop=False, jit=False):
  return pipeline_layers.Pipe(
    layers,
    num_stages,
    num_micro_batches=2,
    micro_batch_loop=loop,
    jit_compile=jit,
  )


def _Step(pipe, share=True):
  """(the step's function names, loss, weight gradients); `share=False`:
  every cell traced on its own."""
  if not share:
    pipe._cell_functions._cell_kind = None  # pylint: disable=protected-access
  x, w = pipeline_layers.Inputs(batch=8, dim=DIM)
  variables = pipe.trainable_variables

  @tf.function
  def Step(x):
    with py_utils.StepSeed(7), py_utils.UpdateCollector() as updates:
      with tf.GradientTape() as tape:
        loss = pipeline_layers.WeightedSum(pipe(x), w)
      grads = tape.gradient(loss, variables)
    with tf.control_dependencies(updates.Apply()):
      return tf.identity(loss), grads

  graph_def = Step.get_concrete_function(x).graph.as_graph_def()
  names = [f.signature.name for f in graph_def.library.function]
  loss, grads = Step(x)
  return names, loss.numpy(), [g.numpy() for g in grads]


def _Count(names, body):
  return sum(n.startswith(f'__inference_{body}_') for n in names)


def testCellsOfOneKindAreTracedOnce():
  # 8 dense layers in 4 cells: cells 0-2 are one kind, the last cell
  # (whose outputs are the pipeline's) another.
  names, _, _ = _Step(_Pipe([_Dense(i) for i in range(8)]))
  assert _Count(names, 'Forward') == 2, names
  # Backward: cell 0 needs no input gradient, cells 1 and 2 are one, and
  # the last cell.
  assert _Count(names, 'Backward') == 3, names
  apart, _, _ = _Step(_Pipe([_Dense(i) for i in range(8)]), share=False)
  assert _Count(apart, 'Forward') == 4, apart
  assert _Count(apart, 'Backward') == 4, apart


def testCellsOfAnotherShapeAreAnotherKind():
  layers = [_Dense(i) for i in range(8)]
  layers[2] = layers[2].Copy().Set(output_dim=DIM + 1)
  layers[3] = layers[3].Copy().Set(input_dim=DIM + 1)
  names, _, _ = _Step(_Pipe(layers))
  # Cells 0 and 2 are one kind, cell 1 (6 -> 7 -> 6) another.
  assert _Count(names, 'Forward') == 3, names


@pytest.mark.parametrize(
  'loop, jit', [(False, False), (True, False), (True, True)]
)
def testSharedCellsComputeWhatEachCellComputes(loop, jit):
  # Bit for bit: a shared function runs the same ops on each cell's weights.
  layers = [_Dense(i) for i in range(8)]
  names, loss, grads = _Step(_Pipe(layers, loop=loop, jit=jit))
  apart, loss_apart, grads_apart = _Step(
    _Pipe(layers, loop=loop, jit=jit), share=False
  )
  assert _Count(names, 'Forward') < _Count(apart, 'Forward')
  assert loss == loss_apart
  for g, h in zip(grads, grads_apart):
    np.testing.assert_array_equal(g, h)


def testCellsWithRandomOpsOrStatisticsAreNotShared():
  # A dropout's seed comes from its layer's name, and a batch norm hands
  # on statistics of its own layer: such cells keep functions of their own.
  def Cells(extra):
    layers = []
    for i in range(4):
      layers += [_Dense(i), extra(i)]
    return layers

  drop = Cells(
    lambda i: dropout.DropoutLayer.Params().Set(name=f'd_{i}', keep_prob=0.5)
  )
  names, _, _ = _Step(_Pipe(drop))
  assert _Count(names, 'Forward') == 4, names
  norm = Cells(
    lambda i: normalizations.BatchNormLayer.Params().Set(
      name=f'bn_{i}', dim=DIM, decay=0.5
    )
  )
  names, _, _ = _Step(_Pipe(norm))
  assert _Count(names, 'Forward') == 4, names
  # A batch norm's backward hands nothing on (its forward does): the
  # backward passes of those cells are shared.
  assert _Count(names, 'Backward') == 3, names
