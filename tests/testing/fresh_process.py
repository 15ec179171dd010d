"""Runs a measuring script in a fresh Python, for the tests.

Memory figures need a process of their own: CPU allocator statistics are
switched on before TensorFlow runs its first op, and a peak must not carry
what earlier tests left. The script prints one line `RESULT <json>`. It is
forked from the test process's warm Python (`warm_python`), which has run
no TensorFlow op: a process of its own all the same.
"""

import json
import sys

from tests.testing import warm_python


def Result(script, *args, timeout=300):
  """The JSON the script `script` (run with `args`) printed after RESULT;
  fails the test, with the end of its stderr, if it exits non-zero."""
  out = warm_python.Run(
    [sys.executable, '-c', script, *map(str, args)], timeout=timeout
  )
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith('RESULT')][0]
  return json.loads(line[len('RESULT') :])
