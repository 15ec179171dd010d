"""What the pipeline asks of the planning package: its K, M and split.

The runtime (`lingvo_gpipe/pipeline/`) imports planning through this module
only (the build test guards it):
- `Resolve`: `num_stages='auto'` and `num_micro_batches='auto'`. A
  `PipeliningLayer` whose K or M is `'auto'` asks `planner.Resolve` for them,
  for its layers, its input shapes and the devices at hand, at build time.
  The choice and the planner's reasons are logged and kept as `plan_text`
  (written to `placement.txt` by the trainer).
- `Splits`: the cells' layer split from the Params (`splits`, or balanced
  by `balance_by`), and `SplitsToRanges`.
"""

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import meta
from lingvo_gpipe.pipeline import placement
from lingvo_gpipe.planning import balance
from lingvo_gpipe.planning import partition
from lingvo_gpipe.planning import planner

SplitsToRanges = balance.SplitsToRanges


def Resolve(p):
  """Resolves the 'auto' K and M of the PipeliningLayer Params `p`.

  Args:
    p: PipeliningLayer Params whose num_stages or num_micro_batches is
      'auto'.

  Returns:
    (K, M, text): the planner's number of stages and of micro-batches, and
    the text that explains the choice.

  Raises:
    ValueError: naming the pipeline, for a value that is neither an int nor
      'auto', for settings that contradict 'auto', or when no configuration
      fits.
  """
  for name in ('num_stages', 'num_micro_batches'):
    v = p.Get(name)
    if v != 'auto' and v is not None and not isinstance(v, int):
      raise ValueError(
        f"Pipeline {p.name!r}: {name}={v!r}; use an int or 'auto'."
      )
  if p.num_micro_batches == 'auto' and p.micro_batch_size:
    raise ValueError(
      f"Pipeline {p.name!r}: num_micro_batches='auto' and "
      f'micro_batch_size={p.micro_batch_size} both set M; give one.'
    )
  if p.cell_tpl:
    if p.num_stages == 'auto':
      raise ValueError(
        f"Pipeline {p.name!r}: num_stages='auto' needs a flat `layers` "
        f'list; cell_tpl fixes K={len(p.cell_tpl)} cells.'
      )
    layers, num_stages = list(p.cell_tpl), len(p.cell_tpl)
  else:
    layers = list(p.layers)
    num_stages = p.num_stages
  devices = list(p.devices) if p.devices else placement.DefaultDevices()
  if num_stages is None:  # M is 'auto'; K as without it.
    if isinstance(p.splits, int) and not isinstance(p.splits, bool):
      num_stages = p.splits
    elif p.splits:
      num_stages = len(p.splits)
    else:
      num_stages = max(1, len(devices) // p.num_replicas) if p.devices else 1
  device = p.planner_device or planner.DetectDevice(devices)
  try:
    k, m, _, text = planner.Resolve(
      layers,
      p.input_shapes,
      max(1, len(devices)),
      num_stages=num_stages,
      num_micro_batches=p.num_micro_batches,
      num_replicas=p.num_replicas,
      recompute=p.recompute != 'never',
      device=device,
      memory_bytes=p.planner_memory_per_device,
      batch_dim=p.batch_dim,
      name=p.name,
      compiled=bool(p.jit_compile),
      schedule=p.schedule,
    )
  except ValueError as e:
    raise ValueError(f'PipeliningLayer {p.name!r}: {e}') from e
  logging.info('Pipeline %r %s', p.name, text)
  return k, m, text


def Splits(p, layers, shapes, auto_num_stages, name):
  """The K end indices of the cells' layers, for PipeliningLayer Params `p`.

  Args:
    p: PipeliningLayer Params.
    layers: the layers' Params, in order.
    shapes: the first cell's input shapes (or None).
    auto_num_stages: K chosen by `Resolve`, or None.
    name: the pipeline's path, for errors.

  Returns:
    The splits (Lingvo's convention: K end indices).
  """
  device = (p.devices or [None])[0]
  if auto_num_stages:
    by = 'flops' if p.balance_by == 'auto' else p.balance_by
    return partition.ComputeSplits(
      layers, auto_num_stages, None, by, shapes, device=device
    )
  num_stages = p.num_stages or (
    len(p.devices) // p.num_replicas if p.devices else None
  )
  by = p.balance_by
  if by == 'auto':
    by = 'flops' if p.input_shapes is not None else 'params'
  num_micro_batches = p.num_micro_batches
  if by == 'memory' and p.micro_batch_size and shapes:
    batch = tf.nest.flatten(meta.ToShape(tuple(shapes)))[0].as_list()[
      p.batch_dim
    ]
    if batch:
      num_micro_batches = max(1, batch // p.micro_batch_size)
  return partition.ComputeSplits(
    layers,
    num_stages,
    p.splits,
    by,
    shapes,
    device=device,
    num_micro_batches=num_micro_batches,
    state_copies=p.memory_state_copies,
    name=name,
  )
