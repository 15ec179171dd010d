r"""Regenerates the deps of BUILD from the sources' imports, and finds cycles.

  python tools/gen_build.py          # rewrites BUILD in place
  python tools/gen_build.py --check  # exit 1 if BUILD is stale or cyclic

Every Python file of the project is one target, named by its path
(`lingvo_gpipe/core/py_utils.py` -> `lingvo_gpipe_core_py_utils`); its deps
are the project modules it imports, anywhere in the file (a deferred import
inside a function is still a dependency). Tests also depend on
`tests/conftest.py`; a py_binary whose file is also a py_library depends on
that library. New files get a target (py_test for tests/**/*_test.py,
py_binary for tools/*.py, else py_library); targets of deleted files go.
Data files (Lingvo model files of tools/lingvo_models/) get a filegroup.
Only the standard library is used, so this runs before anything is installed.
"""

import argparse
import ast
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATTERNS = (
  'lingvo_gpipe/**/*.py',
  'params/**/*.py',
  'tools/*.py',
  'tests/**/*.py',
)
_LIBRARY_DIRS = ('lingvo_gpipe/', 'params/')
# Files that are data, not modules of this project: {filegroup: pattern}.
# tools/lingvo_models/ holds model files written against Lingvo's API, which
# tools/lingvo_crosscheck.py runs under Lingvo and, ported, here.
_DATA_GROUPS = {'tools_lingvo_models': 'tools/lingvo_models/*.py'}
_CONFTEST = 'tests/conftest.py'


def SourceFiles(root=ROOT):
  files = set()
  for pattern in _PATTERNS:
    files.update(
      os.path.relpath(p, root)
      for p in glob.glob(os.path.join(root, pattern), recursive=True)
    )
  return sorted(
    f
    for f in files
    if not (f.startswith('tests/') and f.endswith('__init__.py'))
  )


def TargetName(path):
  return path[: -len('.py')].replace('/', '_').replace('__init__', 'init')


def _Resolve(module, files):
  """The project file of dotted `module`, or None."""
  base = module.replace('.', '/')
  for cand in (base + '.py', base + '/__init__.py'):
    if cand in files:
      return cand
  return None


def Imports(path, files, root=ROOT):
  """The project files `path` imports (anywhere in it), without itself."""
  with open(os.path.join(root, path), encoding='utf-8') as f:
    tree = ast.parse(f.read(), path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        dep = _Resolve(alias.name, files)
        if dep:
          out.add(dep)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        dep = _Resolve(f'{node.module}.{alias.name}', files) or _Resolve(
          node.module, files
        )
        if dep:
          out.add(dep)
  out.discard(path)
  return out


def ImportGraph(root=ROOT):
  """{file: set(files it imports)} over the project's sources."""
  files = set(SourceFiles(root))
  return {f: Imports(f, files, root) for f in sorted(files)}


def FindCycle(graph):
  """One import cycle [a, b, ..., a] of `graph`, or None."""
  state = {}
  for start in sorted(graph):
    if start in state:
      continue
    stack = [(start, iter(sorted(graph[start])))]
    path = [start]
    state[start] = 'open'
    while stack:
      node, children = stack[-1]
      child = next(children, None)
      if child is None:
        state[node] = 'done'
        stack.pop()
        path.pop()
        continue
      if state.get(child) == 'open':
        return path[path.index(child) :] + [child]
      if child not in state and child in graph:
        state[child] = 'open'
        stack.append((child, iter(sorted(graph[child]))))
        path.append(child)
  return None


def LibraryGraph(graph):
  """The part of `graph` among library modules (lingvo_gpipe/, params/)."""
  lib = {f for f in graph if f.startswith(_LIBRARY_DIRS)}
  return {f: {d for d in graph[f] if d in lib} for f in lib}


_BLOCK = re.compile(r'(py_library|py_test|py_binary)\(\n(.*?)\n\)\n', re.DOTALL)


def _Deps(kind, src, graph, libraries):
  if kind == 'py_binary' and src in libraries:
    return [TargetName(src)]
  deps = set(graph.get(src, ()))
  if src.startswith('tests/') and src != _CONFTEST:
    deps.add(_CONFTEST)
  return sorted(TargetName(d) for d in deps)


def _Format(kind, name, src, deps):
  lines = [f'{kind}(', f'    name = "{name}",', f'    srcs = ["{src}"],']
  if kind != 'py_library':
    lines.append(f'    main = "{src}",')
  if deps:
    lines.append('    deps = [' + ', '.join(f'":{d}"' for d in deps) + '],')
  return '\n'.join(lines) + '\n)\n'


def Generate(build_text, root=ROOT):
  """BUILD's text with every target's deps regenerated from the sources."""
  graph = ImportGraph(root)
  head_end = _BLOCK.search(build_text).start()
  head = build_text[:head_end]
  blocks = []
  for m in _BLOCK.finditer(build_text):
    kind, body = m.group(1), m.group(2)
    name = re.search(r'name = "([^"]+)"', body).group(1)
    src = re.search(r'srcs = \["([^"]+)"\]', body).group(1)
    if src in graph:
      blocks.append((kind, name, src))
  libraries = {s for k, _, s in blocks if k == 'py_library'}
  have = {s for _, _, s in blocks}
  for src in graph:
    if src in have:
      continue
    if src.startswith('tests/') and src.endswith('_test.py'):
      kind = 'py_test'
    elif src.startswith('tools/'):
      kind = 'py_binary'
    else:
      kind = 'py_library'
      libraries.add(src)
    # After the last target of the same folder, or at the end.
    at = len(blocks)
    for i, (_, _, s) in enumerate(blocks):
      if os.path.dirname(s) == os.path.dirname(src) and s < src:
        at = i + 1
    blocks.insert(at, (kind, TargetName(src), src))
  text = '\n'.join(
    [_Format(k, n, s, _Deps(k, s, graph, libraries)) for k, n, s in blocks]
    + _DataBlocks(root)
  )
  return head + text


def _DataBlocks(root):
  """A filegroup per entry of _DATA_GROUPS, listing its files."""
  out = []
  for name, pattern in sorted(_DATA_GROUPS.items()):
    files = sorted(
      os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern))
    )
    if files:
      srcs = ''.join(f'        "{f}",\n' for f in files)
      out.append(
        f'filegroup(\n    name = "{name}",\n    srcs = [\n{srcs}    ],\n)\n'
      )
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--check',
    action='store_true',
    help='Fail if BUILD is stale or the library is cyclic.',
  )
  args = parser.parse_args(argv)
  path = os.path.join(ROOT, 'BUILD')
  with open(path, encoding='utf-8') as f:
    old = f.read()
  new = Generate(old)
  cycle = FindCycle(LibraryGraph(ImportGraph()))
  if cycle:
    print('Import cycle: ' + ' -> '.join(cycle), file=sys.stderr)
  if args.check:
    if new != old:
      print('BUILD is stale: run python tools/gen_build.py', file=sys.stderr)
    return 1 if (new != old or cycle) else 0
  with open(path, 'w', encoding='utf-8') as f:
    f.write(new)
  return 1 if cycle else 0


if __name__ == '__main__':
  sys.exit(main())
