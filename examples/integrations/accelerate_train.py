"""Train a tiny Hugging Face Llama with accelerate, fully sharded by fsdp_pass.

    torchrun --standalone --nproc-per-node 2 examples/integrations/accelerate_train.py

accelerate's own loop (accumulate, clip_grad_norm_, save_state, save_model); the two lines marked
"fsdp_pass" are all it takes. See docs/integrations.md.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_pass.integrations.accelerate import prepare


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="accelerate_out")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.compile(backend="vescale")                                   # fsdp_pass
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = prepare(accelerator, model, optimizer)          # fsdp_pass: instead of accelerator.prepare

    data = torch.randint(0, 256, (args.steps * 2 * accelerator.num_processes, 4, 32),
                         generator=torch.Generator().manual_seed(0))
    for i, tokens in enumerate(data[accelerator.process_index::accelerator.num_processes]):
        with accelerator.accumulate(model):                            # no reduce-scatter but every 2nd backward
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            accelerator.print(f"step {(i + 1) // 2}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")
    accelerator.save_state(os.path.join(args.out, "state"))            # whole tensors, loadable at any size
    accelerator.save_model(model, os.path.join(args.out, "model"))     # whole weights, safetensors
    if accelerator.is_main_process:                                    # from_pretrained needs the config too
        model.config.save_pretrained(os.path.join(args.out, "model"))


if __name__ == "__main__":
    main()
