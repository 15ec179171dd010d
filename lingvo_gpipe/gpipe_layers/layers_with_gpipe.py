"""Lingvo's GPipe Transformer: `GPipeTransformerStack` and its layers.

Every layer of the stack takes and returns the same 8-tuple, so any split of
the layers into cells is a valid pipeline (time-major, batch_dim=1):

  (source_vecs [t, b, d], source_paddings [t, b], target_vecs, target_paddings,
   source_segment_id, target_segment_id, transparent_acc,
   transparent_acc_helper)

The embedding layer turns ids into vectors (token embedding + sinusoidal
positions + dropout), the encoder layers transform the source, the decoder
layers the target (attending to the encoder output), and the softmax layer
of the last cell returns the logits; the stack then computes the
per-token cross-entropy. Cells are `FeatureExtractionLayer`s named
`cell_<k>`, with the embedding (`emb`) in cell 0 and the softmax (`softmax`)
in the last one, as in Lingvo: `theta.cell_0.encoder_0...`.

With more than one split or micro-batch, Lingvo switches every dropout to
its deterministic form so that recomputed cells draw the same masks; here
every dropout is deterministic (stateless seeds), and the stack switches the
Params the same way so that its Params read as Lingvo's.
"""

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import meta
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import _shapes
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import embedding
from lingvo_gpipe.layers import layers_with_attention
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.layers import softmax as softmax_lib
from lingvo_gpipe.pipeline import pipelining_layer

__all__ = [
  'DeterministicWeightsLayer',
  'GPipeTransformerEmbeddingLayer',
  'GPipeTransformerLayer',
  'GPipeTransformerSoftmaxLayer',
  'GPipeTransformerStack',
  'StackLayer',
]


def _Shape(x):
  return None if x is None else tf.TensorShape(x)


