"""A wheel of the project installs, non-editable, into a fresh virtual
environment and works outside the checkout: the registered models (params/)
are in it, the console scripts run, and the README's main job trains.

The fresh environment reuses this one's installed dependencies (TensorFlow
and the rest) through a path file instead of downloading them, so the test
runs offline; the wheel itself is installed with pip, without its
dependencies. Nothing of the checkout is on its path.
"""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What setup.py needs to build the wheel.
_SOURCES = ('setup.py', 'setup.cfg', 'README.md', 'lingvo_gpipe', 'params')


def _Run(args, cwd, env=None, timeout=600):
  out = subprocess.run(
    args,
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-3000:])
  return out


def _BuildWheel(tmp_path):
  """Builds the wheel from a copy of the sources (the checkout stays
  untouched); returns its path."""
  src = tmp_path / 'src'
  src.mkdir()
  for name in _SOURCES:
    path = os.path.join(ROOT, name)
    if os.path.isdir(path):
      shutil.copytree(
        path, src / name, ignore=shutil.ignore_patterns('__pycache__')
      )
    else:
      shutil.copy(path, src / name)
  dist = tmp_path / 'dist'
  _Run(
    [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-index']
    + ['--no-build-isolation', '-q', '-w', str(dist), str(src)],
    cwd=tmp_path,
  )
  (wheel,) = dist.glob('lingvo_gpipe-*.whl')
  return wheel


def _FreshVenv(tmp_path):
  """A new virtual environment that sees this one's packages after its
  own (a path file: this environment's own path files, e.g. an editable
  install of the checkout, are not read)."""
  venv = tmp_path / 'venv'
  _Run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], tmp_path)
  python = venv / 'bin' / 'python'
  purelib = _Run(
    [
      str(python),
      '-c',
      "import sysconfig; print(sysconfig.get_paths()['purelib'])",
    ],
    tmp_path,
  ).stdout.strip()
  ours = sysconfig.get_paths()['purelib']
  with open(os.path.join(purelib, 'reuse_installed.pth'), 'w') as f:
    f.write(ours + '\n')
  return venv


@pytest.mark.slow
def testWheelInstallsAndRunsOutsideTheCheckout(tmp_path):
  wheel = _BuildWheel(tmp_path)
  venv = _FreshVenv(tmp_path)
  bin_dir = venv / 'bin'
  # The venv has no pip of its own: this one's installs into it.
  _Run(
    [sys.executable, '-m', 'pip', '--python', str(bin_dir / 'python')]
    + ['install', '-q', '--no-deps', '--no-index', str(wheel)],
    cwd=tmp_path,
  )
  away = tmp_path / 'elsewhere'
  away.mkdir()
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ('PYTHONPATH', 'VIRTUAL_ENV')
  }
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  env['PATH'] = f'{bin_dir}{os.pathsep}{env.get("PATH", "")}'
  python = str(bin_dir / 'python')
  code = (
    'import lingvo_gpipe; import params.image.amoebanet as a; '
    'print(lingvo_gpipe.__file__); print(a.__file__)'
  )
  where = _Run([python, '-c', code], away, env).stdout
  for path in where.split():
    assert path.startswith(str(venv)), where  # Not the checkout's.
  # The console scripts.
  for script in (
    'lingvo-gpipe-plan',
    'lingvo-gpipe-inspect',
    'lingvo-gpipe-capacity',
    'lingvo-gpipe-bench',
    'lingvo-gpipe-build-cost',
    'lingvo-gpipe-accelerator-check',
    'gpipe_trainer',
  ):
    assert (bin_dir / script).exists(), script
  out = _Run(
    [str(bin_dir / 'lingvo-gpipe-inspect')]
    + ['--model=image.amoebanet.AmoebaNetTiny', '--worker_split_size=2'],
    away,
    env,
  )
  out = out.stdout + out.stderr
  assert 'AmoebaNetTiny' in out and 'Traceback' not in out, out
  out = _Run(
    [str(bin_dir / 'lingvo-gpipe-plan'), '--model=image.digits.MlpDigitsTiny']
    + ['--num_devices=2', '--device=cpu'],
    away,
    env,
  )
  out = out.stdout + out.stderr
  assert 'python -m lingvo_gpipe.trainer --model=image.digits' in out, out
  # The README's main job, for one step, from another directory.
  logdir = tmp_path / 'logdir'
  out = _Run(
    [python, '-m', 'lingvo_gpipe.trainer']
    + ['--model=image.amoebanet.AmoebaNetTiny', f'--logdir={logdir}']
    + ['--num_cpu_devices=2', '--mode=sync', '--job=trainer,evaler_dev']
    + ['--max_steps=1', '--eval_max_batches=1'],
    away,
    env,
  )
  out = out.stdout + out.stderr
  assert (logdir / 'train' / 'checkpoint').exists(), out[-3000:]
  assert 'Traceback' not in out, out[-3000:]
