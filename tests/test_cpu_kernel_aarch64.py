"""The CPU decode kernel elsewhere than as built here: calls recorded on this machine (tests/helpers/cpu_replay.py)
replayed on the same bytes by tests/cpu_replay/replay_decode.cpp built for this machine (everywhere: it keeps the
driver in step with the kernel's arguments), and, where Debian's g++-aarch64-linux-gnu and qemu-user are installed,
both kernels cross-compiled unchanged for armv8-a (NEON) and the decode kernel replaying under qemu, giving this
machine's output within float32 rounding."""

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from helpers import skip_without_gxx
from helpers.cpu_replay import recording
from helpers.kernel_cases import BATCHES, cocktail_stores, compare, cpu_kernel_decode, filled
from kvcal.runtime import cpu_kernel, kernel_source
from kvcal.build_cache import cached

pytestmark = pytest.mark.slow

COMPILER, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")
DRIVER = Path(__file__).resolve().parent / "cpu_replay" / "replay_decode.cpp"
ARM_FLAGS = ["-O3", "-march=armv8-a", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
             "-fno-signed-zeros"]
needs_aarch64 = pytest.mark.skipif(COMPILER is None or QEMU is None, reason="needs g++-aarch64-linux-gnu and qemu-user "
                                   "(apt-get install g++-aarch64-linux-gnu qemu-user)")


def cross_compiled(source: Path, flags: list[str], name: str, link: bool, compiler: str | None = None) -> Path:
    """source built by `compiler` (default the aarch64 cross compiler) with flags: an executable (static where
    cross-compiled) where `link`, else a shared library; kept in the build cache by sources, flags and compiler."""
    compiler = compiler or COMPILER
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    kernels = [p.read_text() for p in sorted(kernel_source.KERNEL_DIR.glob("*_cpu.cpp"))]

    def build(target: Path) -> None:
        mode = ([] if compiler != COMPILER else ["-static"]) if link else ["-shared", "-fPIC"]
        done = subprocess.run([compiler, *flags, *mode, f"-I{kernel_source.KERNEL_DIR}", str(source), "-o", str(target)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]

    return cached(name, [source.read_text(), *kernels, *flags, str(link), compiler, version], build)


@needs_aarch64
@pytest.mark.parametrize("kernel", ("decode_attention_cpu.cpp", "append_cpu.cpp"))
def test_both_cpu_kernels_compile_for_aarch64(kernel):
    flags = cpu_kernel.DECODE_FLAGS if kernel.startswith("decode") else cpu_kernel.APPEND_FLAGS
    library = cross_compiled(kernel_source.KERNEL_DIR / kernel, [*flags, "-march=armv8-a", "-fopenmp"], f"{Path(kernel).stem}-aarch64.so",
                             link=False)
    assert library.read_bytes()[18:20] == (183).to_bytes(2, "little")  # ELF machine: EM_AARCH64


CASES = ("kivi2", "kvmix-3bit-10x3+1x2-words", "nuq3-prerope-sink4-window", "nuq4-prerope-crowded-outliers", "skvq2-prerope-sink5-window",
         "nuq3-per-token-keys")
LONG = [1100, 513, 0, 64]


@pytest.fixture(scope="module")
def replayer():
    return cross_compiled(DRIVER, ARM_FLAGS, "replay_decode-aarch64", link=True)


def replayed(replayer: Path, recordings: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([QEMU, "-L", str(SYSROOT), str(replayer), *map(str, recordings)], capture_output=True, text=True, timeout=600)


def test_the_replay_driver_built_here_gives_the_recorded_output(tmp_path):
    """The driver built for this machine replays a recording of the kernel's calls (codebook bodies with pre-RoPE keys
    and crowded outliers) to the output recorded: the driver passes every argument the kernel takes, in order (it
    lagged two behind, unseen where no aarch64 toolchain is), and a recording holds all the memory a call reads."""
    skip_without_gxx()
    replayer = cross_compiled(DRIVER, [*ARM_FLAGS[2:], f"-march={cpu_kernel.target()}", "-O2"], "replay_decode-native",
                              link=True, compiler=shutil.which("g++"))
    (key_store, value_store), pre_rope = filled("nuq4-prerope-crowded-outliers", BATCHES["3"], device="cpu")
    path = tmp_path / "nuq4.kvrp"
    with recording(path, [key_store, value_store]):
        compare(key_store, value_store, 3, group=4, pre_rope=pre_rope, device="cpu", decode=cpu_kernel_decode, atol=1e-5, rtol=1e-5)
    done = subprocess.run([str(replayer), str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.count(": ok,") == 1, done.stdout + done.stderr


@needs_aarch64
def test_the_aarch64_decode_kernel_gives_this_machines_output(replayer, tmp_path):
    recordings = []
    for case in CASES:
        for name, lengths in (("long", LONG), ("ragged", BATCHES["17"])):
            path = tmp_path / f"{case}-{name}.kvrp"
            (key_store, value_store), pre_rope = filled(case, lengths, device="cpu")
            with recording(path, [key_store, value_store]):
                compare(key_store, value_store, len(lengths), group=4, pre_rope=pre_rope, device="cpu", decode=cpu_kernel_decode,
                        atol=1e-5, rtol=1e-5)
            recordings.append(path)
    stores, batch = cocktail_stores(device="cpu")  # three launches chained into one softmax
    path = tmp_path / "cocktail.kvrp"
    with recording(path, stores):
        compare(*stores, batch, group=2, pre_rope=False, device="cpu", decode=cpu_kernel_decode, atol=1e-5, rtol=1e-5)
    recordings.append(path)
    done = replayed(replayer, recordings)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok, 8 lanes") == len(recordings), done.stdout


@needs_aarch64
def test_a_replay_catches_a_kernel_that_computes_otherwise(replayer, tmp_path):
    """The comparison can fail: a recording whose expected output is perturbed by 1e-3 in one value is refused."""
    (key_store, value_store), pre_rope = filled("kivi2", BATCHES["3"], device="cpu")
    path = tmp_path / "kivi2.kvrp"
    with recording(path, [key_store, value_store]):
        compare(key_store, value_store, 3, group=4, pre_rope=pre_rope, device="cpu", decode=cpu_kernel_decode, atol=1e-5, rtol=1e-5)
    data = bytearray(path.read_bytes())  # the last expected value ends the file
    struct.pack_into("<f", data, len(data) - 4, struct.unpack_from("<f", data, len(data) - 4)[0] + 1e-3)
    path.write_bytes(bytes(data))
    done = replayed(replayer, [path])
    assert done.returncode == 1 and "DIFFERS" in done.stdout
