"""Decode backends of the runtime cache: what attends over one layer's stores at a decode step, and what encodes
its appends.

Three decode backends, tried in this order for each layer by `choose`: the CUDA kernels (the tensor-core kernel,
kvcal.runtime.tensor_core, one launch per layer and step over its bodies and fp16 segments; kvcal.runtime.kernels
prepares it) on a CUDA device with CuPy, the compiled CPU kernel
(kvcal.runtime.cpu_kernel) on the CPU, and the torch reference (kvcal.runtime.reference), which serves everything
and is the specification the others are tested against. A backend says why it does not serve a layer
(`Backend.refusal`, from the layer's `LayerShape` alone: codecs, packing layouts, head counts, device), so the choice
and its reasons can be shown before any model runs (`kvcal inspect BUNDLE --device cpu|cuda`). A chosen backend is
bound to its layer once (`Backend.bind`), at the layer's first decode step, and the bound `LayerDecoder` keeps what
it made for the layer's stores (kernel descriptors, the tensor-core kernel's share).

Every decoder reads sliding windows: a sequence attends over its last `window` tokens, the stored ones before them
(kept to the block a window drops whole) weigh nothing.

Appends: each packed body quantizes its appends with the CUDA append kernels, on the CPU with the compiled appends
(kvcal.runtime.cpu_kernel.CpuAppend), else with the torch codec (`append_encoder`, `append_path`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.adapters import kv_shapes, kv_widths, latent_attention, query_heads
from kvcal.errors import KvcalError
from kvcal.packing import layout_for
from kvcal.quantizers import CodecKind
from kvcal.runtime import cpu_kernel, kernels, reference, tensor_core
from kvcal.runtime.segments import fp16_rows_alike
from kvcal.spans import AttentionSpan


@dataclass(frozen=True)
class LayerShape:
    """What decides a layer's backend: its (key codec, value codec) body pairs, one per kernel launch (a Cocktail
    store has several), whether keys are stored before RoPE, the attention's head counts, the device, whether K
    and V keep the same tokens fp16 at every step (kvcal.runtime.segments.fp16_rows_alike), whether the values are
    MLA's latent, which the query's latent part scores too (kvcal.adapters.LatentAttention), and a KV head's value
    channels where they are not head_dim's (MiMo-V2-Flash's narrower values; None: head_dim's)."""

    pairs: tuple[tuple, ...]
    pre_rope: bool
    heads: int
    kv_heads: int
    head_dim: int
    device: torch.device
    fp16_rows_alike: bool = True
    latent: bool = False
    value_dim: int | None = None


# The most tokens a step the CPU kernel reads the stored cache for, as more query heads (stored_attention): past them
# one dequantization of the cache and a matrix product are faster (benchmarks/results/short_steps_*).
CPU_SHORT_STEP_TOKENS = 128
# The most passes of the tensor-core kernel over the cache a step's queries may take (kernels.head_passes): 8 passes
# over 4-bit codes read as many bytes as two fp16 reads, the torch reference writes and reads an fp32 copy of it (a
# bound by bytes; the GPU campaign has not measured it).
CUDA_SHORT_STEP_PASSES = 8


def short_step_tokens(path: str, group: int) -> int:
    """The most tokens a step the decoder of `path` ("cpu-kernel", "tensor-core") reads the stored cache for, with
    `group` query heads a KV head (RuntimeLayer's short steps); 0 for the torch reference, which does not."""
    if path == "cpu-kernel":
        return CPU_SHORT_STEP_TOKENS
    if path == "tensor-core":  # head_passes: ceil(group * m / MAX_GQA) passes
        return CUDA_SHORT_STEP_PASSES * kernels.MAX_GQA // group
    return 0

LATENT_REFUSAL = "MLA's latent attention (its values scored too): the tensor-core kernel reads no latent yet"


