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
    value_carries: bool = True
    """The value written for the other engine means the same to loom's setting (`--parallel.tp 2` for
    `--tensor-model-parallel-size 2`), so the answer can give it; false where it is converted (units, choices)."""


def _entries(engine: str, rows: list[tuple]) -> tuple[NameElsewhere, ...]:
    return tuple(NameElsewhere(engine, *row) for row in rows)


CONVERTED = False
"""A row's fourth field: the other engine's value is not loom's (see NameElsewhere.value_carries)."""

_EVERY_BLOCK = "every block is recomputed; no uniform/block choice"
_NOT_READ = (
    "loom reads its own checkpoints; Megatron-LM's through loom ckpt import-megatron, Hugging Face ones through "
    "loom ckpt import-hf"
)
_BATCH = "its global batch defaults to this x dp, no accumulation; loom's to 256: set --train.global_batch_size"
_PROFILE = "loom bench profile --config C traces a few steps"
_VALIDATION_SPLIT = "loom validates on a split of the training datasets"
_CHECKPOINT_ENABLE = (
    "loom saves every checkpoint.interval steps, its own key, and a run's last step unless --checkpoint.save_at_end "
    "false: enable = false is interval 0 and save_at_end false"
)
GPT2_FILES = (
    'a Hugging Face tokenizer.json holds vocabulary and merges: python -c "from transformers import '
    "GPT2TokenizerFast as T; T('vocab.json', 'merges.txt').save_pretrained('gpt2')\" writes gpt2/tokenizer.json"
)

