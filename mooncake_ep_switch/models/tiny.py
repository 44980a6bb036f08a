"""Tiny Hugging Face transformers MoE models built from a config with seeded random weights.

Nothing is downloaded: every model is `AutoModelForCausalLM.from_config(config)` with its weights
drawn from a seeded CPU generator, so every process that builds the same name and seed holds the
same bits. Each architecture keeps its own routing:

- `qwen3_moe`: softmax over the experts, top-k, renormalised (`norm_topk_prob`);
- `mixtral`: the same router, every layer sparse, a different expert width;
- `deepseek_v3`: sigmoid scores plus a correction bias, group-limited top-k (`n_group`,
  `topk_group`), weights scaled by `routed_scaling_factor`, one shared expert beside the routed
  ones, and a dense first layer (`first_k_dense_replace`).

Every MoE block of these models has a router `block.gate` (returns logits, top-k weights, top-k
ids) and fused experts `block.experts` (`gate_up_proj` `[E, 2I, H]` gate rows then up rows,
`down_proj` `[E, H, I]`), the layout of the runtime's unified weight memory.
"""
from typing import Callable, Dict, List, NamedTuple

import torch

HIDDEN = 128  # dispatch needs a multiple of 128
VOCAB = 128
# The transformers modules `build_model` imports (seconds of CPU): a launcher's fork server that imported them
# (`LocalCluster(preload_modules=RANK_MODULES)`) starts ranks that build a model without them.
RANK_MODULES = ("transformers.models.auto.modeling_auto", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.mixtral.modeling_mixtral")


class ExpertWeights(NamedTuple):
    """One MoE layer's routed experts, full (unsharded), as the runtime loads them.

    Fields:
        gate_up: `[E, 2I, H]` torch.bfloat16, gate rows then up rows.
        down: `[E, H, I]` torch.bfloat16.
    """

    gate_up: torch.Tensor
    down: torch.Tensor


def _qwen3_moe(num_experts: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=num_experts, num_experts_per_tok=2, norm_topk_prob=True,
                          decoder_sparse_step=1, max_position_embeddings=128, tie_word_embeddings=False)


def _mixtral(num_experts: int):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=num_experts,
                         num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)


def _deepseek_v3(num_experts: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                            num_key_value_heads=4, n_routed_experts=num_experts, n_shared_experts=1,
                            num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                            qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=128,
                            tie_word_embeddings=False)


#: Architecture name -> config builder taking the number of routed experts.
ARCHITECTURES: Dict[str, Callable] = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3}


def build_model(name: str, seed: int = 0, num_experts: int = 8):
    """A tiny transformers MoE causal LM with seeded random bf16 weights, in eval mode.

    Arguments:
        name: one of `ARCHITECTURES` (`"qwen3_moe"`, `"mixtral"`, `"deepseek_v3"`).
        seed: seed of the generator drawing every weight (same seed, same bits in every process).
        num_experts: routed experts per MoE layer (a multiple of 4 for `deepseek_v3`'s 4 groups).

    Returns:
        model: a `transformers` `...ForCausalLM` in torch.bfloat16 with eager attention and eager
            experts (the model's own reference forward); its LM head runs in torch.float32 (float32
            logits, so that greedy tokens are not decided by ties of bf16-rounded logits).

    Raises:
        ValueError: `name` is not a supported architecture.
        ImportError: transformers is not installed (the `models` extra).
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"name: expected one of {sorted(ARCHITECTURES)}, got {name!r}")
    from transformers import AutoModelForCausalLM

    config = ARCHITECTURES[name](num_experts)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            if param_name.endswith("norm.weight") or param_name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param_name.endswith("gate.weight"):  # routers: decisive, skewed scores
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5 * 4)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
        # A shared direction in every embedding and a few hot experts per router along it: skewed
        # expert loads, as real routers have (what EPLB's redundant experts are for).
        direction = torch.randn(model.config.hidden_size, generator=generator)
        direction /= direction.norm()
        model.get_input_embeddings().weight.add_(direction)
        for block in moe_blocks(model):
            hot = torch.randperm(block.gate.weight.size(0), generator=generator)[:2]
            block.gate.weight[hot] += 0.3 * direction
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))
    model = model.to(torch.bfloat16).eval()
    # The LM head in float32: greedy tokens are then not decided by ties of bf16-rounded logits.
    model.lm_head.float()
    model.lm_head.register_forward_pre_hook(lambda module, args: (args[0].float(),) + tuple(args[1:]))
    return model


def moe_blocks(model) -> List[torch.nn.Module]:
    """The sparse MoE blocks of a transformers model, in layer order.

    Arguments:
        model: a transformers causal LM whose MoE blocks have `gate` and fused `experts`
            (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`).

    Returns:
        blocks: list of modules (e.g. `Qwen3MoeSparseMoeBlock`, `DeepseekV3MoE`), one per MoE layer.

    Raises:
        ValueError: the model has no such block.
    """
    blocks = [layer.mlp for layer in model.model.layers
              if hasattr(layer.mlp, "gate") and hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj")]
    if not blocks:
        raise ValueError(f"model: expected MoE blocks with `gate` and fused `experts`, found none in "
                         f"{type(model).__name__}")
    return blocks


def expert_layers(model) -> List[ExpertWeights]:
    """Every MoE layer's routed-expert weights (views of the model's parameters).

    Arguments:
        model: a model from `build_model` (or any model `moe_blocks` accepts) in torch.bfloat16.

    Returns:
        layers: list of `ExpertWeights`, one per MoE block, in layer order.
    """
    return [ExpertWeights(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
            for block in moe_blocks(model)]