class LayerDecoder:
    """A backend bound to one layer: `decode` attends the step's query over the layer's stores (the step's tokens
    already appended); `path` names what serves it."""

    path = ""

    def decode(self, query: torch.Tensor, plan, scaling: float, kv_heads: int, span: AttentionSpan | None) -> torch.Tensor:
        """query (B, H, 1, d) -> (B, 1, H, d) in the query's dtype; span: the stored tokens each sequence's query sees
        (its sliding window's or chunk's; None: all of them)."""
        raise NotImplementedError

    def stored_attention(self, query: torch.Tensor, plan, scaling: float, kv_heads: int,
                         span: AttentionSpan | None = None):
        """Attention of a step of m queries a sequence over its tokens stored before the step, without sinks: query
        (B, H, m, d) -> (out (B, m, H, d_v), log-sum-exp of each row's scores (B, m, H); -inf where a query sees
        none) float32, to merge with the step's own tokens' (RuntimeLayer's short steps); span: the layer's window or
        chunk, each query seeing the stored tokens of its own (None: all of them). None where this decoder does not
        serve it, or a step this long reads faster the reference's way (the caller reads the stores itself)."""
        return None


def _reads_short_step(path: str, layer, group: int, m: int, span: AttentionSpan | None) -> bool:
    """Whether the decoder of `path` reads the stored tokens for a step of m queries a sequence (short_step_tokens),
    which under a span needs the stored tokens in order (Cocktail's stores keep them by chunk)."""
    return m <= short_step_tokens(path, group) and (span is None or layer.keys_store.ordered)


def _step_firsts(layer, plan, span: AttentionSpan | None, heads: int) -> tuple[list[int] | None, torch.Tensor | None]:
    """Under a span, each sequence's first stored token a step's queries see (its first real query's), and each query
    row's ((batch, heads * m) int64, rows as _step_as_heads orders them), by the queries' positions; (None, None)
    without a span."""
    if span is None:
        return None, None
    dropped = torch.tensor(layer.keys_store.dropped)[:, None]
    in_sequence = plan.shared("in sequence, on the host", lambda: plan.in_sequence().cpu())  # one copy a step
    columns = span.first_seen(in_sequence) - dropped
    first = (span.first_seen(torch.tensor(plan.before)[:, None]) - dropped).clamp(min=0)[:, 0]
    row_first = torch.maximum(columns, first[:, None])[:, None].expand(-1, heads, -1).reshape(len(first), -1)
    return first.tolist(), row_first


def _step_as_heads(query: torch.Tensor) -> torch.Tensor:
    """(B, H, m, d) -> (B, H * m, d): a step's queries as more query heads of each KV head's group (its heads' rows
    stay together: GQA group g becomes g * m)."""
    batch, heads, m, dim = query.shape
    return query.reshape(batch, heads * m, dim)


