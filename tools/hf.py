"""Hugging Face interchange: a loom checkpoint <-> safetensors + config.json (GPT-2-shaped models: the GPT-2
format, whose names tools/hf_gpt2.py holds; which class a model is, and its config.json: tools/hf_forms.py).

The mapping (tools/hf_names.py) is the one place that knows Hugging Face's Llama names. loom's fused tensors are
split on export (QKV -> q_proj, k_proj, v_proj; SwiGLU fc1 -> gate_proj, up_proj) and joined on import; loom's
rotary embedding already uses Hugging Face's rotate-half convention, so no permutation of the query/key rows is
needed. A Qwen2's names are Llama's with q/k/v_proj.bias, a Qwen3's add q_norm and k_norm, a Granite's are Llama's,
a Phi-3 (Phi-4 too) keeps QKV and gate+up fused as loom does (qkv_proj, gate_up_proj), an OLMo 2 has q_norm and
k_norm across all heads and its norms after attention and the MLP (its post_attention_layernorm is attention's, not
the MLP's), and a Nemotron has LayerNorm biases, its norm weights stored minus one and up_proj alone before a
squared ReLU; a Gemma's are Llama's, its RMSNorm weights stored minus one (its gated GELU and sqrt(hidden_size)
embedding scale are [model] settings); a mixture of experts' (Mixtral's, Qwen3-MoE's, OLMoE's, Qwen2-MoE's:
tools/hf_moe.py) name each expert's tensors apart, which loom stacks.
An import never yields a different model than the one on disk.
transformers is not needed here: the files are written with safetensors and json; tests load them with transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loom.engine.atomic import (
    save_tensors_atomically,
    stream_tensors_atomically,
    torch_dtype_of,
    write_text_atomically,
)
from loom.engine.checkpoint.format import CheckpointError, sha256_of, unrecorded_tokenizer
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.tools.ckpt import LazyWeights, open_checkpoint, write_weights_checkpoint
from loom.tools.hf_forms import (
    HF_TOKEN_ID_FIELDS,
    LOOM_TOKEN_IDS,
    check_llama_form,
    hf_config,
    model_from_hf_config,
    phi3_form,
    read_hf_config,
)
from loom.tools.hf_gemma import gemma3_text_config, text_model_names, with_class_defaults
from loom.tools.hf_gpt2 import (
    embedding_key,
    from_gpt2,
    gpt2_config,
    gpt2_module,
    has_gpt2_form,
    model_from_gpt2_config,
    to_gpt2,
)
from loom.tools.hf_moe import (
    kept_in_fp32,
)
from loom.tools.hf_names import from_hf, fused_sizes, hf_names_of, names_in_block, stored_minus_one, to_hf
from loom.tools.hf_tokenizer import check_moved_tokenizer, export_tokenizer
from loom.tools.lora import ModelWeights, adapted_weights, base_of
from loom.tools.outputs import HF_TOKENIZER_FILES, claimed_checkpoint_output, claimed_export_output

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Hugging Face's names for loom's: outside the blocks, and inside block i (under model.layers.<i>.). A fused
# loom tensor (QKV, SwiGLU gate+up) maps to several Hugging Face tensors stacked along dim 0 in this order.
def export_hf(
    source: Path,
    output: Path,
    base: Path | None = None,
    overwrite: bool = False,
    dtype: str | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """Write model.safetensors + config.json for the checkpoint at `source` (a LoRA run's with its adapters
    folded into its base, found where it was trained or at `base`) into `output` (claimed as tools/outputs.py
    says), in `dtype` (an EXPORT_DTYPES name; None: the dtype an imported model came in, else float32, the
    weights as loom keeps them); `tokenizer`: where the tokenizer the model trained with is now, if it moved."""
    directory, metadata = open_checkpoint(source)
    model = config_to_dict(config_from_dict(metadata.config))["model"]  # fills fields older checkpoints lack
    gpt2 = has_gpt2_form(model)
    if not gpt2:
        check_llama_form(model, gpt2_too=True)
    weights = ModelWeights(directory, metadata, base)
    model.update(weights.router_training())  # a LoRA run's router settings are its base's
    origin = weights.model_metadata  # a LoRA checkpoint's Hugging Face origin is its base's
    trained_with = weights.tokenizer
    if trained_with is None and origin.hf_source is None:
        trained_with = unrecorded_tokenizer(metadata.config)  # an older checkpoint: its config names it, unchecked
    if tokenizer is not None:
        check_moved_tokenizer(trained_with, tokenizer, model["vocab_size"])
    dtype = dtype or origin.hf_dtype or "float32"

    # Each weight read, cast and written on its own: the whole model held in memory took 1-2.5x the checkpoint
    fp32 = kept_in_fp32(model)  # an MoE router's and its biases, as their classes keep them

    def exported(name: str) -> torch.Tensor:  # a Nemotron's or Gemma's norm weights minus one before the cast
        tensor = weights[name].float() - 1 if stored_minus_one(name, model) else weights[name]
        return tensor.float() if name.endswith(fp32) else tensor.to(EXPORT_DTYPES[dtype])

    cast = LazyWeights(weights.shapes, exported)
    phi3 = phi3_form(model, origin.hf_model_type)
    tensors = to_gpt2(cast, model) if gpt2 else to_hf(cast, model, phi3)
    fp32_names = tuple(hf for local in fp32 for hf in names_in_block(model, phi3)[local])
    declared = {
        hf_name: (torch.float32 if hf_name.endswith(fp32_names) else EXPORT_DTYPES[dtype], shape)
        for hf_name, shape in tensors.shapes.items()
    }
    with claimed_export_output(output, overwrite):  # before any weight is read
        print(f"exporting step {metadata.step}: {directory}", flush=True)  # which is a run's newest intact one, say
        output.mkdir(parents=True, exist_ok=True)
        stream_tensors_atomically(declared, tensors.__getitem__, output / "model.safetensors", {"format": "pt"})
        not_written = export_tokenizer(
            output, trained_with, origin, model["max_position_embeddings"], model["vocab_size"], tokenizer
        )
        token_ids = LOOM_TOKEN_IDS if origin.hf_token_ids is None else origin.hf_token_ids
        config = gpt2_config(model, token_ids, dtype) if gpt2 else hf_config(model, token_ids, dtype, phi3)
        write_text_atomically(output / "config.json", json.dumps(config, indent=2))  # last: the export is complete
    if not_written:
        print(f"warning: {not_written}", file=sys.stderr)
    elif trained_with is not None and trained_with["sha256"] is None:
        exported = f"{tokenizer} (--tokenizer)" if tokenizer else f"{trained_with['path']}, which its config names,"
        print(
            f"warning: the checkpoint records no checksum of its tokenizer (it predates loom's record): exported "
            f"{exported} unchecked",
            file=sys.stderr,
        )
    return output


class _SafetensorsFolder(LazyWeights):
    """The tensors of a folder's *.safetensors files by name, each read when asked for (an 8B import that read them
    all first held the model twice over); their shapes and dtypes come from the files' headers."""

    def __init__(self, files: list[Path]):
        self._handles, self._file_of, self.dtypes, shapes = {}, {}, {}, {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
                for key in handle.keys():
                    header = handle.get_slice(key)
                    shapes[key], self.dtypes[key], self._file_of[key] = (
                        tuple(header.get_shape()),
                        header.get_dtype(),
                        file,
                    )
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{file} is not a readable safetensors file (truncated?): {error}") from None
            self._handles[file] = handle
        super().__init__(shapes)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.shapes:
            raise KeyError(key)
        return self._handles[self._file_of[key]].get_tensor(key)


PEFT_ADAPTER = "adapter_model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def _read_hf_tensors(source: Path) -> _SafetensorsFolder:
    """The model's weights: the files its shard index lists, else every *.safetensors but a PEFT adapter's."""
    index = source / SHARD_INDEX
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not all(isinstance(name, str) for name in listed):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a shard index (no weight_map of tensor names to files)") from None
        missing = [name for name in listed if not (source / name).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {', '.join(missing[:3])}, which {source} does not hold")
        return _SafetensorsFolder([source / name for name in listed])
    files = sorted(path for path in source.glob("*.safetensors") if path.name != PEFT_ADAPTER)
    if (source / PEFT_ADAPTER).is_file():
        print(
            f"warning: {source / PEFT_ADAPTER} (a PEFT adapter) is not imported: the base model beside it is; "
            "fine-tune adapters of loom's own with --lora.rank, or merge it in with peft first",
            file=sys.stderr,
        )
    if not files and (source / PEFT_ADAPTER).is_file():
        raise CheckpointError(f"{source} holds only a PEFT adapter ({PEFT_ADAPTER}), not a model to import")
    if not files:
        others = sorted(p.name for p in source.glob("*.bin")) + sorted(p.name for p in source.glob("*.pt*"))
        found = (
            f" (found {', '.join(others[:3])}: load and save_pretrained it with safe_serialization)" if others else ""
        )
        raise CheckpointError(f"{source} holds no *.safetensors weights{found}")
    return _SafetensorsFolder(files)


def import_hf(source: Path, output: Path, overwrite: bool = False) -> Path:
    """Write a loom checkpoint (step 0, weights only, tp=1 pp=1 pieces) under `output` (claimed as
    tools/outputs.py says)."""
    hf = read_hf_config(source)
    image_text = hf.get("model_type") == "gemma3"  # Gemma 3 4B and up: its text model is imported
    hf = gemma3_text_config(hf) if image_text else with_class_defaults(hf)
    gpt2 = hf.get("model_type") == "gpt2"
    try:
        model = model_from_gpt2_config(hf) if gpt2 else model_from_hf_config(hf)
    except KeyError as error:
        kind = "GPT-2" if gpt2 else "Llama"
        raise CheckpointError(f"{source / 'config.json'} has no {error.args[0]!r}; is it a {kind} config?") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source / 'config.json'} has a value of the wrong kind ({error})") from None
    if not gpt2 and model["max_position_embeddings"] < hf["max_position_embeddings"]:
        print(
            f"note: {source / 'config.json'} attends over a sliding window of {hf['sliding_window']} tokens, loom "
            f"over the whole sequence: imported with max_position_embeddings = {model['max_position_embeddings']} "
            f"(not {hf['max_position_embeddings']}), the length up to which the two compute the same",
            file=sys.stderr,
        )
    # The imported checkpoint's run settings are what `loom eval` and fine-tuning start from: sequences no
    # longer than the model's positions, and a batch one CPU rank gets through.
    train = {"seq_length": min(2048, model["max_position_embeddings"]), "global_batch_size": 8}
    tensors = _read_hf_tensors(source)  # their headers: a weight is read only when it is written
    if image_text:
        tensors = _text_model_tensors(tensors, source)
    if hf.get("num_nextn_predict_layers"):
        tensors = _without_prediction_layers(tensors, source, hf["num_hidden_layers"])
    embedding = embedding_key(tensors) if gpt2 else "model.embed_tokens.weight"
    if (
        model["tie_embeddings"]
        and {"lm_head.weight", embedding} <= tensors.keys()
        and not torch.equal(tensors["lm_head.weight"], tensors[embedding])
    ):
        # transformers then keeps both ("will NOT tie them"): the model on disk has its own output layer
        model["tie_embeddings"] = False
        print(
            f"warning: {source / 'config.json'} ties the embeddings, but lm_head.weight differs from "
            f"{embedding}: imported untied, as transformers loads it",
            file=sys.stderr,
        )
    config = config_from_dict({"model": model, "train": train})
    try:
        loom_model = config_to_dict(config)["model"]
        phi3 = hf.get("model_type") == "phi3"
        logical = from_gpt2(tensors, loom_model) if gpt2 else from_hf(tensors, loom_model, phi3)
    except KeyError as error:
        raise CheckpointError(
            f"{source} has no tensor {error.args[0]!r}, which its config.json (model_type {hf.get('model_type')!r}) "
            "implies; do the config and the weights belong together?"
        ) from None
    except CheckpointError as error:
        raise CheckpointError(f"{source}: {error}") from None
    origin = {
        "hf_source": str(source.resolve()),
        "hf_token_ids": {field: hf[field] for field in HF_TOKEN_ID_FIELDS if hf.get(field) is not None},
        "hf_dtype": _stored_dtype(tensors, embedding),
        "hf_model_type": "gemma3" if image_text else hf.get("model_type"),  # the folder's class, for PEFT
        "hf_tokenizer": {name: sha256_of(source / name) for name in HF_TOKENIZER_FILES if (source / name).is_file()}
        or None,
    }
    with claimed_checkpoint_output(output, overwrite):  # once all is known good: --overwrite moves the old one aside
        return write_weights_checkpoint(output, config, logical, "the Hugging Face model", hf_origin=origin)


def _text_model_tensors(tensors: _SafetensorsFolder, source: Path) -> LazyWeights:
    """A Gemma 3 image-text model's text-model tensors under Gemma3ForCausalLM's names (said, with what is left)."""
    names, left = text_model_names(list(tensors))
    text = LazyWeights({new: tensors.shapes[old] for new, old in names.items()}, lambda new: tensors[names[new]])
    text.dtypes = {new: tensors.dtypes[old] for new, old in names.items()}
    print(
        f"note: {source} is an image-text Gemma 3: its text model is imported ({len(names)} tensors), its vision "
        f"tower and projector ({len(left)} tensors) are not; it exports as a Gemma3ForCausalLM",
        file=sys.stderr,
    )
    return text


def _without_prediction_layers(tensors: _SafetensorsFolder, source: Path, layers: int) -> LazyWeights:
    """The tensors but those of the multi-token-prediction layers GLM-4.5's and DeepSeek-V3's files keep after the
    model's own (model.layers.<num_hidden_layers>... : num_nextn_predict_layers), which transformers' classes do not
    compute either (said, with how many)."""
    kept = [name for name in tensors if not _layer_at_or_after(name, layers)]
    if len(kept) == len(tensors.shapes):
        return tensors
    weights = LazyWeights({name: tensors.shapes[name] for name in kept}, tensors.__getitem__)
    weights.dtypes = {name: tensors.dtypes[name] for name in kept}
    print(
        f"note: {source} keeps multi-token-prediction layers after its {layers} ({len(tensors.shapes) - len(kept)} "
        "tensors): they are left out, as transformers leaves them",
        file=sys.stderr,
    )
    return weights


def _layer_at_or_after(name: str, layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers


def _stored_dtype(tensors: _SafetensorsFolder, key: str) -> str | None:
    """The dtype the model's weights (its tensor `key`) are stored in (what config.json's torch_dtype should say,
    and not always does), as an EXPORT_DTYPES name; None for one loom does not write."""
    try:
        stored = torch_dtype_of(tensors.dtypes[key], key)
    except ValueError:
        return None
    return next((name for name, dtype in EXPORT_DTYPES.items() if dtype == stored), None)


def export_peft_adapter(
    source: Path, output: Path, base: Path | None = None, base_model: str | None = None, overwrite: bool = False
) -> Path:
    """Write a LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) for the model export_hf writes of its base. A fused loom adapter maps exactly: in the
    Llama form qkv's one A serves q_proj, k_proj and v_proj, each with its rows of B (likewise gate/up); in GPT-2's
    each loom layer is one Conv1D (c_attn, c_proj, c_fc).
    base_model_name_or_path is `base_model` if given, else the Hugging Face folder the base was imported from
    (its checkpoint, found where it was trained or at `base`, records it)."""
    directory, metadata = open_checkpoint(source)
    if metadata.lora_base is None:
        raise CheckpointError(f"{directory} is not a LoRA checkpoint; --adapter-only exports a LoRA run's adapters")
    try:
        base_metadata = base_of(directory, metadata, base, verify_hashes=False)[1]
    except CheckpointError:  # the base moved or changed: the adapters themselves still export, unnamed
        base_metadata = None
    if base_model is None and base_metadata is not None:
        if base_metadata.hf_model_type == "gemma3":  # its text model sits under model.language_model there
            raise CheckpointError(
                f"the base was imported from an image-text Gemma 3 ({base_metadata.hf_source}), whose text model "
                "the adapters do not name as PEFT would find it: export the base with `loom ckpt export-hf` (a "
                "Gemma3ForCausalLM) and give that folder as --base-model"
            )
        base_model = base_metadata.hf_source
    config = config_from_dict(metadata.config)
    model = config_to_dict(config)["model"]
    # a Phi-3's adapters sit on its fused modules (qkv_proj, gate_up_proj), as export_hf writes its base
    phi3 = phi3_form(model, (base_metadata or metadata).hf_model_type)
    gpt2 = has_gpt2_form(model)
    if not gpt2:
        check_llama_form(model, gpt2_too=True)
    reader, sizes = PieceReader(directory, metadata), fused_sizes(model)
    tensors, modules = {}, set()
    for weight, (a_name, b_name) in adapted_weights(metadata.specs).items():
        a, b = reader.model(a_name).float(), reader.model(b_name).float()
        if gpt2:  # one Conv1D per loom layer, named whole: c_proj is both the attention's and the MLP's last
            module = gpt2_module(weight)
            modules.add(module)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            continue
        hf_weights = hf_names_of(weight, names_in_block(model, phi3), model["num_experts"])
        b_parts = b.split(sizes[naming.split_block_param_name(weight)[1]]) if len(hf_weights) > 1 else (b,)
        for hf_weight, b_part in zip(hf_weights, b_parts, strict=True):
            module = hf_weight.removesuffix(".weight")
            modules.add(module.rpartition(".")[2])
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b_part.contiguous()
    lora = config.lora
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": gpt2,  # GPT-2's Conv1D keeps its weight [in, out]
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    with claimed_export_output(output, overwrite):  # weights without their adapter_config.json: PEFT cannot load them
        print(f"exporting the adapters of step {metadata.step}: {directory}", flush=True)
        output.mkdir(parents=True, exist_ok=True)
        save_tensors_atomically(tensors, output / "adapter_model.safetensors", metadata={"format": "pt"})
        write_text_atomically(output / "adapter_config.json", json.dumps(adapter_config, indent=2))
    return output
