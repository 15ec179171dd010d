"""Unit tests of the name-keyed, atomic checkpointer."""

import os

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.runners import checkpoint_files
from lingvo_gpipe.runners import checkpointer
from tests.testing import fresh_process


def _Vars(scale=1.0, w_shape=(2, 3), extra=False):
  out = {
    'mlp/pipeline/body/layer_0/w': tf.Variable(
      scale * np.arange(np.prod(w_shape), dtype=np.float32).reshape(w_shape)
    ),
    'mlp/pipeline/body/layer_1/b': tf.Variable(
      scale * np.ones([3], np.float32)
    ),
    'global_step': tf.Variable(0, dtype=tf.int64),
  }
  if extra:
    out['mlp/extra.v'] = tf.Variable(np.zeros([4], np.float32))
  return out


def _Zero(variables):
  for v in variables.values():
    v.assign(tf.zeros_like(v))


def _Files(directory):
  return sorted(f for f in os.listdir(directory) if not f.startswith('.'))


def testEscapeRoundTrip():
  for name in ['a/b/c', 'a.b/c..d', 'x.S/y', '']:
    assert checkpointer.UnescapeName(checkpointer.EscapeName(name)) == name
  assert checkpointer.VariableKey('a/b.c') == (
    'model/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE'
  )


def testSaveRestoreByName(tmp_path):
  variables = _Vars(extra=True)
  variables['global_step'].assign(7)
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables)
  prefix = ckpt.Save(7)
  assert prefix.endswith('ckpt-7')
  names = checkpointer.ReadCheckpointVariables(prefix)
  assert set(names) == set(variables)
  # Restore into variables created in another order, on another device.
  with tf.device('/device:CPU:1'):
    other = dict(reversed(list(_Vars(scale=0.0, extra=True).items())))
  restorer = checkpointer.Checkpointer(str(tmp_path), other)
  assert restorer.Restore() == prefix
  for name, v in variables.items():
    np.testing.assert_array_equal(other[name].numpy(), v.numpy())
  assert restorer.last_saved_step == 7
  # The pointer is the standard one TensorFlow reads too.
  assert tf.train.latest_checkpoint(str(tmp_path)) == prefix


def testKeepLastKAndIntervals(tmp_path):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(
    str(tmp_path), variables, max_to_keep=2, save_interval_steps=10
  )
  saved = [s for s in range(0, 45) if ckpt.MaybeSave(s)]
  assert saved == [10, 20, 30, 40]
  assert [s for s, _ in checkpointer.ListCheckpoints(str(tmp_path))] == [30, 40]
  latest, everything = checkpointer.ReadPointer(str(tmp_path))
  assert latest.endswith('ckpt-40')
  assert [os.path.basename(p) for p in everything] == ['ckpt-30', 'ckpt-40']
  assert not any('ckpt-10' in f or 'ckpt-20' in f for f in _Files(tmp_path))
  # A restarted checkpointer adopts the list and keeps sweeping.
  again = checkpointer.Checkpointer(str(tmp_path), variables, max_to_keep=2)
  again.Restore()
  again.Save(50)
  assert [s for s, _ in checkpointer.ListCheckpoints(str(tmp_path))] == [40, 50]
  # Saving the restored step again is a no-op, never an overwrite.
  assert again.Save(50).endswith('ckpt-50')


def testPointerUpdateIsAtomic(tmp_path, monkeypatch):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables)
  first = ckpt.Save(1)
  pointer = os.path.join(str(tmp_path), checkpointer.POINTER)
  before = open(pointer).read()
  replaced = []
  real_replace = os.replace

  def CrashingReplace(src, dst):
    replaced.append((src, dst))
    raise OSError('simulated crash before the rename')

  monkeypatch.setattr(os, 'replace', CrashingReplace)
  with pytest.raises(checkpointer.CheckpointError, match='pointer'):
    ckpt.Save(2)
  monkeypatch.setattr(os, 'replace', real_replace)
  # The pointer went through a temporary file and a rename; the crash left
  # the old pointer whole, naming a complete checkpoint, and no temp file.
  assert replaced and replaced[0][1] == pointer and replaced[0][0] != pointer
  assert open(pointer).read() == before
  assert checkpointer.LatestCheckpoint(str(tmp_path)) == first
  assert not [f for f in os.listdir(tmp_path) if '.tmp-' in f]


