"""AmoebaNet: ops and cells against a straightforward reference, genotype
errors, FPropMeta shapes, the paper's parameter counts (abstractly), the
auxiliary loss and pipeline transparency on a tiny network.

Everything runs eagerly: tracing the pipeline of even a tiny AmoebaNet into
a graph takes longer than running it.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.models import amoebanet
from lingvo_gpipe.models import amoebanet_cells
from lingvo_gpipe.models import amoebanet_ops
from lingvo_gpipe.planning import partition

DEVICES = [f'/device:CPU:{i}' for i in range(4)]


def _Build(p, name='x'):
  p = p.Copy()
  p.name = p.name or name
  with base_layer.DetachedBuild():
    return p.Instantiate()


def _Rand(shape, seed=0):
  return tf.constant(np.random.RandomState(seed).randn(*shape), tf.float32)


# -- The reference: TF AmoebaNet's algorithm in plain TensorFlow ops ---------


def _RefBN(x, th):
  mean, var = tf.nn.moments(x, [0, 1, 2])
  return (x - mean) * tf.math.rsqrt(var + 1e-3) * th.gamma + th.beta


def _RefConv(x, th, kernel_stride=(1, 1), dilation=1, relu=True):
  if relu:
    x = tf.nn.relu(x)
  strides = [1, kernel_stride[0], kernel_stride[1], 1]
  if 'depthwise_w' in th:
    x = tf.nn.separable_conv2d(
      x, th.depthwise_w, th.w, strides, 'SAME', dilations=[dilation, dilation]
    )
  else:
    x = tf.nn.conv2d(x, th.w, strides, 'SAME', dilations=[dilation, dilation])
  return _RefBN(x, th.bn)


def _RefFactorizedReduction(x, th, stride, relu=True):
  if relu:
    x = tf.nn.relu(x)
  if stride == 1:
    return _RefBN(tf.nn.conv2d(x, th.w, 1, 'VALID'), th.bn)
  path1 = tf.nn.avg_pool2d(x, 1, 2, 'VALID')
  path1 = tf.nn.conv2d(path1, th.path1_w, 1, 'VALID')
  path2 = tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]
  path2 = tf.nn.avg_pool2d(path2, 1, 2, 'VALID')
  path2 = tf.nn.conv2d(path2, th.path2_w, 1, 'VALID')
  return _RefBN(tf.concat([path1, path2], 3), th.bn)


def _RefOp(op, x, th, stride, filters):
  """TF's BaseCell._apply_operation, without drop-path."""
  if 'separable' in op:
    dil = int(op.split('_')[1]) if op.startswith('dil_') else 1
    k = int(op.split('x')[1][0])
    n = int(op.split('_')[-1])
    for i in range(n):
      x = _RefConv(
        x,
        th[f'separable_{k}x{k}_{i + 1}'],
        (stride, stride) if i == 0 else (1, 1),
        dil,
      )
    return x
  if op in ('3x3', '1x7_7x1', '1x3_3x1') or op.startswith('dilated'):
    reduced = int(3 * filters / 8) if op == '1x3_3x1' else int(filters / 4)
    dil = int(op.split('_')[-1]) if op.startswith('dilated') else 1
    x = _RefConv(x, th.pre_1x1)
    if op in ('3x3',) or op.startswith('dilated'):
      x = _RefConv(x, th.conv_3x3, (stride, stride), dil)
    else:
      k = int(op[2])
      x = _RefConv(x, th[f'conv_1x{k}'], (1, stride))
      x = _RefConv(x, th[f'conv_{k}x1'], (stride, 1))
    del reduced
    return _RefConv(x, th.post_1x1)
  if op == 'none':
    if stride > 1 or x.shape[-1] != filters:
      return _RefFactorizedReduction(x, th.reduce, stride)
    return x
  if op == '1x1':
    return _RefConv(x, th.conv, (stride, stride))
  kind, _, size = op.split('_')
  pool = tf.nn.avg_pool2d if kind == 'avg' else tf.nn.max_pool2d
  return pool(x, int(size[0]), stride, 'SAME')


