"""Tests for lingvo_gpipe.planning.balance."""

import itertools
import json
import math
import random
import time

import numpy as np
import pytest

from lingvo_gpipe.planning import balance
from lingvo_gpipe.planning import balance_report


def _SumOfSquares(costs, splits):
  return math.fsum(c * c for c in balance._CellCosts(costs, splits))


def _AllSplits(num_layers, num_stages):
  """Every composition of num_layers into num_stages non-empty cells."""
  for inner in itertools.combinations(range(1, num_layers), num_stages - 1):
    yield list(inner) + [num_layers]


def _AssertValidSplits(splits, num_layers, num_stages):
  assert len(splits) == num_stages
  assert splits[-1] == num_layers
  assert all(isinstance(s, int) for s in splits)
  assert all(a < b for a, b in zip([0] + splits[:-1], splits))


# ---------------------------------------------------------------------------
# BalancedSplits: known optima.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  'costs, num_stages, expected',
  [
    ([1] * 8, 4, [2, 4, 6, 8]),
    ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2, [1, 9]),
    # Cells 1+2+3=6, 4, 5 -> 36+16+25=77, better than e.g. [3,4,5]+... .
    ([1, 2, 3, 4, 5], 3, [3, 4, 5]),
    # A heavy middle layer gets a cell of its own.
    ([1, 1, 10, 1, 1], 3, [2, 3, 5]),
    # 2+2 | 4 | 1+1+1+1: every cell costs 4.
    ([2, 2, 4, 1, 1, 1, 1], 3, [2, 3, 7]),
    ([3, 1, 1, 1], 2, [1, 4]),
    ([1, 1, 1, 3], 2, [3, 4]),
    ([5.0, 0.5, 0.5, 2.0, 2.0, 1.0], 3, [1, 4, 6]),
  ],
)
def testBalancedSplitsKnownOptima(costs, num_stages, expected):
  assert balance.BalancedSplits(costs, num_stages) == expected


def testBalancedSplitsHandCheckedAgainstAlternatives():
  costs = [1, 2, 3, 4, 5]
  best = balance.BalancedSplits(costs, 3)
  # Hand check: [3, 4, 5] -> 6, 4, 5 -> 77; [2, 4, 5] -> 3, 7, 5 -> 83;
  # [3, 5, ...] impossible; [2, 3, 5] -> 3, 3, 9 -> 99.
  assert _SumOfSquares(costs, best) == 77
  assert _SumOfSquares(costs, [2, 4, 5]) == 83
  assert _SumOfSquares(costs, [2, 3, 5]) == 99


def testBalancedSplitsTieBreakPrefersEarlierSplits():
  # [1] | [1, 1] and [1, 1] | [1] both give 1 + 4 = 5.
  assert balance.BalancedSplits([1, 1, 1], 2) == [1, 3]
  # Cells of sizes {2, 2, 3, 3} in any order are optimal; the
  # lexicographically smallest split list puts the small cells first.
  assert balance.BalancedSplits([1] * 10, 4) == [2, 4, 7, 10]
  # Zero-cost layers: [0] | [0, 0, 5], [0, 0] | [0, 5], ... all cost 25.
  assert balance.BalancedSplits([0, 0, 0, 5], 2) == [1, 4]


def testBalancedSplitsAcceptsNumpyAndTuples():
  expected = [2, 4, 6, 8]
  assert balance.BalancedSplits(np.ones(8, dtype=np.float32), 4) == expected
  assert balance.BalancedSplits((1,) * 8, np.int64(4)) == expected
  assert balance.BalancedSplits(np.ones(8, dtype=np.int32), 4) == expected


def testBalancedSplitsScaleInvariant():
  rng = random.Random(7)
  costs = [rng.random() for _ in range(30)]
  splits = balance.BalancedSplits(costs, 5)
  for scale in (1e-200, 1e-6, 1e6, 1e200):
    assert balance.BalancedSplits([c * scale for c in costs], 5) == splits


def testBalancedSplitsSingleStage():
  assert balance.BalancedSplits([3, 1, 4, 1, 5], 1) == [5]
  assert balance.BalancedSplits([7], 1) == [1]


def testBalancedSplitsOneLayerPerStage():
  assert balance.BalancedSplits([3, 1, 4, 1, 5], 5) == [1, 2, 3, 4, 5]
  assert balance.BalancedSplits([0, 0, 1], 3) == [1, 2, 3]


