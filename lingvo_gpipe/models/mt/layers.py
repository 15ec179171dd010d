"""Layers of the pipelined multilingual Transformer (GPipe paper, section 5).

The model is a FLAT sequence of layers, so that `PipeliningLayer.layers` can
cut it into cells anywhere (`TransformerMTLayers` builds the list):

  MTEmbeddingLayer           ids -> scaled embeddings + sinusoidal positions
  L x MTEncoderLayer         pre-LN self-attention + feed-forward on `src`
  MTStateLayerNorm('src')    the encoder's final layer norm
  L x MTDecoderLayer         causal self-attention, attention over `src`,
                             feed-forward on `tgt`
  MTSoftmaxLayer             final layer norm, softmax tied with the
                             embedding, label-smoothed cross-entropy

Every layer maps a NestedMap state to a NestedMap state, every tensor with the
batch first (so the pipeline can split it into micro-batches):

  pipeline input   src_ids int32 [b, s], src_paddings [b, s],
                   tgt_ids int32 [b, t], tgt_paddings [b, t],
                   tgt_labels int32 [b, t], tgt_weights [b, t]
  after embedding  src [b, s, d] and tgt [b, t, d] replace the ids; the
                   paddings, labels and weights ride along, so the encoder
                   output and the source paddings reach the decoder cells
  pipeline output  NestedMap(xent, nll, correct, num_tokens), each [b]: the
                   per-example sums over target positions (weighted by
                   tgt_weights) of the label-smoothed cross-entropy, the plain
                   negative log-likelihood, the correct argmaxes and the
                   weights; the task reduces them over the whole batch, so the
                   loss does not depend on the number of micro-batches.

The embedding table is ONE variable, shared by the source and the target
embedding and tied with the softmax weight through
`WeightParams(shared_name=...)`: the embedding sits in the first pipeline
cell and the softmax in the last, and the gradients of both uses add up.
Every layer has an analytic `FPropMeta`, so giant models are balanced and
counted without allocating a weight.
"""

import math

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import embedding
from lingvo_gpipe.layers import normalizations
from lingvo_gpipe.layers import softmax
from lingvo_gpipe.layers import transformer

__all__ = [
  'SinusoidalPositions',
  'MTEmbeddingLayer',
  'MTEncoderLayer',
  'MTDecoderLayer',
  'MTStateLayerNorm',
  'MTSoftmaxLayer',
  'TransformerMTLayers',
  'FFLayerInitScale',
  'DEPTH_SCALINGS',
  'SHARED_EMB_SOFTMAX',
  'INPUT_KEYS',
  'OUTPUT_KEYS',
]

SHARED_EMB_SOFTMAX = 'shared_emb_softmax'
INPUT_KEYS = (
  'src_ids',
  'src_paddings',
  'tgt_ids',
  'tgt_paddings',
  'tgt_labels',
  'tgt_weights',
)
OUTPUT_KEYS = ('xent', 'nll', 'correct', 'num_tokens')
DEPTH_SCALINGS = ('none', 'linear', 'sqrt')


def SinusoidalPositions(
  length, dim, min_timescale=1.0, max_timescale=1.0e4, dtype=tf.float32
):
  """Transformer position encodings (Lingvo's timing signal).

  Args:
    length: number of positions (int or scalar tensor).
    dim: encoding width (even).
    min_timescale: shortest wavelength / (2 pi).
    max_timescale: longest wavelength / (2 pi).
    dtype: output dtype.

  Returns:
    [length, dim]: sin of position / timescale_i in the first dim / 2
    channels, cos in the others, timescales geometric from min to max.
  """
  if dim % 2:
    raise ValueError(
      f'SinusoidalPositions: dim = {dim} must be even (half '
      'sines, half cosines); use an even model_dim.'
    )
  half = dim // 2
  log_increment = math.log(max_timescale / min_timescale) / max(half - 1, 1)
  inv_timescales = min_timescale * tf.exp(
    tf.range(half, dtype=tf.float32) * -log_increment
  )
  position = tf.cast(tf.range(length), tf.float32)
  scaled = position[:, tf.newaxis] * inv_timescales[tf.newaxis, :]
  return tf.cast(tf.concat([tf.sin(scaled), tf.cos(scaled)], axis=1), dtype)


