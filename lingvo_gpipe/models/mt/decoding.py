"""Greedy and beam search over a step function, with static shapes.

Both search functions drive a `log_probs_fn(ids, t)`:

  ids  int32 [n, max_len]: the decoder input buffer, ids[:, 0] = bos_id,
       ids[:, i] = the token chosen at step i - 1 (pad_id after step t);
  t    int32 scalar, the current step;
  returns float32 [n, vocab]: log-probabilities of the next token, i.e. of
       the decoder output at position t.

A Transformer decoder with causal self-attention can compute it by running on
the whole buffer and reading position t (what `TransformerMTTask` does: the
same layers as training, in eval mode). The loop is a `tf.while_loop` with
fixed-size buffers, so it runs inside a `tf.function` and stops as soon as
every hypothesis has emitted `eos_id`.

Outputs (`NestedMap`): `ids` int32 [b, max_len] (the tokens, then eos_id,
then pad_id), `lengths` int32 [b] (tokens before eos), `scores` float32 [b]
(the sum of the log-probabilities, eos included) and, for beam search,
`norm_scores` [b] (the length-normalized score the best beam was chosen by).

Length normalization (GNMT, Wu et al. 2016): a hypothesis of n tokens (eos
included) is ranked by score / ((5 + n) / 6) ** alpha; alpha = 0 ranks by the
raw log-probability. With beam_size = 1 beam search picks the argmax at every
step: it returns exactly the greedy result.
"""

import tensorflow as tf

from lingvo_gpipe.core.nested_map import NestedMap

__all__ = ['GreedySearch', 'BeamSearch', 'LengthPenalty', 'StripEos']

_NEG_INF = -1.0e9


def LengthPenalty(length, alpha):
  """GNMT length penalty ((5 + length) / 6) ** alpha (float32)."""
  length = tf.cast(length, tf.float32)
  return tf.pow((5.0 + length) / 6.0, tf.cast(alpha, tf.float32))


def _KeepShapes(body):
  """Gives a loop body's outputs the static shapes of its inputs."""

  def Wrapped(*args):
    outs = body(*args)
    for new, old in zip(outs, args):
      new.set_shape(old.shape)
    return outs

  return Wrapped


def _Check(batch_size, max_len):
  if not isinstance(max_len, int) or max_len < 1:
    raise ValueError(
      f'max_len = {max_len!r}: the decode length must be a '
      'positive int (the static target length).'
    )
  del batch_size


def GreedySearch(log_probs_fn, batch_size, max_len, bos_id, eos_id, pad_id=0):
  """Picks the most likely token at every step.

  Args:
    log_probs_fn: see the module docstring.
    batch_size: b (int or scalar tensor).
    max_len: int, the buffer length (the longest hypothesis, eos included).
    bos_id: first decoder input.
    eos_id: end of sentence.
    pad_id: filler after eos.

  Returns:
    NestedMap(ids [b, max_len], lengths [b], scores [b]).
  """
  _Check(batch_size, max_len)
  cols = tf.range(max_len)[tf.newaxis, :]
  inp = tf.where(cols == 0, bos_id, pad_id) * tf.ones([batch_size, 1], tf.int32)
  out = tf.fill([batch_size, max_len], tf.constant(pad_id, tf.int32))
  finished = tf.zeros([batch_size], tf.bool)
  scores = tf.zeros([batch_size], tf.float32)
  lengths = tf.zeros([batch_size], tf.int32)

  def Cond(t, unused_inp, unused_out, finished, unused_s, unused_l):
    return tf.logical_and(t < max_len, tf.logical_not(tf.reduce_all(finished)))

  @_KeepShapes
  def Body(t, inp, out, finished, scores, lengths):
    lp = tf.cast(log_probs_fn(inp, t), tf.float32)
    tok = tf.argmax(lp, axis=-1, output_type=tf.int32)
    tok_lp = tf.gather(lp, tok, batch_dims=1)
    tok = tf.where(finished, pad_id, tok)
    scores += tf.where(finished, 0.0, tok_lp)
    lengths += tf.cast(tf.logical_not(finished) & (tok != eos_id), tf.int32)
    out = tf.where(cols == t, tok[:, tf.newaxis], out)
    inp = tf.where(cols == t + 1, tok[:, tf.newaxis], inp)
    finished = finished | tf.equal(tok, eos_id)
    return t + 1, inp, out, finished, scores, lengths

  _, _, out, _, scores, lengths = tf.while_loop(
    Cond,
    Body,
    (tf.constant(0), inp, out, finished, scores, lengths),
    maximum_iterations=max_len,
  )
  return NestedMap(ids=out, lengths=lengths, scores=scores)