def testCrashMidSaveLeavesRestorableLatest(tmp_path):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables)
  good = ckpt.Save(5)
  # What a kill during the next save can leave: shards in ckpt-6_temp, and
  # data without an index.
  os.makedirs(os.path.join(str(tmp_path), 'ckpt-6_temp'))
  with open(os.path.join(str(tmp_path), 'ckpt-6_temp', 'part-0'), 'w') as f:
    f.write('x')
  with open(
    os.path.join(str(tmp_path), 'ckpt-6.data-00000-of-00001'), 'w'
  ) as f:
    f.write('partial')
  assert checkpointer.LatestCheckpoint(str(tmp_path)) == good
  restarted = checkpointer.Checkpointer(str(tmp_path), _Vars(scale=0.0))
  assert not [f for f in _Files(tmp_path) if f.startswith('ckpt-6')]
  assert restarted.Restore() == good


def testPointerToBrokenCheckpointFallsBack(tmp_path):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables)
  good = ckpt.Save(1)
  broken = ckpt.Save(2)
  os.remove(broken + '.index')
  assert checkpointer.LatestCheckpoint(str(tmp_path)) == good
  with open(os.path.join(str(tmp_path), checkpointer.POINTER), 'w') as f:
    f.write('garbage')
  assert checkpointer.LatestCheckpoint(str(tmp_path)) == good


def testBrokenLatestIsSetAsideAndTheOneBeforeRestores(tmp_path):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables)
  for step in (1, 2, 3):
    variables['global_step'].assign(step)
    ckpt.Save(step)
  data = tmp_path / 'ckpt-3.data-00000-of-00001'
  with open(data, 'r+b') as f:
    f.truncate(20)
  restored = _Vars(scale=0.0)
  restorer = checkpointer.Checkpointer(str(tmp_path), restored)
  assert restorer.Restore() == str(tmp_path / 'ckpt-2')
  assert int(restored['global_step'].numpy()) == 2
  # Set aside whole, never deleted; the pointer names the one restored.
  aside = tmp_path / checkpointer.BROKEN_DIR
  assert sorted(os.listdir(aside)) == [
    'ckpt-3.data-00000-of-00001',
    'ckpt-3.index',
  ]
  assert os.path.getsize(aside / 'ckpt-3.data-00000-of-00001') == 20
  latest, listed = checkpointer.ReadPointer(str(tmp_path))
  assert latest == str(tmp_path / 'ckpt-2')
  assert str(tmp_path / 'ckpt-3') not in listed
  assert restorer.Save(3) == str(tmp_path / 'ckpt-3')  # Trained again.
  # A checksum mismatch too; and when none restores, an error naming them.
  for step in (1, 2, 3):
    path = tmp_path / f'ckpt-{step}.data-00000-of-00001'
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))
  with pytest.raises(checkpointer.BrokenCheckpointError) as e:
    checkpointer.Checkpointer(str(tmp_path), _Vars()).Restore()
  assert f'No checkpoint of {tmp_path} restores; set aside in {aside}' in str(
    e.value
  )
  assert 'ckpt-1.data-00000-of-00001 (' in str(e.value)
  assert 'DataLossError' in str(e.value)
  assert sorted(os.listdir(aside))[-2:] == [
    'ckpt-3_1.data-00000-of-00001',
    'ckpt-3_1.index',
  ]


