"""Does onnxruntime-genai compute the same with ``past_present_share_buffer`` true?

    python benchmarks/genai_share_buffer_check.py REFERENCE FOLDER [FOLDER ...] [--prompt 300] [--steps 8]

Runs, in one process per folder, the same three cases and compares every folder's logits with
REFERENCE's (the first folder, e.g. the converted folder as ``convert`` writes it, share buffer
false):

1. batch 1: a ``--prompt``-token prompt (the held-out docstrings of real_model.py), then
   ``--steps`` greedy tokens; the logits after the prompt and after every step;
2. batch 2: two prompts of different lengths (``--prompt`` and ``--prompt // 2 + 7`` tokens),
   padded by genai's tokenizer (``encode_batch``), greedy; the logits of both rows per step;
3. beam search, ``num_beams=2``: the returned sequence and the logits of both beams per step.

Prints per case the largest |logit difference| against REFERENCE per step (as a share of the
reference row's logit range) and whether the tokens are equal. A case genai refuses prints its
error. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import numpy as np

CHILD = "--child"
HERE = pathlib.Path(__file__).parent


def child(folder: str, prompt: int, steps: int, out: str) -> None:
    import onnxruntime_genai as og

    sys.path.insert(0, str(HERE))
    import real_model

    model = og.Model(folder)
    tok = og.Tokenizer(model)
    text = real_model.module_text(real_model.HELD_OUT_MODULES)
    ids = np.asarray(tok.encode(text), np.int32)
    results: dict[str, object] = {}

    def generate(name: str, rows: list[np.ndarray], **options) -> None:
        try:
            params = og.GeneratorParams(model)
            longest = max(len(r) for r in rows)
            params.set_search_options(
                max_length=longest + steps + 1, do_sample=False, batch_size=len(rows), **options
            )
            gen = og.Generator(model, params)
            if len(rows) == 1:
                gen.append_tokens(rows[0])
            else:
                pad = model_pad(folder)
                batch = np.full((len(rows), longest), pad, np.int32)
                for i, r in enumerate(rows):  # left padding, as genai's tokenizer pads
                    batch[i, longest - len(r) :] = r
                gen.append_tokens(batch)
            logits = [
                np.asarray(gen.get_logits(), np.float32).reshape(-1, np.asarray(gen.get_logits()).shape[-1])
            ]
            for _ in range(steps):
                gen.generate_next_token()
                if gen.is_done():
                    break
                logits.append(np.asarray(gen.get_logits(), np.float32).reshape(logits[0].shape))
            n_seq = len(rows) * options.get("num_return_sequences", 1)
            seqs = (
                [list(map(int, gen.get_sequence(i))) for i in range(n_seq)]
                if options.get("num_beams", 1) == 1
                else [list(map(int, gen.get_sequence(0)))]
            )
            np.save(f"{out}-{name}.npy", np.stack(logits))
            results[name] = {"sequences": seqs}
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}

    generate("batch1", [ids[:prompt]])
    generate("batch2", [ids[:prompt], ids[1000 : 1000 + prompt // 2 + 7]])
    generate("beam2", [ids[:prompt]], num_beams=2)
    print(json.dumps(results))


def model_pad(folder: str) -> int:
    return json.loads((pathlib.Path(folder) / "genai_config.json").read_text())["model"]["pad_token_id"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="+")
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/share-buffer-check"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, folder in enumerate(args.folders):
        out = str(args.work / f"f{i}")
        proc = subprocess.run(
            [sys.executable, __file__, CHILD, folder, str(args.prompt), str(args.steps), out],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            print(f"{folder}: failed: {proc.stderr.strip()[-600:]}")
            runs.append(None)
            continue
        runs.append((out, json.loads(proc.stdout.strip().splitlines()[-1])))
    ref = runs[0]
    for folder, run in zip(args.folders, runs):
        if run is None or ref is None:
            continue
        print(f"\n{folder}")
        for case in ("batch1", "batch2", "beam2"):
            r, r0 = run[1][case], ref[1][case]
            if "error" in r or "error" in r0:
                print(f"  {case}: {r.get('error') or 'reference: ' + r0['error']}")
                continue
            a, b = np.load(f"{run[0]}-{case}.npy"), np.load(f"{ref[0]}-{case}.npy")
            n = min(len(a), len(b))
            span = b[:n].max(-1) - b[:n].min(-1)
            rel = (np.abs(a[:n] - b[:n]).max(-1) / span).max(-1)
            print(
                f"  {case}: max |dlogit| / logit range per step: "
                + " ".join(f"{x:.1e}" for x in rel)
                + f"; sequences equal: {r['sequences'] == r0['sequences']}"
            )


if __name__ == "__main__":
    main()