def BeamSearch(
  log_probs_fn,
  batch_size,
  beam_size,
  max_len,
  bos_id,
  eos_id,
  pad_id=0,
  length_normalization=0.6,
):
  """Beam search with GNMT length normalization.

  Each step extends every live hypothesis by every token and keeps the
  `beam_size` best candidates by normalized score; a finished hypothesis
  (it emitted eos) competes with its final score, unchanged. The search
  ends when all beams are finished or after max_len steps, and returns the
  best finished beam of each example by normalized score (the best
  unfinished one if none finished).

  Args:
    log_probs_fn: see the module docstring; called with n = b * beam_size
      rows, example-major (rows i * beam_size .. (i + 1) * beam_size - 1 are
      the beams of example i): tile the encoder output accordingly.
    batch_size: b (int or scalar tensor).
    beam_size: int >= 1.
    max_len: int, the buffer length.
    bos_id: first decoder input.
    eos_id: end of sentence.
    pad_id: filler after eos.
    length_normalization: alpha of `LengthPenalty` (0: none).

  Returns:
    NestedMap(ids [b, max_len], lengths [b], scores [b], norm_scores [b]).
  """
  _Check(batch_size, max_len)
  if not isinstance(beam_size, int) or beam_size < 1:
    raise ValueError(
      f'beam_size = {beam_size!r}; use an int >= 1 (1 = greedy).'
    )
  k = beam_size
  alpha = float(length_normalization)
  cols = tf.range(max_len)[tf.newaxis, tf.newaxis, :]
  inp = tf.where(cols == 0, bos_id, pad_id) * tf.ones(
    [batch_size, k, 1], tf.int32
  )
  out = tf.fill([batch_size, k, max_len], tf.constant(pad_id, tf.int32))
  # Only beam 0 is live at first, so the first step does not pick k copies
  # of the same hypothesis.
  scores = tf.tile(tf.constant([[0.0] + [_NEG_INF] * (k - 1)]), [batch_size, 1])
  finished = tf.zeros([batch_size, k], tf.bool)
  lengths = tf.zeros([batch_size, k], tf.int32)  # eos included

  def Cond(t, unused_inp, unused_out, unused_scores, finished, unused_len):
    return tf.logical_and(t < max_len, tf.logical_not(tf.reduce_all(finished)))

  @_KeepShapes
  def Body(t, inp, out, scores, finished, lengths):
    flat = tf.reshape(inp, [-1, max_len])
    lp = tf.cast(log_probs_fn(flat, t), tf.float32)
    vocab = tf.shape(lp)[-1]
    lp = tf.reshape(lp, [batch_size, k, vocab])
    live = scores[:, :, tf.newaxis] + lp  # [b, k, v]
    # A finished hypothesis has one continuation: pad, at an unchanged score.
    is_pad = tf.equal(tf.range(vocab), pad_id)[tf.newaxis, tf.newaxis, :]
    done = tf.where(is_pad, scores[:, :, tf.newaxis], _NEG_INF)
    cand = tf.where(finished[:, :, tf.newaxis], done, live)
    cand_len = tf.where(finished, lengths, t + 1)  # [b, k]
    norm = cand / LengthPenalty(cand_len, alpha)[:, :, tf.newaxis]
    top_norm, top_idx = tf.math.top_k(tf.reshape(norm, [batch_size, -1]), k=k)
    del top_norm
    beam = top_idx // vocab
    tok = top_idx % vocab
    new_scores = tf.gather(
      tf.reshape(cand, [batch_size, -1]), top_idx, batch_dims=1
    )
    was_finished = tf.gather(finished, beam, batch_dims=1)
    lengths = tf.where(
      was_finished, tf.gather(lengths, beam, batch_dims=1), t + 1
    )
    tok = tf.where(was_finished, pad_id, tok)
    inp = tf.gather(inp, beam, batch_dims=1)
    out = tf.gather(out, beam, batch_dims=1)
    out = tf.where(cols == t, tok[:, :, tf.newaxis], out)
    inp = tf.where(cols == t + 1, tok[:, :, tf.newaxis], inp)
    finished = was_finished | tf.equal(tok, eos_id)
    return t + 1, inp, out, new_scores, finished, lengths

  _, _, out, scores, finished, lengths = tf.while_loop(
    Cond,
    Body,
    (tf.constant(0), inp, out, scores, finished, lengths),
    maximum_iterations=max_len,
  )
  norm = scores / LengthPenalty(lengths, alpha)
  # A finished hypothesis beats any unfinished one (cut off at max_len).
  rank = tf.where(finished, norm, norm + _NEG_INF)
  best = tf.argmax(rank, axis=1, output_type=tf.int32)
  ids = tf.gather(out, best, batch_dims=1)
  best_len = tf.gather(lengths, best, batch_dims=1)
  best_finished = tf.gather(finished, best, batch_dims=1)
  tokens = best_len - tf.cast(best_finished, tf.int32)  # eos not counted
  return NestedMap(
    ids=ids,
    lengths=tokens,
    scores=tf.gather(scores, best, batch_dims=1),
    norm_scores=tf.gather(norm, best, batch_dims=1),
  )


def StripEos(ids, eos_id, pad_id=0):
  """The tokens of one hypothesis (a list/array of ids) before eos, no pads."""
  out = []
  for i in ids:
    i = int(i)
    if i == eos_id:
      break
    if i != pad_id:
      out.append(i)
  return out
