"""Lingvo's GPipe Evolved Transformer: `GPipeEvolvedTransformerStack`.

The stack is `GPipeTransformerStack` with Evolved Transformer encoder and
decoder layers (`layers.evolved_transformer`); each layer takes and returns
the stack's 8-tuple, so any split of the layers into cells is a pipeline.
With more than one split or micro-batch, every dropout of the layers becomes
Lingvo's `DeterministicDropoutLayer`, as in Lingvo.

As in Lingvo, the Evolved Transformer encoder does not carry the
transparent sums of a transparent encoder: `is_transparent` is refused.
"""

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import evolved_transformer
from lingvo_gpipe.pipeline import layers_with_gpipe

__all__ = [
  'GPipeEvolvedTransformerDecoderLayer',
  'GPipeEvolvedTransformerEncoderLayer',
  'GPipeEvolvedTransformerStack',
]


def _DeterministicAttention(tr_atten_tpl):
  tr_atten_tpl.residual_dropout_tpl = dropout.DeterministicDropoutLayer.Params()
  tr_atten_tpl.atten_tpl.atten_dropout_deterministic = True
  tr_atten_tpl.atten_tpl.inner_atten_params.atten_dropout_deterministic = True


def _Deterministic(tpl):
  """DeterministicDropoutLayer Params with the keep_prob of `tpl`."""
  return dropout.DeterministicDropoutLayer.Params().Set(keep_prob=tpl.keep_prob)


def _SetupDeterministicDropout(params):
  """Lingvo's switch of the layer's dropouts to DeterministicDropoutLayer.

  Lingvo replaces the branched convolutions' and the GLU's dropout Params
  with fresh ones, which drops their keep_prob (no dropout there); here the
  keep_prob is kept.
  """
  transformer = params.transformer_tpl
  _DeterministicAttention(transformer.tr_atten_tpl)
  ff = transformer.tr_fflayer_tpl
  ff.residual_dropout_tpl = dropout.DeterministicDropoutLayer.Params()
  ff.fflayer_tpl.dropout = dropout.DeterministicDropoutLayer.Params()
  convs = params.branched_convs_tpl
  convs.dropout_tpl = _Deterministic(convs.dropout_tpl)
  if 'glu_tpl' in params:
    params.glu_tpl.dropout_tpl = _Deterministic(params.glu_tpl.dropout_tpl)
  for name in ('tr_atten_tpl', 'tr_double_heads_atten_tpl'):
    if name in params:
      _DeterministicAttention(params.Get(name))
  return params


class _GPipeEvolvedMixin:
  """The stack's 8-tuple around an Evolved Transformer layer's FProp."""

  def _InitGPipe(self):
    base_layer.RejectUnsupportedParams(
      self.params,
      {
        'is_transparent': (
          False,
          'the Evolved Transformer stack does not carry a transparent '
          "encoder's sums (nor does Lingvo's): use GPipeTransformerStack.",
        )
      },
    )
    layers_with_gpipe.CreateLayerChildren(self)

  @classmethod
  def SetupDeterministicDropout(cls, params):
    return _SetupDeterministicDropout(params)

  @classmethod
  def FPropMeta(cls, p, inputs, *args):
    return layers_with_gpipe.LayerFPropMeta(p, inputs, *args)


class GPipeEvolvedTransformerEncoderLayer(
  _GPipeEvolvedMixin, evolved_transformer.EvolvedTransformerEncoderLayer
):
  """An Evolved Transformer encoder layer of the stack."""

  @classmethod
  def Params(cls):
    return layers_with_gpipe.DefineLayerParams(super().Params())

  def __init__(self, params):
    super().__init__(params)
    self._InitGPipe()

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
    """The stack's 8-tuple in and out; the source is transformed."""
    return layers_with_gpipe.LayerFProp(
      self,
      super().FProp,
      theta,
      source_vecs,
      source_paddings,
      target_vecs,
      target_paddings,
      source_segment_id,
      target_segment_id,
      transparent_acc,
      transparent_acc_helper,
      source_task_id=source_task_id,
      target_task_id=target_task_id,
    )


class GPipeEvolvedTransformerDecoderLayer(
  _GPipeEvolvedMixin, evolved_transformer.EvolvedTransformerDecoderLayer
):
  """An Evolved Transformer decoder layer of the stack."""

  @classmethod
  def Params(cls):
    return layers_with_gpipe.DefineLayerParams(super().Params())

  def __init__(self, params):
    super().__init__(params)
    self._InitGPipe()

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
    """The stack's 8-tuple in and out; the target is transformed."""
    return layers_with_gpipe.LayerFProp(
      self,
      super().FProp,
      theta,
      source_vecs,
      source_paddings,
      target_vecs,
      target_paddings,
      source_segment_id,
      target_segment_id,
      transparent_acc,
      transparent_acc_helper,
      source_task_id=source_task_id,
      target_task_id=target_task_id,
    )


class GPipeEvolvedTransformerStack(layers_with_gpipe.GPipeTransformerStack):
  """`GPipeTransformerStack` of Evolved Transformer encoder and decoder
  layers (So et al. 2019)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.encoder_tpl = GPipeEvolvedTransformerEncoderLayer.Params()
    p.decoder_tpl = GPipeEvolvedTransformerDecoderLayer.Params()
    return p
