"""The operations of AmoebaNet cells, built from their names in a genotype.

A genotype names each operation with a string, as TensorFlow's AmoebaNet
(tensorflow/tpu models/official/amoeba_net) does. `CellOp` turns such a name
into layers; every op maps [b, h, w, dim] to [b, ceil(h / stride),
ceil(w / stride), dim]:

  none                  identity (stride 1), else a `FactorizedReduction`
  1x1                   ReLU -> 1x1 conv (strided) -> BN
  avg_pool_KxK          average pooling (SAME, padding not counted)
  max_pool_KxK          max pooling (SAME)
  separable_KxK_N       N x (ReLU -> separable KxK conv -> BN), the first one
                        strided (TF's AmoebaNet uses N = 2)
  dil_R_separable_KxK_N the same with dilation R (stride 1 only)
  3x3, 1x7_7x1, 1x3_3x1, dilated_3x3_rate_R
                        TF's bottleneck: ReLU -> 1x1 conv to dim/4 (3 dim/8
                        for 1x3_3x1) -> BN, then each conv as ReLU -> conv ->
                        BN (1x7 strided along the width, 7x1 along the
                        height), then ReLU -> 1x1 conv back to dim -> BN

Convolutions have no bias (a BN follows each). `FactorizedReduction` halves
the resolution without dropping pixels: two 1x1 convs, one on the even and
one on the odd (shifted by one pixel) positions, each with half the output
channels, concatenated and batch-normalized.

An op is first turned into a list of `Block`s (pure data), from which both
the layers and the analytic `FPropMeta` are derived; an unknown name raises a
ValueError that names it and lists the known forms.
"""

import collections
import re

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import normalizations

__all__ = [
  'ParseOp',
  'KNOWN_OPS',
  'Block',
  'OpBlocks',
  'BlockMeta',
  'BlockParams',
  'FusedBatchNorm',
  'ReluConvBN',
  'FactorizedReduction',
  'CellOp',
  'ReducedSize',
]

KNOWN_OPS = (
  'none',
  '1x1',
  'avg_pool_KxK',
  'max_pool_KxK',
  'separable_KxK_N',
  'dil_R_separable_KxK_N',
  '3x3',
  '1x7_7x1',
  '1x3_3x1',
  'dilated_3x3_rate_R',
)

_POOL_RE = re.compile(r'^(avg|max)_pool_(\d+)x(\d+)$')
_SEP_RE = re.compile(r'^(?:dil_(\d+)_)?separable_(\d+)x(\d+)_(\d+)$')
_DILATED_RE = re.compile(r'^dilated_3x3_rate_(\d+)$')
# Bottleneck convolutions: name -> [(kernel_h, kernel_w, strided along h,
# strided along w)].
_BOTTLENECK = {
  '3x3': [(3, 3, 1, 1)],
  '1x7_7x1': [(1, 7, 0, 1), (7, 1, 1, 0)],
  '1x3_3x1': [(1, 3, 0, 1), (3, 1, 1, 0)],
}
_BN_FLOPS = 8  # Per element: moments and normalization.

# One step of an op. kind: 'conv' (ReLU? -> conv -> BN), 'pool' or 'fr'
# (factorized reduction).
Block = collections.namedtuple(
  'Block',
  [
    'kind',
    'name',
    'input_dim',
    'output_dim',
    'kernel',
    'stride',
    'dilation',
    'separable',
    'relu',
    'pooling_type',
  ],
)


def _Conv(
  name,
  cin,
  cout,
  kernel=(1, 1),
  stride=(1, 1),
  dilation=1,
  separable=False,
  relu=True,
):
  return Block(
    'conv',
    name,
    cin,
    cout,
    tuple(kernel),
    tuple(stride),
    dilation,
    separable,
    relu,
    None,
  )


