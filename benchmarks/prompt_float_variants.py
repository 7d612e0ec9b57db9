"""Write issue 43's candidate genai folders from a converted (quantized) genai folder (draft).

    python benchmarks/prompt_float_variants.py SRC OUT --variant {share,if,if-share} [--max-length N]

``share``     SRC's graph unchanged, ``search.past_present_share_buffer: true``;
``if``        :class:`PromptFloatAttentionPass` applied (multi-token calls through the float
              kernel), share buffer as SRC has it (false, as convert writes it);
``if-share``  both.

OUT gets the new graph, SRC's tokenizer files copied and SRC's weights hard-linked (0 bytes;
onnxruntime and onnxruntime-genai load hard-linked data, see docs/converting.md). ``--max-length``
sets ``search.max_length`` (genai's buffer when the buffer is shared). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil

import onnx
import onnx_ir as ir

from onnx_kvcache.passes import PromptFloatAttentionPass


def write(src: pathlib.Path, out: pathlib.Path, variant: str, max_length: int | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "genai_config.json").read_text())
    name = config["model"]["decoder"]["filename"]
    for entry in src.iterdir():
        target = out / entry.name
        if entry.name in (name, "genai_config.json") or target.exists():
            continue
        if entry.suffix == ".data":
            os.link(entry, target)
        else:
            shutil.copy2(entry, target)
    if variant in ("if", "if-share"):
        model = ir.load(src / name)
        PromptFloatAttentionPass()(model)
        onnx.save_model(ir.to_proto(model), out / name)  # external data keeps its location
    else:
        shutil.copy2(src / name, out / name)
    if variant in ("share", "if-share"):
        config["search"]["past_present_share_buffer"] = True
    if max_length is not None:
        config["search"]["max_length"] = max_length
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("src", type=pathlib.Path)
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--variant", choices=("share", "if", "if-share"), required=True)
    p.add_argument("--max-length", type=int)
    args = p.parse_args()
    write(args.src, args.out, args.variant, args.max_length)
    print(f"wrote {args.out} ({args.variant})")


if __name__ == "__main__":
    main()
