"""The CUDA sources in kernels/ and every variant the runtime may launch, and a compile check with NVRTC
that needs no GPU (cuda-bindings + nvidia-cuda-nvrtc-cu12 from PyPI).

Variants: the append kernels are one per codec (append.cu); decode attention is decode_attention_tc.cu's template
(its variants: kvcal.runtime.tensor_core). CuPy compiles the same sources with the same options on the GPU
(kvcal.runtime.kernels, kvcal.runtime.tensor_core).
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvcal.errors import KvcalError
from kvcal.build_cache import cached

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
ARCHITECTURES = ("sm_80", "sm_90")
OPTIONS = ("--std=c++17", "-default-device")


def source(module: str) -> str:
    path = KERNEL_DIR / module
    if not path.is_file():
        raise KvcalError(f"kernel source {path} is missing; kvcal's kernels ship in the repository's kernels/ directory")
    return path.read_text()


def enum_members(module: str, name: str) -> dict[str, int]:
    """The members of C++ `enum name { ... }` in kernels/<module>, name -> value, in order: the kernels' own
    definition is the one source of the numbers the host writes (codec ids, layouts, descriptor fields)."""
    match = re.search(r"enum " + name + r"\s*\{([^}]*)\}", source(module))
    if match is None:
        raise KvcalError(f"kernels/{module} defines no enum {name}")
    members, value = {}, 0
    for item in re.sub(r"//[^\n]*", "", match.group(1)).split(","):
        if item.strip():
            member, _, explicit = item.partition("=")
            value = int(explicit) if explicit.strip() else value
            members[member.strip()] = value
            value += 1
    return members


# Codec numbers (kernels/common.cuh enum Codec).
_CODECS = enum_members("common.cuh", "Codec")
FP16_ONLY, UNIFORM_TOKEN, UNIFORM_CHANNEL, CODEBOOK_CHANNEL, CODEBOOK_TOKEN, PERMUTED_GROUPS = (
    _CODECS[codec] for codec in ("FP16_ONLY", "UNIFORM_TOKEN", "UNIFORM_CHANNEL", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN",
                                 "PERMUTED_GROUPS"))
HEAD_DIMS = (64, 128, 256)
APPEND_KERNELS = ("append_token_uniform", "append_permuted_groups", "append_permuted_groups_fp8", "append_channel_block",
                  "append_codebook", "append_codebook_outliers")


def variants(module: str) -> list[str]:
    """Kernel names of append.cu, the module whose kernels are not templates (decode_attention_tc.cu's variants:
    kvcal.runtime.tensor_core.variants)."""
    if module != "append.cu":
        raise KvcalError(f"kernel_source.variants lists append.cu's kernels, not {module}'s")
    return list(APPEND_KERNELS)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def included_sources(text: str, include_dirs: list[Path]) -> list[str]:
    """The files `text` includes with #include "...", and theirs, each found in the first of include_dirs that holds
    it (names found in none, system headers, are left out), each as its name, a NUL and its content, in the order
    first met: what a build of `text` reads, so that a build cache keyed by them is not re-keyed by an edit to an
    unrelated kernel."""
    found, pending, seen = [], [text], set()
    while pending:
        for name in _INCLUDE.findall(pending.pop(0)):
            path = next((folder / name for folder in include_dirs if (folder / name).is_file()), None)
            if path is None or path in seen:
                continue
            seen.add(path)
            content = path.read_text()
            found.append(f"{name}\0{content}")
            pending.append(content)
    return found


@dataclass
class CompiledFunction:
    name: str  # the mangled name
    registers: int
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int


def _check(result, what: str):
    from cuda.bindings import nvrtc

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KvcalError(f"NVRTC {what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


@dataclass
class Compiled:
    log: str  # the compiler's log, with the ptxas report
    functions: list[CompiledFunction]
    lowered: dict[str, str]  # name expression -> mangled name
    cubin: bytes


def nvrtc_compile(text: str, filename: str, arch: str, names=(), extra_options=()) -> Compiled:
    """Compile CUDA source `text` (includes resolved in kernels/) to SASS for `arch` with NVRTC and the runtime's
    options, instantiating the name expressions `names`. Raises KvcalError with the log when compilation fails.
    The result is kept in the build cache (kvcal.build_cache) by the hash of the text, the files it includes
    (`included_sources`), the options and NVRTC's version: a rerun over unchanged sources compiles nothing."""
    from cuda.bindings import nvrtc

    options = [*OPTIONS, f"--gpu-architecture={arch}", f"--include-path={KERNEL_DIR}", "--ptxas-options=-v", *extra_options]
    includes = included_sources(text, [KERNEL_DIR])
    version = ".".join(map(str, _check(nvrtc.nvrtcVersion(), "version")))

    def build(path: Path) -> None:
        compiled = _nvrtc_compile(text, filename, arch, names, options)
        path.write_text(json.dumps({"log": compiled.log, "lowered": compiled.lowered, "cubin": base64.b64encode(compiled.cubin).decode()}))

    # keyed by what kernels/ holds, not where: every checkout of the same sources shares the entry
    key_options = [option.replace(str(KERNEL_DIR), "<kernels>") for option in options]
    stored = json.loads(cached(f"nvrtc-{arch}.json", [text, filename, *names, *key_options, *includes, version], build).read_text())
    return Compiled(stored["log"], parse_ptxas_report(stored["log"]), stored["lowered"], base64.b64decode(stored["cubin"]))


def _nvrtc_compile(text: str, filename: str, arch: str, names, options: list[str]) -> Compiled:
    from cuda.bindings import nvrtc

    program = _check(nvrtc.nvrtcCreateProgram(text.encode(), filename.encode(), 0, [], []), "create")
    try:
        for name in names:
            _check(nvrtc.nvrtcAddNameExpression(program, name.encode()), f"name expression {name}")
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])[0]
        log = b" " * _check(nvrtc.nvrtcGetProgramLogSize(program), "log size")
        _check(nvrtc.nvrtcGetProgramLog(program, log), "log")
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KvcalError(f"{filename} does not compile for {arch}:\n{log_text}")
        lowered = {name: _check(nvrtc.nvrtcGetLoweredName(program, name.encode()), f"lowered name of {name}").decode()
                   for name in names}
        cubin = b" " * _check(nvrtc.nvrtcGetCUBINSize(program), "cubin size")
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "cubin")
        return Compiled(log_text, parse_ptxas_report(log_text), lowered, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def compile_check(module: str, arch: str) -> tuple[list[CompiledFunction], str]:
    """Every variant of `module` compiled for `arch`: the per-function ptxas report and the log."""
    compiled = nvrtc_compile(source(module), module, arch, variants(module))
    return compiled.functions, compiled.log


def parse_ptxas_report(log: str) -> list[CompiledFunction]:
    functions = []
    for block in re.split(r"ptxas info\s*: Compiling entry function", log)[1:]:
        name = re.match(r"\s*'([^']+)'", block).group(1)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
        registers = re.search(r"Used (\d+) registers", block)
        functions.append(CompiledFunction(name, int(registers.group(1)), int(frame.group(2)) + int(frame.group(3)), int(frame.group(1))))
    return functions
