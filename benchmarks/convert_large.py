"""Convert a 70B-shaped decoder (weights in a sparse file): beside it, and into another folder.

80 layers, hidden 8192, 64 heads, 8 KV heads, head size 128, SwiGLU 28672, fp16: 131 GiB
of weights that cost no disk (a sparse file). Targets on a 2-core machine for the whole
CLI run beside the input: under 1.5 s, peak RSS under 300 MiB, zero weight bytes written.
Into another folder the data file is cloned where the filesystem can, else copied with
its holes kept: the bytes it occupies are reported. A 2-layer model with real (random)
weights is also converted into another folder (a real copy) and the naive way (load
everything, convert, save) for comparison.

The export case: the same shape as optimum-cli exports it (the TorchScript form of
``tests/builders/torchscript.py``: decomposed attention, no value_info) in an export folder with
Llama 3 70B's ``config.json`` and ``generation_config.json``, fused and converted beside the
input and into an onnxruntime-genai folder. Targets for each whole CLI run: under 3 s, peak
RSS under 500 MB, no weight byte read (the bytes the process reads in all, Python's modules
included, are reported from ``/proc/self/io``).

    python benchmarks/convert_large.py [--layers 80] [--dir FOLDER] [--case genai|export|small]

``--dir`` runs in FOLDER (e.g. on btrfs or XFS, which clone) instead of a temporary
folder of the default temporary directory; ``--case`` runs one case (default: all).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx_ir as ir

from onnx_kvcache.model_io._atomic import allocated_bytes, format_bytes
from onnx_kvcache.models.decoder import DecoderConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/builders
from builders.exported import build_decoder, exported_config

LLAMA_70B = DecoderConfig(
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    kv_num_heads=8,
    head_size=128,
    intermediate_size=28672,
    vocab_size=128256,
    max_position=8192,
    dtype="float16",
)


def write_sparse_model(folder: pathlib.Path, config: DecoderConfig) -> tuple[pathlib.Path, int]:
    """The decoder graph, every weight an external tensor of one sparse data file."""
    offset = 0

    def factory(name: str, shape: tuple[int, ...], dtype: ir.DataType) -> ir.TensorProtocol:
        nonlocal offset
        length = int(np.prod(shape) * dtype.itemsize)
        tensor = ir.ExternalTensor(
            "model.onnx.data", offset, length, dtype, shape=ir.Shape(shape), name=name, base_dir=folder
        )
        offset += length
        return tensor

    model = build_decoder(config, weight_factory=factory)
    with open(folder / "model.onnx.data", "wb") as f:
        f.truncate(offset)
    path = folder / "model.onnx"
    path.write_bytes(ir.to_proto(model).SerializeToString())
    return path, offset


@dataclasses.dataclass(frozen=True)
class Run:
    wall: float
    """Seconds, launch to exit."""
    cpu: float
    """User + system CPU seconds of the command's process."""
    rss: float
    """Its own peak RSS in MiB (GNU time's: ``wait4`` here would report at least this
    process's, which a forked child starts from)."""
    code: int
    stdout: str
    stderr: str


_TIME = shutil.which("time", path="/usr/bin:/bin")