class DeterministicWeightsLayer(base_layer.BaseLayer):
  """Learned mixing weights [num_sources] (the transparent encoder's):
  softmax(sum_weight * global_weight_scale + 1 / n), after dropout."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_sources', 0, 'Number of sources mixed.')
    p.Define('weighted_merger_dropout_prob', 0.0, 'Dropout of the weights.')
    p.Define('weighted_merger_softmax', True, 'Softmax-normalize the weights.')
    p.Define('global_weight_scale', 1.0, 'Scale of the learned weights.')
    p.Define('minimal_prob', 0.0, 'Least weight of each source.')
    p.Define(
      'dropout_tpl',
      dropout.DeterministicDropoutLayer.Params(),
      'Dropout of the weights.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _shapes.CheckPositive(p, 'num_sources')
    if not 0.0 <= p.minimal_prob * p.num_sources < 1.0:
      raise ValueError(
        f'{_shapes.LayerName(p)}: minimal_prob * num_sources = '
        f'{p.minimal_prob * p.num_sources} must be in [0, 1).'
      )
    self.CreateChild(
      'weighted_merger_dropout', p.dropout_tpl.Copy().Set(name='dropout')
    )
    self.CreateVariable(
      'sum_weight',
      py_utils.WeightParams([p.num_sources], py_utils.WeightInit.Constant(0.0)),
    )

  def FProp(self, theta):
    """The weights [num_sources]."""
    p = self.params
    w = theta.sum_weight * p.global_weight_scale + 1.0 / p.num_sources
    w = self.weighted_merger_dropout.FProp(theta.weighted_merger_dropout, w)
    if p.weighted_merger_softmax:
      rest = p.minimal_prob * p.num_sources
      w = tf.nn.softmax(w, axis=0) * (1.0 - rest) + p.minimal_prob
    return w

  @classmethod
  def FPropMeta(cls, p):
    return meta.Meta(4 * p.num_sources, tf.TensorShape([p.num_sources]))


def _Unsupported(p, names):
  base_layer.RejectUnsupportedParams(p, names)


def _IsDecoder(p):
  return p.has_aux_atten or getattr(p, 'is_decoder', False)


class StackLayer:
  """Makes a Lingvo encoder/decoder layer a layer of the stack (the first
  base; the second is the Lingvo layer, whose FProp(theta, vecs, paddings,
  aux_vecs=, aux_paddings=) returns (out, probs)).

  It adds the Params every layer of the stack has (Lingvo's
  `_common_gpipe_transformer_params`), the output layer norm and the
  transparent mixing weights, and takes and returns the stack's 8-tuple.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'is_transparent',
      False,
      'Encoder: mix the inputs of all encoder layers into the output with '
      'learned weights (Bapna et al. 2018).',
    )
    p.Define(
      'transparent_merger_tpl',
      None,
      'The first encoder layer: Params of the mixing weights.',
    )
    p.Define('final_enc_layer', False, 'The last encoder layer.')
    p.Define('normalize_output', False, 'Layer-normalize the output.')
    p.Define(
      'ln_tpl',
      layers_with_attention.TransformerAttentionLayer.Params().ln_tpl,
      'Params of the output layer norm.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.normalize_output:
      self.CreateChild(
        'layer_norm',
        p.ln_tpl.Copy().Set(name='encoder_ln', input_dim=p.source_dim),
      )
    if p.is_transparent and p.transparent_merger_tpl is not None:
      self.CreateChild(
        'transparent_merger',
        p.transparent_merger_tpl.Copy().Set(name='transparent_0'),
      )

  def FProp(
    self,
    theta,
    source_vecs,
    source_paddings,
    target_vecs,
    target_paddings,
    source_segment_id,
    target_segment_id,
    transparent_acc,
    transparent_acc_helper,
    source_task_id=None,
    target_task_id=None,
  ):
    """The stack's 8-tuple in and out (task ids: only None), with the
    source (encoder) or the target (decoder) replaced."""
    p = self.params
    if source_task_id is not None or target_task_id is not None:
      raise ValueError(
        f'{self.path}: task ids are not supported; pass None (one task).'
      )
    acc, helper = transparent_acc, transparent_acc_helper
    if _IsDecoder(p):
      h, _ = super().FProp(
        theta,
        target_vecs,
        target_paddings,
        aux_vecs=source_vecs,
        aux_paddings=source_paddings,
      )
      target_vecs = tf.ensure_shape(h, target_vecs.shape)
    else:
      h, _ = super().FProp(theta, source_vecs, source_paddings)
      h = tf.ensure_shape(h, source_vecs.shape)
      if p.is_transparent:
        if p.transparent_merger_tpl is not None:
          helper = self.transparent_merger.FProp(theta.transparent_merger)
          acc = tf.zeros_like(source_vecs)
        acc += helper[0] * source_vecs
        if p.final_enc_layer:
          h = acc + h * helper[-1]
          acc, helper = None, None
        else:
          helper = helper[1:]
      if p.normalize_output:
        h = self.layer_norm.FProp(theta.layer_norm, h)
      source_vecs = h
    return (
      source_vecs,
      source_paddings,
      target_vecs,
      target_paddings,
      source_segment_id,
      target_segment_id,
      acc,
      helper,
    )

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    """Lingvo's flops estimate (5 t^2 b d) and the 8-tuple's shapes."""
    inputs = tf.TensorShape(inputs)
    t, b, d = inputs.as_list()
    flops = 5 * (t or 1) * (t or 1) * (b or 1) * (d or 1)
    args = [_Shape(a) for a in args]
    while len(args) < 7:
      args.append(None)
    if not _IsDecoder(p) and p.is_transparent:
      if p.transparent_merger_tpl is not None:
        args[5] = inputs
        args[6] = tf.TensorShape([p.transparent_merger_tpl.num_sources])
      args[6] = tf.TensorShape([args[6][0] - 1])
      if p.final_enc_layer:
        args[5], args[6] = None, None
    return meta.Meta(flops, inputs, *args)


class GPipeTransformerLayer(StackLayer, layers_with_attention.TransformerLayer):
  """A Transformer encoder or decoder layer (has_aux_atten) of the stack."""

  @classmethod
  def SetupDeterministicDropout(cls, params):
    """Lingvo's switch of every dropout to DeterministicDropoutLayer."""
    det = dropout.DeterministicDropoutLayer.Params()
    for tpl in (params.tr_atten_tpl, params.tr_fflayer_tpl):
      tpl.residual_dropout_tpl = det.Copy()
    params.tr_atten_tpl.atten_tpl.atten_dropout_deterministic = True
    params.tr_atten_tpl.atten_tpl.inner_atten_params.Set(
      atten_dropout_deterministic=True
    )
    params.tr_fflayer_tpl.fflayer_tpl.dropout = det.Copy()
    return params


class GPipeTransformerSoftmaxLayer(softmax_lib.SimpleFullSoftmax):
  """The logits [t, b, num_classes] of the decoder's (or encoder's) output."""

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
    source_segment_id,
    target_segment_id,
    transparent_acc,
    transparent_acc_helper,
    source_task_id=None,
    target_task_id=None,
  ):
    """The stack's 8-tuple in; logits [t, b, num_classes] out."""
    p = self.params
    x = target_vecs if p.inputs_from_decoder else source_vecs
    t, b = py_utils.GetShape(x, 2)
    logits = self.Logits(theta, tf.reshape(x, [-1, p.input_dim]))
    return tf.reshape(logits, [t, b, p.num_classes])

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    x = _Shape(args[1]) if p.inputs_from_decoder else tf.TensorShape(inputs)
    t, b = x.as_list()[:2]
    flops = 2 * (t or 1) * (b or 1) * p.input_dim * p.num_classes
    return meta.Meta(flops, tf.TensorShape([t, b, p.num_classes]))


