"""Checkpoints keyed by variable names, saved atomically, resumed safely.

A checkpoint is a `tf.train.Checkpoint` over a DICT {full variable name:
variable} (plus, where the dataset allows, the input iterator):

  model/<escaped name>/.ATTRIBUTES/VARIABLE_VALUE    one per variable
  iterator/.ATTRIBUTES/ITERATOR_STATE                the input position

`<escaped name>` is the variable name with '.' -> '..' and '/' -> '.S' (how
TensorFlow escapes dict keys), e.g. 'mlp/pipeline/body/layer_0/w' is stored as
'model/mlp.Spipeline.Sbody.Slayer_0.Sw/...'. Variable names do not depend on
how the pipeline is split, so a checkpoint of a model in K=2 cells restores
into the same model in K=1.

This module is the Checkpointer; the format and name mapping live in
`checkpoint_names`, the files, pointer and fsyncs in `checkpoint_files`,
and their public names are re-exported here.

Files in the checkpoint directory:

  ckpt-<step>.index, ckpt-<step>.data-*   one checkpoint per saved step
  checkpoint                              the "latest" pointer, in the text
                                          format of `tf.train.latest_checkpoint`

Atomicity: TensorFlow writes the data shards into `ckpt-<step>_temp/`, then
moves them and writes the index last. `Checkpointer.Save` then re-opens the
new checkpoint to verify it, fsyncs its data and index files and their
directory, and only then replaces the pointer (temporary file, fsync,
`os.replace`, fsync of the directory), and only after that deletes
checkpoints beyond the last `max_to_keep`. A crash (or a power cut) at any
moment leaves the pointer naming a complete checkpoint; `LatestCheckpoint`
also falls back to the newest complete checkpoint when the pointer is missing
or names a broken one.
"""

import os
import re
import time

from absl import logging
import tensorflow as tf

from lingvo_gpipe.runners.checkpoint_files import BROKEN_DIR
from lingvo_gpipe.runners.checkpoint_files import POINTER
from lingvo_gpipe.runners.checkpoint_files import PREFIX
from lingvo_gpipe.runners.checkpoint_files import BrokenCheckpointError
from lingvo_gpipe.runners.checkpoint_files import CheckpointError
from lingvo_gpipe.runners.checkpoint_files import CheckWritableDir
from lingvo_gpipe.runners.checkpoint_files import DeleteCheckpointFiles
from lingvo_gpipe.runners.checkpoint_files import DeleteTemp
from lingvo_gpipe.runners.checkpoint_files import ErrorText
from lingvo_gpipe.runners.checkpoint_files import FilesText
from lingvo_gpipe.runners.checkpoint_files import FreeSpaceText
from lingvo_gpipe.runners.checkpoint_files import IncompatibleCheckpointError
from lingvo_gpipe.runners.checkpoint_files import IsCompleteCheckpoint
from lingvo_gpipe.runners.checkpoint_files import LatestCheckpoint
from lingvo_gpipe.runners.checkpoint_files import ListCheckpoints
from lingvo_gpipe.runners.checkpoint_files import ReadPointer
from lingvo_gpipe.runners.checkpoint_files import SetAside
from lingvo_gpipe.runners.checkpoint_files import StepOf
from lingvo_gpipe.runners.checkpoint_files import SyncCheckpoint
from lingvo_gpipe.runners.checkpoint_files import WritePointer
from lingvo_gpipe.runners.checkpoint_names import _MapName  # noqa: F401
from lingvo_gpipe.runners.checkpoint_names import ITER_KEY
from lingvo_gpipe.runners.checkpoint_names import ITERATOR
from lingvo_gpipe.runners.checkpoint_names import MODEL
from lingvo_gpipe.runners.checkpoint_names import DiffLines
from lingvo_gpipe.runners.checkpoint_names import EscapeName
from lingvo_gpipe.runners.checkpoint_names import FineTuneRestore
from lingvo_gpipe.runners.checkpoint_names import ParseRestoreMap
from lingvo_gpipe.runners.checkpoint_names import ReadCheckpointVariables
from lingvo_gpipe.runners.checkpoint_names import RestoreReport
from lingvo_gpipe.runners.checkpoint_names import RESTORE_CHUNK_BYTES
from lingvo_gpipe.runners.checkpoint_names import RestoreVariables
from lingvo_gpipe.runners.checkpoint_names import SplitIndependentMap
from lingvo_gpipe.runners.checkpoint_names import UnescapeName
from lingvo_gpipe.runners.checkpoint_names import VariableKey


