"""Loads a checkpoint written by Lingvo (TF1) into a layer, by name.

A Lingvo variable is named by its variable scopes plus `/var`:
`cell_0/fc0/w/var` (Lingvo's SeqLayer and PipeliningLayer put their children
at the top, without their own name). Here the same weight is `pipe/cell_0/
fc0/w`: the layer path, whose names are Lingvo's scope names. So each
variable `<root>/<rest>` of the layer is read from `<rest>/var` or, failing
that, `<root>/<rest>/var`:

  pipe = p.Instantiate()   # the ported Lingvo Params
  lingvo_checkpoint.LoadLingvoCheckpoint(pipe, '/path/to/ckpt-00012345')
"""

import tensorflow as tf

__all__ = ['LingvoNames', 'LoadLingvoCheckpoint']


def LingvoNames(var_name):
  """The names a Lingvo checkpoint may give the variable `var_name`."""
  name = var_name.split(':')[0].rstrip('/')
  root, _, rest = name.partition('/')
  names = [f'{rest}/var'] if rest else []
  return names + [f'{name}/var']


def LoadLingvoCheckpoint(layer, path):
  """Assigns every variable of `layer` from Lingvo's checkpoint `path`.

  Args:
    layer: a built layer (e.g. a PipeliningLayer from Lingvo's Params).
    path: a checkpoint prefix or a directory with a `checkpoint` file.

  Returns:
    {variable name here: name in the checkpoint}.

  Raises:
    ValueError: in one line, naming the first variable the checkpoint lacks
      (or has in another shape) and the names tried.
  """
  if tf.io.gfile.isdir(path):
    latest = tf.train.latest_checkpoint(path)
    if latest is None:
      raise ValueError(f'{path!r} holds no checkpoint; give its prefix.')
    path = latest
  reader = tf.train.load_checkpoint(path)
  shapes = reader.get_variable_to_shape_map()
  loaded = {}
  for name, var in layer.VariablesByName().items():
    tried = LingvoNames(name)
    found = next((n for n in tried if n in shapes), None)
    if found is None:
      raise ValueError(
        f'Lingvo checkpoint {path!r} has no variable for {name!r} (tried '
        f"{tried}); check that the Params are the Lingvo model's."
      )
    if list(shapes[found]) != var.shape.as_list():
      raise ValueError(
        f'Lingvo checkpoint {path!r}: {found} has shape {shapes[found]} but '
        f'{name!r} has {var.shape.as_list()}; check the Params.'
      )
    var.assign(reader.get_tensor(found))
    loaded[name] = found
  return loaded
