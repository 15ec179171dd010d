"""The README's example runs as written, and its commands name real things."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _Readme():
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    return f.read()


def testExampleRuns(tmp_path):
  blocks = re.findall(r'```python\n(.*?)```', _Readme(), re.S)
  assert blocks, 'README has no python example'
  script = tmp_path / 'example.py'
  script.write_text(blocks[0])
  out = subprocess.run(
    [sys.executable, str(script)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'cell 1 on' in out.stdout


def testSetupCommandsComeFirstAndCiRunsTheTestCommand():
  lines = _Readme().splitlines()
  commands = re.findall(r'```bash\n(.*?)\n```', _Readme(), re.S)[:2]
  assert lines[0].startswith('# ') and lines[2] == '```bash'
  assert 'lingvo_gpipe.trainer' in commands[0]
  assert 'pytest' in commands[1]
  with open(os.path.join(ROOT, '.ci', 'run'), encoding='utf-8') as f:
    ci = f.read()
  for part in commands[1].split('&&')[2:]:
    part = part.strip().replace('pip install', 'pip install -q')
    if part.startswith('python -m pytest'):
      assert 'python -m pytest' in ci
    else:
      assert part in ci, (part, 'is not in .ci/run')


def testMainJobModelIsRegistered():
  from lingvo_gpipe import model_registry  # pylint: disable=g-import-not-at-top

  first = re.findall(r'```bash\n(.*?)\n```', _Readme(), re.S)[0]
  key = re.search(r'--model=(\S+)', first).group(1)
  assert model_registry.GetClass(key) is not None
