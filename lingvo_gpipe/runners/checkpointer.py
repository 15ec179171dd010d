"""Checkpoints keyed by variable names, saved atomically, resumed safely.

Over 500 lines: name mapping, atomic files and the Checkpointer, to be split
by concept.

A checkpoint is a `tf.train.Checkpoint` over a DICT {full variable name:
variable} (plus, where the dataset allows, the input iterator):

  model/<escaped name>/.ATTRIBUTES/VARIABLE_VALUE    one per variable
  iterator/.ATTRIBUTES/ITERATOR_STATE                the input position

`<escaped name>` is the variable name with '.' -> '..' and '/' -> '.S' (how
TensorFlow escapes dict keys), e.g. 'mlp/pipeline/body/layer_0/w' is stored as
'model/mlp.Spipeline.Sbody.Slayer_0.Sw/...'. Variable names do not depend on
how the pipeline is split, so a checkpoint of a model in K=2 cells restores
into the same model in K=1.

Files in the checkpoint directory:

  ckpt-<step>.index, ckpt-<step>.data-*   one checkpoint per saved step
  checkpoint                              the "latest" pointer, in the text
                                          format of `tf.train.latest_checkpoint`

Atomicity: TensorFlow writes the data shards into `ckpt-<step>_temp/`, then
moves them and writes the index last. `Checkpointer.Save` then re-opens the
new checkpoint to verify it, and only then replaces the pointer (temporary
file, fsync, `os.replace`), and only after that deletes checkpoints beyond
the last `max_to_keep`. A crash at any moment leaves the pointer naming a
complete checkpoint; `LatestCheckpoint` also falls back to the newest complete
checkpoint when the pointer is missing or names a broken one.
"""

import os
import re
import shutil
import time

from absl import logging
import tensorflow as tf

__all__ = [
  'CheckpointError',
  'IncompatibleCheckpointError',
  'Checkpointer',
  'RestoreReport',
  'EscapeName',
  'UnescapeName',
  'VariableKey',
  'ReadCheckpointVariables',
  'ListCheckpoints',
  'LatestCheckpoint',
  'IsCompleteCheckpoint',
  'ReadPointer',
  'WritePointer',
  'StepOf',
  'ParseRestoreMap',
  'FineTuneRestore',
  'CheckWritableDir',
]

