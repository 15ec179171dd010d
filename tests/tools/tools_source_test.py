"""tools/*.py use the installed package through its public interface."""

import ast
import pathlib

import pytest

_TOOLS = sorted(
  (pathlib.Path(__file__).resolve().parents[2] / 'tools').glob('*.py')
)


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


def testToolsFound():
  assert any(t.name == 'inspect_model.py' for t in _TOOLS)


@pytest.mark.parametrize('path', _TOOLS, ids=lambda p: p.name)
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


@pytest.mark.parametrize('path', _TOOLS, ids=lambda p: p.name)
def testToolUsesNoProtectedMembers(path):
  found = _ProtectedAccesses(ast.parse(path.read_text()))
  assert not found, (
    f'{path.name} reaches into protected members {found}; '
    'add a public method to the library instead.'
  )


def testProtectedAccessCheckCatchesOne():
  tree = ast.parse('x = opt._SlotSpecs(v)\ny = self._a\nz = sys._getframe')
  assert _ProtectedAccesses(tree) == ['1: opt._SlotSpecs']