def testBrokenIndexThePointerNamesIsSetAsideNotDeleted(tmp_path):
  ckpt = checkpointer.Checkpointer(str(tmp_path), _Vars())
  good = ckpt.Save(1)
  ckpt.Save(2)
  (tmp_path / 'ckpt-2.index').write_bytes(b'not an index')
  restorer = checkpointer.Checkpointer(str(tmp_path), _Vars())
  assert restorer.Restore() == good
  assert sorted(os.listdir(tmp_path / checkpointer.BROKEN_DIR)) == [
    'ckpt-2.data-00000-of-00001',
    'ckpt-2.index',
  ]


def testIteratorPositionIsRestored(tmp_path):
  ds = tf.data.Dataset.range(100).batch(2)
  it = iter(ds)
  for _ in range(3):
    next(it)
  variables = _Vars()
  checkpointer.Checkpointer(str(tmp_path), variables, iterator=it).Save(3)
  expected = next(it).numpy()
  it2 = iter(ds)
  restorer = checkpointer.Checkpointer(str(tmp_path), _Vars(), iterator=it2)
  restorer.Restore()
  np.testing.assert_array_equal(next(it2).numpy(), expected)


def testUnsaveableIteratorFallsBackToVariables(tmp_path):
  ds = tf.data.Dataset.from_generator(
    lambda: iter(range(10)), output_signature=tf.TensorSpec([], tf.int64)
  )
  it = iter(ds)
  next(it)
  variables = _Vars()
  prefix = checkpointer.Checkpointer(
    str(tmp_path), variables, iterator=it
  ).Save(1)
  assert checkpointer.IsCompleteCheckpoint(prefix)
  restorer = checkpointer.Checkpointer(
    str(tmp_path), _Vars(scale=0.0), iterator=iter(ds)
  )
  assert restorer.Restore() == prefix


def testIncompatibleCheckpointIsRefused(tmp_path):
  checkpointer.Checkpointer(str(tmp_path), _Vars(extra=True)).Save(1)
  other = _Vars(w_shape=(3, 3))
  other['mlp/new'] = tf.Variable(1.0)
  with pytest.raises(checkpointer.IncompatibleCheckpointError) as e:
    checkpointer.Checkpointer(str(tmp_path), other).Restore()
  msg = str(e.value)
  assert 'mlp/new' in msg and 'mlp/extra.v' in msg
  assert 'mlp/pipeline/body/layer_0/w: model [3, 3]' in msg
  assert '--restore_from' in msg


def testFineTuneWithMap(tmp_path):
  source = {
    'old/w': tf.Variable(np.full([2, 2], 3.0, np.float32)),
    'old/b': tf.Variable(np.full([2], 4.0, np.float32)),
    'old/unused': tf.Variable(1.0),
    'global_step': tf.Variable(100, dtype=tf.int64),
  }
  prefix = checkpointer.Checkpointer(str(tmp_path), source).Save(100)
  model = {
    'new/w': tf.Variable(np.zeros([2, 2], np.float32)),
    'new/b': tf.Variable(np.zeros([3], np.float32)),
    'new/extra': tf.Variable(0.0),
    'global_step': tf.Variable(0, dtype=tf.int64),
  }
  rules = checkpointer.ParseRestoreMap(
    [r'new/(w|b)=>old/\1', 'global_step=>global_step']
  )
  report = checkpointer.FineTuneRestore(
    model, str(tmp_path), rules, skip=('global_step',)
  )
  assert report.path == prefix
  assert report.restored == [('new/w', 'old/w')]
  reasons = dict(report.not_restored)
  assert 'shape [2]' in reasons['new/b']
  assert 'no --restore_map rule' in reasons['new/extra']
  assert 'never restored' in reasons['global_step']
  assert set(report.unused) == {'old/b', 'old/unused', 'global_step'}
  np.testing.assert_array_equal(model['new/w'].numpy(), np.full([2, 2], 3.0))
  assert int(model['global_step'].numpy()) == 0
  assert 'new/w <- old/w' in str(report)
  # Lingvo's %s form and the identity map.
  rules = checkpointer.ParseRestoreMap(['new/(.*)=>old/%s'])
  assert checkpointer._MapName('new/w', rules) == 'old/w'
  assert checkpointer._MapName('x', []) == 'x'


