"""A tiny multilingual Transformer task and batches, shared by the MT tests.

Sizes: batch B, source length S, target length T, model dim D, vocabulary V.
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core.nested_map import NestedMap
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.models.mt import layers as mt_layers
from lingvo_gpipe.models.mt import model as mt_model
from lingvo_gpipe.pipeline import pipelining_layer

B, S, T, D, V = 4, 7, 6, 16, 40


def Layers(num_layers=1, hidden=32, **kwargs):
  return mt_layers.TransformerMTLayers(
    num_encoder_layers=num_layers,
    num_decoder_layers=num_layers,
    model_dim=D,
    hidden_dim=hidden,
    num_heads=2,
    vocab_size=V,
    **kwargs,
  )


def TaskParams(
  num_stages=2,
  num_micro_batches=2,
  num_layers=1,
  hidden=32,
  pipelined=True,
  **kwargs,
):
  p = mt_model.TransformerMTTask.Params().Set(
    name='mt', vocab_size=V, random_seed=7, beam_size=1
  )
  layers = Layers(num_layers, hidden, **kwargs)
  if pipelined:
    p.network = pipelining_layer.PipeliningLayer.Params().Set(
      name='network',
      layers=layers,
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      balance_by='uniform',
    )
  else:
    p.network = sequential.SequentialLayer.Params().Set(
      name='network', sub=layers
    )
  p.train.learning_rate = 1e-3
  return p


def Batch(seed=0, batch=B):
  rng = np.random.RandomState(seed)
  src_len = rng.randint(2, S + 1, size=batch)
  tgt_len = rng.randint(2, T + 1, size=batch)
  src_pad = (np.arange(S)[None] >= src_len[:, None]).astype(np.float32)
  tgt_pad = (np.arange(T)[None] >= tgt_len[:, None]).astype(np.float32)
  src = rng.randint(4, V, size=[batch, S]) * (1 - src_pad)
  labels = rng.randint(4, V, size=[batch, T]) * (1 - tgt_pad)
  ids = np.concatenate([np.ones([batch, 1]), labels[:, :-1]], 1)
  return NestedMap(
    src=NestedMap(
      ids=tf.constant(src, tf.int32), paddings=tf.constant(src_pad)
    ),
    tgt=NestedMap(
      ids=tf.constant(ids, tf.int32),
      labels=tf.constant(labels, tf.int32),
      paddings=tf.constant(tgt_pad),
      weights=tf.constant(1 - tgt_pad),
    ),
  )
