"""ClusterSpec: presets validate and round-trip through JSON and TOML; bad files say what to change."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoshard.meshes.cluster import ALIASES, PRESETS, ClusterSpec, ClusterSpecError, get_cluster
from autoshard.meshes.logical import make_logical_mesh


def to_toml(data: dict[str, Any]) -> str:
    """A tiny TOML writer for a ClusterSpec dict (tomllib only reads): scalars first, then one table per dict."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(v)  # a TOML basic string for plain text

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{json.dumps(str(kk))} = {value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_and_round_trips(name, tmp_path: Path):
    spec = PRESETS[name]
    assert spec.name == name and spec.num_devices == spec.num_nodes * spec.devices_per_node
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    spec.save(tmp_path / "c.json")
    assert ClusterSpec.load(tmp_path / "c.json") == spec
    assert get_cluster(tmp_path / "c.json") == spec
    (tmp_path / "c.toml").write_text(to_toml(spec.to_dict()))
    assert ClusterSpec.load(tmp_path / "c.toml") == spec
    assert get_cluster(str(tmp_path / "c.toml")) == spec
    assert hash(ClusterSpec.load(tmp_path / "c.toml")) == hash(spec)  # hashable: it keys the cost caches


def test_handwritten_toml(tmp_path: Path):
    (tmp_path / "lab.toml").write_text('''
name = "lab-2x4"
num_nodes = 2
devices_per_node = 4
memory_bandwidth_bytes_per_s = 1.5e12
memory_per_device_bytes = 25769803776

[intra_node]
name = "nvlink"
bandwidth_bytes_per_s = 150e9
latency_s = 5e-6

[inter_node]
name = "ethernet"
bandwidth_bytes_per_s = 12.5e9
latency_s = 2e-5

[peak_flops_per_s]
bfloat16 = 125e12
float32 = 60e12
''')
    spec = get_cluster(tmp_path / "lab.toml")
    assert (spec.name, spec.num_devices, spec.inter_node.bandwidth_bytes_per_s) == ("lab-2x4", 8, 12.5e9)
    assert spec.devices_per_process == 0 and spec.process_size == 4
    mesh = make_logical_mesh(spec, (2, 4))
    assert mesh.axis("x").link.name == "ethernet" and mesh.axis("y").link.name == "nvlink"


def test_presets_by_alias_and_resized():
    assert get_cluster("a100") is PRESETS["1x8-a100"]
    assert all(get_cluster(alias) is PRESETS[target] for alias, target in ALIASES.items())
    assert get_cluster("cpu-8", num_devices=8) is PRESETS["cpu-8"]
    six = get_cluster("cpu-8", num_devices=6)
    assert (six.num_nodes, six.devices_per_node, six.intra_node) == (1, 6, PRESETS["cpu-8"].intra_node)
    # a slice of a multi-node preset keeps its node count when that divides the devices, so the slow
    # inter-node link stays in the model (8 devices of 2x8-a100: 2 nodes of 4) ...
    assert (get_cluster("4x8-h100", num_devices=16).num_nodes, get_cluster("4x8-h100", num_devices=16).devices_per_node) == (4, 4)
    assert (get_cluster("2x8-a100", num_devices=8).num_nodes, get_cluster("2x8-a100", num_devices=8).devices_per_node) == (2, 4)
    assert make_logical_mesh(get_cluster("2x8-a100", num_devices=8), (2, 4)).axis("x").link.name == "ethernet"
    # ... else the fewest equal nodes that hold them
    assert get_cluster("4x8-h100", num_devices=6).num_nodes == 1
    assert get_cluster("2x8-a100", num_devices=12).devices_per_node == 6
    assert get_cluster(PRESETS["tpu-v4-32"]) is PRESETS["tpu-v4-32"]


def _write(tmp_path: Path, data: dict[str, Any], suffix: str = ".json") -> Path:
    path = tmp_path / f"cluster{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else to_toml(data))
    return path


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_missing_field_is_named(tmp_path, suffix):
    data = PRESETS["cpu-8"].to_dict()
    del data["memory_bandwidth_bytes_per_s"]
    with pytest.raises(ClusterSpecError, match=r"missing field\(s\) \['memory_bandwidth_bytes_per_s'\]; add"):
        ClusterSpec.load(_write(tmp_path, data, suffix))
    data = PRESETS["cpu-8"].to_dict()
    del data["inter_node"]["latency_s"]
    with pytest.raises(ClusterSpecError, match=r"inter_node: missing field\(s\) \['latency_s'\]"):
        ClusterSpec.load(_write(tmp_path, data, suffix))


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_negative_bandwidth_is_named(tmp_path, suffix):
    data = PRESETS["2x8-a100"].to_dict()
    data["inter_node"]["bandwidth_bytes_per_s"] = -25e9
    message = r"cluster\.(json|toml).*inter_node\.bandwidth_bytes_per_s must be positive"
    with pytest.raises(ClusterSpecError, match=message):
        ClusterSpec.load(_write(tmp_path, data, suffix))


def test_unknown_field_lists_the_known_ones(tmp_path):
    data = PRESETS["cpu-8"].to_dict() | {"num_gpus": 8}
    with pytest.raises(ClusterSpecError, match=r"unknown field\(s\) \['num_gpus'\]; known fields: .*devices_per_node"):
        ClusterSpec.load(_write(tmp_path, data))
    data = PRESETS["cpu-8"].to_dict()
    data["intra_node"]["bw"] = 1
    with pytest.raises(ClusterSpecError, match=r"intra_node: unknown field\(s\) \['bw'\]"):
        ClusterSpec.from_dict(data)


@pytest.mark.parametrize("field,value,message", [
    ("num_nodes", 0, "num_nodes must be a positive integer"),
    ("num_nodes", 1.5, "num_nodes must be a positive integer"),
    ("devices_per_node", True, "devices_per_node must be a positive integer"),
    ("memory_per_device_bytes", "80GB", "memory_per_device_bytes must be a number"),
    ("peak_flops_per_s", {}, "peak_flops_per_s must name at least one dtype"),
    ("peak_flops_per_s", {"float32": "fast"}, r"peak_flops_per_s\[float32\] must be a number"),
    ("peak_flops_per_s", 1e12, "peak_flops_per_s must be a table"),
    ("intra_node", "nvlink", "intra_node: expected a table"),
    ("devices_per_process", -1, "devices_per_process must be non-negative"),
])
def test_bad_values_are_named(field, value, message):
    data = PRESETS["cpu-8"].to_dict() | {field: value}
    with pytest.raises(ClusterSpecError, match=message):
        ClusterSpec.from_dict(data)


def test_non_numeric_link_value():
    data = PRESETS["cpu-8"].to_dict()
    data["intra_node"]["latency_s"] = "10us"
    with pytest.raises(ClusterSpecError, match=r"intra_node\.latency_s must be a number, got '10us'"):
        ClusterSpec.from_dict(data)


def test_the_unmeasured_mark_is_optional_and_a_boolean():
    data = PRESETS["cpu-8"].to_dict()
    assert data["intra_node"]["unmeasured"] is False
    del data["intra_node"]["unmeasured"]  # a file written before the mark existed
    assert ClusterSpec.from_dict(data) == PRESETS["cpu-8"]
    data["intra_node"]["unmeasured"] = "yes"
    with pytest.raises(ClusterSpecError, match=r"intra_node\.unmeasured must be true or false, got 'yes'"):
        ClusterSpec.from_dict(data)


@pytest.mark.parametrize("suffix,text", [(".json", '{"name": "x",'), (".toml", "name = \n"),
                                         (".json", "[1, 2]")])
def test_broken_file(tmp_path, suffix, text):
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    with pytest.raises(ClusterSpecError, match="does not parse|expected a table of fields"):
        get_cluster(path)


def test_binary_file_does_not_parse(tmp_path):
    path = tmp_path / "c.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ClusterSpecError, match="does not parse"):
        ClusterSpec.load(path)


def test_unknown_preset_or_file():
    with pytest.raises(ClusterSpecError, match=r"unknown cluster '2x8-a10': did you mean '2x8-a100'\? use a preset"):
        get_cluster("2x8-a10")
    with pytest.raises(ClusterSpecError, match="use a preset .*cpu-8.* or a .json/.toml file"):
        get_cluster("my-supercomputer")
    with pytest.raises(ClusterSpecError, match="does not exist; pass a preset name"):
        get_cluster("no/such/cluster.toml")
    assert issubclass(ClusterSpecError, ValueError)


def test_bad_device_count():
    with pytest.raises(ClusterSpecError, match="num_devices must be positive"):
        get_cluster("cpu-8", num_devices=0)
