"""Save a tiny random-weight Hugging Face model of one family (run inside a side venv).

python make_hf.py FAMILY OUT_DIR   -> config.json, generation_config.json, model.safetensors,
tokenizer files. Seeded: the same family gets the same weights in every venv of one
transformers version.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import tiny_tokenizer
from families import COMMON, family_table


def make(family: str, out: str) -> None:
    cfg_cls, model_cls, over = family_table(family)
    kwargs = {**COMMON, **over, "initializer_range": 0.1}
    config = getattr(transformers, cfg_cls)(**kwargs)
    config.architectures = [model_cls]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval().to(torch.float32)
    with torch.no_grad():  # norms away from their init (1 or 0) so that they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out, safe_serialization=True)
    tiny_tokenizer.write(out)


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2])
