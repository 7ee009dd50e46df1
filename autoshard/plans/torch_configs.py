"""A classic strategy as PyTorch users run it: ``accelerate_config.yaml``, ``deepspeed.json`` and ``fsdp2.py``.

``TorchSetup`` is the plain record ``autoshard advise`` fills
(``compiler/advise.py``): which classic strategy, on how many machines and
GPUs, with which micro-batch, accumulation, precision and clipping. The
writers turn it into the files each tool reads, with the key names of
``torch_schema`` (``check-config`` passes them):

==============  =====================  ===================================  ==================================
strategy        Accelerate             DeepSpeed                            FSDP2 snippet
==============  =====================  ===================================  ==================================
DP              MULTI_GPU              ZeRO stage 0                         DistributedDataParallel
FSDP/ZeRO-3     FSDP, FULL_SHARD       stage 3                              fully_shard, reshard after forward
ZeRO-2          DEEPSPEED, stage 2     stage 2                              fully_shard, no reshard (nearest)
HSDP            FSDP, HYBRID_SHARD     stage 3, MiCS shards inside a node   fully_shard on a 2-D mesh
Megatron TP     MEGATRON_LM, tp=all    AutoTP (tensor_parallel)             parallelize_module
DP x TP         MEGATRON_LM, tp=inner  AutoTP, data parallel over the rest  parallelize_module + fully_shard
==============  =====================  ===================================  ==================================

FSDP in Accelerate is written for ``fsdp_version`` 2 (``fsdp_reshard_after_forward``,
HSDP through ``parallelism_config``) or 1 (``fsdp_sharding_strategy``). Offload
is always off: autoshard's plans keep everything in device memory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

DP, FSDP, ZERO2, HSDP, TP, DP_TP = "dp", "fsdp", "zero2", "hsdp", "megatron-tp", "dp-tp"  # passes.classic.Baseline
ZERO_STAGE = {DP: 0, FSDP: 3, ZERO2: 2, HSDP: 3, TP: 0, DP_TP: 0}
DISTRIBUTED_TYPE = {DP: "MULTI_GPU", FSDP: "FSDP", ZERO2: "DEEPSPEED", HSDP: "FSDP", TP: "MEGATRON_LM",
                    DP_TP: "MEGATRON_LM"}


@dataclass(frozen=True)
class TorchSetup:
    strategy: str  # a passes.classic.Baseline value: dp, fsdp, zero2, hsdp, megatron-tp, dp-tp
    label: str  # its display name, e.g. "FSDP/ZeRO-3"
    num_machines: int
    processes_per_machine: int  # one process per GPU
    tensor_parallel: int  # 1 unless Megatron TP or DP x TP
    micro_batch_per_gpu: int  # per data-parallel rank and forward/backward
    gradient_accumulation: int  # micro-batches per optimizer step
    mixed_precision: str  # Accelerate's: "no", "bf16" or "fp16" (the step's parameter dtype)
    gradient_clipping: float | None  # the step's global-norm clipping, None when it does not clip
    fsdp_version: int = 2
    layer_container: str = ""  # the attribute holding the repeated blocks ("blocks"): one FSDP unit per block
    column_modules: tuple[str, ...] = ()  # block-relative module names split by output features (TP)
    row_modules: tuple[str, ...] = ()  # block-relative module names split by input features (TP)
    source: str = ""  # what was planned, for the files' headers

    @property
    def world_size(self) -> int:
        return self.num_machines * self.processes_per_machine

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch_per_gpu * self.gradient_accumulation * self.data_parallel


def _header(setup: TorchSetup, what: str) -> str:
    return (f"{what} written by autoshard advise: {setup.label} on {setup.num_machines} machine(s) x "
            f"{setup.processes_per_machine} GPUs ({setup.source})")


# ----------------------------------------------------------------------------- Accelerate


def accelerate_config(setup: TorchSetup) -> dict[str, Any]:
    """The keys ``accelerate launch --config_file`` reads for ``setup``."""
    kind = setup.strategy
    data: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": DISTRIBUTED_TYPE[kind],
        "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
        "mixed_precision": setup.mixed_precision, "num_machines": setup.num_machines,
        "num_processes": setup.world_size, "rdzv_backend": "static", "same_network": True, "use_cpu": False,
    }
    if setup.num_machines > 1:
        data["main_process_port"] = 29500
    if kind == ZERO2:
        block: dict[str, Any] = {"zero_stage": ZERO_STAGE[kind], "gradient_accumulation_steps":
                                 setup.gradient_accumulation, "offload_optimizer_device": "none",
                                 "offload_param_device": "none", "zero3_init_flag": False}
        if setup.gradient_clipping is not None:
            block["gradient_clipping"] = setup.gradient_clipping
        if setup.num_machines > 1:
            block["deepspeed_multinode_launcher"] = "standard"
        data["deepspeed_config"] = block
    elif kind in (FSDP, HSDP):
        data["fsdp_config"] = _fsdp_block(setup)
        if setup.fsdp_version == 2 and kind == HSDP:
            data["parallelism_config"] = {"parallelism_config_dp_replicate_size": setup.num_machines,
                                          "parallelism_config_dp_shard_size": setup.processes_per_machine}
    elif kind in (TP, DP_TP):
        data["megatron_lm_config"] = {
            "megatron_lm_tp_degree": setup.tensor_parallel, "megatron_lm_pp_degree": 1,
            "megatron_lm_sequence_parallelism": False, "megatron_lm_recompute_activations": False,
            "megatron_lm_use_distributed_optimizer": False,
            "megatron_lm_gradient_clipping": setup.gradient_clipping or 0.0}
    return data


def _fsdp_block(setup: TorchSetup) -> dict[str, Any]:
    block: dict[str, Any] = {"fsdp_version": setup.fsdp_version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                             "fsdp_offload_params": False, "fsdp_activation_checkpointing": False,
                             "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True}
    if setup.fsdp_version == 2:
        block["fsdp_reshard_after_forward"] = True
    else:
        block["fsdp_sharding_strategy"] = "HYBRID_SHARD" if setup.strategy == HSDP else "FULL_SHARD"
        block.update(fsdp_backward_prefetch="BACKWARD_PRE", fsdp_use_orig_params=True, fsdp_sync_module_states=True)
    return block


def accelerate_yaml(setup: TorchSetup) -> str:
    notes = [_header(setup, "Accelerate config"),
             "run: accelerate launch --config_file accelerate_config.yaml train.py (on every machine, with "
             "--machine_rank R and --main_process_ip of machine 0)" if setup.num_machines > 1 else
             "run: accelerate launch --config_file accelerate_config.yaml train.py",
             f"per GPU: micro-batch {setup.micro_batch_per_gpu}, gradient accumulation {setup.gradient_accumulation} "
             f"(Accelerator(gradient_accumulation_steps=...)): global batch {setup.train_batch_size}"]
    if setup.strategy in (FSDP, HSDP):
        notes.append("set fsdp_transformer_layer_cls_to_wrap to your block class unless the model names its "
                     "_no_split_modules")
    body = yaml.safe_dump(accelerate_config(setup), sort_keys=True, default_flow_style=False)
    return "".join(f"# {line}\n" for line in notes) + body


# ----------------------------------------------------------------------------- DeepSpeed


def deepspeed_config(setup: TorchSetup) -> dict[str, Any]:
    """A DeepSpeed config for ``setup``: the batch arithmetic holds over its data-parallel ranks."""
    stage = ZERO_STAGE[setup.strategy]
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero["offload_optimizer"] = {"device": "none"}
    if stage == 3:
        zero["offload_param"] = {"device": "none"}
        zero["overlap_comm"] = True
    if setup.strategy == HSDP:
        zero["mics_shard_size"] = setup.processes_per_machine  # shard inside a node, replicate across nodes
    data: dict[str, Any] = {
        "train_batch_size": setup.train_batch_size,
        "train_micro_batch_size_per_gpu": setup.micro_batch_per_gpu,
        "gradient_accumulation_steps": setup.gradient_accumulation,
        "zero_optimization": zero,
        "bf16": {"enabled": setup.mixed_precision == "bf16"},
        "fp16": {"enabled": setup.mixed_precision == "fp16"},
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if setup.gradient_clipping is not None:
        data["gradient_clipping"] = setup.gradient_clipping
    if setup.tensor_parallel > 1:
        data["tensor_parallel"] = {"autotp_size": setup.tensor_parallel}
    return data


def deepspeed_json(setup: TorchSetup) -> str:
    return json.dumps(deepspeed_config(setup), indent=2) + "\n"


# ----------------------------------------------------------------------------- FSDP2


def fsdp2_snippet(setup: TorchSetup) -> str:
    """A short PyTorch module: the device mesh and the sharding calls of ``setup`` (valid Python, not run here)."""
    kind, machines, per = setup.strategy, setup.num_machines, setup.processes_per_machine
    blocks = setup.layer_container or "blocks"
    lines = [f'"""{_header(setup, "PyTorch setup")}.', "",
             f"torchrun --nnodes={machines} --nproc-per-node={per} train.py, with train.py calling parallelize(model)",
             "and stepping the optimizer every GRADIENT_ACCUMULATION_STEPS micro-batches of MICRO_BATCH_PER_GPU.",
             '"""', "import torch", "from torch.distributed.device_mesh import init_device_mesh"]
    if kind in (FSDP, ZERO2, HSDP, DP_TP):
        lines.append("from torch.distributed.fsdp import fully_shard")
    if kind == DP:
        lines.append("from torch.nn.parallel import DistributedDataParallel")
    if kind in (TP, DP_TP):
        lines.append("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, "
                     "parallelize_module")
    lines += ["", f"MICRO_BATCH_PER_GPU = {setup.micro_batch_per_gpu}",
              f"GRADIENT_ACCUMULATION_STEPS = {setup.gradient_accumulation}",
              f"GLOBAL_BATCH = {setup.train_batch_size}  # MICRO_BATCH_PER_GPU x GRADIENT_ACCUMULATION_STEPS x "
              f"{setup.data_parallel} data-parallel ranks",
              f"GRADIENT_CLIPPING = {setup.gradient_clipping!r}  # clip_grad_norm_ before optimizer.step()", "", "",
              "def parallelize(model: torch.nn.Module) -> torch.nn.Module:"]
    body = _parallelize_body(setup, blocks)
    lines += [f"    {line}" if line else "" for line in body] + [""]
    return "\n".join(lines)