POINTER = 'checkpoint'
PREFIX = 'ckpt'
_MODEL = 'model'
_ITERATOR = 'iterator'
_VAR_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'
_ITER_KEY = _ITERATOR + '/.ATTRIBUTES/ITERATOR_STATE'
_MAX_LISTED = 10


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or read."""


class IncompatibleCheckpointError(CheckpointError):
  """The checkpoint was written by a model with other variables."""


# -- Names -----------------------------------------------------------------


def EscapeName(name):
  """How tf.train.Checkpoint escapes a dict key: '.' -> '..', '/' -> '.S'."""
  return name.replace('.', '..').replace('/', '.S')


def UnescapeName(escaped):
  return re.sub(
    r'\.(.)', lambda m: '/' if m.group(1) == 'S' else m.group(1), escaped
  )


def VariableKey(name):
  """The checkpoint key of variable `name`."""
  return f'{_MODEL}/{EscapeName(name)}{_VAR_SUFFIX}'


def StepOf(prefix):
  """The step of checkpoint prefix '.../ckpt-<step>' (None if not one)."""
  m = re.match(rf'^{PREFIX}-(\d+)$', os.path.basename(prefix))
  return int(m.group(1)) if m else None


def ReadCheckpointVariables(path):
  """{variable name: (shape list, dtype, key)} of checkpoint `path`.

  Understands this module's name-keyed format and plain name-keyed
  checkpoints (TF1 savers); other objects (the iterator) are left out.
  """
  try:
    reader = tf.train.load_checkpoint(path)
  except (tf.errors.OpError, ValueError) as e:
    raise CheckpointError(f'Cannot read checkpoint {path!r}: {e}') from e
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  out = {}
  for key, shape in shapes.items():
    m = re.match(rf'^{_MODEL}/([^/]+){re.escape(_VAR_SUFFIX)}$', key)
    if m:
      out[UnescapeName(m.group(1))] = (list(shape), dtypes[key], key)
    elif '.ATTRIBUTES' not in key and not key.startswith('_CHECKPOINTABLE'):
      out[key] = (list(shape), dtypes[key], key)
  return out


# -- Finding checkpoints ---------------------------------------------------


def IsCompleteCheckpoint(prefix):
  """True if the index and every data shard of `prefix` exist and parse."""
  shards = tf.io.gfile.glob(prefix + '.data-*-of-*')
  m = re.search(r'-of-(\d+)$', shards[0]) if shards else None
  if (
    not tf.io.gfile.exists(prefix + '.index')
    or not m
    or len(shards) < int(m.group(1))
  ):
    return False
  try:
    tf.train.load_checkpoint(prefix)
    return True
  except (tf.errors.OpError, ValueError):
    return False


def ListCheckpoints(directory):
  """[(step, prefix)] of the complete checkpoints in `directory`, by step."""
  out = []
  for index in tf.io.gfile.glob(os.path.join(directory, PREFIX + '-*.index')):
    prefix = index[: -len('.index')]
    step = StepOf(prefix)
    if step is not None and IsCompleteCheckpoint(prefix):
      out.append((step, prefix))
  return sorted(out)


def ReadPointer(directory):
  """(latest prefix, [all prefixes]) from the pointer file, or (None, [])."""
  try:
    with tf.io.gfile.GFile(os.path.join(directory, POINTER), 'r') as f:
      text = f.read()
  except tf.errors.OpError:  # Missing or unreadable.
    return None, []
  latest, everything = None, []
  for key, value in re.findall(r'^\s*(\w+)\s*:\s*"(.*)"\s*$', text, re.M):
    full = value if os.path.isabs(value) else os.path.join(directory, value)
    if key == 'model_checkpoint_path':
      latest = full
    elif key == 'all_model_checkpoint_paths':
      everything.append(full)
  return latest, everything


def _AtomicWrite(path, text):
  """Writes `text` to `path` so readers see the old or the new file, whole.

  Temporary file, fsync, then an atomic rename over `path` (os.replace; on
  remote file systems TensorFlow's rename), then fsync of the directory.
  """
  tmp = os.path.join(
    os.path.dirname(path), f'.{os.path.basename(path)}.tmp-{os.getpid()}'
  )
  if '://' in path:
    with tf.io.gfile.GFile(tmp, 'w') as f:
      f.write(text)
    return tf.io.gfile.rename(tmp, path, overwrite=True)
  try:
    with open(tmp, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  fd = os.open(os.path.dirname(path) or '.', os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError:
    pass  # Some file systems cannot fsync a directory.
  finally:
    os.close(fd)


def WritePointer(directory, latest, all_prefixes):
  """Atomically points `directory`'s latest checkpoint at `latest`."""
  lines = [f'model_checkpoint_path: "{os.path.basename(latest)}"']
  lines += [
    f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in all_prefixes
  ]
  _AtomicWrite(os.path.join(directory, POINTER), '\n'.join(lines) + '\n')


def LatestCheckpoint(directory):
  """The prefix of the newest restorable checkpoint in `directory`, or None.

  The pointer file decides; when it is missing or names a checkpoint that is
  not complete, the newest complete checkpoint in the directory is used.
  """
  if not directory or not tf.io.gfile.isdir(directory):
    return None
  latest, _ = ReadPointer(directory)
  if latest and IsCompleteCheckpoint(latest):
    return latest
  found = ListCheckpoints(directory)
  if latest:
    logging.warning(
      'Checkpoint pointer in %s names %s, which is incomplete; using %s.',
      directory,
      latest,
      found[-1][1] if found else 'none',
    )
  return found[-1][1] if found else None


def _FreeSpaceText(directory):
  try:
    usage = shutil.disk_usage(directory)
    return f'{usage.free / 2**20:.1f} MiB free on the disk of {directory}'
  except OSError:
    return 'free disk space unknown'


def CheckWritableDir(directory, what='--logdir'):
  """Creates `directory` and checks a file can be written there.

  Raises:
    CheckpointError: naming the directory, the error and the fix.
  """
  try:
    tf.io.gfile.makedirs(directory)
    probe = os.path.join(directory, f'.write_probe-{os.getpid()}')
    with tf.io.gfile.GFile(probe, 'w') as f:
      f.write('ok')
    tf.io.gfile.remove(probe)
  except (OSError, tf.errors.OpError) as e:
    raise CheckpointError(
      f'Cannot write to {what} {directory!r}: {getattr(e, "message", e)} '
      f'({_FreeSpaceText(os.path.dirname(directory) or ".")}). Pass a '
      f'writable {what} with free space.'
    ) from e


def _DeleteCheckpointFiles(prefix):
  for path in tf.io.gfile.glob(prefix + '.*'):
    try:
      tf.io.gfile.remove(path)
    except tf.errors.OpError as e:
      logging.warning('Could not delete %s: %s', path, e)


def _DeleteTemp(prefix):
  temp = prefix + '_temp'
  if tf.io.gfile.exists(temp):
    tf.io.gfile.rmtree(temp)


# -- Compatibility ---------------------------------------------------------


def _Diff(variables, ckpt_vars):
  """Lines describing how the model's variables differ from the checkpoint's."""
  missing = sorted(set(variables) - set(ckpt_vars))
  extra = sorted(set(ckpt_vars) - set(variables))
  mismatch = []
  for name in sorted(set(variables) & set(ckpt_vars)):
    v = variables[name]
    shape, dtype, _ = ckpt_vars[name]
    if list(v.shape.as_list()) != shape or v.dtype.base_dtype != dtype:
      mismatch.append(
        f'{name}: model {v.shape.as_list()} {v.dtype.base_dtype.name}, '
        f'checkpoint {shape} {tf.as_dtype(dtype).name}'
      )
  lines = []
  for title, items in (
    ('in the model but not in the checkpoint', missing),
    ('in the checkpoint but not in the model', extra),
    ('with another shape or dtype', mismatch),
  ):
    if items:
      shown = items[:_MAX_LISTED]
      more = (
        f' ... and {len(items) - _MAX_LISTED} more'
        if len(items) > _MAX_LISTED
        else ''
      )
      lines.append(
        f'  {len(items)} variables {title}: ' + '; '.join(shown) + more
      )
  return lines


class RestoreReport:
  """What a fine-tuning restore did: restored, not restored, unused."""

  def __init__(self, path):
    self.path = path
    self.restored = []  # (model name, checkpoint name)
    self.not_restored = []  # (model name, reason)
    self.unused = []  # checkpoint names nothing was restored from

  def __str__(self):
    lines = [f'Restored {len(self.restored)} variables from {self.path}:']
    lines += [f'  {m} <- {c}' for m, c in self.restored]
    lines.append(
      f'Not restored ({len(self.not_restored)}; they keep their '
      'initial values):'
    )
    lines += [f'  {m}: {why}' for m, why in self.not_restored]
    lines.append(f'Checkpoint variables not used ({len(self.unused)}):')
    lines += [f'  {c}' for c in self.unused]
    return '\n'.join(lines)


def ParseRestoreMap(specs):
  """Parses ['REGEX=>NAME', ...] into [(compiled regex, NAME)].

  REGEX must match a whole model variable name; NAME is the checkpoint name,
  with \\1 / \\g<name> (or Lingvo's %s) standing for the regex's groups.
  """
  rules = []
  for spec in specs or []:
    if '=>' not in spec:
      raise ValueError(
        f'--restore_map entry {spec!r} has no "=>"; write '
        'REGEX=>NAME, e.g. "new/(.*)=>old/\\1".'
      )
    regex, name = spec.split('=>', 1)
    try:
      rules.append((re.compile(regex.strip()), name.strip()))
    except re.error as e:
      raise ValueError(
        f'--restore_map entry {spec!r}: bad regex {regex!r}: {e}.'
      ) from e
  return rules


def _MapName(name, rules):
  if not rules:
    return name
  for regex, target in rules:
    m = regex.fullmatch(name)
    if m:
      if '%' in target and '\\' not in target:
        return target % m.groups()
      return m.expand(target)
  return None


def FineTuneRestore(variables, path, rules=None, skip=()):
  """Assigns model variables from checkpoint `path` through name `rules`.

  Args:
    variables: {model variable name: tf.Variable}.
    path: checkpoint prefix, or a directory (its latest checkpoint, looking
      in `<path>/train` too).
    rules: [(regex, name)] from `ParseRestoreMap`; none: same names.
    skip: model variable names never restored (e.g. the global step).

  Returns:
    A RestoreReport.
  """
  prefix = path
  if tf.io.gfile.isdir(path):
    prefix = LatestCheckpoint(path) or LatestCheckpoint(
      os.path.join(path, 'train')
    )
    if prefix is None:
      raise CheckpointError(
        f'--restore_from={path!r} is a directory without '
        'a complete checkpoint; pass a checkpoint prefix '
        '(.../ckpt-<step>) or a train directory.'
      )
  ckpt_vars = ReadCheckpointVariables(prefix)
  reader = tf.train.load_checkpoint(prefix)
  report = RestoreReport(prefix)
  used = set()
  for name in sorted(variables):
    var = variables[name]
    if name in skip:
      report.not_restored.append((name, 'never restored when fine-tuning'))
      continue
    source = _MapName(name, rules)
    if source is None:
      report.not_restored.append((name, 'no --restore_map rule matches it'))
      continue
    if source not in ckpt_vars:
      report.not_restored.append((name, f'{source!r} is not in the checkpoint'))
      continue
    shape, dtype, key = ckpt_vars[source]
    if shape != var.shape.as_list() or dtype != var.dtype.base_dtype:
      report.not_restored.append(
        (
          name,
          f'checkpoint {source!r} has shape {shape} '
          f'{tf.as_dtype(dtype).name}, the model '
          f'{var.shape.as_list()} {var.dtype.base_dtype.name}',
        )
      )
      continue
    var.assign(reader.get_tensor(key))
    used.add(source)
    report.restored.append((name, source))
  report.unused = sorted(set(ckpt_vars) - used)
  return report


# -- The checkpointer ------------------------------------------------------


class Checkpointer:
  """Saves and restores the model variables (and input position) by name.

  Usage (the trainer):

    ckpt = Checkpointer(train_dir, model.VariablesByName(), iterator=it,
                        max_to_keep=5, save_interval_steps=100)
    step = ckpt.Restore()      # resume, or None for a fresh start
    ...
    ckpt.MaybeSave(step)       # every step; saves when due
    ckpt.Save(step)            # at exit
  """

  def __init__(
    self,
    directory,
    variables,
    iterator=None,
    max_to_keep=5,
    save_interval_steps=None,
    save_interval_seconds=None,
    writable=True,
  ):
    """Constructor.

    Args:
      directory: where checkpoints live (created when `writable`).
      variables: {full variable name: tf.Variable}, including the global
        step and the optimizer slots.
      iterator: an input iterator to checkpoint, or None.
      max_to_keep: how many recent checkpoints to keep (None or 0: all).
      save_interval_steps: `MaybeSave` saves every this many steps.
      save_interval_seconds: ... or when this much time has passed.
      writable: False for readers (the evaler): no directory checks or
        cleanup.
    """
    self._dir = directory
    self._vars = dict(variables)
    self._iterator = iterator
    self._max_to_keep = max_to_keep
    self._interval_steps = save_interval_steps
    self._interval_secs = save_interval_seconds
    self._last_step = None
    self._last_time = time.time()
    self._kept = []
    if writable:
      CheckWritableDir(directory)
      self._Cleanup()

  @property
  def directory(self):
    return self._dir

  @property
  def variables(self):
    """{name: variable} this checkpointer saves and restores."""
    return dict(self._vars)

  @property
  def last_saved_step(self):
    return self._last_step

  def _Cleanup(self):
    """Removes what crashed saves left; adopts the pointer's checkpoint list.

    Removed: `ckpt-*_temp` shard directories, temporary pointer files,
    incomplete checkpoints, complete
    ones newer than the latest (a save that died before its pointer update:
    they would be overwritten in place) and, when the pointer lists the kept
    checkpoints, unlisted older ones (a sweep that died half-way).
    """
    for temp in tf.io.gfile.glob(os.path.join(self._dir, PREFIX + '-*_temp')):
      tf.io.gfile.rmtree(temp)
    for tmp in tf.io.gfile.glob(os.path.join(self._dir, f'.{POINTER}.tmp-*')):
      tf.io.gfile.remove(tmp)  # A pointer update that died before its rename.
    latest, listed = ReadPointer(self._dir)
    newest = LatestCheckpoint(self._dir)
    newest_step = StepOf(newest) if newest else -1
    complete = {p for _, p in ListCheckpoints(self._dir)}
    for path in tf.io.gfile.glob(os.path.join(self._dir, PREFIX + '-*.*')):
      prefix = re.sub(r'\.(index|data-\d+-of-\d+)$', '', path)
      step = StepOf(prefix)
      if step is None or prefix == newest:
        continue
      if (
        prefix not in complete
        or step > newest_step
        or (listed and prefix not in listed)
      ):
        logging.info(
          'Removing %s.*, left by an interrupted save or sweep.', prefix
        )
        _DeleteCheckpointFiles(prefix)
        complete.discard(prefix)
    self._kept = [p for p in listed if p in complete and p != newest]
    self._kept += [newest] if newest else []
    if newest and newest != latest:
      WritePointer(self._dir, newest, self._kept)

  def _Checkpoint(self, with_iterator):
    kwargs = {_MODEL: self._vars}
    if with_iterator and self._iterator is not None:
      kwargs[_ITERATOR] = self._iterator
    return tf.train.Checkpoint(**kwargs)

  # -- Saving ---------------------------------------------------------------

  def ShouldSave(self, step):
    if step == self._last_step:
      return False
    if self._interval_steps and (
      step - (self._last_step or 0) >= self._interval_steps
    ):
      return True
    return bool(
      self._interval_secs
      and time.time() - self._last_time >= self._interval_secs
    )

  def MaybeSave(self, step):
    """Saves when `save_interval_steps`/`_seconds` say so; returns the path."""
    return self.Save(step) if self.ShouldSave(step) else None

  def Save(self, step):
    """Writes checkpoint `ckpt-<step>` and points `latest` at it.

    Returns:
      The checkpoint prefix.

    Raises:
      CheckpointError: naming the directory and the free space, when the
        write fails (e.g. a full disk).
    """
    step = int(step)
    prefix = os.path.join(self._dir, f'{PREFIX}-{step}')
    if step == self._last_step or prefix in self._kept:
      return prefix  # Already saved: never overwrite a pointed checkpoint.
    start = time.time()
    try:
      try:
        self._Checkpoint(True).write(prefix)
      except (
        tf.errors.FailedPreconditionError,
        tf.errors.UnimplementedError,
        tf.errors.InvalidArgumentError,
      ) as e:
        if self._iterator is None:
          raise
        logging.warning(
          'The input iterator cannot be checkpointed (%s); '
          'saving variables only. A restart begins the input '
          'anew.',
          str(e).splitlines()[0],
        )
        self._iterator = None
        _DeleteTemp(prefix)
        self._Checkpoint(False).write(prefix)
      if not IsCompleteCheckpoint(prefix):
        raise CheckpointError(
          f'Checkpoint {prefix} is incomplete after writing it.'
        )
    except (OSError, tf.errors.OpError, CheckpointError) as e:
      _DeleteTemp(prefix)
      _DeleteCheckpointFiles(prefix)
      raise CheckpointError(
        f'Could not write checkpoint {prefix!r} at step {step}: '
        f'{getattr(e, "message", e)} ({_FreeSpaceText(self._dir)}). Free '
        'space or pass another --logdir; the previous checkpoint '
        f'{self._kept[-1] if self._kept else "(none)"} is intact.'
      ) from e
    self._kept.append(prefix)
    try:
      WritePointer(self._dir, prefix, self._kept)
    except OSError as e:
      self._kept.pop()
      raise CheckpointError(
        f'Could not update the checkpoint pointer in {self._dir!r}: {e} '
        f'({_FreeSpaceText(self._dir)}).'
      ) from e
    self._Sweep()
    self._last_step = step
    self._last_time = time.time()
    logging.info('Saved checkpoint %s in %.2fs.', prefix, time.time() - start)
    return prefix

  def _Sweep(self):
    if not self._max_to_keep or len(self._kept) <= self._max_to_keep:
      return
    old = self._kept[: -self._max_to_keep]
    self._kept = self._kept[-self._max_to_keep :]
    WritePointer(self._dir, self._kept[-1], self._kept)
    for prefix in old:
      _DeleteCheckpointFiles(prefix)

  # -- Restoring ------------------------------------------------------------

  def CheckCompatible(self, prefix):
    """Raises IncompatibleCheckpointError unless names/shapes/dtypes agree."""
    lines = _Diff(self._vars, ReadCheckpointVariables(prefix))
    if lines:
      raise IncompatibleCheckpointError(
        f'The checkpoint {prefix} was written by a different model; its '
        "variables differ from this model's:\n"
        + '\n'.join(lines)
        + f'\nUse a new --logdir for this model, or start it from that '
        f'checkpoint with --restore_from={prefix} (and --restore_map to '
        'rename variables).'
      )

  def RestoreFrom(self, prefix, strict=True):
    """Restores `prefix` into the variables (and iterator if it was saved).

    Args:
      prefix: checkpoint prefix.
      strict: require every checkpoint variable to be in the model and vice
        versa; else only the model's variables must be in the checkpoint.

    Returns:
      The checkpoint's step (from its name), or None.
    """
    if strict:
      self.CheckCompatible(prefix)
    else:
      ckpt_vars = ReadCheckpointVariables(prefix)
      lines = _Diff(
        self._vars, {k: v for k, v in ckpt_vars.items() if k in self._vars}
      )
      if lines:
        raise IncompatibleCheckpointError(
          f'Cannot restore {prefix} into this model:\n' + '\n'.join(lines)
        )
    reader = tf.train.load_checkpoint(prefix)
    has_iterator = reader.has_tensor(_ITER_KEY)
    if self._iterator is not None and has_iterator:
      try:
        status = self._Checkpoint(True).read(prefix)
        status.assert_existing_objects_matched()
        status.expect_partial()
        return StepOf(prefix)
      except (tf.errors.OpError, AssertionError, ValueError) as e:
        logging.warning(
          'Could not restore the input position from %s (%s); '
          'the input begins anew.',
          prefix,
          str(e).splitlines()[0],
        )
    status = self._Checkpoint(False).read(prefix)
    status.assert_existing_objects_matched()
    status.expect_partial()
    return StepOf(prefix)

  def Restore(self):
    """Restores the latest checkpoint of the directory.

    Returns:
      The restored prefix, or None when the directory holds no checkpoint.

    Raises:
      IncompatibleCheckpointError: the checkpoint is of another model.
    """
    prefix = LatestCheckpoint(self._dir)
    if prefix is None:
      return None
    self.RestoreFrom(prefix)
    self._last_step = StepOf(prefix)
    self._last_time = time.time()
    if prefix not in self._kept:
      self._kept.append(prefix)
    logging.info('Restored %s.', prefix)
    return prefix
