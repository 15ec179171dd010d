"""The devices the cost model knows: `Device` and the presets.

A `Device` holds what the planner needs to turn a layer's flops, bytes and
ops into seconds (`ComputeS`) and its memory, links and allocator into the
simulator's `cost_model.DeviceSpec` (`Spec`). `PRESETS` holds published
figures of TPUs and GPUs and this host's CPU; `GetPreset(name)` looks one
up (`layer_profile.MeasuredDevice` measures this host instead).
"""

import dataclasses

from lingvo_gpipe.planning import cost_model

__all__ = ['BFC_OVERHEAD', 'Device', 'PRESETS', 'GetPreset']

_GB = 1e9
_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Device:
  """An accelerator as the cost model sees it.

  Attributes:
    name: the preset's key, e.g. 'tpu_v3'.
    description: what it is and where its numbers come from.
    peak_flops: peak FLOP/s of one device (the matrix units, 16-bit inputs).
    memory_bytes: memory of one device.
    memory_bytes_per_s: memory bandwidth of one device.
    link_bytes_per_s: one-way bandwidth between two neighbouring devices.
    link_latency_s: latency of one transfer.
    op_overhead_s: fixed cost of launching one op.
    flops_efficiency: the fraction of peak_flops that training reaches
      (an assumption, the same for every preset unless measured).
    allocator_overhead: what the device's allocator adds to the buffers
      that a re-materialized cell frees and allocates again for every
      micro-batch, as a fraction of their bytes. TensorFlow's BFC allocator
      (CPU and GPU) gives a buffer a free chunk of up to twice its size
      without splitting it, and counts the whole chunk as in use; traced at
      the peak of pipelined training steps on this host's workers, the live
      buffers took 1.12-1.19x their bytes (1.06x without
      re-materialization; XLA-compiled cells 1.05-1.70x; docs/planner.md).
      XLA on TPU assigns buffers ahead of time: 0.
  """

  name: str
  description: str
  peak_flops: float
  memory_bytes: int
  memory_bytes_per_s: float
  link_bytes_per_s: float
  link_latency_s: float
  op_overhead_s: float
  flops_efficiency: float = 0.5
  allocator_overhead: float = 0.0

  def Spec(self, memory_bytes=None):
    """The `DeviceSpec` the simulator takes (per-op overhead is charged
    per op by the planner, so the per-task overhead here is 0)."""
    return cost_model.DeviceSpec(
      memory_bytes=int(memory_bytes or self.memory_bytes),
      link_bytes_per_s=self.link_bytes_per_s,
      link_latency_s=self.link_latency_s,
      op_overhead_s=0.0,
      allocator_overhead=self.allocator_overhead,
    )

  def ComputeS(self, flops, bytes_touched, num_ops):
    """Seconds of an op sequence: roofline of compute and memory traffic,
    plus the launch overhead of each op."""
    compute = flops / (self.peak_flops * self.flops_efficiency)
    traffic = bytes_touched / self.memory_bytes_per_s
    return max(compute, traffic) + num_ops * self.op_overhead_s


# What TensorFlow's BFC allocator adds to the buffers of a step, measured on
# this host's CPU workers (`Device.allocator_overhead`). GPUs use the same
# allocator; the fraction there is assumed, not measured.
BFC_OVERHEAD = 0.15

# Published peak numbers (per device: one TPU core, one GPU). Links are the
# one-way bandwidth of the inter-chip link between two neighbours: TPU ICI
# (Jouppi et al., "A domain-specific supercomputer for training deep neural
# networks", CACM 2020: 4 links of 496 Gbit/s on v2, 656 Gbit/s on v3),
# NVLink for GPUs. flops_efficiency 0.5 is an assumption, not a published
# figure; so is the GPUs' allocator_overhead.
PRESETS = {
  d.name: d
  for d in [
    Device(
      'tpu_v2',
      'Cloud TPU v2, one core (published: 45 TFLOP/s bf16 and 16 GiB HBM '
      'per chip of 2 cores, 600 GB/s HBM per chip, ICI 496 Gbit/s per link)',
      peak_flops=22.5e12,
      memory_bytes=8 * _GIB,
      memory_bytes_per_s=300 * _GB,
      link_bytes_per_s=62 * _GB,
      link_latency_s=5e-6,
      op_overhead_s=1e-6,
    ),
    Device(
      'tpu_v3',
      'Cloud TPU v3, one core (published: 123 TFLOP/s bf16 and 32 GiB HBM '
      'per chip of 2 cores, 900 GB/s HBM per chip, ICI 656 Gbit/s per link)',
      peak_flops=61.5e12,
      memory_bytes=16 * _GIB,
      memory_bytes_per_s=450 * _GB,
      link_bytes_per_s=82 * _GB,
      link_latency_s=5e-6,
      op_overhead_s=1e-6,
    ),
    Device(
      'v100',
      'NVIDIA V100 SXM2 32 GB (published: 125 TFLOP/s fp16 tensor, '
      '900 GB/s HBM2, NVLink 2: 2 links of 25 GB/s each way between '
      'neighbours in a DGX-1)',
      peak_flops=125e12,
      memory_bytes=32 * _GB,
      memory_bytes_per_s=900 * _GB,
      link_bytes_per_s=50 * _GB,
      link_latency_s=10e-6,
      op_overhead_s=5e-6,
      allocator_overhead=BFC_OVERHEAD,
    ),
    Device(
      'a100',
      'NVIDIA A100 SXM4 80 GB (published: 312 TFLOP/s bf16 dense, '
      '2039 GB/s HBM2e, NVLink 3: 300 GB/s each way)',
      peak_flops=312e12,
      memory_bytes=80 * _GB,
      memory_bytes_per_s=2039 * _GB,
      link_bytes_per_s=300 * _GB,
      link_latency_s=10e-6,
      op_overhead_s=5e-6,
      allocator_overhead=BFC_OVERHEAD,
    ),
    Device(
      'h100',
      'NVIDIA H100 SXM5 80 GB (published: 989 TFLOP/s bf16 dense, '
      '3.35 TB/s HBM3, NVLink 4: 450 GB/s each way)',
      peak_flops=989e12,
      memory_bytes=80 * _GB,
      memory_bytes_per_s=3350 * _GB,
      link_bytes_per_s=450 * _GB,
      link_latency_s=10e-6,
      op_overhead_s=5e-6,
      allocator_overhead=BFC_OVERHEAD,
    ),
    Device(
      'cpu',
      'A generic host CPU core standing for a device (rough figures: '
      '100 GFLOP/s, 4 GiB, 10 GB/s memory, 1 GB/s loopback gRPC between '
      "processes as tools/benchmark_pipeline.py measures it); use 'measure' "
      'for this host',
      peak_flops=100e9,
      memory_bytes=4 * _GIB,
      memory_bytes_per_s=10 * _GB,
      link_bytes_per_s=1 * _GB,
      link_latency_s=200e-6,
      op_overhead_s=20e-6,
      allocator_overhead=BFC_OVERHEAD,
    ),
  ]
}


def GetPreset(name):
  """The preset `name`; ValueError listing the presets otherwise."""
  if name not in PRESETS:
    raise ValueError(
      f'Unknown device preset {name!r}; use one of {sorted(PRESETS)} '
      "or 'measure' (profiles this host)."
    )
  return PRESETS[name]
