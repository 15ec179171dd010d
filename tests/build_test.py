"""BUILD and setup.py describe the same project as the source tree."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _Read(name):
  with open(os.path.join(ROOT, name), encoding='utf-8') as f:
    return f.read()


def _Files(pattern):
  return sorted(os.path.relpath(p, ROOT) for p in glob.glob(
      os.path.join(ROOT, pattern), recursive=True))


def _BuildSrcs():
  return set(re.findall(r'srcs = \["([^"]+)"\]', _Read('BUILD')))


def testEveryModuleTestAndToolIsInBuild():
  srcs = _BuildSrcs()
  files = (_Files('lingvo_gpipe/**/*.py') + _Files('params/**/*.py') +
           _Files('tools/*.py') +
           [f for f in _Files('tests/**/*.py') if not f.endswith('__init__.py')])
  missing = [f for f in files if f not in srcs]
  assert not missing, (
      'Files not named in BUILD (add a py_library / py_test / py_binary with '
      f'srcs = ["<file>"] for each): {missing}')
  stale = [s for s in srcs if not os.path.exists(os.path.join(ROOT, s))]
  assert not stale, f'BUILD names files that do not exist: {stale}'


def testTestsArePyTestsAndToolsArePyBinaries():
  build = _Read('BUILD')
  for f in _Files('tests/**/*_test.py'):
    assert re.search(r'py_test\(\n\s+name = "[^"]+",\n\s+srcs = \["' +
                     re.escape(f) + '"', build), f
  for f in _Files('tools/*.py'):
    assert re.search(r'py_binary\(\n\s+name = "[^"]+",\n\s+srcs = \["' +
                     re.escape(f) + '"', build), f


def _SetupCall():
  tree = ast.parse(_Read('setup.py'))
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'setup':
      return {k.arg: k.value for k in node.keywords}
  raise AssertionError('setup.py has no setuptools.setup(...) call')


def testConsoleScriptsAreBuildBinaries():
  call = _SetupCall()
  scripts = ast.literal_eval(call['entry_points'])['console_scripts']
  build = _Read('BUILD')
  for entry in scripts:
    name, target = [s.strip() for s in entry.split('=')]
    module = target.split(':')[0]
    path = module.replace('.', '/') + '.py'
    assert os.path.exists(os.path.join(ROOT, path)), entry
    assert re.search(r'py_binary\(\n\s+name = "' + re.escape(name) +
                     r'",\n\s+srcs = \["' + re.escape(path) + '"', build), (
                         f'{name} ({path}) has no py_binary in BUILD')


def testEveryPackageIsInstalled():
  import setuptools  # pylint: disable=g-import-not-at-top
  found = set(setuptools.find_packages(
      ROOT, include=['lingvo_gpipe', 'lingvo_gpipe.*', 'params', 'params.*']))
  dirs = {os.path.dirname(f).replace('/', '.') for f in
          _Files('lingvo_gpipe/**/*.py') + _Files('params/**/*.py')}
  missing = sorted(d for d in dirs if d not in found)
  assert not missing, (f'Folders with modules but no __init__.py, so setup.py '
                       f'would not install them: {missing}')