def ReducedSize(size, stride):
  """Spatial size after a SAME-padded stride (None stays None)."""
  if size is None:
    return None
  return -(-size // stride)


def _OpError(op, why=''):
  return ValueError(
    f'Unknown AmoebaNet operation {op!r}{": " + why if why else ""}. Known '
    f'forms: {", ".join(KNOWN_OPS)} (K, N, R integers), e.g. '
    '"separable_3x3_2" or "max_pool_3x3". Fix the genotype.'
  )


def ParseOp(op):
  """Parses an op name into a NestedMap describing it.

  Args:
    op: the op's name in a genotype, e.g. 'separable_5x5_2'.

  Returns:
    NestedMap(kind=one of 'none', '1x1', 'pool', 'separable', 'bottleneck',
    plus: pooling_type and window ('pool'); kernel, num_layers, dilation
    ('separable'); convs [(kh, kw, strided_h, strided_w)], dilation and
    reduce_ratio ('bottleneck')).

  Raises:
    ValueError: naming `op` if it is not a known form.
  """
  if not isinstance(op, str):
    raise _OpError(op, 'op names are strings')
  if op in ('none', '1x1'):
    return NestedMap(kind=op)
  m = _POOL_RE.match(op)
  if m:
    if m.group(2) != m.group(3) or int(m.group(2)) < 1:
      raise _OpError(op, 'pooling windows must be square and >= 1')
    return NestedMap(
      kind='pool', pooling_type=m.group(1).upper(), window=int(m.group(2))
    )
  m = _SEP_RE.match(op)
  if m:
    dilation = int(m.group(1) or 1)
    if m.group(2) != m.group(3) or int(m.group(2)) < 1:
      raise _OpError(op, 'separable kernels must be square and >= 1')
    if int(m.group(4)) < 1 or dilation < 1:
      raise _OpError(op, 'the layer count and dilation must be >= 1')
    return NestedMap(
      kind='separable',
      kernel=int(m.group(2)),
      num_layers=int(m.group(4)),
      dilation=dilation,
    )
  if op in _BOTTLENECK:
    ratio = 3.0 / 8.0 if op == '1x3_3x1' else 0.25
    return NestedMap(
      kind='bottleneck',
      convs=list(_BOTTLENECK[op]),
      dilation=1,
      reduce_ratio=ratio,
    )
  m = _DILATED_RE.match(op)
  if m and int(m.group(1)) >= 1:
    return NestedMap(
      kind='bottleneck',
      convs=[(3, 3, 1, 1)],
      dilation=int(m.group(1)),
      reduce_ratio=0.25,
    )
  raise _OpError(op)


def OpBlocks(op, input_dim, output_dim, stride, who='CellOp'):
  """The `Block`s op `op` runs in sequence (empty for the identity).

  Raises:
    ValueError: for an unknown op, or a dilated op applied with a stride.
  """
  spec = ParseOp(op)
  s, c_in, c = stride, input_dim, output_dim
  if spec.kind == 'none':
    if s == 1 and c_in == c:
      return []
    return [
      Block('fr', 'reduce', c_in, c, (1, 1), (s, s), 1, False, True, None)
    ]
  if spec.kind == '1x1':
    return [_Conv('conv', c_in, c, stride=(s, s))]
  if spec.kind == 'pool':
    out = [
      Block(
        'pool',
        'pool',
        c_in,
        c_in,
        (spec.window, spec.window),
        (s, s),
        1,
        False,
        False,
        spec.pooling_type,
      )
    ]
    if c_in != c:
      out.append(_Conv('proj', c_in, c, relu=False))
    return out
  if spec.dilation > 1 and s > 1:
    raise ValueError(
      f'{who}: op {op!r} has dilation {spec.dilation} but is applied with '
      f'stride {s}; TensorFlow convolutions take one or the other. In a '
      'reduction cell, apply dilated ops to hidden states made inside the '
      'cell (index >= 2).'
    )
  if spec.kind == 'separable':
    k = spec.kernel
    return [
      _Conv(
        f'separable_{k}x{k}_{i + 1}',
        c_in if i == 0 else c,
        c,
        (k, k),
        (s, s) if i == 0 else (1, 1),
        spec.dilation,
        separable=True,
      )
      for i in range(spec.num_layers)
    ]
  reduced = int(c * spec.reduce_ratio)
  out = []
  if reduced >= 1:
    out.append(_Conv('pre_1x1', c_in, reduced))
  inner = reduced if reduced >= 1 else c
  dim = reduced if reduced >= 1 else c_in
  for kh, kw, sh, sw in spec.convs:
    out.append(
      _Conv(
        f'conv_{kh}x{kw}',
        dim,
        inner,
        (kh, kw),
        (s if sh else 1, s if sw else 1),
        spec.dilation,
      )
    )
    dim = inner
  if reduced >= 1:
    out.append(_Conv('post_1x1', reduced, c))
  return out


def BlockMeta(block, dims):
  """(flops, output dims) of `block` on input dims [b, h, w, c]."""
  b, h, w, _ = dims
  oh, ow = ReducedSize(h, block.stride[0]), ReducedSize(w, block.stride[1])
  out = [b, oh, ow, block.output_dim]
  n_in = _shapes.NumElements(dims)
  n_out = _shapes.NumElements(out)
  if block.kind == 'pool':
    return block.kernel[0] * block.kernel[1] * n_out, out
  flops = (n_in if block.relu else 0) + _BN_FLOPS * n_out
  if block.kind == 'fr':
    return flops + 2 * n_out * block.input_dim, out
  kh, kw = block.kernel
  if block.separable:
    spatial = _shapes.NumElements([b, oh, ow])
    flops += 2 * spatial * block.input_dim * kh * kw
    flops += 2 * n_out * block.input_dim
  else:
    flops += 2 * n_out * kh * kw * block.input_dim
  return flops, out


def BlockParams(block, bn_decay):
  """Layer Params of a 'conv' or 'fr' block."""
  if block.kind == 'fr':
    return FactorizedReduction.Params().Set(
      name=block.name,
      input_dim=block.input_dim,
      output_dim=block.output_dim,
      stride=block.stride[0],
      relu=block.relu,
      bn_decay=bn_decay,
    )
  return ReluConvBN.Params().Set(
    name=block.name,
    input_dim=block.input_dim,
    output_dim=block.output_dim,
    kernel=block.kernel,
    stride=block.stride,
    dilation=block.dilation,
    separable=block.separable,
    relu=block.relu,
    bn_decay=bn_decay,
  )


def _CheckNHWC(who, shape, dim):
  return _shapes.CheckShape(
    who,
    'inputs',
    shape,
    [None, None, None, dim],
    f'Inputs must be NHWC with {dim} channels (input_dim).',
  )


def _BatchNormParams(dim, decay):
  return normalizations.BatchNormLayer.Params().Set(
    name='bn', dim=dim, decay=decay
  )


def FusedBatchNorm(bn, theta, inputs):
  """BatchNormLayer `bn`'s computation on NHWC inputs, as one fused op.

  The same semantics as `bn.FProp` (batch statistics in training, handed to
  `py_utils.AddDeferredUpdate` so a pipeline updates the moving averages
  once per mini-batch; moving averages in eval), with TensorFlow's fused
  kernel: a cell has dozens of batch norms, and one op instead of ~25 per
  batch norm keeps the traced pipeline graph small.

  Args:
    bn: a BatchNormLayer (beta/gamma variables, not
      use_moving_avg_in_training).
    theta: its theta.
    inputs: [b, h, w, bn.params.dim], float32.

  Returns:
    The normalized inputs, same shape.
  """
  p = bn.params
  dtype = inputs.dtype
  x = tf.cast(inputs, tf.float32) if dtype != tf.float32 else inputs
  gamma = tf.cast(theta.gamma, tf.float32)
  beta = tf.cast(theta.beta, tf.float32)
  if bn.do_eval:
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(
      x,
      gamma,
      beta,
      mean=tf.cast(theta.moving_mean, tf.float32),
      variance=tf.cast(theta.moving_variance, tf.float32),
      epsilon=p.epsilon,
      is_training=False,
    )
  else:
    y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
      x, gamma, beta, epsilon=p.epsilon, is_training=True
    )
    # The kernel returns the unbiased variance; the moments are biased.
    dims = x.shape.as_list()
    if all(d is not None for d in dims[:3]):
      n = dims[0] * dims[1] * dims[2]
      count = tf.constant(float(n))
      variance = variance * ((n - 1.0) / max(n, 1))
    else:
      count = tf.cast(tf.reduce_prod(tf.shape(x)[:3]), tf.float32)
      variance = variance * ((count - 1.0) / tf.maximum(count, 1.0))
    py_utils.AddDeferredUpdate(
      bn,
      NestedMap(
        mean=tf.stop_gradient(mean),
        variance=tf.stop_gradient(variance),
        count=count,
      ),
    )
  return tf.cast(y, dtype) if dtype != tf.float32 else y


