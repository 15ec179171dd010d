"""Balanced partitioning of a layer sequence into pipeline cells.

GPipe splits a sequence of L layers into K contiguous, non-empty cells, one per
accelerator. The GPipe paper: "the partitioning algorithm minimizes the
variance in the estimated costs of all cells". The total cost is fixed, so
minimizing the variance of the K cell costs is the same as minimizing the sum
of their squares, which `BalancedSplits` does exactly by dynamic programming.

Split points follow Lingvo's convention of "end indices": `splits` is a list of
K strictly increasing ints whose last entry is L, and cell k holds layers
`[splits[k - 1], splits[k])` with `splits[-1] := 0`. For example 8 layers in 4
cells of 2 layers each are `[2, 4, 6, 8]`.

Example:

  costs = CostsFromMeasurements(per_layer_time_samples)
  splits = BalancedSplits(costs, num_stages=4)
  print(MakeReport(costs, splits, names=layer_names).ToText())

The report's dataclasses (`PartitionReport`, `CellReport`) and their
formatting live in `balance_report` and are re-exported here.

This module is pure Python plus numpy so that it can be used (and tested)
without TensorFlow.
"""

import math
import numbers
import statistics
from collections.abc import Sequence

import numpy as np

from lingvo_gpipe.planning.balance_report import CellReport
from lingvo_gpipe.planning.balance_report import PartitionReport

__all__ = [
  'BalancedSplits',
  'CellReport',
  'CostsFromMeasurements',
  'MakeReport',
  'MemoryCellBytes',
  'MemorySplits',
  'PartitionReport',
  'SplitsToRanges',
  'UniformSplits',
  'ValidateSplits',
]

# Two candidate partitions whose objectives (on costs normalized to a total of
# 1, so objectives lie in [1/K, 1]) differ by at most this much are ties.
_TIE_TOLERANCE = 1e-12

# Upper bound on the number of float64 entries of one block of the dynamic
# programming table computed at once (16 MiB).
_BLOCK_ENTRIES = 1 << 21


def _IsInt(x):
  """True for Python and numpy ints, False for bools."""
  return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _IsReal(x):
  """True for Python and numpy ints and floats, False for bools."""
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _IsSequenceLike(x):
  """True for lists, tuples, numpy arrays and ranges, not for str/bytes/dict."""
  if isinstance(x, (str, bytes, dict, set, frozenset)):
    return False
  if isinstance(x, np.ndarray):
    return x.ndim >= 1
  return isinstance(x, Sequence)


def _ValidateCosts(costs, name='costs'):
  """Checks per-layer costs and returns them as a list of Python floats.

  Args:
    costs: a non-empty sequence of finite, non-negative real numbers.
    name: how to call the argument in error messages.

  Returns:
    A list of floats, one per layer.

  Raises:
    ValueError: if `costs` is not a non-empty sequence of finite, non-negative
      real numbers.
  """
  if not _IsSequenceLike(costs):
    raise ValueError(
      f'{name} must be a list of per-layer costs (numbers), got '
      f'{type(costs).__name__} {costs!r}: pass one cost per layer, e.g. '
      f'[1.0, 2.5, 1.0].'
    )
  if len(costs) == 0:  # pylint: disable=g-explicit-length-test
    raise ValueError(
      f'{name} is empty: pass one cost per layer (at least one layer).'
    )
  return [_ValidateCost(c, f'{name}[{i}]') for i, c in enumerate(costs)]


def _ValidateCost(c, label):
  """Checks one cost (finite, >= 0 real number) and returns it as a float."""
  if not _IsReal(c):
    raise ValueError(
      f'{label}={c!r} has type {type(c).__name__}: per-layer costs must be '
      f'real numbers (int or float), e.g. FLOPs or seconds.'
    )
  c = float(c)
  if not math.isfinite(c):
    raise ValueError(
      f'{label}={c!r} is not finite: per-layer costs must be finite; '
      f'replace NaN/inf estimates with a real estimate.'
    )
  if c < 0:
    raise ValueError(f'{label}={c!r} is negative: costs must be >= 0.')
  return c


