"""Tiny builds of third-party models people train, from configs in code (no download).

diffusers' ``ModelMixin`` and peft's wrappers define ``__getattr__``, so Dynamo reaches their parameters
through ``__dict__['_modules']`` sources ([Note: parameters known by identity] in compile/passes/detect.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["LORA_QUERY_WEIGHTS", "tiny_lora_llama", "tiny_unet", "tiny_unet_conditional"]

# the frozen query projections of tiny_lora_llama, as named_parameters() names them (an fnmatch pattern)
LORA_QUERY_WEIGHTS = "base_model.model.model.layers.*.self_attn.q_proj.base_layer.weight"


def tiny_unet() -> nn.Module:
    """diffusers' ``UNet2DModel``: ``(sample (b, 3, 8, 8), timestep (b,))`` → ``.sample``."""
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, attention_head_dim=8)


def tiny_unet_conditional() -> nn.Module:
    """diffusers' ``UNet2DConditionModel``: ``(sample (b, 4, 8, 8), timestep (b,), text (b, 3, 8))`` → ``.sample``."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=4, attention_head_dim=4)


def tiny_lora_llama() -> nn.Module:
    """A peft LoRA model (rank 4 on the query and value projections) over transformers' Llama: tokens → ``.logits``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, attn_implementation="sdpa")
    base = LlamaForCausalLM(cfg)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():  # LoRA's B starts at zero; nonzero values make every adapter weight's gradient nonzero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model
