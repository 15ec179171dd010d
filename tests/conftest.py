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

# tf.data's autotuning off for the input pipelines built in the test
# processes: TensorFlow 2.21 can block the thread that deletes an autotuned
# iterator for up to 60 s, and a test's model (with its input generator's
# iterator) is collected in some later test. With it on, one test of each
# run stalled for 19-60 s (base_input_generator.TF_DATA_AUTOTUNE).
from lingvo_gpipe.core import base_input_generator  # noqa: E402  # pylint: disable=g-import-not-at-top

base_input_generator.TF_DATA_AUTOTUNE = False

# The modules that take longest, run first. The test processes take one
# module at a time in collection order (pytest.ini: --dist=loadscope), so a
# long module collected last runs alone at the end while the other process
# idles; started first, the long ones overlap and the short ones fill in.
# (Measured with `pytest --durations=0`; an unlisted module keeps its
# place after these.)
_LONGEST_FIRST = (
  'tests/trainer_scaleout_test.py',
  'tests/pipeline/recompute_memory_test.py',
  'tests/tools/local_cluster_test.py',
  'tests/models/amoebanet_test.py',
  'tests/readme_test.py',
  'tests/pipeline/pipelining_layer_test.py',
  'tests/trainer_test.py',
  'tests/pipeline/jit_cell_test.py',
  'tests/models/mt_test.py',
  'tests/core/cluster_test.py',
  'tests/reliability_test.py',
  'tests/docs_test.py',
  'tests/pipeline/multi_process_test.py',
  'tests/gpipe_layers/layers_with_gpipe_test.py',
  'tests/gpipe_layers/keras_model_test.py',
  'tests/models/mt_trainer_test.py',
  'tests/tools/max_model_size_test.py',
  'tests/trainer_strategy_test.py',
)


def pytest_collection_modifyitems(items):
  rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}

  def Key(item):
    path = item.nodeid.split('::', 1)[0]
    return rank.get(path, len(rank))

  items.sort(key=Key)  # Stable: each module keeps its own order.
