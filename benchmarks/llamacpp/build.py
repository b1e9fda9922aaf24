"""llama.cpp's tree, its build, and the GGUF of a shape.

The tree is the one llama-cpp-python 0.3.36 vendors (the sdist on PyPI, fetched with pip as a
user's machine would), or a tarball made from it by `make_src` (trimmed to what the CPU/CUDA
builds and the converter need: ~5 MB xz, small enough to carry to a machine with no internet).
Only `llama-bench` and `llama-quantize` are built: Release, native CPU code, no curl/openssl,
server, examples or tests; `-DGGML_CUDA=ON` for sm_90 on the GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
# Not needed to build llama-bench / llama-quantize or to convert: docs, test data, vocab
# fixtures, the web UI and the backends of other hardware (Metal, Vulkan, SYCL, ...).
TRIM = ("models", "docs", "media", "benches", "tests", ".github", "tools/ui",
        *(f"ggml/src/ggml-{b}" for b in ("et", "metal", "hexagon", "sycl", "vulkan", "opencl",
                                          "cann", "webgpu", "zdnn", "openvino")))
TARGETS = ("llama-bench", "llama-quantize")


# /proc/cpuinfo flag -> the ggml option that enables it (a non-native CPU build names them)
ISA_OPTIONS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2",
               "avx512f": "AVX512", "avx512_bf16": "AVX512_BF16", "avx512vbmi": "AVX512_VBMI",
               "avx512_vnni": "AVX512_VNNI", "avx_vnni": "AVX_VNNI"}


def isa_args(cpu_flags: set[str]) -> list[str]:
    """A CPU build for this machine's vector ISA without AMX: GGML_NATIVE=OFF and each ggml
    ISA option the CPU has. (llama.cpp 0.3.36's native build crashed in
    ggml_backend_amx_mul_mat on an AMX Xeon: `--no-amx` in the side-by-side takes this.)"""
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{opt}={'ON' if flag in cpu_flags else 'OFF'}"
                                   for flag, opt in ISA_OPTIONS.items())]


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(device: str) -> list[str]:
    """Configure flags for a CPU-only or a CUDA (H200, sm_90) build; env
    `MLXR_LLAMACPP_NO_AMX=1`: the CPU build without AMX (`isa_args`)."""
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
    if device == "cuda":
        return [*args, "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_NCCL=OFF"]
    if os.environ.get("MLXR_LLAMACPP_NO_AMX") == "1":
        args = [a for a in args if a != "-DGGML_NATIVE=ON"] + isa_args(cpu_flags())
    return [*args, "-DGGML_CUDA=OFF"]


def fetch_sdist(cache: Path) -> Path:
    """The llama-cpp-python sdist in `cache`, downloaded by pip unless already there."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", SDIST, "-d", str(cache)], check=True)
        found = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit(f"error: pip download {SDIST} left no sdist in {cache}")
    return found[-1]


def tree_root(names: list[str]) -> str:
    """The archive folder holding llama.cpp's CMakeLists.txt (sdist: its vendor/llama.cpp)."""
    roots = [n.removesuffix("/CMakeLists.txt") for n in names
             if n.endswith("llama.cpp/CMakeLists.txt")]
    if not roots:
        raise SystemExit("error: no llama.cpp/CMakeLists.txt in the source archive")
    return min(roots, key=len)


def extract_tree(archive: Path, work: Path) -> Path:
    """work/llama.cpp from an sdist or a make_src tarball (kept if already there)."""
    tree = work / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    with tarfile.open(archive) as tar:
        root = tree_root(tar.getnames())
        members = []
        for m in tar.getmembers():
            if m.name == root or m.name.startswith(root + "/"):
                m.name = "llama.cpp" + m.name[len(root):]
                members.append(m)
        tar.extractall(work, members=members, filter="data")
    return tree


def source_tree(work: Path, src: Path | None) -> Path:
    """The tree to build: `src` (a llama.cpp folder, an sdist or a make_src tarball), else
    the sdist fetched into work/cache."""
    if src is not None and src.is_dir():
        return src
    return extract_tree(src or fetch_sdist(work / "cache"), work)


