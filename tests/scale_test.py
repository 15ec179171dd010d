"""The path of docs/scale.md (a 608M-parameter LM, pipeline-8 over 8 worker
processes) at 1/100 of its size: 8 workers, checkpoints, the trainer killed
with SIGKILL after a checkpoint and rerun with the same command, and the
resumed losses equal to an uninterrupted run's.
"""

import re
import signal

import numpy as np
import pytest

from lingvo_gpipe.core import cluster
from lingvo_gpipe.runners import checkpointer
from tests.testing import trainer_process

MODEL = 'lm.one_billion_wds.OneBWdsGPipeTransformerHalfBMini'
TIMEOUT = 600


def _Losses(log):
  """{step: loss} of the trainer's progress lines."""
  return {
    int(step): float(loss)
    for step, loss in re.findall(r'step\s+(\d+)/\d+\s+loss (\S+)', log)
  }


@pytest.mark.slow
def testEightWorkersSigkillAfterACheckpointResumesWithTheSameLosses(tmp_path):
  with cluster.LocalCluster(8, startup_timeout_s=180) as local:
    flags = [
      f'--model={MODEL}',
      f'--cluster_spec=worker={",".join(local.addresses)}',
      '--worker_split_size=8',
      '--log_interval_steps=1',
    ]
    killed = tmp_path / 'killed'
    proc = trainer_process.Proc(
      tmp_path / 'log1.txt', f'--logdir={killed}', *flags, '--max_steps=1000'
    )
    try:
      proc.WaitFor(
        lambda: trainer_process.Latest(killed / 'train') >= 5, timeout=TIMEOUT
      )
      proc.proc.send_signal(signal.SIGKILL)
      proc.proc.wait(timeout=60)
    finally:
      proc.Close()
    first = proc.Log()
    assert 'Worker memory (resident, peak): /job:worker/task:0 ' in first
    last = checkpointer.LatestCheckpoint(str(killed / 'train'))
    saved = checkpointer.StepOf(last)
    assert saved >= 5, first[-3000:]
    # The same command again, against the same workers: it resumes.
    res = trainer_process.Run(
      f'--logdir={killed}', *flags, f'--max_steps={saved + 3}', timeout=TIMEOUT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f'Restored {last}.' in res.stderr, res.stderr[-3000:]
    assert 'variables of this trainer on the workers' in res.stderr
    assert 'was killed before it could free its variables on the workers' in (
      res.stderr
    ), res.stderr[-3000:]
    resumed = _Losses(res.stderr)
    # Uninterrupted, in a logdir of its own.
    res = trainer_process.Run(
      f'--logdir={tmp_path / "whole"}',
      *flags,
      f'--max_steps={saved + 3}',
      timeout=TIMEOUT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    whole = _Losses(res.stderr)
  steps = [saved + 1, saved + 2, saved + 3]
  assert all(s in resumed and s in whole for s in steps), (resumed, whole)
  # The killed run's own losses up to its checkpoint match too.
  before = {s: v for s, v in _Losses(first).items() if s <= saved}
  assert before, first[-3000:]
  np.testing.assert_allclose(
    list(before.values()), [whole[s] for s in before], rtol=1e-5
  )
  np.testing.assert_allclose(
    [resumed[s] for s in steps], [whole[s] for s in steps], rtol=1e-5
  )
  # The weights change from step to step: the losses are not one value.
  assert len(set(whole.values())) == len(whole), whole