def testBadRestoreMapIsNamed():
  with pytest.raises(ValueError, match='no "=>"'):
    checkpointer.ParseRestoreMap(['a/b'])
  with pytest.raises(ValueError, match=r"bad regex '\(a'"):
    checkpointer.ParseRestoreMap(['(a=>b'])


def testUnwritableDirIsAClearError(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('x')
  with pytest.raises(
    checkpointer.CheckpointError, match='Cannot write to --logdir .*file/sub'
  ):
    checkpointer.Checkpointer(str(blocker / 'sub'), _Vars())


def testFullDiskKeepsPreviousCheckpoint(tmp_path, monkeypatch):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables)
  good = ckpt.Save(1)

  def Full(*unused_args, **unused_kwargs):
    raise tf.errors.ResourceExhaustedError(
      None, None, 'No space left on device'
    )

  monkeypatch.setattr(tf.train.Checkpoint, 'write', Full)
  with pytest.raises(
    checkpointer.CheckpointError,
    match='No space left.*MiB free.*ckpt-1 is intact',
  ):
    ckpt.Save(2)
  monkeypatch.undo()
  assert checkpointer.LatestCheckpoint(str(tmp_path)) == good


def testInterruptedSweepAndUnpointedNewerCheckpointsAreRemoved(tmp_path):
  variables = _Vars()
  ckpt = checkpointer.Checkpointer(str(tmp_path), variables, max_to_keep=2)
  for step in (1, 2, 3):
    ckpt.Save(step)
  # A sweep that died after the pointer update left ckpt-1 behind; a save
  # that died before it left a complete, unpointed ckpt-9.
  checkpointer.Checkpointer(str(tmp_path / 'other'), variables).Save(1)
  checkpointer.Checkpointer(str(tmp_path / 'other'), variables).Save(9)
  for f in os.listdir(tmp_path / 'other'):
    if f.startswith(('ckpt-1.', 'ckpt-9.')):
      os.replace(tmp_path / 'other' / f, tmp_path / f)
  assert [s for s, _ in checkpointer.ListCheckpoints(str(tmp_path))] == [
    1,
    2,
    3,
    9,
  ]
  assert checkpointer.LatestCheckpoint(str(tmp_path)).endswith('ckpt-3')
  checkpointer.Checkpointer(str(tmp_path), variables, max_to_keep=2)
  assert [s for s, _ in checkpointer.ListCheckpoints(str(tmp_path))] == [2, 3]


def testDataAndIndexReachTheDiskBeforeThePointerMoves(tmp_path, monkeypatch):
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def Fsync(fd):
    events.append(('fsync', os.readlink(f'/proc/self/fd/{fd}')))
    return real_fsync(fd)

  def Replace(src, dst):
    events.append(('replace', str(dst)))
    return real_replace(src, dst)

  monkeypatch.setattr(os, 'fsync', Fsync)
  monkeypatch.setattr(os, 'replace', Replace)
  ckpt = checkpointer.Checkpointer(str(tmp_path), _Vars())
  events.clear()
  prefix = ckpt.Save(3)
  pointer = ('replace', str(tmp_path / 'checkpoint'))
  assert pointer in events, events
  before = events[: events.index(pointer)]
  synced = {path for kind, path in before if kind == 'fsync'}
  data = [f for f in os.listdir(tmp_path) if f.startswith('ckpt-3.data-')]
  assert data
  for name in data + ['ckpt-3.index']:
    assert str(tmp_path / name) in synced, (name, events)
  # The directory (holding the new files' names) too, after the files.
  fsyncs = [path for kind, path in before if kind == 'fsync']
  assert fsyncs.index(str(tmp_path)) > fsyncs.index(prefix + '.index')


