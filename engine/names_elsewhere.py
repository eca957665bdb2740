"""What Megatron-LM, torchtitan and torchrun call loom's settings.

Users come to loom with the flags of the engine they trained with before (`--tensor-model-parallel-size 2`,
`--parallelism.tensor_parallel_degree 2`, a torchtitan TOML's `[training] steps`). loom does not take those
spellings (two names for a setting is two places for a fact, and several mean something slightly different), but
it answers them with its own name and what differs, where argparse or the config reader would only say
"unrecognized". The tables are data: docs/config.md prints them (tools/config_reference.py), tests check every
loom name in them is a real setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loom.engine.config import LoomConfig

MEGATRON = "Megatron-LM"
TORCHTITAN = "torchtitan"
TORCHRUN = "torchrun"
PREPROCESS_DATA = "Megatron-LM's preprocess_data.py"


@dataclass(frozen=True)
class NameElsewhere:
    engine: str
    """Whose name it is: MEGATRON, TORCHTITAN, TORCHRUN or PREPROCESS_DATA."""
    name: str
    """The name as its users write it: a flag (`--tensor-model-parallel-size`) or a dotted config key
    (`parallelism.tensor_parallel_degree`, which torchtitan takes as a flag or a TOML [section] key)."""
    loom: str
    """loom's setting, as its flag, with the value where one value of it is meant (`--train.precision bf16`); ""
    where loom has no such setting (the note says what loom does instead)."""
    note: str = ""
    """What differs: units, meaning, defaults; or, without a loom setting, what loom does instead."""


def _entries(engine: str, rows: list[tuple[str, ...]]) -> tuple[NameElsewhere, ...]:
    return tuple(NameElsewhere(engine, *row) for row in rows)


TRAINING_NAMES: tuple[NameElsewhere, ...] = (
    *_entries(
        MEGATRON,
        [
            ("--tensor-model-parallel-size", "--parallel.tp"),
            ("--pipeline-model-parallel-size", "--parallel.pp"),
            ("--virtual-pipeline-model-parallel-size", "--parallel.vp", "model chunks per pipeline rank"),
            (
                "--num-layers-per-virtual-pipeline-stage",
                "--parallel.vp",
                "loom counts chunks per pipeline rank: num_layers / pp / this",
            ),
            ("--context-parallel-size", "--parallel.cp"),
            ("--sequence-parallel", "--parallel.sequence_parallel true"),
            ("--use-distributed-optimizer", "--optim.zero 1", "ZeRO-1; 2 and 3 shard gradients and weights too"),
            ("--overlap-grad-reduce", "--parallel.overlap_grad_reduce true", "loom's default"),
            ("--ddp-bucket-size", "--parallel.grad_bucket_mb", "in megabytes, not parameters"),
            ("--distributed-timeout-minutes", "--parallel.timeout_minutes"),
            ("--distributed-backend", "--parallel.backend", "auto picks NCCL on GPUs, gloo on CPU"),
            ("--micro-batch-size", "--train.micro_batch_size"),
            ("--global-batch-size", "--train.global_batch_size"),
            ("--rampup-batch-size", "--train.rampup_batch_size", "the same three numbers: start increment samples"),
            ("--train-iters", "--train.steps"),
            ("--train-samples", "--train.steps", "loom counts steps: samples / global batch size"),
            ("--seq-length", "--train.seq_length"),
            ("--seed", "--train.seed"),
            ("--num-layers", "--model.num_layers"),
            ("--hidden-size", "--model.hidden_size"),
            ("--ffn-hidden-size", "--model.ffn_hidden_size"),
            ("--num-attention-heads", "--model.num_heads"),
            ("--num-query-groups", "--model.num_kv_heads"),
            ("--group-query-attention", "--model.num_kv_heads", "set to the number of key/value heads"),
            ("--max-position-embeddings", "--model.max_position_embeddings"),
            ("--position-embedding-type", "--model.position_embedding", "rope, or learned for learned_absolute"),
            ("--rotary-base", "--model.rope_theta"),
            ("--use-rope-scaling", "--model.rope_scaling llama3"),
            ("--rope-scaling-factor", "--model.rope_scaling_factor"),
            ("--normalization", "--model.norm", "rmsnorm or layernorm"),
            ("--norm-epsilon", "--model.norm_eps"),
            ("--swiglu", "--model.activation swiglu", "loom's default"),
            ("--disable-bias-linear", "--model.bias false", "loom's default"),
            ("--untie-embeddings-and-output-weights", "--model.tie_embeddings false", "loom's default"),
            ("--init-method-std", "--model.init_std"),
            ("--hidden-dropout", "--model.dropout", "one rate for the residual branches and attention"),
            ("--attention-dropout", "--model.dropout", "one rate for the residual branches and attention"),
            ("--vocab-size", "--model.vocab_size"),
            ("--make-vocab-size-divisible-by", "--model.make_vocab_divisible_by", "times parallel.tp, as Megatron"),
            ("--recompute-granularity", "--model.recompute", "full or selective"),
            ("--recompute-activations", "--model.recompute selective"),
            ("--recompute-method", "--model.recompute full", "every block is recomputed; no uniform/block choice"),
            ("--recompute-num-layers", "--model.recompute full", "every block is recomputed; no uniform/block choice"),
            ("--transformer-impl", "--model.kernels", "te for transformer_engine, native for local, or auto"),
            ("--attention-backend", "--model.attention_backend", "auto, flash, cudnn for fused, or efficient"),
            ("--optimizer", "--optim.name", "adamw for adam, which decays weights decoupled; sgd, lamb, adafactor"),
            ("--lr", "--optim.lr"),
            ("--min-lr", "--optim.min_lr"),
            ("--lr-decay-style", "--optim.decay", "cosine, linear or constant"),
            ("--lr-decay-iters", "--optim.decay_steps"),
            ("--lr-decay-samples", "--optim.decay_steps", "in steps, not samples"),
            ("--lr-warmup-iters", "--optim.warmup_steps", "loom's first warmup step already learns, at lr / warmup"),
            ("--lr-warmup-samples", "--optim.warmup_steps", "in steps, not samples"),
            ("--lr-warmup-fraction", "--optim.warmup_steps", "a number of steps, not a fraction"),
            ("--weight-decay", "--optim.weight_decay"),
            ("--adam-beta1", "--optim.beta1"),
            ("--adam-beta2", "--optim.beta2"),
            ("--adam-eps", "--optim.eps"),
            ("--sgd-momentum", "--optim.momentum"),
            ("--clip-grad", "--optim.clip_grad"),
            ("--bf16", "--train.precision bf16", "loom's default"),
            ("--fp16", "--train.precision fp16"),
            ("--fp8-format", "--train.fp8 current", "E4M3 forward, E5M2 gradients: hybrid"),
            ("--fp8-recipe", "--train.fp8", "delayed, or current for tensorwise"),
            ("--initial-loss-scale", "--optim.initial_loss_scale"),
            ("--loss-scale-window", "--optim.loss_scale_window"),
            ("--hysteresis", "--optim.loss_scale_hysteresis"),
            ("--min-loss-scale", "--optim.min_loss_scale"),
            ("--accumulate-allreduce-grads-in-fp32", "--optim.grad_dtype fp32", "loom's default"),
            ("--no-gradient-accumulation-fusion", "--optim.grad_accumulation_fusion false"),
            ("--save", "--train.run_dir", "checkpoints go in its checkpoints/, beside the run's logs and metrics"),
            ("--load", "--checkpoint.load", "a run resumes from its own checkpoints without it"),
            ("--save-interval", "--checkpoint.interval"),
            ("--finetune", "--checkpoint.finetune true", "with --checkpoint.load"),
            ("--async-save", "--checkpoint.async_save true"),
            ("--exit-interval", "--train.exit_after", "steps this job trains, not a step number"),
            ("--log-interval", "--train.log_interval"),
            ("--eval-interval", "--train.eval_interval"),
            ("--eval-iters", "--train.eval_iters"),
            ("--tensorboard-dir", "--train.tensorboard true", "events go in the run directory"),
            ("--wandb-project", "--train.wandb_project"),
            ("--wandb-exp-name", "--train.wandb_run_name"),
            ("--wandb-entity", "--train.wandb_entity"),
            (
                "--data-path",
                "--data.paths",
                "the prefixes of Megatron's weight-prefix pairs; their weights go to --data.weights",
            ),
            ("--split", "--data.split"),
            ("--tokenizer-model", "--data.tokenizer"),
            ("--tokenizer-type", "--data.tokenizer", "the kind is read from the file: a .model or a tokenizer.json"),
            ("--data-cache-path", "--data.cache_dir"),
        ],
    ),
    *_entries(
        TORCHTITAN,
        [
            ("job.config_file", "--config"),
            ("job.description", "--train.name", "the run's name, which names its directory under runs/"),
            ("job.dump_folder", "--train.run_dir", "a run's checkpoints, logs and metrics all go there"),
            ("model.name", "--config", "a preset of configs/, or a TOML file with the model's [model] fields"),
            ("model.flavor", "--config", "a preset of configs/, or a TOML file with the model's [model] fields"),
            ("model.tokenizer_path", "--data.tokenizer"),
            ("model.hf_assets_path", "--data.tokenizer", "the tokenizer.json in it"),
            ("model.converters", "--train.fp8 current", "float8: loom's FP8 training"),
            ("optimizer.name", "--optim.name", "adamw, sgd, lamb or adafactor"),
            ("optimizer.lr", "--optim.lr"),
            ("optimizer.eps", "--optim.eps"),
            ("optimizer.weight_decay", "--optim.weight_decay"),
            ("optimizer.beta1", "--optim.beta1"),
            ("optimizer.beta2", "--optim.beta2"),
            ("optimizer.implementation", "", "loom runs fused AdamW where the device has it"),
            ("lr_scheduler.warmup_steps", "--optim.warmup_steps"),
            ("lr_scheduler.decay_type", "--optim.decay", "cosine or linear, no sqrt; constant keeps lr"),
            ("lr_scheduler.min_lr_factor", "--optim.min_lr", "a learning rate: lr x the factor"),
            ("lr_scheduler.total_steps", "--optim.decay_steps"),
            (
                "lr_scheduler.decay_ratio",
                "--optim.decay_steps",
                "loom decays right after warmup, without a stable phase",
            ),
            ("training.steps", "--train.steps"),
            ("training.local_batch_size", "--train.micro_batch_size"),
            ("training.global_batch_size", "--train.global_batch_size"),
            ("training.seq_len", "--train.seq_length"),
            ("training.max_norm", "--optim.clip_grad"),
            ("training.dataset", "--data.paths", "the .bin/.idx prefixes loom data build writes"),
            ("training.dataset_path", "--data.paths", "the .bin/.idx prefixes loom data build writes"),
            ("training.mixed_precision_param", "--train.precision", "bf16 for bfloat16, fp32 for float32"),
            ("training.dtype", "--train.precision", "bf16 for bfloat16, fp32 for float32"),
            ("training.mixed_precision_reduce", "--optim.grad_dtype", "fp32 for float32, or bf16"),
            ("training.enable_cpu_offload", "--optim.offload cpu"),
            ("training.compile", "--model.compile true", "auto, the default, compiles on CUDA"),
            ("training.seed", "--train.seed"),
            ("debug.seed", "--train.seed"),
            ("parallelism.tensor_parallel_degree", "--parallel.tp"),
            ("parallelism.pipeline_parallel_degree", "--parallel.pp"),
            ("parallelism.context_parallel_degree", "--parallel.cp"),
            (
                "parallelism.data_parallel_shard_degree",
                "--optim.zero 3",
                "shards weights, gradients and optimizer state over all data-parallel ranks, as FSDP",
            ),
            (
                "parallelism.data_parallel_replicate_degree",
                "--parallel.dp",
                "ZeRO shards over all of them: no replicate x shard mesh",
            ),
            ("parallelism.enable_sequence_parallel", "--parallel.sequence_parallel"),
            ("parallelism.disable_loss_parallel", "", "loom's loss is always vocabulary-parallel under tp"),
            ("parallelism.pipeline_parallel_schedule", "--parallel.vp", "1 runs 1F1B, 2 or more interleaved 1F1B"),
            ("parallelism.pipeline_parallel_microbatch_size", "--train.micro_batch_size"),
            ("parallelism.expert_parallel_degree", "", "loom trains dense models, no mixture of experts"),
            ("checkpoint.enable", "--checkpoint.interval", "loom always saves a run's last step"),
            ("checkpoint.enable_checkpoint", "--checkpoint.interval", "loom always saves a run's last step"),
            ("checkpoint.folder", "--train.run_dir", "checkpoints go in its checkpoints/"),
            ("checkpoint.keep_latest_k", "--checkpoint.keep"),
            ("checkpoint.initial_load_path", "--checkpoint.load"),
            ("checkpoint.initial_load_model_only", "--checkpoint.finetune", "with --checkpoint.load"),
            ("checkpoint.async_mode", "--checkpoint.async_save true"),
            ("checkpoint.load_step", "--checkpoint.load", "RUN/checkpoints/iter_000000N for step N"),
            ("checkpoint.last_save_model_only", "", "loom ckpt export-hf writes the weights alone"),
            ("checkpoint.export_dtype", "", "loom ckpt export-hf --dtype writes Hugging Face weights"),
            ("activation_checkpoint.mode", "--model.recompute", "none, selective or full"),
            ("activation_checkpoint.selective_ac_option", "--model.recompute selective", "core attention only"),
            ("compile.enable", "--model.compile true", "auto, the default, compiles on CUDA"),
            ("compile.components", "", "loom compiles each block; its loss is one fused pass"),
            ("quantize.linear", "--train.fp8 current", "tensorwise scales"),
            ("metrics.log_freq", "--train.log_interval"),
            ("metrics.save_tb_folder", "", "TensorBoard's events go in the run directory"),
            ("profiling.enable_profiling", "", "loom bench profile --config C traces a few steps"),
            ("profiling.save_traces_folder", "", "loom bench profile --config C traces a few steps"),
            ("profiling.profile_freq", "", "loom bench profile --config C traces a few steps"),
            ("metrics.enable_tensorboard", "--train.tensorboard", "on by default; events go in the run directory"),
            ("metrics.enable_wandb", "--train.wandb_project"),
            ("validation.enable", "--train.eval_interval", "steps between evaluations; 0 is off"),
            ("validation.enabled", "--train.eval_interval", "steps between evaluations; 0 is off"),
            ("validation.freq", "--train.eval_interval"),
            ("validation.dataset", "--data.split", "loom validates on a split of the training datasets"),
            ("validation.dataset_path", "--data.split", "loom validates on a split of the training datasets"),
            ("validation.steps", "--train.eval_iters"),
            ("comm.init_timeout_seconds", "--parallel.timeout_minutes", "in minutes"),
            ("comm.train_timeout_seconds", "--parallel.timeout_minutes", "in minutes"),
        ],
    ),
)
"""Names of training settings elsewhere: the commands that take config overrides (train, submit, plan, ...)."""

TRAIN_LAUNCH_NAMES: tuple[NameElsewhere, ...] = _entries(
    TORCHRUN,
    [
        ("--nproc-per-node", "--nproc", "loom train starts its own ranks, or runs as one under torchrun"),
        ("--nnodes", "", "several nodes: loom submit --nodes N, or loom train under torchrun on each"),
    ],
)
"""torchrun's options for `loom train`, which launches its ranks itself."""