def _RefCell(cell, theta, prev, cur):
  """TF's BaseCell.__call__ (no drop-path) with the cell's weights."""
  p = cell.params
  spec = p.cell_spec
  if p.prev_reduction:
    prev = _RefFactorizedReduction(prev, theta.prev_proj, 2)
  elif p.prev_dim != p.filters:
    prev = _RefConv(prev, theta.prev_proj)
  net = [_RefConv(cur, theta.cur_proj), prev]
  for i in range(0, len(spec.operations), 2):
    hs = []
    for k in (i, i + 1):
      j = spec.hiddenstate_indices[k]
      stride = p.stride if j < 2 else 1
      hs.append(
        _RefOp(spec.operations[k], net[j], theta.ops[k], stride, p.filters)
      )
    net.append(hs[0] + hs[1])
  final_h = net[-1].shape[1]
  outs, r = [], 0
  for j, used in enumerate(spec.used_hiddenstates):
    if used:
      continue
    h = net[j]
    if h.shape[1] != final_h:
      h = _RefFactorizedReduction(h, theta.reduce[r], 2, relu=False)
      r += 1
    outs.append(h)
  return tf.concat(outs, 3)


# -- Ops and cells -------------------------------------------------------------


@pytest.mark.parametrize(
  'op,stride',
  [
    ('none', 2),
    ('1x1', 1),
    ('1x1', 2),
    ('avg_pool_3x3', 2),
    ('max_pool_2x2', 2),
    ('separable_3x3_2', 2),
    ('separable_5x5_2', 1),
    ('dil_2_separable_5x5_2', 1),
    ('3x3', 2),
    ('1x7_7x1', 2),
    ('1x3_3x1', 1),
    ('dilated_3x3_rate_2', 1),
  ],
)
def testOpMatchesReference(op, stride):
  layer = _Build(
    amoebanet_ops.CellOp.Params().Set(
      op=op, input_dim=16, output_dim=16, stride=stride
    )
  )
  x = _Rand([3, 7, 6, 16])
  with py_utils.UpdateCollector():
    out = layer(x)
  want = _RefOp(op, x, layer.theta, stride, 16)
  assert (
    out.shape
    == want.shape
    == [3, 4 if stride == 2 else 7, 3 if stride == 2 else 6, 16]
  )
  np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
  meta = amoebanet_ops.CellOp.FPropMeta(layer.params, x.shape)
  assert meta.out_shapes[0] == out.shape
  assert layer.is_identity == (op == 'none' and stride == 1)


def testFactorizedReductionOddSizesAndEvalMode():
  layer = _Build(
    amoebanet_ops.FactorizedReduction.Params().Set(input_dim=6, output_dim=8)
  )
  x = _Rand([2, 7, 5, 6])
  with py_utils.UpdateCollector() as updates:
    out = layer(x)
  np.testing.assert_allclose(
    out.numpy(),
    _RefFactorizedReduction(x, layer.theta, 2).numpy(),
    rtol=1e-4,
    atol=1e-4,
  )
  assert out.shape == [2, 4, 3, 8]
  updates.Apply()  # Deferred moving-average update, merged.
  assert not np.allclose(layer.vars.bn.moving_mean.numpy(), 0.0)
  with py_utils.EvalMode():
    y = layer(x)
  th = layer.theta
  x2 = tf.nn.relu(x)
  p1 = tf.nn.conv2d(x2[:, ::2, ::2], th.path1_w, 1, 'VALID')
  p2 = tf.nn.conv2d(
    tf.pad(x2, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1::2, 1::2],
    th.path2_w,
    1,
    'VALID',
  )
  z = tf.concat([p1, p2], 3)
  want = (z - th.bn.moving_mean) * tf.math.rsqrt(th.bn.moving_variance + 1e-3)
  np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match='output_dim = 7 is odd'):
    _Build(
      amoebanet_ops.FactorizedReduction.Params().Set(input_dim=6, output_dim=7)
    )


