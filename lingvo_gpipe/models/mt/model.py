"""TransformerMTTask: the pipelined multilingual Transformer as a BaseTask.

  p = TransformerMTTask.Params().Set(name='mt', vocab_size=V)
  p.network = PipeliningLayer.Params().Set(
      name='network', layers=mt_layers.TransformerMTLayers(...),
      num_stages=2, num_micro_batches=4, input_shapes=[...])

Input batches (`lingvo_gpipe.input.mt_input.MultilingualMTInput`):

  src.ids int32 [b, s]   <2xx> + source pieces + </s>, then pad
  src.paddings [b, s]    1.0 on padding
  tgt.ids int32 [b, t]   <s> + target pieces (the decoder input)
  tgt.labels int32 [b, t]  target pieces + </s>
  tgt.paddings, tgt.weights [b, t]
  lang int32 [b]         index of the source language (for per-language
                         BLEU), optional
  src.text, tgt.text     the raw sentences (eval inputs), optional
  weight [b]             1 for real examples, 0 for the padding of the last
                         eval batch, optional

Training runs the whole network (embedding .. loss) as one PipeliningLayer;
the metrics are token-weighted means over the whole batch:

  loss        label-smoothed cross-entropy per target token
  log_pplx    plain cross-entropy per token (exp() = perplexity)
  token_accuracy  argmax == label
  num_tokens  the target tokens of the batch (weight 1)

With `network.schedule = '1f1b'` the loss is computed on the last cell per
micro-batch (`PipeliningLayer.FPropWithLoss`: each micro-batch's share is
its summed cross-entropy over the batch's target tokens), so a micro-batch's
backward starts before the others' forwards; the metrics and gradients are
the same as with 'gpipe'.

`Decode` runs the SAME layers outside the pipeline in eval mode: the
encoder once, then greedy (beam_size = 1) or beam search with length
normalization, each step running the decoder layers over the fixed-size
target buffer. `PostProcessDecodeOut` turns the decoded ids into text with
the input's vocabulary and scores BLEU per source language (sacrebleu).
"""

import tensorflow as tf

from lingvo_gpipe.core import base_model
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.models.mt import decoding
from lingvo_gpipe.models.mt import evaluation
from lingvo_gpipe.models.mt import layers as mt_layers

__all__ = ['TransformerMTTask']


