"""check-config on real-world-shaped Accelerate and DeepSpeed files (tests/data/configs) and one file per contradiction.

The ``accelerate_*`` and ``deepspeed_*`` files follow the shapes ``accelerate config`` writes and the DeepSpeed
docs and HF Trainer integration show (FSDP1 with numeric and named strategies, FSDP2, ZeRO-3 with offload, a
``deepspeed_config_file`` with "auto" values, Megatron-LM, two-node DDP): every one must pass. Each ``bad_*``
file has exactly one contradiction class; its test checks the finding names the key and the exit status is 1.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from autoshard import cli
from autoshard.plans.check_config import ConfigFileError, check_config, check_deepspeed, detect_kind, read_config

DATA = Path(__file__).resolve().parents[1] / "data" / "configs"
REAL_WORLD = sorted(p for p in DATA.iterdir() if not p.name.startswith("bad_"))


@pytest.mark.parametrize("path", REAL_WORLD, ids=lambda p: p.name)
def test_real_world_files_pass(path, capsys):
    reports = check_config(path)
    assert reports[0].kind == ("deepspeed" if path.name.startswith("deepspeed") else "accelerate")
    assert [str(f) for r in reports for f in r.errors] == []
    assert cli.main(["check-config", str(path)]) == 0
    assert "ok" in capsys.readouterr().out


def test_an_accelerate_file_is_checked_with_the_deepspeed_file_it_names():
    reports = check_config(DATA / "accelerate_deepspeed_with_file.yaml")
    assert [r.kind for r in reports] == ["accelerate", "deepspeed"]
    assert reports[1].path.endswith("deepspeed_zero2_hf_auto.json")


def _errors(path: Path, **kwargs) -> list[str]:
    return [f"{f.key}: {f.message}" for r in check_config(path, **kwargs) for f in r.errors]


def _cli_lines(capsys, *args: str) -> tuple[int, list[str]]:
    code = cli.main(["check-config", *args])
    return code, [line for line in capsys.readouterr().out.splitlines() if " error " in f" {line} "]


def test_unknown_key_with_did_you_mean(capsys):
    path = DATA / "bad_unknown_key.yaml"
    assert _errors(path) == ["fsdp_config.fsdp_sharding_stratgy: unknown key; did you mean 'fsdp_sharding_strategy'? "
                             "(accelerate drops keys it does not know here)"]
    code, lines = _cli_lines(capsys, str(path))
    assert code == 1 and len(lines) == 1 and "fsdp_config.fsdp_sharding_stratgy" in lines[0]


def test_unknown_top_level_key_is_an_error_where_accelerate_refuses_it(tmp_path):
    text = (DATA / "accelerate_fsdp2.yaml").read_text().replace("num_processes: 8", "num_proceses: 8")
    (tmp_path / "typo.yaml").write_text(text)
    assert any(e.startswith("num_proceses: unknown key; did you mean 'num_processes'") for e in
               _errors(tmp_path / "typo.yaml"))


def test_deepspeed_refuses_unknown_zero_keys_but_ignores_unknown_top_level_ones():
    found = check_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "flavour": 1},
                             "my_own_setting": True})
    severities = {f.key: f.severity.value for f in found}
    assert severities == {"zero_optimization.flavour": "error", "my_own_setting": "warning"}


def test_batch_arithmetic(capsys):
    path = DATA / "bad_batch_arithmetic.json"
    assert _errors(path) == ["train_batch_size: 64 is not a multiple of train_micro_batch_size_per_gpu 3 x "
                             "gradient_accumulation_steps 2 = 6: no world size makes the batch arithmetic hold"]
    assert _cli_lines(capsys, str(path))[0] == 1
    real = DATA / "deepspeed_zero3_offload.json"  # 256 = 8 x 4 x 8
    assert _errors(real, world_size=8) == []
    assert _errors(real, world_size=16) == ["train_batch_size: 256 != train_micro_batch_size_per_gpu 8 x "
                                            "gradient_accumulation_steps 4 x 16 data-parallel ranks = 512"]
    code, lines = _cli_lines(capsys, str(real), "--world-size", "16")
    assert code == 1 and "train_batch_size" in lines[0]


def test_batch_arithmetic_counts_data_parallel_ranks_under_tensor_parallelism():
    data = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "tensor_parallel": {"autotp_size": 4}}
    assert [f.key for f in check_deepspeed(data, world_size=16)] == []  # 32 = 4 x 2 x (16 / 4)
    assert [f.key for f in check_deepspeed(data, world_size=32)] == ["train_batch_size"]


def test_zero_stage_against_offload(capsys):
    path = DATA / "bad_zero_offload.yaml"
    assert _errors(path) == ["deepspeed_config.offload_param_device: parameter offload (cpu) needs ZeRO stage 3, the "
                             "file sets deepspeed_config.zero_stage 2: set the stage to 3 or the device to none"]
    assert _cli_lines(capsys, str(path))[0] == 1
    json_form = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0, "offload_optimizer":
                                                                            {"device": "cpu"}}}
    assert [f.key for f in check_deepspeed(json_form)] == ["zero_optimization.offload_optimizer.device"]


def test_zero_stage_against_fsdp_keys_in_one_file(capsys):
    path = DATA / "bad_zero_with_fsdp.yaml"
    errors = _errors(path)
    assert len(errors) == 1 and errors[0].startswith("fsdp_config.fsdp_sharding_strategy: fsdp_config")
    assert "distributed_type is DEEPSPEED" in errors[0]
    assert _cli_lines(capsys, str(path))[0] == 1
    in_json = check_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                               "fsdp_sharding_strategy": "FULL_SHARD"})
    assert [f.key for f in in_json if f.severity.value == "error"] == ["fsdp_sharding_strategy"]


def test_deepspeed_config_file_beside_the_keys_accelerate_then_refuses(capsys):
    path = DATA / "bad_deepspeed_file_with_inline.yaml"
    keys = [e.split(":")[0] for e in _errors(path)]
    assert keys == ["deepspeed_config.gradient_accumulation_steps", "deepspeed_config.zero_stage", "mixed_precision"]
    assert _cli_lines(capsys, str(path))[0] == 1


def test_num_processes_against_machines_and_devices(capsys, tmp_path):
    path = DATA / "bad_num_processes.yaml"
    assert _errors(path) == ["num_processes: 16 processes do not split over num_machines 3: every machine runs the "
                             "same number"]
    assert _cli_lines(capsys, str(path))[0] == 1
    fsdp2 = DATA / "accelerate_fsdp2.yaml"  # 8 processes on 1 machine
    assert _errors(fsdp2, devices_per_node=8) == []
    assert _errors(fsdp2, devices_per_node=4) == ["num_processes: 8 != num_machines 1 x 4 devices per node = 4"]
    megatron = (DATA / "accelerate_megatron.yaml").read_text().replace("num_processes: 8", "num_processes: 6")
    (tmp_path / "megatron_six.yaml").write_text(megatron)
    assert any(e.startswith("megatron_lm_config.megatron_lm_tp_degree: megatron_lm_tp_degree 2 x "
                            "megatron_lm_pp_degree 2 = 4 does not divide num_processes 6")
               for e in _errors(tmp_path / "megatron_six.yaml"))


def test_mixed_precision_contradictions(capsys):
    path = DATA / "bad_mixed_precision.json"
    errors = _errors(path)
    assert len(errors) == 1 and errors[0].startswith("bf16.enabled: fp16.enabled and bf16.enabled are both true")
    assert _cli_lines(capsys, str(path))[0] == 1
    assert [f.key for f in check_deepspeed({"train_micro_batch_size_per_gpu": 1, "amp": {"enabled": True},
                                            "fp16": {"enabled": True}})] == ["amp.enabled"]


def test_hybrid_shard_on_one_node(capsys):
    path = DATA / "bad_hybrid_one_node.yaml"
    errors = _errors(path)
    assert len(errors) == 1 and errors[0].startswith("fsdp_config.fsdp_sharding_strategy: HYBRID_SHARD on one machine")
    assert _cli_lines(capsys, str(path))[0] == 1
    assert _errors(DATA / "accelerate_fsdp1_two_nodes.yaml") == []  # the same strategy on two machines is fine


def test_unreadable_or_foreign_files_fail_clearly(tmp_path, capsys):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "other.json").write_text('{"name": "not a training config"}')
    with pytest.raises(ConfigFileError, match="not a mapping"):
        read_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigFileError, match="neither an Accelerate config"):
        detect_kind(read_config(tmp_path / "other.json"), "other.json")
    assert cli.main(["check-config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_fsdp1_keys_in_an_fsdp2_file_are_warned_about(tmp_path):
    text = (DATA / "accelerate_fsdp2.yaml").read_text().replace(
        "  fsdp_version: 2", "  fsdp_version: 2\n  fsdp_sharding_strategy: FULL_SHARD")
    (tmp_path / "mixed.yaml").write_text(text)
    [report] = check_config(tmp_path / "mixed.yaml")
    assert report.errors == ()
    assert [(f.severity.value, f.key) for f in report.findings] == [("warning", "fsdp_config.fsdp_sharding_strategy")]
    assert "use fsdp_reshard_after_forward" in report.findings[0].message
