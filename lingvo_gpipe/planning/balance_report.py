"""The report of how well a partition balances a pipeline's cells.

`balance.MakeReport` computes a `PartitionReport` (one `CellReport` per cell);
this module holds the two dataclasses and their text and dict formatting, so
that `balance` keeps only the partitioning arithmetic. Both names are
re-exported from `balance`.
"""

import dataclasses
from typing import Any

__all__ = [
  'CellReport',
  'PartitionReport',
]


@dataclasses.dataclass
class CellReport:
  """Statistics of one pipeline cell.

  Attributes:
    index: the cell index k.
    start: the first layer of the cell.
    end: one past the last layer of the cell.
    num_layers: end - start.
    cost: the summed cost of the cell's layers.
    share: cost / total cost (0 when the total is 0).
    params: the summed parameter count of the cell's layers, or None.
    names: the names of the cell's layers, or None.
  """

  index: int
  start: int
  end: int
  num_layers: int
  cost: float
  share: float
  params: int | None = None
  names: list[str] | None = None


@dataclasses.dataclass
class PartitionReport:
  """How well a partition of layers into pipeline cells is balanced.

  Attributes:
    num_layers: L.
    num_stages: K.
    splits: the K end indices (Lingvo convention).
    total_cost: the sum of all layer costs.
    cells: one `CellReport` per cell.
    mean_cost: total_cost / K.
    max_cost: the largest cell cost; the pipeline runs at its pace.
    min_cost: the smallest cell cost.
    imbalance: max_cost / mean_cost (1.0 is perfect; 1.0 if the total is 0).
    variance: the population variance of the cell costs.
    ideal_max_cost: a lower bound on max_cost over all partitions:
      max(total_cost / K, largest single layer cost).
    efficiency: mean_cost / max_cost, the fraction of device time doing work
      in a bubble-free pipeline (1.0 if the total is 0).
    total_params: the summed parameter count, or None.
  """

  num_layers: int
  num_stages: int
  splits: list[int]
  total_cost: float
  cells: list[CellReport]
  mean_cost: float
  max_cost: float
  min_cost: float
  imbalance: float
  variance: float
  ideal_max_cost: float
  efficiency: float
  total_params: int | None = None

  def ToDict(self) -> dict[str, Any]:
    """Returns the report as a JSON-serializable dict."""
    return dataclasses.asdict(self)

  def ToText(self, max_names_width=40) -> str:
    """Returns the report as a fixed-width table.

    Args:
      max_names_width: layer names of a cell are joined with ', ' and cut to
        this many characters.

    Returns:
      A multi-line string (no trailing newline).
    """
    has_params = self.total_params is not None
    has_names = any(c.names is not None for c in self.cells)
    header = ['cell', 'layers', '#layers', 'cost', 'share']
    if has_params:
      header.append('params')
    if has_names:
      header.append('names')
    rows = []
    for c in self.cells:
      row = [
        str(c.index),
        f'[{c.start}, {c.end})',
        str(c.num_layers),
        _FormatNumber(c.cost),
        f'{100.0 * c.share:.1f}%',
      ]
      if has_params:
        row.append(f'{c.params:,}')
      if has_names:
        row.append(_Truncate(', '.join(c.names or []), max_names_width))
      rows.append(row)
    widths = [
      max(len(r[i]) for r in [header] + rows) for i in range(len(header))
    ]
    # Right-align numbers, left-align the layer range and names.
    left = {1, len(header) - 1} if has_names else {1}

    def _Line(row):
      parts = [
        cell.ljust(w) if i in left else cell.rjust(w)
        for i, (cell, w) in enumerate(zip(row, widths))
      ]
      return '  '.join(parts).rstrip()

    lines = [
      f'Pipeline partition: {self.num_layers} layers -> {self.num_stages} '
      f'cells, total cost {_FormatNumber(self.total_cost)}'
      + (f', {self.total_params:,} params' if has_params else ''),
      _Line(header),
      _Line(['-' * w for w in widths]),
    ]
    lines.extend(_Line(r) for r in rows)
    lines.append(
      f'max cell cost {_FormatNumber(self.max_cost)}, mean '
      f'{_FormatNumber(self.mean_cost)}, ideal max >= '
      f'{_FormatNumber(self.ideal_max_cost)}'
    )
    lines.append(
      f'imbalance (max/mean) {self.imbalance:.3f}, variance '
      f'{_FormatNumber(self.variance)}, efficiency bound (mean/max) '
      f'{100.0 * self.efficiency:.1f}%'
    )
    return '\n'.join(lines)


def _FormatNumber(x):
  """Formats a cost compactly: 4 significant digits."""
  return f'{x:.4g}'


def _Truncate(s, width):
  if width < 4 or len(s) <= width:
    return s
  return s[: width - 3] + '...'
