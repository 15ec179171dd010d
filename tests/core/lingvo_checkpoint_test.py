"""lingvo_checkpoint.LoadLingvoCheckpoint reads Lingvo's TF1 names."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import gpipe
from lingvo_gpipe.core import layers
from lingvo_gpipe.core import lingvo_checkpoint


def _Pipe():
  cells = [
    gpipe.FeatureExtractionLayer.Params().Set(
      name=f'cell_{k}',
      sub=[
        layers.FCLayer.Params().Set(name=f'fc{k}', input_dim=3, output_dim=3)
      ],
    )
    for k in range(2)
  ]
  return (
    gpipe.PipeliningLayer.Params()
    .Set(name='pipe', cell_tpl=cells, devices=['/device:CPU:0'] * 2)
    .Instantiate()
  )


def _WriteTf1Checkpoint(path, values):
  """A checkpoint as Lingvo's TF1 Saver writes it: `<scope>/var` names."""
  with tf.Graph().as_default():
    vs = [
      tf.compat.v1.Variable(v, name=n[: -len(':0')] if n.endswith(':0') else n)
      for n, v in values.items()
    ]
    saver = tf.compat.v1.train.Saver(vs)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return saver.save(sess, path)


def testLoadsByLingvoName(tmp_path):
  rng = np.random.RandomState(0)
  values = {
    f'cell_{k}/fc{k}/{v}/var': rng.randn(*([3, 3] if v == 'w' else [3])).astype(
      np.float32
    )
    for k in range(2)
    for v in 'wb'
  }
  prefix = _WriteTf1Checkpoint(str(tmp_path / 'ckpt'), values)
  pipe = _Pipe()
  loaded = lingvo_checkpoint.LoadLingvoCheckpoint(pipe, prefix)
  assert loaded['pipe/cell_1/fc1/w'] == 'cell_1/fc1/w/var'
  np.testing.assert_array_equal(
    pipe.theta.cell_1.fc1.w.numpy(), values['cell_1/fc1/w/var']
  )
  # A directory works too; a missing variable is named in one line.
  del values['cell_0/fc0/b/var']
  _WriteTf1Checkpoint(str(tmp_path / 'd' / 'ckpt'), values)
  with pytest.raises(ValueError, match="no variable for 'pipe/cell_0/fc0/b'"):
    lingvo_checkpoint.LoadLingvoCheckpoint(_Pipe(), str(tmp_path / 'd'))
