"""AmoebaNet image classifiers as a flat sequence of pipeline layers.

AmoebaNet (Real et al., arXiv 1802.01548) is the image model of the GPipe
paper: AmoebaNet-D (L, D) for Table 1's giant models and AmoebaNet-B (18, 512)
(557M parameters, 480x480) for ImageNet and transfer learning. As in TF's
AmoebaNet (tensorflow/tpu models/official/amoeba_net), the network is

  stem conv 3x3/2 -> 2 stem reduction cells (D/4, D/2 filters)
  -> L/3 normal cells (D) -> reduction (2D) -> L/3 normal (2D)
  -> reduction (4D) -> L/3 normal (4D) -> ReLU, global avg pool, dropout

with L = `num_cells`, the total number of normal cells (TF's `num_cells`;
18 = 6 per stack for the paper's AmoebaNet-D (18, D)), and D =
`num_filters`. The reduction cells sit where TF puts them
(`ReductionIndices`). Cells are built from genotypes given as data
(`amoebanet_cells.GENOTYPES`, `CellSpec`).

`AmoebaNet.Params()...Instantiate().Layers()` returns the flat list of layer
Params for `PipeliningLayer.layers`; the state between layers is
NestedMap(prev, cur) (see `amoebanet_cells`). Every layer has an analytic
`FPropMeta`, so pipelines balance by flops and parameters are counted
without allocating weights:

  net = amoebanet.AmoebaNet.Params().Set(num_cells=18, num_filters=208,
                                         image_size=224).Instantiate()
  pipe = net.PipelineParams(num_stages=1)
  base_layer.CountParams(pipe)     # 78.0M (+ 3.3M softmax), no memory

`AmoebaNetTask` is a `ClassifierTask` that adds the auxiliary head's loss.
"""

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import convolutions
from lingvo_gpipe.models import amoebanet_cells
from lingvo_gpipe.models import amoebanet_heads
from lingvo_gpipe.models import amoebanet_ops
from lingvo_gpipe.models import classifier
from lingvo_gpipe.pipeline import pipelining_layer

__all__ = [
  'AmoebaNet',
  'AmoebaNetTask',
  'BenchmarkCells',
  'GENOTYPES',
  'GetGenotype',
  'ReductionIndices',
  'STEM_TYPES',
]

GENOTYPES = amoebanet_cells.GENOTYPES
GetGenotype = amoebanet_cells.GetGenotype
STEM_TYPES = ('imagenet', 'cifar')


def ReductionIndices(num_cells, num_reduction_layers):
  """Normal cells before which a reduction cell goes (TF's rule)."""
  return [
    int(float(i) / (num_reduction_layers + 1) * num_cells)
    for i in range(1, num_reduction_layers + 1)
  ]


