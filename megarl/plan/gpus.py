"""GPU presets for ``cluster.gpu``: memory, dense peak throughput and link bandwidths per GPU.

Numbers from the vendors' datasheets (SXM parts; "dense" = without 2:4 sparsity, which the
datasheets' headline figures include and which training does not use):

| preset | part | memory | BF16 dense | FP8 dense | NVLink per GPU | network per GPU | source |
|---|---|---|---|---|---|---|---|
| ``h100`` | H100 SXM5 | 80 GiB HBM3 | 989 TFLOP/s | 1979 TFLOP/s | 900 GB/s (both directions) | 400 Gb/s ConnectX-7 | NVIDIA H100 Tensor Core GPU datasheet; DGX H100 user guide |
| ``h200`` | H200 SXM | 141 GB HBM3e | 989 TFLOP/s | 1979 TFLOP/s | 900 GB/s | 400 Gb/s ConnectX-7 | NVIDIA H200 datasheet; HGX H200 |
| ``b200`` | B200 (HGX / DGX B200) | 180 GB HBM3e | 2250 TFLOP/s | 4500 TFLOP/s | 1800 GB/s (NVLink 5) | 400 Gb/s ConnectX-7 | NVIDIA DGX B200 datasheet (72 PF FP8 training per 8 GPUs = 9 PF sparse / GPU) |
| ``gb200`` | GB200 NVL72, per GPU | 186 GB HBM3e | 2500 TFLOP/s | 5000 TFLOP/s | 1800 GB/s (72-GPU NVLink domain) | 400 Gb/s ConnectX-7 | NVIDIA GB200 NVL72 datasheet (13.4 TB HBM3e, 360 PF BF16 / 720 PF FP8 sparse per 72 GPUs) |

Memory is in the unit the card is sold in: the H100's "80 GB" is 80 GiB (torch reports 79.6 GiB
usable), the H200's 141 GB, B200's 180 GB and GB200's 186 GB are decimal. GPUs per node: 8 (HGX /
DGX boards), 4 on GB200 (an NVL72 compute tray holds 2 Grace CPUs and 4 Blackwell GPUs).

Bandwidths here are one direction (half the datasheet's bidirectional NVLink figure; a NIC's
line rate / 8), in GB/s = 1e9 bytes/s, the unit of ``megarl plan-sync``'s ``--intra-gbps`` /
``--inter-gbps``. ``auto`` asks ``torch.cuda.get_device_name`` on the node it runs on.
"""  # noqa: E501 - a table row is one line
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model.

    Attributes:
        name: the preset's name (``cluster.gpu``).
        memory_bytes: device memory, bytes.
        bf16_tflops / fp8_tflops: dense peak tensor throughput, TFLOP/s.
        nvlink_gbps: NVLink bandwidth per GPU, one direction, GB/s.
        network_gbps: inter-node bandwidth per GPU, one direction, GB/s.
        gpus_per_node: GPUs of one node (one HGX board, one GB200 tray).
    """

    name: str
    memory_bytes: int
    bf16_tflops: float
    fp8_tflops: float
    nvlink_gbps: float
    network_gbps: float
    gpus_per_node: int = 8

    @property
    def memory_text(self) -> str:
        """The memory in the card's own unit: ``80 GiB``, ``141 GB``."""
        if self.memory_bytes % GIB == 0:
            return f"{self.memory_bytes // GIB} GiB"
        return f"{self.memory_bytes / GB:.0f} GB"


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 80 * GIB, 989.0, 1979.0, 450.0, 50.0),
    "h200": GpuSpec("h200", int(141 * GB), 989.0, 1979.0, 450.0, 50.0),
    "b200": GpuSpec("b200", int(180 * GB), 2250.0, 4500.0, 900.0, 50.0),
    "gb200": GpuSpec("gb200", int(186 * GB), 2500.0, 5000.0, 900.0, 50.0, gpus_per_node=4),
}
"""The presets of the module docstring's table, by ``cluster.gpu`` name."""
CHOICES = (None, "auto", *GPUS)
"""Values ``cluster.gpu`` accepts (None: unknown, the fit check is skipped)."""


def detect_gpu() -> GpuSpec | None:
    """The preset of this node's first CUDA device (by ``torch.cuda.get_device_name``), None without one.

    A device that matches no preset by name is described by its own memory
    (``torch.cuda.get_device_properties``) and the H100's throughput and links.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).upper()
    for key in ("GB200", "B200", "H200", "H100"):  # GB200 before B200: its name contains both
        if key in name:
            return GPUS[key.lower()]
    memory = int(torch.cuda.get_device_properties(0).total_memory)
    base = GPUS["h100"]
    return GpuSpec(name.lower(), memory, base.bf16_tflops, base.fp8_tflops, base.nvlink_gbps, base.network_gbps,
                   torch.cuda.device_count())


def gpu_spec(name: str | None) -> GpuSpec | None:
    """The preset named by ``cluster.gpu`` (``auto``: :func:`detect_gpu`; None: None).

    Raises:
        ValueError: an unknown name (the message names ``cluster.gpu`` and the presets).
    """
    if name is None:
        return None
    if name == "auto":
        return detect_gpu()
    if name not in GPUS:
        raise ValueError(f"cluster.gpu: unknown GPU {name!r} (presets: auto, {', '.join(GPUS)})")
    return GPUS[name]
