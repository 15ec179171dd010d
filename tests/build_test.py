"""BUILD and setup.py describe the same project as the source tree, and the
library's imports form no cycle."""

import ast
import glob
import importlib.util
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _GenBuild():
  spec = importlib.util.spec_from_file_location(
    'gen_build', os.path.join(ROOT, 'tools', 'gen_build.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _Read(name):
  with open(os.path.join(ROOT, name), encoding='utf-8') as f:
    return f.read()


def _Files(pattern):
  return sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
  )


def _BuildSrcs():
  return set(re.findall(r'srcs = \["([^"]+)"\]', _Read('BUILD')))


def testEveryModuleTestAndToolIsInBuild():
  srcs = _BuildSrcs()
  files = (
    _Files('lingvo_gpipe/**/*.py')
    + _Files('params/**/*.py')
    + _Files('tools/*.py')
    + [f for f in _Files('tests/**/*.py') if not f.endswith('__init__.py')]
  )
  missing = [f for f in files if f not in srcs]
  assert not missing, (
    'Files not named in BUILD (add a py_library / py_test / py_binary with '
    f'srcs = ["<file>"] for each): {missing}'
  )
  stale = [s for s in srcs if not os.path.exists(os.path.join(ROOT, s))]
  assert not stale, f'BUILD names files that do not exist: {stale}'


def testTestsArePyTestsAndToolsArePyBinaries():
  build = _Read('BUILD')
  for f in _Files('tests/**/*_test.py'):
    assert re.search(
      r'py_test\(\n\s+name = "[^"]+",\n\s+srcs = \["' + re.escape(f) + '"',
      build,
    ), f
  for f in _Files('tools/*.py'):
    assert re.search(
      r'py_binary\(\n\s+name = "[^"]+",\n\s+srcs = \["' + re.escape(f) + '"',
      build,
    ), f


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
    assert re.search(
      r'py_binary\(\n\s+name = "'
      + re.escape(name)
      + r'",\n\s+srcs = \["'
      + re.escape(path)
      + '"',
      build,
    ), f'{name} ({path}) has no py_binary in BUILD'


def InstalledPackages(root):
  """The packages setup.py installs from the tree at `root` (its
  `packages=` expression, evaluated there)."""
  import setuptools  # pylint: disable=g-import-not-at-top

  expr = ast.Expression(_SetupCall()['packages'])
  cwd = os.getcwd()
  os.chdir(root)
  try:
    return set(
      eval(compile(expr, 'setup.py', 'eval'), {'setuptools': setuptools})
    )
  finally:
    os.chdir(cwd)


def testEveryPackageIsInstalled():
  found = InstalledPackages(ROOT)
  dirs = {
    os.path.dirname(f).replace('/', '.')
    for f in _Files('lingvo_gpipe/**/*.py') + _Files('params/**/*.py')
  }
  missing = sorted(d for d in dirs if d not in found)
  assert not missing, (
    f'Folders with modules that setup.py would not install: {missing}. '
    'Give a folder under lingvo_gpipe/ an __init__.py.'
  )
  assert not [p for p in found if '__pycache__' in p], found


def testNewParamsTopicFoldersAreInstalled(tmp_path):
  """A topic folder under params/ is installed with or without an
  __init__.py: no edit of setup.py."""
  for topic, init in (('mytopic', True), ('bare', False)):
    folder = tmp_path / 'params' / topic
    folder.mkdir(parents=True)
    (folder / 'mymodel.py').write_text('')
    if init:
      (folder / '__init__.py').write_text('')
  (tmp_path / 'params' / '__init__.py').write_text('')
  (tmp_path / 'params' / 'bare' / '__pycache__').mkdir()
  assert InstalledPackages(tmp_path) == {
    'params',
    'params.mytopic',
    'params.bare',
  }


def testBuildDepsAreTheImports():
  build = _Read('BUILD')
  assert _GenBuild().Generate(build) == build, (
    "BUILD deps differ from the sources' imports: run python tools/gen_build.py"
  )


def testLibraryHasNoImportCycle():
  gen = _GenBuild()
  cycle = gen.FindCycle(gen.LibraryGraph(gen.ImportGraph()))
  assert cycle is None, (
    'Import cycle among library modules (deferred imports count): '
    + ' -> '.join(cycle)
    + '. Move the shared code into a module both '
    'can import.'
  )


def testFindCycleSeesDeferredImports(tmp_path):
  gen = _GenBuild()
  pkg = tmp_path / 'lingvo_gpipe'
  pkg.mkdir()
  (pkg / '__init__.py').write_text('')
  (pkg / 'a.py').write_text('from lingvo_gpipe import b\n')
  (pkg / 'b.py').write_text(
    textwrap.dedent("""\
      def F():
        from lingvo_gpipe import c
        return c
      """)
  )
  (pkg / 'c.py').write_text('import lingvo_gpipe.a\n')
  (pkg / 'd.py').write_text('import lingvo_gpipe.c\n')
  graph = gen.LibraryGraph(gen.ImportGraph(str(tmp_path)))
  assert graph['lingvo_gpipe/d.py'] == {'lingvo_gpipe/c.py'}
  cycle = gen.FindCycle(graph)
  assert cycle == [
    'lingvo_gpipe/a.py',
    'lingvo_gpipe/b.py',
    'lingvo_gpipe/c.py',
    'lingvo_gpipe/a.py',
  ]
  (pkg / 'c.py').write_text('import os\n')
  assert gen.FindCycle(gen.LibraryGraph(gen.ImportGraph(str(tmp_path)))) is None


# The import layering, lowest first: a module imports only modules of its own
# or a lower rank (docs/architecture.md, "Layout").
_LAYERS = {
  'core': 0,
  'compat': 0,
  'layers': 1,
  'input': 1,
  'cells': 1,
  'pipeline': 2,
  'planning': 2,
  'gpipe_layers': 3,
  'models': 4,
  'model_registry': 4,
  'runners': 5,
  'trainer': 6,
  'tools': 7,
  'params': 7,
}
# The Lingvo import-path facades re-export the pipeline and the layers.
_FACADES = {
  'lingvo_gpipe/core/gpipe.py',
  'lingvo_gpipe/core/layers.py',
  'lingvo_gpipe/core/layers_with_attention.py',
  'lingvo_gpipe/core/layers_with_gpipe.py',
  'lingvo_gpipe/core/batch_major_attention.py',
}


def _Layer(path):
  parts = path[: -len('.py')].split('/')
  if parts[0] == 'params':
    return 'params'
  if len(parts) == 2 and parts[1].startswith('trainer_'):
    return 'trainer'  # The binary's own modules: trainer_flags.py, ...
  return parts[1]


def _UpwardImports(graph):
  """['a -> b'] of the imports in `graph` that go to a higher layer."""
  return [
    f'{f} -> {d}'
    for f, deps in sorted(graph.items())
    if f not in _FACADES
    for d in sorted(deps)
    if _LAYERS.get(_Layer(d), -1) > _LAYERS.get(_Layer(f), -1)
  ]


def testLibraryImportsFollowTheLayers():
  graph = _GenBuild().LibraryGraph(_GenBuild().ImportGraph())
  unknown = sorted({_Layer(f) for f in graph} - set(_LAYERS) - {'__init__'})
  assert not unknown, (
    f'Packages {unknown} have no rank in _LAYERS of tests/build_test.py: '
    'give each one, and describe it in docs/architecture.md.'
  )
  upward = _UpwardImports(graph)
  assert not upward, (
    'Library modules importing a higher layer '
    '(core -> layers, input, cells -> pipeline, planning -> gpipe_layers '
    '-> models '
    '-> runners -> trainer -> '
    f'tools, params): {upward}. Move the shared code down a layer.'
  )


# General modules know no particular model or input: a model's or input's
# behaviour reaches them through the task's or generator's methods.
_GENERAL = (
  'core',
  'compat',
  'layers',
  'cells',
  'pipeline',
  'planning',
  'gpipe_layers',
  'runners',
  'trainer',
)
_SPECIFIC = ('models', 'input')


def testGeneralModulesImportNoSpecificModelOrInput():
  graph = _GenBuild().LibraryGraph(_GenBuild().ImportGraph())
  found = [
    f'{f} -> {d}'
    for f, deps in sorted(graph.items())
    if _Layer(f) in _GENERAL and f not in _FACADES
    for d in sorted(deps)
    if _Layer(d) in _SPECIFIC
  ]
  assert not found, (
    f'General modules importing a particular model or input: {found}. '
    'Ask the task or the input generator instead (a method they override).'
  )


# The runtime (pipeline/) asks the planning package for K, M and the split
# through planning/auto.py only; planning may read the runtime's schedules.
_PLANNING_ENTRY = 'lingvo_gpipe/planning/auto.py'


def _RuntimeIntoPlanning(graph):
  return [
    f'{f} -> {d}'
    for f, deps in sorted(graph.items())
    if _Layer(f) == 'pipeline'
    for d in sorted(deps)
    if _Layer(d) == 'planning' and d != _PLANNING_ENTRY
  ]


def testRuntimeImportsPlanningOnlyThroughAuto():
  graph = _GenBuild().LibraryGraph(_GenBuild().ImportGraph())
  found = _RuntimeIntoPlanning(graph)
  assert not found, (
    f'Runtime modules importing the planning package directly: {found}. '
    f'Ask through {_PLANNING_ENTRY} (a function there) instead.'
  )
  layer = 'lingvo_gpipe/pipeline/pipelining_layer.py'
  assert _PLANNING_ENTRY in graph[layer]
  assert _RuntimeIntoPlanning(
    {layer: {_PLANNING_ENTRY, 'lingvo_gpipe/planning/balance.py'}}
  ) == [f'{layer} -> lingvo_gpipe/planning/balance.py']


def testLayerCheckSeesAnUpwardImport():
  cluster = 'lingvo_gpipe/core/cluster.py'
  placement = 'lingvo_gpipe/pipeline/placement.py'
  gpipe = 'lingvo_gpipe/core/gpipe.py'
  evaluation = 'lingvo_gpipe/models/mt/evaluation.py'
  checkpointer = 'lingvo_gpipe/runners/checkpointer.py'
  trainer_errors = 'lingvo_gpipe/trainer_errors.py'
  cell_function = 'lingvo_gpipe/cells/cell_function.py'
  engine = 'lingvo_gpipe/pipeline/engine.py'
  graph = {
    cluster: {placement},
    placement: {cluster},
    cell_function: {engine},
    engine: {cell_function},
    gpipe: {placement},
    evaluation: {checkpointer},
    checkpointer: {trainer_errors},
    trainer_errors: {'lingvo_gpipe/trainer.py', checkpointer},
    'params/mt/multilingual.py': {evaluation, 'lingvo_gpipe/trainer.py'},
  }
  assert _UpwardImports(graph) == [
    f'{cell_function} -> {engine}',
    f'{cluster} -> {placement}',
    f'{evaluation} -> {checkpointer}',
    f'{checkpointer} -> {trainer_errors}',
  ]


def testTestsImportNoOtherTestModule():
  graph = _GenBuild().ImportGraph()
  crossed = [
    f'{f} imports {d}'
    for f, deps in sorted(graph.items())
    if f.startswith('tests/')
    for d in sorted(deps)
    if d.endswith('_test.py')
  ]
  assert not crossed, (
    f'Test modules importing other test modules: {crossed}. Move the '
    'shared helpers to tests/testing/ and import them from there.'
  )