class AmoebaNet:
  """Builds the flat layer list of an AmoebaNet. See the module docstring."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'amoebanet', 'Name used in error messages.')
    p.Define(
      'genotype',
      'amoeba_net_d',
      f'A genotype name ({", ".join(GENOTYPES)}) or a '
      'amoebanet_cells.Genotype(...) Params.',
    )
    p.Define(
      'num_cells',
      18,
      'L: the total number of normal cells (over the 3 stacks).',
    )
    p.Define(
      'num_filters',
      208,
      'D: filters of the first stack (x2 after each reduction); a '
      'multiple of 8.',
    )
    p.Define(
      'num_reduction_layers',
      2,
      'Reduction cells between the stacks of normal cells.',
    )
    p.Define('image_size', 224, 'Input height and width (int or pair).')
    p.Define('image_channels', 3, 'Input channels.')
    p.Define(
      'stem_type',
      'imagenet',
      'imagenet: conv 3x3/2 + num_stem_cells reduction cells; cifar: '
      'conv 3x3/1 only.',
    )
    p.Define('stem_filters', 32, 'Channels of the stem conv.')
    p.Define('num_stem_cells', 2, 'Reduction cells of the ImageNet stem.')
    p.Define(
      'drop_path_keep_prob',
      1.0,
      'Drop-path keep probability (TF: 0.7); 1: off.',
    )
    p.Define(
      'drop_path_scale_by_depth',
      False,
      'If True, cell n of N keeps paths with 1 - (n + 1) / N * (1 - '
      "drop_path_keep_prob) (TF's drop_connect_version v2).",
    )
    p.Define(
      'dense_dropout_keep_prob',
      1.0,
      'Keep probability of the dropout before the classifier (TF: 0.5).',
    )
    p.Define(
      'use_aux_head',
      False,
      "Adds TF's auxiliary classifier after the last normal cell of "
      'the second stack (needs num_classes).',
    )
    p.Define('aux_scaling', 0.4, 'Filter scaling of the auxiliary head.')
    p.Define(
      'num_classes',
      0,
      'Classes of the auxiliary head, and of the final FC when '
      'head_logits is True.',
    )
    p.Define(
      'head_logits',
      False,
      'True: the last layer returns logits [b, num_classes]; False: '
      'features [b, FeatureDim()] for a ClassifierTask softmax.',
    )
    p.Define('bn_decay', 0.9997, 'Decay of every batch norm moving average.')
    return p

  def __init__(self, params):
    self._params = params.Copy().Freeze()
    p = self._params
    self._genotype = (
      GetGenotype(p.genotype)
      if isinstance(p.genotype, str)
      else p.genotype.Copy()
    )
    self._Validate()
    self._layers, self._feature_dim = self._Build()

  @property
  def params(self):
    return self._params

  def _Error(self, what, fix):
    return ValueError(f'AmoebaNet {self.params.name!r}: {what}; {fix}')

  def _Validate(self):
    p = self.params
    for field in ('num_cells', 'num_filters', 'image_channels', 'stem_filters'):
      v = p.Get(field)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise self._Error(f'{field} = {v!r}', 'use a positive int.')
    if p.num_filters % 8:
      raise self._Error(
        f'num_filters = {p.num_filters} is not a multiple of 8',
        'the stem cells use D/4 filters and factorized reductions split '
        'them in halves: use e.g. 8, 16, 208, 512.',
      )
    if p.stem_type not in STEM_TYPES:
      raise self._Error(
        f'stem_type = {p.stem_type!r}', f'use one of {STEM_TYPES}.'
      )
    if p.num_reduction_layers < 0 or p.num_stem_cells < 0:
      raise self._Error(
        'num_reduction_layers and num_stem_cells must be >= 0',
        f'got {p.num_reduction_layers}, {p.num_stem_cells}.',
      )
    if p.use_aux_head and p.num_reduction_layers < 2:
      raise self._Error(
        'use_aux_head needs 2 reduction layers',
        'set num_reduction_layers = 2 or use_aux_head False.',
      )
    if (p.use_aux_head or p.head_logits) and p.num_classes <= 0:
      raise self._Error(
        f'num_classes = {p.num_classes}',
        'set num_classes > 0 for the auxiliary head and head_logits.',
      )
    for name in ('normal', 'reduction'):
      amoebanet_cells.ValidateCellSpec(
        self._genotype.Get(name), f'genotype {name} cell'
      )

  def ImageSize(self):
    """(height, width) of the input images."""
    s = self.params.image_size
    if isinstance(s, int):
      return s, s
    return int(s[0]), int(s[1])

  def InputShape(self, batch_size=None):
    """[batch, height, width, channels] of the network input."""
    h, w = self.ImageSize()
    return [batch_size, h, w, self.params.image_channels]

  def FeatureDim(self):
    """Channels of the head's output features."""
    return self._feature_dim

  def Layers(self):
    """Copies of the flat list of layer Params (stem, cells, head)."""
    return [lp.Copy() for lp in self._layers]

  def _Build(self):
    """Builds the layer list, tracking channels and resolutions."""
    p = self.params
    h, w = self.ImageSize()
    min_size = self.MinImageSize()
    if h < 3 or w < 3:
      raise self._Error(
        f'image_size = {p.image_size!r} is smaller than the 3x3 stem conv',
        f'use at least {min_size}x{min_size}.',
      )
    layers = []
    stride = 2 if p.stem_type == 'imagenet' else 1
    layers.append(
      amoebanet_heads.AmoebaStem.Params().Set(
        name='stem',
        input_dim=p.image_channels,
        filters=p.stem_filters,
        stride=stride,
        bn_decay=p.bn_decay,
      )
    )
    h = convolutions.ConvOutputSize(h, 3, stride, 1, 'VALID')
    w = convolutions.ConvOutputSize(w, 3, stride, 1, 'VALID')
    # (channels, height, width) of state.prev and state.cur.
    st = NestedMap(prev=(p.stem_filters, h, w), cur=(p.stem_filters, h, w))
    num_stem = p.num_stem_cells if p.stem_type == 'imagenet' else 0
    total = p.num_cells + p.num_reduction_layers + num_stem
    reductions = ReductionIndices(p.num_cells, p.num_reduction_layers)
    cell_num = [0]

    def AddCell(name, filters, reduction):
      spec = self._genotype.reduction if reduction else self._genotype.normal
      c, ch, cw = st.cur
      if reduction and (ch < 2 or cw < 2):
        raise self._Error(
          f'image_size = {p.image_size!r} leaves a {ch}x{cw} feature map at '
          f'{name}, which a reduction cell cannot halve',
          f'use an image_size of at least {min_size} (or fewer reduction/'
          'stem cells).',
        )
      keep = p.drop_path_keep_prob
      if p.drop_path_scale_by_depth:
        keep = 1.0 - (cell_num[0] + 1) / float(total) * (1.0 - keep)
      cp = amoebanet_cells.AmoebaCell.Params().Set(
        name=name,
        cell_spec=spec.Copy(),
        filters=filters,
        cur_dim=c,
        prev_dim=st.prev[0],
        prev_reduction=st.prev[1:] != st.cur[1:],
        stride=2 if reduction else 1,
        drop_path_keep_prob=keep,
        bn_decay=p.bn_decay,
      )
      out_dim = amoebanet_cells.AmoebaCell.OutputDim(cp)
      if reduction:
        ch, cw = (
          amoebanet_ops.ReducedSize(ch, 2),
          amoebanet_ops.ReducedSize(cw, 2),
        )
      st.prev, st.cur = st.cur, (out_dim, ch, cw)
      cell_num[0] += 1
      layers.append(cp)

    scaling = 1.0 / 2**num_stem
    for i in range(num_stem):
      AddCell(f'stem_cell_{i}', int(p.num_filters * scaling), True)
      scaling *= 2
    scaling = 1.0
    for n in range(p.num_cells):
      if n in reductions:
        scaling *= 2
        AddCell(
          f'reduction_cell_{reductions.index(n)}',
          int(p.num_filters * scaling),
          True,
        )
      AddCell(f'cell_{n}', int(p.num_filters * scaling), False)
      if p.use_aux_head and n == reductions[1] - 1:
        layers.append(
          amoebanet_heads.AmoebaAuxHead.Params().Set(
            name=f'aux_{n}',
            input_dim=st.cur[0],
            input_size=st.cur[1:],
            num_classes=p.num_classes,
            aux_scaling=p.aux_scaling,
            bn_decay=p.bn_decay,
          )
        )
        # Validates the aux head's input size now, naming the fix.
        amoebanet_heads.AmoebaAuxHead.Children(layers[-1])
    layers.append(
      amoebanet_heads.AmoebaHead.Params().Set(
        name='head',
        input_dim=st.cur[0],
        dropout_keep_prob=p.dense_dropout_keep_prob,
        num_classes=p.num_classes if p.head_logits else 0,
      )
    )
    return layers, st.cur[0]

  def MinImageSize(self):
    """The smallest square image every reduction cell can halve."""
    p = self.params
    num_red = p.num_reduction_layers + (
      p.num_stem_cells if p.stem_type == 'imagenet' else 0
    )
    size = 1  # Working backwards from the last reduction's output.
    for _ in range(num_red):
      size = max(2, 2 * size - 1)  # The smallest n with ceil(n / 2) >= size.
    if p.stem_type == 'imagenet':
      return 2 * size + 1  # The smallest n with (n - 3) // 2 + 1 >= size.
    return size + 2

  def PipelineParams(
    self,
    num_stages=1,
    num_micro_batches=1,
    devices=None,
    name='network',
    **kwargs,
  ):
    """PipeliningLayer Params of these layers, balanced by flops."""
    return pipelining_layer.PipeliningLayer.Params().Set(
      name=name,
      layers=self.Layers(),
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      devices=devices,
      balance_by='flops',
      input_shapes=[self.InputShape()],
      **kwargs,
    )