class TransformerMTTask(base_model.BaseTask):
  """Multilingual Transformer translation. See the module docstring."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'network',
      None,
      'Params of a PipeliningLayer (or SequentialLayer) whose flat '
      '`layers` (`sub`) are mt.layers.TransformerMTLayers(...).',
    )
    p.Define(
      'vocab_size',
      0,
      "Size of the shared vocabulary; must equal the network's and "
      "the input's.",
    )
    p.Define('bos_id', 1, 'Id of <s>, the first decoder input.')
    p.Define('eos_id', 2, 'Id of </s>, which ends a sentence.')
    p.Define('pad_id', 0, 'Id of <pad>.')
    p.Define('beam_size', 4, 'Beams of Decode; 1: greedy search.')
    p.Define(
      'length_normalization',
      0.6,
      'alpha of the GNMT length penalty ((5 + n) / 6)^alpha of beam '
      'search; 0: rank by the raw log-probability.',
    )
    p.Define(
      'max_decode_length',
      None,
      'Longest hypothesis (eos included); None: the target length of '
      'the batch.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.network is None:
      raise ValueError(
        f'TransformerMTTask {self.path!r}: p.network is None; '
        'set it to a PipeliningLayer whose layers are '
        'mt.layers.TransformerMTLayers(...).'
      )
    layer_ps = []
    for field in ('layers', 'sub'):
      if field in p.network and p.network.Get(field):
        layer_ps = list(p.network.Get(field))
        break
    if not layer_ps:
      raise ValueError(
        f'TransformerMTTask {self.path!r}: the network has '
        'no flat layer list (PipeliningLayer.layers or '
        'SequentialLayer.sub); cell_tpl is not supported.'
      )
    self._CheckLayerParams(layer_ps)
    input_p = p.input
    if (
      input_p is not None
      and 'vocab_size' in input_p
      and (input_p.vocab_size and input_p.vocab_size != p.vocab_size)
    ):
      raise ValueError(
        f"TransformerMTTask {self.path!r}: the input's vocab_size = "
        f"{input_p.vocab_size} but the model's is {p.vocab_size}; the "
        'model and its vocabulary must agree (set both from one constant).'
      )
    self.CreateChild('network', p.network)

  def _CheckLayerParams(self, layer_ps):
    p = self.params
    first, last = layer_ps[0], layer_ps[-1]
    if not issubclass(first.cls, mt_layers.MTEmbeddingLayer) or not issubclass(
      last.cls, mt_layers.MTSoftmaxLayer
    ):
      raise ValueError(
        f'TransformerMTTask {self.path!r}: the network layers must start '
        'with an MTEmbeddingLayer and end with an MTSoftmaxLayer (got '
        f'{first.cls.__name__} .. {last.cls.__name__}); build them with '
        'mt.layers.TransformerMTLayers.'
      )
    for lp in (first, last):
      if lp.vocab_size != p.vocab_size:
        raise ValueError(
          f'TransformerMTTask {self.path!r}: layer {lp.name!r} has '
          f'vocab_size = {lp.vocab_size} but the task has {p.vocab_size}; '
          'use one vocabulary size throughout.'
        )

  # -- Structure ---------------------------------------------------------------

  def _Layers(self):
    """The layers of the flat list, in order."""
    net = self.network
    return list(net.body) if hasattr(net, 'CellLayers') else list(net.sub)

  def _LayerThetas(self, theta):
    return (
      list(theta.network.body)
      if hasattr(self.network, 'CellLayers')
      else list(theta.network.sub)
    )

  def _Split(self, theta):
    """(emb, encoder side, decoder side, softmax), each (layer, theta)."""
    pairs = list(zip(self._Layers(), self._LayerThetas(theta)))
    emb, final = pairs[0], pairs[-1]
    middle = pairs[1:-1]
    first_dec = next(
      (
        i
        for i, (lyr, _) in enumerate(middle)
        if isinstance(lyr, mt_layers.MTDecoderLayer)
      ),
      len(middle),
    )
    return emb, middle[:first_dec], middle[first_dec:], final

  # -- Training ----------------------------------------------------------------

  def _PipelineInput(self, input_batch):
    src, tgt = input_batch.src, input_batch.tgt
    weights = tf.cast(tgt.weights, tf.float32)
    if 'weight' in input_batch:  # Padding examples of an eval batch.
      weights *= tf.cast(input_batch.weight, tf.float32)[:, tf.newaxis]
    return NestedMap(
      src_ids=tf.cast(src.ids, tf.int32),
      src_paddings=tf.cast(src.paddings, tf.float32),
      tgt_ids=tf.cast(tgt.ids, tf.int32),
      tgt_paddings=tf.cast(tgt.paddings, tf.float32),
      tgt_labels=tf.cast(tgt.labels, tf.int32),
      tgt_weights=weights,
    )

  def _LossOnLastCell(self):
    """Whether training computes the loss on the pipeline's last cell."""
    net = self.network
    return (
      not self.do_eval
      and hasattr(net, 'FPropWithLoss')
      and net.params.schedule == '1f1b'
    )

  def ComputePredictions(self, theta, input_batch):
    """NestedMap(xent, nll, correct, num_tokens), each [b]; with the loss
    on the last cell (schedule '1f1b') also `loss`, the training loss."""
    pipe_in = self._PipelineInput(input_batch)
    if self._LossOnLastCell():
      total = tf.reduce_sum(pipe_in.tgt_weights)

      def LossFn(out):
        return tf.math.divide_no_nan(tf.reduce_sum(out.xent), total)

      loss, out = self.network.FPropWithLoss(
        theta.network, pipe_in, loss_fn=LossFn
      )
      out = NestedMap(out)
      out.loss = loss
      return out
    out = self.network.FProp(theta.network, pipe_in)
    if isinstance(out, tuple) and len(out) == 1:
      out = out[0]
    return out

  def ComputeLoss(self, theta, predictions, input_batch):
    """Token-weighted metrics of the whole batch (module docstring)."""
    del theta, input_batch
    total = tf.reduce_sum(predictions.num_tokens)

    def Mean(x):
      return tf.math.divide_no_nan(tf.reduce_sum(x), total)

    loss = predictions.loss if 'loss' in predictions else None
    metrics = NestedMap(
      loss=(Mean(predictions.xent) if loss is None else loss, total),
      log_pplx=(Mean(predictions.nll), total),
      token_accuracy=(Mean(predictions.correct), total),
      num_tokens=(total, tf.constant(1.0)),
    )
    per_example = NestedMap(
      loss=tf.math.divide_no_nan(predictions.xent, predictions.num_tokens)
    )
    return metrics, per_example

  # -- Decoding ----------------------------------------------------------------

  def Encode(self, theta, src_ids, src_paddings):
    """Runs the embedding and encoder layers: NestedMap(src, src_paddings)."""
    (emb, emb_theta), enc_side, _, _ = self._Split(theta)
    state = NestedMap(
      src=emb.Embed(emb_theta, tf.cast(src_ids, tf.int32)),
      src_paddings=tf.cast(src_paddings, tf.float32),
    )
    for layer, layer_theta in enc_side:
      state = layer.FProp(layer_theta, state)
    return state

  def DecoderLogits(self, theta, encoded, tgt_ids, tgt_paddings=None):
    """Logits [b, t, vocab] of decoder inputs tgt_ids [b, t] (teacher forced).

    Args:
      theta: the task's theta.
      encoded: `Encode`'s NestedMap(src [b, s, d], src_paddings [b, s]).
      tgt_ids: int [b, t], starting with bos_id.
      tgt_paddings: [b, t] or None (no padding).
    """
    (emb, emb_theta), _, dec_side, (final, final_theta) = self._Split(theta)
    tgt_ids = tf.cast(tgt_ids, tf.int32)
    if tgt_paddings is None:
      tgt_paddings = tf.zeros(tf.shape(tgt_ids), tf.float32)
    state = NestedMap(
      src=encoded.src,
      src_paddings=encoded.src_paddings,
      tgt=emb.Embed(emb_theta, tgt_ids),
      tgt_paddings=tf.cast(tgt_paddings, tf.float32),
    )
    for layer, layer_theta in dec_side:
      state = layer.FProp(layer_theta, state)
    return final.Logits(final_theta, state.tgt)

  def Search(self, theta, src_ids, src_paddings, beam_size=None, max_len=None):
    """Greedy (beam_size 1) or beam search; see `decoding`.

    Args:
      theta: the task's theta.
      src_ids: int [b, s].
      src_paddings: [b, s].
      beam_size: None: p.beam_size.
      max_len: None: p.max_decode_length, else the source length + 10.

    Returns:
      NestedMap(ids int32 [b, max_len], lengths [b], scores [b], ...).
    """
    p = self.params
    beam_size = p.beam_size if beam_size is None else beam_size
    max_len = max_len or p.max_decode_length or int(src_ids.shape[1]) + 10
    encoded = self.Encode(theta, src_ids, src_paddings)
    batch = src_ids.shape[0] or tf.shape(src_ids)[0]
    if beam_size > 1:
      encoded = encoded.Transform(lambda x: tf.repeat(x, beam_size, axis=0))

    def LogProbs(ids, t):
      logits = self.DecoderLogits(theta, encoded, ids)
      return tf.nn.log_softmax(tf.cast(logits[:, t, :], tf.float32))

    if beam_size == 1:
      return decoding.GreedySearch(
        LogProbs, batch, max_len, p.bos_id, p.eos_id, p.pad_id
      )
    return decoding.BeamSearch(
      LogProbs,
      batch,
      beam_size,
      max_len,
      p.bos_id,
      p.eos_id,
      p.pad_id,
      p.length_normalization,
    )

  @tf.autograph.experimental.do_not_convert
  def Decode(self, input_batch):
    """Translates a batch: NestedMap(hyp_ids [b, t], hyp_lens [b],
    scores [b], and the batch's lang, src_text, ref_text when present)."""
    p = self.params
    max_len = p.max_decode_length or int(input_batch.tgt.ids.shape[1])
    with py_utils.EvalMode(), py_utils.NoUpdateCollection():
      result = self.Search(
        self.theta,
        input_batch.src.ids,
        input_batch.src.paddings,
        max_len=max_len,
      )
    out = NestedMap(
      hyp_ids=result.ids, hyp_lens=result.lengths, scores=result.scores
    )
    if 'lang' in input_batch:
      out.lang = input_batch.lang
    if 'text' in input_batch.src:
      out.src_text = input_batch.src.text
    if 'text' in input_batch.tgt:
      out.ref_text = input_batch.tgt.text
    return out

  def EvaluateDecoder(self, max_batches=None, **decode):
    """Decodes the input and returns its `bleu.BleuReport` (**decode:
    progress, progress_every_s; see `evaluation.DecodeColumns`)."""
    return evaluation.EvaluateBleu(self, max_batches, **decode)

  def PostProcessDecodeOut(self, columns, vocab=None, languages=None):
    """BLEU of decoded outputs, per source language and averaged.

    Args:
      columns: {name: numpy array} of `Decode` outputs over a whole pass
        (padding examples removed), as the decoder job collects them:
        hyp_ids [n, t], ref_text [n] and optionally lang [n].
      vocab: a `mt_vocab.Vocabulary`; None: the input generator's.
      languages: names of the `lang` indices; None: the input generator's.

    Returns:
      A `bleu.BleuReport` (per-language BLEU, their mean, the corpus BLEU
      over all languages, the hypotheses).
    """
    from lingvo_gpipe.models.mt import bleu  # pylint: disable=g-import-not-at-top

    gen = self.input_generator
    if vocab is None:
      if gen is None:
        raise ValueError(
          'PostProcessDecodeOut needs a vocabulary: pass '
          'vocab= or build the task with its input.'
        )
      vocab = gen.vocab
    if languages is None and gen is not None and hasattr(gen, 'languages'):
      languages = gen.languages
    p = self.params
    hyps = [
      vocab.Decode(decoding.StripEos(row, p.eos_id, p.pad_id))
      for row in columns['hyp_ids']
    ]
    if 'ref_text' not in columns:
      raise ValueError(
        'PostProcessDecodeOut: the decoder outputs have no '
        'ref_text; decode an eval input (include_text=True).'
      )
    refs = [
      r.decode('utf-8') if isinstance(r, bytes) else str(r)
      for r in columns['ref_text']
    ]
    langs = None
    if 'lang' in columns:
      idx = [int(i) for i in columns['lang']]
      langs = [languages[i] if languages else str(i) for i in idx]
    return bleu.PerLanguageBleu(hyps, refs, langs)