def run_process(command: list[str]) -> Run:
    """Run ``command`` as its own process: times, peak RSS, exit code and output."""
    with tempfile.NamedTemporaryFile("r") as report:
        timed = [_TIME, "-q", "-f", "%U %S %M", "-o", report.name, *command] if _TIME else command
        start = time.perf_counter()
        proc = subprocess.Popen(timed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate()
        wall = time.perf_counter() - start
        if _TIME:
            user, system, kib = report.read().split()[-3:]
            cpu, rss = float(user) + float(system), int(kib) / 1024
        else:  # no GNU time here: no figure rather than a wrong one
            cpu, rss = float("nan"), float("nan")
    return Run(wall, cpu, rss, proc.returncode, out, err)


#: The command as ``python -m onnx_kvcache`` runs it, saying at exit (on stderr) how many bytes
#: the process read in all (``rchar`` of ``/proc/self/io``: files, pipes, its own modules).
_READS = (
    "import atexit, os, sys\n"
    "def said():\n"
    "    if os.path.exists('/proc/self/io'):\n"
    "        sys.stderr.write('bytes read: ' + open('/proc/self/io').read().split()[1] + '\\n')\n"
    "atexit.register(said)\n"
    "sys.argv[0] = 'onnx-kvcache'\n"
    "from onnx_kvcache.cli._entry import main\n"
    "main()\n"
)


def run_cli(args: list[str]) -> tuple[float, float, str]:
    """Wall seconds, the command's own peak RSS in MiB, stdout (with its CPU seconds)."""
    run = run_process([sys.executable, "-m", "onnx_kvcache", *args])
    if run.code:
        raise SystemExit(f"onnx-kvcache {' '.join(args)} failed: {run.stderr}")
    return run.wall, run.rss, f"cpu: {run.cpu:.2f} s\n{run.stdout}"


def run_cli_reads(args: list[str]) -> tuple[Run, int | None]:
    """The command's run and the bytes its process read in all (None where unknown)."""
    run = run_process([sys.executable, "-c", _READS, *args])
    if run.code:
        raise SystemExit(f"onnx-kvcache {' '.join(args)} failed: {run.stderr}")
    said = [line for line in run.stderr.splitlines() if line.startswith("bytes read: ")]
    return run, int(said[-1].split()[-1]) if said else None


def cpu_line(stdout: str) -> str:
    return stdout.splitlines()[0].removeprefix("cpu: ") + " CPU"


def naive_convert(src: pathlib.Path, dst: pathlib.Path) -> float:
    import onnx

    from onnx_kvcache import Fp8KvCachePass

    start = time.perf_counter()
    proto = onnx.load(src, load_external_data=True)
    model = ir.from_proto(proto)
    Fp8KvCachePass({i: (1.0, 1.0) for i in range(2)})(model)
    ir.save(model, dst, external_data="naive.onnx.data")
    return time.perf_counter() - start


def weights_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("weights:"))


#: Llama 3 70B's ``config.json`` and ``generation_config.json``, as the export folder holds them.
LLAMA_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "max_position_embeddings": 8192,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "torch_dtype": "float16",
    "vocab_size": 128256,
}
LLAMA_70B_GENERATION = {
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
}