TRAINING_NAMES: tuple[NameElsewhere, ...] = (
    *_entries(
        MEGATRON,
        [
            ("--tensor-model-parallel-size", "--parallel.tp"),
            ("--pipeline-model-parallel-size", "--parallel.pp"),
            ("--num-virtual-stages-per-pipeline-rank", "--parallel.vp", "model chunks per pipeline rank"),
            ("--virtual-pipeline-model-parallel-size", "--parallel.vp", "model chunks per pipeline rank; NeMo's name"),
            (
                "--num-layers-per-virtual-pipeline-stage",
                "--parallel.vp",
                "loom counts chunks per pipeline rank: num_layers / pp / this",
                CONVERTED,
            ),
            ("--context-parallel-size", "--parallel.cp"),
            ("--sequence-parallel", "--parallel.sequence_parallel true"),
            ("--use-distributed-optimizer", "--optim.zero 1", "ZeRO-1; 2 and 3 shard gradients and weights too"),
            ("--overlap-grad-reduce", "--parallel.overlap_grad_reduce true", "loom's default"),
            ("--overlap-param-gather", "", "ZeRO-3 prefetches the next block's weights by itself"),
            (
                "--ddp-bucket-size",
                "--parallel.grad_bucket_mb",
                "MiB of fp32 gradients, not parameters: parameters x 4 / 2^20",
                CONVERTED,
            ),
            ("--distributed-timeout-minutes", "--parallel.timeout_minutes"),
            ("--distributed-backend", "--parallel.backend", "auto picks NCCL on GPUs, gloo on CPU"),
            ("--micro-batch-size", "--train.micro_batch_size", _BATCH),
            ("--global-batch-size", "--train.global_batch_size"),
            ("--rampup-batch-size", "--train.rampup_batch_size"),
            (
                "--step-batch-size-schedule",
                "--train.rampup_batch_size",
                "loom ramps as Megatron's older --rampup-batch-size: start increment samples",
                CONVERTED,
            ),
            ("--train-iters", "--train.steps"),
            (
                "--train-samples",
                "--train.steps",
                "loom counts steps: samples / global batch size, fewer under a batch ramp-up",
                CONVERTED,
            ),
            ("--seq-length", "--train.seq_length"),
            ("--seed", "--train.seed"),
            ("--num-layers", "--model.num_layers"),
            ("--hidden-size", "--model.hidden_size"),
            ("--ffn-hidden-size", "--model.ffn_hidden_size"),
            ("--num-attention-heads", "--model.num_heads"),
            ("--num-query-groups", "--model.num_kv_heads", "Megatron reads it only with --group-query-attention"),
            ("--group-query-attention", "--model.num_kv_heads", "set to the number of key/value heads"),
            ("--kv-channels", "--model.head_dim"),
            ("--max-position-embeddings", "--model.max_position_embeddings"),
            (
                "--position-embedding-type",
                "--model.position_embedding",
                "rope, or learned for learned_absolute, Megatron's default; loom's is rope",
                CONVERTED,
            ),
            ("--rotary-base", "--model.rope_theta"),
            ("--rotary-percent", "--model.rotary_percent"),
            ("--use-rope-scaling", "--model.rope_scaling llama3"),
            ("--rope-scaling-factor", "--model.rope_scaling_factor"),
            (
                "--rotary-seq-len-interpolation-factor",
                "--model.rope_scaling linear",
                "with --model.rope_scaling_factor F: positions divided by F, as every frequency is",
            ),
            (
                "--normalization",
                "--model.norm",
                "rmsnorm or layernorm; Megatron's default is LayerNorm, loom's rmsnorm",
                CONVERTED,
            ),
            ("--norm-epsilon", "--model.norm_eps"),
            (
                "--apply-layernorm-1p",
                "",
                "loom's norms scale by their weight, not 1 + weight; import-megatron adds the 1 to the weights",
            ),
            ("--qk-layernorm", "--model.qk_norm true"),
            ("--softmax-scale", "--model.attention_scale"),
            (
                "--swiglu",
                "--model.activation swiglu",
                "Megatron's default is gelu, loom's swiglu; without --ffn-hidden-size Megatron takes 8h/3 rounded "
                "down to 64, loom up to 256: give --model.ffn_hidden_size",
            ),
            ("--squared-relu", "--model.activation squared_relu"),
            ("--num-experts", "--model.num_experts"),
            ("--moe-router-topk", "--model.moe_top_k"),
            ("--moe-aux-loss-coeff", "--model.moe_aux_loss_coeff", "loom's loss is per sequence, as seq_aux_loss"),
            ("--moe-z-loss-coeff", "--model.moe_z_loss_coeff"),
            ("--moe-router-score-function", "--model.moe_router_score"),
            ("--moe-router-topk-scaling-factor", "--model.moe_router_scale"),
            ("--moe-router-enable-expert-bias", "--model.moe_expert_bias true --model.moe_router_score sigmoid"),
            ("--moe-router-bias-update-rate", "--model.moe_expert_bias_rate"),
            ("--moe-router-num-groups", "--model.moe_router_groups"),
            ("--moe-router-group-topk", "--model.moe_router_group_top_k"),
            ("--moe-router-dtype", "--model.moe_router_fp32 true", "fp32; loom has no fp64 router"),
            (
                "--moe-router-pre-softmax",
                "--model.moe_norm_top_k false",
                "the top k weighted by the softmax over every expert, not renormalised (softmax scores: Megatron "
                "renormalises sigmoid ones whatever it says)",
            ),
            ("--moe-ffn-hidden-size", "--model.moe_ffn_hidden_size"),
            (
                "--moe-layer-freq",
                "--model.moe_dense_layers",
                "the number of dense blocks before the expert ones: a pattern '([0]*N+[1]*rest)' is N, 1 (every "
                "block has experts) is 0; other frequencies and patterns are not loom's",
                CONVERTED,
            ),
            ("--moe-shared-expert-intermediate-size", "--model.moe_shared_ffn_hidden_size"),
            ("--moe-shared-expert-gate", "--model.moe_shared_expert_gate true"),
            ("--expert-model-parallel-size", "--parallel.ep"),
            (
                "--disable-bias-linear",
                "--model.bias false",
                "Megatron has biases by default, loom none; without them Megatron's GELU is exact (erf), loom's the "
                "tanh form its fused bias-GELU computes",
            ),
            (
                "--add-qkv-bias",
                "--model.qkv_bias true",
                "QKV's biases alone with --disable-bias-linear; without it Megatron biases every linear layer: "
                "--model.bias true",
            ),
            (
                "--untie-embeddings-and-output-weights",
                "--model.tie_embeddings false",
                "Megatron ties them by default, loom does not",
            ),
            ("--init-method-std", "--model.init_std"),
            (
                "--hidden-dropout",
                "--model.dropout",
                "one rate for the embedding output, residual branches and attention; Megatron's 0.1, loom's 0",
            ),
            (
                "--attention-dropout",
                "--model.dropout",
                "one rate for the embedding output, residual branches and attention; Megatron's 0.1",
            ),
            ("--vocab-size", "--model.vocab_size"),
            (
                "--make-vocab-size-divisible-by",
                "--model.make_vocab_divisible_by",
                "times parallel.tp, as Megatron; loom leaves the padding ids out of the softmax, Megatron's includes "
                "them (its first losses are higher by about log(padded / real vocabulary))",
            ),
            ("--recompute-granularity", "--model.recompute", "full or selective"),
            ("--recompute-activations", "--model.recompute selective"),
            ("--recompute-method", "--model.recompute full", _EVERY_BLOCK),
            ("--recompute-num-layers", "--model.recompute full", _EVERY_BLOCK),
            (
                "--transformer-impl",
                "--model.kernels",
                "te for transformer_engine, native for local, or auto",
                CONVERTED,
            ),
            (
                "--attention-backend",
                "--model.attention_backend",
                "auto, flash, cudnn for fused, or efficient",
                CONVERTED,
            ),
            (
                "--optimizer",
                "--optim.name",
                "adamw for adam, which decays weights decoupled; sgd, lamb, adafactor",
                CONVERTED,
            ),
            ("--lr", "--optim.lr"),
            ("--min-lr", "--optim.min_lr", "Megatron's default 0, loom's 3e-5"),
            ("--decoupled-lr", "", "one learning rate for all, with --optim.layer_lr_decay"),
            ("--decoupled-min-lr", "", "one learning rate for all, with --optim.layer_lr_decay"),
            (
                "--lr-decay-style",
                "--optim.decay",
                "cosine, linear or constant; Megatron's default linear, loom's cosine",
                CONVERTED,
            ),
            ("--lr-decay-iters", "--optim.decay_steps"),
            ("--lr-decay-samples", "--optim.decay_steps", "in global batches: samples / global batch size", CONVERTED),
            ("--lr-warmup-iters", "--optim.warmup_steps", "loom's first warmup step already learns, at lr / warmup"),
            (
                "--lr-warmup-samples",
                "--optim.warmup_steps",
                "in global batches: samples / global batch size",
                CONVERTED,
            ),
            (
                "--lr-warmup-fraction",
                "--optim.warmup_steps",
                "a number of steps: the fraction x --lr-decay-iters (else --train-iters)",
                CONVERTED,
            ),
            ("--lr-warmup-init", "", "warmup starts at lr / warmup_steps"),
            ("--weight-decay", "--optim.weight_decay", "Megatron's default 0.01, loom's 0.1"),
            ("--adam-beta1", "--optim.beta1"),
            ("--adam-beta2", "--optim.beta2", "Megatron's default 0.999, loom's 0.95"),
            ("--adam-eps", "--optim.eps"),
            ("--sgd-momentum", "--optim.momentum"),
            ("--clip-grad", "--optim.clip_grad"),
            ("--bf16", "--train.precision bf16", "Megatron's default is fp32, loom's bf16"),
            ("--fp16", "--train.precision fp16", "a skipped step holds the learning rate, as in Megatron"),
            (
                "--fp8-format",
                "--train.fp8 delayed",
                "hybrid: E4M3 forward, E5M2 gradients; Megatron's --fp8-recipe defaults to delayed, whose amax "
                "history loom keeps 1024 long and takes the max of",
            ),
            ("--fp8-recipe", "--train.fp8", "delayed, or current for tensorwise", CONVERTED),
            ("--initial-loss-scale", "--optim.initial_loss_scale", "Megatron's default 2^32, loom's 65536"),
            ("--loss-scale", "", "loom's fp16 scale is dynamic: --optim.initial_loss_scale"),
            ("--loss-scale-window", "--optim.loss_scale_window"),
            ("--hysteresis", "--optim.loss_scale_hysteresis"),
            ("--min-loss-scale", "--optim.min_loss_scale"),
            (
                "--accumulate-allreduce-grads-in-fp32",
                "--optim.grad_dtype fp32",
                "loom's default; Megatron's under --bf16, not --fp16",
            ),
            ("--grad-reduce-in-bf16", "--optim.grad_dtype bf16"),
            ("--no-gradient-accumulation-fusion", "--optim.grad_accumulation_fusion false"),
            ("--save", "--train.run_dir", "checkpoints go in its checkpoints/, beside the run's logs and metrics"),
            (
                "--load",
                "--checkpoint.load",
                f"a run resumes from its own checkpoints without it, and --load D of --save D is that; {_NOT_READ}",
            ),
            ("--save-interval", "--checkpoint.interval"),
            (
                "--ckpt-format",
                "",
                "loom writes its own format; loom ckpt import-megatron reads Megatron's torch_dist and torch "
                "checkpoints",
            ),
            (
                "--ckpt-convert-format",
                "",
                "loom ckpt import-megatron reads torch_dist and torch checkpoints as they are; export-megatron writes "
                "torch_dist",
            ),
            (
                "--use-legacy-models",
                "",
                "loom has one GPT model, megatron-core's; loom ckpt import-megatron reads the legacy model's "
                "checkpoints",
            ),
            ("--finetune", "--checkpoint.finetune true", "with --checkpoint.load"),
            ("--no-load-optim", "--checkpoint.finetune true", "fresh optimizer state, from step 1"),
            ("--no-load-rng", "", "a resume restores the saved random state, under the same layout"),
            ("--async-save", "--checkpoint.async_save true"),
            ("--exit-interval", "--train.exit_after", "steps this job trains, not a step number", CONVERTED),
            (
                "--exit-duration-in-mins",
                "",
                "loom submit checkpoints before its Slurm time limit and requeues the job",
            ),
            (
                "--log-interval",
                "--train.log_interval",
                "loom logs that step's values every log_interval steps; Megatron's console line averages the interval",
            ),
            (
                "--calculate-per-token-loss",
                "",
                "loom's loss is the mean over the global batch's tokens, which is Megatron's default too while no "
                "token is masked",
            ),
            ("--eod-mask-loss", "", "loom trains on every token, as Megatron does without it"),
            ("--reset-position-ids", "", "loom's positions run on across documents, as Megatron's without it"),
            ("--reset-attention-mask", "", "loom's attention crosses documents, as Megatron's without it"),
            ("--eval-interval", "--train.eval_interval"),
            ("--eval-iters", "--train.eval_iters", "loom evaluates the same batches each time, Megatron fresh ones"),
            ("--tensorboard-dir", "--train.tensorboard true", "events go in the run directory"),
            ("--wandb-project", "--train.wandb_project"),
            ("--wandb-exp-name", "--train.wandb_run_name"),
            ("--wandb-entity", "--train.wandb_entity"),
            (
                "--data-path",
                "--data.paths",
                "the prefixes of Megatron's weight-prefix pairs, their weights to --data.weights; without weights "
                "Megatron blends by dataset size, loom equally",
                CONVERTED,
            ),
            (
                "--train-data-path",
                "--data.paths",
                "loom splits each dataset into train, valid and test by --data.split",
                CONVERTED,
            ),
            ("--valid-data-path", "--data.split", _VALIDATION_SPLIT, CONVERTED),
            ("--split", "--data.split", "Megatron's default 969,30,1, loom's 98,1,1"),
            ("--tokenizer-model", "--data.tokenizer"),
            (
                "--tokenizer-type",
                "--data.tokenizer",
                "the kind is read from the file: a .model or a tokenizer.json",
                CONVERTED,
            ),
            (
                "--vocab-file",
                "--data.tokenizer",
                GPT2_FILES,
                CONVERTED,
            ),
            (
                "--merge-file",
                "--data.tokenizer",
                GPT2_FILES,
                CONVERTED,
            ),
            ("--data-cache-path", "--data.cache_dir"),
            ("--mock-data", "", "loom demo trains on its embedded corpus; loom data build makes one of any JSONL"),
            ("--num-workers", "", "loom reads memory-mapped samples in the training process"),
        ],
    ),
    *_entries(
        TORCHTITAN,
        [
            ("job.config_file", "--config"),
            ("job.description", "--train.name", "the run's name, which names its directory under runs/", CONVERTED),
            ("job.dump_folder", "--train.run_dir", "a run's checkpoints, logs and metrics all go there"),
            (
                "model.name",
                "--config",
                "a preset of configs/, or a TOML file with a dense model's [model] fields; torchtitan's llama3 scales "
                "RoPE as Llama 3.1, loom with --model.rope_scaling llama3, and initialises its own way",
                CONVERTED,
            ),
            (
                "model.flavor",
                "--config",
                "llama3's 1B, 8B and 70B are the presets llama-1b, llama-8b and llama-70b; debugmodel has none, "
                "tiny is smaller; torchtitan's llama3 scales RoPE as Llama 3.1, loom with --model.rope_scaling llama3",
                CONVERTED,
            ),
            ("model.tokenizer_path", "--data.tokenizer"),
            ("model.hf_assets_path", "--data.tokenizer", "the tokenizer.json in the local folder", CONVERTED),
            ("model.converters", "--train.fp8 current", "float8: loom's FP8 training"),
            ("model.norm_type", "--model.norm", "rmsnorm or layernorm", CONVERTED),
            (
                "optimizer.name",
                "--optim.name",
                "adamw for AdamW; torch's Adam, with L2 decay in the gradient, loom has not",
                CONVERTED,
            ),
            ("optimizer.lr", "--optim.lr"),
            ("optimizer.eps", "--optim.eps"),
            (
                "optimizer.weight_decay",
                "--optim.weight_decay",
                "torchtitan decays every parameter, loom never norms and biases",
            ),
            ("optimizer.beta1", "--optim.beta1"),
            ("optimizer.beta2", "--optim.beta2"),
            ("optimizer.implementation", "", "loom runs fused AdamW where the device has it"),
            ("lr_scheduler.warmup_steps", "--optim.warmup_steps", "torchtitan's default 200, loom's 0"),
            (
                "lr_scheduler.decay_type",
                "--optim.decay",
                "cosine or linear, no sqrt; torchtitan's default linear, loom's cosine",
                CONVERTED,
            ),
            (
                "lr_scheduler.min_lr_factor",
                "--optim.min_lr",
                "a learning rate: lr x the factor; torchtitan's default factor 0, loom's min_lr 3e-5",
                CONVERTED,
            ),
            ("lr_scheduler.lr_min", "--optim.min_lr", "a learning rate: lr x the factor", CONVERTED),
            ("lr_scheduler.total_steps", "--optim.decay_steps"),
            (
                "lr_scheduler.decay_ratio",
                "--optim.decay_steps",
                "loom decays right after warmup, without a stable phase",
                CONVERTED,
            ),
            ("training.steps", "--train.steps"),
            ("training.local_batch_size", "--train.micro_batch_size", _BATCH),
            ("training.batch_size", "--train.micro_batch_size", _BATCH),
            ("training.global_batch_size", "--train.global_batch_size", "-1 there is local batch x dp", CONVERTED),
            ("training.seq_len", "--train.seq_length"),
            ("training.max_norm", "--optim.clip_grad"),
            ("training.warmup_steps", "--optim.warmup_steps"),
            ("training.dataset", "--data.paths", "the .bin/.idx prefixes loom data build writes", CONVERTED),
            ("training.dataset_path", "--data.paths", "the .bin/.idx prefixes loom data build writes", CONVERTED),
            (
                "training.mixed_precision_param",
                "--train.precision",
                "bf16 for bfloat16, fp32 for float32",
                CONVERTED,
            ),
            (
                "training.dtype",
                "--train.precision",
                "torchtitan's float32 with bfloat16 mixed precision is loom's bf16; a bfloat16 dtype, without fp32 "
                "master weights, loom has not",
                CONVERTED,
            ),
            ("training.mixed_precision_reduce", "--optim.grad_dtype", "fp32 for float32, or bf16", CONVERTED),
            ("training.enable_cpu_offload", "--optim.offload cpu"),
            ("training.compile", "--model.compile", "true or false; auto, the default, compiles on CUDA"),
            ("training.seed", "--train.seed"),
            ("debug.seed", "--train.seed"),
            ("training.tensor_parallel_degree", "--parallel.tp"),
            ("training.pipeline_parallel_degree", "--parallel.pp"),
            ("experimental.pipeline_parallel_degree", "--parallel.pp"),
            ("training.data_parallel_degree", "--parallel.dp", "-1 there is what remains of the world", CONVERTED),
            ("parallelism.tensor_parallel_degree", "--parallel.tp"),
            ("parallelism.pipeline_parallel_degree", "--parallel.pp"),
            ("parallelism.context_parallel_degree", "--parallel.cp"),
            (
                "parallelism.data_parallel_shard_degree",
                "--optim.zero",
                "3 shards weights, gradients and optimizer state over all data-parallel ranks, as FSDP; a shard "
                "degree of 1 is 0; loom's dp is replicate x shard",
                CONVERTED,
            ),
            (
                "parallelism.data_parallel_replicate_degree",
                "--parallel.dp",
                "loom's dp is replicate x shard, and ZeRO shards over all of it",
                CONVERTED,
            ),
            ("parallelism.enable_sequence_parallel", "--parallel.sequence_parallel", "true there by default"),
            ("parallelism.disable_loss_parallel", "", "loom's loss is always vocabulary-parallel under tp"),
            (
                "parallelism.pipeline_parallel_schedule",
                "--parallel.vp",
                "1 runs 1F1B, 2 or more interleaved 1F1B",
                CONVERTED,
            ),
            ("parallelism.pipeline_parallel_microbatch_size", "--train.micro_batch_size"),
            ("parallelism.expert_parallel_degree", "--parallel.ep"),
            ("checkpoint.enable", "--checkpoint.interval", _CHECKPOINT_ENABLE, CONVERTED),
            ("checkpoint.enable_checkpoint", "--checkpoint.interval", _CHECKPOINT_ENABLE, CONVERTED),
            ("checkpoint.folder", "--train.run_dir", "checkpoints go in its checkpoints/", CONVERTED),
            ("checkpoint.keep_latest_k", "--checkpoint.keep", "0 keeps all there; loom keeps at least 1", CONVERTED),
            (
                "checkpoint.initial_load_path",
                "--checkpoint.load",
                "torchtitan loads the model alone unless initial_load_model_only = false: add --checkpoint.finetune "
                f"true; {_NOT_READ}",
            ),
            ("checkpoint.initial_load_model_only", "--checkpoint.finetune", "with --checkpoint.load"),
            ("checkpoint.initial_load_in_hf", "", "loom ckpt import-hf converts a Hugging Face model first"),
            ("checkpoint.async_mode", "--checkpoint.async_save", "true for async, false for disabled", CONVERTED),
            (
                "checkpoint.load_step",
                "--checkpoint.load",
                "RUN/checkpoints/iter_0000500 for step 500",
                CONVERTED,
            ),
            ("checkpoint.interval_type", "", "loom saves every so many steps"),
            ("checkpoint.model_weights_only", "", "loom ckpt export-hf writes the weights alone"),
            ("checkpoint.last_save_model_only", "", "loom ckpt export-hf writes the weights alone"),
            ("checkpoint.export_dtype", "", "loom ckpt export-hf --dtype writes Hugging Face weights"),
            ("activation_checkpoint.mode", "--model.recompute", "none, selective or full"),
            (
                "activation_checkpoint.selective_ac_option",
                "--model.recompute",
                "loom's selective recomputes core attention alone, not every Nth block nor by op",
                CONVERTED,
            ),
            ("compile.enable", "--model.compile", "true or false; auto, the default, compiles on CUDA"),
            ("compile.components", "", "loom compiles each block; its loss is one fused pass"),
            (
                "quantize.linear",
                "--train.fp8 current",
                "tensorwise scales; torchtitan trains in FP8 only when model.converters lists float8",
            ),
            ("float8.enable_float8_linear", "--train.fp8 current"),
            ("metrics.log_freq", "--train.log_interval"),
            ("metrics.enable_tensorboard", "--train.tensorboard", "on by default; events go in the run directory"),
            ("metrics.enable_wandb", "--train.wandb_project", "a project name", CONVERTED),
            ("metrics.save_tb_folder", "", "TensorBoard's events go in the run directory"),
            ("profiling.enable_profiling", "", _PROFILE),
            ("profiling.save_traces_folder", "", _PROFILE),
            ("profiling.profile_freq", "", _PROFILE),
            ("validation.enable", "--train.eval_interval", "steps between evaluations; 0 is off", CONVERTED),
            ("validation.enabled", "--train.eval_interval", "steps between evaluations; 0 is off", CONVERTED),
            ("validation.freq", "--train.eval_interval", "with validation.enable; loom's 0 is off"),
            (
                "validation.steps",
                "--train.eval_iters",
                "global batches, not per-rank ones; -1, the whole set, loom has not",
                CONVERTED,
            ),
            ("validation.dataset", "--data.split", _VALIDATION_SPLIT, CONVERTED),
            ("validation.dataset_path", "--data.split", _VALIDATION_SPLIT, CONVERTED),
            ("comm.init_timeout_seconds", "--parallel.timeout_minutes", "in minutes", CONVERTED),
            ("comm.train_timeout_seconds", "--parallel.timeout_minutes", "in minutes", CONVERTED),
        ],
    ),
)
"""Names of training settings elsewhere: the commands that take config overrides (train, submit, plan, ...)."""

