"""Fields of Linux's /proc text files, without TensorFlow.

`runners/device_memory` reads this process's resident memory before
TensorFlow is imported (its CPU allocator statistics must be switched on
first), and `core/worker_memory` parses the same files as read on a remote
worker, so the parsing lives here, free of TensorFlow.
"""

import os
import re

__all__ = ['CpuSeconds', 'Field', 'ReadStatus']


def Field(text, name):
  """The number after `name:` in /proc text (`status`, `meminfo`), in bytes
  where it is given in kB; None where the field is missing."""
  m = re.search(rf'^{name}:\s+(\d+)(\s*kB)?', text, re.MULTILINE)
  if not m:
    return None
  return int(m.group(1)) * (1024 if m.group(2) else 1)


def ReadStatus(pid='self', names=('VmRSS', 'VmHWM')):
  """{name: bytes} of the fields `names` of /proc/<pid>/status that it
  holds ({} where the file cannot be read)."""
  try:
    with open(f'/proc/{pid}/status') as f:
      text = f.read()
  except OSError:
    return {}
  out = {name: Field(text, name) for name in names}
  return {k: v for k, v in out.items() if v is not None}


def CpuSeconds(pid='self'):
  """User + system CPU seconds of process `pid` so far, from
  /proc/<pid>/stat."""
  with open(f'/proc/{pid}/stat', encoding='ascii') as f:
    fields = f.read().rsplit(')', 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')
