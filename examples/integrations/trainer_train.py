"""Train a tiny Hugging Face Llama with transformers' Trainer, fully sharded by fsdp_pass.

    torchrun --standalone --nproc-per-node 2 examples/integrations/trainer_train.py

The Trainer's own loop (gradient accumulation, clipping, logging, checkpoints, resume, save_model);
the lines marked "fsdp_pass" are all it takes. Run it again with the same --out (after an interruption,
or with a larger --steps): it resumes from the last checkpoint. See docs/integrations.md.
"""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from fsdp_pass.integrations.transformers import Trainer   # fsdp_pass: instead of transformers.Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="trainer_out")
    args = parser.parse_args()

    checkpoint = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    training_args = TrainingArguments(
        output_dir=args.out, use_cpu=not torch.cuda.is_available(), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=5, save_steps=10,
        max_steps=args.steps, report_to="none", disable_tqdm=True, gradient_checkpointing=True)
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True  # speed: compile checkpointed layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.compile(backend="vescale")                                   # fsdp_pass: compile in place

    tokens = torch.randint(0, 256, (4096, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train(resume_from_checkpoint=checkpoint)                   # checkpoints hold whole tensors
    trainer.save_model(os.path.join(args.out, "model"))                # every rank; LlamaForCausalLM.from_pretrained


if __name__ == "__main__":
    main()