SUBMIT_LAUNCH_NAMES: tuple[NameElsewhere, ...] = _entries(
    TORCHRUN, [("--nproc-per-node", "--tasks-per-node"), ("--nnodes", "--nodes")]
)
"""torchrun's options for `loom submit`, one Slurm task per rank."""

DATA_BUILD_NAMES: tuple[NameElsewhere, ...] = _entries(
    PREPROCESS_DATA,
    [
        ("--json-keys", "--text-key", "one key"),
        ("--tokenizer-model", "--tokenizer"),
        ("--tokenizer-type", "--tokenizer", "the kind is read from the file: a .model or a tokenizer.json"),
        ("--split-sentences", "", "loom keeps documents whole"),
    ],
)
"""Names of `loom data build`'s options in Megatron-LM's preprocessing script."""


def name_key(typed: str) -> str:
    """How a typed name is looked up: without dashes before it or a value after `=`, `-` as `_` (Megatron's
    flags, torchtitan's tyro flags), lower case."""
    return typed.lstrip("-").split("=", 1)[0].replace("-", "_").lower()


def entry_for(typed: str, names: tuple[NameElsewhere, ...] = TRAINING_NAMES) -> NameElsewhere | None:
    """The entry of `names` that `typed` spells, if any."""
    key = name_key(typed)
    return next((entry for entry in names if name_key(entry.name) == key), None)