def export_case(base: pathlib.Path | None, layers: int, scales: list[float]) -> None:
    """An optimum-cli export folder of the 70B shape: fused and converted beside the input, and
    into an onnxruntime-genai folder."""
    shape = {k: v for k, v in LLAMA_70B.__dict__.items() if k not in ("num_layers", "exported")}
    config = exported_config("optimum-llama", **{**shape, "num_layers": layers})
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        folder = pathlib.Path(tmp) / "export"
        folder.mkdir()
        src, weight_bytes = write_sparse_model(folder, config)
        data = folder / "model.onnx.data"
        (folder / "config.json").write_text(json.dumps({**LLAMA_70B_CONFIG, "num_hidden_layers": layers}))
        (folder / "generation_config.json").write_text(json.dumps(LLAMA_70B_GENERATION))
        scale_file = pathlib.Path(tmp) / "scales.json"
        scale_file.write_text(json.dumps({"scales": {"k_scales": scales, "v_scales": scales}}))
        data_mtime = data.stat().st_mtime_ns
        print(
            f"{layers}-layer 70B-shaped export (optimum-cli's TorchScript form: decomposed attention, "
            f"no value_info), {format_bytes(weight_bytes)} of fp16 weights (sparse):"
        )
        fp8 = ["--format", "fp8", "--scales", str(scale_file)]
        beside = ["convert", str(src), str(folder / "model.fp8.onnx")]
        genai = ["convert", str(folder), str(pathlib.Path(tmp) / "genai")]
        for what, args in (
            ("the folder into an onnxruntime-genai folder", genai),  # before the folder holds two graphs
            ("fused and converted beside the input", beside),
        ):
            run, read = run_cli_reads([*args, *fp8])
            no_read = read is not None and read < weight_bytes // 100  # all it reads: modules, graph
            untouched = data.stat().st_mtime_ns == data_mtime
            said = [
                line
                for line in run.stdout.splitlines()
                if line.startswith(("weights:", "genai_config.json written"))
            ]
            print(
                f"  {what}: {run.wall:.2f} s wall ({run.cpu:.2f} s CPU), peak RSS {run.rss:.0f} MiB, "
                f"{format_bytes(read) if read is not None else 'unknown bytes'} read in all; "
                + "; ".join(said)
            )
            met = run.rss * 2**20 < 500e6 and no_read and untouched
            verdict = {True: "met", False: "MISSED"}
            load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
            print(
                f"    targets: RSS < 500 MB and no weight byte read {verdict[met]}; under 3 s: "
                f"{verdict[run.cpu < 3]} in CPU time (the wall time of an idle core), "
                f"{verdict[run.wall < 3]} in wall time ({load})"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--dir", help="run in this folder (default: a temporary folder)")
    parser.add_argument("--case", choices=("genai", "export", "small"), help="run one case (default: all)")
    args = parser.parse_args()
    config = DecoderConfig(**{**LLAMA_70B.__dict__, "num_layers": args.layers})
    base = pathlib.Path(args.dir) if args.dir else None
    fs = subprocess.run(
        ["stat", "-f", "-c", "%T", str(base or tempfile.gettempdir())], capture_output=True, text=True
    )
    print(f"folder: {base or tempfile.gettempdir()} ({fs.stdout.strip() or 'unknown filesystem'})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.case in (None, "genai"):
        genai_case(base, config, args.layers)
    if args.case in (None, "export"):
        export_case(base, args.layers, [0.01] * args.layers)
    if args.case in (None, "small"):
        small_case(base)


def genai_case(base: pathlib.Path | None, config: DecoderConfig, layers: int) -> None:
    """The 70B-shaped decoder as onnxruntime-genai's builder writes it: beside the input and
    into another folder."""
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        folder = pathlib.Path(tmp)
        (folder / "in").mkdir()
        src, weight_bytes = write_sparse_model(folder / "in", config)
        data = folder / "in" / "model.onnx.data"
        data_mtime = data.stat().st_mtime_ns
        scales = folder / "scales.json"
        ones = [0.01] * layers
        scales.write_text(json.dumps({"scales": {"k_scales": ones, "v_scales": ones}}))
        print(f"{layers}-layer 70B-shaped decoder, {format_bytes(weight_bytes)} of fp16 weights (sparse)")

        out = folder / "in" / "model.fp8.onnx"
        wall, rss, stdout = run_cli(
            ["convert", str(src), str(out), "--format", "fp8", "--scales", str(scales)]
        )
        written = out.stat().st_size
        new_files = sorted(p.name for p in (folder / "in").iterdir())
        expected = ["model.fp8.onnx", "model.onnx", "model.onnx.data"]
        untouched = data.stat().st_mtime_ns == data_mtime and new_files == expected
        print(
            f"  beside the input:    {wall:.2f} s wall ({cpu_line(stdout)}), peak RSS {rss:.0f} MiB, "
            f"{format_bytes(written)} written (the graph); {weights_line(stdout)}"
        )
        met = wall < 1.5 and rss < 300 and untouched
        print(
            f"    targets (CLI < 1.5 s, RSS < 300 MiB, no weight byte written): {'met' if met else 'MISSED'}"
        )

        other = folder / "other" / "model.fp8.onnx"
        wall, rss, stdout = run_cli(
            ["convert", str(src), str(other), "--format", "fp8", "--scales", str(scales)]
        )
        copy = other.with_name("model.fp8.onnx.data")
        assert copy.stat().st_size == weight_bytes
        print(
            f"  another folder:      {wall:.2f} s wall ({cpu_line(stdout)}), peak RSS {rss:.0f} MiB; "
            f"{weights_line(stdout)}; "
            f"the output's data file occupies {format_bytes(allocated_bytes(copy))} on disk"
        )


def small_case(base: pathlib.Path | None) -> None:
    """A 2-layer model of the same shape with real (random) weights: another folder, and the
    naive way (load everything, convert, save)."""
    small = DecoderConfig(
        **{**LLAMA_70B.__dict__, "num_layers": 2, "intermediate_size": 8192, "vocab_size": 32000}
    )
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        folder = pathlib.Path(tmp)
        rng = np.random.default_rng(0)
        model = build_decoder(
            small,
            weight_factory=lambda n, s, d: ir.tensor(
                rng.standard_normal(s, np.float32).astype(np.float16), name=n
            ),
        )
        src = folder / "model.onnx"
        ir.save(model, src, external_data="model.onnx.data")
        size = (folder / "model.onnx.data").stat().st_size
        wall, _, _ = run_cli(["convert", str(src), str(folder / "fast.onnx"), "--format", "fp8"])
        wall_other, _, stdout = run_cli(
            ["convert", str(src), str(folder / "other" / "model.onnx"), "--format", "fp8"]
        )
        naive = naive_convert(src, folder / "naive.onnx")
        print(f"2-layer model, {format_bytes(size)} of weights (random, no holes):")
        print(f"  onnx-kvcache convert, beside the input: {wall:.2f} s (CLI, including interpreter start)")
        print(f"  onnx-kvcache convert, another folder:   {wall_other:.2f} s; {weights_line(stdout)}")
        print(f"  load everything, convert, save:         {naive:.2f} s, {format_bytes(size)} rewritten")


if __name__ == "__main__":
    main()
