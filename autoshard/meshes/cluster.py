"""ClusterSpec: what the cost model knows about a cluster, and the presets.

Every constant the cost model uses comes from a ClusterSpec: devices per node,
nodes, a link level per scope (inside a node, between nodes), peak FLOP/s per
dtype, memory bandwidth and memory per device.

Links are per device and one direction. ``inter_node.bandwidth_bytes_per_s`` is
one device's NIC: a collective group with m members on each node drives m NICs
in parallel (rail-optimized clusters, NCCL's channels), so it crosses nodes at
m times that, capped by the intra-node link; a group with one member per node
gets one NIC (``meshes/logical.py``). Multi-axis collectives are priced as the
cheaper of that flat ring and the hierarchical algorithm (``meshes/cost.py``).

The host link (``host_bandwidth_bytes_per_s``, PCIe) carries each step's batch to the devices: the
cost model charges every device for the batch bytes it stores, so a replicated batch costs the whole
batch per device and a batch split over all devices a shard of it.

Peaks: ``peak_flops_per_s`` is keyed by dtype name; dots and convolutions run
at their operands' dtype. ``"tfloat32"``, when present, is the rate of float32
dots at XLA's default precision on GPUs with TF32 tensor cores (A100, H100);
float32 dots asked for ``precision=HIGHEST`` and everything else in float32 run
at ``"float32"``. A link level marked ``unmeasured`` (profiled on one device,
or the inter-node link profiled on one node) holds placeholder numbers: the
cost model prices with them and a plan that crosses it says so in its
caveats. Specs load from JSON or TOML
files with the same field names as the dataclasses; missing or negative fields
are rejected with a message naming the field.
"""
from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

GIB = 1024**3
GBIT_BPS = 1e9 / 8  # one Gbit/s in bytes per second


class ClusterSpecError(ValueError):
    """A cluster description is incomplete or wrong; the message names the field."""


