"""Lingvo model: the batch-major GPipeBatchMajorTransformerStack its GPipe
language model uses, here with 2 encoder and 1 decoder layers, 2 cells,
2 micro-batches, unpacked inputs [batch, time]."""

import numpy as np

from lingvo.core import layers_with_gpipe

VOCAB, DIM, B, T = 11, 8, 4, 5


def Params():
  p = layers_with_gpipe.GPipeBatchMajorTransformerStack.Params().Set(
    name='stack',
    model_dim=DIM,
    num_encoder_layers=2,
    num_decoder_layers=1,
    splits=[1, 3],
    num_micro_batches=2,
    packed_input=False,
  )
  for tpl in (p.encoder_tpl, p.decoder_tpl):
    tpl.input_dim = DIM
    tpl.num_heads = 2
    tpl.tr_fflayer_tpl.hidden_dim = 16
  p.emb_tpl.token_emb.Set(vocab_size=VOCAB, embedding_dim=DIM)
  p.emb_tpl.position_emb.embedding_dim = DIM
  p.softmax_tpl.Set(input_dim=DIM, num_classes=VOCAB)
  return p


def Inputs(rng):
  src = rng.randint(0, VOCAB, [B, T]).astype(np.int32)
  tgt = rng.randint(0, VOCAB, [B, T]).astype(np.int32)
  labels = rng.randint(0, VOCAB, [B, T]).astype(np.int32)
  src_pad = np.zeros([B, T], np.float32)
  src_pad[1, -2:] = 1.0
  tgt_pad = np.zeros([B, T], np.float32)
  tgt_pad[2, -1:] = 1.0
  return [src, src_pad, tgt, tgt_pad, None, None, labels, 1.0 - tgt_pad]
