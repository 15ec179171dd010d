"""The documentation site builds with warnings as errors, its API reference
covers the public modules, and every code block of the guides marked
runnable runs.

A runnable block is a ```python block right after a line
`<!-- runnable -->` (an HTML comment: the site does not show it). It runs as
it is, in a fresh directory, in its own process, with the checkout on
PYTHONPATH; so it imports what it uses and runs in a few seconds.
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.testing import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = '<!-- runnable -->'
_RUNNABLE = re.compile(re.escape(MARKER) + r'\n```python\n(.*?)```', re.S)


def _Guides():
  return sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def _Read(path):
  with open(path, encoding='utf-8') as f:
    return f.read()


def RunnableBlocks(text):
  """The code of each block of Markdown `text` marked runnable."""
  return _RUNNABLE.findall(text)


def _AllRunnable():
  out = []
  for path in _Guides():
    for i, code in enumerate(RunnableBlocks(_Read(path))):
      out.append(pytest.param(code, id=f'{os.path.basename(path)}-{i}'))
  return out


def testMarkerFindsOnlyMarkedPythonBlocks():
  text = (
    '```python\nnot_marked()\n```\n\n<!-- runnable -->\n```python\n'
    'print(1)\n```\n<!-- runnable -->\n```bash\nls\n```\n'
  )
  assert RunnableBlocks(text) == ['print(1)\n']


def Markers(text):
  """How many lines of Markdown `text` are the marker, outside code blocks
  (a page may show the marker in a block, as docs/architecture.md does)."""
  count, fenced = 0, False
  for line in text.splitlines():
    if line.startswith('```'):
      fenced = not fenced
    elif line.strip() == MARKER and not fenced:
      count += 1
  return count


def testEveryMarkerIsOnAPythonBlock():
  assert Markers('<!-- runnable -->\n```\n<!-- runnable -->\n```\n') == 1
  for path in _Guides():
    text = _Read(path)
    assert Markers(text) == len(RunnableBlocks(text)), (
      f'{path}: {MARKER} must be the line right before a ```python block.'
    )


def testSeveralGuidesHaveRunnableBlocks():
  marked = [p for p in _Guides() if RunnableBlocks(_Read(p))]
  assert len(marked) >= 3, marked


@pytest.mark.parametrize('code', _AllRunnable())
def testRunnableBlockRuns(code, tmp_path):
  (tmp_path / 'block.py').write_text(code)
  out = warm_python.Run(
    [sys.executable, 'block.py'],
    cwd=tmp_path,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert out.returncode == 0, f'{code}\n{out.stderr[-3000:]}'


# -- The site -----------------------------------------------------------------


def _ApiModules():
  found = []
  for path in glob.glob(os.path.join(ROOT, 'docs', 'api', '*.md')):
    found += re.findall(r'^::: (\S+)$', _Read(path), re.M)
  return found


# The modules a user of the library imports: the API reference must show
# them (each layer module is added below).
_PUBLIC = [
  'lingvo_gpipe.core.gpipe',
  'lingvo_gpipe.core.layers',
  'lingvo_gpipe.core.base_layer',
  'lingvo_gpipe.core.base_model',
  'lingvo_gpipe.core.base_model_params',
  'lingvo_gpipe.core.cluster',
  'lingvo_gpipe.core.hyperparams',
  'lingvo_gpipe.core.learner',
  'lingvo_gpipe.core.optimizer',
  'lingvo_gpipe.core.py_utils',
  'lingvo_gpipe.core.schedule',
  'lingvo_gpipe.core.tpu',
  'lingvo_gpipe.pipeline.pipelining_layer',
  'lingvo_gpipe.planning.planner',
  'lingvo_gpipe.pipeline.schedule',
  'lingvo_gpipe.model_registry',
  'lingvo_gpipe.trainer',
  'lingvo_gpipe.runners.device_memory',
  'lingvo_gpipe.tools.plan',
]


def testApiReferenceCoversThePublicModules():
  shown = set(_ApiModules())
  layers = [
    'lingvo_gpipe.layers.' + os.path.basename(p)[: -len('.py')]
    for p in glob.glob(os.path.join(ROOT, 'lingvo_gpipe', 'layers', '*.py'))
    if not os.path.basename(p).startswith('_')
  ]
  missing = sorted(m for m in _PUBLIC + layers if m not in shown)
  assert not missing, (
    f'Modules missing from the API reference: {missing}; add a '
    '"::: <module>" line to a page of docs/api/.'
  )
  unknown = sorted(m for m in shown if importlib.util.find_spec(m) is None)
  assert not unknown, f'docs/api/ names modules that do not exist: {unknown}'


def _MkDocs():
  if importlib.util.find_spec('mkdocs') is None:
    pytest.fail('MkDocs is not installed: pip install -e ".[cpu,test]".')
  return [sys.executable, '-m', 'mkdocs']


def testSiteBuildsWithWarningsAsErrors(tmp_path):
  out = subprocess.run(
    _MkDocs() + ['build', '--strict', '--site-dir', str(tmp_path / 'site')],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  warnings = [l for l in out.stderr.splitlines() if 'WARNING' in l]
  assert out.returncode == 0 and not warnings, '\n'.join(
    warnings or out.stderr.splitlines()[-20:]
  )
  site = tmp_path / 'site'
  assert (site / 'index.html').exists()
  for page in ('gpipe', 'add_a_model', 'api/pipeline', 'api/layers'):
    assert (site / page / 'index.html').exists(), page
  api = (site / 'api' / 'pipeline' / 'index.html').read_text()
  # Generated from the docstrings: the class and a field of its Params.
  assert 'lingvo_gpipe.pipeline.pipelining_layer.PipeliningLayer' in api
  assert 'num_micro_batches' in api


def testEveryGuideIsInTheSiteNavigation():
  nav = set(
    re.findall(r'(\S+\.md)$', _Read(os.path.join(ROOT, 'mkdocs.yml')), re.M)
  )
  guides = {os.path.basename(p) for p in _Guides()}
  assert guides <= nav, f'Not in mkdocs.yml nav: {sorted(guides - nav)}'