def _StateShapes(who, state, keys):
  """{key: TensorShape} of a state of shapes; ValueError if keys are missing."""
  if not isinstance(state, dict):
    raise ValueError(
      f'{who}: the input must be a NestedMap state with keys '
      f'{list(keys)}; got {type(state).__name__}.'
    )
  missing = [k for k in keys if k not in state]
  if missing:
    raise ValueError(
      f'{who}: the input state has keys {sorted(state)} but '
      f'lacks {missing}. Put the layer after the ones that '
      'produce them (see TransformerMTLayers).'
    )
  return NestedMap({k: _shapes.ToShape(v) for k, v in state.items()})


def _CheckState(layer, state, keys):
  if not isinstance(state, dict):
    raise ValueError(
      f'{_shapes.LayerName(layer)}: FProp takes the NestedMap '
      f'state (keys {list(keys)}); got {type(state).__name__}.'
    )
  missing = [k for k in keys if k not in state]
  if missing:
    raise ValueError(
      f'{_shapes.LayerName(layer)}: the state has keys '
      f'{sorted(state)} but lacks {missing}.'
    )


class MTEmbeddingLayer(base_layer.BaseLayer):
  """Embeds source and target ids with one table, adds positions.

  x = dropout(table[ids] * sqrt(model_dim) + SinusoidalPositions), for the
  source ids and the target ids alike. The table is `emb.wm` [vocab_size,
  model_dim], created with `shared_name = p.shared_weight_name` so the
  softmax of `MTSoftmaxLayer` uses the same variable.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Size of the shared (source and target) vocab.')
    p.Define('model_dim', 0, 'Model dimension d.')
    p.Define(
      'shared_weight_name',
      SHARED_EMB_SOFTMAX,
      'Shared name of the table; the softmax with the same name is '
      'tied with it. None: not shared with the softmax.',
    )
    p.Define(
      'input_dropout_prob',
      0.0,
      'Dropout of the embeddings (after adding the positions).',
    )
    p.Define(
      'max_timescale',
      1.0e4,
      'Longest timescale of the sinusoidal position encodings.',
    )
    return p

  @classmethod
  def _Validate(cls, p):
    _shapes.CheckPositive(p, 'vocab_size', 'model_dim')
    if p.model_dim % 2:
      raise ValueError(
        f'{_shapes.LayerName(p)}: model_dim = {p.model_dim} '
        'must be even for the sinusoidal positions.'
      )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self.CreateChild(
      'emb',
      embedding.SimpleEmbeddingLayer.Params().Set(
        vocab_size=p.vocab_size,
        embedding_dim=p.model_dim,
        scale_sqrt_depth=True,
        shared_weight_name=p.shared_weight_name,
        params_init=py_utils.WeightInit.Gaussian(p.model_dim**-0.5),
      ),
    )
    self.CreateChild(
      'dropout',
      dropout.DropoutLayer.Params().Set(keep_prob=1.0 - p.input_dropout_prob),
    )

  def Embed(self, theta, ids):
    """ids int [b, t] -> [b, t, model_dim] (embedding + positions, dropout)."""
    p = self.params
    x = self.emb.EmbLookup(theta.emb, ids)
    x += SinusoidalPositions(
      tf.shape(ids)[1],
      p.model_dim,
      max_timescale=p.max_timescale,
      dtype=x.dtype,
    )
    return self.dropout.FProp(theta.dropout, x)

  def FProp(self, theta, state):
    """Replaces src_ids/tgt_ids [b, *] by src/tgt [b, *, model_dim]."""
    _CheckState(self, state, ('src_ids', 'tgt_ids'))
    out = NestedMap(
      {k: v for k, v in state.items() if k not in ('src_ids', 'tgt_ids')}
    )
    out.src = self.Embed(theta, state.src_ids)
    out.tgt = self.Embed(theta, state.tgt_ids)
    return out

  @classmethod
  def FPropMeta(cls, p, state):
    cls._Validate(p)
    shapes = _StateShapes(_shapes.LayerName(p), state, ('src_ids', 'tgt_ids'))
    out = NestedMap(
      {k: v for k, v in shapes.items() if k not in ('src_ids', 'tgt_ids')}
    )
    out.src = tf.TensorShape(shapes.src_ids.as_list() + [p.model_dim])
    out.tgt = tf.TensorShape(shapes.tgt_ids.as_list() + [p.model_dim])
    n = _shapes.NumElements(out.src.as_list()) + _shapes.NumElements(
      out.tgt.as_list()
    )
    return meta.Meta(2 * n, out)


class MTEncoderLayer(transformer.TransformerLayer):
  """A pre-LN Transformer encoder layer on `state.src` (src_paddings masked).

  The library `TransformerLayer` (self-attention over the non-padded source
  positions, then the feed-forward block), taking and returning the state.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.has_aux_atten = False
    p.mask_self_atten = False
    return p

  def __init__(self, params):
    if params.has_aux_atten or params.mask_self_atten:
      raise ValueError(
        f'MTEncoderLayer {params.name!r}: has_aux_atten = '
        f'{params.has_aux_atten} and mask_self_atten = '
        f'{params.mask_self_atten}; an encoder layer has neither (use '
        'MTDecoderLayer for the decoder).'
      )
    super().__init__(params)

  def FProp(self, theta, state):
    """state.src [b, s, d] -> the same, other keys passed through."""
    _CheckState(self, state, ('src', 'src_paddings'))
    out = state.copy()
    out.src = super().FProp(theta, state.src, state.src_paddings)
    return out

  @classmethod
  def FPropMeta(cls, p, state):
    shapes = _StateShapes(_shapes.LayerName(p), state, ('src', 'src_paddings'))
    m = super().FPropMeta(p, shapes.src)
    return meta.Meta(m.flops, shapes)


