"""End to end: the trainer binary trains TransformerTiny; BLEU is scored.

The trainer runs in a subprocess on 2 virtual CPU devices (the pipeline's 2
cells), with an empty cache directory, so the demo corpus and its vocabulary
are built on the fly, as on a fresh machine.
"""

import json
import os
import pathlib
import re
import sys

import pytest

from lingvo_gpipe.runners import checkpointer
from tests.testing import warm_python

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = 'mt.multilingual.TransformerTiny'


def _Env(cache):
  return dict(warm_python.ServerEnv(), XDG_CACHE_HOME=str(cache))


def testTinyTransformerTrainsAndIsScored(tmp_path):
  logdir = tmp_path / 'logdir'
  env = _Env(tmp_path / 'cache')
  res = warm_python.Run(
    [
      sys.executable,
      '-m',
      'lingvo_gpipe.trainer',
      f'--model={MODEL}',
      f'--logdir={logdir}',
      '--num_cpu_devices=2',
      '--run_locally=cpu',
      '--mode=sync',
      '--max_steps=3',
      '--log_interval_steps=1',
    ],
    cwd=REPO,
    env=env,
    timeout=180,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  log = res.stderr
  assert 'cell 1 on /device:CPU:1' in log and 'mt/network/softmax' in log
  assert 'step       3/3' in log
  assert 'Corpus de-en' in log  # Per-corpus counts are logged.
  assert os.path.exists(
    tmp_path / 'cache' / 'lingvo_gpipe' / 'demo_mt' / 'spm.model'
  )
  assert checkpointer.LatestCheckpoint(str(logdir / 'train')).endswith('ckpt-3')
  out = tmp_path / 'bleu.json'
  res = warm_python.Run(
    [
      sys.executable,
      str(REPO / 'tools' / 'eval_bleu.py'),
      f'--model={MODEL}',
      f'--logdir={logdir}',
      '--dataset=Dev',
      '--beam_size=2',
      '--max_batches=1',
      '--num_cpu_devices=2',
      f'--json={out}',
    ],
    cwd=REPO,
    env=env,
    timeout=120,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert f'{MODEL} step 3, Dev:' in res.stdout
  assert 'average' in res.stdout and 'corpus' in res.stdout
  scores = json.loads(out.read_text())
  assert scores['step'] == 3 and 0.0 <= scores['bleu'] <= 100.0
  assert any(k.startswith('bleu_') and k.endswith('-en') for k in scores)


def _StepLog(log):
  """{step: (loss, grad_norm)} from the trainer's step lines."""
  out = {}
  for line in log.splitlines():
    match = re.search(
      r'step +(\d+)/\d+ +loss (\S+) +lr \S+ +grad_norm (\S+)', line
    )
    if match:
      out[int(match.group(1))] = (float(match.group(2)), float(match.group(3)))
  return out


@pytest.mark.slow
def testTinyTransformerTrainsWithOneFOneBLikeGPipe(tmp_path):
  """The registered model takes schedule='1f1b' through a Params override
  and trains through the loss on the last cell: the same losses and
  gradient norms, step by step, as with the default 'gpipe'."""
  logs = {}
  for schedule in ('gpipe', '1f1b'):
    res = warm_python.Run(
      [
        sys.executable,
        '-m',
        'lingvo_gpipe.trainer',
        f'--model={MODEL}',
        f'--logdir={tmp_path / schedule}',
        '--num_cpu_devices=2',
        '--run_locally=cpu',
        '--mode=sync',
        '--max_steps=3',
        '--log_interval_steps=1',
        f"--model_params_override=task.network.schedule : '{schedule}'",
      ],
      cwd=REPO,
      env=_Env(tmp_path / 'cache'),
      timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    logs[schedule] = _StepLog(res.stderr)
  assert sorted(logs['1f1b']) == sorted(logs['gpipe']) == [1, 2, 3]
  for step, (loss, grad_norm) in logs['gpipe'].items():
    loss_1f1b, norm_1f1b = logs['1f1b'][step]
    assert loss_1f1b == pytest.approx(loss, rel=1e-4), step
    assert norm_1f1b == pytest.approx(grad_norm, rel=1e-3), step
