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
from lingvo_gpipe.gpipe_layers import layers_with_gpipe
from lingvo_gpipe.layers import dropout
from lingvo_gpipe.layers import evolved_transformer

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


class _Evolved(layers_with_gpipe.StackLayer):
  """An Evolved Transformer layer of the stack (the first base; the second
  is the Evolved Transformer layer)."""

  def __init__(self, params):
    base_layer.RejectUnsupportedParams(
      params,
      {
        'is_transparent': (
          False,
          'the Evolved Transformer stack does not carry a transparent '
          "encoder's sums (nor does Lingvo's): use GPipeTransformerStack.",
        )
      },
    )
    super().__init__(params)

  @classmethod
  def SetupDeterministicDropout(cls, params):
    return _SetupDeterministicDropout(params)


class GPipeEvolvedTransformerEncoderLayer(
  _Evolved, evolved_transformer.EvolvedTransformerEncoderLayer
):
  """An Evolved Transformer encoder layer of the stack."""


class GPipeEvolvedTransformerDecoderLayer(
  _Evolved, evolved_transformer.EvolvedTransformerDecoderLayer
):
  """An Evolved Transformer decoder layer of the stack."""


class GPipeEvolvedTransformerStack(layers_with_gpipe.GPipeTransformerStack):
  """`GPipeTransformerStack` of Evolved Transformer encoder and decoder
  layers (So et al. 2019)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.encoder_tpl = GPipeEvolvedTransformerEncoderLayer.Params()
    p.decoder_tpl = GPipeEvolvedTransformerDecoderLayer.Params()
    return p