_TORCHRUN_RENDEZVOUS = "loom train under torchrun takes them from torchrun; loom submit from Slurm"

TRAIN_LAUNCH_NAMES: tuple[NameElsewhere, ...] = _entries(
    TORCHRUN,
    [
        ("--nproc-per-node", "--nproc", "loom train starts its own ranks, or runs as one under torchrun"),
        ("--nnodes", "", "several nodes: loom submit --nodes N, or loom train under torchrun on each"),
        ("--node-rank", "", _TORCHRUN_RENDEZVOUS),
        ("--master-addr", "", _TORCHRUN_RENDEZVOUS),
        ("--master-port", "", _TORCHRUN_RENDEZVOUS),
        ("--rdzv-endpoint", "", _TORCHRUN_RENDEZVOUS),
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
        ("--json-keys", "--text-key", "one key", CONVERTED),
        ("--tokenizer-model", "--tokenizer"),
        ("--tokenizer-type", "--tokenizer", "the kind is read from the file: a .model or a tokenizer.json", CONVERTED),
        (
            "--vocab-file",
            "--tokenizer",
            GPT2_FILES,
            CONVERTED,
        ),
        (
            "--merge-file",
            "--tokenizer",
            GPT2_FILES,
            CONVERTED,
        ),
        ("--split-sentences", "", "loom keeps documents whole"),
        ("--keep-newlines", "", "loom keeps the text as written"),
        ("--partitions", "--workers", "processes that encode, over one output", CONVERTED),
        ("--log-interval", "", "loom data build shows a progress bar"),
    ],
)
"""Names of `loom data build`'s options in Megatron-LM's preprocessing script (which appends no end-of-document
token unless --append-eod, and names its output PREFIX_text_document; loom appends one unless --no-append-eod, and
writes PREFIX.bin and PREFIX.idx)."""


