"""Lingvo's Evolved Transformer decoder layer outside a pipeline, without
encoder attention: masked double-headed self-attention, the causal branched
convolutions, a Transformer layer with swish; padded time-major vectors."""

import numpy as np

from lingvo.core import layers_with_attention

DIM, T, B = 8, 7, 3


def Params():
  dec = layers_with_attention.EvolvedTransformerDecoderLayer.Params().Set(
    name='dec', source_dim=DIM, has_aux_atten=False, mask_self_atten=True
  )
  dec.tr_double_heads_atten_tpl.num_attention_heads = 4
  dec.transformer_tpl.tr_atten_tpl.num_attention_heads = 2
  return dec


def Inputs(rng):
  x = rng.randn(T, B, DIM).astype(np.float32)
  paddings = np.zeros([T, B], np.float32)
  paddings[-3:, 1] = 1.0
  return [x, paddings]