class ReluConvBN(base_layer.BaseLayer):
  """[ReLU ->] conv (plain or depthwise-separable, no bias) -> BN.

  [b, h, w, input_dim] -> [b, ceil(h / sh), ceil(w / sw), output_dim].
  Variables: `w` [kh, kw, in, out] (separable: `depthwise_w` [kh, kw, in, 1]
  and the pointwise `w` [1, 1, in, out]) and the BatchNormLayer `bn`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Input channels.')
    p.Define('output_dim', 0, 'Output channels.')
    p.Define('kernel', (1, 1), 'Kernel [height, width].')
    p.Define('stride', (1, 1), 'Stride [height, width].')
    p.Define('dilation', 1, 'Dilation rate (requires stride (1, 1)).')
    p.Define(
      'separable',
      False,
      'True: a depthwise (multiplier 1) then a pointwise conv.',
    )
    p.Define('relu', True, 'Whether a ReLU precedes the conv.')
    p.Define('bn_decay', 0.9997, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def _Block(cls, p):
    _shapes.CheckPositive(p, 'input_dim', 'output_dim', 'dilation')
    if p.dilation > 1 and tuple(p.stride) != (1, 1):
      raise ValueError(
        f'{_shapes.LayerName(p)}: dilation {p.dilation} with '
        f'stride {p.stride}; use one of the two.'
      )
    return _Conv(
      p.name,
      p.input_dim,
      p.output_dim,
      p.kernel,
      p.stride,
      p.dilation,
      p.separable,
      p.relu,
    )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Block(p)
    kh, kw = p.kernel
    if p.separable:
      self.CreateVariable(
        'depthwise_w', py_utils.WeightParams([kh, kw, p.input_dim, 1])
      )
      self.CreateVariable(
        'w', py_utils.WeightParams([1, 1, p.input_dim, p.output_dim])
      )
    else:
      self.CreateVariable(
        'w', py_utils.WeightParams([kh, kw, p.input_dim, p.output_dim])
      )
    self.CreateChild('bn', _BatchNormParams(p.output_dim, p.bn_decay))

  def FProp(self, theta, inputs):
    """[b, h, w, input_dim] -> [b, h', w', output_dim]."""
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    _CheckNHWC(self, inputs.shape, p.input_dim)
    x = tf.nn.relu(inputs) if p.relu else inputs
    strides = [1, p.stride[0], p.stride[1], 1]
    rate = [p.dilation, p.dilation]
    if p.separable:
      x = tf.nn.depthwise_conv2d(
        x, theta.depthwise_w, strides, 'SAME', dilations=rate
      )
      x = tf.nn.conv2d(x, theta.w, 1, 'VALID')
    else:
      x = tf.nn.conv2d(x, theta.w, strides, 'SAME', dilations=rate)
    return FusedBatchNorm(self.bn, theta.bn, x)

  @classmethod
  def FPropMeta(cls, p, inputs):
    dims = _CheckNHWC(p, inputs, p.input_dim)
    flops, out = BlockMeta(cls._Block(p), dims)
    return meta.Meta(flops, tf.TensorShape(out))


class FactorizedReduction(base_layer.BaseLayer):
  """Changes the channels (stride 1) or halves the resolution (stride 2).

  [ReLU ->] stride 1: 1x1 conv `w`; stride 2: 1x1 convs `path1_w` on
  x[:, ::2, ::2] and `path2_w` on the input shifted by one pixel
  (zero-padded at the bottom/right), output_dim / 2 channels each,
  concatenated; then BN `bn` (TF's `factorized_reduction`).
  [b, h, w, input_dim] -> [b, ceil(h / s), ceil(w / s), output_dim].
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Input channels.')
    p.Define('output_dim', 0, 'Output channels (even for stride 2).')
    p.Define('stride', 2, 'Stride: 1 or 2.')
    p.Define('relu', True, 'Whether a ReLU precedes the convs.')
    p.Define('bn_decay', 0.9997, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def _Block(cls, p):
    _shapes.CheckPositive(p, 'input_dim', 'output_dim')
    name = _shapes.LayerName(p)
    if p.stride not in (1, 2):
      raise ValueError(f'{name}: stride = {p.stride!r}; use 1 or 2.')
    if p.stride == 2 and p.output_dim % 2:
      raise ValueError(
        f'{name}: output_dim = {p.output_dim} is odd; a factorized '
        'reduction splits the output channels between two paths, so use '
        'an even number of filters (an AmoebaNet num_filters divisible by '
        '8).'
      )
    return Block(
      'fr',
      p.name,
      p.input_dim,
      p.output_dim,
      (1, 1),
      (p.stride, p.stride),
      1,
      False,
      p.relu,
      None,
    )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Block(p)
    if p.stride == 1:
      self.CreateVariable(
        'w', py_utils.WeightParams([1, 1, p.input_dim, p.output_dim])
      )
    else:
      for name in ('path1_w', 'path2_w'):
        self.CreateVariable(
          name, py_utils.WeightParams([1, 1, p.input_dim, p.output_dim // 2])
        )
    self.CreateChild('bn', _BatchNormParams(p.output_dim, p.bn_decay))

  def FProp(self, theta, inputs):
    """[b, h, w, input_dim] -> [b, ceil(h/s), ceil(w/s), output_dim]."""
    p = self.params
    inputs = _shapes.CastFloat(inputs, self.fprop_dtype)
    _CheckNHWC(self, inputs.shape, p.input_dim)
    if p.relu:
      inputs = tf.nn.relu(inputs)
    if p.stride == 1:
      out = tf.nn.conv2d(inputs, theta.w, 1, 'VALID')
    else:
      path1 = tf.nn.conv2d(inputs[:, ::2, ::2, :], theta.path1_w, 1, 'VALID')
      shifted = tf.pad(inputs, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:]
      path2 = tf.nn.conv2d(shifted[:, ::2, ::2, :], theta.path2_w, 1, 'VALID')
      out = tf.concat([path1, path2], axis=-1)
    return FusedBatchNorm(self.bn, theta.bn, out)

  @classmethod
  def FPropMeta(cls, p, inputs):
    dims = _CheckNHWC(p, inputs, p.input_dim)
    flops, out = BlockMeta(cls._Block(p), dims)
    return meta.Meta(flops, tf.TensorShape(out))


class CellOp(base_layer.BaseLayer):
  """One operation of an AmoebaNet cell, named as in the genotype.

  [b, h, w, input_dim] -> [b, ceil(h / stride), ceil(w / stride),
  output_dim]. See the module docstring for the ops; the children are the
  op's conv blocks (`ReluConvBN`) or its `FactorizedReduction` `reduce`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('op', 'none', 'The op name, e.g. "separable_3x3_2".')
    p.Define('input_dim', 0, 'Input channels.')
    p.Define('output_dim', 0, "Output channels (the cell's filters).")
    p.Define('stride', 1, 'Stride: 1, or 2 in a reduction cell.')
    p.Define('bn_decay', 0.9997, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def Blocks(cls, p):
    """The op's `Block`s (validated)."""
    _shapes.CheckPositive(p, 'input_dim', 'output_dim', 'stride')
    return OpBlocks(
      p.op, p.input_dim, p.output_dim, p.stride, _shapes.LayerName(p)
    )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._blocks = self.Blocks(p)
    for block in self._blocks:
      if block.kind != 'pool':
        self.CreateChild(block.name, BlockParams(block, p.bn_decay))

  @property
  def is_identity(self):
    """True for 'none' at stride 1 without a channel change."""
    return not self._blocks

  def FProp(self, theta, inputs):
    """[b, h, w, input_dim] -> [b, h / stride, w / stride, output_dim]."""
    _CheckNHWC(self, inputs.shape, self.params.input_dim)
    for block in self._blocks:
      if block.kind == 'pool':
        inputs = tf.nn.pool(
          inputs,
          list(block.kernel),
          block.pooling_type,
          strides=list(block.stride),
          padding='SAME',
        )
      else:
        inputs = self._private_children[block.name].FProp(
          theta[block.name], inputs
        )
    return inputs

  @classmethod
  def FPropMeta(cls, p, inputs):
    dims = _CheckNHWC(p, inputs, p.input_dim)
    flops = 0
    for block in cls.Blocks(p):
      f, dims = BlockMeta(block, dims)
      flops += f
    return meta.Meta(flops, tf.TensorShape(dims))