@pytest.mark.parametrize(
  'genotype', ['amoeba_net_d', 'amoeba_net_b', 'amoeba_net_a']
)
@pytest.mark.parametrize('kind', ['normal', 'reduction'])
def testCellMatchesReference(genotype, kind):
  g = amoebanet_cells.GetGenotype(genotype)
  reduction = kind == 'reduction'
  # A normal cell after a reduction (prev at twice the resolution), and a
  # reduction cell whose previous input needs a 1x1 projection.
  cur = _Rand([2, 6, 6, 24], 1)
  prev = _Rand([2, 6, 6, 12] if reduction else [2, 12, 12, 12], 2)
  cell = _Build(
    amoebanet_cells.AmoebaCell.Params().Set(
      cell_spec=g.Get(kind),
      filters=8,
      cur_dim=24,
      prev_dim=12,
      prev_reduction=not reduction,
      stride=2 if reduction else 1,
    )
  )
  state = NestedMap(prev=prev, cur=cur, extra=tf.ones([2, 3]))
  with py_utils.UpdateCollector():
    out = cell(state)
  want = _RefCell(cell, cell.theta, prev, cur)
  np.testing.assert_allclose(
    out.cur.numpy(), want.numpy(), rtol=1e-4, atol=1e-4
  )
  assert out.prev is cur and out.extra is state.extra
  meta = amoebanet_cells.AmoebaCell.FPropMeta(
    cell.params, NestedMap(prev=prev.shape, cur=cur.shape, extra=[2, 3])
  )
  assert meta.out_shapes[0].cur == out.cur.shape
  assert meta.out_shapes[0].prev == cur.shape
  assert out.cur.shape[-1] == amoebanet_cells.AmoebaCell.OutputDim(cell.params)


def testGenotypeDConcatenatesStates0346():
  g = amoebanet.GetGenotype('amoeba_net_d')
  assert amoebanet_cells.ValidateCellSpec(g.normal) == [0, 3, 4, 6]
  assert amoebanet_cells.ValidateCellSpec(g.reduction) == [4, 5, 6]
  assert set(amoebanet.GENOTYPES) >= {'amoeba_net_b', 'amoeba_net_d'}


def testGenotypeErrors():
  bad = amoebanet_cells.CellSpec(
    ['1x1', 'sep_conv_9x9', 'none', 'none'], [0, 1, 2, 0], [0, 0, 0, 0]
  )
  net = amoebanet.AmoebaNet.Params().Set(
    genotype=amoebanet_cells.Genotype('mine', bad, bad),
    num_filters=16,
    num_cells=3,
    image_size=32,
  )
  with pytest.raises(
    ValueError,
    match="Unknown AmoebaNet operation 'sep_conv_9x9'.*Fix the genotype",
  ):
    net.Instantiate()
  with pytest.raises(ValueError, match="Unknown AmoebaNet genotype 'nope'"):
    amoebanet.AmoebaNet.Params().Set(genotype='nope').Instantiate()
  cell = amoebanet_cells.AmoebaCell.Params().Set(
    name='c', filters=8, cur_dim=8, prev_dim=8
  )
  cases = [
    (amoebanet_cells.CellSpec(['1x1'], [0], [0, 0, 0]), 'two ops'),
    (
      amoebanet_cells.CellSpec(['1x1', '1x1'], [0, 3], [0, 0, 0]),
      'reads hidden state 3',
    ),
    (amoebanet_cells.CellSpec(['1x1', '1x1'], [0, 1], [0, 0]), 'give 3 flags'),
    (amoebanet_cells.CellSpec(['1x1', '1x1'], [0, 1], [1, 1, 1]), 'no output'),
    (
      amoebanet_cells.CellSpec(['1x1', 'avg_pool_3x5'], [0, 1], [0, 0, 0]),
      'square',
    ),
  ]
  for spec, msg in cases:
    with pytest.raises(ValueError, match=msg):
      _Build(cell.Copy().Set(cell_spec=spec))
  with pytest.raises(
    ValueError, match='dilation 2 but is applied with stride 2'
  ):
    amoebanet_ops.OpBlocks('dil_2_separable_3x3_2', 8, 8, 2)


def testCellInputChecks():
  g = amoebanet.GetGenotype('amoeba_net_d')
  cell = _Build(
    amoebanet_cells.AmoebaCell.Params().Set(
      cell_spec=g.normal,
      filters=8,
      cur_dim=32,
      prev_dim=32,
      prev_reduction=True,
    )
  )
  with pytest.raises(ValueError, match='prev_reduction = True expects'):
    cell(NestedMap(prev=_Rand([1, 4, 4, 32]), cur=_Rand([1, 4, 4, 32])))
  with pytest.raises(ValueError, match='state.cur must have 32 channels'):
    cell(NestedMap(prev=_Rand([1, 8, 8, 32]), cur=_Rand([1, 4, 4, 16])))
  with pytest.raises(ValueError, match='AmoebaStem first'):
    cell(_Rand([1, 4, 4, 32]))