class GPipeTransformerEmbeddingLayer(base_layer.BaseLayer):
  """Token embedding + sinusoidal positions + dropout, source and target."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'token_emb',
      embedding.SimpleEmbeddingLayer.Params(),
      'Token embedding Params (source and target).',
    )
    p.Define(
      'position_emb',
      embedding.PositionalEmbeddingLayer.Params(),
      'Position embedding Params.',
    )
    p.Define('input_dropout_prob', 0.0, 'Dropout of the embeddings.')
    p.Define(
      'dropout_tpl',
      dropout.DropoutLayer.Params(),
      'Dropout Params (keep_prob set from input_dropout_prob).',
    )
    p.Define('add_tgt_embedding_layer', False, 'Also embed the target.')
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define('is_transparent', False, 'Set by the stack.')
    p.Define('max_seq_len', 300, 'Longest sequence of step-by-step decoding.')
    p.Define('target_vocab_size', 0, 'Target vocabulary; 0: the same.')
    p.Define('dec_task_emb', None, 'Only None.')
    p.Define('enc_task_emb', None, 'Only None.')
    p.Define('batch_dim', 1, 'The batch axis of the ids (1: time-major).')
    p.Define('ret_task_ids', False, 'Only False.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _Unsupported(
      p,
      {
        'packed_input': (
          False,
          'give one sequence per row and leave packed_input False.',
        ),
        'dec_task_emb': (None, 'remove it: one task.'),
        'enc_task_emb': (None, 'remove it: one task.'),
        'ret_task_ids': (False, 'remove it: one task.'),
      },
    )
    keep = 1.0 - p.input_dropout_prob
    self.CreateChild(
      'src_token_emb', p.token_emb.Copy().Set(name='src_token_emb')
    )
    self.CreateChild(
      'src_pos_emb', p.position_emb.Copy().Set(name='src_position_emb')
    )
    self.CreateChild(
      'src_dropout',
      p.dropout_tpl.Copy().Set(name='src_dropout', keep_prob=keep),
    )
    if p.add_tgt_embedding_layer:
      tgt = p.token_emb.Copy().Set(name='tgt_token_emb')
      if p.target_vocab_size:
        tgt.vocab_size = p.target_vocab_size
      self.CreateChild('tgt_token_emb', tgt)
      self.CreateChild(
        'tgt_pos_emb', p.position_emb.Copy().Set(name='tgt_position_emb')
      )
      self.CreateChild(
        'tgt_dropout',
        p.dropout_tpl.Copy().Set(name='tgt_dropout', keep_prob=keep),
      )

  def _Embed(self, theta, prefix, ids):
    p = self.params
    time_dim = 0 if p.batch_dim else 1
    seq_len = tf.shape(ids)[time_dim]
    emb = self.children[f'{prefix}_token_emb']
    x = emb.EmbLookup(theta[f'{prefix}_token_emb'], ids)
    pos = self.children[f'{prefix}_pos_emb']
    x += tf.expand_dims(
      pos.FProp(theta[f'{prefix}_pos_emb'], seq_len), p.batch_dim
    )
    drop = self.children[f'{prefix}_dropout']
    return drop.FProp(theta[f'{prefix}_dropout'], x)

  def GetEncoderEmbeddingsDefaultTheta(self, input_ids, task_ids=None):
    """The source embeddings of ids [t, b] (for decoding)."""
    del task_ids
    return self._Embed(self.theta, 'src', input_ids)

  def GetDecoderEmbeddingsDefaultTheta(self, input_ids, task_ids=None, t=None):
    """The target embeddings of ids [t, b]; with step `t`, of ids [b] at
    position t (step-by-step decoding, t < max_seq_len)."""
    del task_ids
    if t is None:
      return self._Embed(self.theta, 'tgt', input_ids)
    p = self.params
    theta = self.theta
    x = self.tgt_token_emb.EmbLookup(theta.tgt_token_emb, input_ids)
    pos = self.tgt_pos_emb.FProp(theta.tgt_pos_emb, p.max_seq_len)
    x += tf.slice(pos, [t, 0], [1, p.token_emb.embedding_dim])
    return self.tgt_dropout.FProp(theta.tgt_dropout, x)

  def FProp(
    self,
    theta,
    source_id,
    source_paddings,
    target_id,
    target_paddings,
    source_segment_id,
    target_segment_id,
    source_segment_pos,
    target_segment_pos,
    source_task_id,
    target_task_id,
  ):
    """Ids [t, b] in; the stack's 8-tuple out."""
    p = self.params
    source_vecs = self._Embed(theta, 'src', source_id)
    target_vecs = None
    if p.add_tgt_embedding_layer:
      target_vecs = self._Embed(theta, 'tgt', target_id)
    return (
      source_vecs,
      source_paddings,
      target_vecs,
      target_paddings,
      source_segment_id,
      target_segment_id,
      None,
      None,
    )

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    t, b = tf.TensorShape(meta.ToShape(inputs)).as_list()
    dim = p.token_emb.embedding_dim
    args = [None if a is None else meta.ToShape(a) for a in args]
    while len(args) < 9:
      args.append(None)
    if p.add_tgt_embedding_layer and args[1] is not None:
      args[1] = tf.TensorShape(args[1].as_list()[:2] + [dim])
    out = [tf.TensorShape([t, b, dim])] + args[:5] + [None, None]
    return meta.Meta(2 * (t or 1) * (b or 1) * dim, *out)


