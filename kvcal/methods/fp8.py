"""vLLM's FP8 (e4m3) KV cache (`fp8`): the `eval ppl` baseline `fp8` is vLLM's default scale 1.0, and
`eval ppl --quant FOLDER` evaluates the scales a `kvcal export vllm` folder holds (absmax / 448 or
calibrated, one per layer or per KV head). As vLLM stores it: keys post-RoPE, every token as
fp8_e4m3(x / scale) * scale saturated at +-448 (kvcal.export.fp8.fp8_fake_quantize), nothing kept fp16;
8 bits per element, the scales being per-layer constants of the checkpoint, not stored per token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kvcal import registry
from kvcal.export.fp8 import Fp8KvScales, fp8_fake_quantize
from kvcal.export.vllm import holds_export_marker, read_export
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import CodecKind, LayerCodecs, Quantized
from kvcal.registry import MethodSpec
from kvcal.simulate import Method

FP8_BITS = 8


@dataclass(frozen=True, eq=False)
class Fp8Codec:
    """One layer's K or V in vLLM's FP8 cache, for the simulation (vLLM stores it; the kvcal runtime has no
    FP8 layer format, so there is no encode/decode to share with it)."""

    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    scale: torch.Tensor  # 1 element (strategy tensor) or one per KV head (attn_head)
    block_tokens = 1

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(fp8_fake_quantize(x, self.scale), torch.full((x.shape[0],), float(FP8_BITS * x.shape[1]), device=x.device))


def fp8_method(name: str, scales: Fp8KvScales, fingerprint: dict | None = None) -> Method:
    layers = [LayerCodecs(Fp8Codec(k), Fp8Codec(v), key_pre_rope=False) for k, v in zip(scales.k, scales.v)]
    return Method(name, FP8_BITS, layers, SegmentPolicy(), fingerprint=fingerprint)


class Fp8Spec(MethodSpec):
    name = "fp8"
    description = "vLLM's FP8 e4m3 KV cache, post-RoPE keys: scale 1.0 (baseline), or a kvcal export vllm folder's scales (--quant)"
    folder_kind = "kvcal export vllm folder"
    fit_command = "kvcal export vllm"

    def baseline_syntax(self):
        return "fp8 (vLLM's default scale 1.0)"

    def baseline(self, text, num_layers, head_dim):
        if text != "fp8":
            return None
        return fp8_method("fp8 scale 1.0", Fp8KvScales.unit(num_layers))

    def folder_method(self, path):
        if not holds_export_marker(Path(path)):
            return None
        fit = read_export(path)
        scales = Fp8KvScales.of_fit(fit)
        # a calibrated export of a profile without stored windows holds absmax / 448 (nothing to search on)
        return fp8_method(f"fp8 {'calibrated' if fit.searched else 'absmax'} {fit.strategy}", scales, fingerprint=fit.fingerprint)


registry.register_method(Fp8Spec())
