"""What a traced step runs: its ops with those of the functions it calls.

A pipeline's cells are function calls (`cells/cell_function.py`), so the
ops of a cell are in the graph's function library, once, and each work item
is one call op. `ExpandedOps` yields the ops of the graph as (op type,
device), each call replaced by the ops of its function on the call's device
(and each loop or branch by those of its bodies, once); `GraphSize` counts
the ops that were built.
"""

import tensorflow as tf

_CALLS = ('PartitionedCall', 'StatefulPartitionedCall')
# A pipeline built as loops (`pipeline/clock_loop.py`) calls its cells from
# a while loop's body, inside tf.cond branches: each body counts once.
_LOOPS_AND_BRANCHES = {
  'While': ('cond', 'body'),
  'StatelessWhile': ('cond', 'body'),
  'If': ('then_branch', 'else_branch'),
  'StatelessIf': ('then_branch', 'else_branch'),
}


def _Library(graph_def):
  return {f.signature.name: f for f in graph_def.library.function}


def _Bodies(node):
  """The functions a call, loop or branch node runs."""
  if node.op in _CALLS:
    return [node.attr['f'].func.name]
  if node.op in _LOOPS_AND_BRANCHES:
    return [node.attr[a].func.name for a in _LOOPS_AND_BRANCHES[node.op]]
  return []


def _FunctionOps(library, name, device, depth=0):
  for node in library[name].node_def:
    node_device = node.device or device
    bodies = _Bodies(node) if depth < 8 else []
    if bodies:
      for body in bodies:
        yield from _FunctionOps(library, body, node_device, depth + 1)
    elif node.op in library and depth < 8:
      yield from _FunctionOps(library, node.op, node_device, depth + 1)
    else:
      yield node.op, node_device


def ExpandedOps(graph):
  """[(op type, device)] that one run of `graph` executes."""
  library = _Library(graph.as_graph_def())
  out = []
  for op in graph.get_operations():
    bodies = _Bodies(op.node_def)
    if bodies:
      for body in bodies:
        out.extend(_FunctionOps(library, body, op.device))
    else:
      out.append((op.type, op.device))
  return out


def DeviceIndex(device):
  return tf.DeviceSpec.from_string(device).device_index


def GraphSize(graph):
  """(ops in the graph, ops in its function library)."""
  library = graph.as_graph_def().library.function
  return len(graph.get_operations()), sum(len(f.node_def) for f in library)
