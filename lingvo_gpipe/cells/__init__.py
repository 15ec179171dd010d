"""A pipeline cell: its layers' shapes checked cell by cell (`cell_shapes`),
and the cell traced once into a forward and a recompute-and-backward
function that every work item calls (`cell_function.CellFunctions`, what
the engine in `pipeline/` is given), with their layout of tensors
(`cell_layout`), their checks (`cell_checks`) and identical layers as one
function (`layer_function`). Nothing here knows the schedule: `pipeline/`
imports this package, never the other way."""