class MTDecoderLayer(transformer.TransformerLayer):
  """A pre-LN Transformer decoder layer on `state.tgt`.

  Causal self-attention over the target, attention over the encoder output
  `state.src` (masked by `state.src_paddings`), then the feed-forward block.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.has_aux_atten = True
    p.mask_self_atten = True
    return p

  def __init__(self, params):
    if not (params.has_aux_atten and params.mask_self_atten):
      raise ValueError(
        f'MTDecoderLayer {params.name!r}: has_aux_atten = '
        f'{params.has_aux_atten} and mask_self_atten = '
        f'{params.mask_self_atten}; a decoder layer needs both True.'
      )
    super().__init__(params)

  def FProp(self, theta, state):
    """state.tgt [b, t, d] -> the same, attending to state.src [b, s, d]."""
    _CheckState(self, state, ('src', 'src_paddings', 'tgt'))
    out = state.copy()
    tgt_paddings = state.get('tgt_paddings')
    out.tgt = super().FProp(
      theta, state.tgt, tgt_paddings, state.src, state.src_paddings
    )
    return out

  @classmethod
  def FPropMeta(cls, p, state):
    shapes = _StateShapes(
      _shapes.LayerName(p), state, ('src', 'src_paddings', 'tgt')
    )
    m = super().FPropMeta(p, shapes.tgt, None, shapes.src)
    return meta.Meta(m.flops, shapes)


class MTStateLayerNorm(normalizations.LayerNorm):
  """Layer norm of one entry of the state (the encoder's final layer norm)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('state_key', 'src', 'Which entry of the state to normalize.')
    return p

  def Normalize(self, theta, x):
    """Layer norm of a tensor [..., input_dim]."""
    return super().FProp(theta, x)

  def FProp(self, theta, state):
    key = self.params.state_key
    _CheckState(self, state, (key,))
    out = state.copy()
    out[key] = self.Normalize(theta, state[key])
    return out

  @classmethod
  def FPropMeta(cls, p, state):
    shapes = _StateShapes(_shapes.LayerName(p), state, (p.state_key,))
    m = super().FPropMeta(p, shapes[p.state_key])
    return meta.Meta(m.flops, shapes)


class MTSoftmaxLayer(base_layer.BaseLayer):
  """Final layer norm, tied softmax and the per-example loss sums.

  Children: `final_ln` (LayerNorm) and `softmax` (SimpleFullSoftmax with the
  [vocab_size, model_dim] layout and `shared_weight_name`, i.e. the very
  variable of the embedding; plus its own bias). `logits_abs_max` clips the
  logits (the GPipe paper's fix for deep models).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of classes (the shared vocabulary).')
    p.Define('model_dim', 0, 'Model dimension d.')
    p.Define(
      'shared_weight_name',
      SHARED_EMB_SOFTMAX,
      "Shared name of the softmax weight (= the embedding's to tie "
      'them); None: an untied softmax weight.',
    )
    p.Define(
      'label_smoothing', 0.1, 'Label smoothing of the training loss (xent).'
    )
    p.Define(
      'logits_abs_max',
      None,
      'If set, logits are clipped to [-logits_abs_max, '
      'logits_abs_max] (stabilizes deep models).',
    )
    return p

  @classmethod
  def _Validate(cls, p):
    _shapes.CheckPositive(p, 'vocab_size', 'model_dim')
    if p.logits_abs_max is not None and not p.logits_abs_max > 0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: logits_abs_max = '
        f'{p.logits_abs_max!r}; use None (no clipping) or a '
        'positive number such as 20.'
      )

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self._Validate(p)
    self.CreateChild(
      'final_ln', normalizations.LayerNorm.Params().Set(input_dim=p.model_dim)
    )
    self.CreateChild(
      'softmax',
      softmax.SimpleFullSoftmax.Params().Set(
        input_dim=p.model_dim,
        num_classes=p.vocab_size,
        use_num_classes_major_weight=True,
        shared_weight_name=p.shared_weight_name,
        logits_abs_max=p.logits_abs_max,
        label_smoothing=p.label_smoothing,
        params_init=py_utils.WeightInit.Gaussian(p.model_dim**-0.5),
      ),
    )

  def Logits(self, theta, tgt):
    """Decoder output [b, t, d] -> logits [b, t, vocab_size]."""
    h = self.final_ln.FProp(theta.final_ln, tgt)
    return self.softmax.Logits(theta.softmax, h)

  def FProp(self, theta, state):
    """Per-example loss sums [b] (see the module docstring)."""
    p = self.params
    _CheckState(self, state, ('tgt', 'tgt_labels', 'tgt_weights'))
    logits = tf.cast(self.Logits(theta, state.tgt), tf.float32)
    labels = tf.cast(state.tgt_labels, tf.int32)
    weights = tf.cast(state.tgt_weights, tf.float32)
    xent = softmax.SoftmaxCrossEntropyWithLabelSmoothing(
      logits, class_ids=labels, label_smoothing=p.label_smoothing
    )
    nll = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits
    )
    correct = tf.cast(
      tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32
    )
    return NestedMap(
      xent=tf.reduce_sum(xent * weights, axis=1),
      nll=tf.reduce_sum(nll * weights, axis=1),
      correct=tf.reduce_sum(correct * weights, axis=1),
      num_tokens=tf.reduce_sum(weights, axis=1),
    )

  @classmethod
  def FPropMeta(cls, p, state):
    cls._Validate(p)
    shapes = _StateShapes(
      _shapes.LayerName(p), state, ('tgt', 'tgt_labels', 'tgt_weights')
    )
    tgt = shapes.tgt.as_list()
    rows = _shapes.NumElements(tgt[:-1])
    flops = (
      2 * rows * p.model_dim * p.vocab_size  # logits
      + 12 * rows * p.vocab_size  # softmax, losses
      + 8 * rows * p.model_dim
    )  # layer norm
    batch = tf.TensorShape(tgt[:1])
    return meta.Meta(flops, NestedMap({k: batch for k in OUTPUT_KEYS}))


def FFLayerInitScale(base_scale, depth_scaling, num_layers):
  """The feed-forward init scale of a stack of `num_layers` layers.

  Args:
    base_scale: the scale of a shallow model (1.0: plain Xavier).
    depth_scaling: 'none' (base_scale), 'linear' (base_scale / num_layers, the
      GPipe paper's "scaled down by the number of layers") or 'sqrt'
      (base_scale / sqrt(num_layers)).
    num_layers: encoder + decoder layers.

  Returns:
    The Xavier scale of every feed-forward weight.
  """
  if depth_scaling not in DEPTH_SCALINGS:
    raise ValueError(
      f'fflayer_init_depth_scaling = {depth_scaling!r}; use '
      f'one of {DEPTH_SCALINGS}.'
    )
  if depth_scaling == 'linear':
    return base_scale / num_layers
  if depth_scaling == 'sqrt':
    return base_scale / math.sqrt(num_layers)
  return base_scale


def TransformerMTLayers(
  num_encoder_layers,
  num_decoder_layers,
  model_dim,
  hidden_dim,
  num_heads,
  vocab_size,
  input_dropout_prob=0.0,
  residual_dropout_prob=0.0,
  atten_dropout_prob=0.0,
  relu_dropout_prob=0.0,
  label_smoothing=0.1,
  logits_abs_max=None,
  fflayer_init_scale=1.0,
  fflayer_init_depth_scaling='none',
  tie_softmax=True,
):
  """The flat list of layer Params of the model, for PipeliningLayer.layers.

  Args:
    num_encoder_layers: L encoder layers.
    num_decoder_layers: L decoder layers.
    model_dim: model dimension d (1024 in the paper).
    hidden_dim: feed-forward width H.
    num_heads: attention heads A (must divide model_dim).
    vocab_size: the shared vocabulary (64k in the paper).
    input_dropout_prob: dropout of the embeddings.
    residual_dropout_prob: dropout before each residual add.
    atten_dropout_prob: dropout of the attention probabilities.
    relu_dropout_prob: dropout of the feed-forward hidden layer.
    label_smoothing: of the training loss.
    logits_abs_max: logit clipping (None: off).
    fflayer_init_scale: base Xavier scale of the feed-forward weights.
    fflayer_init_depth_scaling: 'none' | 'linear' | 'sqrt': divides the scale
      by (the square root of) the number of layers (`FFLayerInitScale`).
    tie_softmax: share one table among the source embedding, the target
      embedding and the softmax (False: the softmax has its own weight).

  Returns:
    [emb, enc_0 .. enc_{L-1}, enc_ln, dec_0 .. dec_{L-1}, softmax] Params.
  """
  for name, value in (
    ('num_encoder_layers', num_encoder_layers),
    ('num_decoder_layers', num_decoder_layers),
  ):
    if not isinstance(value, int) or value < 1:
      raise ValueError(
        f'TransformerMTLayers: {name} = {value!r}; use a positive int.'
      )
  if model_dim % num_heads:
    raise ValueError(
      f'TransformerMTLayers: num_heads = {num_heads} does not '
      f'divide model_dim = {model_dim}; pick a divisor.'
    )
  ff_scale = FFLayerInitScale(
    fflayer_init_scale,
    fflayer_init_depth_scaling,
    num_encoder_layers + num_decoder_layers,
  )
  shared = SHARED_EMB_SOFTMAX if tie_softmax else None
  common = dict(
    source_dim=model_dim,
    hidden_dim=hidden_dim,
    num_attention_heads=num_heads,
    residual_dropout_prob=residual_dropout_prob,
    atten_dropout_prob=atten_dropout_prob,
    relu_dropout_prob=relu_dropout_prob,
    fflayer_init_scale=ff_scale,
  )
  layers = [
    MTEmbeddingLayer.Params().Set(
      name='emb',
      vocab_size=vocab_size,
      model_dim=model_dim,
      shared_weight_name=shared,
      input_dropout_prob=input_dropout_prob,
    )
  ]
  layers += [
    MTEncoderLayer.Params().Set(name=f'enc_{i}', **common)
    for i in range(num_encoder_layers)
  ]
  layers.append(
    MTStateLayerNorm.Params().Set(
      name='enc_ln', input_dim=model_dim, state_key='src'
    )
  )
  layers += [
    MTDecoderLayer.Params().Set(name=f'dec_{i}', **common)
    for i in range(num_decoder_layers)
  ]
  layers.append(
    MTSoftmaxLayer.Params().Set(
      name='softmax',
      vocab_size=vocab_size,
      model_dim=model_dim,
      shared_weight_name=shared,
      label_smoothing=label_smoothing,
      logits_abs_max=logits_abs_max,
    )
  )
  return layers