def _heads_as_step(out: torch.Tensor, lse: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_step_as_heads' inverse on the outputs: (B, H * m, d_v), (B, H * m) -> (B, m, H, d_v), (B, m, H)."""
    batch = out.shape[0]
    return out.view(batch, -1, m, out.shape[-1]).transpose(1, 2), lse.view(batch, -1, m).transpose(1, 2)


class Backend:
    name = ""

    def refusal(self, shape: LayerShape) -> str | None:
        """Why this backend does not serve a layer of this shape, or None when it does."""
        raise NotImplementedError

    def bind(self, layer, shape: LayerShape) -> LayerDecoder:
        """The decoder of `layer` (a kvcal.runtime.layer.RuntimeLayer with allocated stores)."""
        raise NotImplementedError


class TorchReference(Backend):
    name = "torch-reference"

    def refusal(self, shape: LayerShape) -> str | None:
        return None

    def bind(self, layer, shape: LayerShape) -> LayerDecoder:
        return ReferenceDecoder(layer)


class ReferenceDecoder(LayerDecoder):
    """The batched torch reference: every sequence's cache read at once (padded to the longest), one attention with
    a mask of each sequence's own tokens (and span). An MLA layer's query is its rotated part beside its latent one,
    over keys and values side by side (one KV head: one attention sums both scores)."""

    path = "reference"

    def __init__(self, layer):
        self.layer = layer

    def decode(self, query, plan, scaling, kv_heads, span, chosen: torch.Tensor | None = None):
        """LayerDecoder.decode; chosen (B, groups, tokens): the stored tokens each sequence's query attends among those
        it sees, per group of query heads (a sparse layer's indexer's pick: StepPlan.chosen_rows), None: all."""
        layer = self.layer
        keys = layer.keys_store.read_batch(plan.memo, kv_heads)  # (B, kv_heads, tokens, head_dim)
        values = layer.values_store.read_batch(plan.memo, kv_heads)
        tokens = keys.shape[2]
        if layer.pre_rope:
            keys = reference.rotate(keys, *plan.rope(tokens, layer.inv_freq, layer.rope_scaling, layer.keys_store.dropped))
        if layer.latent is not None:
            keys = torch.cat([keys, values], -1)
        visible = plan.visible(tokens, span, layer.keys_store)
        if chosen is not None:
            visible = visible[:, None] & chosen
        out = reference.decode_attention(query, keys, values, visible, scaling, layer.sinks, layer.softcap)
        return plan.zero_padding(out.transpose(1, 2)).to(query.dtype)


def _launches(layer) -> list[kernels.Segments]:
    """The layer's kernel launches: (sink, body, recent) of K beside V's, per launch (made once: they keep their
    descriptors)."""
    return [kernels.Segments(k, v) for k, v in zip(layer.keys_store.kernel_segments(), layer.values_store.kernel_segments())]


class CpuKernel(Backend):
    name = "cpu-kernel"

    def refusal(self, shape: LayerShape) -> str | None:
        if shape.device.type != "cpu":
            return f"not a CPU device ({shape.device})"
        if cpu_kernel.library() is None:
            return "the CPU kernel is not built here (no C++ compiler, a failed build, or KVCAL_CPU_KERNEL=0)"
        unserved = [pair for pair in shape.pairs if not cpu_kernel.decode_supported(*pair)]
        if unserved:
            return f"it reads no {_codec_names(unserved[0])} bodies"
        return None

    def bind(self, layer, shape: LayerShape) -> LayerDecoder:
        return CpuDecoder(layer)


class CpuDecoder(LayerDecoder):
    """One call of the CPU kernel per launch, every sequence at once; it reads spans (each sequence's first visible
    token) itself. An MLA layer's query is its rotated part beside its latent one, which scores the values."""

    path = "cpu-kernel"

    def __init__(self, layer):
        self.layer, self.launches = layer, _launches(layer)

    def decode(self, query, plan, scaling, kv_heads, span):
        first = plan.first_visible(span, self.layer.keys_store.dropped)
        out = self._attend(query[:, :, 0], plan, scaling, kv_heads, first)
        return plan.zero_padding(out[:, None]).to(query.dtype)  # a sequence with no token this step gets zeros

    def stored_attention(self, query, plan, scaling, kv_heads, span=None):
        _, heads, m, _ = query.shape
        if not _reads_short_step(self.path, self.layer, heads // kv_heads, m, span):
            return None
        first, row_first = _step_firsts(self.layer, plan, span, heads)
        out, lse = self._attend(_step_as_heads(query), plan, scaling, kv_heads, first, True, row_first)
        return _heads_as_step(out, lse, m)

    def _attend(self, query, plan, scaling, kv_heads, first, with_lse=False, row_first=None):
        """cpu_kernel.decode_attention of query (B, heads, d) over the stores as they are, from each sequence's
        `first` stored token (None: all), each query row from its row_first's (None: its sequence's); with_lse:
        without sinks, beside each row's log-sum-exp."""
        layer = self.layer
        dropped = layer.keys_store.dropped
        rope = None
        if layer.pre_rope and layer.widths[0]:  # (a key of no channel has nothing to rotate)
            tokens = max(layer.keys_store.count(b) for b in range(len(dropped)))
            rope = layer.cache.rope_rows(plan.stored_positions(dropped), tokens, layer.inv_freq, layer.rope_scaling,
                                         layer.drops)
        return cpu_kernel.decode_attention(query, self.launches, kv_heads, scaling, rope, first,
                                           None if with_lse else layer.sinks, layer.softcap, layer.widths[1] // kv_heads,
                                           layer.latent is not None, with_lse, row_first)


class CudaKernels(Backend):
    name = "cuda-kernels"

    def refusal(self, shape: LayerShape) -> str | None:
        if not kernels.cuda_ready(shape.device):
            return f"not a CUDA device with CuPy ({shape.device})"
        return cuda_refusal(shape)

    def bind(self, layer, shape: LayerShape) -> LayerDecoder:
        return CudaDecoder(layer, shape)


def cuda_refusal(shape: LayerShape) -> str | None:
    """Why the tensor-core kernel would not serve a layer of this shape on any CUDA device, or None."""
    if shape.latent:
        return LATENT_REFUSAL
    if shape.value_dim not in (None, shape.head_dim):
        return (f"values of {shape.value_dim} channels a KV head beside keys of {shape.head_dim}: the tensor-core kernel "
                "reads values as wide as keys")
    refused = kernels.heads_refusal(shape.heads, shape.kv_heads, shape.head_dim)
    if refused is not None:
        return refused
    for pair in shape.pairs:
        try:
            for gqa in set(kernels.head_passes(shape.heads // shape.kv_heads)):
                tensor_core.variant_for_codecs(*pair, shape.head_dim, gqa, shape.pre_rope)
        except KvcalError as exc:
            return f"{_codec_names(pair)}: {exc}"
        if not (tensor_core.segment_blocks_read_bodies(pair[0]) or shape.fp16_rows_alike):
            return (f"K and V keep different tokens fp16 beside {_codec_names(pair)} bodies; the tensor-core kernel's "
                    "segment blocks read only fp16 rows of the same tokens there")
    return None


class CudaDecoder(LayerDecoder):
    """The tensor-core kernel, one launch per cache launch (its body blocks over the body rows K and V both hold, its
    segment blocks over the other tokens), the last merging every launch's splits; it reads spans (the tokens before a
    sequence's first visible one weigh nothing)."""

    path = "tensor-core"

    def __init__(self, layer, shape: LayerShape):
        self.layer, self.launches = layer, _launches(layer)
        inv_freq = layer.inv_freq if layer.pre_rope else None
        self.served = [tensor_core.serve(segments, shape.heads, shape.kv_heads, shape.head_dim, inv_freq, layer.rope_scaling,
                                         layer.softcap)
                       for segments in self.launches]

    def decode(self, query, plan, scaling, kv_heads, span):
        dropped = self.layer.keys_store.dropped
        out = kernels.decode_attention(query[:, :, 0], self.launches, kv_heads, scaling, plan.stored_positions(dropped),
                                       self.served, step=plan.kernel_step(query.device),
                                       first=plan.first_visible(span, dropped), sinks=self.layer.sinks)
        return plan.zero_padding(out[:, None]).to(query.dtype)  # a sequence with no token this step gets zeros

    def stored_attention(self, query, plan, scaling, kv_heads, span=None):
        _, heads, m, _ = query.shape
        if not _reads_short_step(self.path, self.layer, heads // kv_heads, m, span):
            return None
        first, row_first = _step_firsts(self.layer, plan, span, heads)
        dropped = self.layer.keys_store.dropped
        out, lse = kernels.decode_attention(_step_as_heads(query), self.launches, kv_heads, scaling,
                                            plan.stored_positions(dropped), self.served,
                                            step=plan.kernel_step(query.device), first=first, with_lse=True,
                                            row_first=row_first)
        return _heads_as_step(out, lse, m)


BACKENDS: tuple[Backend, ...] = (CudaKernels(), CpuKernel(), TorchReference())


@dataclass(frozen=True)
class Choice:
    """The backend that serves a layer, and why each one tried before it does not."""

    backend: Backend
    passed_over: tuple[tuple[str, str], ...]

    def why(self) -> str:
        return "; ".join(f"not {name}: {reason}" for name, reason in self.passed_over)


def choose(shape: LayerShape) -> Choice:
    passed_over = []
    for backend in BACKENDS:
        reason = backend.refusal(shape)
        if reason is None:
            return Choice(backend, tuple(passed_over))
        passed_over.append((backend.name, reason))
    raise AssertionError("the torch reference serves every layer")


def _codec_names(pair: tuple) -> str:
    return " / ".join(codec_name(codec) for codec in pair)


def codec_name(codec) -> str:
    """A body codec as its kind and code width, e.g. 'nuq3 per-channel thresholds, outliers'."""
    kind = codec.kind
    if kind is CodecKind.PERMUTED_GROUPS:
        return f"skvq{codec.bits:g}{' fp8' if codec.fp8 else ''}"
    if kind in (CodecKind.UNIFORM_TOKEN, CodecKind.UNIFORM_CHANNEL):
        return f"int{codec.bits:g} per {'token' if kind is CodecKind.UNIFORM_TOKEN else 'channel'} g{codec.group}"
    if kind in kernels.CODEBOOKS:
        thresholds = "per-channel" if kind is CodecKind.CODEBOOK_CHANNEL else "per-token"
        return f"nuq{codec.bits:g} {thresholds} thresholds{', outliers' if codec.outlier_fraction else ''}"
    return f"{kind.value} {codec.bits:g}-bit"


# ---------------------------------------------------------------------------------------------------------
# appends


def append_encoder(codec, width: int, layout: str, device, cuda_rows_together: bool = True):
    """What a packed body quantizes its appends with: the CUDA append kernels (laying rows out as cuda_rows_together
    says: kernels.AppendKernels), on the CPU the compiled appends, or None (the torch codec)."""
    return (kernels.append_encoder(codec, width, layout, device, cuda_rows_together)
            or cpu_kernel.append_encoder(codec, width, layout, device))


def append_path(codec, width: int, device) -> str:
    """What would encode a body's appends on `device` (the CUDA append kernels counted as present on a CUDA device):
    'cuda-append', 'cpu-append' or 'torch codec'."""
    layout = layout_for(codec.bits)
    if torch.device(device).type == "cuda":
        return "cuda-append" if kernels.append_supported(codec, width, layout) else "torch codec"
    return "cpu-append" if cpu_kernel.append_encoder(codec, width, layout, device) is not None else "torch codec"


# ---------------------------------------------------------------------------------------------------------
# what would serve a bundle


@dataclass(frozen=True)
class LayerPlan:
    """What serves one layer's decode steps on a kind of device: its bodies, its fp16 segments (sinks, windows,
    residuals, recent pivotal tokens), its K and V appends, why not something faster, and the longest step of several
    tokens its decoder reads the stored tokens for (the torch reference's way beyond: 0 where it serves them all)."""

    layer: int
    bodies: str
    fp16_segments: str
    key_append: str
    value_append: str
    why: str
    short_steps: int = 0  # the most tokens a step whose decoder reads the stored cache (short_step_tokens)


def _has_fp16_segments(recipe) -> bool:
    return bool(recipe.sink or recipe.window or recipe.residual or recipe.rpc_k or recipe.rpc_v
                or recipe.format.body_block(recipe, keys=True) > 1)


def bundle_plan(bundle, device_type: str) -> list[LayerPlan]:
    """Per layer of `bundle` (a kvcal.bundle.Bundle), what serves it on device_type "cpu" (this machine: whether
    the CPU kernel builds here counts) or "cuda" (any CUDA device with CuPy: what the kernels read, whether or not
    one is here)."""
    if device_type not in ("cpu", "cuda"):
        raise KvcalError(f"device {device_type!r}: say cpu or cuda")
    device = torch.device(device_type)
    latent, value_widths = latent_attention(bundle.fingerprint), kv_widths(bundle.fingerprint, "v")
    plans = []
    for i, (recipe, heads, (kv_heads, head_dim)) in enumerate(zip(bundle.layers, query_heads(bundle.fingerprint),
                                                                  kv_shapes(bundle.fingerprint))):
        widths = (kv_heads * head_dim, value_widths[i])
        codecs = bundle.layer_codecs(i)
        blocks = tuple(recipe.format.body_block(recipe, keys) for keys in (True, False))
        alike = fp16_rows_alike(recipe.format.policy(recipe), blocks, (recipe.rpc_k, recipe.rpc_v))
        shape = LayerShape(((codecs.key_codec, codecs.value_codec),), codecs.key_pre_rope, heads, kv_heads, head_dim, device,
                           alike, latent, None if latent else value_widths[i] // kv_heads)
        if device_type == "cuda":
            refused = cuda_refusal(shape)
            bodies = segments = "reference" if refused else "tensor-core"
            why = f"not cuda-kernels: {refused}" if refused else ""
            passes = kernels.head_passes(heads // kv_heads)
            if not refused and len(passes) > 1:
                why = f"{heads // kv_heads} query heads per KV head in {len(passes)} passes of {max(passes)} or fewer (each reads the cache)"
        else:
            choice = choose(shape)
            bodies = segments = {"cpu-kernel": "cpu-kernel", "torch-reference": "reference"}[choice.backend.name]
            why = choice.why() if choice.backend.name != "cpu-kernel" else ""
        key_append, value_append = (append_path(codec, width, device)
                                    for codec, width in zip((codecs.key_codec, codecs.value_codec), widths))
        plans.append(LayerPlan(i, bodies, segments if _has_fp16_segments(recipe) else "-", key_append, value_append, why,
                               short_step_tokens(bodies, heads // kv_heads)))
    return plans