def trimmed(name: str) -> bool:
    """Whether make_src leaves this tree path (relative to llama.cpp/) out."""
    return any(name == t or name.startswith(t + "/") for t in TRIM)


def make_src(out: Path, work: Path, src: Path | None) -> Path:
    """llama.cpp's tree as a .tar.xz without the TRIM paths, for carrying."""
    tree = source_tree(work, src)
    out.parent.mkdir(parents=True, exist_ok=True)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = info.name.partition("/")[2]
        return None if rel and trimmed(rel) else info

    with tarfile.open(out, "w:xz") as tar:
        tar.add(tree, arcname="llama.cpp", filter=keep)
    return out


def bin_dir(work: Path, device: str) -> Path:
    return work / f"build-{device}" / "bin"


def build_cmd(tree: Path, work: Path, device: str, jobs: int) -> str:
    """The configure-and-build shell command (reuses an earlier build: ninja redoes nothing
    that is up to date)."""
    b = work / f"build-{device}"
    conf = " ".join(["cmake", "-S", str(tree), "-B", str(b), "-G", "Ninja", *cmake_args(device)])
    make = f"cmake --build {b} -j {jobs} --target {' '.join(TARGETS)}"
    return f"{conf} > {work}/cmake-{device}.log 2>&1 && {make} > {work}/build-{device}.log 2>&1"


def build(tree: Path, work: Path, device: str, jobs: int) -> Path:
    """Build in the foreground; the bin folder."""
    rc = subprocess.run(["bash", "-c", build_cmd(tree, work, device, jobs)]).returncode
    if rc:
        raise SystemExit(f"error: llama.cpp build failed ({rc}): see {work}/build-{device}.log "
                         f"and {work}/cmake-{device}.log")
    return bin_dir(work, device)


def build_background(tree: Path, work: Path, device: str, jobs: int) -> None:
    """Start the build in its own session (it outlives this process); its exit status goes
    to work/build-DEVICE.rc."""
    rc = work / f"build-{device}.rc"
    rc.unlink(missing_ok=True)
    (work / f"build-{device}.started").touch()
    subprocess.Popen(["bash", "-c", f"{build_cmd(tree, work, device, jobs)}; echo $? > {rc}"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def build_status(work: Path, device: str) -> int | None:
    """A background build's exit status, None while it runs (or was never started)."""
    rc = work / f"build-{device}.rc"
    return int(rc.read_text()) if rc.is_file() and rc.read_text().strip() else None


def build_running(work: Path, device: str) -> bool:
    """A background build was started and has not written its status yet."""
    return (work / f"build-{device}.started").is_file() and build_status(work, device) is None


def wait_build(work: Path, device: str, seconds: float) -> bool:
    """Whether the binaries are there, waiting up to `seconds` for a background build."""
    deadline = time.monotonic() + seconds
    while build_running(work, device) and time.monotonic() < deadline:
        time.sleep(5)
    rc = build_status(work, device)
    if rc:
        raise SystemExit(f"error: llama.cpp build failed ({rc}): see {work}/build-{device}.log")
    return all((bin_dir(work, device) / t).is_file() for t in TARGETS)


def convert(tree: Path, hf_dir: Path, out: Path, flags: tuple[str, ...] = ()) -> Path:
    """GGUF f16 of an HF checkpoint by the tree's own converter (its gguf-py on the path)."""
    part = out.with_name(out.name + ".part")
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
    r = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir),
                        "--outtype", "f16", "--outfile", str(part), *flags],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"error: convert_hf_to_gguf.py {hf_dir} failed:\n{r.stderr[-3000:]}")
    part.rename(out)
    return out


def quantize(bins: Path, f16: Path, out: Path, quant: tuple[str, ...], threads: int) -> Path:
    """llama-quantize f16 -> `quant` (its overrides, then the type)."""
    part = out.with_name(out.name + ".part")
    *flags, qtype = quant
    r = subprocess.run([str(bins / "llama-quantize"), *flags, str(f16), str(part), qtype,
                        str(threads)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"error: llama-quantize {f16} failed:\n{r.stderr[-3000:]}")
    part.rename(out)
    return out
