"""Lingvo's import path of the core layers (`lingvo_gpipe.core.layers`).

Re-exports every public layer class of `lingvo_gpipe.layers`, so Lingvo code
such as `layers.FCLayer.Params()` works unchanged.
"""

# pylint: disable=unused-import,wildcard-import
from lingvo_gpipe import layers as _layers
from lingvo_gpipe.layers import *
from lingvo_gpipe.layers import activations
# pylint: enable=unused-import,wildcard-import

__all__ = ['activations'] + list(_layers.__all__)
