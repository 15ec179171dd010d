"""Naive-1 at the width of lm.one_billion_wds.OneBWdsGPipeTransformerHalfB.

The same LM in one cell, one micro-batch, recompute='never', on one device;
3 training steps; prints the parameters and the allocator's peak. Run from
the repository root: python docs/data/naive1_halfb_width.py LAYERS [HIDDEN]
(HIDDEN: the feed-forward's hidden width, 8192 by default; d stays 2048).
"""

import json
import sys
import time

from lingvo_gpipe.runners import device_memory

device_memory.EnableCpuStats()

import tensorflow as tf  # noqa: E402

from lingvo_gpipe import model_registry  # noqa: E402
from params.lm import one_billion_wds  # noqa: E402

LAYERS = int(sys.argv[1])
HIDDEN = int(sys.argv[2]) if len(sys.argv) > 2 else 8192


class Naive(one_billion_wds.OneBWdsGPipeTransformerHalfB):
  NUM_LAYERS = LAYERS
  HIDDEN_DIM = HIDDEN
  SPLITS = [LAYERS]
  NUM_MICRO_BATCHES = 1


def main():
  p = model_registry.GetParams(
    'lm.one_billion_wds.OneBWdsGPipeTransformerHalfB', 'Train'
  )
  p.task = Naive().Task()
  p.task.lm.stack.recompute = 'never'
  model = p.Instantiate()
  task = model.GetTask()
  params = sum(
    v.shape.num_elements()
    for v in model.VariablesByName().values()
    if v.trainable
  )
  batches = iter(task.input_generator.GetDataset())
  start = time.time()
  for _ in range(3):
    task.TrainStep(next(batches))
  peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
  print(
    'RESULT',
    json.dumps(
      dict(
        layers=LAYERS,
        hidden=HIDDEN,
        params=params,
        peak_gib=peak / 2**30,
        s=time.time() - start,
      )
    ),
  )


if __name__ == '__main__':
  main()
