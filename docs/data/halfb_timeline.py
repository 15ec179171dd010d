"""A timeline of one training step of the 608M LM (pipeline-8 over 8 local
worker processes): when each cell ran each micro-batch's forward and
recompute-and-backward, read from timestamps the workers take.

  python docs/data/halfb_timeline.py /tmp/halfb_timeline   # .png, .json
"""

import os
import sys

import tensorflow as tf

from lingvo_gpipe import trainer_params
from lingvo_gpipe.core import cluster
from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline import timeline

MODEL = 'lm.one_billion_wds.OneBWdsGPipeTransformerHalfB'


def main(out):
  os.makedirs(out, exist_ok=True)
  with cluster.LocalCluster(
    8, intra_op_threads=1, inter_op_threads=2, startup_timeout_s=180
  ) as local:
    c = cluster.Cluster(
      cluster.Cluster.Params().Set(
        cluster_spec='worker=' + ','.join(local.addresses),
        worker_split_size=8,
      )
    ).Configure()
    devices = [d for row in c.StageDevices() for d in row]
    p = trainer_params.BuildParams(
      MODEL, 'Train', worker_split_size=8, devices=devices
    )
    model = p.Instantiate()
    task = model.GetTask()
    batches = iter(task.input_generator.GetDataset())
    tracer = schedule.ScheduleTracer()

    @tf.function(autograph=False)
    def Step(batch):
      with tracer:
        outputs = task.TrainStep(batch)
      return outputs, tracer.Tensors()

    for _ in range(3):  # the first traces; the third is drawn
      outputs, stamps = Step(next(batches))
    events = tracer.Events(stamps)
    stack = task.lm.stack
    timeline.WriteChromeTrace(
      events, os.path.join(out, 'halfb_step.trace.json'), stack.devices
    )
    timeline.PlotTimeline(
      events,
      os.path.join(out, 'halfb_step.png'),
      devices=stack.devices,
      title=(
        '608M-parameter LM, K=8, M=4: 8 worker processes on 2 cores '
        '(blue forward, orange recompute + backward)'
      ),
    )
    end = max(e[4] for e in events)
    print(
      f'{len(events)} work items, {end:.2f} s; loss {float(outputs.loss):.4f}'
    )


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/halfb_timeline')