def testBalancedSplitsAllZeroFallsBackToUniform():
  assert balance.BalancedSplits([0] * 10, 4) == balance.UniformSplits(10, 4)
  assert balance.BalancedSplits([0.0] * 10, 4) == [3, 6, 8, 10]


# ---------------------------------------------------------------------------
# BalancedSplits: optimality against brute force.
# ---------------------------------------------------------------------------


def _BruteForce(costs, num_stages):
  """Returns (min sum of squares, all optimal splits) by enumeration."""
  scored = [
    (_SumOfSquares(costs, s), s) for s in _AllSplits(len(costs), num_stages)
  ]
  best = min(v for v, _ in scored)
  return best, [s for v, s in scored if v == best]


@pytest.mark.parametrize('seed', range(60))
def testBalancedSplitsMatchesBruteForceRandomFloats(seed):
  rng = random.Random(seed)
  for _ in range(10):
    num_layers = rng.randint(1, 9)
    num_stages = rng.randint(1, min(4, num_layers))
    kind = rng.choice(['uniform', 'lognormal', 'sparse'])
    if kind == 'uniform':
      costs = [rng.random() for _ in range(num_layers)]
    elif kind == 'lognormal':
      costs = [rng.lognormvariate(0.0, 2.0) for _ in range(num_layers)]
    else:
      costs = [
        rng.random() if rng.random() < 0.4 else 0.0 for _ in range(num_layers)
      ]
    splits = balance.BalancedSplits(costs, num_stages)
    _AssertValidSplits(splits, num_layers, num_stages)
    best, _ = _BruteForce(costs, num_stages)
    got = _SumOfSquares(costs, splits)
    assert got <= best * (1 + 1e-9) + 1e-300, (costs, num_stages, splits)


@pytest.mark.parametrize('seed', range(30))
def testBalancedSplitsMatchesBruteForceIntegerTies(seed):
  # Small integer costs produce many exact ties; the result must be the
  # lexicographically smallest optimal split list.
  rng = random.Random(1000 + seed)
  for _ in range(10):
    num_layers = rng.randint(1, 9)
    num_stages = rng.randint(1, min(4, num_layers))
    costs = [rng.randint(0, 3) for _ in range(num_layers)]
    splits = balance.BalancedSplits(costs, num_stages)
    _AssertValidSplits(splits, num_layers, num_stages)
    if sum(costs) == 0:
      assert splits == balance.UniformSplits(num_layers, num_stages)
      continue
    best, optimal = _BruteForce(costs, num_stages)
    assert _SumOfSquares(costs, splits) == best, (costs, num_stages, splits)
    assert splits == min(optimal), (costs, num_stages, splits, optimal)


def testBalancedSplitsMinimizesVariance():
  rng = random.Random(3)
  costs = [rng.random() for _ in range(9)]
  splits = balance.BalancedSplits(costs, 3)
  got = np.var(balance._CellCosts(costs, splits))
  for s in _AllSplits(9, 3):
    assert got <= np.var(balance._CellCosts(costs, s)) + 1e-12


def testBalancedSplitsLarge():
  rng = np.random.RandomState(0)
  costs = rng.lognormal(size=2000)
  start = time.perf_counter()
  splits = balance.BalancedSplits(costs, 16)
  elapsed = time.perf_counter() - start
  _AssertValidSplits(splits, 2000, 16)
  assert elapsed < 30.0  # Generous sanity bound; typically well under 1 s.
  report = balance.MakeReport(costs, splits)
  # A fine-grained random model balances well.
  assert report.imbalance < 1.1
  # Better (in sum of squares) than the uniform split.
  assert _SumOfSquares(costs, splits) <= _SumOfSquares(
    costs, balance.UniformSplits(2000, 16)
  )


def testBalancedSplitsLocallyOptimalOnMediumCase():
  # Moving any single split point by one must not improve the objective.
  rng = random.Random(11)
  costs = [rng.lognormvariate(0.0, 1.0) for _ in range(200)]
  splits = balance.BalancedSplits(costs, 8)
  best = _SumOfSquares(costs, splits)
  for k in range(len(splits) - 1):
    for delta in (-1, 1):
      moved = list(splits)
      moved[k] += delta
      try:
        balance.ValidateSplits(moved, len(costs))
      except ValueError:
        continue
      assert best <= _SumOfSquares(costs, moved) * (1 + 1e-12)


