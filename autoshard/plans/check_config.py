"""Static checks of Accelerate and DeepSpeed config files (``autoshard check-config FILE``).

The file is JSON or YAML (PyYAML reads the YAML); its kind,
Accelerate or DeepSpeed, is told from its keys. Each finding names the key
(dotted: ``zero_optimization.stage``) and says what to change. The classes:

- **unknown keys**, with a did-you-mean (``torch_schema`` says where each tool
  refuses an unknown key and where it silently drops one);
- **bad values**: a ``distributed_type``, a ZeRO stage, an offload device;
- **batch arithmetic**: ``train_batch_size`` = ``train_micro_batch_size_per_gpu``
  x ``gradient_accumulation_steps`` x data-parallel world size (DeepSpeed
  asserts it at start-up); with no world size known, a product that no world
  size can complete;
- **world size**: ``num_processes`` against ``num_machines`` (x devices per
  node, when given), parallel degrees that do not divide it;
- **ZeRO stage vs offload** (parameter offload needs stage 3, optimizer
  offload stage >= 1) and **engine blocks in one file** (``fsdp_*`` keys beside
  a ZeRO stage, a ``deepspeed_config_file`` beside the keys Accelerate then
  refuses);
- **mixed precision**: fp16 and bf16 both on, amp beside either, fp16 beside
  another ``mixed_precision``;
- **HYBRID_SHARD on one node** (it shards inside the node and replicates over
  one node: FULL_SHARD with extra process groups).

An Accelerate file's ``deepspeed_config_file`` is checked too, with the
Accelerate file's ``num_processes`` as its world size. No torch, accelerate
or deepspeed import: they stay optional.
"""
from __future__ import annotations

import difflib
import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autoshard.errors import PlanningError
from autoshard.plans import torch_schema as schema


class ConfigFileError(PlanningError):
    """A config file cannot be read or is not an Accelerate or DeepSpeed config; the message says why."""


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class ConfigFinding:
    severity: Severity
    key: str  # dotted path of the key the finding is about
    message: str

    def __str__(self) -> str:
        return f"{self.severity.value:7} {self.key}: {self.message}"


@dataclass(frozen=True)
class ConfigReport:
    path: str
    kind: str  # "accelerate" or "deepspeed"
    findings: tuple[ConfigFinding, ...]

    @property
    def errors(self) -> tuple[ConfigFinding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.ERROR)


def _error(key: str, message: str) -> ConfigFinding:
    return ConfigFinding(Severity.ERROR, key, message)


def _warning(key: str, message: str) -> ConfigFinding:
    return ConfigFinding(Severity.WARNING, key, message)


# ----------------------------------------------------------------------------- reading


