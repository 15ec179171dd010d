"""docs/add_a_model.md works as written: its files, trained and tested.

The guide's python blocks whose first line is `# <path>` are written to a
fresh directory, then every command of its bash blocks runs there (training
for a few steps), with the directory on PYTHONPATH as the guide says.
"""

import ast
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, 'docs', 'add_a_model.md')


def _Guide():
  with open(GUIDE, encoding='utf-8') as f:
    return f.read()


def _Files():
  files = {}
  for block in re.findall(r'```python\n(.*?)```', _Guide(), re.S):
    first = block.splitlines()[0]
    assert first.startswith('# ') and first.endswith('.py'), first
    files[first[2:]] = block
  return files


def _Commands():
  out = []
  for block in re.findall(r'```bash\n(.*?)\n```', _Guide(), re.S):
    out.extend(line for line in block.splitlines() if line.strip())
  return out


def testTheReadmeLinksTheGuide():
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    assert '(docs/add_a_model.md)' in f.read()


def _WriteFiles(tmp_path):
  files = _Files()
  assert set(files) == {
    'myexp/__init__.py',
    'myexp/res_mlp.py',
    'myexp/digits.py',
    'myexp/res_mlp_test.py',
  }
  for path, text in files.items():
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)


def _ConsoleScripts():
  """{script: (module, function)} of setup.py's console scripts."""
  tree = ast.parse(_Read(os.path.join(ROOT, 'setup.py')))
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == 'entry_points':
      entries = ast.literal_eval(node.value)['console_scripts']
      out = {}
      for entry in entries:
        name, target = [t.strip() for t in entry.split('=')]
        out[name] = tuple(target.split(':'))
      return out
  raise AssertionError('setup.py has no entry_points')


def _Read(path):
  with open(path, encoding='utf-8') as f:
    return f.read()


def testTheGuidesToolsAreConsoleScripts():
  # Its package may live anywhere: the guide uses the installed commands,
  # not the checkout's tools/ paths.
  scripts = _ConsoleScripts()
  for command in _Commands():
    args = shlex.split(command)[1:]
    assert not any(a.startswith('tools/') for a in args), command
    if args[0] != 'python':
      assert args[0] in scripts, command
  assert 'lingvo-gpipe-inspect' in _Guide()


def _Env(tmp_path):
  return dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL='2',
    PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]),
  )


def testTheGuidesModelIsFoundByItsKey(tmp_path):
  _WriteFiles(tmp_path)
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'lingvo_gpipe.trainer',
      '--model=myexp.digits.ResMlpDigits',
      '--mode=inspect_params',
    ],
    cwd=tmp_path,
    env=_Env(tmp_path),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'myexp.res_mlp/ResMlpBlock' in out.stdout


@pytest.mark.slow
def testTheGuideRunsAsWritten(tmp_path):
  _WriteFiles(tmp_path)
  commands = _Commands()
  assert len(commands) == 5, commands
  env = _Env(tmp_path)
  outputs = []
  scripts = _ConsoleScripts()
  for command in commands:
    assert command.startswith('PYTHONPATH=. '), command
    args = shlex.split(command)[1:]
    if args[0] in scripts:
      # The console script, as pip installs it: its entry point.
      module, function = scripts[args[0]]
      args[:1] = [
        sys.executable,
        '-c',
        f'import sys; from {module} import {function}; sys.exit({function}())',
      ]
    else:
      assert args[0] == 'python', command
      args[0] = sys.executable
    # The guide's /tmp/ paths, in this test's directory (not the
    # interpreter's path, which may lie under /tmp/ too).
    args[1:] = [a.replace('/tmp/', f'{tmp_path}/') for a in args[1:]]
    if '--job=trainer,evaler_dev' in args:
      args += ['--max_steps=3', '--eval_max_batches=1']
    out = subprocess.run(
      args,
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
    )
    assert out.returncode == 0, (
      command,
      out.stdout[-2000:],
      out.stderr[-3000:],
    )
    outputs.append(out.stdout + out.stderr)
  train, params, model, inspect, test = outputs
  assert (tmp_path / 'resmlp' / 'train' / 'checkpoint').exists()
  assert 'accuracy' in train and 'Traceback' not in train
  assert 'balanced by' not in train  # The layer's FPropMeta: no warning.
  assert 'task.network.layers[2].cls' in params and 'ResMlpBlock' in params
  assert 'network/block0/w1' in model
  assert '6 layers -> 3 cells' in inspect
  assert '2 passed' in test


def testTheGuideSaysANewModelNeedsItsGoldenFile():
  # A model added to params/ fails tests/golden_test.py until its golden
  # file is written with tools/update_golden.py.
  guide = _Guide()
  assert 'tests/golden/<model key>.json' in guide
  assert 'tests/golden_test.py' in guide
  found = re.findall(r'`python (tools/update_golden\.py) --model=(\S+)`', guide)
  assert found == [('tools/update_golden.py', 'tabular.digits.ResMlpDigits')]
  assert os.path.exists(os.path.join(ROOT, found[0][0]))
  assert "'--model'" in _Read(os.path.join(ROOT, found[0][0]))
