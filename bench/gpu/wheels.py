"""The wheels the serving benchmarks need on the lent CUDA machine (no package index there): Ray Serve,
the web stack, MLX with its CUDA 13 backend, mlx-lm, and what they pull in, for CPython 3.12 on
manylinux x86_64, at the versions this venv runs (its `pip freeze` is the constraint), less what that
machine's image already has (PyTorch's stack: numpy, transformers, tokenizers, ...; its grpcio,
which grpcio-reflection must match). One tar, split into parts that fit a device call's 64 MiB
beside the working tree: bench/gpu/run.sh carries `.gpu/wpart.N` over back-to-back calls into one
folder there, installs them and runs a benchmark (its opening comment says how).

    python -m bench.gpu.wheels [--out .gpu] [--part-mib 58] [--engine-only]

`--engine-only`: just what bench.engine.* needs (mlx, mlx-cuda-13, mlx-lm, pydantic, llguidance)."""

import argparse
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]  # its glibc is 2.39
SERVING = ["ray[serve]", "fastapi", "uvicorn[standard]", "python-multipart", "aiohttp", "py-spy", "psutil"]
ENGINE = ["mlx", "mlx-cuda-13", "mlx-lm", "pydantic", "llguidance"]
# On the machine's image already (shared/gpu/README.md, the device tool's KINDS.md): carrying them
# would shadow its own builds for nothing, and grpcio must stay the image's (1.84.0).
PRESENT = {
    "numpy", "torch", "transformers", "tokenizers", "huggingface-hub", "safetensors", "sentencepiece", "jinja2", "markupsafe",
    "filelock", "fsspec", "packaging", "pyyaml", "requests", "urllib3", "certifi", "idna", "charset-normalizer", "tqdm", "regex",
    "grpcio", "protobuf", "networkx", "sympy", "mpmath", "setuptools", "triton", "hf-xet", "pillow",
    "grpcio-reflection",  # ... carried, but at the image's grpcio version (EXTRA)
}  # fmt: skip
EXTRA = ["grpcio-reflection==1.84.0"]  # Serve's gRPC side, matched to the image's grpcio
# The peers of bench.peers: vllm-mlx 0.6.0 in a site folder of its own with the mlx-lm it needs
# (`--vllm-mlx-site`), on top of the carried packages plus mlx-vlm, which it imports.
PEERS = ["vllm-mlx==0.6.0", "mlx-lm==0.31.3"]
PEERS_SHARED = ["mlx-vlm==0.7.10", "tabulate"]


def _name(wheel: Path) -> str:
    return _norm(wheel.name.split("-")[0])


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(wanted: list[str]) -> dict[str, str]:
    """{name: version} of the wanted distributions and everything they require, as installed in this
    venv (requirement markers read for CPython 3.12 on Linux), less what the machine has."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux"}
    found: dict[str, str] = {}
    todo = [Requirement(w) for w in wanted]
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in PRESENT or name in found:
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            if name == "mlx-cuda-13":  # this machine runs mlx[cpu]: the CUDA backend is pinned to mlx's version
                found[name] = distribution("mlx").version
                continue
            raise
        found[name] = dist.version
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate(env | {"extra": e}) for e in (req.extras or {""})):
                todo.append(dep)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu")
    ap.add_argument("--part-mib", type=int, default=58)  # + the working tree (~3 MiB) < a call's 64 MiB
    ap.add_argument("--engine-only", action="store_true")
    a = ap.parse_args(argv)
    wheels = a.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pins = closure(ENGINE + ([] if a.engine_only else SERVING))
    pins.pop("mlx-cpu", None)
    wanted = [f"{name}=={version}" for name, version in sorted(pins.items())] + ([] if a.engine_only else EXTRA + PEERS_SHARED)
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels)]
    for requirement in wanted:  # binary for the machine where one exists, else a pure-Python wheel
        subprocess.run([*cmd, "--only-binary=:all:", *platform_args, requirement], check=True)
    kept = sorted(wheels.glob("*.whl"))
    if not a.engine_only:  # loose, beside the parts: bench.peers' --vllm-mlx-site is made of these
        peers = a.out / "peers"
        shutil.rmtree(peers, ignore_errors=True)
        subprocess.run([*cmd[:-1], str(peers), *PEERS], check=True)
    tar_path = a.out / "wheels.tar"
    with tarfile.open(tar_path, "w") as tar:
        for wheel in kept:
            tar.add(wheel, arcname=wheel.name)
    for old in a.out.glob("wpart.*"):
        old.unlink()
    size, part = a.part_mib * 2**20, 0
    with tar_path.open("rb") as f:
        while chunk := f.read(size):
            (a.out / f"wpart.{part}").write_bytes(chunk)
            part += 1
    tar_path.unlink()
    total = sum(w.stat().st_size for w in kept)
    print(f"{len(kept)} wheels, {total / 2**20:.0f} MiB, in {part} parts of <= {a.part_mib} MiB under {a.out}:")
    for wheel in kept:
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
