"""A TensorFlow server process: one worker of a (local) cluster.

  python -m lingvo_gpipe.runners.tf_server --cluster_spec='{"worker": [...]}' \
      --task_index=1 [--intra_op_threads=1 --inter_op_threads=1]

It serves until killed. With one intra- and one inter-op thread a worker runs
one op at a time, like an accelerator, which is how pipeline speed is
measured honestly on a CPU host (see tools/benchmark_pipeline.py).
"""

import argparse
import json
import os
import sys


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cluster_spec', required=True,
                      help='JSON dict job -> list of host:port.')
  parser.add_argument('--job_name', default='worker')
  parser.add_argument('--task_index', type=int, required=True)
  parser.add_argument('--intra_op_threads', type=int, default=0)
  parser.add_argument('--inter_op_threads', type=int, default=0)
  parser.add_argument('--cpus', default='',
                      help='Comma list of CPU cores this process may use, '
                      'e.g. "1": a worker that stands for one accelerator.')
  args = parser.parse_args(argv)
  if args.cpus:
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(',')})
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = json.loads(args.cluster_spec)
  config = tf.compat.v1.ConfigProto(
      intra_op_parallelism_threads=args.intra_op_threads,
      inter_op_parallelism_threads=args.inter_op_threads)
  if args.intra_op_threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
  if args.inter_op_threads:
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
  server = tf.distribute.Server(
      tf.train.ClusterSpec(spec), job_name=args.job_name,
      task_index=args.task_index, config=config, start=True)
  print(f'tf_server {args.job_name}:{args.task_index} ready at '
        f'{spec[args.job_name][args.task_index]}', flush=True)
  server.join()
  return 0


if __name__ == '__main__':
  sys.exit(main())