__all__ = [
  'CheckpointError',
  'IncompatibleCheckpointError',
  'BrokenCheckpointError',
  'BROKEN_DIR',
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
  'SyncCheckpoint',
  'StepOf',
  'ParseRestoreMap',
  'FineTuneRestore',
  'RestoreVariables',
  'RESTORE_CHUNK_BYTES',
  'CheckWritableDir',
  'POINTER',
  'PREFIX',
]


# -- The checkpointer ------------------------------------------------------

# What reading a checkpoint whose data files are truncated or corrupt
# raises (TensorFlow's reader raises IndexError for a short read).
_DATA_ERRORS = (
  IndexError,
  tf.errors.DataLossError,
  tf.errors.OutOfRangeError,
)


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

  @property
  def latest(self):
    """The prefix of the newest checkpoint saved or restored, or None."""
    return self._kept[-1] if self._kept else None

  def Discard(self, prefix):
    """Removes checkpoint `prefix` (e.g. diverged weights): the pointer goes
    back to the checkpoint before it (or is removed), then its files go."""
    if prefix not in self._kept:
      return
    self._kept.remove(prefix)
    if self._kept:
      WritePointer(self._dir, self._kept[-1], self._kept)
    else:
      pointer = os.path.join(self._dir, POINTER)
      if tf.io.gfile.exists(pointer):
        tf.io.gfile.remove(pointer)
    DeleteCheckpointFiles(prefix)
    self._last_step = StepOf(self._kept[-1]) if self._kept else None
    logging.warning('Removed checkpoint %s.', prefix)

  def _Cleanup(self):
    """Removes what crashed saves left; adopts the pointer's checkpoint list.

    Removed: `ckpt-*_temp` shard directories, temporary pointer files,
    incomplete checkpoints the pointer does not name (those it names are
    set aside in `broken/`), complete
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
      if prefix not in complete and prefix in listed + [latest]:
        # Saves are whole before the pointer names them: this one broke.
        logging.warning(
          'Checkpoint %s is broken (%s); set aside as %s.',
          prefix,
          FilesText(prefix),
          SetAside(prefix),
        )
      elif (
        prefix not in complete
        or step > newest_step
        or (listed and prefix not in listed)
      ):
        logging.info(
          'Removing %s.*, left by an interrupted save or sweep.', prefix
        )
        DeleteCheckpointFiles(prefix)
        complete.discard(prefix)
    self._kept = [p for p in listed if p in complete and p != newest]
    self._kept += [newest] if newest else []
    if newest and newest != latest:
      WritePointer(self._dir, newest, self._kept)

  def _Checkpoint(self, with_iterator):
    """What `Save` writes: the variables, and the input position."""
    kwargs = {MODEL: self._vars}
    if with_iterator and self._iterator is not None:
      kwargs[ITERATOR] = self._iterator
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
        DeleteTemp(prefix)
        self._Checkpoint(False).write(prefix)
      if not IsCompleteCheckpoint(prefix):
        raise CheckpointError(
          f'Checkpoint {prefix} is incomplete after writing it.'
        )
      SyncCheckpoint(prefix)  # On disk before the pointer names it.
    except (OSError, tf.errors.OpError, CheckpointError) as e:
      DeleteTemp(prefix)
      DeleteCheckpointFiles(prefix)
      raise CheckpointError(
        f'Could not write checkpoint {prefix} at step {step}: '
        f'{ErrorText(e)} ({FreeSpaceText(self._dir)}). Free '
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
        f'({FreeSpaceText(self._dir)}).'
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
      DeleteCheckpointFiles(prefix)

  # -- Restoring ------------------------------------------------------------

  def CheckCompatible(self, prefix):
    """Raises IncompatibleCheckpointError unless names/shapes/dtypes agree."""
    lines = DiffLines(self._vars, ReadCheckpointVariables(prefix))
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
    names = None
    try:
      if strict:
        self.CheckCompatible(prefix)
      else:
        ckpt_vars = ReadCheckpointVariables(prefix)
        lines = DiffLines(
          self._vars, {k: v for k, v in ckpt_vars.items() if k in self._vars}
        )
        if lines:
          raise IncompatibleCheckpointError(
            f'Cannot restore {prefix} into this model:\n' + '\n'.join(lines)
          )
    except IncompatibleCheckpointError:
      # Written with another split of a pipeline whose names carry the cell
      # (Lingvo's `cell_<k>/`): restore by the names without it.
      names = SplitIndependentMap(
        self._vars, ReadCheckpointVariables(prefix), strict=strict
      )
      if names is None:
        raise
      logging.info(
        'Restoring %s, written with another split of the pipeline cells: '
        '%d variables by their names without cell_<k>/.',
        prefix,
        sum(a != b for a, b in names.items()),
      )
    try:
      return self._Read(prefix, names)
    except _DATA_ERRORS as e:
      # A short data file: IndexError from the Python reader,
      # OutOfRangeError from the restore op.
      short = isinstance(e, IndexError) or (
        isinstance(e, tf.errors.OutOfRangeError) and 'Read less bytes' in str(e)
      )
      what = (
        'shorter than its index says (truncated)'
        if short
        else f'{type(e).__name__}: {ErrorText(e)}'
      )
      raise BrokenCheckpointError(
        f'Checkpoint {prefix} is truncated or corrupt: '
        f'{FilesText(prefix, data_only=True)}: {what}.'
      ) from e

  def _Read(self, prefix, names=None):
    reader = tf.train.load_checkpoint(prefix)
    variables = self._vars
    if names is not None:
      variables = {names[n]: v for n, v in self._vars.items()}
    # The variables a few at a time (no second copy of the model), then the
    # input position alone.
    RestoreVariables(prefix, variables)
    if self._iterator is not None and reader.has_tensor(ITER_KEY):
      try:
        status = tf.train.Checkpoint(**{ITERATOR: self._iterator}).read(prefix)
        status.assert_existing_objects_matched()
        status.expect_partial()
      except _DATA_ERRORS:
        raise
      except (tf.errors.OpError, AssertionError, ValueError) as e:
        logging.warning(
          'Could not restore the input position from %s (%s); '
          'the input begins anew.',
          prefix,
          str(e).splitlines()[0],
        )
    return StepOf(prefix)

  def Restore(self):
    """Restores the latest checkpoint of the directory that restores.

    A checkpoint whose files are truncated or corrupt is set aside in
    `broken/` (never deleted), with a warning naming its files and what is
    wrong, and the newest checkpoint before it is restored instead.

    Returns:
      The restored prefix, or None when the directory holds no checkpoint.

    Raises:
      IncompatibleCheckpointError: the checkpoint is of another model.
      BrokenCheckpointError: no checkpoint restores (all set aside).
    """
    broken = []
    while True:
      prefix = LatestCheckpoint(self._dir)
      if prefix is None:
        if broken:
          raise BrokenCheckpointError(
            f'No checkpoint of {self._dir} restores; set aside in '
            f'{os.path.join(self._dir, BROKEN_DIR)}: '
            + ' '.join(broken)
            + ' Put back a good copy, or rerun to train from the start.'
          )
        return None
      try:
        self.RestoreFrom(prefix)
        break
      except BrokenCheckpointError as e:
        broken.append(str(e))
        self._kept = [p for p in self._kept if p != prefix]
        moved = SetAside(prefix)
        if self._kept:
          WritePointer(self._dir, self._kept[-1], self._kept)
        elif tf.io.gfile.exists(os.path.join(self._dir, POINTER)):
          tf.io.gfile.remove(os.path.join(self._dir, POINTER))
        logging.warning(
          '%s Set it aside as %s; resuming from the checkpoint before it.',
          e,
          moved,
        )
    self._last_step = StepOf(prefix)
    self._last_time = time.time()
    if prefix not in self._kept:
      self._kept.append(prefix)
    logging.info('Restored %s.', prefix)
    if broken:
      logging.warning(
        'Resumed from %s, the newest checkpoint that restores: the steps '
        'after it are trained again.',
        prefix,
      )
    return prefix