class GPipeTransformerStack(pipelining_layer.PipeliningLayer):
  """Lingvo's pipelined Transformer: embeddings, encoder and decoder layers
  and the softmax, split into cells at `splits` (time-major)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.splits = 1
    p.Define('model_dim', 1024, 'Model dimension.')
    p.Define('num_encoder_layers', 0, 'Number of encoder layers.')
    p.Define('num_decoder_layers', 0, 'Number of decoder layers.')
    p.Define('use_pipelined_embeddings', True, "Lingvo's; deprecated, unused.")
    p.Define(
      'emb_tpl',
      GPipeTransformerEmbeddingLayer.Params(),
      'Embedding layer Params (the first layer of cell 0).',
    )
    p.Define(
      'softmax_tpl',
      GPipeTransformerSoftmaxLayer.Params(),
      'Softmax Params (the last layer of the last cell); None: FProp '
      'returns the last layer outputs.',
    )
    p.Define(
      'label_smoothing',
      None,
      'Label smoother Params (e.g. layers.UniformLabelSmoother); None: none.',
    )
    p.Define(
      'encoder_tpl', GPipeTransformerLayer.Params(), 'Encoder layer Params.'
    )
    p.Define(
      'decoder_tpl', GPipeTransformerLayer.Params(), 'Decoder layer Params.'
    )
    p.Define(
      'transparent_merger_dropout_prob',
      0.1,
      'Dropout of the transparent mixing weights.',
    )
    p.Define(
      'is_transparent',
      False,
      'The encoder output mixes the inputs of every encoder layer.',
    )
    p.Define(
      'transparent_merger_tpl',
      DeterministicWeightsLayer.Params(),
      'Params of the transparent mixing weights.',
    )
    p.Define('packed_input', False, 'Only False (one sequence per row).')
    p.Define('normalize_encoder', False, 'Layer-normalize the encoder output.')
    p.encoder_tpl.has_aux_atten = False
    p.decoder_tpl.has_aux_atten = True
    p.decoder_tpl.mask_self_atten = True
    p.batch_dim = 1
    return p

  @classmethod
  def _EndIndices(cls, p):
    n = p.num_encoder_layers + p.num_decoder_layers
    if isinstance(p.splits, (list, tuple)):
      splits = list(p.splits)
      if not splits or splits[-1] != n or splits != sorted(splits):
        raise ValueError(
          f'GPipeTransformerStack {p.name!r}: splits={splits} must be '
          f'increasing end indices ending at num_encoder_layers + '
          f'num_decoder_layers = {n}, e.g. [{n // 2}, {n}].'
        )
      return splits
    if not isinstance(p.splits, int) or p.splits < 1:
      raise ValueError(
        f'GPipeTransformerStack {p.name!r}: splits={p.splits!r}; give the '
        'number of cells (an int >= 1) or their end indices.'
      )
    per = (n - 1) // p.splits + 1
    splits = [(i + 1) * per for i in range(p.splits)]
    splits[-1] = n
    return splits

  @classmethod
  def CellParams(cls, p):
    """The stack's layers grouped into cells, as Lingvo groups them."""
    _Unsupported(
      p,
      {
        'packed_input': (
          False,
          'give one sequence per row and leave packed_input False.',
        )
      },
    )
    splits = cls._EndIndices(p)
    deterministic = len(splits) > 1 or p.num_micro_batches != 1
    emb = p.emb_tpl.Copy()
    if deterministic:
      emb.dropout_tpl = dropout.DeterministicDropoutLayer.Params()
    emb.Set(
      name='emb',
      packed_input=p.packed_input,
      is_transparent=p.is_transparent,
      add_tgt_embedding_layer=p.num_decoder_layers > 0,
      batch_dim=p.batch_dim,
    )
    layers = [emb]
    merger = None
    if p.is_transparent:
      merger = p.transparent_merger_tpl.Copy()
      merger.num_sources = p.num_encoder_layers + 1
      merger.dropout_tpl.keep_prob = 1.0 - p.transparent_merger_dropout_prob
    for i in range(p.num_encoder_layers):
      lp = p.encoder_tpl.Copy().Set(name=f'encoder_{i}')
      last = i == p.num_encoder_layers - 1
      if p.is_transparent:
        lp.Set(is_transparent=True, final_enc_layer=last)
        if i == 0:
          lp.transparent_merger_tpl = merger.Copy()
      if p.normalize_encoder and last:
        lp.Set(normalize_output=True, final_enc_layer=True)
      if deterministic:
        lp = lp.cls.SetupDeterministicDropout(lp)
      layers.append(lp)
    for i in range(p.num_decoder_layers):
      lp = p.decoder_tpl.Copy().Set(name=f'decoder_{i}', mask_self_atten=True)
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
    super().__init__(p)
    if p.label_smoothing is not None:
      self.CreateChild(
        'smoother', p.label_smoothing.Copy().Set(name='smoother')
      )

  @property
  def _last_cell(self):
    return self.cells[-1]

  def Logits(self, theta, inputs):
    """The softmax's logits of inputs [..., model_dim]."""
    name = self._cell_names[-1]
    return self._last_cell.softmax.Logits(theta[name].softmax, inputs)

  def _LayersNamed(self, prefix, count):
    out = []
    for cell in self.cells:
      out += [lyr for lyr in cell.sub if lyr.params.name.startswith(prefix)]
    return out[:count]

  def EncoderEmbedFPropDefaultTheta(self, source_id, source_task_id=None):
    """The source embeddings (the `emb` layer of cell 0) of ids [t, b]."""
    emb = self.cells[0].emb
    return emb.GetEncoderEmbeddingsDefaultTheta(source_id, source_task_id)

  def DecoderEmbedFPropDefaultTheta(self, tgt_id, tgt_task_id=None, t=None):
    """The target embeddings of ids [t, b] (or [b] at step t)."""
    emb = self.cells[0].emb
    return emb.GetDecoderEmbeddingsDefaultTheta(tgt_id, tgt_task_id, t)

  def EncoderFPropDefaultTheta(
    self,
    source_vecs,
    source_paddings,
    source_segment_id=None,
    source_task_id=None,
    target_task_id=None,
  ):
    """The encoder layers, in order, on embeddings [t, b, d] (no pipeline;
    for decoding)."""
    acc, helper = None, None
    for layer in self.GetEncoders():
      outs = layer.FProp(
        layer.theta,
        source_vecs,
        source_paddings,
        None,
        None,
        source_segment_id,
        None,
        acc,
        helper,
        source_task_id,
        target_task_id,
      )
      source_vecs, acc, helper = outs[0], outs[6], outs[7]
    return source_vecs

  def GetEncoders(self):
    return self._LayersNamed('encoder_', self.params.num_encoder_layers)

  def GetDecoders(self):
    return self._LayersNamed('decoder_', self.params.num_decoder_layers)

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
    source_task_id=None,
    target_task_id=None,
  ):
    """Ids and paddings [t, b] in (time-major).

    Returns:
      With a softmax: (per-token cross-entropy [t, b], logits [t, b, C]) of
      `labels` (weights unused in the cross-entropy, as in Lingvo);
      without: the last layer's outputs.
    """
    p = self.params
    if p.num_decoder_layers > 0 and (
      target_input is None or target_paddings is None
    ):
      raise ValueError(
        f'GPipeTransformerStack {self.path!r} has decoder layers: pass '
        'target_input and target_paddings.'
      )
    if source_task_id is not None or target_task_id is not None:
      raise ValueError(
        f'GPipeTransformerStack {self.path!r}: task ids are not supported; '
        'pass None (one task).'
      )
    logits = super().FProp(
      theta,
      source_input,
      source_paddings,
      target_input,
      target_paddings,
      source_segment_id,
      target_segment_id,
      source_segment_pos,
      target_segment_pos,
      None,
      None,
    )
    if not p.softmax_tpl:
      return logits
    num_classes = p.softmax_tpl.num_classes
    probs = None
    if p.label_smoothing is not None:
      probs = self.smoother.FProp(theta.smoother, target_paddings, labels)
      probs = tf.reshape(probs, [-1, num_classes])
    softmax = self._last_cell.softmax
    xent = softmax.XentLossFromLogits(
      theta[self._cell_names[-1]].softmax,
      tf.reshape(logits, [-1, num_classes]),
      class_weights=tf.reshape(label_weights, [-1]),
      class_ids=None if probs is not None else tf.reshape(labels, [-1]),
      class_probabilities=probs,
    ).per_example_xent
    return tf.reshape(xent, tf.shape(logits)[:2]), logits
