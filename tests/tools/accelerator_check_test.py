"""tools/accelerator_check.py: the no-GPU path, and its checks on CPU devices.

The checks run here on the test's virtual CPU devices; on a GPU host the tool
runs the same functions on 2 logical GPUs.
"""

import pathlib
import subprocess
import sys

import tensorflow as tf

from lingvo_gpipe.tools import accelerator_check

_PATH = (
  pathlib.Path(__file__).resolve().parents[2] / 'tools' / 'accelerator_check.py'
)

DEVICES = ['/device:CPU:0', '/device:CPU:1']


def testWithoutGpuSaysSoAndExitsZero():
  r = subprocess.run(
    [sys.executable, str(_PATH)],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
    env={
      'CUDA_VISIBLE_DEVICES': '',
      'PATH': '/usr/bin:/bin',
      'PYTHONPATH': str(_PATH.parents[1]),
    },
  )
  assert r.returncode == 0, r.stderr
  assert 'No accelerator' in r.stdout and 'nothing run' in r.stdout, r.stdout
  assert 'ok ' not in r.stdout and 'Device:' not in r.stdout


def testTransparencyCheckPassesOnCpuDevices():
  ok, detail = accelerator_check.CheckTransparency(DEVICES)
  assert ok, detail


def testMixedPrecisionChecksPassOnCpuDevices():
  for dtype, scale in ((tf.float16, 2.0**12), (tf.bfloat16, 1.0)):
    ok, detail = accelerator_check.CheckMixedPrecision(DEVICES, dtype, scale)
    assert ok, (dtype, detail)


def testFailingCheckIsReportedNotRaised(capsys):
  args = accelerator_check.argparse.Namespace(
    loss_scale=1.0, skip_trainer=True, skip_benchmark=True
  )
  results = accelerator_check.RunChecks(args, ['/device:CPU:0'])
  # One device cannot hold K=2: every check fails with a one-line reason.
  assert [ok for _, ok, _ in results] == [False, False, False]
  out = capsys.readouterr().out
  assert out.count('FAIL') == 3
