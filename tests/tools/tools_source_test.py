"""The tools (lingvo_gpipe/tools/*.py and the tools/*.py of a checkout) use
the installed package through its public interface, and import each other
as modules, never by file path."""

import ast
import pathlib

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_TOOLS = sorted(_ROOT.glob('tools/*.py')) + sorted(
  p for p in _ROOT.glob('lingvo_gpipe/tools/*.py') if p.name != '__init__.py'
)
# What loads Python code from a file path instead of importing a module.
_LOAD_BY_PATH = ('spec_from_file_location', 'run_path', 'SourceFileLoader')


def _ProtectedAccesses(tree):
  """['line: X._name'] of attribute reads of another object's `_name`."""
  out = []
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and node.attr.startswith('_')
      and not node.attr.startswith('__')
      and not (
        isinstance(node.value, ast.Name)
        and node.value.id in ('self', 'cls', 'sys', 'os')
      )
    ):
      out.append(f'{node.lineno}: {ast.unparse(node)}')
  return out


def _LoadsByPath(tree):
  """['line: call'] of the calls in `tree` that load code from a file."""
  return [
    f'{node.lineno}: {ast.unparse(node.func)}'
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and isinstance(node.func, (ast.Attribute, ast.Name))
    and getattr(node.func, 'attr', getattr(node.func, 'id', ''))
    in _LOAD_BY_PATH
  ]


def _IdsOf(path):
  return str(path.relative_to(_ROOT))


def testToolsFound():
  names = {str(t.relative_to(_ROOT)) for t in _TOOLS}
  assert 'tools/inspect_model.py' in names
  assert 'lingvo_gpipe/tools/plan.py' in names


@pytest.mark.parametrize('path', _TOOLS, ids=_IdsOf)
def testToolLoadsNoCodeByFilePath(path):
  found = _LoadsByPath(ast.parse(path.read_text()))
  assert not found, (
    f'{path.name} loads code from a file path ({found}); tools are modules '
    'of lingvo_gpipe.tools: import the other tool instead.'
  )


def testLoadByPathCheckCatchesOne():
  tree = ast.parse(
    'import importlib.util, runpy\n'
    "s = importlib.util.spec_from_file_location('t', 'tools/t.py')\n"
    "runpy.run_path('tools/t.py')\nimport tools.x\n"
  )
  assert _LoadsByPath(tree) == [
    '2: importlib.util.spec_from_file_location',
    '3: runpy.run_path',
  ]


@pytest.mark.parametrize('path', _TOOLS, ids=_IdsOf)
def testToolDoesNotEditSysPath(path):
  tree = ast.parse(path.read_text())
  edits = [
    ast.unparse(n)
    for n in ast.walk(tree)
    if isinstance(n, ast.Attribute)
    and n.attr == 'path'
    and isinstance(n.value, ast.Name)
    and n.value.id == 'sys'
  ]
  assert not edits, (
    f'{path.name} edits sys.path ({edits}); the package is '
    'installed (pip install -e .), import it directly.'
  )


@pytest.mark.parametrize('path', _TOOLS, ids=_IdsOf)
def testToolUsesNoProtectedMembers(path):
  found = _ProtectedAccesses(ast.parse(path.read_text()))
  assert not found, (
    f'{path.name} reaches into protected members {found}; '
    'add a public method to the library instead.'
  )


def testProtectedAccessCheckCatchesOne():
  tree = ast.parse('x = opt._SlotSpecs(v)\ny = self._a\nz = sys._getframe')
  assert _ProtectedAccesses(tree) == ['1: opt._SlotSpecs']