def loom_equivalent(entry: NameElsewhere) -> str:
    """What loom has for it: `--parallel.tp`, `--parallel.grad_bucket_mb (in megabytes, not parameters)`, `no loom
    setting (loom trains dense models, ...)`."""
    note = f" ({entry.note})" if entry.note else ""
    return f"{entry.loom or 'no loom setting'}{note}"


def said_elsewhere(typed: str, names: tuple[NameElsewhere, ...] = TRAINING_NAMES) -> str | None:
    """One clause telling loom's name for a setting typed in another engine's spelling, or None if none of
    `names` is it."""
    entry = entry_for(typed, names)
    if entry is None:
        return None
    note = f" ({entry.note})" if entry.note else ""
    if not entry.loom:
        return f"{typed} ({entry.engine}) has no loom setting{note}"
    return f"{typed} ({entry.engine}) is {entry.loom} in loom{note}"


def loom_fields_named(typed: str) -> list[str]:
    """loom's settings whose field is named as typed, whatever the section (`--steps` is --train.steps)."""
    key = name_key(typed)
    return [
        f"--{section.name}.{spec.name}"
        for section in dataclasses.fields(LoomConfig)
        for spec in dataclasses.fields(section.default_factory)
        if spec.name == key
    ]


def told_in_loom_terms(flags: list[str], names: tuple[NameElsewhere, ...], takes_config: bool) -> list[str]:
    """A clause for each of `flags` (none of them the command's own) that is another engine's name for a loom
    setting, or, for a command that takes config overrides, a loom field written without its section."""
    told = []
    for flag in dict.fromkeys(flags):
        said = said_elsewhere(flag, names)
        if said is None and takes_config and "." not in flag:
            fields = loom_fields_named(flag)
            said = f"{flag} is {' or '.join(fields)} in loom" if fields else None
        if said is not None:
            told.append(said)
    return told
