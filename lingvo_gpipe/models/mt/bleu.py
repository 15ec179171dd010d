"""BLEU per language with sacrebleu (detokenized text, its 13a tokenizer).

  report = PerLanguageBleu(hyps, refs, langs=['de', 'de', 'fr', ...])
  report.per_language     {'de': 41.2, 'fr': 37.9, ...}
  report.average          the mean of the per-language scores (every
                          language counts the same, as in the paper's plots)
  report.corpus           one corpus BLEU over all sentences
  print(report)           a table

Scores are sacrebleu's corpus BLEU on a 0..100 scale.
"""

import collections
import dataclasses

__all__ = ['CorpusBleu', 'PerLanguageBleu', 'BleuReport']


def CorpusBleu(hyps, refs):
  """sacrebleu corpus BLEU (0..100) of hypothesis/reference strings."""
  import sacrebleu  # pylint: disable=g-import-not-at-top

  if len(hyps) != len(refs):
    raise ValueError(
      f'CorpusBleu: {len(hyps)} hypotheses but {len(refs)} '
      'references; they must pair up one to one.'
    )
  if not hyps:
    raise ValueError('CorpusBleu: no sentences to score.')
  return float(sacrebleu.corpus_bleu(list(hyps), [list(refs)]).score)


@dataclasses.dataclass
class BleuReport:
  """BLEU of one evaluation: per language, their mean, the whole corpus."""

  per_language: dict
  counts: dict
  average: float
  corpus: float
  hyps: list
  refs: list
  langs: list

  def Metrics(self):
    """{'bleu': average, 'corpus_bleu': ..., 'bleu_<lang>': ...}."""
    out = {'bleu': self.average, 'corpus_bleu': self.corpus}
    out.update({f'bleu_{k}': v for k, v in self.per_language.items()})
    return out

  def __str__(self):
    lines = [f'{"language":<10} {"sentences":>9} {"BLEU":>6}']
    for lang in sorted(self.per_language):
      lines.append(
        f'{lang:<10} {self.counts[lang]:>9d} {self.per_language[lang]:>6.2f}'
      )
    lines.append(
      f'{"average":<10} {sum(self.counts.values()):>9d} {self.average:>6.2f}'
    )
    lines.append(f'{"corpus":<10} {"":>9} {self.corpus:>6.2f}')
    return '\n'.join(lines)


def PerLanguageBleu(hyps, refs, langs=None):
  """BLEU per language (`langs[i]` of sentence i; None: one language 'all')."""
  hyps, refs = list(hyps), list(refs)
  if langs is None:
    langs = ['all'] * len(hyps)
  langs = list(langs)
  if not len(hyps) == len(refs) == len(langs):
    raise ValueError(
      f'PerLanguageBleu: {len(hyps)} hypotheses, {len(refs)} '
      f'references and {len(langs)} languages; give one of '
      'each per sentence.'
    )
  groups = collections.defaultdict(lambda: ([], []))
  for h, r, lang in zip(hyps, refs, langs):
    groups[lang][0].append(h)
    groups[lang][1].append(r)
  per_language = {lang: CorpusBleu(h, r) for lang, (h, r) in groups.items()}
  counts = {lang: len(h) for lang, (h, _) in groups.items()}
  average = sum(per_language.values()) / len(per_language)
  return BleuReport(
    per_language=dict(sorted(per_language.items())),
    counts=dict(sorted(counts.items())),
    average=average,
    corpus=CorpusBleu(hyps, refs),
    hyps=hyps,
    refs=refs,
    langs=langs,
  )
