"""Lingvo's `test_utils.TestCase` for TF2 eager tests.

A `tf.test.TestCase` whose `setUp` fixes the random seeds (numpy and
TensorFlow's global seed). Tests compute eagerly: `self.evaluate(x)` or
`x.numpy()`; Lingvo's `self.session()` is a TF1 session, which TF2 eager
code does not need (`self.session()` and `self.cached_session()` say so in
one line).
"""

import numpy as np
import tensorflow as tf

__all__ = ['TestCase', 'main']

main = tf.test.main


class TestCase(tf.test.TestCase):
  """tf.test.TestCase with fixed seeds and eager-only sessions."""

  def setUp(self):
    super().setUp()
    np.random.seed(12345)
    tf.random.set_seed(12345)

  def _NoSession(self, *unused_args, **unused_kwargs):
    raise RuntimeError(
      'lingvo_gpipe tests run TF2 eager: there is no session; compute the '
      'values directly (x.numpy() or self.evaluate(x)).'
    )

  session = _NoSession
  cached_session = _NoSession
