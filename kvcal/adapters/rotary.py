"""A model's RoPE as kvcal stores it: the module holding each layer's frequencies, the order kvcal reads each layer's
channels in (kvcal.rope.rotate_half_order: neighbouring pairs, part of each head rotated), which layers rotate at all,
and LongRoPE's second set of frequencies. RoPE whose frequencies kvcal cannot store (dynamic NTK, LongRoPE per
layer type) is refused here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvcal.adapters.model_types import MSCALED_LONGROPE, STATE_LAYER_TYPES
from kvcal.errors import KvcalError
from kvcal.rope import rotate_half_order


@dataclass(frozen=True)
class LongRope:
    """LongRoPE's second set of frequencies: a forward whose positions reach past `switch` (the config's
    original_max_position_embeddings) rotates every token by `long_inv_freq`, a shorter forward by the rotary's own
    (transformers' longrope update)."""

    switch: int
    long_inv_freq: torch.Tensor  # (rotated channels / 2,) float32 on the CPU, as the rotary holds its own
    scaling: float | None = None  # the cos/sin scaling of every forward where the rotary's own is not it (PhiMoE's)

    def check_prefill_steps(self, tokens: int, step: int) -> None:
        """Refuse a prefill of `tokens` tokens in steps of `step` that ends past the switch and whose first step does
        not: its steps would rotate by both sets, as no forward of the model over those tokens does."""
        if step <= self.switch < tokens:
            raise KvcalError(f"a prefill of {tokens} tokens in steps of {step} rotates its first steps by LongRoPE's short "
                             f"frequencies and the others by its long ones, past {self.switch}; give a prefill chunk of "
                             f"more than {self.switch} tokens, or none")


def rotary_name(kind: str | None, name: str) -> str:
    """The rotary module's attribute `name` for layers of type `kind` (None: the one set of every layer)."""
    return name if kind is None else f"{kind}_{name}"


def rotary_inv_freq(rotary: nn.Module, kind: str | None) -> torch.Tensor:
    """The frequencies `rotary` rotates layers of type `kind` (None: every layer) by: its inv_freq (times exp(alpha),
    learned, where it has one: Mistral Large 4's LeRoPE), or those its table of sines and cosines was made of
    (model_types.SINUSOID_TABLE_ROPE: computed as the model computes them)."""
    table = getattr(rotary, "embed_positions", None)
    if isinstance(table, torch.Tensor) and not hasattr(rotary, "inv_freq"):
        width = table.shape[-1]
        return 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.int64, device=table.device) / width))
    inv_freq = getattr(rotary, rotary_name(kind, "inv_freq"))
    alpha = getattr(rotary, "alpha", None)
    # (a model built without its weights, `kvcal models`, holds no alpha: its frequencies before it, zero where those are)
    if isinstance(alpha, torch.Tensor) and alpha.shape == inv_freq.shape and not alpha.is_meta:
        return inv_freq.float() * alpha.detach().float().exp()
    return inv_freq


def find_rotary(model: nn.Module, kinds: list[str | None], where: str, optional: bool = False,
                table: bool = False) -> nn.Module | None:
    """The module holding the frequencies of every layer type (`inv_freq`, or `<type>_inv_freq` per type; `table`:
    `embed_positions`, model_types.SINUSOID_TABLE_ROPE's); None where there is none and that is `optional` (a model
    whose attention then applies no RoPE)."""
    names = {"embed_positions"} if table else {rotary_name(kind, "inv_freq") for kind in kinds}
    for module in model.modules():
        if all(isinstance(getattr(module, name, None), torch.Tensor) for name in names):
            return module
    if optional:
        return None
    raise KvcalError(f"{where}: could not find a rotary position embedding (a module with {', '.join(sorted(names))})")


def channel_orders(rotary: nn.Module, kinds: list[str | None], head_dims: list[int], rope_free: set, interleaved: bool,
                   swapped: bool, where: str) -> list[tuple[int, ...] | None]:
    """Per layer, kvcal's channel order of the model's RoPE (kvcal.rope.rotate_half_order; None: the model's own): a
    rotating layer's by the channels its type rotates (Laguna's full layers rotate half of each head, its sliding ones
    all), a layer of a type RoPE leaves out (`rope_free`) the rotating layers' where they share one, else the model's.
    Refused: RoPE kvcal cannot store: more rotated channels than a head has, frequencies that change with every
    sequence length, LongRoPE given per layer type."""
    orders = {}
    for kind, head_dim in zip(kinds, head_dims):
        if kind in rope_free or head_dim == 0:  # (a latent layer caching no rotated key: no channels to order)
            continue
        rotated = 2 * rotary_inv_freq(rotary, kind).numel()
        if rotated > head_dim:
            raise KvcalError(f"{where}: its RoPE rotates {rotated} of a head's {head_dim} channels; kvcal takes up to "
                             "head_dim")
        order = rotate_half_order(head_dim, rotated, interleaved, swapped)
        orders[kind, head_dim] = tuple(order) if order is not None else None
    rope_types = getattr(rotary, "rope_type", "default")
    for rope_type in rope_types.values() if isinstance(rope_types, dict) else [rope_types]:
        if "dynamic" in rope_type:  # transformers' dynamic_rope_update
            raise KvcalError(f"{where}: its RoPE (rope_type '{rope_type}') changes its frequencies with every sequence "
                             "length, and kvcal stores one set; use a static rope_type (default, linear, llama3, yarn) or "
                             "longrope")
        if rope_type == "longrope" and isinstance(rope_types, dict):
            raise KvcalError(f"{where}: its layer types rotate by RoPE of their own, one of them LongRoPE; kvcal serves "
                             "LongRoPE shared by every layer")
    shared = set(orders.values())
    unrotated = shared.pop() if len(shared) == 1 else None
    return [None if head_dim == 0 else orders[kind, head_dim] if kind not in rope_free else
            unrotated if unrotated is None or len(unrotated) == head_dim else None
            for kind, head_dim in zip(kinds, head_dims)]