class AmoebaNetTask(classifier.ClassifierTask):
  """ClassifierTask whose network may also return auxiliary logits.

  The network returns features [b, dim], or NestedMap(features,
  aux_logits [b, num_classes]) when it has an AmoebaAuxHead. Then the loss
  is the main loss plus `aux_loss_weight` times the label-smoothed
  cross-entropy of the auxiliary logits (TF AmoebaNet: 0.4), and the metrics
  gain `aux_loss` and `main_loss`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('aux_loss_weight', 0.4, "Weight of the auxiliary head's loss.")
    return p

  def _NetworkOutput(self, out):
    """(features [b, dim], NestedMap(aux_logits) or an empty one)."""
    if isinstance(out, tuple) and len(out) == 1:
      out = out[0]
    others = NestedMap()
    if isinstance(out, dict):
      if 'features' not in out:
        raise ValueError(
          f'AmoebaNetTask {self.path!r}: the network returned keys '
          f'{sorted(out)}; it must return features [b, dim] or '
          'NestedMap(features, aux_logits). End it with an AmoebaHead '
          'without num_classes.'
        )
      if out.get('aux_logits') is not None:
        others.aux_logits = out['aux_logits']
      out = out['features']
    if out.shape.rank != 2:
      raise ValueError(
        f'AmoebaNetTask {self.path!r}: the network returned '
        f'{out.shape}; it must return features [batch, dim].'
      )
    return out, others

  def _LossTerms(self, xent, others, labels, weights, total):
    """The main loss and, with an auxiliary head, its label-smoothed
    cross-entropy weighted by aux_loss_weight."""
    terms = super()._LossTerms(xent, others, labels, weights, total)
    if 'aux_logits' in others:
      aux = classifier.Share(
        self._Xent(others.aux_logits, labels), weights, total
      )
      terms.append(('aux_loss', aux, self.params.aux_loss_weight))
    return terms


def BenchmarkCells(batch_size, filters=16, image_size=32):
  """A small AmoebaNet-D for benchmarks (tools/benchmark_pipeline.py
  --model=amoebanet): 2 normal cells per stack (num_cells 6), the CIFAR
  stem, 10-class logits from the last layer.

  Args:
    batch_size: examples per batch.
    filters: the number of filters (stem and cells).
    image_size: the side of the square RGB input images.

  Returns:
    (list of layer Params, input shape [batch, size, size, 3]).
  """
  filters, size = int(filters), int(image_size)
  net = (
    AmoebaNet.Params()
    .Set(
      num_cells=6,
      num_filters=filters,
      image_size=size,
      stem_type='cifar',
      stem_filters=filters,
      num_classes=10,
      head_logits=True,
    )
    .Instantiate()
  )
  return net.Layers(), net.InputShape(int(batch_size))
