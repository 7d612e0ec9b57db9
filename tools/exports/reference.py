"""transformers' own logits for a 7-token prompt (run inside the side venv that saved HF_DIR).

python reference.py HF_DIR -> HF_DIR/reference.npz: input_ids [1, 7] and logits [1, 7, vocab]
(float32, no cache), what generate.py compares each producer's file against. The prompt is
longer than the families' 4-token sliding window. decode_ids [1, 10] and decode_logits
[1, 10, vocab]: the prompt and 3 more tokens in one call (no cache), what each of 3 decode steps
after the prompt must give (generate.py feeds each file its own presents back).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

PROMPT = [[1, 72, 101, 108, 108, 111, 33]]  # <s> "Hello!"
DECODE = [[32, 72, 105]]  # " Hi", one token per decode step


def main(hf_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    full = torch.tensor([PROMPT[0] + DECODE[0]])
    with torch.no_grad():
        decode = model(input_ids=full, attention_mask=torch.ones_like(full), use_cache=False).logits
    np.savez(
        f"{hf_dir}/reference.npz",
        input_ids=ids.numpy(),
        logits=logits.float().numpy(),
        decode_ids=full.numpy(),
        decode_logits=decode.float().numpy(),
    )


if __name__ == "__main__":
    main(sys.argv[1])