@pytest.mark.parametrize(
  'costs, num_stages, match',
  [
    ([1, 2, 3], 5, 'num_stages=5 but only 3 layers'),
    ([1, 2, 3], 0, 'num_stages=0'),
    ([1, 2, 3], -2, 'num_stages=-2'),
    ([1, 2, 3], 2.0, 'num_stages=2.0'),
    ([1, 2, 3], True, 'num_stages=True'),
    ([1, -2, 3], 2, r'costs\[1\]=-2.0 is negative'),
    ([1, float('nan'), 3], 2, r'costs\[1\]=nan is not finite'),
    ([1, 2, float('inf')], 2, r'costs\[2\]=inf is not finite'),
    ([1, '2', 3], 2, r"costs\[1\]='2'"),
    ([1, None, 3], 2, r'costs\[1\]=None'),
    ([], 1, 'costs is empty'),
    (5, 1, 'costs must be a list'),
    ('abc', 1, 'costs must be a list'),
  ],
)
def testBalancedSplitsValidation(costs, num_stages, match):
  with pytest.raises(ValueError, match=match):
    balance.BalancedSplits(costs, num_stages)


def testBalancedSplitsTooManyStagesSaysHowToFix():
  with pytest.raises(ValueError) as e:
    balance.BalancedSplits([1, 2, 3], 5)
  assert 'use at most 3 stages' in str(e.value)


# ---------------------------------------------------------------------------
# UniformSplits.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  'num_layers, num_stages, expected',
  [
    (8, 4, [2, 4, 6, 8]),
    (10, 4, [3, 6, 8, 10]),
    (7, 3, [3, 5, 7]),
    (5, 1, [5]),
    (5, 5, [1, 2, 3, 4, 5]),
    (1, 1, [1]),
  ],
)
def testUniformSplits(num_layers, num_stages, expected):
  assert balance.UniformSplits(num_layers, num_stages) == expected


def testUniformSplitsSizesDifferByAtMostOne():
  for num_layers in range(1, 30):
    for num_stages in range(1, num_layers + 1):
      splits = balance.UniformSplits(num_layers, num_stages)
      _AssertValidSplits(splits, num_layers, num_stages)
      sizes = [b - a for a, b in balance.SplitsToRanges(splits)]
      assert max(sizes) - min(sizes) <= 1
      assert sizes == sorted(sizes, reverse=True)  # Earlier cells larger.


@pytest.mark.parametrize(
  'num_layers, num_stages, match',
  [
    (3, 4, 'num_stages=4 but only 3 layers'),
    (3, 0, 'num_stages=0'),
    (0, 1, 'num_layers=0'),
    (2.5, 1, 'num_layers=2.5'),
  ],
)
def testUniformSplitsValidation(num_layers, num_stages, match):
  with pytest.raises(ValueError, match=match):
    balance.UniformSplits(num_layers, num_stages)


# ---------------------------------------------------------------------------
# ValidateSplits, SplitsToRanges, RangesToSplits.
# ---------------------------------------------------------------------------


def testValidateSplitsAccepts():
  assert balance.ValidateSplits([2, 4], 4) == [2, 4]
  assert balance.ValidateSplits((1, 3, 4), 4) == [1, 3, 4]
  assert balance.ValidateSplits(np.array([2, 4]), 4) == [2, 4]
  out = balance.ValidateSplits([np.int64(2), 4], 4)
  assert out == [2, 4] and all(type(s) is int for s in out)  # pylint: disable=unidiomatic-typecheck


@pytest.mark.parametrize(
  'splits, num_layers, match',
  [
    ([3, 2, 4], 4, r'not increasing: splits\[1\]=2 < splits\[0\]=3'),
    ([2, 2, 4], 4, r'cell 1 is empty: splits\[1\]=2'),
    ([0, 2, 4], 4, r'cell 0 is empty: splits\[0\]=0'),
    ([2, 3], 4, r'splits\[1\]=3 must equal num_layers=4'),
    ([2, 5], 4, r'splits\[1\]=5 is out of range'),
    ([-1, 4], 4, r'splits\[0\]=-1 is out of range'),
    ([2.0, 4], 4, r'splits\[0\]=2.0 has type float'),
    ([True, 4], 4, r'splits\[0\]=True'),
    (2, 4, r'splits=2 is an int: .*UniformSplits\(4, 2\)'),
    ('24', 4, "splits='24' has type str"),
    ({2: 4}, 4, 'has type dict'),
    ([], 4, 'splits is empty'),
    ([2, 4], 0, 'num_layers=0'),
  ],
)
def testValidateSplitsErrors(splits, num_layers, match):
  with pytest.raises(ValueError, match=match):
    balance.ValidateSplits(splits, num_layers)