def testDropPathIsStatelessPerExampleAndScaled():
  x = tf.ones([64, 2, 2, 3])
  with py_utils.StepSeed(5):
    a = amoebanet_cells.DropPath(x, 0.5, 17)
    b = amoebanet_cells.DropPath(x, 0.5, 17)
  with py_utils.StepSeed(6):
    c = amoebanet_cells.DropPath(x, 0.5, 17)
  np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert not np.array_equal(a.numpy(), c.numpy())
  per_example = a.numpy().reshape(64, -1)
  assert set(np.unique(per_example)) <= {0.0, 2.0}
  assert all(len(set(row)) == 1 for row in per_example)
  assert 10 < (per_example[:, 0] > 0).sum() < 54
  assert amoebanet_cells.DropPath(x, 1.0, 17) is x


# -- The network ---------------------------------------------------------------


def _Tiny(**kwargs):
  args = dict(
    num_cells=3,
    num_filters=16,
    image_size=32,
    image_channels=1,
    stem_type='cifar',
    stem_filters=8,
    bn_decay=0.9,
  )
  args.update(kwargs)
  return amoebanet.AmoebaNet.Params().Set(**args).Instantiate()


@pytest.mark.parametrize(
  'kwargs',
  [
    dict(),
    dict(
      stem_type='imagenet',
      genotype='amoeba_net_b',
      use_aux_head=True,
      num_classes=5,
      image_size=70,
      head_logits=True,
    ),
  ],
)
def testFpropMetaMatchesRealShapes(kwargs):
  net = _Tiny(**kwargs)
  layers = net.Layers()
  x = _Rand(net.InputShape(2))
  metas = partition.LayerMetas(layers, [None] + list(x.shape[1:]))
  state = x
  with py_utils.UpdateCollector():
    for lp, (flops, _, out_shapes) in zip(layers, metas):
      state = _Build(lp)(state)
      real = tf.nest.map_structure(lambda t: t.shape.as_list()[1:], state)
      want = tf.nest.map_structure(
        lambda s: tf.TensorShape(s).as_list()[1:], out_shapes[0]
      )
      assert real == want, lp.name
      assert flops > 0, lp.name
  if kwargs:
    assert state.logits.shape == [2, 5] and state.aux_logits.shape == [2, 5]
  else:
    assert state.shape == [2, net.FeatureDim()]
  names = [lp.name for lp in layers]
  if kwargs:
    assert names[:3] == ['stem', 'stem_cell_0', 'stem_cell_1']
    assert 'aux_1' in names  # After the last normal cell of stack 2.
    assert names.index('aux_1') == names.index('cell_1') + 1


def _CountParams(layers):
  """base_layer.CountParams of each layer, once per distinct layer."""
  cache, total = {}, 0
  for lp in layers:
    key = lp.Copy().Set(name='x').ToText()
    if key not in cache:
      cache[key] = base_layer.CountParams(lp)
    total += cache[key]
  return total


_PAPER = [
  # (genotype, L, D, image size, paper's parameter count)
  ('amoeba_net_d', 18, 208, 224, 82e6),
  ('amoeba_net_d', 18, 416, 224, 318e6),
  ('amoeba_net_d', 18, 544, 224, 542e6),
  ('amoeba_net_d', 36, 544, 224, 1.05e9),
  ('amoeba_net_d', 72, 512, 224, 1.8e9),
  ('amoeba_net_b', 18, 512, 480, 557e6),
]


@pytest.mark.parametrize('genotype,cells,filters,size,paper', _PAPER)
def testParameterCountsMatchThePaper(genotype, cells, filters, size, paper):
  net = (
    amoebanet.AmoebaNet.Params()
    .Set(
      genotype=genotype, num_cells=cells, num_filters=filters, image_size=size
    )
    .Instantiate()
  )
  softmax = net.FeatureDim() * 1000 + 1000
  total = _CountParams(net.Layers()) + softmax
  assert abs(total / paper - 1) < 0.05, (total, paper)


