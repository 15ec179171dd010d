"""The README's example runs as written, and its commands name real things."""

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.testing import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _Readme():
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    return f.read()


@pytest.mark.parametrize('index', [0, 1])
def testExampleRuns(tmp_path, index):
  blocks = re.findall(r'```python\n(.*?)```', _Readme(), re.S)
  assert len(blocks) == 2, 'README has not the custom-layer and Keras examples'
  script = tmp_path / 'example.py'
  script.write_text(blocks[index])
  out = warm_python.Run(
    [sys.executable, str(script)],
    cwd=ROOT,
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


# -- Every command of the README runs -----------------------------------------

# Flags appended to a README command (matched by the first key it contains)
# so that it runs small: later flags override earlier ones.
_SMALL = [
  # No --max_steps: the evaler takes it from the logdir's params.txt.
  ('--job=evaler_dev', ['--eval_max_batches=1']),
  ('--mode=inspect', []),
  ('lingvo_gpipe.trainer', ['--max_steps=3', '--eval_max_batches=1']),
  ('local_cluster.py', ['--serve_seconds=300']),
  (
    'benchmark_pipeline.py',
    [
      '--model=mlp',
      '--configs=2x2x1',
      '--num_blocks=2',
      '--dim=16',
      '--batch_size=8',
      '--steps=1',
      '--warmup=0',
      '--trace_micro_batches=2',
    ],
  ),
  (
    'max_model_size.py',
    ['--budget_mb=512', '--configs=pipeline-2', '--max_size=2'],
  ),
  ('build_cost.py', ['--configs=fc:L=2:K=2:M=2', '--steps=1']),
  ('accelerator_check.py', []),
  ('plan.py', []),
  ('eval_bleu.py', ['--max_batches=1', '--beam_size=1']),
  ('mkdocs build', []),
]

# What a command's output must show.
_EXPECT = {
  # The trainer's in-process evaler evaluated the last checkpoint already.
  '--job=evaler_dev': 'evaluated before',
  '--mode=inspect_model': 'cell 1 on',
  # The model's pipeline has 2 cells.
  '--job=trainer,evaler_dev': 'Cluster: this host; 1 replica(s) x 2 stage(s).',
}

# What no command's output may show: noise and tracebacks.
_NEVER = [
  'Traceback',
  'Sharding callback duration',
  'flops_registry',
  'oneDNN custom operations',  # TensorFlow's start-up banner
  'absl::InitializeLog()',
  'default session config',
  'Failed to remove function remotely',
]

# The README's commands in groups that run in order in one directory; the
# fast groups run by default, the others with `pytest -m slow`.
_GROUPS = {
  'digits': (
    False,
    ['MlpDigitsTiny --logdir=/tmp/digits', 'MlpDigitsTiny --mode=inspect'],
  ),
  'accelerator': (False, ['accelerator_check.py']),
  'digits_split': (True, ['--logdir=/tmp/d2', '--logdir=/tmp/dp']),
  'main': (True, ['AmoebaNetTiny']),
  'multihost': (True, ['local_cluster.py', '--logdir=/tmp/mh']),
  # The planner's validation reads the benchmark's JSON: one group.
  'benchmarks': (
    True,
    ['benchmark_pipeline.py', 'build_cost.py', '--validate=/tmp/bench.json'],
  ),
  'capacity': (True, ['max_model_size.py']),
  'planner': (
    True,
    ['plan.py --model=', 'plan.py --validate=docs/', 'plan.py --paper'],
  ),
  'mt': (True, ['mt.multilingual.TransformerTiny']),
  'lm': (True, ['OneBWdsGPipeTransformerTiny']),
  # tests/docs_test.py builds the site in the default run.
  'docs': (True, ['mkdocs build']),
}


def _ReadmeCommands():
  """Every `python ...` command of the README's bash blocks, one line each
  (continuations joined, comments dropped; setup steps before it cut)."""
  commands = []
  for block in re.findall(r'```bash\n(.*?)\n```', _Readme(), re.S):
    for line in block.replace('\\\n', ' ').splitlines():
      line = ' '.join(line.split('  #')[0].split())
      if not line or line.startswith('#'):
        continue
      line = line.split('&& ')[-1]  # The venv and pip steps of the setup.
      if line.startswith('python -m pytest'):
        continue  # The test run itself.
      commands.append(line)
  return commands


def _Group(command):
  found = [
    name
    for name, (_, keys) in _GROUPS.items()
    if any(k in command for k in keys)
  ]
  return found[0] if len(found) == 1 else found


def testEveryReadmeCommandIsInOneGroup():
  commands = _ReadmeCommands()
  assert len(commands) >= 15, commands
  for command in commands:
    group = _Group(command)
    assert isinstance(group, str), (
      f'README command {command!r} is in groups {group}: add it to exactly '
      'one group of _GROUPS in tests/readme_test.py.'
    )
    assert any(key in command for key, _ in _SMALL), command


def _Small(command, tmp_path, spec=None):
  args = shlex.split(command)
  assert args[0] == 'python', command
  out = [sys.executable]  # Its path may itself be under /tmp.
  for a in args[1:]:
    a = re.sub(r'/tmp/', f'{tmp_path}/', a)
    if spec and 'PORT0' in a:
      a = '--cluster_spec=worker=' + ','.join(spec['worker'])
    out.append(a)
  for key, extra in _SMALL:
    if key in command:
      return out + extra
  raise AssertionError(command)


def _Env():
  """The environment of a user's shell: no TF_CPP_MIN_LOG_LEVEL of ours."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  return env


def _RunGroup(name, tmp_path):
  commands = [c for c in _ReadmeCommands() if _Group(c) == name]
  assert commands, name
  server = None
  spec = None
  try:
    for command in commands:
      args = _Small(command, tmp_path, spec)
      if 'local_cluster.py' in command:
        spec_file = tmp_path / 'spec.json'
        server = subprocess.Popen(
          args + [f'--spec_file={spec_file}'],
          cwd=ROOT,
          env=_Env(),
          stdout=subprocess.DEVNULL,
          stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 120
        while not spec_file.exists() and time.time() < deadline:
          assert server.poll() is None, 'local_cluster.py exited'
          time.sleep(0.2)
        spec = json.loads(spec_file.read_text())
        continue
      out = subprocess.run(
        args,
        cwd=ROOT,
        env=_Env(),
        capture_output=True,
        text=True,
        timeout=600,
      )
      assert out.returncode == 0, (command, out.stderr[-3000:])
      for unwanted in _NEVER:
        assert unwanted not in out.stderr + out.stdout, (command, unwanted)
      for key, expected in _EXPECT.items():
        if key in command:
          assert expected in out.stderr + out.stdout, (command, expected)
  finally:
    if server is not None:
      server.kill()
      server.wait(timeout=30)


@pytest.mark.parametrize(
  'name', [n for n, (slow, _) in _GROUPS.items() if not slow]
)
def testReadmeCommandsRun(name, tmp_path):
  _RunGroup(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
  'name', [n for n, (slow, _) in _GROUPS.items() if slow]
)
def testSlowReadmeCommandsRun(name, tmp_path):
  _RunGroup(name, tmp_path)