def name_key(typed: str) -> str:
    """How a typed name is looked up: without dashes before it or a value after `=`, `-` as `_` (Megatron's
    flags, torchtitan's tyro flags), lower case."""
    return typed.lstrip("-").split("=", 1)[0].replace("-", "_").lower()


def entry_for(typed: str, names: tuple[NameElsewhere, ...] = TRAINING_NAMES) -> NameElsewhere | None:
    """The entry of `names` that `typed` spells, if any. A dotted name under an entry's (torchtitan's
    `quantize.linear.float8.recipe_name` under `quantize.linear`) is that entry's; one whose last part is an
    entry's name or last part (`--model.num_attention_heads`, `--parallel.tensor_parallel_degree`) is that entry's."""
    by_key = {name_key(entry.name): entry for entry in names}
    key = name_key(typed)
    while key not in by_key and key.count(".") > 1:
        key = key.rsplit(".", 1)[0]
    if key in by_key or "." not in key:
        return by_key.get(key)
    field = key.rsplit(".", 1)[1]
    return next((entry for name, entry in by_key.items() if name.rsplit(".", 1)[-1] == field), None)


def loom_setting(entry: NameElsewhere, value: str | None = None) -> str:
    """loom's flag for it, with the value written for the other engine where that value means the same."""
    if value and entry.value_carries and entry.loom.startswith("--") and " " not in entry.loom:
        return f"{entry.loom} {value}"
    return entry.loom


