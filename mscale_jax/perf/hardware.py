"""Accelerator and cluster descriptions: peaks, memory, links and a tiered Clos network.

Numbers are data-sheet peaks; how much of a peak real kernels reach lives in `constants.py`,
so one preset serves every efficiency assumption. Peak FLOP/s come from the one table in
`mscale_jax.flops.PEAK_FLOPS`. Bandwidths are bytes/s in one direction.
"""
import dataclasses

from mscale_jax.errors import ConfigError
from mscale_jax.flops import PEAK_FLOPS

GB = 1e9
GiB = 2.0 ** 30


@dataclasses.dataclass(frozen=True)
class NetworkTier:
  """One switch tier: it connects up to `devices` accelerators; crossing it costs `latency_s`."""
  name: str
  devices: int
  latency_s: float


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator and how it is wired: the node (fast links) and the network above it."""
  name: str
  peak_flops: dict                # dtype -> dense FLOP/s
  hbm_bw: float                   # bytes/s
  hbm_bytes: float
  num_sms: int                    # compute units that communication kernels can take
  devices_per_node: int
  intra_node_bw: float            # per device, one direction, bytes/s
  intra_node_latency_s: float
  nics_per_node: int
  nic_bw: float                   # per NIC, one direction, bytes/s
  tiers: tuple                    # NetworkTier, innermost first
  device_kinds: tuple = ()        # lower-case pieces of the JAX device_kind this preset models

  def peak(self, dtype: str = "bfloat16") -> float:
    """Dense peak FLOP/s in `dtype`."""
    if dtype not in self.peak_flops:
      raise ConfigError("dtype", dtype, f"one of {sorted(self.peak_flops)} on {self.name}")
    return self.peak_flops[dtype]

  @property
  def net_bw_per_device(self) -> float:
    """Network bandwidth one device can use when every device of the node talks at once."""
    return self.nics_per_node * self.nic_bw / self.devices_per_node

  def tier_for_span(self, span: int) -> NetworkTier | None:
    """The innermost tier whose reach covers `span` consecutive devices; None inside a node."""
    if span <= self.devices_per_node:
      return None
    for tier in self.tiers:
      if span <= tier.devices:
        return tier
    return self.tiers[-1]


# The paper's cluster (MegaScale section 2 / Table 1; NVIDIA A100 SXM4 80GB data sheet).
A100_MEGASCALE = Hardware(
    name="a100_megascale",
    peak_flops=PEAK_FLOPS["a100"],
    hbm_bw=2039 * GB,             # A100 SXM4 80GB: 2,039 GB/s (the 40GB part has 1,555 GB/s)
    hbm_bytes=80 * GiB,           # 80 GB HBM2e (CUDA reports 81,920 MiB)
    num_sms=108,
    devices_per_node=8,
    intra_node_bw=300 * GB,       # NVLink 3: 12 links x 50 GB/s bidirectional = 300 GB/s per way
    intra_node_latency_s=8e-6,    # NCCL's per-step base latency on NVLink (its tuning tables)
    nics_per_node=8,
    nic_bw=200e9 / 8,             # 8 x 200 Gb/s HDR RDMA NICs per server (paper section 2)
    # Three-tier Clos, 1:1 down/up at every tier (paper section 3.4). A 25.6 Tb/s switch has 64
    # x 400G ports; 32 go down, split into 64 x 200G NIC ports, so a tier-1 switch reaches 64
    # servers on one rail (512 GPUs). Tier 2 groups 8 tier-1 switches (4,096 GPUs); tier 3 spans
    # the cluster. Latencies: NCCL's inter-node base latency plus ~1 us per extra switch hop.
    tiers=(NetworkTier("tor", 512, 15e-6), NetworkTier("aggregation", 4096, 17e-6),
           NetworkTier("spine", 1 << 20, 19e-6)),
    device_kinds=("a100",),
)

# NVIDIA H100 SXM5 data sheet; DGX H100: 8 x 400 Gb/s ConnectX-7 compute NICs.
H100_DGX = dataclasses.replace(
    A100_MEGASCALE, name="h100_dgx",
    peak_flops=PEAK_FLOPS["h100"],  # SXM; the PCIe card ('h100 pcie') is slower
    hbm_bw=3350 * GB, hbm_bytes=80 * GiB, num_sms=132,
    intra_node_bw=450 * GB,       # NVLink 4: 18 links, 900 GB/s bidirectional
    nic_bw=400e9 / 8, device_kinds=("h100",))

# H800: the H100 with NVLink cut to 400 GB/s bidirectional (export variant), same compute.
H800_DGX = dataclasses.replace(H100_DGX, name="h800_dgx", intra_node_bw=200 * GB,
                               device_kinds=("h800",))

# TPU v5p (Google Cloud TPU docs): 459 TFLOP/s bf16, 95 GB HBM at 2,765 GB/s, ICI 4,800 Gb/s
# per chip. The 3D torus is approximated as a 'node' of one 4x4x4 cube (64 chips) with ICI at
# half the chip's total per direction, and data-centre network (DCN) between cubes at 200 Gb/s
# per chip; a torus is not a Clos, so treat cross-cube numbers as rough.
TPU_V5P = Hardware(
    name="tpu_v5p",
    peak_flops=PEAK_FLOPS["tpu v5p"],
    # ICI collectives run on DMA engines, not on the TensorCores: num_sms is set so that
    # overlapped communication takes a negligible share of compute.
    hbm_bw=2765 * GB, hbm_bytes=95 * GB, num_sms=1 << 12,
    devices_per_node=64, intra_node_bw=300 * GB, intra_node_latency_s=5e-6,
    nics_per_node=64, nic_bw=200e9 / 8,
    tiers=(NetworkTier("dcn", 1 << 20, 25e-6),),
    device_kinds=("tpu v5p", "tpu v5"),   # v5p reports 'TPU v5'
)

PRESETS = {hw.name: hw for hw in (A100_MEGASCALE, H100_DGX, H800_DGX, TPU_V5P)}


def models_device(hw: Hardware, device_kind: str) -> bool:
  """Whether a JAX `device_kind` (as a benchmark record names it) is the accelerator `hw` models.

  The longest known name found in the kind decides, so 'NVIDIA H100 PCIe' ('h100 pcie') is
  not the SXM preset's 'h100', nor 'TPU v5 lite' the v5p's 'tpu v5'.
  """
  kind = device_kind.lower()
  known = set(PEAK_FLOPS).union(*(p.device_kinds for p in PRESETS.values()), hw.device_kinds)
  found = [name for name in known if name in kind]
  return bool(found) and max(found, key=lambda name: (len(name), name)) in hw.device_kinds


def get_hardware(name: str) -> Hardware:
  """The preset called `name`; a ConfigError lists the known ones."""
  if name not in PRESETS:
    raise ConfigError("hardware", name, f"one of {sorted(PRESETS)}")
  return PRESETS[name]
