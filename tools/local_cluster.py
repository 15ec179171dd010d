r"""Starts a local TensorFlow cluster of N worker processes on 127.0.0.1.

  python tools/local_cluster.py --num_workers=2
  # prints the cluster spec and a trainer command line, then serves until
  # Ctrl-C (or SIGTERM), and stops every worker on the way out.

In another shell, train with stages (or replicas) on the workers:

  python -m lingvo_gpipe.trainer --model=image.digits.MlpDigitsTiny \
      --logdir=/tmp/digits_cluster --cluster_spec=worker=127.0.0.1:P0,... \
      --worker_split_size=2

A worker that dies is restarted on its own port while the others keep
running, so the cluster spec stays valid: rerun the trainer with the same
--cluster_spec to resume from its last checkpoint (--max_restarts bounds the
restarts of each worker; beyond it the cluster stops with status 1).

Each worker is `python -m lingvo_gpipe.runners.tf_server` (console script
`gpipe_tf_server`); on several hosts, start one per host with the same
--cluster_spec and its own --task_index instead of this tool. --pin pins worker
i to CPU core i, so that each worker computes like one accelerator.
"""

import argparse
import json
import signal
import sys
import time

from lingvo_gpipe.core import quiet_start

quiet_start.ImportTensorFlow(min_log_level='2')

from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top


def _Parser():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--num_workers', type=int, default=2)
  parser.add_argument(
    '--intra_op_threads',
    type=int,
    default=0,
    help='Threads one op may use in a worker (0: TF).',
  )
  parser.add_argument(
    '--inter_op_threads',
    type=int,
    default=0,
    help='Ops a worker may run at once (0: TF).',
  )
  parser.add_argument(
    '--pin', action='store_true', help='Pin worker i to CPU core i.'
  )
  parser.add_argument('--startup_timeout_s', type=float, default=120)
  parser.add_argument(
    '--max_restarts',
    type=int,
    default=5,
    help='Restarts of each worker that dies (0: stop the cluster instead).',
  )
  parser.add_argument(
    '--spec_file', default='', help='Also write the cluster spec (JSON) here.'
  )
  parser.add_argument(
    '--serve_seconds',
    type=float,
    default=0,
    help='Stop after this many seconds (0: until killed).',
  )
  return parser


def _Announce(local, args, spec):
  """The cluster spec, each worker, and a trainer command line for them."""
  if args.spec_file:
    with open(args.spec_file, 'w') as f:
      json.dump(local.cluster_spec, f)
  print(f'{args.num_workers} workers ready: {local.cluster_spec}')
  for i in range(args.num_workers):
    print(f'  task {i}: pid {local.pids[i]}, device {local.devices[i]}')
  print(
    'Train on them with, e.g.:\n'
    '  python -m lingvo_gpipe.trainer --model=image.digits.MlpDigitsTiny'
    f' --logdir=/tmp/digits_cluster --cluster_spec={spec} '
    f'--worker_split_size={args.num_workers}',
    flush=True,
  )


def _Serve(local, args, spec, stop):
  """Restarts workers that die until `stop`, the deadline or Ctrl-C; 1 where
  a worker has used up its restarts, else 0."""
  deadline = time.time() + args.serve_seconds if args.serve_seconds else None
  restarts = [0] * args.num_workers
  try:
    while not stop and (deadline is None or time.time() < deadline):
      for i, alive in enumerate(local.Alive()):
        if alive:
          continue
        if restarts[i] >= args.max_restarts:
          print(
            f'Worker {i} exited after {restarts[i]} restarts '
            f'(--max_restarts={args.max_restarts}); stopping the cluster.',
            file=sys.stderr,
            flush=True,
          )
          return 1
        restarts[i] += 1
        print(
          f'Worker {i} exited; restarting it on {local.addresses[i]} '
          f'(restart {restarts[i]} of {args.max_restarts}); the other '
          'workers keep running.',
          flush=True,
        )
        local.Restart(i)
        print(
          f'  task {i}: pid {local.pids[i]} ready again; the cluster spec '
          f'is unchanged: --cluster_spec={spec}',
          flush=True,
        )
      time.sleep(0.5)
  except KeyboardInterrupt:
    pass
  return 0


def main(argv=None):
  parser = _Parser()
  args = parser.parse_args(argv)
  if args.num_workers < 1:
    parser.error(f'--num_workers={args.num_workers} must be >= 1.')
  stop = []
  signal.signal(signal.SIGTERM, lambda *unused: stop.append(True))
  local = cluster.LocalCluster(
    args.num_workers,
    intra_op_threads=args.intra_op_threads,
    inter_op_threads=args.inter_op_threads,
    startup_timeout_s=args.startup_timeout_s,
    pin_cpus=args.pin,
  )
  with local:
    spec = 'worker=' + ','.join(local.addresses)
    _Announce(local, args, spec)
    if _Serve(local, args, spec, stop):
      return 1
  print('Cluster stopped.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
