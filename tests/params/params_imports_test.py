"""`params/` imports the library the way a user's experiment does.

A registered experiment is the example a user copies. So it imports only
public modules and public names of the library's model-building packages
(core, layers, input, pipeline, planning, gpipe_layers, models and the
registry), never the
trainer's runners or the trainer, never a private module or name, and never
a test helper.
"""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

# What an experiment may import from, by the first component after
# `lingvo_gpipe.`.
_USER_PACKAGES = {
  'core',
  'layers',
  'input',
  'pipeline',
  'planning',
  'gpipe_layers',
  'models',
  'model_registry',
}


def _Imports(path):
  """Yields (line, module, name) for each import of the file at `path`."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name, None
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        yield node.lineno, node.module, alias.name


def _Problems(path):
  """Why each import of the file at `path` is not a user's import."""
  problems = []
  rel = os.path.relpath(path, ROOT)
  for line, module, name in _Imports(path):
    parts = module.split('.')
    where = f'{rel}:{line}: {module}' + (f'.{name}' if name else '')
    if parts[0] == 'tests':
      problems.append(f'{where} is a test helper')
      continue
    if parts[0] != 'lingvo_gpipe':
      continue
    if len(parts) == 1:
      first = name
    else:
      first = parts[1]
    if first not in _USER_PACKAGES:
      problems.append(
        f'{where} is not among the packages a model is built from '
        f'({", ".join(sorted(_USER_PACKAGES))})'
      )
    private = [p for p in parts[1:] + [name or ''] if p.startswith('_')]
    if private:
      problems.append(f'{where} reaches the private {private[0]}')
  return problems


def testParamsImportOnlyWhatUsersImport():
  files = glob.glob(os.path.join(ROOT, 'params', '**', '*.py'), recursive=True)
  assert files
  problems = [p for f in sorted(files) for p in _Problems(f)]
  assert not problems, (
    'params/ should import the library as a user experiment does: '
    + '; '.join(problems)
  )


def testTheCheckSeesAPrivateOrRunnerImport(tmp_path):
  bad = tmp_path / 'bad.py'
  bad.write_text(
    'from lingvo_gpipe.runners import checkpointer\n'
    'from lingvo_gpipe.core import _tf_internal\n'
    'from lingvo_gpipe.pipeline.engine import _Walk\n'
    'from tests.testing import models\n'
    'from lingvo_gpipe.core import optimizer\n'
  )
  problems = _Problems(str(bad))
  assert len(problems) == 4, problems
  assert 'lingvo_gpipe.runners.checkpointer is not among' in problems[0]
  assert 'private _tf_internal' in problems[1]
  assert 'private _Walk' in problems[2]
  assert 'test helper' in problems[3]
