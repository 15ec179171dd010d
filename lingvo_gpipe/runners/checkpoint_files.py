"""Checkpoint files: finding complete checkpoints, the pointer, durability.

Files in a checkpoint directory:

  ckpt-<step>.index, ckpt-<step>.data-*   one checkpoint per saved step
  checkpoint                              the "latest" pointer, in the text
                                          format of `tf.train.latest_checkpoint`

Durability: `SyncCheckpoint` fsyncs a new checkpoint's data and index files
and their directory; the pointer is then replaced atomically (temporary
file, fsync, `os.replace`, fsync of the directory). A crash or a power cut at
any moment leaves the pointer naming a checkpoint whose bytes are on disk.
"""

import os
import re
import shutil

from absl import logging
import tensorflow as tf

__all__ = [
  'CheckpointError',
  'IncompatibleCheckpointError',
  'BrokenCheckpointError',
  'BROKEN_DIR',
  'SetAside',
  'FilesText',
  'POINTER',
  'PREFIX',
  'StepOf',
  'IsCompleteCheckpoint',
  'ListCheckpoints',
  'ReadPointer',
  'SyncCheckpoint',
  'WritePointer',
  'LatestCheckpoint',
  'CheckWritableDir',
  'FreeSpaceText',
  'ErrorText',
  'DeleteCheckpointFiles',
  'DeleteTemp',
]

POINTER = 'checkpoint'
PREFIX = 'ckpt'
# Where broken checkpoints are set aside, in the checkpoint directory.
BROKEN_DIR = 'broken'


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or read."""


class IncompatibleCheckpointError(CheckpointError):
  """The checkpoint was written by a model with other variables."""


class BrokenCheckpointError(CheckpointError):
  """The files of a checkpoint are truncated or corrupt."""


# -- Finding checkpoints ---------------------------------------------------


def StepOf(prefix):
  """The step of checkpoint prefix '.../ckpt-<step>' (None if not one)."""
  m = re.match(rf'^{PREFIX}-(\d+)$', os.path.basename(prefix))
  return int(m.group(1)) if m else None


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
  _FsyncPath(os.path.dirname(path) or '.')


def _FsyncPath(path):
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError:
    pass  # Some file systems cannot fsync a directory.
  finally:
    os.close(fd)


def SyncCheckpoint(prefix):
  """Forces checkpoint `prefix`'s data and index files, then their directory,
  to disk (local files; remote file systems persist on close). Call it
  before the pointer names `prefix`."""
  if '://' in prefix:
    return
  paths = sorted(tf.io.gfile.glob(prefix + '.data-*-of-*'))
  for path in paths + [prefix + '.index']:
    _FsyncPath(path)
  _FsyncPath(os.path.dirname(prefix) or '.')


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


def FreeSpaceText(directory):
  try:
    usage = shutil.disk_usage(directory)
    return f'{usage.free / 2**20:.1f} MiB free on the disk of {directory}'
  except OSError:
    return 'free disk space unknown'


def ErrorText(error):
  """The message of an OSError or a TensorFlow error in one line, without
  TensorFlow's {{function_node ...}} and [Op:...] decorations; TensorFlow's
  "<file>.tempstate<n>; <reason>" reads "<reason> (writing <file>)"."""
  text = str(getattr(error, 'message', None) or error)
  text = re.sub(r'\{\{function_node [^}]*\}\}\s*', '', text)
  text = re.sub(r'\s*\[Op:[^\]]*\].*$', '', text, flags=re.S)
  text = ' '.join(text.split())
  m = re.match(r'^(\S+?)(?:\.tempstate\d+)?; (.+)$', text)
  if m:
    return f'{m.group(2)} (writing {m.group(1)})'
  # A save over several devices (workers) fails with "Graph execution
  # error: Detected at node ... (most recent call last): <the Python
  # stack> ... N root error(s) found. (0) RESOURCE_EXHAUSTED:
  # <file>.tempstate<n>; <reason> [[{{node SaveV2_2}}]] Hint: ...", once per
  # failed device: the first file and its reason, and how many failed.
  found = re.findall(
    r'(?:^|\s)(\S+?)\.tempstate\d+; (.+?)(?=\s*\[\[|\\n|$)', text
  )
  if found:
    files = sorted({f for f, _ in found})
    more = f' and {len(files) - 1} more' if len(files) > 1 else ''
    return f'{found[0][1]} (writing {found[0][0]}{more})'
  return text


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
      f'Cannot write to {what} {directory!r}: {ErrorText(e)} '
      f'({FreeSpaceText(os.path.dirname(directory) or ".")}). Pass a '
      f'writable {what} with free space.'
    ) from e


def FilesText(prefix, data_only=False):
  """The files of checkpoint `prefix` and their sizes, for a message."""
  paths = sorted(tf.io.gfile.glob(prefix + '.data-*'))
  if not data_only:
    paths.append(prefix + '.index')
  out = []
  for path in paths:
    try:
      size = f'{tf.io.gfile.stat(path).length} bytes'
    except tf.errors.OpError:
      size = 'missing'
    out.append(f'{path} ({size})')
  return ', '.join(out)


def SetAside(prefix):
  """Moves the files of checkpoint `prefix` into `<its directory>/broken/`
  (never deleting them); returns their new prefix there."""
  directory, name = os.path.split(prefix)
  aside = os.path.join(directory, BROKEN_DIR)
  tf.io.gfile.makedirs(aside)
  target, n = os.path.join(aside, name), 1
  while tf.io.gfile.glob(target + '.*'):
    target, n = os.path.join(aside, f'{name}_{n}'), n + 1
  for path in tf.io.gfile.glob(prefix + '.*'):
    tf.io.gfile.rename(path, target + path[len(prefix) :])
  return target


def DeleteCheckpointFiles(prefix):
  for path in tf.io.gfile.glob(prefix + '.*'):
    try:
      tf.io.gfile.remove(path)
    except tf.errors.OpError as e:
      logging.warning('Could not delete %s: %s', path, e)


def DeleteTemp(prefix):
  temp = prefix + '_temp'
  if tf.io.gfile.exists(temp):
    tf.io.gfile.rmtree(temp)
