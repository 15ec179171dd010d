"""Lingvo's batch-major GPipe Transformer: `GPipeBatchMajorTransformerStack`.

The stack Lingvo's GPipe language model uses: embeddings, encoder and
decoder layers (`batch_major_attention.GPipeBatchMajorTransformerLayer`)
and a softmax, split into `FeatureExtractionLayer` cells `cell_<k>` at
`splits`, on [batch, time] ids (batch_dim 0). Every layer passes the 7-tuple

  (source_vecs, source_paddings, target_vecs, target_paddings,
   encoder_self_atten_segment_mask, decoder_self_atten_segment_mask,
   decoder_cross_atten_segment_mask)

(the masks are None: packed inputs are refused at build). The last encoder
and decoder layers normalize their outputs, as in Lingvo.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.gpipe_layers import layers_with_gpipe
from lingvo_gpipe.layers import batch_major_attention
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import embedding
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.layers import softmax as softmax_lib
from lingvo_gpipe.pipeline import pipelining_layer

__all__ = [
  'GPipeBatchMajorTransformerEmbeddingLayer',
  'GPipeBatchMajorTransformerSoftmaxLayer',
  'GPipeBatchMajorTransformerStack',
]

_PACKED = (
  True,
  'set packed_input=False and give one sequence per row (Lingvo defaults '
  'to True; packed inputs are not supported here).',
)


def _RejectPacked(p):
  if p.packed_input:
    raise ValueError(
      f'{p.cls.__name__} {p.name!r}: packed_input=True is not supported; '
      + _PACKED[1]
    )


class GPipeBatchMajorTransformerEmbeddingLayer(base_layer.BaseLayer):
  """Token embedding (scaled by sqrt(dim)) + positions + dropout."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'token_emb',
      embedding.SimpleEmbeddingLayer.Params().Set(scale_sqrt_depth=True),
      'Token embedding Params.',
    )
    p.Define(
      'position_emb',
      embedding.PositionalEmbeddingLayer.Params(),
      'Position embedding Params.',
    )
    p.Define('input_dropout_prob', 0.0, 'Dropout of the embeddings.')
    p.Define('dropout_tpl', dropout.DropoutLayer.Params(), 'Dropout Params.')
    p.Define('add_tgt_embedding_layer', True, 'Also embed the target.')
    p.Define('packed_input', True, 'Only False (one sequence per row).')
    p.Define('max_seq_len', 300, 'Longest sequence of step-by-step decoding.')
    p.Define('target_vocab_size', 0, 'Target vocabulary; 0: the same.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _RejectPacked(p)
    keep = 1.0 - p.input_dropout_prob
    for prefix in ('src', 'tgt') if p.add_tgt_embedding_layer else ('src',):
      tok = p.token_emb.Copy().Set(name=f'{prefix}_token_emb')
      if prefix == 'tgt' and p.target_vocab_size:
        tok.vocab_size = p.target_vocab_size
      self.CreateChild(f'{prefix}_token_emb', tok)
      self.CreateChild(
        f'{prefix}_pos_emb',
        p.position_emb.Copy().Set(name=f'{prefix}_position_emb'),
      )
      self.CreateChild(
        f'{prefix}_dropout',
        p.dropout_tpl.Copy().Set(name=f'{prefix}_dropout', keep_prob=keep),
      )

  def _Embed(self, theta, prefix, ids):
    x = self.children[f'{prefix}_token_emb'].EmbLookup(
      theta[f'{prefix}_token_emb'], ids
    )
    pos = self.children[f'{prefix}_pos_emb'].FProp(
      theta[f'{prefix}_pos_emb'], tf.shape(ids)[1]
    )
    x += tf.expand_dims(pos, 0)
    return self.children[f'{prefix}_dropout'].FProp(
      theta[f'{prefix}_dropout'], x
    )

  def GetEncoderEmbeddingsDefaultTheta(self, input_ids):
    return self._Embed(self.theta, 'src', input_ids)

  def FProp(
    self,
    theta,
    source_id,
    source_paddings,
    target_id,
    target_paddings,
    encoder_self_atten_segment_mask,
    decoder_self_atten_segment_mask,
    decoder_cross_atten_segment_mask,
    source_segment_pos,
    target_segment_pos,
  ):
    """Ids [b, t] in; the stack's 7-tuple out."""
    source_vecs = self._Embed(theta, 'src', source_id)
    target_vecs = None
    if self.params.add_tgt_embedding_layer:
      target_vecs = self._Embed(theta, 'tgt', target_id)
    return (
      source_vecs,
      source_paddings,
      target_vecs,
      target_paddings,
      encoder_self_atten_segment_mask,
      decoder_self_atten_segment_mask,
      decoder_cross_atten_segment_mask,
    )

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    b, t = tf.TensorShape(meta.ToShape(inputs)).as_list()
    dim = p.token_emb.embedding_dim
    args = [None if a is None else meta.ToShape(a) for a in args]
    while len(args) < 8:
      args.append(None)
    if p.add_tgt_embedding_layer and args[1] is not None:
      args[1] = tf.TensorShape(args[1].as_list()[:2] + [dim])
    out = [tf.TensorShape([b, t, dim])] + args[:6]
    return meta.Meta(2 * (b or 1) * (t or 1) * dim, *out)


class GPipeBatchMajorTransformerSoftmaxLayer(softmax_lib.SimpleFullSoftmax):
  """The logits [b, t, num_classes] of the decoder's (or encoder's) output."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'inputs_from_decoder', False, 'Take target_vecs, else source_vecs.'
    )
    return p

  def FProp(
    self,
    theta,
    source_vecs,
    source_paddings,
    target_vecs,
    target_paddings,
    encoder_self_atten_segment_mask,
    decoder_self_atten_segment_mask,
    decoder_cross_atten_segment_mask,
  ):
    p = self.params
    x = target_vecs if p.inputs_from_decoder else source_vecs
    b, t = py_utils.GetShape(x, 2)
    logits = self.Logits(theta, tf.reshape(x, [-1, p.input_dim]))
    return tf.reshape(logits, [b, t, p.num_classes])

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    x = tf.TensorShape(args[1] if p.inputs_from_decoder else inputs)
    b, t = x.as_list()[:2]
    flops = 2 * (b or 1) * (t or 1) * p.input_dim * p.num_classes
    return meta.Meta(flops, tf.TensorShape([b, t, p.num_classes]))


class GPipeBatchMajorTransformerStack(pipelining_layer.PipeliningLayer):
  """Lingvo's batch-major pipelined Transformer (its GPipe LM's stack)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.splits = 1
    p.Define('model_dim', 1024, 'Model dimension.')
    p.Define('num_encoder_layers', 0, 'Number of encoder layers.')
    p.Define('num_decoder_layers', 0, 'Number of decoder layers.')
    p.Define(
      'emb_tpl',
      GPipeBatchMajorTransformerEmbeddingLayer.Params(),
      'Embedding layer Params (the first layer of cell 0).',
    )
    p.Define(
      'softmax_tpl',
      GPipeBatchMajorTransformerSoftmaxLayer.Params(),
      'Softmax Params (the last layer of the last cell).',
    )
    p.Define('label_smoothing', None, 'Label smoother Params, or None.')
    gp = batch_major_attention.GPipeBatchMajorTransformerLayer.Params()
    p.Define('encoder_tpl', gp.Copy(), 'Encoder layer Params.')
    p.Define('decoder_tpl', gp.Copy(), 'Decoder layer Params.')
    p.Define('packed_input', True, 'Only False (one sequence per row).')
    p.encoder_tpl.has_aux_atten = False
    p.decoder_tpl.has_aux_atten = True
    p.decoder_tpl.mask_self_atten = True
    p.batch_dim = 0
    return p

  @classmethod
  def PlannerLayers(cls, p):
    """The stack's layers in order, as the planner splits them: the
    embedding, the encoder and decoder layers, the softmax."""
    return [sub for cell in cls.CellParams(p) for sub in cell.sub]

  @classmethod
  def PlannerInputs(cls, p, batch_size, seq_len):
    """What the stack's first layer takes, as the planner profiles it: the
    LM's ids and paddings [batch, time], four absent inputs (no source, no
    segment ids), and the labels and their weights."""
    if p.num_decoder_layers:
      raise ValueError(
        f'{p.name}: the planner takes the language-model form of this stack '
        '(encoder layers only); this one has '
        f'num_decoder_layers={p.num_decoder_layers}.'
      )
    ids = tf.TensorSpec([batch_size, seq_len], tf.int32)
    pads = tf.TensorSpec([batch_size, seq_len], tf.float32)
    return [ids, pads, None, None, None, None, ids, pads]

  @classmethod
  def PlannerSplits(cls, p, ends):
    """The stack's `splits` for cells that end after layers `ends` of
    `PlannerLayers` (the embedding counts as layer 0 of cell 0, the softmax
    always closes the last cell)."""
    n = p.num_encoder_layers + p.num_decoder_layers
    return [int(e) - 1 for e in ends[:-1]] + [n]

  @classmethod
  def CellParams(cls, p):
    _RejectPacked(p)
    splits = layers_with_gpipe.GPipeTransformerStack._EndIndices(p)  # pylint: disable=protected-access
    deterministic = len(splits) > 1 or p.num_micro_batches != 1
    emb = p.emb_tpl.Copy()
    if deterministic:
      emb.dropout_tpl = dropout.DeterministicDropoutLayer.Params()
    emb.Set(
      name='emb',
      packed_input=p.packed_input,
      add_tgt_embedding_layer=p.num_decoder_layers > 0,
    )
    layers = [emb]
    for kind, tpl, n in (
      ('encoder', p.encoder_tpl, p.num_encoder_layers),
      ('decoder', p.decoder_tpl, p.num_decoder_layers),
    ):
      for i in range(n):
        lp = tpl.Copy().Set(
          name=f'{kind}_{i}',
          output_layer_norm=i == n - 1,
          packed_input=p.packed_input,
        )
        if kind == 'decoder':
          lp.mask_self_atten = True
        if deterministic:
          lp = lp.cls.SetupDeterministicDropout(lp)
        layers.append(lp)
    cells, start = [], 0
    for k, end in enumerate(splits):
      sub = layers[start : end + 1]
      if k == len(splits) - 1 and p.softmax_tpl:
        sub.append(
          p.softmax_tpl.Copy().Set(
            name='softmax', inputs_from_decoder=p.num_decoder_layers > 0
          )
        )
      cells.append(
        sequential.FeatureExtractionLayer.Params().Set(
          name=f'cell_{k}', sub=sub
        )
      )
      start = end + 1
    return cells

  def __init__(self, params):
    p = params.Copy()
    p.cell_tpl = self.CellParams(p)
    p.state_dtype = p.fprop_dtype or p.dtype
    super().__init__(p)
    if p.label_smoothing is not None:
      self.CreateChild(
        'smoother', p.label_smoothing.Copy().Set(name='smoother')
      )

  def Logits(self, theta, inputs):
    name = self.params.cell_tpl[-1].name
    return self.cells[-1].softmax.Logits(theta[name].softmax, inputs)

  def EncoderEmbedFPropDefaultTheta(self, source_id):
    return self.cells[0].emb.GetEncoderEmbeddingsDefaultTheta(source_id)

  def FProp(
    self,
    theta,
    source_input,
    source_paddings,
    target_input=None,
    target_paddings=None,
    source_segment_id=None,
    target_segment_id=None,
    labels=None,
    label_weights=None,
    source_segment_pos=None,
    target_segment_pos=None,
  ):
    """Ids and paddings [b, t]. Returns (per-token cross-entropy [b, t],
    logits [b, t, C]) of `labels`."""
    p = self.params
    if p.num_decoder_layers > 0 and (
      target_input is None or target_paddings is None
    ):
      raise ValueError(
        f'GPipeBatchMajorTransformerStack {self.path!r} has decoder layers: '
        'pass target_input and target_paddings.'
      )
    logits = super().FProp(
      theta,
      source_input,
      source_paddings,
      target_input,
      target_paddings,
      None,
      None,
      None,
      source_segment_pos,
      target_segment_pos,
    )
    num_classes = p.softmax_tpl.num_classes
    probs = None
    if p.label_smoothing is not None:
      probs = self.smoother.FProp(theta.smoother, target_paddings, labels)
      probs = tf.reshape(probs, [-1, num_classes])
    name = p.cell_tpl[-1].name
    xent = (
      self.cells[-1]
      .softmax.XentLossFromLogits(
        theta[name].softmax,
        tf.reshape(logits, [-1, num_classes]),
        class_weights=tf.reshape(label_weights, [-1]),
        class_ids=None if probs is not None else tf.reshape(labels, [-1]),
        class_probabilities=probs,
      )
      .per_example_xent
    )
    return tf.reshape(xent, tf.shape(logits)[:2]), logits
