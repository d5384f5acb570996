"""Train a tiny Hugging Face Llama with Lightning's ModelParallelStrategy, fully sharded by fsdp_pass.

    torchrun --standalone --nproc-per-node 2 examples/integrations/lightning_train.py

Lightning's own Trainer (gradient clipping, accumulation, distributed and full checkpoints); the
lines marked "fsdp_pass" are all it takes. See docs/integrations.md.
"""

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import fsdp_pass
from fsdp_pass.integrations.lightning import ModelParallelStrategy   # fsdp_pass: loads its checkpoints too


class LitLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        fsdp_pass.fully_shard(self.model, mesh)                                # fsdp_pass
        self.model.compile(backend="vescale", options={"mesh": mesh})          # fsdp_pass

    def training_step(self, tokens, index):
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="lightning_out")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    data = torch.randint(0, 256, (args.steps * 2 * world, 4, 32), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu" if not torch.cuda.is_available() else "gpu", devices=world,
                        max_steps=args.steps, strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_checkpointing=False)
    trainer.fit(LitLlama(), DataLoader(list(data), batch_size=None))
    trainer.save_checkpoint(os.path.join(args.out, "sharded"))                 # DCP: resume at any world size


if __name__ == "__main__":
    main()
