"""What the trainer does about its remote workers: reads their memory, ends
a step that does not finish, frees its variables on them when it exits, and
warns when a killed trainer left its variables there.

A worker frees the variables of a client only when the client releases
them. The trainer ends by `os._exit` (TensorFlow's interpreter shutdown can
block), which releases nothing, so `WatchMemory` registers the release with
`trainer_errors.BeforeExit`; a trainer killed by a signal cannot, and the
next one says so (`WarnIfKilledBefore`).
"""

import time

from absl import logging

from lingvo_gpipe import trainer_errors
from lingvo_gpipe.core import worker_memory
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import train_loop
from lingvo_gpipe.runners import trainer_state

__all__ = ['WarnIfKilledBefore', 'WatchMemory', 'StepTimeout', 'Watchdog']


def _Remote(cluster):
  return cluster is not None and cluster.is_remote


def WarnIfKilledBefore(train_dir, cluster):
  """Logs a warning if the last trainer of `train_dir` was killed (its
  variables are still on the workers of `cluster`)."""
  killed = trainer_state.KilledTrainer(train_dir)
  if killed and _Remote(cluster):
    logging.warning(
      'The last trainer of this logdir (pid %s) was killed before it could '
      'free its variables on the workers: the workers still hold them (a '
      'worker frees what a client holds only when the client releases it). '
      'If they are short of memory, restart them before this trainer '
      'builds its model.',
      killed['pid'],
    )


def WatchMemory(cluster, model):
  """The `WorkerMemory` of `cluster`'s workers (None if it has none), with
  the release of `model`'s variables on them registered for the exit."""
  if not _Remote(cluster):
    return None
  trainer_errors.BeforeExit(lambda: _ReleaseOnWorkers(model))
  return worker_memory.WorkerMemory(cluster.spec)


def _ReleaseOnWorkers(model):
  """Frees the model's variables (weights, optimizer slots) on the remote
  workers before the process ends."""
  t0 = time.time()
  n = worker_memory.ReleaseRemoteVariables(model.VariablesByName().values())
  logging.info(
    'Freed %d variables of this trainer on the workers in %.1f s.',
    n,
    time.time() - t0,
  )


def StepTimeout(cluster, step_timeout_s):
  """Seconds, 0 (off) or None (auto: from the running median step time)."""
  if step_timeout_s is not None:
    return step_timeout_s
  return None if _Remote(cluster) else 0.0


def Watchdog(train_dir, cluster, memory, step_timeout_s, min_step_timeout_s):
  """A StepWatchdog that ends the process naming the workers (or None);
  `memory`: the workers' `WorkerMemory`, whose last samples of a lost worker
  the message gives; the timeouts: --step_timeout_s, --min_step_timeout_s."""
  timeout = StepTimeout(cluster, step_timeout_s)
  if timeout == 0:
    return None
  floor = min_step_timeout_s
  rule = (
    f'--step_timeout_s={timeout:g}'
    if timeout is not None
    else f'the default step timeout, max({floor:g} s '
    '(--min_step_timeout_s), 10 x the median step time)'
  )

  def OnTimeout(step, elapsed, bound):
    lost = cluster.UnreachableWorkers() if cluster is not None else []
    silent = []
    if not lost and _Remote(cluster):
      silent = cluster.SilentWorkers()
    if lost:
      who = (
        f'worker {", ".join(lost)} no longer accepts connections (the '
        'process died or its host is down)'
      )
      known = [memory.Describe(w) for w in lost] if memory else []
      if any(known):
        who += ' (' + '; '.join(k for k in known if k) + ')'
    elif silent:
      who = (
        f'worker {", ".join(silent)} accepts connections but does not '
        'answer (stopped, swapping or deadlocked)'
      )
    elif _Remote(cluster):
      who = (
        'every worker answers, so the step is slower than the bound or '
        'stuck inside a worker; set --step_timeout_s if it is just slow'
      )
    else:
      who = 'raise --step_timeout_s if the step is just slow'
    last = checkpointer.LatestCheckpoint(train_dir)
    trainer_errors.Exit(
      1,
      f'Step {step} did not finish within {elapsed:.0f} s (bound '
      f'{bound:.0f} s, {rule}): {who}. The last checkpoint is '
      f'{last or "none"}; fix the workers and rerun the trainer to resume '
      'from it.',
      release=not (lost or silent),
    )

  logging.info(
    'Step timeout: %s.',
    rule if timeout is not None else rule + ', 900 s for the first step',
  )
  return train_loop.StepWatchdog(timeout, OnTimeout, min_timeout_s=floor)
