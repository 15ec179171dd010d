"""Times deleting tf.data iterators, with tf.data's autotuning on or off.

  python docs/data/tf_data_iterator_deletion.py --autotune=1 --seconds=90

Iterators over the pipeline shape `BaseInputGenerator.GetDataset` builds
(an enumerated stream, a parallel map, a batch, a map, a prefetch) are made,
read, left idle and deleted at random for --seconds; each deletion is timed.
Prints the slowest deletions and a JSON line with all of them.
"""

import argparse
import json
import random
import time

import tensorflow as tf


def _Dataset(autotune):
  ds = tf.data.Dataset.range(1000).repeat().enumerate()
  ds = ds.map(
    lambda i, x: x * 2 + i,
    num_parallel_calls=tf.data.AUTOTUNE,
    deterministic=True,
  )
  ds = ds.batch(4).map(lambda x: x + 1).prefetch(tf.data.AUTOTUNE)
  if not autotune:
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = ds.with_options(options)
  return ds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--autotune', type=int, default=1, choices=(0, 1))
  parser.add_argument('--seconds', type=float, default=90)
  parser.add_argument('--seed', type=int, default=2)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  live, seconds = [], []
  end = time.time() + args.seconds
  while time.time() < end:
    r = rng.random()
    if r < 0.3 or not live:
      it = iter(_Dataset(args.autotune))
      next(it)
      live.append(it)
    elif r < 0.6:
      next(rng.choice(live))
    elif r < 0.8:
      it = live.pop(rng.randrange(len(live)))
      start = time.time()
      del it
      seconds.append(round(time.time() - start, 3))
    else:
      time.sleep(rng.random() * 3)
  slow = sorted(seconds, reverse=True)[:5]
  print(
    f'autotune={args.autotune}: {len(seconds)} deletions, slowest (s): {slow}'
  )
  print(json.dumps({'autotune': bool(args.autotune), 'seconds': seconds}))


if __name__ == '__main__':
  main()