def read_config(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML or JSON config file holds; ``ConfigFileError`` when there is none."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigFileError(f"cannot read {path}: {err.strerror}") from None
    try:
        data = json.loads(text)  # JSON first: YAML 1.1 reads JSON's 2e8 as a string
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigFileError(f"{path} is neither YAML nor JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} holds a {type(data).__name__}, not a mapping of config keys")
    return data


def detect_kind(data: Mapping[str, Any], source: str = "config") -> str:
    """"accelerate" or "deepspeed", from the keys; ``ConfigFileError`` when neither fits."""
    keys = set(data)
    accelerate, deepspeed = len(keys & schema.ACCELERATE_MARKERS), len(keys & schema.DEEPSPEED_MARKERS)
    if not accelerate and not deepspeed:
        raise ConfigFileError(f"{source} is neither an Accelerate config (no distributed_type, num_processes, ...) "
                              f"nor a DeepSpeed config (no train_batch_size, zero_optimization, ...)")
    return "accelerate" if accelerate >= deepspeed else "deepspeed"


def check_config(path: str | Path, *, world_size: int | None = None,
                 devices_per_node: int | None = None) -> list[ConfigReport]:
    """Check a config file (and the DeepSpeed file an Accelerate file names); one report per file."""
    path = Path(path)
    data = read_config(path)
    kind = detect_kind(data, str(path))
    if kind == "deepspeed":
        return [ConfigReport(str(path), kind, tuple(check_deepspeed(data, world_size=world_size)))]
    findings = check_accelerate(data, world_size=world_size, devices_per_node=devices_per_node)
    reports = [ConfigReport(str(path), kind, tuple(findings))]
    ds_file = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if isinstance(ds_file, str) and ds_file.lower() != "none":
        target = (path.parent / ds_file) if not Path(ds_file).is_absolute() else Path(ds_file)
        if target.exists():
            processes = data.get("num_processes")
            world = processes if isinstance(processes, int) and processes > 0 else world_size
            inner = read_config(target)
            reports.append(ConfigReport(str(target), "deepspeed", tuple(check_deepspeed(inner, world_size=world))))
        else:
            reports[0] = ConfigReport(str(path), kind, (*findings, _warning(
                "deepspeed_config.deepspeed_config_file", f"{ds_file} not found next to {path.name}: not checked")))
    return reports


# ----------------------------------------------------------------------------- shared rules


def _unknown(keys: Iterable[str], known: Iterable[str], where: str, *, strict: bool, what: str) -> list[ConfigFinding]:
    """Unknown keys: an error where the tool refuses them (``strict``) or a known key is one typo away."""
    known = sorted(known)
    found = []
    for key in keys:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        full = f"{where}.{key}" if where else key
        if close:
            found.append(_error(full, f"unknown key; did you mean {close[0]!r}? ({what})"))
        elif strict:
            found.append(_error(full, f"unknown key ({what})"))
        else:
            found.append(_warning(full, f"not a key this checker knows ({what})"))
    return found


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _on(value: Any) -> bool:
    """A YAML/JSON flag that is on (true, "true", "yes"); "auto" and absent are off."""
    return value is True or (isinstance(value, str) and value.lower() in ("true", "yes"))


def _offload_findings(stage: Any, param_device: Any, optimizer_device: Any, keys: tuple[str, str, str]
                      ) -> list[ConfigFinding]:
    """ZeRO stage against parameter and optimizer offload (``keys``: stage, param, optimizer key names)."""
    found: list[ConfigFinding] = []
    stage = _int(stage)
    if stage is None:
        return found
    if stage not in schema.ZERO_STAGES:
        return [_error(keys[0], f"{stage} is not a ZeRO stage (0, 1, 2 or 3)")]
    if isinstance(param_device, str) and param_device.lower() != "none" and stage != 3:
        found.append(_error(keys[1], f"parameter offload ({param_device}) needs ZeRO stage 3, the file sets "
                                     f"{keys[0]} {stage}: set the stage to 3 or the device to none"))
    if isinstance(optimizer_device, str) and optimizer_device.lower() != "none" and stage == 0:
        found.append(_error(keys[2], f"optimizer offload ({optimizer_device}) needs ZeRO stage 1, 2 or 3, the file "
                                     f"sets {keys[0]} 0"))
    for device, key in zip((param_device, optimizer_device), keys[1:]):
        if device is not None and (not isinstance(device, str) or device.lower() not in schema.OFFLOAD_DEVICES):
            found.append(_error(key, f"{device!r} is not an offload device ({', '.join(schema.OFFLOAD_DEVICES)})"))
    return found


# ----------------------------------------------------------------------------- DeepSpeed


def check_deepspeed(data: Mapping[str, Any], *, world_size: int | None = None) -> list[ConfigFinding]:
    """Findings for a DeepSpeed JSON config (module docstring); ``world_size``: all ranks, when known."""
    found = _unknown(data, schema.DEEPSPEED_TOP_LEVEL, "", strict=False,
                     what="DeepSpeed ignores unknown top-level keys")
    found = [f for f in found if not f.key.startswith("fsdp")]
    fsdp = sorted(k for k in data if k.startswith("fsdp"))
    if fsdp:
        found.append(_error(fsdp[0], f"FSDP settings ({', '.join(fsdp)}) in a DeepSpeed config: DeepSpeed ignores "
                                     "them and shards by zero_optimization.stage; drop them or use an FSDP config"))
    for section, known in schema.DEEPSPEED_SECTIONS.items():
        block = _get(data, section)
        if isinstance(block, Mapping):
            found += _unknown(block, known, section, strict=True,
                              what=f"DeepSpeed refuses unknown keys in {section}")
    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        zero = {}
    stage = zero.get("stage", 0)
    found += _offload_findings(stage, _get(zero, "offload_param.device"), _get(zero, "offload_optimizer.device"),
                               ("zero_optimization.stage", "zero_optimization.offload_param.device",
                                "zero_optimization.offload_optimizer.device"))
    if _int(stage) is not None and stage != 3:
        ratio = _get(zero, "offload_optimizer.ratio")
        if isinstance(ratio, (int, float)) and ratio < 1:
            found.append(_error("zero_optimization.offload_optimizer.ratio",
                                f"partial optimizer offload (ratio {ratio}) needs ZeRO stage 3, the file sets {stage}"))
        for key in sorted(set(zero) & schema.ZERO3_ONLY):
            found.append(_warning(f"zero_optimization.{key}",
                                  f"only ZeRO stage 3 reads it; the file sets stage {stage}"))
        if data.get("gradient_allreduce_op") == "sum" and stage == 3:
            found.append(_error("gradient_allreduce_op", "'sum' is not supported with ZeRO stage 3"))
    found += _deepspeed_precision(data)
    found += _deepspeed_batch(data, world_size)
    clip = data.get("gradient_clipping")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip < 0:
        found.append(_error("gradient_clipping", f"{clip} is negative; 0 turns clipping off"))
    return found


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _deepspeed_precision(data: Mapping[str, Any]) -> list[ConfigFinding]:
    fp16 = _on(_get(data, "fp16.enabled"))
    bf16 = _on(_get(data, "bf16.enabled")) or _on(_get(data, "bfloat16.enabled"))
    amp = _on(_get(data, "amp.enabled"))
    found = []
    if fp16 and bf16:
        found.append(_error("bf16.enabled", "fp16.enabled and bf16.enabled are both true: DeepSpeed refuses "
                                            "('bfloat16 and fp16 modes cannot be simultaneously enabled'); keep one"))
    if amp and (fp16 or bf16):
        found.append(_error("amp.enabled", f"amp and {'fp16' if fp16 else 'bf16'} are both enabled: pick one "
                                           "mixed-precision mechanism"))
    return found


def _deepspeed_batch(data: Mapping[str, Any], world_size: int | None) -> list[ConfigFinding]:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = {n: data.get(n) for n in names}
    found = []
    for name, value in values.items():
        if value is None or value == "auto":
            continue
        if _int(value) is None or value < 1:
            found.append(_error(name, f"{value!r} must be a positive integer (or \"auto\" under the HF Trainer)"))
    if found:
        return found
    tp = _int(_get(data, "tensor_parallel.autotp_size")) or 1
    dp_world = None
    if world_size is not None:
        if world_size % tp:
            return [_error("tensor_parallel.autotp_size", f"{tp} does not divide the world size {world_size}")]
        dp_world = world_size // tp
    train, micro, accum = (values[n] if _int(values[n]) is not None else None for n in names)
    if train is None and micro is None and all(values[n] is None for n in names[:2]):
        return [_error("train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu is set: "
                                           "DeepSpeed needs one of them")]
    world_text = f"{dp_world} data-parallel ranks" + (f" ({world_size} / autotp_size {tp})" if tp > 1 else "")
    if train is not None and micro is not None and accum is not None:
        if dp_world is not None and train != micro * accum * dp_world:
            found.append(_error("train_batch_size", f"{train} != train_micro_batch_size_per_gpu {micro} x "
                                f"gradient_accumulation_steps {accum} x {world_text} = {micro * accum * dp_world}"))
        elif dp_world is None and train % (micro * accum):
            found.append(_error("train_batch_size", f"{train} is not a multiple of train_micro_batch_size_per_gpu "
                                f"{micro} x gradient_accumulation_steps {accum} = {micro * accum}: no world size "
                                "makes the batch arithmetic hold"))
    elif train is not None and dp_world is not None:
        per_rank = micro if micro is not None else accum
        if train % dp_world or (per_rank is not None and (train // dp_world) % per_rank):
            found.append(_error("train_batch_size", f"{train} does not split into {world_text}"
                                + (f" x {per_rank}" if per_rank is not None else "")))
    return found


# ----------------------------------------------------------------------------- Accelerate


def check_accelerate(data: Mapping[str, Any], *, world_size: int | None = None,
                     devices_per_node: int | None = None) -> list[ConfigFinding]:
    """Findings for an Accelerate config (module docstring)."""
    found = _unknown(data, schema.ACCELERATE_TOP_LEVEL, "", strict=True,
                     what="`accelerate launch` refuses a file with unknown keys")
    blocks: dict[str, dict[str, Any]] = {}
    for name, known in schema.ACCELERATE_BLOCKS.items():
        block = data.get(name)
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            found.append(_error(name, f"should be a mapping of keys, got {block!r}"))
            block = {}
        prefix = schema.BLOCK_PREFIX.get(name, "")
        block = {k if k.startswith(prefix) else prefix + k: v for k, v in block.items()}
        found += _unknown(block, known, name, strict=False, what="accelerate drops keys it does not know here")
        blocks[name] = block
    dist = data.get("distributed_type")
    for key, value, allowed in (("distributed_type", dist, schema.DISTRIBUTED_TYPES),
                                ("compute_environment", data.get("compute_environment", "LOCAL_MACHINE"),
                                 schema.COMPUTE_ENVIRONMENTS),
                                ("mixed_precision", data.get("mixed_precision", "no"), schema.MIXED_PRECISION)):
        if value is not None and value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            found.append(_error(key, f"{value!r} is not one of {', '.join(allowed)}"
                                + (f"; did you mean {close[0]!r}?" if close else "")))
    if dist is None:
        found.append(_error("distributed_type", "missing: accelerate needs it (MULTI_GPU, FSDP, DEEPSPEED, ...)"))
    found += _world(data, blocks, world_size, devices_per_node)
    found += _engine_blocks(data, blocks)
    found += _fsdp(data, blocks["fsdp_config"])
    ds = blocks["deepspeed_config"]
    found += _offload_findings(ds.get("zero_stage"), ds.get("offload_param_device"), ds.get("offload_optimizer_device"),
                               ("deepspeed_config.zero_stage", "deepspeed_config.offload_param_device",
                                "deepspeed_config.offload_optimizer_device"))
    stage = _int(ds.get("zero_stage"))
    if stage is not None and stage != 3:
        for key in ("zero3_init_flag", "zero3_save_16bit_model"):
            if _on(ds.get(key)):
                found.append(_warning(f"deepspeed_config.{key}", f"only ZeRO stage 3 reads it; the file sets "
                                                                 f"zero_stage {stage}"))
    if ds.get("deepspeed_config_file") not in (None, "none"):
        inline = [k for k in schema.DEEPSPEED_FILE_EXCLUSIVE if k in ds]
        if "mixed_precision" in data:
            inline.append("mixed_precision")
        for key in inline:
            found.append(_error(key if key == "mixed_precision" else f"deepspeed_config.{key}",
                                "set beside deepspeed_config_file: accelerate refuses the pair ('When using "
                                "`deepspeed_config_file`, the following accelerate config variables will be "
                                "ignored'); set it in the DeepSpeed file only"))
    if "fp16" in data and _on(data["fp16"]) and data.get("mixed_precision", "fp16") != "fp16":
        found.append(_error("fp16", f"fp16 is on but mixed_precision is {data['mixed_precision']!r}: keep one"))
    if _on(data.get("downcast_bf16")) and data.get("mixed_precision") != "bf16":
        found.append(_warning("downcast_bf16", "only read with mixed_precision bf16 (on TPUs)"))
    return found


def _world(data: Mapping[str, Any], blocks: Mapping[str, Mapping[str, Any]], world_size: int | None,
           devices_per_node: int | None) -> list[ConfigFinding]:
    found = []
    processes, machines = data.get("num_processes"), data.get("num_machines", 1)
    if processes is not None and (_int(processes) is None or (processes < 1 and processes != -1)):
        return [_error("num_processes", f"{processes!r} must be a positive integer")]
    if _int(machines) is None or machines < 1:
        return [_error("num_machines", f"{machines!r} must be a positive integer")]
    rank = data.get("machine_rank", 0)
    if _int(rank) is not None and not 0 <= rank < machines:
        found.append(_error("machine_rank", f"{rank} is not a machine of 0..{machines - 1}"))
    if processes in (None, -1):
        return found
    if processes % machines:
        found.append(_error("num_processes", f"{processes} processes do not split over num_machines {machines}: "
                                             "every machine runs the same number"))
    elif devices_per_node is not None and processes != machines * devices_per_node:
        found.append(_error("num_processes", f"{processes} != num_machines {machines} x {devices_per_node} devices "
                                             f"per node = {machines * devices_per_node}"))
    if world_size is not None and processes != world_size:
        found.append(_error("num_processes", f"{processes}, but the world size is {world_size}"))
    if data.get("distributed_type") == "NO" and processes > 1:
        found.append(_error("distributed_type", f"NO (one process) with num_processes {processes}"))
    degrees = {"megatron_lm_config": ("megatron_lm_tp_degree", "megatron_lm_pp_degree",
                                      "megatron_lm_context_parallel_size"),
               "parallelism_config": ("parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
                                      "parallelism_config_tp_size", "parallelism_config_cp_size",
                                      "parallelism_config_sp_size")}
    for block, keys in degrees.items():
        sizes = {k: _int(blocks[block].get(k)) for k in keys if _int(blocks[block].get(k))}
        product = 1
        for size in sizes.values():
            product *= size
        if not sizes:
            continue
        exact = block == "parallelism_config"  # dp_replicate x dp_shard x tp x cp covers every process
        if (exact and product != processes) or (not exact and processes % product):
            found.append(_error(f"{block}.{next(iter(sizes))}",
                                f"{' x '.join(f'{k} {v}' for k, v in sizes.items())} = {product} "
                                f"{'is not' if exact else 'does not divide'} num_processes {processes}"))
    return found


def _engine_blocks(data: Mapping[str, Any], blocks: Mapping[str, Mapping[str, Any]]) -> list[ConfigFinding]:
    """A block for another engine than ``distributed_type`` names is ignored: the file contradicts itself."""
    owner = {"DEEPSPEED": "deepspeed_config", "FSDP": "fsdp_config", "MEGATRON_LM": "megatron_lm_config"}
    dist = data.get("distributed_type")
    found = []
    for block in ("deepspeed_config", "fsdp_config", "megatron_lm_config"):
        keys = sorted(blocks[block])
        if keys and owner.get(str(dist)) != block:
            what = ("ZeRO stage " + str(blocks[block]["zero_stage"]) if "zero_stage" in blocks[block]
                    else ", ".join(keys[:3]))
            found.append(_error(f"{block}.{keys[0]}", f"{block} ({what}) in a file whose distributed_type is {dist}: "
                                                      f"accelerate ignores it; remove the block or change the type"))
    return found


def _fsdp(data: Mapping[str, Any], fsdp: Mapping[str, Any]) -> list[ConfigFinding]:
    if not fsdp:
        return []
    found = []
    version = fsdp.get("fsdp_version", 1)
    if version not in (1, 2, "1", "2"):
        return [_error("fsdp_config.fsdp_version", f"{version!r} is not 1 or 2")]
    version = int(version)
    strategy = fsdp.get("fsdp_sharding_strategy")
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if isinstance(strategy, int) and not isinstance(strategy, bool) and 1 <= strategy <= 5:
        strategy = schema.FSDP_SHARDING_STRATEGIES[strategy - 1]  # FSDP1's numeric form
    if version == 2:
        for key in schema.FSDP1_ONLY:
            if key in fsdp:
                hint = "; use fsdp_reshard_after_forward" if key == "fsdp_sharding_strategy" else ""
                found.append(_warning(f"fsdp_config.{key}",
                                      f"an FSDP1 key that FSDP2 (fsdp_version 2) does not read{hint}"))
        if reshard is not None and not isinstance(reshard, bool):
            found.append(_error("fsdp_config.fsdp_reshard_after_forward",
                                f"FSDP2 takes true or false, got {reshard!r}"))
    else:
        named = [(k, v) for k, v in (("fsdp_sharding_strategy", strategy), ("fsdp_reshard_after_forward", reshard))
                 if isinstance(v, str)]
        for key, value in named:
            if value.upper() not in schema.FSDP_SHARDING_STRATEGIES:
                found.append(_error(f"fsdp_config.{key}", f"{value!r} is not one of "
                                                          f"{', '.join(schema.FSDP_SHARDING_STRATEGIES)}"))
    hybrid = [(k, v) for k, v in (("fsdp_sharding_strategy", strategy), ("fsdp_reshard_after_forward", reshard))
              if isinstance(v, str) and v.upper() in schema.HYBRID_STRATEGIES]
    if hybrid and data.get("num_machines", 1) == 1:
        key, value = hybrid[0]
        found.append(_error(f"fsdp_config.{key}", f"{value} on one machine (num_machines 1) shards inside the node "
                                                  "and replicates over one node: it is FULL_SHARD with extra process "
                                                  "groups; use FULL_SHARD, or set num_machines"))
    policy = fsdp.get("fsdp_auto_wrap_policy")
    if policy is not None and policy not in schema.FSDP_AUTO_WRAP_POLICIES:
        found.append(_error("fsdp_config.fsdp_auto_wrap_policy",
                            f"{policy!r} is not one of {', '.join(schema.FSDP_AUTO_WRAP_POLICIES)}"))
    return found
