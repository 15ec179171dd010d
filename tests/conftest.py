"""Test setup: 4 virtual CPU devices, so pipelines of up to 4 cells run here.

The split must happen before TensorFlow runs its first op, which is why it is
done when pytest imports this file.
"""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

NUM_TEST_CPU_DEVICES = 4

_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(
  _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_CPU_DEVICES
)
