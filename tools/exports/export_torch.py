"""torch.onnx.export of one tiny model (run inside a side venv with torch + transformers).

python export_torch.py HF_DIR OUT_DIR --exporter dynamo|torchscript [--opset N] [--no-optimize]
    [--dtype float16] [--cache full|config] [--attn eager]

The wrapper is docs/exporting.md section 1: inputs input_ids, attention_mask [batch, past+seq],
position_ids, past_key_values.{i}.key|value [batch, kv_heads, past, head]; outputs logits,
present.{i}.key|value; dynamic batch, seq and past. Float32 (or --dtype float16), weights inline.
Each cache tensor's heads and head size are what the model's own cache holds (one forward over
an empty cache: MLA's key and value head sizes differ). ``--cache full`` (the default, what
docs/exporting.md tells users) builds ``DynamicCache()``: every layer keeps its whole past;
``--cache config`` builds ``DynamicCache(config=...)`` as transformers 5.x does by itself: a
sliding-window layer keeps only its last ``window - 1`` tokens (the rolling window cache).
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache


def presents_of(cache) -> list:
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for kv in cache.to_legacy_cache() for t in kv]


class Decoder(torch.nn.Module):
    def __init__(self, model, layers: int, cache: str = "full"):
        super().__init__()
        self.model = model
        self.layers = layers
        self.cache = cache

    def new_cache(self):
        if self.cache == "config":  # transformers 5.x's own: window layers crop to window - 1
            return DynamicCache(config=self.model.config)
        return DynamicCache()  # full-length caches (a config-built cache crops window layers)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = self.new_cache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        return (out.logits, *presents_of(out.past_key_values))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--exporter", choices=["dynamo", "torchscript"], required=True)
    ap.add_argument("--opset", type=int, default=None)
    ap.add_argument("--no-optimize", action="store_true")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--cache", choices=["full", "config"], default="full")
    ap.add_argument("--past", type=int, default=5, help="the example past length the export traces")
    ap.add_argument("--attn", default=None, help="attn_implementation to load the model with (eager)")
    a = ap.parse_args()

    config = AutoConfig.from_pretrained(a.hf_dir)
    dtype = getattr(torch, a.dtype)
    # transformers 5's MoE experts default to a grouped_mm custom op that torch.onnx has no function
    # for ("No ONNX function found for transformers.grouped_mm_fallback"), and their eager loop over
    # the experts hit is data-dependent (torch.export: "for expert_idx in expert_hit"): batched_mm
    # (each token's experts' weights gathered, one batched matmul) exports
    extra = {} if transformers.__version__.startswith("4.") else {"experts_implementation": "batched_mm"}
    if a.attn:  # transformers' own attention code (eager: GPT-J casts q and k to float32)
        extra["attn_implementation"] = a.attn
    model = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=dtype, **extra).eval()
    layers = config.num_hidden_layers
    decoder = Decoder(model, layers, a.cache)
    with torch.no_grad():  # each cache tensor's [kv_heads, head size], as the model's cache holds it
        one = torch.ones(1, 1, dtype=torch.int64)
        probe = model(input_ids=one, attention_mask=one, past_key_values=decoder.new_cache(), use_cache=True)
        dims = [(t.shape[1], t.shape[3]) for t in presents_of(probe.past_key_values)]

    batch, seq, past_len = 2, 3, a.past
    names = [f"{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    torch.manual_seed(1)
    args = (
        torch.randint(3, config.vocab_size, (batch, seq)),
        torch.ones(batch, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq).expand(batch, seq),
        *(torch.randn(batch, heads, past_len, head, dtype=dtype) for heads, head in dims),
    )
    input_names = ["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{n}" for n in names)]
    output_names = ["logits", *(f"present.{n}" for n in names)]
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs: dict = {"input_names": input_names, "output_names": output_names}
    if a.opset is not None:
        kwargs["opset_version"] = a.opset
    if a.exporter == "dynamo":
        kwargs.update(
            dynamo=True,
            optimize=not a.no_optimize,
            external_data=False,
            dynamic_shapes=(
                {0: "batch", 1: "seq"},
                {0: "batch", 1: "total"},
                {0: "batch", 1: "seq"},
                tuple({0: "batch", 2: "past"} for _ in names),  # the *past varargs, one entry
            ),
        )
    else:
        if transformers.__version__.startswith("4."):
            # transformers 4.57 builds the mask with torch.vmap, which TorchScript cannot trace
            # ("RuntimeError: unordered_map::at"); register optimum's broadcast version, as
            # optimum-cli does for its own TorchScript export.
            from optimum.exporters.onnx.model_patcher import sdpa_mask_without_vmap
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

            ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", sdpa_mask_without_vmap)
        axes = {
            "input_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "seq"},
            "logits": {0: "batch", 1: "seq"},
        }
        axes.update({f"past_key_values.{n}": {0: "batch", 2: "past"} for n in names})
        axes.update({f"present.{n}": {0: "batch", 2: "total"} for n in names})
        kwargs.update(dynamo=False, dynamic_axes=axes)
    with torch.no_grad():
        torch.onnx.export(decoder, args, str(out / "model.onnx"), **kwargs)


if __name__ == "__main__":
    main()
