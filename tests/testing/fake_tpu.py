"""A TPUStrategy stand-in, to test TPU code paths without a TPU."""

import types

import numpy as np
import tensorflow as tf


class FakeTPUStrategy(tf.distribute.TPUStrategy):
  """A TPUStrategy (for isinstance) whose `extended` is a stand-in.

  `record=True` records experimental_assign_to_logical_device; else TF's own
  method runs against the stand-in.
  """

  def __init__(
    self, num_replicas, num_cores, device_assignment=None, record=True
  ):  # pylint: disable=super-init-not-called
    self._extended = types.SimpleNamespace(
      _device_assignment=device_assignment,
      _tpu_devices=np.empty([num_replicas, num_cores], dtype=object),
      _use_spmd_for_xla_partitioning=False,
      _get_local_replica_id=lambda replica_id: replica_id,
    )
    self.calls = []
    self._record = record

  def experimental_assign_to_logical_device(self, tensor, logical_device_id):
    if not self._record:
      return super().experimental_assign_to_logical_device(
        tensor, logical_device_id
      )
    self.calls.append((tensor, logical_device_id))
    return tf.identity(tensor)