def testCountingByLayerEqualsTheWholePipeline():
  net = _Tiny(use_aux_head=True, num_classes=10)
  assert _CountParams(net.Layers()) == base_layer.CountParams(
    net.PipelineParams(num_stages=2)
  )


def testImageSizeErrors():
  with pytest.raises(
    ValueError,
    match=r'image_size = 12 leaves a 1x1 '
    r'feature map at reduction_cell_1, which a reduction '
    r'cell cannot halve; use an image_size of at least 19',
  ):
    amoebanet.AmoebaNet.Params().Set(
      image_size=12, num_cells=3, num_filters=8
    ).Instantiate()
  net = (
    amoebanet.AmoebaNet.Params()
    .Set(image_size=19, num_cells=3, num_filters=8)
    .Instantiate()
  )
  assert net.MinImageSize() == 19
  with pytest.raises(ValueError, match='needs at least 5x5'):
    amoebanet.AmoebaNet.Params().Set(
      image_size=64,
      num_cells=3,
      num_filters=8,
      use_aux_head=True,
      num_classes=3,
    ).Instantiate()
  with pytest.raises(
    ValueError, match='num_filters = 20 is not a multiple of 8'
  ):
    amoebanet.AmoebaNet.Params().Set(num_filters=20).Instantiate()


def testBenchmarkCellsEndWithLogits():
  layers, shape = amoebanet.BenchmarkCells(2)
  assert shape == [2, 32, 32, 3]
  state = _Rand(shape)
  with py_utils.UpdateCollector():
    for lp in layers:
      state = _Build(lp)(state)
  assert isinstance(state, tf.Tensor) and state.shape == [2, 10]


def testTaskAddsTheAuxLoss():
  net = _Tiny(use_aux_head=True, num_classes=10)
  p = amoebanet.AmoebaNetTask.Params().Set(
    name='amoebanet', num_classes=10, label_smoothing=0.1, aux_loss_weight=0.4
  )
  p.network = net.PipelineParams(num_stages=1)
  p.softmax.input_dim = net.FeatureDim()
  with base_layer.DetachedBuild():
    task = p.Instantiate()
  batch = NestedMap(
    image=_Rand([4, 32, 32, 1]), label=tf.constant([0, 3, 9, 1])
  )
  with py_utils.UpdateCollector():
    metrics, _ = task.FPropDefaultTheta(batch)
  main, aux = metrics.main_loss[0], metrics.aux_loss[0]
  np.testing.assert_allclose(
    metrics.loss[0].numpy(), (main + 0.4 * aux).numpy(), rtol=1e-6
  )
  assert 0 <= metrics.accuracy[0].numpy() <= 1 and 'acc5' in metrics


def testTaskAddsTheAuxLossOnTheLastCellWithOneFOneB():
  """With schedule '1f1b' the main and auxiliary losses are computed on the
  last cell per micro-batch; metrics and gradients are GPipe's."""
  batch = NestedMap(
    image=_Rand([4, 32, 32, 1]), label=tf.constant([0, 3, 9, 1])
  )
  results = {}
  for schedule in ('gpipe', '1f1b'):
    net = _Tiny(use_aux_head=True, num_classes=10)
    p = amoebanet.AmoebaNetTask.Params().Set(
      name='amoebanet', num_classes=10, label_smoothing=0.1, random_seed=5
    )
    p.network = net.PipelineParams(
      num_stages=2, num_micro_batches=2, devices=DEVICES[:2]
    ).Set(schedule=schedule)
    p.softmax.input_dim = net.FeatureDim()
    with base_layer.DetachedBuild():
      task = p.Instantiate()
    assert task._LossOnLastCell() == (schedule == '1f1b')
    variables = {k: v for k, v in task.VariablesByName().items() if v.trainable}
    with py_utils.StepSeed(7), py_utils.UpdateCollector():
      with tf.GradientTape() as tape:
        metrics, _ = task.FPropDefaultTheta(batch)
      grads = tape.gradient(metrics.loss[0], list(variables.values()))
    results[schedule] = metrics, dict(zip(variables, grads))
  (m_g, g_g), (m_1, g_1) = results['gpipe'], results['1f1b']
  for key in ('loss', 'main_loss', 'aux_loss', 'accuracy'):
    np.testing.assert_allclose(
      m_1[key][0].numpy(), m_g[key][0].numpy(), rtol=1e-5, err_msg=key
    )
  assert any('aux' in name for name in g_g)
  for name, g in g_g.items():
    assert g is not None and g_1[name] is not None, name
    np.testing.assert_allclose(
      g_1[name].numpy(), g.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
    )


