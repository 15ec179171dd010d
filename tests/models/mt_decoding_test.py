"""Tests of greedy/beam search, the task's Decode and BLEU (models/mt)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import nested_map
from lingvo_gpipe.models.mt import bleu
from lingvo_gpipe.models.mt import decoding
from lingvo_gpipe.models.mt import evaluation
from tests.testing import mt

BOS, EOS, PAD = 1, 2, 0
A, B_, C = 3, 4, 5  # Tokens of the handcrafted models.
VOCAB = 6


def _TableFn(table):
  """A step function from {prefix (tuple of tokens): {token: prob}}.

  Unlisted prefixes put all their mass on eos.
  """

  def Fn(ids, t):
    def Row(ids_np, t_np):
      out = np.full([ids_np.shape[0], VOCAB], -1e9, np.float32)
      for r, row in enumerate(ids_np):
        prefix = tuple(int(x) for x in row[1 : int(t_np) + 1])
        dist = table.get(prefix, {EOS: 1.0})
        for tok, prob in dist.items():
          out[r, tok] = np.log(prob)
      return out

    lp = tf.numpy_function(Row, [ids, t], tf.float32)
    lp.set_shape([None, VOCAB])
    return lp

  return Fn


# A greedy trap: A is likelier first, but every continuation of A is bad.
_TRAP = {
  (): {A: 0.6, B_: 0.4},
  (A,): {EOS: 0.3, C: 0.4, B_: 0.3},
  (A, C): {EOS: 0.5, C: 0.5},
  (A, B_): {EOS: 0.5, C: 0.5},
  (B_,): {EOS: 1.0},
}


def testBeamSearchEscapesTheGreedyTrap():
  fn = _TableFn(_TRAP)
  greedy = decoding.GreedySearch(fn, 1, 5, BOS, EOS, PAD)
  beam = decoding.BeamSearch(
    fn, 1, 3, 5, BOS, EOS, PAD, length_normalization=0.0
  )
  assert greedy.ids.numpy()[0, :3].tolist() == [A, C, EOS]
  assert int(greedy.lengths[0]) == 2
  assert float(greedy.scores[0]) == pytest.approx(
    np.log(0.6 * 0.4 * 0.5), rel=1e-5
  )
  assert beam.ids.numpy()[0].tolist() == [B_, EOS, PAD, PAD, PAD]
  assert int(beam.lengths[0]) == 1
  assert float(beam.scores[0]) == pytest.approx(np.log(0.4), rel=1e-5)


def testLengthNormalizationPrefersLongerHypotheses():
  # Short: B eos, p = 0.3. Long: A C C C eos, p = 0.7 * 0.6^3 * 0.7 = 0.106.
  table = {
    (): {A: 0.7, B_: 0.3},
    (B_,): {EOS: 1.0},
    (A,): {C: 0.6, EOS: 0.4},
    (A, C): {C: 0.6, EOS: 0.4},
    (A, C, C): {C: 0.6, EOS: 0.4},
    (A, C, C, C): {EOS: 0.7, C: 0.3},
  }
  fn = _TableFn(table)
  raw = decoding.BeamSearch(fn, 1, 4, 6, BOS, EOS, PAD, 0.0)
  normed = decoding.BeamSearch(fn, 1, 4, 6, BOS, EOS, PAD, 2.0)
  assert raw.ids.numpy()[0, :2].tolist() == [B_, EOS]
  assert normed.ids.numpy()[0, :5].tolist() == [A, C, C, C, EOS]
  assert float(normed.norm_scores[0]) == pytest.approx(
    np.log(0.7 * 0.6**3 * 0.7) / ((5 + 5) / 6) ** 2.0, rel=1e-4
  )


def testUnfinishedHypothesesStopAtMaxLen():
  fn = _TableFn({(): {C: 1.0}, (C,): {C: 1.0}, (C, C): {C: 1.0}})
  out = decoding.GreedySearch(fn, 2, 3, BOS, EOS, PAD)
  assert out.ids.numpy().tolist() == [[C, C, C]] * 2
  assert out.lengths.numpy().tolist() == [3, 3]
  beam = decoding.BeamSearch(fn, 2, 2, 3, BOS, EOS, PAD)
  assert beam.ids.numpy().tolist() == [[C, C, C]] * 2


def testSearchValidatesItsArguments():
  fn = _TableFn({})
  with pytest.raises(ValueError, match='beam_size'):
    decoding.BeamSearch(fn, 1, 0, 4, BOS, EOS)
  with pytest.raises(ValueError, match='max_len'):
    decoding.GreedySearch(fn, 1, 0, BOS, EOS)


def testStripEos():
  assert decoding.StripEos([5, 6, 2, 7, 0], eos_id=2) == [5, 6]
  assert decoding.StripEos([0, 5, 0], eos_id=2) == [5]


# -- On the model --------------------------------------------------------------


@pytest.fixture(scope='module')
def task():
  return mt.TaskParams(num_stages=2, num_micro_batches=2).Instantiate()


def testGreedyEqualsBeamSizeOneOnTheModel(task):
  batch = mt.Batch(seed=3, batch=4)
  greedy = tf.function(
    lambda b: task.Search(
      task.theta, b.src.ids, b.src.paddings, beam_size=1, max_len=6
    ),
    autograph=False,
  )(batch)
  beam = decoding.BeamSearch(
    _ModelFn(task, batch),
    4,
    1,
    6,
    task.params.bos_id,
    task.params.eos_id,
    task.params.pad_id,
    length_normalization=0.6,
  )
  np.testing.assert_array_equal(greedy.ids.numpy(), beam.ids.numpy())
  np.testing.assert_array_equal(greedy.lengths.numpy(), beam.lengths.numpy())
  np.testing.assert_allclose(
    greedy.scores.numpy(), beam.scores.numpy(), rtol=1e-5
  )


def _ModelFn(task, batch):
  enc = task.Encode(task.theta, batch.src.ids, batch.src.paddings)

  def Fn(ids, t):
    logits = task.DecoderLogits(task.theta, enc, ids)
    return tf.nn.log_softmax(logits[:, t, :])

  return Fn


def testGreedyIsTheArgmaxOfTeacherForcedLogits(task):
  batch = mt.Batch(seed=4, batch=3)
  out = task.Search(
    task.theta, batch.src.ids, batch.src.paddings, beam_size=1, max_len=5
  )
  ids = out.ids.numpy()
  dec_in = np.concatenate([np.full([3, 1], task.params.bos_id), ids[:, :-1]], 1)
  enc = task.Encode(task.theta, batch.src.ids, batch.src.paddings)
  logits = task.DecoderLogits(task.theta, enc, dec_in).numpy()
  for r in range(3):
    n = int(out.lengths[r])
    np.testing.assert_array_equal(logits[r, :n].argmax(-1), ids[r, :n])


def testDecodeOutputsAndBeamScores(task):
  batch = mt.Batch(seed=5, batch=4)
  batch.lang = tf.constant([0, 1, 0, 1])
  batch.tgt.text = tf.constant(['a', 'b', 'c', 'd'])
  out = tf.function(task.Decode, autograph=False)(batch)
  assert out.hyp_ids.shape.as_list() == [4, mt.T]
  assert out.hyp_lens.shape.as_list() == [4]
  assert out.lang.numpy().tolist() == [0, 1, 0, 1]
  assert out.ref_text.numpy().tolist() == [b'a', b'b', b'c', b'd']
  beam = task.Search(
    task.theta,
    batch.src.ids,
    batch.src.paddings,
    beam_size=4,
    max_len=mt.T,
  )
  # Beam search finds a hypothesis at least as likely (normalized) as greedy.
  greedy_norm = (
    out.scores.numpy()
    / decoding.LengthPenalty(
      np.minimum(out.hyp_lens.numpy() + 1, mt.T), 0.6
    ).numpy()
  )
  assert np.all(beam.norm_scores.numpy() >= greedy_norm - 1e-4)


class _FakeVocab:
  def Decode(self, ids):
    return ' '.join(f'w{i}' for i in ids)


def testPostProcessReportsBleuPerLanguage(task):
  columns = {
    'hyp_ids': np.array(
      [[5, 6, 9, 9, 2, 0], [5, 7, 9, 9, 2, 0], [8, 9, 10, 11, 2, 0]]
    ),
    'ref_text': np.array(
      [b'w5 w6 w9 w9', b'w5 w6 w9 w9', b'w8 w9 w10 w11'], dtype=object
    ),
    'lang': np.array([0, 0, 1]),
  }
  report = task.PostProcessDecodeOut(
    columns, vocab=_FakeVocab(), languages=['de-en', 'fr-en']
  )
  assert report.hyps == ['w5 w6 w9 w9', 'w5 w7 w9 w9', 'w8 w9 w10 w11']
  assert report.counts == {'de-en': 2, 'fr-en': 1}
  assert report.per_language['fr-en'] == pytest.approx(100.0)
  assert 0 < report.per_language['de-en'] < 100
  assert report.average == pytest.approx(
    (report.per_language['de-en'] + 100.0) / 2
  )
  metrics = report.Metrics()
  assert metrics['bleu'] == report.average and 'bleu_de-en' in metrics
  assert 'de-en' in str(report) and 'average' in str(report)


class _EvalInput:
  """5 sentences in batches of 2, the last padded (weight 0)."""

  def __init__(self):
    self.params = hyperparams.Params()
    self.params.Define('num_epochs', 1, 'Passes over the data.')

  def GetDataset(self):
    return tf.data.Dataset.from_tensor_slices(
      dict(ids=np.arange(6), weight=np.array([1, 1, 1, 1, 1, 0]))
    ).batch(2)


class _EvalTask:
  input_generator = _EvalInput()


def _Decode(batch):
  return nested_map.NestedMap(hyp_ids=batch['ids'] * 10)


def testDecodeColumnsReportsProgress():
  lines = []
  columns = evaluation.DecodeColumns(
    _EvalTask(), decode_fn=_Decode, progress=lines.append, progress_every_s=0
  )
  assert columns['hyp_ids'].tolist() == [0, 10, 20, 30, 40]
  assert [ln.rsplit(', ', 1)[0] for ln in lines] == [
    'decoded batch 1/3 (2 sentences)',
    'decoded batch 2/3 (4 sentences)',
    'decoded batch 3/3 (5 sentences)',
    'decoded 5 sentences in 3 batches',
  ]
  assert all(ln.endswith(' s') for ln in lines)
  # At most one line a minute: only the last one here; max_batches bounds
  # the count.
  lines.clear()
  evaluation.DecodeColumns(
    _EvalTask(),
    max_batches=2,
    decode_fn=_Decode,
    progress=lines.append,
    progress_every_s=60,
  )
  assert [ln.rsplit(', ', 1)[0] for ln in lines] == [
    'decoded 4 sentences in 2 batches'
  ]


# -- BLEU ----------------------------------------------------------------------


def testCorpusBleuMatchesSacrebleu():
  import sacrebleu  # pylint: disable=g-import-not-at-top

  hyps = ['the cat sat on the mat', 'one hundred and two']
  refs = ['the cat sat on a mat', 'one hundred and three']
  expected = sacrebleu.corpus_bleu(hyps, [refs]).score
  assert bleu.CorpusBleu(hyps, refs) == pytest.approx(expected)
  assert bleu.CorpusBleu(refs, refs) == pytest.approx(100.0)
  assert bleu.CorpusBleu(['x y z w'], ['a b c d']) == pytest.approx(0.0)


def testPerLanguageBleuGroupsSentences():
  report = bleu.PerLanguageBleu(
    ['a b c d', 'e f g h', 'x y z w'],
    ['a b c d', 'e f g h', 'a b c d'],
    ['de', 'de', 'fr'],
  )
  assert report.per_language == {
    'de': pytest.approx(100.0),
    'fr': pytest.approx(0.0),
  }
  assert report.average == pytest.approx(50.0)
  with pytest.raises(ValueError, match='one of each'):
    bleu.PerLanguageBleu(['a'], ['a', 'b'])
  with pytest.raises(ValueError, match='no sentences'):
    bleu.CorpusBleu([], [])
