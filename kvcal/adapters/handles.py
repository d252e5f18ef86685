"""Where a layer's query, key and value come out of its attention module (LayerHandles), found by structure: separate
projections, one fused projection read by column in any of its layouts, or MLA's latent (LatentAttention); the norms
around RoPE; what multiplies or clamps them. The pre-RoPE key is the tensor RoPE consumes: a key norm's output where
the model has one before RoPE, else the projection's."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from kvcal.adapters.model_types import DEINTERLEAVED_LATENT_ROPE, DEINTERLEAVED_LATENT_ROPE_FROM_5_25, SERVED_ONES, SINKS
from kvcal.errors import KvcalError
from kvcal.rope import rows_in_order
from kvcal.version import transformers_from


@dataclass
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2's MLA). A token caches one latent c (kv_lora_rank channels, the
    kv_a_layernorm output) shared by every head, and one key k_rope of qk_rope_head_dim channels that RoPE rotates;
    head h's key is [W_UK^h c ; k_rope] and its value W_UV^h c (kv_b_proj's rows: per head nope_dim of W_UK, then
    value_dim of W_UV). Attention is exact over the cache as stored: q . key = (q_nope W_UK^h) . c + q_rope . k_rope,
    and the output is W_UV^h (p . c). kvcal caches k_rope as the key (one KV head) and the latent as the value."""

    kv_b_proj: nn.Linear
    nope_dim: int  # the channels of each head's query and key that RoPE leaves alone, before its rotated ones
    value_dim: int  # the channels of each head's output
    # RoPE leaves the query's and key's rotated channels in kvcal's order (rope_interleave de-interleaves them), not the
    # model's: the query attention is handed, and the rotated key transformers' cache is handed
    rope_in_order: bool

    def _per_head(self) -> torch.Tensor:
        """(heads, nope_dim + value_dim, latent channels): W_UK^h above W_UV^h."""
        return self.kv_b_proj.weight.unflatten(0, (-1, self.nope_dim + self.value_dim))

    def latent_query(self, query: torch.Tensor) -> torch.Tensor:
        """(..., heads, tokens, nope_dim) -> (..., heads, tokens, latent channels): q_nope W_UK^h, in float32."""
        return query.float() @ self._per_head()[:, : self.nope_dim].float()

    def head_outputs(self, latent_outputs: torch.Tensor) -> torch.Tensor:
        """(..., heads, tokens, latent channels) -> (..., heads, tokens, value_dim): W_UV^h (p . c), in float32."""
        return latent_outputs.float() @ self._per_head()[:, self.nope_dim :].float().transpose(-1, -2)