def _LossAndGrads(net, num_stages, num_micro_batches, x, labels):
  pipe = _Build(
    net.PipelineParams(
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      devices=DEVICES[:num_stages],
    ).Set(random_seed=3)
  )
  with py_utils.StepSeed(7), py_utils.UpdateCollector() as updates:
    with tf.GradientTape() as tape:
      logits = pipe(x)
      loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
      )
    variables = pipe.trainable_variables
    grads = tape.gradient(loss, variables)
  updates.Apply()
  with py_utils.EvalMode():
    eval_logits = pipe(x)
  names = [v.name for v in variables]
  moving = {v.name: v.numpy() for v in pipe.variables if not v.trainable}
  return loss, dict(zip(names, grads)), eval_logits, moving


def _SequentialReference(net, x, labels, num_micro_batches):
  """GPipe's semantics without a pipeline: the plain layers run on each
  micro-batch (BN statistics per micro-batch, the pipeline's per-micro-batch
  step seeds), the loss is the mean over the whole batch."""
  seq = _Build(
    sequential.SequentialLayer.Params().Set(
      name='network', sub=net.Layers(), random_seed=3
    )
  )
  xs = tf.split(x, num_micro_batches)
  ys = tf.split(labels, num_micro_batches)
  with tf.GradientTape() as tape, py_utils.UpdateCollector():
    losses = []
    for m, (xm, ym) in enumerate(zip(xs, ys)):
      with py_utils.StepSeed(py_utils.MixSeed(tf.constant(7, tf.int64), m)):
        logits = seq(xm)
      losses.append(tf.nn.sparse_softmax_cross_entropy_with_logits(ym, logits))
    loss = tf.reduce_mean(tf.concat(losses, 0))
  variables = seq.trainable_variables
  grads = tape.gradient(loss, variables)
  return loss, {v.name: g for v, g in zip(variables, grads)}


def testPipelineTransparency():
  """K=2, M=2 == the plain layers run per micro-batch == K=1, M=2: loss and
  gradients (BN per micro-batch, drop-path on); then the eval outputs; the
  first BN's moving averages do not depend on M."""
  net = _Tiny(
    drop_path_keep_prob=0.7, num_classes=10, head_logits=True, image_size=16
  )
  x = _Rand([8, 16, 16, 1])
  labels = tf.constant([0, 1, 2, 3, 4, 5, 6, 7])
  ref_loss, ref_grads = _SequentialReference(net, x, labels, 2)
  k1 = {m: _LossAndGrads(net, 1, m, x, labels) for m in (1, 2)}
  loss, grads, eval_logits, moving = _LossAndGrads(net, 2, 2, x, labels)
  np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5)
  np.testing.assert_allclose(k1[2][0].numpy(), ref_loss.numpy(), rtol=1e-5)
  assert grads.keys() == ref_grads.keys() == k1[2][1].keys()
  assert len(grads) > 50
  for name, g in grads.items():
    assert g is not None, name
    np.testing.assert_allclose(
      g.numpy(), ref_grads[name].numpy(), rtol=1e-3, atol=1e-5, err_msg=name
    )
    np.testing.assert_allclose(
      k1[2][1][name].numpy(),
      ref_grads[name].numpy(),
      rtol=1e-3,
      atol=1e-5,
      err_msg=name,
    )
  # Eval uses the moving averages: after the same first update, the eval
  # outputs of K=2, M=2 and K=1, M=2 agree. M=1 normalizes the whole batch
  # at once, but the first BN's inputs do not depend on M and its moving
  # averages are merged over the micro-batches: the same either way.
  np.testing.assert_allclose(
    eval_logits.numpy(), k1[2][2].numpy(), rtol=1e-4, atol=1e-5
  )
  stem_mean = [
    n for n in moving if n.startswith('network/stem/') and 'moving_mean' in n
  ][0]
  np.testing.assert_allclose(
    moving[stem_mean], k1[1][3][stem_mean], rtol=1e-4, atol=1e-6
  )
