"""Lingvo's import path of its time-major Transformer layers.

Re-exports `lingvo_gpipe.layers.layers_with_attention`
(`from lingvo.core import layers_with_attention` ->
`from lingvo_gpipe.core import layers_with_attention`).
Also Lingvo's Evolved Transformer layers, from
`lingvo_gpipe.layers.evolved_transformer`.
"""

from lingvo_gpipe.layers.evolved_transformer import (
  EvolvedTransformerBaseLayer,
)
from lingvo_gpipe.layers.evolved_transformer import (
  EvolvedTransformerDecoderBranchedConvsLayer,
)
from lingvo_gpipe.layers.evolved_transformer import (
  EvolvedTransformerDecoderLayer,
)
from lingvo_gpipe.layers.evolved_transformer import (
  EvolvedTransformerEncoderBranchedConvsLayer,
)
from lingvo_gpipe.layers.evolved_transformer import (
  EvolvedTransformerEncoderLayer,
)
from lingvo_gpipe.layers.layers_with_attention import DotProductAttention
from lingvo_gpipe.layers.layers_with_attention import FeedForwardNet
from lingvo_gpipe.layers.layers_with_attention import MultiHeadedAttention
from lingvo_gpipe.layers.layers_with_attention import TransformerAttentionLayer
from lingvo_gpipe.layers.layers_with_attention import (
  TransformerFeedForwardLayer,
)
from lingvo_gpipe.layers.layers_with_attention import TransformerLayer

__all__ = [
  'DotProductAttention',
  'EvolvedTransformerBaseLayer',
  'EvolvedTransformerDecoderBranchedConvsLayer',
  'EvolvedTransformerDecoderLayer',
  'EvolvedTransformerEncoderBranchedConvsLayer',
  'EvolvedTransformerEncoderLayer',
  'FeedForwardNet',
  'MultiHeadedAttention',
  'TransformerAttentionLayer',
  'TransformerFeedForwardLayer',
  'TransformerLayer',
]