@dataclass
class LayerHandles:
    index: int
    attention: nn.Module
    q_proj: nn.Module  # where q, k and v come from one fused linear (Phi-3's qkv_proj), that one for each
    k_proj: nn.Module  # nn.Linear, or GPT-2's Conv1D (its weight (inputs, outputs))
    v_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    v_norm: nn.Module | None = None  # a norm of each value head (Gemma 3n's, without a scale): the value is its output
    # the norms of each query head and each key head after RoPE, without a scale (Llama 4 Scout's one qk_norm for both,
    # NanoChat's q_norm and k_norm): they commute with RoPE, a rotation, so the pre-RoPE query and key are their output
    # on the projections' output (source_rows)
    rope_norms: tuple[nn.Module, nn.Module] | None = None
    # rope_norms run before RoPE (Muse Spark's; Chameleon's, with a scale): their output is the pre-RoPE key
    norms_before_rope: bool = False
    head_dim: int = 0  # the channels of each head, which rope_norms norm together
    heads_first: bool = False  # the q/k norms' output is (batch, heads, tokens, head_dim)
    rope_order: tuple[int, ...] | None = None  # per head, the model's channel at each of kvcal's (kvcal.rope); None: the same
    sinks: torch.Tensor | None = None  # (heads,) the attention sinks' logits (gpt-oss), None where it has none
    key_multiplier: float = 1.0  # the key is the key source's output times this (Falcon-H1's key_multiplier, Ergo's)
    query_multiplier: float = 1.0  # the query is the query source's output times this (Ergo's qk_scale)
    value_multiplier: float = 1.0  # the value is the value source's output times this (MiMo-V2-Flash's v_scale)
    # q, k and v are their source's output clamped to [-clip, clip] (DBRX's, OLMo 1.7's and OLMoE's clip_qkv; OLMo's
    # and OLMoE's clamp in place after the hooks read it); None: not clamped. The gradient with respect to the output
    # is 0 where the model clamps (a hook on it sees the gradient before an in-place clamp): Fisher weighs those 0
    clip: float | None = None
    # (head_dim,) in kvcal's order: 1 / the cos/sin scaling on the channels RoPE leaves alone, 1 on the others, where RoPE
    # covers part of each head and scales cos/sin (Phi-4-mini's LongRoPE): kvcal's rotation scales every channel (by
    # frequency 0 on those), so the pre-RoPE query and key it reads hold those channels divided by it; None: no such
    unrotated_scale: torch.Tensor | None = None
    # the value is v_norm of k_proj's output, the key k_norm of it (Gemma 4's attention_k_eq_v): v_proj is k_proj
    value_from_key_projection: bool = False
    # each of q, k, v: its output columns of its projection (all of them, but in a fused one: a slice where the three lie
    # side by side, an index where they alternate by head)
    columns: dict[str, slice | torch.Tensor] = field(default_factory=lambda: dict.fromkeys("qkv", slice(None)))
    latent: LatentAttention | None = None  # MLA: k_proj and v_proj are kv_a_proj_with_mqa, v_norm its kv_a_layernorm
    # sparse attention: its attention is handed the columns of the mask each query attends, picked by its own indexer,
    # which keeps keys of its own, or by an earlier layer's (Hy V4's shared layers: indexer None). DeepSeek Sparse
    # Attention's (MLA): the top index_topk tokens by the indexer's scores (`indices`; Cache.update_indexer); MiniMax-M3's
    # (GQA): per KV head, the top blocks of `pick_block` keys (`block_indices`; its cache layer's update_index);
    # Qwen4-Exp's (GQA, pick_in_mask): the tokens of the top blocks, handed inside the attention's mask; GLM-5 Next's
    # (MLA, pick_returned): the columns of the tokens of the top pools, returned by its indexer (take_returned_pick)
    sparse: bool = False
    indexer: nn.Module | None = None
    index_width: int = 0  # the channels of one token's indexer key (its one key head), or all its indexer keeps a token
    pick_block: int = 1
    pick_in_mask: bool = False
    pick_returned: bool = False
    # q_proj is a mixture of attention experts (JetMoE's), whose map() makes the queries: no call of a module returns
    # them (tiled_queries). Each of a token's experts makes a tile, a query head of every KV head in turn: its query
    # heads are query_tiles tiles, its keys and values handed to its attention repeated so, where kvcal's attention
    # reads each KV head's queries together (ModelAdapter.grouped_heads)
    query_mixture: bool = False
    query_tiles: int = 1

    @property
    def query_source(self) -> nn.Module:
        """The module whose output holds the pre-RoPE query."""
        return self.q_norm if self.q_norm is not None else self.q_proj

    @property
    def key_source(self) -> nn.Module:
        """The module whose output holds the pre-RoPE key."""
        return self.k_norm if self.k_norm is not None else self.k_proj

    @property
    def value_source(self) -> nn.Module:
        """The module whose output holds the value."""
        return self.v_norm if self.v_norm is not None else self.v_proj

    def tiled_queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The pre-RoPE queries (batch, tokens, heads * head_dim) of a query_mixture layer, each KV head's together in
        kvcal's channel order, made from its attention's input as its experts' map() makes them."""
        queries = self.q_proj.map(hidden_states)[0]  # (batch, tokens, tiles, KV heads * head_dim)
        grouped = queries.unflatten(-1, (-1, self.head_dim)).transpose(2, 3).flatten(2)
        return rows_in_order(grouped, self.rope_order)

    def source_rows(self, kind: str, output: torch.Tensor, gradient: bool = False) -> torch.Tensor:
        """The query (kind "q"), key ("k") or value ("v") in its source's output (query_source, key_source, value_source),
        or the gradient with respect to it in the gradient with respect to that output (`gradient`), as (batch,
        tokens, heads * head_dim)."""
        if self.heads_first and output.dim() == 4:
            rows = output.transpose(1, 2).flatten(2)
        else:
            normed = {"q": self.q_norm, "k": self.k_norm, "v": self.v_norm}[kind] is not None
            rows = output.flatten(2) if normed else output.flatten(2)[..., self.columns[kind]]
        if self.clip is not None and not gradient:
            rows = rows.clamp(-self.clip, self.clip)
        multiplier = {"q": self.query_multiplier, "k": self.key_multiplier}.get(kind, 1.0)
        if multiplier != 1.0:  # key = output * m, so dL/dkey = dL/doutput / m (a query likewise)
            rows = rows / multiplier if gradient else rows * multiplier
        if kind != "v" and self.rope_norms is not None:
            if gradient:  # the norm's Jacobian drops the gradient along the key: capture takes it after the norm
                raise ValueError("the gradient with respect to a key normed after RoPE is not in its projection's")
            # forward, not __call__: the norm's hooks (capture's) see the model's own calls only
            rows = self.rope_norms["qk".index(kind)].forward(rows.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        if kind == "v":
            if self.value_multiplier != 1.0:  # value = output * m, so dL/dvalue = dL/doutput / m
                rows = rows / self.value_multiplier if gradient else rows * self.value_multiplier
            return rows
        rows = rows_in_order(rows, self.rope_order)
        if self.unrotated_scale is not None:  # read = output * scale, so dL/dread = dL/doutput / scale
            if self.unrotated_scale.device != rows.device:  # moved once: a copy from the host would wait for the device
                self.unrotated_scale = self.unrotated_scale.to(rows.device)
            scale = self.unrotated_scale.to(rows.dtype).repeat(rows.shape[-1] // len(self.unrotated_scale))
            rows = rows / scale if gradient else rows * scale
        return rows

    def weight_gradient(self, kind: str) -> torch.Tensor:
        """dL/dW_k (kind "k") or dL/dW_v ("v"): the gradient's rows of that projection (both: the one projection's
        where the value is made from k_proj's output, value_from_key_projection)."""
        projection = self.k_proj if kind == "k" else self.v_proj
        if isinstance(projection, Conv1D):
            return projection.weight.grad[:, self.columns[kind]].T
        return projection.weight.grad[self.columns[kind]]


def layer_handles(attention: nn.Module, index: int, where: str, heads_first: bool, q_width: int, kv_width: int,
                  head_dim: int, sinks: bool, unscaled_norms: str | None) -> LayerHandles:
    """The handles of `attention` (at `where`), the adapter's layer `index`; `unscaled_norms` "after": its qk_norm, or
    its q_norm and k_norm, where it has them, norm q and k after RoPE (model_types.NORMED_AFTER_ROPE); "before": they
    norm them before RoPE, read from the projections' output (model_types.SHARED_NORM_BEFORE_ROPE,
    FLAT_NORMS_BEFORE_ROPE)."""
    linear = {name: module for name in ("q_proj", "k_proj", "v_proj", "qkv_proj", "Wqkv", "query_key_value", "o_proj",
                                        "dense", "out_proj", "Wo") if isinstance(module := getattr(attention, name, None), nn.Linear)}
    for name in ("dense", "out_proj", "Wo"):  # Phi's and GPT-NeoX's output projection; LFM2's and DBRX's; ModernBERT's
        if name in linear:
            linear.setdefault("o_proj", linear.pop(name))
    if "Wqkv" in linear:  # DBRX's q, k and v side by side
        linear.setdefault("qkv_proj", linear.pop("Wqkv"))
    query_columns = slice(None)
    gated = getattr(attention, "q_gate_proj", None)
    if "q_proj" not in linear and isinstance(gated, nn.Linear) and gated.out_features == 2 * q_width:
        # MiniCPM5-MoE's: each head's query, then its output gate
        linear["q_proj"] = gated
        query_columns = _block_columns(2 * q_width, q_width // head_dim, q=(0, head_dim))["q"]
    fused = getattr(attention, "c_attn", None)
    if isinstance(fused, (Conv1D, nn.Linear)):  # GPT-2's (Conv1D: its weight (inputs, outputs)), GPT-BigCode's
        # q, k and v side by side (GPT-2; GPT-BigCode with multi_query), or each head's in turn (GPT-BigCode's others)
        side_by_side = isinstance(fused, Conv1D) or getattr(attention, "multi_query", False)
        linear.update({"qkv_proj" if side_by_side else "query_key_value": fused, "o_proj": attention.c_proj})
    if getattr(attention, "new_decoder_architecture", False) and "query_key_value" in linear:  # Falcon-40B's
        linear["grouped_qkv"] = linear.pop("query_key_value")
    elif getattr(attention, "multi_query", False) and "query_key_value" in linear:  # Falcon-7B's: side by side
        linear["qkv_proj"] = linear.pop("query_key_value")
    # StableLM's q_layernorm, Hunyuan's query_layernorm
    names = {"q": ("q_norm", "q_layernorm", "query_layernorm"), "k": ("k_norm", "k_layernorm", "key_layernorm"),
             "v": ("v_norm", "v_layernorm")}
    norms = {f"{kind}_norm": next((norm for name in names[kind] if (norm := getattr(attention, name, None)) is not None),
                                  None) for kind in "qkv"}
    if unscaled_norms:  # Llama 4 Scout's qk_norm (none in its NoPE layers, nor in Maverick's), NanoChat's q/k_norm,
        # Chameleon's
        shared = getattr(attention, "qk_norm", None)
        rope_norms = (shared, shared) if shared is not None else (norms["q_norm"], norms["k_norm"])
        norms.update(q_norm=None, k_norm=None, rope_norms=None if None in rope_norms else rope_norms,
                     norms_before_rope=unscaled_norms == "before")
    norms.update(heads_first=heads_first, sinks=attention.sinks if sinks else None, head_dim=head_dim,
                 **_qk_multipliers(attention),
                 value_multiplier=float(getattr(attention, "v_scale", 1.0)),
                 # DBRX's attention holds its clip_qkv, OLMo's and OLMoE's config (they clamp in place, after the hooks)
                 clip=getattr(attention, "clip_qkv", None) or getattr(getattr(attention, "config", None), "clip_qkv", None))
    if norms["key_multiplier"] == 0.0:
        raise KvcalError(f"{where}: its key_multiplier is 0: every key is zero, and no cache is worth keeping")
    # no v_proj: the value is the v norm of k_proj's output (Gemma 4's attention_k_eq_v)
    value_from_key = getattr(attention, "v_proj", 0) is None and norms["v_norm"] is not None
    if "o_proj" in linear and "q_proj" in linear and "k_proj" in linear and ("v_proj" in linear or value_from_key):
        if linear["k_proj"].out_features != kv_width:
            raise KvcalError(f"{where}: k_proj has {linear['k_proj'].out_features} outputs, expected {kv_width} (KV heads x head_dim)")
        return LayerHandles(index, attention, linear["q_proj"], linear["k_proj"], linear.get("v_proj", linear["k_proj"]),
                            **norms, value_from_key_projection=value_from_key,
                            columns=dict(q=query_columns, k=slice(None), v=slice(None)))
    mixture, pair = getattr(attention, "experts", None), getattr(attention, "kv_proj", None)
    if isinstance(pair, nn.Linear) and callable(getattr(mixture, "map", None)):  # JetMoE's: queries from a mixture of
        # attention experts, tiled over the KV heads; k and v side by side in kv_proj
        if pair.out_features != 2 * kv_width or q_width % kv_width:
            raise KvcalError(f"{where}: kv_proj has {pair.out_features} outputs and its experts {q_width // head_dim} "
                             f"query heads; kvcal reads 2 x {kv_width} (k, v) and tiles of {kv_width // head_dim} heads")
        return LayerHandles(index, attention, mixture, pair, pair, **norms, query_mixture=True,
                            query_tiles=q_width // kv_width,
                            columns=dict(q=slice(None), k=slice(0, kv_width), v=slice(kv_width, None)))
    if "o_proj" in linear and "qkv_proj" in linear and hasattr(attention, "mp_num"):  # CodeGen's: q, v and k side by
        # side within each of the mp_num shards it was trained in
        fused, shards = linear["qkv_proj"], attention.mp_num
        if q_width != kv_width or fused.out_features != 3 * q_width or q_width % shards:
            raise KvcalError(f"{where}: qkv_proj has {fused.out_features} outputs for {q_width // head_dim} query and "
                             f"{kv_width // head_dim} KV heads; kvcal reads it as {shards} shards of q, v and k")
        local = q_width // shards
        columns = _block_columns(fused.out_features, shards, q=(0, local), v=(local, local), k=(2 * local, local))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    if "o_proj" in linear and "qkv_proj" in linear:  # q, k, v side by side in its output (Phi-3)
        fused = linear["qkv_proj"]
        outputs = fused.nf if isinstance(fused, Conv1D) else fused.out_features
        if outputs != q_width + 2 * kv_width:
            raise KvcalError(f"{where}: qkv_proj has {outputs} outputs, expected {q_width} + 2 x {kv_width} (q, k, v)")
        columns = dict(q=slice(0, q_width), k=slice(q_width, q_width + kv_width), v=slice(q_width + kv_width, None))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    if "o_proj" in linear and "grouped_qkv" in linear:  # each KV head's queries, then its key and value (Falcon-40B)
        fused, group = linear["grouped_qkv"], q_width // kv_width
        if fused.out_features != q_width + 2 * kv_width:
            raise KvcalError(f"{where}: query_key_value has {fused.out_features} outputs, expected {q_width} + 2 x "
                             f"{kv_width} (q, k, v)")
        columns = _block_columns(fused.out_features, kv_width // head_dim, q=(0, group * head_dim),
                                 k=(group * head_dim, head_dim), v=((group + 1) * head_dim, head_dim))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    if "o_proj" in linear and "query_key_value" in linear:  # each head's q, k and v in turn (GPT-NeoX)
        fused = linear["query_key_value"]
        if q_width != kv_width or fused.out_features != 3 * q_width:
            raise KvcalError(f"{where}: query_key_value has {fused.out_features} outputs for {q_width // head_dim} query and "
                             f"{kv_width // head_dim} KV heads; kvcal reads it as q, k and v of every head in turn")
        columns = _block_columns(fused.out_features, q_width // head_dim, q=(0, head_dim), k=(head_dim, head_dim),
                                 v=(2 * head_dim, head_dim))
        return LayerHandles(index, attention, fused, fused, fused, **norms, columns=columns)
    # each child's type beside its name: a child may bear one of these names and be no linear layer (ZAYA's qkv_proj)
    children = ", ".join(f"{n} ({type(m).__name__})" for n, m in attention.named_children())
    raise KvcalError(f"{where}: could not find separate q_proj, k_proj, v_proj (or one qkv_proj or query_key_value) and o_proj "
                     f"(or dense) linear layers in its attention (found: {children}); {SERVED_ONES}")


def _qk_multipliers(attention: nn.Module) -> dict[str, float]:
    """What the attention multiplies its query and key sources' output by (LayerHandles.query_multiplier,
    key_multiplier): both by Ergo's qk_scale on its global layers (after their NoPE norms), the key alone by Falcon-H1's
    key_multiplier, else 1."""
    scale = getattr(attention, "qk_scale", None)
    if isinstance(scale, torch.Tensor):
        return dict(query_multiplier=float(scale), key_multiplier=float(scale))
    return dict(query_multiplier=1.0, key_multiplier=float(getattr(attention, "key_multiplier", 1.0)))


def _block_columns(outputs: int, blocks: int, **parts: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The columns of a fused projection's `outputs` made of `blocks` equal blocks (one a head, KV head or shard), each
    holding every part (q, k, v) at its (offset, width) in the block: per part, its columns of every block in turn."""
    starts = torch.arange(0, outputs, outputs // blocks)[:, None]
    return {kind: (starts + offset + torch.arange(width)).flatten() for kind, (offset, width) in parts.items()}


def latent_rope(config) -> str:
    """How an MLA model's RoPE pairs channels: "halves" (i, i + d/2, rotate_half), "interleaved" (2i, 2i+1, left so:
    DeepSeek-V2's complex rotation) or "de-interleaved" (2i, 2i+1, rotated into halves order: where rope_interleave
    says so, and always on DEINTERLEAVED_LATENT_ROPE)."""
    if config.model_type == "deepseek_v2":
        return "interleaved"
    if (config.model_type in DEINTERLEAVED_LATENT_ROPE or getattr(config, "rope_interleave", False)
            or config.model_type in DEINTERLEAVED_LATENT_ROPE_FROM_5_25 and transformers_from(5, 25)):
        return "de-interleaved"
    return "halves"


def latent_handles(attention: nn.Module, index: int, where: str, config, indexed: bool) -> LayerHandles:
    """The handles of an MLA attention (LatentAttention): its key is the rotated part of kv_a_proj_with_mqa's output
    (dots.note3's: that part normed by k_rope_only_layernorm, before RoPE), its value the latent, kv_a_layernorm's
    output; its query q_proj's output, or q_b_proj's (a low-rank query), or each head's first channels of q_gate_proj's
    (A.X K2's: a head's query, then its output gate); `indexed`: its attention is DeepSeek Sparse Attention's; its
    widths the attention's own where it has them (dots.note3's sliding layers differ from its others), else the
    config's. LongCat-Flash caches its latent times mla_scale_kv_lora, dots.note3 times kv_lora_scale
    (value_multiplier); their queries' scales are in the query the attention is handed (capture keeps no MLA
    queries)."""
    parts = {name: getattr(attention, name, None)
             for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
    query = getattr(attention, "q_proj", None) or getattr(attention, "q_b_proj", None)
    query_columns = slice(None)
    if query is None and getattr(attention, "q_gate_proj", None) is not None:
        query, per_head = attention.q_gate_proj, config.qk_nope_head_dim + config.qk_rope_head_dim
        heads = query.out_features // (per_head + config.v_head_dim)
        query_columns = _block_columns(query.out_features, heads, q=(0, per_head))["q"]
    if query is None or None in parts.values():
        children = ", ".join(n for n, _ in attention.named_children())
        raise KvcalError(f"{where}: could not find q_proj (or q_b_proj, q_gate_proj), kv_a_proj_with_mqa, kv_a_layernorm, "
                         f"kv_b_proj and o_proj in its latent attention (found: {children})")
    # (the attention's own widths where it has them: a layer without RoPE rotates none, its query's every channel
    # meeting the latent: Mistral Large 4's)
    rank, rotated, nope, value = (getattr(attention, name, getattr(config, name))
                                  for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    if parts["kv_a_proj_with_mqa"].out_features != rank + rotated:
        raise KvcalError(f"{where}: kv_a_proj_with_mqa has {parts['kv_a_proj_with_mqa'].out_features} outputs, expected "
                         f"{rank} + {rotated} (kv_lora_rank + qk_rope_head_dim)")
    latent = LatentAttention(parts["kv_b_proj"], nope, value, rope_in_order=latent_rope(config) == "de-interleaved")
    projection = parts["kv_a_proj_with_mqa"]
    indexer = getattr(attention, "indexer", None) if indexed else None
    index_width = getattr(indexer, "head_dim", None) if indexer is not None else 0
    if not isinstance(index_width, int):
        raise KvcalError(f"{where}: its attention's indexer has no head_dim (the channels of its keys)")
    key_norm = getattr(attention, "k_rope_only_layernorm", None)  # (its output (batch, 1, tokens, rotated channels))
    multiplier = next((getattr(attention, name) for name in ("mla_scale_kv_lora", "kv_lora_scale") if hasattr(attention, name)), 1.0)
    return LayerHandles(index, attention, query, projection, projection, None, key_norm, v_norm=parts["kv_a_layernorm"],
                        heads_first=key_norm is not None,
                        columns=dict(q=query_columns, k=slice(rank, rank + rotated), v=slice(0, rank)), latent=latent,
                        sparse=indexed, indexer=indexer, index_width=index_width,
                        sinks=attention.sinks if config.model_type in SINKS else None, value_multiplier=float(multiplier))


def pick_key_blocks(handles: LayerHandles, query_heads: int, where: str) -> None:
    """Make a GQA layer's handles sparse, as MiniMax-M3's block-sparse layers: its attention's indexer (head_dim: the
    channels of its one key head; block_size: the keys of a block) picks key blocks per group of query heads."""
    indexer = getattr(handles.attention, "indexer", None)
    heads, head_dim, block = (getattr(indexer, name, None) for name in ("num_heads", "head_dim", "block_size"))
    if not all(isinstance(number, int) and number > 0 for number in (heads, head_dim, block)) or query_heads % heads:
        raise KvcalError(f"{where}: an indexed layer whose attention has no indexer of key blocks (num_heads dividing its "
                         f"{query_heads} query heads, head_dim, block_size), which kvcal serves (MiniMax-M3's)")
    handles.sparse, handles.indexer, handles.index_width, handles.pick_block = True, indexer, head_dim, block


def pick_tokens_in_mask(handles: LayerHandles, where: str) -> None:
    """Make a GQA layer's handles sparse, as Qwen4-Exp's QSA layers: its attention's indexer (index_head_dim: the
    channels of its one key head; token_budget, compress_ratio) picks the tokens each query attends and hands them to
    the attention inside its mask."""
    indexer = getattr(handles.attention, "indexer", None)
    width, budget, ratio = (getattr(indexer, name, None) for name in ("index_head_dim", "token_budget", "compress_ratio"))
    if not all(isinstance(number, int) and number > 0 for number in (width, budget, ratio)):
        raise KvcalError(f"{where}: an indexed layer whose attention has no token indexer (index_head_dim, token_budget, "
                         "compress_ratio), which kvcal serves (Qwen4-Exp's)")
    if "attention_mask" not in inspect.signature(handles.attention.forward).parameters:  # (the step's, kvcal.wiring)
        raise KvcalError(f"{where}: its attention takes no attention_mask, beside which kvcal reads its indexer's pick")
    handles.sparse, handles.indexer, handles.index_width, handles.pick_in_mask = True, indexer, width, True


def take_returned_pick(handles: LayerHandles, where: str) -> None:
    """Make an MLA layer's handles read its pick as GLM-5 Next's (PICK_RETURNED): its indexer (head_dim, index_kpool)
    returns the columns of the tokens each query attends, and keeps 2 head_dim + 1 channels a token (its key, its pool
    gate's scores, whether it is real); a layer without one reuses an earlier layer's, handed as prev_topk_indices."""
    attention, indexer = handles.attention, handles.indexer
    if "prev_topk_indices" not in inspect.signature(attention.forward).parameters:
        raise KvcalError(f"{where}: its attention takes no prev_topk_indices, the pick kvcal reads where it runs no "
                         "indexer of its own (GLM-5 Next's shared layers)")
    if indexer is not None:
        head_dim, pool = getattr(indexer, "head_dim", None), getattr(indexer, "index_kpool", None)
        if not all(isinstance(number, int) and number > 0 for number in (head_dim, pool)):
            raise KvcalError(f"{where}: its attention's indexer has no head_dim and index_kpool (the channels of its "
                             "keys, the tokens of a pool), which kvcal serves (GLM-5 Next's)")
        handles.index_width = 2 * head_dim + 1
    handles.pick_returned = True
