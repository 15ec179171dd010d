"""Lingvo's `SeqLayer` and `PartitionSequentialLayers`.

`SeqLayer` runs `before_tpl` layers, then the cells of `cell_tpl` one after
another, cell k on device k (round robin over the devices): model
parallelism without micro-batches, the sequential form of
`PipeliningLayer`. Every layer is a child named by its Params name, so
`theta.cell_0.fc0` and the variable `<path>/cell_0/fc0/w` are what Lingvo's
would be (`cell_0/fc0/w/var` in Lingvo's TF1 graph).

`PartitionSequentialLayers` splits a flat sequence of layers into
`FeatureExtractionLayer` cells the way Lingvo does, with Lingvo's names
(cells `d<k>`, layers `cell_<iii>`), so a Lingvo model that builds its cells
with it names its variables as Lingvo does. The library's own balanced
split, which keeps the layers' names, is `partition.PartitionSequentialLayers`.
"""

import contextlib

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.pipeline import placement

__all__ = ['SeqLayer', 'PartitionSequentialLayers']


class SeqLayer(base_layer.BaseLayer):
  """Runs `before_tpl`, then each cell of `cell_tpl` on its device."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'before_tpl',
      [],
      'Layers run in order before the cells, on the first device.',
    )
    p.Define(
      'cell_tpl',
      [],
      'Cell Params (e.g. FeatureExtractionLayer), run in order; cell k on '
      'devices[k mod len(devices)].',
    )
    p.Define(
      'devices',
      None,
      'Devices the cells run on, round robin; None: the accelerators (or '
      'CPU devices) TensorFlow lists.',
    )
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not p.cell_tpl:
      raise ValueError(
        f'SeqLayer {p.name!r}: cell_tpl is empty; give it a list of cell '
        'Params (e.g. gpipe.FeatureExtractionLayer).'
      )
    if base_layer.IsAbstract():
      self._devices = [None]
    else:
      self._devices = list(p.devices or placement.DefaultDevices()) or [None]
    self._before_names = self._Create(p.before_tpl, 'before', lambda i: 0)
    self._cell_names = self._Create(p.cell_tpl, 'cell', lambda i: i)

  def _Device(self, k):
    d = self._devices[k % len(self._devices)]
    return tf.device(d) if d else contextlib.nullcontext()

  def _Create(self, params_list, what, device_of):
    names = []
    for i, lp in enumerate(params_list or []):
      lp = base_layer.LayerParams(lp).Copy()
      if not lp.name:
        lp.name = f'{what}_{i}'
      with self._Device(device_of(i)):
        self.CreateChild(lp.name, lp)
      names.append(lp.name)
    return names

  @property
  def cells(self):
    return [self.children[n] for n in self._cell_names]

  @property
  def before_layers(self):
    return [self.children[n] for n in self._before_names]

  def FProp(self, theta, *args):
    """before_tpl layers, then cell 0, cell 1, ...: the last one's outputs."""
    with self._Device(0):
      for name in self._before_names:
        args = py_utils.AsTuple(self.children[name].FProp(theta[name], *args))
    for k, name in enumerate(self._cell_names):
      with self._Device(k):
        args = py_utils.AsTuple(self.children[name].FProp(theta[name], *args))
    return py_utils.Unwrap(args)

  @classmethod
  def FPropMeta(cls, p, *args):
    layers = list(p.before_tpl or []) + list(p.cell_tpl)
    return sequential.ChainFPropMeta(layers, *args)


def _Flatten(p):
  """Lingvo's flattening: nested sequences (with `repeat`) become a list."""
  if isinstance(p, (list, tuple)):
    return [q.Copy() for q in p]
  seq_classes = (sequential.SequentialLayer, sequential.FeatureExtractionLayer)
  if not (isinstance(p.cls, type) and issubclass(p.cls, seq_classes)):
    return [p.Copy()]
  repeat = p.Get('repeat') if 'repeat' in p else 1
  out = []
  for _ in range(repeat):
    for s in p.sub:
      out += _Flatten(s)
  return out


def PartitionSequentialLayers(params, num_partitions, *shapes):
  """Lingvo's partition of a sequence of layers into cells of similar flops.

  Layer i joins cell min(int(c_i * K), K - 1), where c_i is the share of the
  total FPropMeta flops of layers 0..i. Layers are renamed `cell_<iii>`
  (three digits) and cells `d<k>`, as in Lingvo.

  Args:
    params: a layer's Params (a SequentialLayer or FeatureExtractionLayer is
      flattened, `repeat` included) or a list of layer Params.
    num_partitions: K.
    *shapes: the shape of the one input of the first layer.

  Returns:
    K `FeatureExtractionLayer` Params, for `PipeliningLayer`'s `cell_tpl`.
  """
  if len(shapes) != 1:
    raise ValueError(
      f'PartitionSequentialLayers takes the shape of one input; got '
      f'{len(shapes)} shapes. Give the first layer one input, or split '
      'the layers with splits= in PipeliningLayer(layers=...).'
    )
  if not isinstance(num_partitions, int) or num_partitions < 1:
    raise ValueError(
      f'PartitionSequentialLayers: num_partitions={num_partitions!r}; use '
      'an int >= 1.'
    )
  subs = _Flatten(params)
  for i, s in enumerate(subs):
    s.name = 'cell_%03d' % i
  metas = sequential.LayerMetas(subs, *shapes)
  cumulative, total = [], 0
  for flops, _, _ in metas:
    total += flops
    cumulative.append(total)
  parts = [[] for _ in range(num_partitions)]
  for i, s in enumerate(subs):
    share = cumulative[i] / total if total else (i + 1) / len(subs)
    parts[min(int(share * num_partitions), num_partitions - 1)].append(s)
  logging.info(
    'PartitionSequentialLayers: %d layers in %s',
    len(subs),
    [len(pa) for pa in parts],
  )
  return [
    sequential.FeatureExtractionLayer.Params().Set(name=f'd{k}', sub=pa)
    for k, pa in enumerate(parts)
  ]
