"""AmoebaNet genotypes (as data) and cells.

An AmoebaNet is a chain of cells, each consuming the outputs of the two
previous cells. To run it in a `PipeliningLayer`, whose layers pass one state
along, the state is `NestedMap(prev=..., cur=...)`:

  images [b, H, W, 3]
    -> AmoebaStem        NestedMap(prev=x, cur=x), x = BN(conv3x3/2(images))
    -> AmoebaCell ...    NestedMap(prev=cur_in, cur=cell(prev_in, cur_in))
    -> AmoebaAuxHead     (optional) adds aux_logits [b, num_classes]
    -> AmoebaCell ...    (keys other than prev/cur pass through)
    -> AmoebaHead        features [b, dim] (or logits [b, num_classes]),
                         NestedMap(features, aux_logits) with an aux head

(the stem and heads are in `amoebanet_heads`).

A cell is described by data, its `CellSpec` (TF AmoebaNet's three lists):
`operations` (2B op names), `hiddenstate_indices` (2B indices: op 2i and
2i+1 read hidden states indices[2i] and indices[2i+1] and their sum is
hidden state 2 + i), and `used_hiddenstates` (2 + B flags: the hidden states
with flag 0 are concatenated into the output). Hidden states 0 and 1 are the
current and previous cell outputs brought to `num_filters` channels at the
current resolution (ReLU-1x1 conv-BN; a factorized reduction for a previous
output of twice the resolution). In a reduction cell the ops reading states 0
and 1 have stride 2. Every op but 'none' is followed by drop-path.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.models import amoebanet_ops

__all__ = [
  'CellSpec',
  'Genotype',
  'GENOTYPES',
  'GetGenotype',
  'ValidateCellSpec',
  'CellShapes',
  'DropPath',
  'CheckState',
  'AmoebaCell',
]


def CellSpec(operations=(), hiddenstate_indices=(), used_hiddenstates=()):
  """A Params describing one cell (TF AmoebaNet's model_specs lists)."""
  p = hyperparams.Params()
  p.Define(
    'operations',
    list(operations),
    'Op names, two per combination (left, right).',
  )
  p.Define(
    'hiddenstate_indices',
    list(hiddenstate_indices),
    'Hidden state read by each op; combination i makes state 2 + i.',
  )
  p.Define(
    'used_hiddenstates',
    list(used_hiddenstates),
    '2 + B flags; the states flagged 0 are concatenated as output.',
  )
  return p


def Genotype(name, normal, reduction):
  """A Params holding a genotype's normal and reduction `CellSpec`s."""
  p = hyperparams.Params()
  p.Define('name', name, 'Name of the genotype.')
  p.Define('normal', normal, 'CellSpec of the normal cell.')
  p.Define('reduction', reduction, 'CellSpec of the reduction cell.')
  return p


# The genotypes of TF's AmoebaNet (tensorflow/tpu,
# models/official/amoeba_net/model_specs.py), from Real et al., "Regularized
# Evolution for Image Classifier Architecture Search" (arXiv 1802.01548).
_GENOTYPES = {
  'amoeba_net_a': (
    (
      [
        'avg_pool_3x3',
        'max_pool_3x3',
        'separable_3x3_2',
        'none',
        'none',
        'avg_pool_3x3',
        'separable_3x3_2',
        'separable_5x5_2',
        'avg_pool_3x3',
        'separable_3x3_2',
      ],
      [0, 0, 1, 1, 0, 1, 0, 2, 5, 0],
      [1, 0, 1, 0, 0, 1, 0],
    ),
    (
      [
        'separable_3x3_2',
        'avg_pool_3x3',
        'max_pool_3x3',
        'separable_7x7_2',
        'max_pool_3x3',
        'max_pool_3x3',
        'separable_3x3_2',
        '1x7_7x1',
        'avg_pool_3x3',
        'separable_7x7_2',
      ],
      [1, 0, 0, 2, 1, 0, 4, 0, 1, 0],
      [1, 1, 0, 0, 0, 0, 0],
    ),
  ),
  'amoeba_net_b': (
    (
      [
        '1x1',
        'max_pool_3x3',
        'none',
        'separable_3x3_2',
        '1x1',
        'separable_3x3_2',
        '1x1',
        'none',
        'avg_pool_3x3',
        '1x1',
      ],
      [1, 1, 1, 0, 1, 0, 2, 2, 1, 5],
      [0, 1, 1, 0, 0, 1, 0],
    ),
    (
      [
        'max_pool_2x2',
        'max_pool_3x3',
        'none',
        '3x3',
        'dil_2_separable_5x5_2',
        'max_pool_3x3',
        'none',
        'separable_3x3_2',
        'avg_pool_3x3',
        '1x1',
      ],
      [0, 0, 2, 1, 2, 2, 3, 1, 4, 3],
      [1, 1, 1, 1, 1, 0, 0],
    ),
  ),
  'amoeba_net_d': (
    (
      [
        '1x1',
        'max_pool_3x3',
        'none',
        '1x7_7x1',
        '1x1',
        '1x7_7x1',
        'max_pool_3x3',
        'none',
        'avg_pool_3x3',
        '1x1',
      ],
      [1, 1, 1, 0, 0, 0, 2, 2, 1, 5],
      [0, 1, 1, 0, 0, 1, 0],
    ),
    (
      [
        'max_pool_2x2',
        'max_pool_3x3',
        'none',
        '3x3',
        '1x7_7x1',
        'max_pool_3x3',
        'none',
        'max_pool_2x2',
        'avg_pool_3x3',
        '1x1',
      ],
      [0, 0, 2, 1, 2, 2, 3, 1, 2, 3],
      [1, 1, 1, 1, 0, 0, 0],
    ),
  ),
}

GENOTYPES = tuple(sorted(_GENOTYPES))


def GetGenotype(name):
  """The Genotype Params of a named genotype, e.g. 'amoeba_net_d'."""
  if name not in _GENOTYPES:
    raise ValueError(
      f'Unknown AmoebaNet genotype {name!r}; use one of '
      f'{list(GENOTYPES)}, or pass a Genotype(...) Params.'
    )
  normal, reduction = _GENOTYPES[name]
  return Genotype(name, CellSpec(*normal), CellSpec(*reduction))


def ValidateCellSpec(spec, what='cell'):
  """Checks a CellSpec; returns the indices of the concatenated states.

  Raises:
    ValueError: naming the bad entry (including an unknown op) and the fix.
  """
  ops = list(spec.operations)
  idx = list(spec.hiddenstate_indices)
  used = list(spec.used_hiddenstates)
  if not ops or len(ops) % 2:
    raise ValueError(
      f'{what}: operations has {len(ops)} entries; give two '
      'ops (left, right) per combination, at least one pair.'
    )
  if len(idx) != len(ops):
    raise ValueError(
      f'{what}: hiddenstate_indices has {len(idx)} entries '
      f'but operations has {len(ops)}; give one index per op.'
    )
  num_states = 2 + len(ops) // 2
  if len(used) != num_states:
    raise ValueError(
      f'{what}: used_hiddenstates has {len(used)} flags; '
      f'{len(ops) // 2} combinations make {num_states} hidden '
      f'states, so give {num_states} flags.'
    )
  for i, (op, j) in enumerate(zip(ops, idx)):
    amoebanet_ops.ParseOp(op)
    if not isinstance(j, int) or not 0 <= j < 2 + i // 2:
      raise ValueError(
        f'{what}: op {i} ({op!r}) reads hidden state {j!r}, '
        f'but only states 0..{1 + i // 2} exist before '
        f'combination {i // 2}; fix hiddenstate_indices.'
      )
  if any(u not in (0, 1) for u in used):
    raise ValueError(
      f'{what}: used_hiddenstates = {used}; flags are 0 '
      '(concatenated into the output) or 1.'
    )
  concat = [i for i, u in enumerate(used) if not u]
  if not concat:
    raise ValueError(
      f'{what}: every hidden state is flagged used, so the '
      'cell has no output; flag at least one with 0.'
    )
  return concat


def CellShapes(p):
  """The stride factor of every hidden state of cell Params `p`.

  States 0 and 1 (the inputs) are at factor 1; in a reduction cell every op
  reading them is strided, so every state made in the cell is at factor
  `p.stride`.
  """
  num_combs = len(p.cell_spec.operations) // 2
  return [1, 1] + [p.stride] * num_combs


def DropPath(inputs, keep_prob, layer_seed):
  """Drops whole examples' paths: [b, ...] * mask[b] / keep_prob.

  The mask is stateless (`py_utils.GenerateStepSeedPair(layer_seed)`): the
  same layer and step seed give the same mask, so a re-materialized forward
  pass drops the same paths.
  """
  if keep_prob >= 1.0:
    return inputs
  shape = tf.concat(
    [tf.shape(inputs)[:1], tf.ones([inputs.shape.rank - 1], tf.int32)], 0
  )
  u = tf.random.stateless_uniform(
    shape, py_utils.GenerateStepSeedPair(layer_seed), dtype=tf.float32
  )
  keep = tf.cast(u < keep_prob, inputs.dtype)
  return inputs * keep * tf.cast(1.0 / keep_prob, inputs.dtype)


def CheckState(who, state, extra=''):
  """Raises ValueError unless `state` is the NestedMap(prev, cur) state."""
  if not isinstance(state, dict) or 'prev' not in state or 'cur' not in state:
    raise ValueError(
      f'{_shapes.LayerName(who)} takes the AmoebaNet state NestedMap(prev, '
      f'cur) made by AmoebaStem, got {state!r}.{extra} Put an AmoebaStem '
      'first in the layer list.'
    )


class AmoebaCell(base_layer.BaseLayer):
  """A normal or reduction cell. See the module docstring.

  NestedMap(prev [b, 2h or h, .., prev_dim], cur [b, h, w, cur_dim], ...) ->
  NestedMap(prev=cur, cur=[b, h / stride, w / stride, filters * |concat|],
  ...).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('cell_spec', CellSpec(), "The cell's CellSpec (genotype data).")
    p.Define('filters', 0, 'Channels of every hidden state.')
    p.Define('cur_dim', 0, 'Channels of the current input (state.cur).')
    p.Define('prev_dim', 0, 'Channels of the previous input (state.prev).')
    p.Define(
      'prev_reduction',
      False,
      'True if state.prev has twice the resolution of state.cur (a '
      'reduction cell came in between): it is halved by a '
      'factorized reduction.',
    )
    p.Define('stride', 1, '1: normal cell; 2: reduction cell.')
    p.Define(
      'drop_path_keep_prob',
      1.0,
      'Keep probability of drop-path after each op but "none" '
      '(training only; 1: off).',
    )
    p.Define('bn_decay', 0.9997, 'Decay of the batch norm moving averages.')
    return p

  @classmethod
  def _Plan(cls, p):
    """NestedMap(concat, prev, cur, ops, reduce): the cell's parts.

    prev/cur: the `Block`s bringing the inputs to `filters` channels (prev
    None when it already fits); ops: [(name, op, stride)]; reduce: {state
    index: Block} for concatenated states at a finer resolution.
    """
    name = _shapes.LayerName(p)
    _shapes.CheckPositive(p, 'filters', 'cur_dim', 'prev_dim')
    if p.stride not in (1, 2):
      raise ValueError(
        f'{name}: stride = {p.stride!r}; use 1 (normal cell) '
        'or 2 (reduction cell).'
      )
    if not 0.0 < p.drop_path_keep_prob <= 1.0:
      raise ValueError(
        f'{name}: drop_path_keep_prob = '
        f'{p.drop_path_keep_prob!r}; use a value in (0, 1].'
      )
    concat = ValidateCellSpec(p.cell_spec, name)
    factors = CellShapes(p)
    f = p.filters
    Block = amoebanet_ops.Block  # pylint: disable=invalid-name
    plan = NestedMap(concat=concat, prev=None, reduce={})
    if p.prev_reduction:
      if f % 2:
        raise ValueError(
          f'{name}: filters = {f} is odd but the previous '
          'output is halved by a factorized reduction, which '
          'needs an even number of filters.'
        )
      plan.prev = Block(
        'fr', 'prev_proj', p.prev_dim, f, (1, 1), (2, 2), 1, False, True, None
      )
    elif p.prev_dim != f:
      plan.prev = Block(
        'conv', 'prev_proj', p.prev_dim, f, (1, 1), (1, 1), 1, False, True, None
      )
    plan.cur = Block(
      'conv', 'cur_proj', p.cur_dim, f, (1, 1), (1, 1), 1, False, True, None
    )
    spec = p.cell_spec
    plan.ops = []
    for i, (op, j) in enumerate(zip(spec.operations, spec.hiddenstate_indices)):
      side = 'left' if i % 2 == 0 else 'right'
      stride = p.stride if j < 2 else 1
      amoebanet_ops.OpBlocks(op, f, f, stride, f'{name} op {i}')  # Validates.
      plan.ops.append((f'comb_iter_{i // 2}_{side}', op, stride))
    for j in concat:
      if factors[j] != factors[-1]:
        s = factors[-1] // factors[j]
        plan.reduce[j] = Block(
          'fr', f'reduction_{j}', f, f, (1, 1), (s, s), 1, False, False, None
        )
    return plan

  @classmethod
  def OutputDim(cls, p):
    """Channels of the cell output."""
    return p.filters * len(ValidateCellSpec(p.cell_spec, _shapes.LayerName(p)))

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    plan = self._Plan(p)
    self._concat = plan.concat
    self._reduce_idx = sorted(plan.reduce)
    self._has_prev_proj = plan.prev is not None
    if plan.prev is not None:
      self.CreateChild(
        'prev_proj', amoebanet_ops.BlockParams(plan.prev, p.bn_decay)
      )
    self.CreateChild(
      'cur_proj', amoebanet_ops.BlockParams(plan.cur, p.bn_decay)
    )
    self.CreateChildren(
      'ops',
      [
        amoebanet_ops.CellOp.Params().Set(
          name=n,
          op=op,
          input_dim=p.filters,
          output_dim=p.filters,
          stride=stride,
          bn_decay=p.bn_decay,
        )
        for n, op, stride in plan.ops
      ],
    )
    if plan.reduce:
      self.CreateChildren(
        'reduce',
        [
          amoebanet_ops.BlockParams(plan.reduce[j], p.bn_decay)
          for j in self._reduce_idx
        ],
      )
    self._seeds = [
      py_utils.StableHash(p.random_seed or 0, self.path, 'drop_path', i)
      for i in range(len(plan.ops))
    ]

  def _CheckInputs(self, state):
    p = self.params
    CheckState(self, state)
    cur = _shapes.CheckShape(
      self,
      'state.cur',
      state.cur.shape,
      [None, None, None, p.cur_dim],
      f'state.cur must have {p.cur_dim} channels (cur_dim).',
    )
    prev = _shapes.CheckShape(
      self,
      'state.prev',
      state.prev.shape,
      [None, None, None, p.prev_dim],
      f'state.prev must have {p.prev_dim} channels (prev_dim).',
    )
    if cur is None or prev is None:
      return
    _CheckResolutions(self, p, prev, cur)

  def FProp(self, theta, state):
    """Runs the cell. See the class docstring for shapes."""
    p = self.params
    self._CheckInputs(state)
    cur = self.cur_proj.FProp(theta.cur_proj, state.cur)
    prev = state.prev
    if self._has_prev_proj:
      prev = self.prev_proj.FProp(theta.prev_proj, prev)
    states = [cur, prev]
    keep = 1.0 if self.do_eval else p.drop_path_keep_prob
    idx = p.cell_spec.hiddenstate_indices
    for i in range(0, len(self.ops), 2):
      pair = []
      for k in (i, i + 1):
        h = self.ops[k].FProp(theta.ops[k], states[idx[k]])
        if p.cell_spec.operations[k] != 'none':
          h = DropPath(h, keep, self._seeds[k])
        pair.append(h)
      states.append(pair[0] + pair[1])
    outs = []
    for j in self._concat:
      h = states[j]
      if j in self._reduce_idx:
        r = self._reduce_idx.index(j)
        h = self.reduce[r].FProp(theta.reduce[r], h)
      outs.append(h)
    out = NestedMap(state)
    out.prev = state.cur
    out.cur = tf.concat(outs, axis=-1)
    return out

  @classmethod
  def FPropMeta(cls, p, state):
    CheckState(p, state)
    plan = cls._Plan(p)
    cur = _shapes.CheckShape(
      p,
      'state.cur',
      state.cur,
      [None, None, None, p.cur_dim],
      f'state.cur must have {p.cur_dim} channels (cur_dim).',
    )
    prev = _shapes.CheckShape(
      p,
      'state.prev',
      state.prev,
      [None, None, None, p.prev_dim],
      f'state.prev must have {p.prev_dim} channels (prev_dim).',
    )
    _CheckResolutions(p, p, prev, cur)
    flops, h0 = amoebanet_ops.BlockMeta(plan.cur, cur)
    h1 = prev
    if plan.prev is not None:
      f, h1 = amoebanet_ops.BlockMeta(plan.prev, prev)
      flops += f
    dims = [h0, h1]
    idx = p.cell_spec.hiddenstate_indices
    for i in range(0, len(plan.ops), 2):
      out = None
      for k in (i, i + 1):
        _, op, stride = plan.ops[k]
        out = dims[idx[k]]
        for block in amoebanet_ops.OpBlocks(op, p.filters, p.filters, stride):
          f, out = amoebanet_ops.BlockMeta(block, out)
          flops += f
      n = _shapes.NumElements(out)
      flops += n + (4 * n if p.drop_path_keep_prob < 1 else 0)
      dims.append(out)
    for j in plan.concat:
      if j in plan.reduce:
        flops += amoebanet_ops.BlockMeta(plan.reduce[j], dims[j])[0]
    out = NestedMap(state)
    out.prev = _shapes.ToShape(state.cur)
    out.cur = tf.TensorShape(dims[-1][:3] + [p.filters * len(plan.concat)])
    return meta.Meta(flops, out)


def _CheckResolutions(who, p, prev, cur):
  """Checks state.prev's resolution against state.cur's (dims lists)."""
  for a, b in zip(prev[1:3], cur[1:3]):
    if a is None or b is None:
      continue
    want = amoebanet_ops.ReducedSize(a, 2) if p.prev_reduction else a
    if want != b:
      raise ValueError(
        f'{_shapes.LayerName(who)}: state.prev is {prev} and state.cur is '
        f'{cur}, but prev_reduction = {p.prev_reduction} expects the '
        'previous output at '
        + ('twice' if p.prev_reduction else 'the same')
        + ' resolution; set '
        'prev_reduction to True right after a reduction cell, else False.'
      )