def testSplitsToRangesAndBack():
  assert balance.SplitsToRanges([2, 5]) == [(0, 2), (2, 5)]
  assert balance.SplitsToRanges([1]) == [(0, 1)]
  assert balance._RangesToSplits([(0, 2), (2, 5)]) == [2, 5]
  for splits in ([3], [1, 2, 3], [2, 4, 7, 10]):
    assert balance._RangesToSplits(balance.SplitsToRanges(splits)) == splits


@pytest.mark.parametrize(
  'splits, match',
  [
    ([2, 2, 5], 'cell 1 is empty'),
    ([3, 2], 'not increasing'),
    ([], 'splits is empty'),
    ([0], r'splits=\[0\] ends at 0'),
  ],
)
def testSplitsToRangesErrors(splits, match):
  with pytest.raises(ValueError, match=match):
    balance.SplitsToRanges(splits)


@pytest.mark.parametrize(
  'ranges, match',
  [
    ([(1, 2)], r'ranges\[0\]=\(1, 2\) must start at 0'),
    ([(0, 2), (3, 4)], r'ranges\[1\]=\(3, 4\) must start at 2'),
    ([(0, 2), (2, 2)], r'ranges\[1\]=\(2, 2\) is empty'),
    ([(0, 2, 3)], r'ranges\[0\]=\(0, 2, 3\) must be a \(start, end\) pair'),
    ([], 'must be a non-empty list'),
  ],
)
def testRangesToSplitsErrors(ranges, match):
  with pytest.raises(ValueError, match=match):
    balance._RangesToSplits(ranges)


# ---------------------------------------------------------------------------
# CellCosts and MakeReport.
# ---------------------------------------------------------------------------


def testCellCosts():
  assert balance._CellCosts([1, 2, 3, 4, 5], [3, 4, 5]) == [6.0, 4.0, 5.0]
  assert balance._CellCosts([0.1] * 10, [10]) == [1.0]  # fsum is exact here.
  with pytest.raises(ValueError, match='must equal num_layers=5'):
    balance._CellCosts([1, 2, 3, 4, 5], [2, 4])


def _FixedReport():
  # Cells: [1, 2, 3] = 6, [4] = 4, [5, 0] = 5 -> total 15, mean 5, max 6.
  return balance.MakeReport(
    [1, 2, 3, 4, 5, 0],
    [3, 4, 6],
    params=[10, 20, 30, 400, 5, 0],
    names=['embed', 'l1', 'l2', 'l3', 'l4', 'softmax'],
  )


def testMakeReportNumbers():
  r = _FixedReport()
  assert r.num_layers == 6 and r.num_stages == 3
  assert r.splits == [3, 4, 6]
  assert r.total_cost == 15.0
  assert [c.cost for c in r.cells] == [6.0, 4.0, 5.0]
  assert [c.share for c in r.cells] == pytest.approx([0.4, 4 / 15, 1 / 3])
  assert [(c.start, c.end, c.num_layers) for c in r.cells] == [
    (0, 3, 3),
    (3, 4, 1),
    (4, 6, 2),
  ]
  assert [c.params for c in r.cells] == [60, 400, 5]
  assert r.total_params == 465
  assert r.cells[2].names == ['l4', 'softmax']
  assert r.mean_cost == 5.0
  assert r.max_cost == 6.0 and r.min_cost == 4.0
  assert r.imbalance == pytest.approx(1.2)
  assert r.variance == pytest.approx(2 / 3)  # ((1)^2 + (-1)^2 + 0) / 3.
  assert r.ideal_max_cost == 5.0  # max(15 / 3, largest layer 5).
  assert r.efficiency == pytest.approx(5 / 6)