def testAFullDiskOverSeveralWorkersReadsAsOneReason():
  """A save whose shards fail on several workers: TensorFlow's message (the
  Python stack of the save, then one root error per device, with gRPC
  details) becomes the reason, the first file and how many more."""
  stack = ' '.join(f'File "/x/lib{i}.py", line {i}, in F{i}' for i in range(40))
  message = (
    f'Graph execution error: Detected at node SaveV2_5 defined at (most '
    f'recent call last): {stack} 7 root error(s) found. (0) '
    'RESOURCE_EXHAUSTED: /d/train/ckpt-20_temp/part-00005-of-00009.data-'
    '00000-of-00001.tempstate4219357733099696125; No space left on device '
    '[[{{node SaveV2_5}}]] Hint: If you want to see a list of allocated '
    'tensors when OOM happens, add report_tensor_allocations_upon_oom. '
    'Additional GRPC error information from remote target /job:worker/'
    'replica:0/task:4/device:CPU:0: {grpc_message:" /d/train/ckpt-20_temp/'
    'part-00005-of-00009.data-00000-of-00001.tempstate4219357733099696125; '
    'No space left on device\\n\\t [[{{node SaveV2_5}}]]\\nHint: ..."} (1) '
    'RESOURCE_EXHAUSTED: /d/train/ckpt-20_temp/part-00001-of-00009.data-'
    '00000-of-00001.tempstate77; No space left on device [[{{node SaveV2_1}}]]'
  )
  assert checkpoint_files.ErrorText(
    tf.errors.ResourceExhaustedError(None, None, message)
  ) == (
    'No space left on device (writing /d/train/ckpt-20_temp/part-00005-of-'
    '00009.data-00000-of-00001 and 1 more)'
  )


def testRestoreReadsAFewVariablesAtATimeOnTheirOwnDevices(tmp_path):
  # Variables on two devices, restored in reads of at most 100 bytes: every
  # value and dtype comes back, each on its variable's device.
  cpus = [d.name for d in tf.config.list_logical_devices('CPU')][:2]
  saved = {}
  for i in range(6):
    with tf.device(cpus[i % 2]):
      saved[f'cell_{i % 2}/w{i}'] = tf.Variable(np.full([5, 4], i, np.float32))
  saved['global_step'] = tf.Variable(7, dtype=tf.int64)
  ckpt = checkpointer.Checkpointer(str(tmp_path), saved)
  ckpt.Save(7)
  for v in saved.values():
    v.assign(tf.zeros_like(v))
  checkpointer.RestoreVariables(
    checkpoint_files.LatestCheckpoint(str(tmp_path)), saved, chunk_bytes=100
  )
  for name, v in saved.items():
    if name == 'global_step':
      assert int(v.numpy()) == 7
    else:
      np.testing.assert_array_equal(v.numpy(), int(name[-1]), err_msg=name)
      assert v.device.endswith(cpus[int(name[-1]) % 2][-5:]), v.device


_RESTORE_PEAK = """
import json, sys
from lingvo_gpipe.runners import device_memory
device_memory.EnableCpuStats()
import tensorflow as tf
from lingvo_gpipe.runners import checkpointer
from tests.testing import fresh_process
vs = {f'w{i}': tf.Variable(tf.zeros([2048, 1024])) for i in range(24)}
ckpt = checkpointer.Checkpointer(sys.argv[1], vs)
ckpt.Save(1)
before = tf.config.experimental.get_memory_info('CPU:0')['current']
tf.config.experimental.reset_memory_stats('CPU:0')
assert ckpt.Restore()
peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
print('RESULT', json.dumps(dict(weights=24 << 23, extra=peak - before)))
"""


def testRestoreHoldsNoSecondCopyOfTheModel(tmp_path):
  # tf.train.Checkpoint.read reads every tensor before it assigns any: 192
  # MiB of weights restored with 192 MiB more at the peak. The checkpointer
  # reads at most RESTORE_CHUNK_BYTES (64 MiB) at a time.
  r = fresh_process.Result(_RESTORE_PEAK, tmp_path, timeout=120)
  assert r['extra'] <= checkpointer.RESTORE_CHUNK_BYTES + (1 << 20), r
  assert r['extra'] < 0.6 * r['weights'], r
