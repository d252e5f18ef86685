"""The append kernels compile without a GPU, for sm_80 and sm_90, with NVRTC (the README test command installs
cuda-bindings and nvidia-cuda-nvrtc-cu12), and no register spills (the tensor-core decode's variants:
tests/test_tensor_core_decode.py); a compile keeps what it read by its includes; the enums the host reads."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcal.runtime import kernel_source, kernels

pytestmark = pytest.mark.nvrtc

@pytest.fixture(scope="module")
def compiled():
    """arch -> append.cu's ptxas report; the compilations run side by side (NVRTC releases the GIL)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = pool.map(lambda arch: kernel_source.compile_check("append.cu", arch)[0], kernel_source.ARCHITECTURES)
    return dict(zip(kernel_source.ARCHITECTURES, reports))


@pytest.mark.parametrize("arch", kernel_source.ARCHITECTURES)
def test_every_append_kernel_compiles_without_spills(compiled, arch):
    report = compiled[arch]
    assert len(report) == len(kernel_source.variants("append.cu"))
    assert {f.name: f.spill_bytes for f in report if f.spill_bytes} == {}
    assert {f.name: f.stack_bytes for f in report if f.stack_bytes} == {}  # nothing in local memory at all


def test_a_compile_error_is_reported_with_the_compiler_log(monkeypatch):
    from kvcal.errors import KvcalError

    broken = kernel_source.source("append.cu").replace("__syncthreads();", "__syncthreads()", 1)
    monkeypatch.setattr(kernel_source, "source", lambda module: broken)
    with pytest.raises(KvcalError, match=r"append.cu does not compile for sm_80:\n.*error"):
        kernel_source.compile_check("append.cu", "sm_80")


def test_the_cpu_kernel_extends_the_cuda_kernels_descriptor_and_codecs():
    """The host reads every number from the kernels' enums (kernel_source.enum_members); the CPU kernel reads the
    CUDA kernel's descriptor and codec ids with fields and codecs of its own after them, so its enums must begin
    with theirs."""
    cuda_fields = [name for name in kernel_source.enum_members("segments.cuh", "SideField") if name != "SIDE_FIELDS"]
    cpu_fields = list(kernel_source.enum_members("decode_attention_cpu.cpp", "SideField"))
    assert cpu_fields[:len(cuda_fields)] == cuda_fields and cpu_fields[-1] == "SIDE_FIELDS"
    cuda_meta = list(kernel_source.enum_members("segments.cuh", "MetaField"))
    assert list(kernel_source.enum_members("decode_attention_cpu.cpp", "MetaField"))[:4] == cuda_meta[:4]
    codecs = kernel_source.enum_members("common.cuh", "Codec")
    assert list(kernel_source.enum_members("decode_attention_cpu.cpp", "Codec").items())[:len(codecs)] == list(codecs.items())
    assert kernel_source.enum_members("decode_attention_cpu.cpp", "Layout") == kernel_source.enum_members("common.cuh", "Layout")
    assert kernels.SIDE_FIELDS == len(cuda_fields) and kernels.SideField.LAYOUT == cuda_fields.index("LAYOUT")


def test_a_build_is_keyed_by_the_files_it_includes_and_theirs_only(tmp_path):
    """kernel_source.included_sources: what a build of a text reads, found in the first folder that holds each name;
    a header no folder holds (a system one) is left out, and a file of the folder nobody includes is not read."""
    (first := tmp_path / "first").mkdir()
    (second := tmp_path / "second").mkdir()
    (first / "a.cuh").write_text('#pragma once\n#include "b.cuh"\n#include <cmath>\n')
    (second / "a.cuh").write_text("shadowed")
    (second / "b.cuh").write_text('#include "a.cuh"\nint b;\n')
    (second / "unrelated.cu").write_text("int unrelated;\n")
    found = kernel_source.included_sources('#include "a.cuh"\n  #  include "missing.h"\n', [first, second])
    assert found == ['a.cuh\0#pragma once\n#include "b.cuh"\n#include <cmath>\n', 'b.cuh\0#include "a.cuh"\nint b;\n']
    names = [x.split("\0")[0] for x in kernel_source.included_sources(kernel_source.source("decode_attention_tc.cu"),
                                                                      [kernel_source.KERNEL_DIR])]
    assert sorted(names) == ["code_lookups.cuh", "common.cuh", "intrinsics.cuh", "merge.cuh", "segments.cuh"]  # not append.cu


def test_enum_members_counts_on_from_explicit_values(tmp_path, monkeypatch):
    (tmp_path / "probe.cuh").write_text("enum Probe {\n    A,  // first\n    B = 4,\n    C\n};\n")
    monkeypatch.setattr(kernel_source, "KERNEL_DIR", tmp_path)
    assert kernel_source.enum_members("probe.cuh", "Probe") == {"A": 0, "B": 4, "C": 5}
    with pytest.raises(kernel_source.KvcalError, match="defines no enum Missing"):
        kernel_source.enum_members("probe.cuh", "Missing")
