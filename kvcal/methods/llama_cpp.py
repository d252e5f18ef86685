"""llama.cpp's KV cache types (`llama.cpp`, the `eval ppl` baselines q8_0, q5_0, q5_1, q4_0, q4_1, iq4_nl,
no calibration): blocks of 32 channels with ggml's reference rounding, after the Hadamard rotation llama.cpp
applies to a quantized K and V cache; each token is quantized once, when stored. `K/V` (`q8_0/q4_0`, `f16/q4_0`)
is `-ctk K -ctv V`: each tensor takes its own type, and llama.cpp rotates only a quantized one (attn_rot_k and
attn_rot_v in src/llama-kv-cache.cpp each test their own type). Codecs: kvcal.rotation_codecs.LlamaCppKV. An MLA
model's cache (DeepSeek-V2/V3 and kin, arch deepseek2) is one row a token, the latent then the rotated key, of -ctk's
type (-ctv must equal it) and never rotated: kvcal.methods.latent_refusal and baseline_method(latent=True).

ik_llama.cpp's mixed cache (ikawrakow/ik_llama.cpp PR #1599: `-ctk-first TYPE,N`, `-ctk-last TYPE,M`, `-ctv-first`,
`-ctv-last`) sets the first N and the last M layers of K or V to another type: the baseline options
`;k_first=TYPE,N`, `;k_last=TYPE,M`, `;v_first=...`, `;v_last=...` after the pair (kvcal.methods.baseline_method).
These are what ik_llama.cpp stores with -khad -vhad: it rotates each layer's K (V) on blocks of its own size
(kvcal.rotation_codecs.ik_llama_cpp_rotation_size) when the tensor's base type is quantized, and turns the
rotation off when the base type is f16 (src/llama.cpp, llama_init_from_model), so then the ends are stored plain.
An f16 layer it rotates is stored as the unrotated f16 would be, to fp16 rounding."""

from __future__ import annotations

from kvcal import registry
from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import Fp16Codec, LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.rotation_codecs import LLAMA_CPP_TYPES, LlamaCppKV
from kvcal.simulate import Method

CACHE_TYPES = ("f16", *LLAMA_CPP_TYPES)  # what -ctk / -ctv take here (f32 and bf16 store no fewer bytes than f16)
# what ik_llama.cpp's CPU flash attention reads of those (ggml/src/iqk/iqk_flash_attn.cpp, supported_kv_types; it
# aborts on q5_0 / q5_1): its plans keep to them, so that a setting runs on every backend it has
IK_CACHE_TYPES = ("f16", "q8_0", "q4_1", "q4_0", "iq4_nl")


def cache_type_codec(cache_type: str, head_dim: int, tensor: str, hadamard: str | None = "llama.cpp"):
    """The codec of one tensor ("k" or "v") under a llama.cpp cache type, rotated as `hadamard` says (LlamaCppKV)."""
    return Fp16Codec() if cache_type == "f16" else LlamaCppKV(cache_type, head_dim, tensor, hadamard)


def ik_hadamard(base_type: str) -> str | None:
    """The rotation ik_llama.cpp gives a tensor's layers under -khad / -vhad: none when the base type is f16."""
    return None if base_type == "f16" else "ik_llama.cpp"


FIRST_LAST = ("k_first", "k_last", "v_first", "v_last")  # ik_llama.cpp's -ctk-first, -ctk-last, -ctv-first, -ctv-last


def cache_type_pair(text: str, f16_for_both: bool = False) -> tuple[str, str] | None:
    """(type_k, type_v) of `T` or `K/V`, or None when it is not a llama.cpp cache type (pair); f16 for both is one
    only where `f16_for_both` (the base of an ik_llama.cpp setting, whose first / last options give other types)."""
    type_k, type_v = text.split("/", 1) if "/" in text else (text, text)
    if type_k not in CACHE_TYPES or type_v not in CACHE_TYPES or (type_k == type_v == "f16" and not f16_for_both):
        return None
    return type_k, type_v


def first_last_option(option: str) -> tuple[str, tuple[str, int]] | None:
    """(name, (type, n)) of one `k_first=TYPE,N` (k_last, v_first, v_last), or None when it is not one."""
    name, _, value = option.partition("=")
    cache_type, _, count = value.partition(",")
    return (name, (cache_type, int(count))) if name in FIRST_LAST and count.isdigit() else None


def ik_llama_cpp_setting(spec: str) -> tuple[str, dict[str, tuple[str, int]]]:
    """The base (T or K/V) and first / last options of an ik_llama.cpp setting written as kvcal's baseline spec
    (`q4_0`, `q8_0/q4_0;k_first=f16,2;v_last=q8_0,1`), each option at most once."""
    base, *options = [part.strip() for part in spec.strip().split(";")]
    parsed = [first_last_option(option) for option in options]
    names = [option[0] for option in parsed if option is not None]
    if cache_type_pair(base, f16_for_both=bool(options)) is None or None in parsed or len(set(names)) < len(names):
        raise KvcalError(f"'{spec}' is not an ik_llama.cpp setting: give a cache type or K/V pair ({', '.join(CACHE_TYPES)}), "
                         "then ;k_first=TYPE,N (k_last, v_first, v_last) at most once each")
    return base, dict(parsed)


