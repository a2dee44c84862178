"""Hardware catalogue: GPUs, links and hosts, every number with the document it comes from.

Units are SI bytes and seconds. Link bandwidth is *per GPU, per direction*: a ring collective sends
and receives at the same time, so its time is the bytes each rank sends over one direction
(nccl-tests "bus bandwidth", NVIDIA nccl-tests doc/PERFORMANCE.md). Vendors quote NVLink and PCIe
as bidirectional totals; we halve them and say so in the source string.

HBM capacities are binary (nvidia-smi lists an A100 80GB as 81920 MiB), so "80GB" is stored as
80 GiB; the CUDA driver reserves a few hundred MiB of it, which the plan's headroom covers.
Latencies are not datasheet figures: they are order-of-magnitude assumptions for one ring step of
NCCL and are labelled as such. Every entry can be overridden from the CLI or `make_cluster`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zerokit.planner.device import DeviceProfile

GiB = 2**30
TiB = 2**40
TB = 10**12


@dataclass(frozen=True)
class Link:
    key: str
    name: str
    bandwidth: float
    """bytes/s per GPU per direction."""
    latency: float
    """seconds per ring step (one hop of a collective)."""
    source: str


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory: int
    """bytes."""
    peak_flops: dict[str, float]
    """Dense tensor-core peak per compute dtype (no sparsity); fp32 means plain (non-TF32) FP32."""
    hbm_bandwidth: float
    """bytes/s, for the on-GPU optimizer step."""
    intra_link: str
    pcie: str
    inter_link: str
    host: str
    source: str

    def __hash__(self) -> int:  # dict field: hash by key
        return hash(self.key)


@dataclass(frozen=True)
class Host:
    key: str
    name: str
    ram: int
    """bytes of host RAM per node."""
    ram_bandwidth: float
    """bytes/s, all sockets (the CPU optimizer step is memory-bound)."""
    cpu_cores: int
    nvme_capacity: int
    """bytes of local NVMe per node."""
    nvme_read: float
    """bytes/s, all drives striped."""
    nvme_write: float
    source: str


_NVLINK_LATENCY = "latency: assumed 1.5 us per ring step (NCCL intra-node order of magnitude, not a datasheet figure)"
_PCIE_LATENCY = "latency: assumed 3 us per ring step (not a datasheet figure)"
_IB_LATENCY = "latency: assumed 5 us per ring step across nodes (not a datasheet figure)"
_ETH_LATENCY = "latency: assumed 10 us per ring step over RoCE/TCP (not a datasheet figure)"

LINKS: dict[str, Link] = {link.key: link for link in (
    Link("nvlink2", "NVLink 2", 150e9, 1.5e-6,
         "NVIDIA V100 datasheet: NVLink 300 GB/s bidirectional -> 150 GB/s each way; " + _NVLINK_LATENCY),
    Link("nvlink3", "NVLink 3", 300e9, 1.5e-6,
         "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional (12 links x 50 GB/s, Ampere GA100 "
         "whitepaper) -> 300 GB/s each way; " + _NVLINK_LATENCY),
    Link("nvlink4", "NVLink 4", 450e9, 1.5e-6,
         "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional (18 links) -> 450 GB/s each way; " + _NVLINK_LATENCY),
    Link("nvlink5", "NVLink 5", 900e9, 1.5e-6,
         "NVIDIA DGX B200 datasheet: fifth-generation NVLink 1.8 TB/s per GPU bidirectional -> 900 GB/s "
         "each way; " + _NVLINK_LATENCY),
    Link("pcie3", "PCIe 3.0 x16", 15.75e9, 3e-6,
         "PCI-SIG PCIe 3.0: 8 GT/s x 16 lanes, 128b/130b -> 15.75 GB/s each way (V100 datasheet: "
         "32 GB/s bidirectional); " + _PCIE_LATENCY),
    Link("pcie4", "PCIe 4.0 x16", 31.5e9, 3e-6,
         "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b -> 31.5 GB/s each way (A100 datasheet: "
         "64 GB/s bidirectional); " + _PCIE_LATENCY),
    Link("pcie5", "PCIe 5.0 x16", 63e9, 3e-6,
         "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b -> 63 GB/s each way (H100 datasheet: "
         "128 GB/s bidirectional); " + _PCIE_LATENCY),
    Link("ib-hdr", "InfiniBand HDR 200 Gb/s", 25e9, 5e-6,
         "NVIDIA ConnectX-6 datasheet: HDR InfiniBand 200 Gb/s per port = 25 GB/s each way; " + _IB_LATENCY),
    Link("ib-ndr", "InfiniBand NDR 400 Gb/s", 50e9, 5e-6,
         "NVIDIA ConnectX-7 datasheet: NDR InfiniBand 400 Gb/s per port = 50 GB/s each way; " + _IB_LATENCY),
    Link("eth-100g", "Ethernet 100 Gb/s", 12.5e9, 10e-6,
         "IEEE 802.3ba/bj 100 Gb/s Ethernet line rate = 12.5 GB/s each way; " + _ETH_LATENCY),
    Link("eth-200g", "Ethernet 200 Gb/s", 25e9, 10e-6,
         "IEEE 802.3bs 200 Gb/s Ethernet line rate = 25 GB/s each way; " + _ETH_LATENCY),
    Link("eth-400g", "Ethernet 400 Gb/s", 50e9, 10e-6,
         "IEEE 802.3bs-2017 400 Gb/s Ethernet line rate = 50 GB/s each way; " + _ETH_LATENCY),
)}

_PM1733 = ("per drive: Samsung PM1733 U.2 PCIe 4.0 (Samsung launch specs) 6.4 GB/s read, 3.8 GB/s "
           "write, assumed for the DGX U.2 bays, drives striped")
_EPYC_7742 = "2x AMD EPYC 7742 (AMD spec: 64 cores, 8 channels DDR4-3200 = 204.8 GB/s per socket)"

HOSTS: dict[str, Host] = {host.key: host for host in (
    Host("dgx-a100", "DGX A100 640GB", 2048 * GiB, 2 * 204.8e9, 128, 8 * 3840 * 10**9, 8 * 6.4e9, 8 * 3.8e9,
         "NVIDIA DGX A100 user guide / datasheet (640GB system): 2 TB RAM, 8x 3.84 TB U.2 NVMe (30 TB); "
         + _EPYC_7742 + "; " + _PM1733),
    Host("dgx-a100-320gb", "DGX A100 320GB", 1024 * GiB, 2 * 204.8e9, 128, 4 * 3840 * 10**9, 4 * 6.4e9,
         4 * 3.8e9, "NVIDIA DGX A100 datasheet (320GB system): 1 TB RAM, 4x 3.84 TB U.2 NVMe (15 TB); "
         + _EPYC_7742 + "; " + _PM1733),
    Host("dgx-h100", "DGX H100 / H200", 2048 * GiB, 2 * 307.2e9, 112, 8 * 3840 * 10**9, 8 * 6.4e9, 8 * 3.8e9,
         "NVIDIA DGX BasePOD reference architecture (DGX H100/H200): 2 TB DDR5, 2x Xeon Platinum 8480C "
         "(112 cores; Intel ark: 8 channels DDR5-4800 = 307.2 GB/s per socket), 8x 3.84 TB U.2 NVMe; "
         + _PM1733),
    Host("dgx-b200", "DGX B200", 2048 * GiB, 2 * 358.4e9, 112, 8 * 3840 * 10**9, 8 * 6.4e9, 8 * 3.8e9,
         "NVIDIA DGX B200 datasheet: 2 TB RAM (up to 4 TB), 2x Xeon Platinum 8570 (112 cores; Intel ark: "
         "8 channels DDR5-5600 = 358.4 GB/s per socket), 8x 3.84 TB U.2 NVMe; " + _PM1733),
    Host("generic", "generic PCIe server", 512 * GiB, 204.8e9, 64, 3840 * 10**9, 6.4e9, 3.8e9,
         "assumption, not a datasheet: one socket with 8 channels DDR4-3200 (204.8 GB/s), 512 GiB RAM, one "
         "3.84 TB PCIe 4.0 NVMe; give --host-ram-gb/--nvme-gb/--nvme-read-gbps for your machine"),
)}


def _gpu(key, name, mem_gib, bf16, fp16, fp32, hbm, intra, pcie, inter, host, source) -> GPU:
    flops = {"fp32": fp32 * 1e12, "fp16": fp16 * 1e12}
    if bf16 is not None:
        flops["bf16"] = bf16 * 1e12
    return GPU(key, name, int(mem_gib * GiB), flops, hbm * 1e9, intra, pcie, inter, host, source)


GPUS: dict[str, GPU] = {gpu.key: gpu for gpu in (
    _gpu("a100-40gb", "A100 40GB SXM", 40, 312, 312, 19.5, 1555, "nvlink3", "pcie4", "ib-hdr", "dgx-a100-320gb",
         "NVIDIA A100 Tensor Core GPU datasheet: 40 GB HBM2 at 1,555 GB/s; BF16/FP16 tensor 312 TFLOPS dense "
         "(624 with sparsity); FP32 19.5 TFLOPS"),
    _gpu("a100-80gb", "A100 80GB SXM", 80, 312, 312, 19.5, 2039, "nvlink3", "pcie4", "ib-hdr", "dgx-a100",
         "NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e at 2,039 GB/s; BF16/FP16 tensor 312 TFLOPS dense "
         "(624 with sparsity); FP32 19.5 TFLOPS"),
    _gpu("a100-80gb-pcie", "A100 80GB PCIe", 80, 312, 312, 19.5, 1935, "pcie4", "pcie4", "eth-100g", "generic",
         "NVIDIA A100 Tensor Core GPU datasheet (PCIe): 80 GB HBM2e at 1,935 GB/s; BF16 312 TFLOPS dense; "
         "NVLink bridge joins only pairs, so GPUs talk over PCIe 4.0"),
    _gpu("h100-sxm", "H100 80GB SXM", 80, 989, 989, 67, 3350, "nvlink4", "pcie5", "ib-ndr", "dgx-h100",
         "NVIDIA H100 Tensor Core GPU datasheet (SXM): 80 GB HBM3 at 3.35 TB/s; BF16/FP16 tensor 1,979 TFLOPS "
         "with sparsity = 989 dense; FP32 67 TFLOPS"),
    _gpu("h100-pcie", "H100 80GB PCIe", 80, 756, 756, 51, 2000, "pcie5", "pcie5", "eth-100g", "generic",
         "NVIDIA H100 PCIe product brief / datasheet: 80 GB HBM2e at 2 TB/s; BF16 1,513 TFLOPS with sparsity "
         "= 756 dense; FP32 51 TFLOPS"),
    _gpu("h200", "H200 141GB SXM", 141, 989, 989, 67, 4800, "nvlink4", "pcie5", "ib-ndr", "dgx-h100",
         "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; BF16 1,979 TFLOPS with "
         "sparsity = 989 dense; FP32 67 TFLOPS; NVLink 900 GB/s"),
    _gpu("b200", "B200 180GB", 180, 2250, 2250, 75, 8000, "nvlink5", "pcie5", "ib-ndr", "dgx-b200",
         "NVIDIA DGX B200 / HGX B200 datasheet: 1,440 GB HBM3e for 8 GPUs (180 GB each) at 8 TB/s per GPU; "
         "FP16/BF16 36 PFLOPS with sparsity for 8 GPUs = 2.25 PFLOPS dense per GPU; FP32 600 TFLOPS for 8"),
    _gpu("l40s", "L40S 48GB", 48, 362, 362, 91.6, 864, "pcie4", "pcie4", "eth-100g", "generic",
         "NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s; BF16 tensor 362.05 TFLOPS dense (733 with "
         "sparsity); FP32 91.6 TFLOPS; no NVLink"),
    _gpu("a10", "A10 24GB", 24, 125, 125, 31.2, 600, "pcie4", "pcie4", "eth-100g", "generic",
         "NVIDIA A10 datasheet: 24 GB GDDR6 at 600 GB/s; BF16 tensor 125 TFLOPS dense (250 with sparsity); "
         "FP32 31.2 TFLOPS"),
    _gpu("rtx-4090", "GeForce RTX 4090", 24, 165.2, 165.2, 82.6, 1008, "pcie4", "pcie4", "eth-100g", "generic",
         "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: 24 GB GDDR6X at 1,008 GB/s; BF16 tensor "
         "with FP32 accumulate 165.2 TFLOPS dense; FP32 82.6 TFLOPS; no NVLink"),
    _gpu("v100-32gb", "V100 32GB SXM2", 32, None, 125, 15.7, 900, "nvlink2", "pcie3", "ib-hdr", "generic",
         "NVIDIA V100 datasheet (SXM2): 32 GB HBM2 at 900 GB/s; FP16 tensor 125 TFLOPS; FP32 15.7 TFLOPS; "
         "no BF16"),
)}


def _lookup(table: dict, key: str, what: str):
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; accepted: {', '.join(table)}")
    return table[key]


def gpu(key: str) -> GPU:
    return _lookup(GPUS, key, "GPU")


def link(key: str) -> Link:
    return _lookup(LINKS, key, "link")


def host(key: str) -> Host:
    return _lookup(HOSTS, key, "host")


@dataclass(frozen=True)
class Cluster:
    """`nodes` identical nodes of `gpus_per_node` GPUs."""

    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra_link: Link
    inter_link: Link
    pcie: Link
    host: Host
    nics_per_node: int
    """Inter-node ports per node; DGX-style nodes have one per GPU (rail-optimised)."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def inter_bandwidth_per_gpu(self) -> float:
        """bytes/s one GPU gets across nodes when all GPUs of a node send at once."""
        return self.inter_link.bandwidth * self.nics_per_node / self.gpus_per_node

    def peak_flops(self, precision: str) -> float:
        if precision not in self.gpu.peak_flops:
            raise ValueError(f"{self.gpu.name} has no {precision} tensor cores; use "
                             + " or ".join(sorted(self.gpu.peak_flops)))
        return self.gpu.peak_flops[precision]

    @property
    def name(self) -> str:
        nics = f"{self.nics_per_node}x {self.inter_link.name}" if self.nodes > 1 else "single node"
        return (f"{self.nodes} x {self.gpus_per_node} {self.gpu.name} ({self.intra_link.name} in node, "
                f"{nics})")