def loom_fields_named(typed: str) -> list[str]:
    """loom's settings whose field is named as typed (its last part), whatever the section: `--steps` and
    `--model.lr` are --train.steps and --optim.lr."""
    key = name_key(typed).rsplit(".", 1)[-1]
    return [
        f"--{section.name}.{spec.name}"
        for section in dataclasses.fields(LoomConfig)
        for spec in dataclasses.fields(section.default_factory)
        if spec.name == key
    ]


@dataclass(frozen=True)
class Answer:
    """What loom calls a name the user typed: another engine's (`engine` set) or a loom field in the wrong place."""

    name: str
    engine: str | None
    loom: str
    """loom's setting with the value where it carries over; "" where loom has none."""
    note: str

    def _label(self) -> str:
        return f"{self.name} ({self.engine})" if self.engine else self.name

    def clause(self) -> str:
        """`--tensor-model-parallel-size (Megatron-LM) is --parallel.tp 2 in loom`, for a one-line error."""
        note = f" ({self.note})" if self.note else ""
        if not self.loom:
            return f"{self._label()} has no loom setting{note}"
        return f"{self._label()} is {self.loom} in loom{note}"

    def line(self) -> str:
        """`  --tensor-model-parallel-size (Megatron-LM): --parallel.tp 2`, one of a list."""
        note = f" ({self.note})" if self.note else ""
        return f"  {self._label()}: {self.loom or 'no loom setting'}{note}"