def testMakeReportIdealBoundedByLargestLayer():
  r = balance.MakeReport([10, 1, 1, 1], [1, 2, 3, 4])
  assert r.ideal_max_cost == 10.0
  assert r.imbalance == pytest.approx(10 / 3.25)
  assert r.total_params is None
  assert all(c.params is None and c.names is None for c in r.cells)


def testMakeReportAllZeroCosts():
  r = balance.MakeReport([0, 0, 0, 0], [2, 4])
  assert r.imbalance == 1.0 and r.efficiency == 1.0
  assert [c.share for c in r.cells] == [0.0, 0.0]


def testMakeReportToDictIsJsonable():
  d = _FixedReport().ToDict()
  round_trip = json.loads(json.dumps(d))
  assert round_trip['imbalance'] == pytest.approx(1.2)
  assert round_trip['cells'][0]['names'] == ['embed', 'l1', 'l2']
  assert round_trip['cells'][1]['params'] == 400
  assert round_trip['splits'] == [3, 4, 6]


def testMakeReportToDictIsJsonableWithNumpyInputs():
  r = balance.MakeReport(
    np.array([1.0, 2.0, 3.0]), np.array([1, 3]), params=np.array([1, 2, 3])
  )
  json.dumps(r.ToDict())


def testMakeReportToText():
  text = _FixedReport().ToText()
  lines = text.splitlines()
  assert '6 layers -> 3 cells' in lines[0]
  assert lines[1].split() == [
    'cell',
    'layers',
    '#layers',
    'cost',
    'share',
    'params',
    'names',
  ]
  assert '[0, 3)' in lines[3] and '40.0%' in lines[3]
  assert 'embed, l1, l2' in lines[3]
  assert '[3, 4)' in lines[4] and '26.7%' in lines[4]
  assert 'imbalance (max/mean) 1.200' in text
  assert 'efficiency bound (mean/max) 83.3%' in text
  # Fixed width: all table lines (header, rule, rows) align the share column.
  share_ends = {line.index('%') for line in lines[3:6]}
  assert len(share_ends) == 1


def testMakeReportToTextWithoutOptionalColumnsAndLongNames():
  text = balance.MakeReport([1, 1], [1, 2]).ToText()
  assert 'params' not in text.splitlines()[1]
  assert 'names' not in text.splitlines()[1]
  names = [f'a_very_long_layer_name_{i}' for i in range(10)]
  text = balance.MakeReport([1] * 10, [10], names=names).ToText(
    max_names_width=30
  )
  row = text.splitlines()[3]
  assert row.endswith('...')
  assert len(row.split('  ')[-1]) <= 30


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'params': [1, 2]}, 'params has 2 entries but there are 3 layers'),
    ({'params': [1, -2, 3]}, r'params\[1\]=-2'),
    ({'params': [1, 2.5, 3]}, r'params\[1\]=2.5'),
    ({'names': ['a']}, 'names has 1 entry but there are 3 layers'),
    ({'names': 7}, 'names has type int'),
  ],
)
def testMakeReportValidation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    balance.MakeReport([1, 2, 3], [1, 3], **kwargs)


# ---------------------------------------------------------------------------
# CostsFromMeasurements.
# ---------------------------------------------------------------------------


def testCostsFromMeasurements():
  times = [[1.0, 1.2, 50.0], [2.0], 3.0, (4.0, 5.0), np.array([0.5, 0.7])]
  assert balance.CostsFromMeasurements(times) == pytest.approx(
    [1.2, 2.0, 3.0, 4.5, 0.6]
  )


def testCostsFromMeasurements2DArray():
  times = np.array([[1.0, 3.0, 2.0], [5.0, 4.0, 6.0]])
  assert balance.CostsFromMeasurements(times) == [2.0, 5.0]


def testCostsFromMeasurementsFeedsBalancedSplits():
  times = [[1.0, 1.1, 0.9]] * 4 + [[4.0, 30.0, 4.1]]
  costs = balance.CostsFromMeasurements(times)
  assert balance.BalancedSplits(costs, 2) == [4, 5]