def _override(item, **changes):
    """`replace` with only the changes that were given, and a source that says so."""
    given = {k: v for k, v in changes.items() if v is not None}
    if not given:
        return item
    for name, value in given.items():
        if not 0 < value < math.inf:  # written so that NaN fails too
            raise ValueError(f"{name}={value!r} must be > 0 and finite")
    note = ", ".join(f"{k}={v:g}" for k, v in given.items())
    return replace(item, source=f"user override ({note}); otherwise {item.source}", **given)


def device_entries(profile: DeviceProfile, gpus_per_node: int) -> tuple[GPU, Link]:
    """A measured device (a CPU, `zerokit plan --measure-device`) as a catalogue GPU and its link between
    ranks: `gpus_per_node` ranks share its memory."""
    gpu_entry = GPU("cpu", profile.name, profile.memory_bytes // gpus_per_node if profile.memory_bytes else 0,
                    dict(profile.peak_flops), profile.memory_bandwidth, "loopback", "pcie4", "eth-100g", "generic",
                    profile.source)
    return gpu_entry, Link("loopback", "gloo between ranks on this host", profile.link_bandwidth,
                           profile.link_latency, profile.source)


def make_cluster(gpu_key: str, *, gpus_per_node: int = 8, nodes: int = 1, intra_link: str | None = None,
                 inter_link: str | None = None, host_key: str | None = None, nics_per_node: int | None = None,
                 gpu_memory: int | None = None, peak_tflops: float | None = None,
                 intra_bandwidth: float | None = None, inter_bandwidth: float | None = None,
                 intra_latency: float | None = None, inter_latency: float | None = None,
                 host_ram: int | None = None, nvme_capacity: int | None = None, nvme_read: float | None = None,
                 nvme_write: float | None = None, ram_bandwidth: float | None = None,
                 device: DeviceProfile | None = None) -> Cluster:
    """A cluster from catalogue keys, with the user's own numbers where given (bytes, bytes/s, s).
    gpu_key "cpu" takes a measured `device` (zerokit/planner/device.py) instead of a catalogue entry."""
    for name, value in (("gpus per node", gpus_per_node), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if nics_per_node is not None and (not isinstance(nics_per_node, int) or nics_per_node < 1):
        raise ValueError(f"nics per node={nics_per_node!r} must be a positive integer")
    measured_link = None
    if gpu_key == "cpu":
        if device is None:
            raise ValueError("--gpu cpu needs the device's numbers: --device-file (from zerokit plan --measure-device)")
        chosen, measured_link = device_entries(device, gpus_per_node)
        if not chosen.memory and gpu_memory is None:
            raise ValueError("the device file does not say how much memory it has; give --gpu-memory-gib")
    else:
        chosen = gpu(gpu_key)
    chosen = _override(chosen, memory=gpu_memory)
    if peak_tflops is not None:
        if not 0 < peak_tflops < math.inf:
            raise ValueError(f"peak tflops={peak_tflops!r} must be > 0 and finite")
        flops = {name: peak_tflops * 1e12 for name in chosen.peak_flops}
        chosen = replace(chosen, peak_flops=flops, source=f"user override (peak {peak_tflops:g} TFLOPS); "
                                                          f"otherwise {chosen.source}")
    base_intra = (measured_link if measured_link is not None and intra_link is None
                  else link(intra_link or chosen.intra_link))
    intra = _override(base_intra, bandwidth=intra_bandwidth, latency=intra_latency)
    inter = _override(link(inter_link or chosen.inter_link), bandwidth=inter_bandwidth, latency=inter_latency)
    node = _override(host(host_key or chosen.host), ram=host_ram, nvme_capacity=nvme_capacity,
                     nvme_read=nvme_read, nvme_write=nvme_write, ram_bandwidth=ram_bandwidth)
    return Cluster(chosen, gpus_per_node, nodes, intra, inter, link(chosen.pcie), node,
                   nics_per_node or gpus_per_node)
