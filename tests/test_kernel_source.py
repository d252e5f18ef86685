"""The CUDA kernels compile without a GPU: every variant the runtime may launch, for sm_80 and sm_90, with
NVRTC (the README test command installs cuda-bindings and nvidia-cuda-nvrtc-cu12), and no register spills."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcal.runtime import kernel_source, kernels

pytestmark = pytest.mark.nvrtc

MODULES = ("decode_attention.cu", "append.cu")


@pytest.fixture(scope="module")
def compiled():
    """(module, arch) -> ptxas report; the compilations run side by side (NVRTC releases the GIL)."""
    jobs = [(module, arch) for module in MODULES for arch in kernel_source.ARCHITECTURES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = pool.map(lambda job: kernel_source.compile_check(*job)[0], jobs)
    return dict(zip(jobs, reports))


@pytest.mark.parametrize("arch", kernel_source.ARCHITECTURES)
@pytest.mark.parametrize("module", MODULES)
def test_every_kernel_variant_compiles_without_spills(compiled, module, arch):
    report = compiled[module, arch]
    assert len(report) == len(kernel_source.variants(module))
    assert {f.name: f.spill_bytes for f in report if f.spill_bytes} == {}
    assert {f.name: f.stack_bytes for f in report if f.stack_bytes} == {}  # nothing in local memory at all


def test_decode_variants_cover_every_codec_pair_head_dim_and_rope():
    names = kernel_source.decode_variants()
    assert len(names) == len(set(names)) == len(kernel_source.CODEC_PAIRS) * len(kernel_source.HEAD_DIMS) * 2


def test_a_compile_error_is_reported_with_the_compiler_log(monkeypatch):
    from kvcal.errors import KvcalError

    broken = kernel_source.source("append.cu").replace("__syncthreads();", "__syncthreads()", 1)
    monkeypatch.setattr(kernel_source, "source", lambda module: broken)
    with pytest.raises(KvcalError, match=r"append.cu does not compile for sm_80:\n.*error"):
        kernel_source.compile_check("append.cu", "sm_80")


def _enum(module: str, name: str) -> list[str]:
    body = re.search(r"enum " + name + r" \{([^}]*)\}", kernel_source.source(module)).group(1)
    return [re.sub(r"//.*", "", item).split("=")[0].strip() for item in re.sub(r"//[^\n]*", "", body).split(",") if item.strip()]


def test_python_and_cuda_agree_on_descriptor_fields_and_codec_numbers():
    """The launcher writes descriptors and codec ids by position: the enums in the CUDA sources must match."""
    side_fields = _enum("decode_attention.cu", "SideField")
    assert side_fields[-1] == "SIDE_FIELDS" and len(side_fields) - 1 == kernels.SIDE_FIELDS
    meta_fields = _enum("decode_attention.cu", "MetaField")
    assert meta_fields[-1] == "META_FIELDS" and len(meta_fields) - 1 == kernels.META_FIELDS
    codecs = _enum("common.cuh", "Codec")
    assert codecs == [kernel_source.CODEC_NAMES[i] for i in range(len(codecs))]