def _ValidateNumStages(num_stages, num_layers):
  """Checks that 1 <= num_stages <= num_layers."""
  if not _IsInt(num_stages):
    raise ValueError(
      f'num_stages={num_stages!r} has type {type(num_stages).__name__}: '
      f'pass a positive int.'
    )
  num_stages = int(num_stages)
  if num_stages < 1:
    raise ValueError(
      f'num_stages={num_stages} must be >= 1: use at least one stage.'
    )
  if num_stages > num_layers:
    raise ValueError(
      f'num_stages={num_stages} but only {num_layers} layers: use at most '
      f'{num_layers} stages or split layers finer (every cell needs at '
      f'least one layer).'
    )
  return num_stages


def UniformSplits(num_layers, num_stages):
  """Splits `num_layers` layers into `num_stages` cells of near-equal size.

  Cell sizes differ by at most one; when `num_layers` is not divisible by
  `num_stages` the earlier cells get the extra layer.

  Args:
    num_layers: the number of layers L >= 1.
    num_stages: the number of cells K, 1 <= K <= L.

  Returns:
    The K end indices (Lingvo convention), e.g. `UniformSplits(10, 4)` is
    `[3, 6, 8, 10]`.

  Raises:
    ValueError: if `num_layers` is not a positive int or `num_stages` is not
      an int in [1, num_layers].
  """
  if not _IsInt(num_layers) or num_layers < 1:
    raise ValueError(
      f'num_layers={num_layers!r} must be a positive int: a pipeline needs '
      f'at least one layer.'
    )
  num_layers = int(num_layers)
  num_stages = _ValidateNumStages(num_stages, num_layers)
  base, extra = divmod(num_layers, num_stages)
  splits = []
  end = 0
  for k in range(num_stages):
    end += base + (1 if k < extra else 0)
    splits.append(end)
  return splits


