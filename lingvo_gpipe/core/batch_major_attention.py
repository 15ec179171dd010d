"""Lingvo's import path of its batch-major Transformer layers.

Re-exports `lingvo_gpipe.layers.batch_major_attention`
(`from lingvo.core import batch_major_attention` ->
`from lingvo_gpipe.core import batch_major_attention`).
"""

from lingvo_gpipe.layers.batch_major_attention import (
  GPipeBatchMajorTransformerLayer,
)
from lingvo_gpipe.layers.batch_major_attention import MultiHeadedAttention
from lingvo_gpipe.layers.batch_major_attention import PerDimScaleLayer
from lingvo_gpipe.layers.batch_major_attention import TransformerAttentionLayer
from lingvo_gpipe.layers.batch_major_attention import TransformerLayer

__all__ = [
  'GPipeBatchMajorTransformerLayer',
  'MultiHeadedAttention',
  'PerDimScaleLayer',
  'TransformerAttentionLayer',
  'TransformerLayer',
]
