"""The side-by-side command, for the CPU (`benchmarks/cpu/llamacpp_side_by_side.py`) and the
GPU (`benchmarks/gpu/llamacpp_side_by_side.py`).

Steps: `all` (build, checkpoints, GGUFs, benches, in one call), or split for machines whose
calls are time-limited: `prep` (the build started in the background; checkpoints written and
converted meanwhile; quantized once the build is there) and `run` (what `prep` left to
quantize, then the benches). Every artefact lives under --work and is reused when present:
work/llama.cpp (the tree), work/build-DEVICE, work/cache (the sdist), work/models (per shape:
KEY-mlx/ for mlxr, KEY-TYPE.gguf for llama.cpp; the HF bf16 folder and the f16 GGUF are
deleted once used).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import build, compare, hf_checkpoint, shapes

DEFAULT_SHAPES = {
    "cpu": "qwen3-0.6b",
    # Qwen3-30B-A3B cut to 12 of 48 layers: its HF bf16 (16 GB) and f16 GGUF (16 GB) are
    # written within one 10-minute call beside the build, and fit the 64 GB disk with the
    # other shapes' files; gpt-oss's HF file keeps its experts in mxfp4 (13 GB): it runs whole.
    # The dense shapes' GPU figures are in ../shared/docs/perf-anchors.md already.
    "cuda": "qwen3-30b-a3b:12,gpt-oss-20b,qwen3.5-0.8b,qwen3.5-2b,gemma-4-e2b",
}


@dataclass(frozen=True)
class Job:
    """One shape at one layer count (None: whole), and where its files go."""

    name: str
    layers: int | None

    @property
    def key(self) -> str:
        return self.name if self.layers is None else f"{self.name}-{self.layers}l"

    def mlx(self, work: Path) -> Path:
        return work / "models" / f"{self.key}-mlx"

    def gguf(self, work: Path) -> Path:
        qtype = shapes.SHAPES[self.name].quant[-1].lower()
        return work / "models" / f"{self.key}-{qtype}.gguf"

    def f16(self, work: Path) -> Path:
        return work / "models" / f"{self.key}-f16.gguf"


def parse_jobs(spec: str, layers: int | None) -> list[Job]:
    """'a,b:16' -> jobs; NAME:N cuts that shape to N layers, --layers cuts the others."""
    jobs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, n = item.partition(":")
        if name not in shapes.SHAPES:
            raise SystemExit(f"error: unknown shape {name!r} (known: {', '.join(shapes.SHAPES)})")
        cut = int(n) if n else layers
        if cut is not None and not 1 <= cut <= shapes.full_layers(name):
            raise SystemExit(f"error: {name}: layers must be 1..{shapes.full_layers(name)}")
        jobs.append(Job(name, None if cut == shapes.full_layers(name) else cut))
    return jobs


def parse_threads(spec: str) -> list[int]:
    threads = [int(t) for t in spec.split(",") if t.strip()]
    if not threads or min(threads) < 1:
        raise SystemExit("error: --threads wants positive counts, e.g. 2,1")
    return threads


def parser(device: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog=(
        f"python benchmarks/{'gpu' if device == 'cuda' else 'cpu'}/llamacpp_side_by_side.py"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("step", nargs="?", default="all", choices=["all", "prep", "run"])
    p.add_argument("--work", type=Path, required=True, help="folder of every artefact")
    p.add_argument("--src", type=Path, help="llama.cpp tree: a folder, the llama-cpp-python "
                   "sdist or a --make-src tarball (default: the sdist, fetched by pip)")
    p.add_argument("--make-src", type=Path, metavar="OUT.tar.xz",
                   help="only write the trimmed source tarball (to carry) and exit")
    p.add_argument("--shapes", default=DEFAULT_SHAPES[device],
                   help=f"comma list of NAME[:LAYERS] of {', '.join(shapes.SHAPES)}")
    p.add_argument("--layers", type=int, help="cut every shape without its own :LAYERS")
    p.add_argument("--threads", default="2,1" if device == "cpu" else "",
                   help="CPU threads, each count a run of both sides (CPU only)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two sides")
    p.add_argument("--repeats", type=int, default=3, help="repeats inside one bench call")
    p.add_argument("-p", "--prompt", type=int, default=512)
    p.add_argument("-n", "--gen", type=int, default=128)
    p.add_argument("--tokenizers", type=Path, default=compare.REPO / "tests/assets/tokenizers",
                   help="folder of the tokenizer folders the shapes name")
    p.add_argument("--no-amx", action="store_true",
                   help="CPU: build llama.cpp for this CPU's vector ISA without AMX (its AMX "
                        "path crashed on an AMX Xeon); delete WORK/build-cpu to rebuild")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs")
    p.add_argument("--build-wait", type=int, default=120,
                   help="prep: seconds to wait for the background build before leaving the "
                        "quantizing to `run`")
    return p


def write_checkpoints(job: Job, work: Path, tree: Path, tokenizers: Path) -> None:
    """mlxr's MLX checkpoint and llama.cpp's f16 GGUF of the job's shape, unless present."""
    mlx = job.mlx(work)
    if not (mlx / "config.json").is_file():
        part = mlx.with_name(mlx.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        shapes.write_mlx(job.name, job.layers, part)
        part.rename(mlx)
        print(f"wrote {mlx}", flush=True)
    if job.gguf(work).is_file() or job.f16(work).is_file():
        return
    hf = work / "models" / f"{job.key}-hf"
    shutil.rmtree(hf, ignore_errors=True)
    cfg = shapes.hf_config(job.name, job.layers)
    hf_checkpoint.write_hf(cfg, hf)
    shape = shapes.SHAPES[job.name]
    hf_checkpoint.copy_tokenizer(tokenizers / shape.tokenizer, hf,
                                 cfg["vocab_size"] if shape.pad_vocab else None)
    build.convert(tree, hf, job.f16(work), shape.convert_flags)
    shutil.rmtree(hf)
    print(f"wrote {job.f16(work)}", flush=True)


def quantize_ready(jobs: list[Job], work: Path, bins: Path) -> None:
    for job in jobs:
        if not job.gguf(work).is_file() and job.f16(work).is_file():
            build.quantize(bins, job.f16(work), job.gguf(work), shapes.SHAPES[job.name].quant,
                           os.cpu_count() or 1)
            job.f16(work).unlink()
            print(f"wrote {job.gguf(work)}", flush=True)


def main(device: str, argv: list[str] | None = None) -> None:
    a = parser(device).parse_args(argv)
    if a.no_amx:
        os.environ["MLXR_LLAMACPP_NO_AMX"] = "1"  # read by build.cmake_args
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.make_src:
        print(build.make_src(a.make_src.resolve(), work, a.src))
        return
    jobs = parse_jobs(a.shapes, a.layers)
    threads: list[int | None] = parse_threads(a.threads) if device == "cpu" else [None]
    # `run` needs no tree (no build, no converting): nothing fetched on an offline machine
    tree = build.source_tree(work, a.src) if a.step != "run" else work / "llama.cpp"
    bins = build.bin_dir(work, device)
    if a.step == "all" and not build.build_running(work, device):
        build.build(tree, work, device, a.jobs)
    elif a.step == "prep" and not build.build_running(work, device):
        build.build_background(tree, work, device, a.jobs)
    if a.step in ("all", "prep"):
        for job in jobs:
            write_checkpoints(job, work, tree, a.tokenizers)
            if not build.build_running(work, device) and build.wait_build(work, device, 0):
                quantize_ready([job], work, bins)  # the f16 GGUF off the disk before the next
    if not build.wait_build(work, device, a.build_wait if a.step == "prep" else 3600):
        print(f"build still running: `run` quantizes ({work}/build-{device}.log)")
        return
    quantize_ready(jobs, work, bins)
    if a.step == "prep":
        return
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"box before: {uptime}", flush=True)
    runs = []
    for job in jobs:
        if not job.gguf(work).is_file():
            raise SystemExit(f"error: {job.gguf(work)} missing: run `prep` (or `all`) first")
        runs += compare.alternate(job.key, job.gguf(work), job.mlx(work), bins, device, threads,
                                  a.rounds, a.repeats, a.prompt, a.gen)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"box after: {uptime}\n\n" + compare.format_table(runs, a.prompt, a.gen))