@dataclass(frozen=True)
class LinkLevel:
    """One level of the interconnect: the link a collective crosses at this scope."""

    name: str  # e.g. "nvlink", "infiniband", "ici", "dcn"
    bandwidth_bytes_per_s: float  # per-device unidirectional bandwidth on this level
    latency_s: float  # per-hop latency (the alpha of the alpha-beta model)
    # True: nobody measured or stated this link (``autoshard profile`` on one device, or on one node for the
    # inter-node link); its numbers are placeholders that keep the cost model defined, and a plan whose
    # devices cross it says so in its caveats (``ClusterSpec.unmeasured_links``)
    unmeasured: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_nodes: int  # hosts / nodes
    devices_per_node: int
    intra_node: LinkLevel  # links between devices of one node
    inter_node: LinkLevel  # links between nodes (unused when num_nodes == 1)
    peak_flops_per_s: Mapping[str, float]  # per device, keyed by dtype name ("float32", "bfloat16", ...)
    memory_bandwidth_bytes_per_s: float  # per device (HBM)
    memory_per_device_bytes: float
    devices_per_process: int = 0  # 0: one process per node
    # float dtypes the device has no arithmetic for, computed in float32 by its compiler: XLA:CPU runs a
    # bfloat16 / float16 dot or convolution on float32 copies of its operands into a float32 result, so
    # the memory model sizes those buffers as float32 (passes/memory_model.py, rule 10); () on GPUs / TPUs
    f32_compute_dtypes: tuple[str, ...] = ()
    # per device, host to device (PCIe): each step's batch arrives over it, so a batch stored replicated
    # costs every device the whole batch; 0: unknown, the batch's arrival is not priced
    host_bandwidth_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        _validate(self)

    def __hash__(self) -> int:
        # explicit: the generated hash fails on the peak_flops_per_s dict, and a LogicalMesh
        # (which holds its ClusterSpec) must be hashable to key the cost caches
        return hash((self.name, self.num_nodes, self.devices_per_node, self.intra_node, self.inter_node,
                     tuple(sorted(self.peak_flops_per_s.items())), self.memory_bandwidth_bytes_per_s,
                     self.memory_per_device_bytes, self.devices_per_process, self.f32_compute_dtypes,
                     self.host_bandwidth_bytes_per_s))

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def process_size(self) -> int:
        return self.devices_per_process or self.devices_per_node

    def node_of(self, device_index: int) -> int:
        return device_index // self.devices_per_node

    def unmeasured_links(self, devices: int) -> tuple[str, ...]:
        """The link levels marked unmeasured that a mesh of ``devices`` devices on this cluster crosses:
        the intra-node link once two devices talk, the inter-node link once they span nodes."""
        crossed = [("intra-node", self.intra_node, devices > 1),
                   ("inter-node", self.inter_node, devices > self.devices_per_node)]
        return tuple(scope for scope, level, used in crossed if used and level.unmeasured)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype; unknown dtypes fall back to float32's rate."""
        if dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        return self.peak_flops_per_s.get("float32", max(self.peak_flops_per_s.values()))

    def with_devices(self, num_nodes: int, devices_per_node: int) -> "ClusterSpec":
        """The same hardware with another device count (e.g. a 6-device slice), named ``base[NxK]``."""
        if (num_nodes, devices_per_node) == (self.num_nodes, self.devices_per_node):
            return self
        data = asdict(self)
        data.update(num_nodes=num_nodes, devices_per_node=devices_per_node,
                    name=f"{self.base_name}[{num_nodes}x{devices_per_node}]")
        return ClusterSpec.from_dict(data)

    @property
    def base_name(self) -> str:
        """The name without a ``[NxK]`` resize suffix: ``cpu-8`` for ``cpu-8[1x4]``."""
        return re.sub(r"(\[\d+x\d+\])+$", "", self.name)

    def same_hardware(self, other: "ClusterSpec") -> bool:
        """Equal in everything the cost model reads (every field but the name)."""
        return replace(self, name="") == replace(other, name="")

    # ---- files -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        data["f32_compute_dtypes"] = list(self.f32_compute_dtypes)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "cluster spec") -> "ClusterSpec":
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{source}: expected a table of fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ClusterSpecError(f"{source}: unknown field(s) {unknown}; known fields: {sorted(known)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ClusterSpecError(f"{source}: missing field(s) {missing}; add them (see the presets in autoshard.meshes.cluster)")
        kwargs = dict(data)
        for level in ("intra_node", "inter_node"):
            kwargs[level] = _link_from(kwargs[level], f"{source}: {level}")
        if not isinstance(kwargs["peak_flops_per_s"], Mapping):
            raise ClusterSpecError(f"{source}: peak_flops_per_s must be a table dtype -> FLOP/s")
        kwargs["peak_flops_per_s"] = {str(k): _number(f"{source}: peak_flops_per_s[{k}]", v)
                                      for k, v in kwargs["peak_flops_per_s"].items()}
        widened = kwargs.get("f32_compute_dtypes", ())
        if not isinstance(widened, (list, tuple)) or not all(isinstance(d, str) for d in widened):
            raise ClusterSpecError(f"{source}: f32_compute_dtypes must be a list of dtype names, got {widened!r}")
        kwargs["f32_compute_dtypes"] = tuple(widened)
        try:
            return cls(**kwargs)
        except ClusterSpecError as err:
            raise ClusterSpecError(f"{source}: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ClusterSpec":
        path = Path(path)
        if not path.exists():
            raise ClusterSpecError(f"cluster file {path} does not exist; pass a preset name ({', '.join(PRESETS)}) or a .json/.toml file")
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
            raise ClusterSpecError(f"cluster file {path} does not parse: {err}") from None
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def _link_from(data: Any, where: str) -> LinkLevel:
    if isinstance(data, LinkLevel):
        return data
    if not isinstance(data, Mapping):
        raise ClusterSpecError(f"{where}: expected a table with name, bandwidth_bytes_per_s, latency_s")
    missing = [f.name for f in fields(LinkLevel) if f.name not in data and f.default is MISSING]
    if missing:
        raise ClusterSpecError(f"{where}: missing field(s) {missing}")
    unknown = sorted(set(data) - {f.name for f in fields(LinkLevel)})
    if unknown:
        raise ClusterSpecError(f"{where}: unknown field(s) {unknown}")
    unmeasured = data.get("unmeasured", False)
    if not isinstance(unmeasured, bool):
        raise ClusterSpecError(f"{where}.unmeasured must be true or false, got {unmeasured!r}")
    return LinkLevel(name=str(data["name"]),
                     bandwidth_bytes_per_s=_number(f"{where}.bandwidth_bytes_per_s", data["bandwidth_bytes_per_s"]),
                     latency_s=_number(f"{where}.latency_s", data["latency_s"]), unmeasured=unmeasured)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterSpecError(f"{where} must be a number, got {value!r}")
    return float(value)


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ClusterSpecError(f"field {name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ClusterSpecError(f"field {name} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")


def _validate(spec: ClusterSpec) -> None:
    for name in ("num_nodes", "devices_per_node"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ClusterSpecError(f"field {name} must be a positive integer, got {value!r}")
    _positive("memory_bandwidth_bytes_per_s", spec.memory_bandwidth_bytes_per_s)
    _positive("memory_per_device_bytes", spec.memory_per_device_bytes)
    _positive("devices_per_process", spec.devices_per_process, allow_zero=True)
    _positive("host_bandwidth_bytes_per_s", spec.host_bandwidth_bytes_per_s, allow_zero=True)
    for level_name in ("intra_node", "inter_node"):
        level = getattr(spec, level_name)
        _positive(f"{level_name}.bandwidth_bytes_per_s", level.bandwidth_bytes_per_s)
        _positive(f"{level_name}.latency_s", level.latency_s, allow_zero=True)
    if not spec.peak_flops_per_s:
        raise ClusterSpecError("field peak_flops_per_s must name at least one dtype")
    for dtype, flops in spec.peak_flops_per_s.items():
        _positive(f"peak_flops_per_s[{dtype}]", flops)


def _gpu(name: str, nodes: int, per_node: int, *, nvlink_gbps: float, inter_gbit: float, bf16_tflops: float,
         tf32_tflops: float, fp32_tflops: float, hbm_tbps: float, mem_gib: float, pcie_gbps: float) -> ClusterSpec:
    return ClusterSpec(
        name=name, num_nodes=nodes, devices_per_node=per_node,
        intra_node=LinkLevel("nvlink", nvlink_gbps * 1e9, 5e-6),
        inter_node=LinkLevel("infiniband" if inter_gbit >= 100 else "ethernet", inter_gbit * GBIT_BPS, 20e-6),
        peak_flops_per_s={"bfloat16": bf16_tflops * 1e12, "float16": bf16_tflops * 1e12,
                          "tfloat32": tf32_tflops * 1e12, "float32": fp32_tflops * 1e12},
        memory_bandwidth_bytes_per_s=hbm_tbps * 1e12, memory_per_device_bytes=mem_gib * GIB,
        host_bandwidth_bytes_per_s=pcie_gbps * 1e9,
    )


# Preset numbers are public datasheet figures (dense, no sparsity): A100 SXM (bf16 312, TF32 156, FP32
# 19.5 TFLOP/s), H100 SXM (bf16 989, TF32 494, FP32 67); NVLink per device, one direction; host links
# PCIe 4.0 x16 (A100, ~25 GB/s achieved of 32) and 5.0 x16 (H100, ~50 of 64), TPU hosts PCIe 3.0 x16.
PRESETS: dict[str, ClusterSpec] = {
    # 8 simulated CPU devices: modest numbers so that communication and compute both matter.
    "cpu-8": ClusterSpec(
        name="cpu-8", num_nodes=1, devices_per_node=8,
        intra_node=LinkLevel("shared-memory", 10e9, 10e-6),
        inter_node=LinkLevel("loopback", 1e9, 50e-6),
        peak_flops_per_s={"float32": 50e9, "bfloat16": 50e9},
        memory_bandwidth_bytes_per_s=20e9, memory_per_device_bytes=2 * GIB, host_bandwidth_bytes_per_s=10e9,
        f32_compute_dtypes=("bfloat16", "float16"),  # XLA:CPU
    ),
    "1x8-a100": _gpu("1x8-a100", 1, 8, nvlink_gbps=300, inter_gbit=200, bf16_tflops=312, tf32_tflops=156, fp32_tflops=19.5,
                     hbm_tbps=2.0, mem_gib=80, pcie_gbps=25),
    # Alpa's setting: two 8-GPU nodes with a 25 Gbit/s-class link between them.
    "2x8-a100": _gpu("2x8-a100", 2, 8, nvlink_gbps=300, inter_gbit=25, bf16_tflops=312, tf32_tflops=156, fp32_tflops=19.5,
                     hbm_tbps=2.0, mem_gib=80, pcie_gbps=25),
    "1x8-h100": _gpu("1x8-h100", 1, 8, nvlink_gbps=450, inter_gbit=400, bf16_tflops=989, tf32_tflops=494, fp32_tflops=67,
                     hbm_tbps=3.35, mem_gib=80, pcie_gbps=50),
    "4x8-h100": _gpu("4x8-h100", 4, 8, nvlink_gbps=450, inter_gbit=400, bf16_tflops=989, tf32_tflops=494, fp32_tflops=67,
                     hbm_tbps=3.35, mem_gib=80, pcie_gbps=50),
    # TPU slices: ICI joins every chip of a slice; the "node" is the host (4 chips each).
    "tpu-v4-32": ClusterSpec(
        name="tpu-v4-32", num_nodes=4, devices_per_node=4,
        intra_node=LinkLevel("ici", 45e9, 2e-6), inter_node=LinkLevel("ici", 45e9, 2e-6),
        peak_flops_per_s={"bfloat16": 275e12, "float32": 275e12 / 4},
        memory_bandwidth_bytes_per_s=1.2e12, memory_per_device_bytes=32 * GIB, host_bandwidth_bytes_per_s=12e9,
    ),
    "tpu-v5e-8": ClusterSpec(
        name="tpu-v5e-8", num_nodes=2, devices_per_node=4,
        intra_node=LinkLevel("ici", 50e9, 2e-6), inter_node=LinkLevel("ici", 50e9, 2e-6),
        peak_flops_per_s={"bfloat16": 197e12, "float32": 197e12 / 4},
        memory_bandwidth_bytes_per_s=0.82e12, memory_per_device_bytes=16 * GIB, host_bandwidth_bytes_per_s=12e9,
    ),
}
ALIASES = {"8xa100": "1x8-a100", "a100": "1x8-a100", "8xh100": "1x8-h100", "cpu": "cpu-8"}


def get_cluster(spec: "ClusterSpec | str | Path | None", *, num_devices: int | None = None) -> ClusterSpec:
    """A ClusterSpec from a preset name, a JSON/TOML file, or None (the devices present).

    With ``num_devices`` the spec is resized when it describes a different count
    (e.g. the cpu-8 preset on 6 simulated devices). A multi-node preset keeps its
    node count when that divides the devices (8 devices of 2x8-a100: 2 nodes of 4).
    """
    if spec is None:
        spec = _describe_local_devices()
    elif isinstance(spec, (str, Path)):
        key = str(spec)
        key = ALIASES.get(key.lower(), key)
        if key in PRESETS:
            spec = PRESETS[key]
        elif Path(key).suffix in (".json", ".toml") or Path(key).exists():
            spec = ClusterSpec.load(key)
        else:
            close = difflib.get_close_matches(key, [*PRESETS, *ALIASES], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ClusterSpecError(f"unknown cluster {str(spec)!r}: {hint}use a preset ({', '.join(PRESETS)}) "
                                   "or a .json/.toml file")
    if num_devices is not None and num_devices != spec.num_devices:
        if num_devices < 1:
            raise ClusterSpecError(f"num_devices must be positive, got {num_devices}")
        if spec.num_nodes == 1:
            spec = spec.with_devices(1, num_devices)
        elif num_devices % spec.num_nodes == 0 and num_devices // spec.num_nodes <= spec.devices_per_node:
            # keep the node structure: 8 devices of 2x8-a100 are 2 nodes of 4, so a (2, 4) mesh
            # still has its first axis across the slow link (the setting the preset describes)
            spec = spec.with_devices(spec.num_nodes, num_devices // spec.num_nodes)
        else:
            # a multi-node cluster's devices beyond one node span nodes, so the inter-node link must stay
            # in the model: use the fewest equal nodes that hold them (12 on 8-device nodes: 2 nodes of 6)
            nodes = -(-num_devices // spec.devices_per_node)
            while num_devices % nodes:
                nodes += 1
            spec = spec.with_devices(nodes, num_devices // nodes)
    return spec


def platform_preset(platform: str) -> ClusterSpec:
    """The preset that stands for devices of a jax platform ("cpu", "gpu", "tpu") nobody described."""
    return PRESETS["cpu-8"] if platform == "cpu" else PRESETS["1x8-h100"]


def _describe_local_devices() -> ClusterSpec:
    import jax  # local import: meshes/ is usable without initialising a backend

    devices = jax.devices()
    base = platform_preset(devices[0].platform)
    processes = max(1, jax.process_count())
    per_node = max(1, len(devices) // processes)
    spec = base.with_devices(processes, per_node)
    return spec
