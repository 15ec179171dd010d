"""Lingvo model: a GPipeTransformerStack with a transparent encoder (its
output mixes every encoder layer's input with learned weights), label
smoothing and an output layer norm on the encoder, 3 cells."""

import numpy as np
import tensorflow as tf

from lingvo.core import layers
from lingvo.core import layers_with_gpipe

VOCAB, DIM, T, B = 9, 8, 4, 4


def Params():
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
    name='stack',
    model_dim=DIM,
    num_encoder_layers=3,
    num_decoder_layers=1,
    splits=[1, 3, 4],
    num_micro_batches=2,
    is_transparent=True,
    transparent_merger_dropout_prob=0.0,
    normalize_encoder=True,
    state_dtype=tf.float32,
  )
  p.label_smoothing = layers.UniformLabelSmoother.Params().Set(
    num_classes=VOCAB, uncertainty=0.1
  )
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.source_dim = DIM
    tpl.tr_atten_tpl.num_attention_heads = 4
    tpl.tr_fflayer_tpl.hidden_dim = 12
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.embedding_dim = DIM
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  return p


def Inputs(rng):
  src = rng.randint(0, VOCAB, [T, B]).astype(np.int32)
  tgt = rng.randint(0, VOCAB, [T, B]).astype(np.int32)
  labels = rng.randint(0, VOCAB, [T, B]).astype(np.int32)
  pad = np.zeros([T, B], np.float32)
  return [src, pad, tgt, pad, None, None, labels, 1.0 - pad]
