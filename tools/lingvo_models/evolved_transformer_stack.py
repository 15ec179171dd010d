"""Lingvo's GPipeEvolvedTransformerStack: embeddings, 2 Evolved Transformer
encoder layers (GLU, branched convolutions, Transformer layer) and 2 decoder
layers (double-headed self-attention beside encoder attention, causal
separable convolutions, Transformer decoder layer), the softmax, splits=[1, 4]
(3 layers in the second cell), 2 micro-batches, padded time-major ids."""

import numpy as np
import tensorflow as tf

from lingvo.core import layers_with_gpipe

VOCAB, DIM, T, B = 13, 8, 6, 4


def Params():
  p = layers_with_gpipe.GPipeEvolvedTransformerStack.Params().Set(
    name='stack',
    model_dim=DIM,
    num_encoder_layers=2,
    num_decoder_layers=2,
    splits=[1, 4],
    num_micro_batches=2,
    state_dtype=tf.float32,  # Lingvo's states default to the ids' int32
  )
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.source_dim = DIM
    tpl.transformer_tpl.tr_atten_tpl.num_attention_heads = 2
  p.decoder_tpl.tr_atten_tpl.num_attention_heads = 2
  p.decoder_tpl.tr_double_heads_atten_tpl.num_attention_heads = 4
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.embedding_dim = DIM
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  return p


def Inputs(rng):
  src = rng.randint(0, VOCAB, [T, B]).astype(np.int32)
  tgt = rng.randint(0, VOCAB, [T, B]).astype(np.int32)
  labels = rng.randint(0, VOCAB, [T, B]).astype(np.int32)
  src_pad = np.zeros([T, B], np.float32)
  src_pad[-2:, 1] = 1.0  # a shorter source sequence
  tgt_pad = np.zeros([T, B], np.float32)
  tgt_pad[-1:, 2] = 1.0
  weights = 1.0 - tgt_pad
  return [src, src_pad, tgt, tgt_pad, None, None, labels, weights]