def BalancedSplits(costs, num_stages):
  """Splits layers into cells minimizing the variance of the cell costs.

  Finds the K contiguous, non-empty cells whose costs have the smallest sum of
  squares (equivalently, the smallest variance, as the total is fixed). The
  optimum is exact, found by dynamic programming in O(K L^2) time (vectorized
  with numpy; L=2000, K=16 takes well under a second) and O(K L) memory.

  Ties: among all optimal partitions (objectives equal up to a relative
  tolerance of 1e-12 of the squared total) the lexicographically smallest
  `splits` list is returned, i.e. each split point is as early as possible
  given the earlier ones. For example `[1, 1, 1]` in 2 cells gives `[1, 3]`.
  Note that this may differ from `UniformSplits`, which gives the extra layers
  to the earlier cells, when the costs are all equal and K does not divide L.

  If all costs are zero, every partition is optimal and `UniformSplits(L, K)`
  is returned.

  Args:
    costs: per-layer costs c_0..c_{L-1} (finite, >= 0), e.g. FLOPs or
      measured seconds; a list, tuple or 1-D numpy array.
    num_stages: the number of cells K, 1 <= K <= L.

  Returns:
    The K end indices (Lingvo convention): strictly increasing, the last is L;
    cell k holds layers [splits[k-1], splits[k]) with splits[-1] := 0.

  Raises:
    ValueError: if a cost is negative, not finite or not a number, or if
      `num_stages` is not an int in [1, L].
  """
  costs = _ValidateCosts(costs)
  num_layers = len(costs)
  num_stages = _ValidateNumStages(num_stages, num_layers)
  total = math.fsum(costs)
  if total == 0.0:
    return UniformSplits(num_layers, num_stages)
  if num_stages == 1:
    return [num_layers]
  if num_stages == num_layers:
    return list(range(1, num_layers + 1))

  # Normalize to a total of 1: avoids overflow when squaring and makes the tie
  # tolerance scale-free.
  prefix = np.zeros(num_layers + 1, dtype=np.float64)
  prefix[1:] = np.cumsum(np.asarray(costs, dtype=np.float64) / total)
  prefix[-1] = 1.0

  # best[r, i]: the smallest sum of squares splitting layers [i, L) into r
  # cells. Only i in [K - r, L - r] matter (r cells need r layers and the K - r
  # cells before need K - r layers).
  best = np.full((num_stages + 1, num_layers + 1), np.inf)
  best[1, :num_layers] = np.square(1.0 - prefix[:num_layers])
  for r in range(2, num_stages + 1):
    prev = best[r - 1]
    i_lo = num_stages - r if r < num_stages else 0
    # Inclusive; with all K cells left only i = 0 (the whole model) matters.
    i_hi = num_layers - r if r < num_stages else 0
    j_hi = num_layers - r + 1  # Inclusive: the last start of r - 1 cells.
    cols = np.arange(i_lo + 1, j_hi + 1)
    block = max(1, _BLOCK_ENTRIES // max(1, len(cols)))
    for a in range(i_lo, i_hi + 1, block):
      b = min(a + block, i_hi + 1)
      rows = np.arange(a, b)
      # Columns j <= a cannot follow any row in this block.
      c0 = a + 1 - (i_lo + 1)
      sub_cols = cols[c0:]
      diff = prefix[sub_cols][None, :] - prefix[rows][:, None]
      vals = np.square(diff) + prev[sub_cols][None, :]
      vals[sub_cols[None, :] <= rows[:, None]] = np.inf
      best[r, a:b] = vals.min(axis=1)

  # Reconstruct forward, taking the earliest split that stays optimal.
  splits = []
  i = 0
  for r in range(num_stages, 1, -1):
    js = np.arange(i + 1, num_layers - r + 2)
    vals = np.square(prefix[js] - prefix[i]) + best[r - 1, js]
    target = best[r, i] + _TIE_TOLERANCE
    i = int(js[np.flatnonzero(vals <= target)[0]])
    splits.append(i)
  splits.append(num_layers)
  return splits


def ValidateSplits(splits, num_layers):
  """Checks user-given split points and returns them as a list of ints.

  Args:
    splits: K end indices (Lingvo convention): a list or tuple of strictly
      increasing ints in [1, num_layers] whose last entry is num_layers.
    num_layers: the number of layers L >= 1.

  Returns:
    `splits` as a new list of Python ints.

  Raises:
    ValueError: if `splits` is not a list/tuple of ints, an entry is out of
      range, the entries are not increasing, a cell would be empty, or the
      last entry is not `num_layers`.
  """
  if not _IsInt(num_layers) or num_layers < 1:
    raise ValueError(
      f'num_layers={num_layers!r} must be a positive int: a pipeline needs '
      f'at least one layer.'
    )
  num_layers = int(num_layers)
  if _IsInt(splits):
    raise ValueError(
      f'splits={splits!r} is an int: pass a list of end indices, e.g. '
      f'UniformSplits({num_layers}, {int(splits)}) or BalancedSplits(costs, '
      f'{int(splits)}) for {int(splits)} cells.'
    )
  if not isinstance(splits, (list, tuple, np.ndarray)) or (
    isinstance(splits, np.ndarray) and splits.ndim != 1
  ):
    raise ValueError(
      f'splits={splits!r} has type {type(splits).__name__}: pass a list of '
      f'increasing end indices whose last entry is num_layers={num_layers}, '
      f'e.g. [2, 4] for 4 layers in 2 cells.'
    )
  if len(splits) == 0:  # pylint: disable=g-explicit-length-test
    raise ValueError(
      f'splits is empty: pass at least one end index; the last must be '
      f'num_layers={num_layers}, e.g. [{num_layers}] for a single cell.'
    )
  result = []
  for k, s in enumerate(splits):
    if not _IsInt(s):
      raise ValueError(
        f'splits[{k}]={s!r} has type {type(s).__name__}: split points must '
        f'be ints (layer end indices).'
      )
    s = int(s)
    if s < 0 or s > num_layers:
      raise ValueError(
        f'splits[{k}]={s} is out of range: split points must lie in '
        f'[1, num_layers={num_layers}] (splits={list(splits)!r}).'
      )
    prev = result[-1] if result else 0
    if s == prev:
      raise ValueError(
        f'cell {k} is empty: splits[{k}]={s} equals the previous split '
        f'point {prev} (splits={list(splits)!r}); every cell needs at least '
        f'one layer, so remove the duplicate or use fewer cells.'
      )
    if s < prev:
      raise ValueError(
        f'splits are not increasing: splits[{k}]={s} < splits[{k - 1}]='
        f'{prev} (splits={list(splits)!r}); pass strictly increasing end '
        f'indices.'
      )
    result.append(s)
  if result[-1] != num_layers:
    raise ValueError(
      f'the last split point splits[{len(result) - 1}]={result[-1]} must '
      f'equal num_layers={num_layers}: layers [{result[-1]}, {num_layers}) '
      f'are in no cell; append {num_layers} or set the last entry to '
      f'{num_layers}.'
    )
  return result


def SplitsToRanges(splits):
  """Converts end indices to per-cell `(start, end)` layer ranges.

  Args:
    splits: K end indices (Lingvo convention), strictly increasing, positive.

  Returns:
    A list of K `(start, end)` tuples; cell k holds layers [start, end).
    `SplitsToRanges([2, 5])` is `[(0, 2), (2, 5)]`.

  Raises:
    ValueError: if `splits` is not valid (see `ValidateSplits`).
  """
  # The number of layers is implied by the (largest) end index; any problem
  # with `splits` is reported by ValidateSplits below.
  ints = (
    [int(s) for s in splits if _IsInt(s)] if _IsSequenceLike(splits) else []
  )
  num_layers = max(ints) if ints else 1
  if num_layers < 1:
    raise ValueError(
      f'splits={list(splits)!r} ends at {num_layers}: the last end index is '
      f'the number of layers and must be >= 1.'
    )
  splits = ValidateSplits(splits, num_layers)
  return list(zip([0] + splits[:-1], splits))


def _RangesToSplits(ranges):
  """Converts per-cell `(start, end)` layer ranges to end indices.

  Args:
    ranges: a list of K `(start, end)` pairs of ints that tile [0, L): the
      first starts at 0, each starts where the previous ends, none is empty.

  Returns:
    The K end indices (Lingvo convention).

  Raises:
    ValueError: if the ranges do not tile [0, L) with non-empty cells.
  """
  if not _IsSequenceLike(ranges) or len(ranges) == 0:
    raise ValueError(
      f'ranges={ranges!r} must be a non-empty list of (start, end) pairs, '
      f'e.g. [(0, 2), (2, 5)].'
    )
  splits = []
  prev_end = 0
  for k, r in enumerate(ranges):
    if (
      not _IsSequenceLike(r)
      or len(r) != 2
      or not _IsInt(r[0])
      or not _IsInt(r[1])
    ):
      raise ValueError(
        f'ranges[{k}]={r!r} must be a (start, end) pair of ints.'
      )
    start, end = int(r[0]), int(r[1])
    if start != prev_end:
      raise ValueError(
        f'ranges[{k}]=({start}, {end}) must start at {prev_end}, where the '
        f'previous cell ends: cells must be contiguous and start at 0.'
      )
    if end <= start:
      raise ValueError(
        f'ranges[{k}]=({start}, {end}) is empty: cell {k} needs end > '
        f'start (at least one layer).'
      )
    splits.append(end)
    prev_end = end
  return splits


def _CellCosts(costs, splits):
  """Sums the per-layer costs of each cell.

  Args:
    costs: per-layer costs (finite, >= 0), one per layer.
    splits: K end indices (Lingvo convention) for `len(costs)` layers.

  Returns:
    A list of K floats, the cost of each cell (summed with `math.fsum`).

  Raises:
    ValueError: if `costs` or `splits` is invalid.
  """
  costs = _ValidateCosts(costs)
  splits = ValidateSplits(splits, len(costs))
  return [math.fsum(costs[a:b]) for a, b in zip([0] + splits[:-1], splits)]


def MakeReport(costs, splits, params=None, names=None) -> PartitionReport:
  """Reports how well `splits` balances `costs`.

  Args:
    costs: per-layer costs (finite, >= 0), one per layer.
    splits: K end indices (Lingvo convention) for `len(costs)` layers.
    params: optional per-layer parameter counts (non-negative ints), summed
      per cell.
    names: optional per-layer names (strings), listed per cell.

  Returns:
    A `PartitionReport`.

  Raises:
    ValueError: if an argument is invalid or `params`/`names` do not have one
      entry per layer.
  """
  costs = _ValidateCosts(costs)
  num_layers = len(costs)
  splits = ValidateSplits(splits, num_layers)
  num_stages = len(splits)
  if params is not None:
    if not _IsSequenceLike(params) or len(params) != num_layers:
      raise ValueError(
        f'params has {_LenOrType(params)} but there are {num_layers} layers:'
        f' pass one parameter count per layer.'
      )
    for i, p in enumerate(params):
      if not _IsInt(p) or p < 0:
        raise ValueError(
          f'params[{i}]={p!r} must be a non-negative int (a parameter count).'
        )
    params = [int(p) for p in params]
  if names is not None:
    if not _IsSequenceLike(names) or len(names) != num_layers:
      raise ValueError(
        f'names has {_LenOrType(names)} but there are {num_layers} layers: '
        f'pass one name per layer.'
      )
    names = [str(n) for n in names]

  total = math.fsum(costs)
  cells = []
  for k, (a, b) in enumerate(zip([0] + splits[:-1], splits)):
    cost = math.fsum(costs[a:b])
    cells.append(
      CellReport(
        index=k,
        start=a,
        end=b,
        num_layers=b - a,
        cost=cost,
        share=cost / total if total > 0 else 0.0,
        params=sum(params[a:b]) if params is not None else None,
        names=names[a:b] if names is not None else None,
      )
    )
  cell_costs = [c.cost for c in cells]
  mean = total / num_stages
  max_cost = max(cell_costs)
  variance = math.fsum((c - mean) ** 2 for c in cell_costs) / num_stages
  return PartitionReport(
    num_layers=num_layers,
    num_stages=num_stages,
    splits=splits,
    total_cost=total,
    cells=cells,
    mean_cost=mean,
    max_cost=max_cost,
    min_cost=min(cell_costs),
    imbalance=max_cost / mean if mean > 0 else 1.0,
    variance=variance,
    ideal_max_cost=max(mean, max(costs)),
    efficiency=mean / max_cost if max_cost > 0 else 1.0,
    total_params=sum(params) if params is not None else None,
  )


def _LenOrType(x):
  if _IsSequenceLike(x):
    return f'{len(x)} entr' + ('y' if len(x) == 1 else 'ies')
  return f'type {type(x).__name__}'


def CostsFromMeasurements(times):
  """Turns measured per-layer times into per-layer costs.

  Each layer's cost is the median of its samples, which is robust to the
  occasional slow outlier (a cold cache, a host hiccup).

  Args:
    times: one entry per layer; each entry is either a single time (a number)
      or a non-empty sequence of time samples. A 2-D numpy array of shape
      [num_layers, num_samples] works too. Times must be finite and >= 0.

  Returns:
    A list of floats, the median time of each layer.

  Raises:
    ValueError: if `times` is empty, a layer has no samples, or a sample is
      not a finite, non-negative number.
  """
  if not _IsSequenceLike(times) or len(times) == 0:
    raise ValueError(
      f'times={times!r} must be a non-empty list with one entry per layer '
      f'(a number or a list of samples).'
    )
  result = []
  for i, t in enumerate(times):
    if _IsSequenceLike(t):
      if len(t) == 0:
        raise ValueError(
          f'times[{i}] has no samples: measure layer {i} at least once.'
        )
      samples = _ValidateCosts(t, name=f'times[{i}]')
      result.append(float(statistics.median(samples)))
    else:
      result.append(_ValidateCost(t, f'times[{i}]'))
  return result


def MemoryCellBytes(layer_bytes, input_bytes, splits):
  """The estimated peak bytes of each cell's device.

  Cell k, layers [a, b), holds `input_bytes[a] + sum(layer_bytes[a:b])`: what
  its layers hold (weights, gradients, optimizer slots, live activations)
  plus the input it stores for every micro-batch, which depends on where the
  cell starts.

  Args:
    layer_bytes: per-layer bytes (finite, >= 0), one per layer.
    input_bytes: per-layer bytes (finite, >= 0) a cell starting at that
      layer stores, one per layer.
    splits: K end indices (Lingvo convention) for `len(layer_bytes)` layers.

  Returns:
    A list of K floats.

  Raises:
    ValueError: if an argument is invalid.
  """
  layer_bytes, input_bytes = _ValidateMemory(layer_bytes, input_bytes)
  splits = ValidateSplits(splits, len(layer_bytes))
  return [
    input_bytes[a] + math.fsum(layer_bytes[a:b])
    for a, b in zip([0] + splits[:-1], splits)
  ]


def _ValidateMemory(layer_bytes, input_bytes):
  layer_bytes = _ValidateCosts(layer_bytes, name='layer_bytes')
  input_bytes = _ValidateCosts(input_bytes, name='input_bytes')
  if len(input_bytes) != len(layer_bytes):
    raise ValueError(
      f'input_bytes has {len(input_bytes)} entries but layer_bytes has '
      f'{len(layer_bytes)}: pass one entry per layer in both (input_bytes[i] '
      'is what a cell starting at layer i stores).'
    )
  return layer_bytes, input_bytes


def MemorySplits(layer_bytes, input_bytes, num_stages):
  """Splits layers into cells so that the fullest device holds the least.

  A pipeline fits when every device fits, so the split minimizes the largest
  cell's `MemoryCellBytes` (exactly, by dynamic programming in O(K L^2)).
  Among the splits with that smallest maximum (up to a relative 1e-9) it
  picks the one with the smallest sum of squared cell bytes, and among
  those the lexicographically smallest.

  Unlike `BalancedSplits` a cell's bytes are not the sum of its layers': a
  cell also stores its input for every micro-batch, and that input depends
  on the layer the cell starts at (`input_bytes`).

  Args:
    layer_bytes: per-layer bytes (finite, >= 0) that a layer adds to its
      cell's device, e.g. weight bytes x (1 + gradient + optimizer slots)
      plus its activations for one micro-batch.
    input_bytes: per-layer bytes (finite, >= 0) that a cell starting at that
      layer stores: its input for all micro-batches.
    num_stages: the number of cells K, 1 <= K <= L.

  Returns:
    The K end indices (Lingvo convention).

  Raises:
    ValueError: if a value is negative, not finite or not a number, the two
      lists differ in length, or `num_stages` is not an int in [1, L].
  """
  layer_bytes, input_bytes = _ValidateMemory(layer_bytes, input_bytes)
  n = len(layer_bytes)
  num_stages = _ValidateNumStages(num_stages, n)
  if num_stages == 1:
    return [n]
  if num_stages == n:
    return list(range(1, n + 1))
  scale = max(math.fsum(layer_bytes) + max(input_bytes), 1e-300)
  prefix = np.zeros(n + 1, dtype=np.float64)
  prefix[1:] = np.cumsum(np.asarray(layer_bytes, np.float64) / scale)
  inputs = np.asarray(input_bytes, np.float64) / scale
  idx = np.arange(n + 1)
  # cost[i, j]: cell [i, j) (j > i), inf elsewhere.
  cost = inputs[:, None] + prefix[None, :] - prefix[:n, None]
  cost[idx[None, :] <= idx[:n, None]] = np.inf

  # Pass 1: the smallest largest cell. worst[r, i]: layers [i, n) in r cells.
  worst = np.full((num_stages + 1, n + 1), np.inf)
  worst[1, :n] = cost[:, n]
  for r in range(2, num_stages + 1):
    worst[r, :n] = np.min(np.maximum(cost, worst[r - 1][None, :]), axis=1)
  bound = worst[num_stages, 0] * (1 + 1e-9) + 1e-15

  # Pass 2: the smallest sum of squares among cells within the bound.
  sq = np.where(cost <= bound, np.square(cost), np.inf)
  best = np.full((num_stages + 1, n + 1), np.inf)
  best[1, :n] = sq[:, n]
  for r in range(2, num_stages + 1):
    best[r, :n] = np.min(sq + best[r - 1][None, :], axis=1)
  splits, i = [], 0
  for r in range(num_stages, 1, -1):
    vals = sq[i] + best[r - 1]
    target = best[r, i] + 1e-12
    i = int(np.flatnonzero(vals <= target)[0])
    splits.append(i)
  splits.append(n)
  return splits