def _tp_plan(setup: TorchSetup) -> list[str]:
    entries = [f"{name!r}: ColwiseParallel()" for name in setup.column_modules]
    entries += [f"{name!r}: RowwiseParallel()" for name in setup.row_modules]
    return ["plan = {" + ", ".join(entries) + "}",
            "# attention modules must then use num_heads // tp_mesh.size() heads per rank"]


def _parallelize_body(setup: TorchSetup, blocks: str) -> list[str]:
    kind, machines, per, world = setup.strategy, setup.num_machines, setup.processes_per_machine, setup.world_size
    if kind == DP:
        return [f'mesh = init_device_mesh("cuda", ({world},), mesh_dim_names=("dp",))',
                "return DistributedDataParallel(model, device_mesh=mesh)"]
    if kind in (FSDP, ZERO2, HSDP):
        if kind == HSDP:
            mesh = (f'mesh = init_device_mesh("cuda", ({machines}, {per}), mesh_dim_names=("dp_replicate", '
                    '"dp_shard"))  # replicate across nodes, shard inside one')
        else:
            mesh = f'mesh = init_device_mesh("cuda", ({world},), mesh_dim_names=("dp_shard",))'
        reshard = "False" if kind == ZERO2 else "True"
        note = (["# ZeRO-2 keeps parameters whole; FSDP2's nearest is reshard_after_forward=False (SHARD_GRAD_OP):",
                 "# parameters stay gathered from forward to backward. deepspeed.json has ZeRO-2 itself."]
                if kind == ZERO2 else [])
        return [mesh, *note, f"for block in model.{blocks}:  # one unit per block: its all-gather overlaps the "
                             "previous block's compute",
                f"    fully_shard(block, mesh=mesh, reshard_after_forward={reshard})",
                f"fully_shard(model, mesh=mesh, reshard_after_forward={reshard})", "return model"]
    if kind == TP:
        return [f'tp_mesh = init_device_mesh("cuda", ({world},), mesh_dim_names=("tp",))', *_tp_plan(setup),
                f"for block in model.{blocks}:", "    parallelize_module(block, tp_mesh, plan)", "return model"]
    dp, tp = setup.data_parallel, setup.tensor_parallel
    return [f'mesh = init_device_mesh("cuda", ({dp}, {tp}), mesh_dim_names=("dp", "tp"))  # tp inside a node',
            *_tp_plan(setup), f"for block in model.{blocks}:", '    parallelize_module(block, mesh["tp"], plan)',
            "# data parallel over dp: FSDP2 composes with TP by sharding the state over dp as well",
            "# (autoshard's DP x TP keeps it replicated there; this needs less memory, more all-gathers)",
            'fully_shard(model, mesh=mesh["dp"])', "return model"]
