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
  parser.add_argument(
    '--cluster_spec', required=True, help='JSON dict job -> list of host:port.'
  )
  parser.add_argument('--job_name', default='worker')
  parser.add_argument('--task_index', type=int, required=True)
  parser.add_argument('--intra_op_threads', type=int, default=0)
  parser.add_argument('--inter_op_threads', type=int, default=0)
  parser.add_argument(
    '--status_port',
    type=int,
    default=-1,
    help="Serve this worker's memory figures over HTTP on "
    'this port (0: any free port; -1: no endpoint); see '
    'lingvo_gpipe.runners.device_memory.',
  )
  parser.add_argument(
    '--allocator_stats',
    action='store_true',
    help="Count CPU allocations (TensorFlow's BFC "
    'allocator), so that the status endpoint reports the '
    "allocator's current and peak bytes.",
  )
  parser.add_argument(
    '--memory_limit_mb',
    type=int,
    default=0,
    help='With --allocator_stats: refuse allocations beyond '
    'this many MiB, like an accelerator of that memory.',
  )
  parser.add_argument(
    '--profiler_port',
    type=int,
    default=0,
    help="Serve TensorFlow's profiler on this port (0: none), so that "
    'tf.profiler.experimental.client.trace (or TensorBoard) can record '
    "this worker's ops and, with --allocator_stats, its allocations.",
  )
  parser.add_argument(
    '--cpus',
    default='',
    help='Comma list of CPU cores this process may use, '
    'e.g. "1": a worker that stands for one accelerator.',
  )
  args = parser.parse_args(argv)
  if args.cpus:
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(',')})
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from lingvo_gpipe.runners import device_memory  # pylint: disable=g-import-not-at-top

  if args.allocator_stats or args.memory_limit_mb:
    device_memory.EnableCpuStats(args.memory_limit_mb or None)
  status = None
  if args.status_port >= 0:
    host = json.loads(args.cluster_spec)[args.job_name][args.task_index].rsplit(
      ':', 1
    )[0]
    status = device_memory.StatusServer(args.status_port, host=host).Start()
  from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

  tf = quiet_start.ImportTensorFlow(min_log_level='2')

  spec = json.loads(args.cluster_spec)
  config = tf.compat.v1.ConfigProto(
    intra_op_parallelism_threads=args.intra_op_threads,
    inter_op_parallelism_threads=args.inter_op_threads,
  )
  if args.intra_op_threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
  if args.inter_op_threads:
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
  server = tf.distribute.Server(
    tf.train.ClusterSpec(spec),
    job_name=args.job_name,
    task_index=args.task_index,
    config=config,
    start=True,
  )
  if args.profiler_port:
    tf.profiler.experimental.server.start(args.profiler_port)
  if status:
    status.MarkBaseline()
  status_text = f', memory status on port {status.port}' if status else ''
  print(
    f'tf_server {args.job_name}:{args.task_index} ready at '
    f'{spec[args.job_name][args.task_index]}{status_text}',
    flush=True,
  )
  server.join()
  return 0


if __name__ == '__main__':
  sys.exit(main())
