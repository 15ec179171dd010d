"""Batch-norm moving averages that are still mostly their initial values.

Evaluation normalizes with a BatchNormLayer's moving averages, which start
at mean 0, variance 1 and move by (1 - decay) toward each mini-batch's
statistics once per training step: after n steps d = decay ** n of the
initial values remains. With Lingvo's default decay of 0.999 that is 74%
after 300 steps, so a model that trains well evaluates badly. The evaler
logs `MovingAverageWarning(model, step)` once: the layers, their decay and
the fix.
"""

import math

from lingvo_gpipe.layers import normalizations

__all__ = ['MAX_INITIAL_SHARE', 'SlowLayers', 'MovingAverageWarning']

# Warn while more than this share of the initial values remains.
MAX_INITIAL_SHARE = 0.1


def SlowLayers(model, step):
  """[(layer path, decay)] of the BatchNormLayers of `model` whose moving
  averages keep more than MAX_INITIAL_SHARE of their initial values after
  `step` updates (one per training step)."""
  out = []
  for m in model.submodules:
    if not isinstance(m, normalizations.BatchNormLayer):
      continue
    p = m.params
    if p.use_moving_avg_in_training or not 0.0 < p.decay < 1.0:
      continue
    if p.decay ** max(int(step), 0) > MAX_INITIAL_SHARE:
      out.append((m.path, p.decay))
  return sorted(out)


def MovingAverageWarning(model, step):
  """The warning for the slow layers of `model` at `step`, or None."""
  slow = SlowLayers(model, step)
  if not slow:
    return None
  decay = max(d for _, d in slow)
  names = ', '.join(path for path, _ in slow[:6])
  if len(slow) > 6:
    names += f' and {len(slow) - 6} more'
  needed = math.ceil(math.log(MAX_INITIAL_SHARE) / math.log(decay))
  return (
    f'The batch-norm moving averages of {len(slow)} layer(s) ({names}; '
    f'decay up to {decay:g}) have had {step} updates: they are still '
    f'{decay ** max(step, 0):.0%} their initial values (mean 0, variance '
    '1), and evaluation normalizes with them, so its metrics can be far '
    f"worse than training's. Train at least {needed} steps, or lower the "
    'decay (BatchNormLayer decay, Conv2DLayer bn_decay; e.g. 0.99 or 0.9 '
    'for a short run).'
  )