@pytest.mark.parametrize(
  'times, match',
  [
    ([], 'must be a non-empty list'),
    (3.0, 'must be a non-empty list'),
    ([[1.0], []], r'times\[1\] has no samples'),
    ([[1.0, -1.0]], r'times\[0\]\[1\]=-1.0 is negative'),
    ([1.0, float('nan')], r'times\[1\]=nan is not finite'),
    ([[1.0, 'x']], r"times\[0\]\[1\]='x'"),
  ],
)
def testCostsFromMeasurementsValidation(times, match):
  with pytest.raises(ValueError, match=match):
    balance.CostsFromMeasurements(times)


def testPublicApi():
  for name in balance.__all__:
    assert hasattr(balance, name), name


def testReportClassesLiveInBalanceReport():
  assert balance.PartitionReport is balance_report.PartitionReport
  assert balance.CellReport is balance_report.CellReport
  report = balance.MakeReport([1, 2, 3], [1, 3])
  assert isinstance(report, balance_report.PartitionReport)
  assert all(isinstance(c, balance_report.CellReport) for c in report.cells)
  # Names used only by tests are private.
  assert 'CellCosts' not in balance.__all__
  assert 'RangesToSplits' not in balance.__all__


# ---------------------------------------------------------------------------
# MemorySplits: the fullest device holds the least.
# ---------------------------------------------------------------------------


def testMemorySplitsWithoutStoredInputsBalancesLayers():
  assert balance.MemorySplits([4, 4, 4, 4], [0, 0, 0, 0], 2) == [2, 4]
  assert balance.MemorySplits([4, 4, 4, 4], [0, 0, 0, 0], 1) == [4]
  assert balance.MemorySplits([4, 4, 4, 4], [0, 0, 0, 0], 4) == [1, 2, 3, 4]


def testMemorySplitsCountsTheInputACellStores():
  # Splitting after layer 2 would store 6 bytes on the second device
  # (max(8, 14) = 14); after layer 1: max(4, 13); after layer 3: max(12, 4).
  layer_bytes, input_bytes = [4, 4, 4, 4], [0, 1, 6, 0]
  assert balance.BalancedSplits(layer_bytes, 2) == [2, 4]
  assert balance.MemorySplits(layer_bytes, input_bytes, 2) == [3, 4]
  assert balance.MemoryCellBytes(layer_bytes, input_bytes, [3, 4]) == [12, 4]
  assert balance.MemoryCellBytes(layer_bytes, input_bytes, [2, 4]) == [8, 14]


def testMemorySplitsAmoebaNetLikeModel():
  # Balancing the layer sums alone gives [3, 6] (24 and 18), but a cell
  # starting at layer 3 stores a large input (12): 25 and 30. Starting the
  # second cell at layer 2 (input 2) gives 18 and 27.
  layer_bytes = [9, 8, 7, 6, 6, 6]
  input_bytes = [1, 10, 2, 12, 3, 3]
  assert balance.BalancedSplits(layer_bytes, 2) == [3, 6]
  assert balance.MemoryCellBytes(layer_bytes, input_bytes, [3, 6]) == [25, 30]
  splits = balance.MemorySplits(layer_bytes, input_bytes, 2)
  assert splits == [2, 6]
  assert balance.MemoryCellBytes(layer_bytes, input_bytes, splits) == [18, 27]


@pytest.mark.parametrize('seed', range(30))
def testMemorySplitsIsOptimalByBruteForce(seed):
  rng = random.Random(seed)
  n = rng.randint(1, 7)
  k = rng.randint(1, n)
  layer_bytes = [rng.randint(0, 9) for _ in range(n)]
  input_bytes = [rng.randint(0, 9) for _ in range(n)]
  got = balance.MemorySplits(layer_bytes, input_bytes, k)
  _AssertValidSplits(got, n, k)

  def Key(splits):
    cells = balance.MemoryCellBytes(layer_bytes, input_bytes, splits)
    return (max(cells), sum(c * c for c in cells), splits)

  assert Key(got) == min(Key(s) for s in _AllSplits(n, k))


def testMemorySplitsErrors():
  with pytest.raises(ValueError, match='input_bytes has 2 entries but'):
    balance.MemorySplits([1, 2, 3], [0, 0], 2)
  with pytest.raises(ValueError, match=r'input_bytes\[1\]=-1.0 is negative'):
    balance.MemorySplits([1, 2], [0, -1], 2)
  with pytest.raises(ValueError, match='num_stages=3 but only 2 layers'):
    balance.MemorySplits([1, 2], [0, 0], 3)