def answers(named: list[tuple[str, str | None]], names: tuple[NameElsewhere, ...], loom_fields: bool) -> list[Answer]:
    """An Answer for each (name, value) of `named` that is another engine's name in `names` for a loom setting, or,
    with `loom_fields`, a loom field outside its section; a note shared by several is given with the first."""
    found, notes_said = [], set()
    for name, value in dict.fromkeys(named):
        entry = entry_for(name, names)
        fields = loom_fields_named(name) if loom_fields and entry is None else []
        if entry is not None:
            note = "" if entry.note in notes_said else entry.note
            notes_said.add(entry.note)
            found.append(Answer(name, entry.engine, loom_setting(entry, value), note))
        elif fields:
            shown = f" {value}" if value and len(fields) == 1 else ""
            found.append(Answer(name, None, " or ".join(fields) + shown, ""))
    return found


def flags_and_values(arguments: list[str]) -> list[tuple[str, str | None]]:
    """Each `--flag` of a command line with what follows it up to the next flag (`--flag=value` too), as one
    string, or None."""
    pairs = []
    for i, argument in enumerate(arguments):
        if not argument.startswith("--") or argument == "--":
            continue
        flag, equals, inline = argument.partition("=")
        following = []
        for later in arguments[i + 1 :]:
            if later.startswith("--"):
                break
            following.append(later)
        pairs.append((flag, inline if equals else " ".join(following) or None))
    return pairs
