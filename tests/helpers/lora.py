"""Random LoRA adapters that PEFT builds and saves for a tiny HF model: the reference adapters
are checked against."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = [list(range(5, 5 + n)) for n in (19, 26, 33)]
TOKENS = 12
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def peft_adapter(base: Path, folder: Path, targets: list[str], seed: int, **lora_kwargs):
    """A PEFT adapter over the HF model in ``base`` with random A and B, saved to ``folder``;
    the ``PeftModel`` itself, for reference outputs."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    torch.manual_seed(seed)
    pm = peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, init_lora_weights=False,
                                                    **lora_kwargs))
    pm.save_pretrained(folder)
    return pm.eval()