def ik_llama_cpp_arguments(spec: str) -> str:
    """ik_llama.cpp's arguments for a setting (ik_llama_cpp_setting): -ctk / -ctv, -ctk-first TYPE,N ... in FIRST_LAST's
    order, and -khad / -vhad for each tensor whose base type is quantized (what the codecs here model)."""
    base, options = ik_llama_cpp_setting(spec)
    pair = cache_type_pair(base, f16_for_both=True)
    arguments = [f"-ctk {pair[0]}", f"-ctv {pair[1]}"]
    for option in (option for option in FIRST_LAST if option in options):  # k_first -> -ctk-first TYPE,N
        cache_type, count = options[option]
        arguments.append(f"-ct{option[0]}-{option[2:]} {cache_type},{count}")
    arguments += [f"-{tensor}had" for tensor, base_type in zip("kv", pair) if ik_hadamard(base_type)]
    return " ".join(arguments)


def first_last_method(base: str, options: dict[str, tuple[str, int]], head_dims: list[int]) -> Method:
    """ik_llama.cpp's mixed cache: the pair `base` (T or K/V) on every layer but the first / last n of K / V, which
    take another type; options {k_first | k_last | v_first | v_last: (type, n)} (under an f16 base, the quantized
    layers); each layer's codecs for its head_dim (one a layer)."""
    num_layers = len(head_dims)
    pair = cache_type_pair(base, f16_for_both=True)
    if pair is None:
        raise KvcalError(f"{', '.join(FIRST_LAST)} follow a llama.cpp cache type or K/V pair, not '{base}'")
    types = {tensor: [pair[i]] * num_layers for i, tensor in enumerate("kv")}
    for option, (cache_type, count) in options.items():
        if cache_type not in CACHE_TYPES:
            raise KvcalError(f"{option}={cache_type},{count}: '{cache_type}' is not one of {', '.join(CACHE_TYPES)}")
        if count < 1:
            raise KvcalError(f"{option}={cache_type},{count}: give a number of layers, 1 or more")
        if count > num_layers:
            raise KvcalError(f"{option}={cache_type},{count}: the model has {num_layers} layers")
        layers = range(count) if option.endswith("first") else range(num_layers - count, num_layers)
        for layer in layers:
            types[option[0]][layer] = cache_type
    for tensor in "kv":
        first, last = options.get(f"{tensor}_first", ("", 0))[1], options.get(f"{tensor}_last", ("", 0))[1]
        if first + last > num_layers:
            raise KvcalError(f"{tensor}_first and {tensor}_last name {first} + {last} layers of {num_layers}: they overlap")
    hadamard = {tensor: ik_hadamard(base) for tensor, base in zip("kv", pair)}
    layers = [LayerCodecs(cache_type_codec(k, head_dim, "k", hadamard["k"]), cache_type_codec(v, head_dim, "v", hadamard["v"]),
                          key_pre_rope=False)
              for k, v, head_dim in zip(types["k"], types["v"], head_dims)]
    name = base + "".join(f";{option}={t},{n}" for option, (t, n) in sorted(options.items(), key=lambda o: FIRST_LAST.index(o[0])))
    nominal = sum(codecs.key_codec.bits + codecs.value_codec.bits for codecs in layers) / (2 * num_layers)
    return Method(name, nominal, layers, SegmentPolicy())


def llama_cpp_method(type_k: str, type_v: str, num_layers: int, head_dim: int, hadamard: str | None = "llama.cpp") -> Method:
    """`-ctk type_k -ctv type_v` on every layer (llama.cpp has one type per tensor for the whole model), rotated as
    `hadamard` says (LlamaCppKV; None: MLA's cache, which llama.cpp does not rotate)."""
    keys, values = cache_type_codec(type_k, head_dim, "k", hadamard), cache_type_codec(type_v, head_dim, "v", hadamard)
    name = type_k if type_k == type_v else f"{type_k}/{type_v}"
    return Method(name, (keys.bits + values.bits) / 2, [LayerCodecs(keys, values, key_pre_rope=False)] * num_layers,
                  SegmentPolicy())


class LlamaCppSpec(MethodSpec):
    name = "llama.cpp"
    description = "llama.cpp KV cache types with its Hadamard rotation, exact to ggml's reference rounding (baseline)"

    def baseline_syntax(self):
        return " | ".join(LLAMA_CPP_TYPES) + " | K/V (-ctk K -ctv V, each of these or f16)"

    def baseline(self, text, num_layers, head_dim):
        pair = cache_type_pair(text)
        return None if pair is None else llama_cpp_method(*pair, num_layers, head_dim)


registry.register_method(LlamaCppSpec())