def find_long_rope(rotary: nn.Module) -> LongRope | None:
    """The rotary's LongRoPE long frequencies, as transformers makes them for a forward past the switch. PhiMoE's
    rotary rotates by its short set at any length and scales cos/sin by the config's short_mscale, or long_mscale
    past the switch: served where the two are equal (the released Phi-3.5-MoE's are), refused where they are not."""
    if getattr(rotary, "rope_type", None) != "longrope":  # (per layer type: refused by channel_orders)
        return None
    parameters = rotary.config.rope_parameters
    switch = int(parameters["original_max_position_embeddings"])
    if rotary.config.model_type in MSCALED_LONGROPE:
        if parameters["short_mscale"] != parameters["long_mscale"]:
            raise KvcalError(f"{rotary.config.model_type}'s RoPE scales cos/sin by short_mscale {parameters['short_mscale']} "
                             f"up to {switch} positions and by long_mscale {parameters['long_mscale']} past them, which "
                             "kvcal does not follow: serve a config whose two are equal, as the released model's are")
        return LongRope(switch, rotary.original_inv_freq.detach().float().cpu(), float(parameters["short_mscale"]))
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, "cpu", seq_len=switch + 1)
    return LongRope(switch, long_inv_freq.float())


def rope_free_types(config) -> set[str]:
    """The layer types whose rope parameters are None: layers of these apply no RoPE (Beam's full-attention ones)."""
    rope = getattr(config, "rope_parameters", None)
    return {kind for kind, parameters in rope.items() if parameters is None} if isinstance(rope, dict) else set()


def rotary_layer_types(config, num_layers: int) -> list[str | None]:
    """Per layer, the name its frequencies go by: the config's layer type where the rope parameters are per type (of
    the attention layers: a hybrid's state layers have none)."""
    types, rope = getattr(config, "layer_types", None), getattr(config, "rope_parameters", None)
    if types and isinstance(rope, dict) and all(kind in rope for kind in types if kind not in STATE_LAYER_TYPES):
        return list(types)[:num_layers]
    return [None] * num_layers


def rotated_layers(config, model_type: str, num_layers: int, rope_free: set[str]) -> list[bool]:
    """Per layer, whether it applies RoPE: not SmolLM3's no_rope_layers (0 there), not EXAONE 4's, EXAONE MoE's and
    Kolibri-1's and Flint's full-attention layers where they have sliding ones (their "global NoPE"; Flint's none
    without a window), Cohere 2's sliding layers
    only (none without a window) and Cohere 2 MoE's besides its dense layers where
    prefix_dense_sliding_window_pattern is 1 (its force_rope), AFMoE's and Lara Mini's sliding layers only, Granite
    SWA's, Muse Spark's and Muse Glimmer's of a non-zero layer_rope_theta, Beam's of a type with rope parameters (not of
    `rope_free`, rope_free_types); every layer elsewhere."""
    if model_type in ("cohere2", "cohere2_moe"):
        window = getattr(config, "sliding_window", None) is not None
        forced = [model_type == "cohere2_moe" and mlp == "dense" and config.prefix_dense_sliding_window_pattern == 1
                  for mlp in getattr(config, "mlp_layer_types", None) or [None] * num_layers]
        return [(kind == "sliding_attention" and window) or force
                for kind, force in zip(config.layer_types, forced)][:num_layers]
    if getattr(config, "layer_rope_theta", None) is not None:  # 0: NoPE (Granite SWA's, Muse Spark's)
        return [bool(theta) for theta in config.layer_rope_theta][:num_layers]
    if rope_free:
        return [kind not in rope_free for kind in config.layer_types][:num_layers]
    window = getattr(config, "sliding_window", None) is not None
    global_nope = model_type in ("exaone4", "exaone_moe", "kolibri1", "flint") and window
    if global_nope or model_type in ("afmoe", "lara_mini"):
        return [kind == "sliding_attention" for kind in config.layer_types][:num_layers]
    return [bool(flag) for flag in getattr(config, "no_rope_layers", None) or [1] * num_layers][:num_layers]


def rotaries_per_base(decoder: nn.Module, config, num_layers: int) -> list[nn.Module | None]:
    """Per decoder layer, the rotary module of its RoPE base (config.layer_rope_theta; None for 0, no RoPE): Granite
    SWA keeps one per base (`rotary_embs`), its `rotary_emb` left unused."""
    by_base = {float(module.config.rope_parameters["rope_theta"]): module for module in decoder.rotary_embs}
    return [by_base[float(theta)] if theta else None for theta in config.layer_rope_theta[:num_layers]]


def rotaries_scaled_by_layer(decoder: nn.Module, config, num_layers: int) -> list[nn.Module]:
    """Per decoder layer, Molmo 2's scaled rotary module where config.rope_scaling_layers lists it, else its unscaled one."""
    scaled = set(config.rope_scaling_layers)
    return [decoder.rotary_emb if m in scaled else decoder.rotary_emb_unscaled for m in range(num_layers)]
