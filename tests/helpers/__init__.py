"""Helpers shared by several test modules (test modules never import each other)."""

import collections
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvcal.runtime import kernels, quantized_cache
from kvcal.build_cache import cached

# g++ flags of every build of the CUDA emulation (tests/kernel_emulation). -U_FORTIFY_SOURCE: distributions that
# fortify by default (Ubuntu) turn the fibers' _longjmp between stacks into __longjmp_chk, which aborts ("longjmp
# causes uninitialized stack frame"). -fno-gnu-unique: a test process loads several emulator libraries, and g++ gives
# static locals of templates (a kernel variant's shared-memory array) STB_GNU_UNIQUE binding, one copy per process, so
# a variant built into two libraries ran on the first library's array while the second library's shared-window record
# (intrinsics_on_cpu.h) held its own arrays' upper address bits: where the two libraries lay in different 4 GiB
# regions of the address space, the emulated shared_address aborted ("shared memory straddles a 4 GiB boundary").
EMULATION_FLAGS = ["-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-U_FORTIFY_SOURCE", "-fno-gnu-unique",
                   "-DKVCAL_HOST_EMULATION"]


def emulator_library(driver: str, include_dirs: list[Path], name: str) -> Path:
    """The C++ `driver` built with g++ and EMULATION_FLAGS against `include_dirs` into a shared library `name`, once
    per content: the build cache (kvcal.build_cache) keys it by the driver, the flags, the compiler and every
    source file of the include folders, so a rerun over unchanged kernels builds nothing."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("the kernel emulation needs g++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = [f"{i}/{p.name}\0{p.read_text()}" for i, folder in enumerate(include_dirs) for p in sorted(folder.iterdir())
               if p.suffix in (".h", ".cuh", ".cu")]

    def build(target: Path) -> None:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "driver.cpp").write_text(driver)
            command = [compiler, *EMULATION_FLAGS, *(f"-I{d}" for d in include_dirs), str(Path(folder) / "driver.cpp"), "-o", str(target)]
            built = subprocess.run(command, capture_output=True, text=True)
            assert built.returncode == 0, built.stderr[-6000:]

    return cached(name, [driver, *EMULATION_FLAGS, compiler, version, *sources], build)


AVX2_LEVEL = ("x86-64-v3", {"avx2", "fma", "bmi2", "f16c", "movbe"})  # the 8-lane build


def runnable_cpu_targets() -> list[str]:
    """The -march targets of the CPU kernels to test on this machine: native, and the AVX2 build where the CPU runs it
    and native is wider (AVX-512: 16 lanes; the AVX2 build has 8). No other width exists, so no other build."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    level, needs = AVX2_LEVEL
    return ["native", level] if needs <= flags and "avx512f" in flags else ["native"]


def requires_gpu(test):
    """Marks a test `gpu` (the GPU suite is `pytest -m gpu`) and skips it where there is no CUDA GPU or no CuPy."""
    ready = torch.cuda.is_available() and kernels.cuda_ready("cuda")
    return pytest.mark.gpu(pytest.mark.skipif(not ready, reason="needs a CUDA GPU and CuPy (pip install -e '.[gpu]')")(test))


def decode_token_by_token(model, bundle, ids):
    """Logits of feeding `ids` one token at a time through the runtime cache."""
    logits = []
    with quantized_cache(model, bundle) as cache:
        for t in range(ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, 0])
    return torch.stack(logits, dim=1), cache


def decode_step_operations(model, bundle, batch: int, prompt_tokens: int = 30) -> collections.Counter:
    """The torch operations called in one decode step after a prefill of `batch` sequences (torch.profiler on CPU:
    the top-level events; the events nested in them are ATen's own decomposition of an operation, which follows
    shapes and strides, e.g. a reshape is a view for one sequence and a copy for eight)."""
    ids = torch.randint(3, 512, (batch, prompt_tokens + 2), generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        model(ids[:, :prompt_tokens], past_key_values=cache, use_cache=True)
        model(ids[:, prompt_tokens : prompt_tokens + 1], past_key_values=cache, use_cache=True)  # the first decode step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            model(ids[:, prompt_tokens + 1 :], past_key_values=cache, use_cache=True)
    return collections.Counter(event.name for event in profile.events() if event.cpu_parent is None)


READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def host_reads(monkeypatch):
    """Within the block, record every read of a tensor's values by the host (what waits for a GPU): the name of
    the function that made it, in a list."""
    callers = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, original=original, **kwargs):
            callers.append(sys._getframe(1).f_code.co_name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    try:
        yield callers
    finally:
        monkeypatch.undo()
