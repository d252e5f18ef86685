"""The capture pass behind `kvcal profile-gradients`: one forward and one backward per window.

From that single backward it collects, per decoder layer:
- KVmix importance ||dL/dW_k||_F and ||dL/dW_v||_F, averaged over windows;
- KVQuant Fisher information (dL/dK)^2, (dL/dV)^2 w.r.t. the pre-RoPE key and the value, kept for
  a seeded subsample of token rows, aligned row by row with the stored pre-RoPE K, post-RoPE K and V;
- streaming per-channel min / max / absmax over every non-sink token;
- a few whole windows of pre-RoPE Q, K and V, for fitters whose objective is the attention output (none of an MLA
  model, whose attention over them would need its queries absorbed into the latent: kvcal.adapters.LatentAttention).

Host memory is bounded by the settings, not by the calibration set (widths summed over the layers, which differ
where the layers' heads do: Gemma 4; values as wide as keys but in MLA, whose value is its latent):
  rows x (3 sum(k_width) + 2 sum(v_width)) x 4 B   (sampled rows, float32; rows = max_tokens_per_layer, by default
                                                     every row past the sink while this stays under SAMPLE_BUDGET_BYTES)
+ store_windows x seqlen x sum(q_width + k_width + v_width) x 2 B   (whole windows, float16)
+ 6 x sum(k_width) x 4 B + 3 x sum(v_width) x 4 B   (streaming statistics)
+ the model and one window's activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcal.adapters import LayerHandles, ModelAdapter, text_inputs
from kvcal.errors import KvcalError
from kvcal.rope import rotate_keys, stored_inv_freq

STAT_TENSORS = ("k_pre", "k_post", "v")  # tensors with streaming per-channel statistics
SAMPLE_TENSORS = ("k_pre", "k_post", "v", "k_pre_fisher", "v_fisher")
VALUE_TENSORS = ("v", "v_fisher")  # of the values' width, the others of the keys' (they differ in MLA)
# Default cap on the sampled rows' memory. The rows set the fit's quality (per-channel thresholds are 0.5% tail
# quantiles): SmolLM2's nuq3 on wikitext-2 test went from +7.78% (2048 rows) to +6.27% (all 8176; mixed_widths.md).
SAMPLE_BUDGET_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class CaptureSettings:
    sink: int = 1
    max_tokens_per_layer: int | None = None  # None: every row past the sink, within SAMPLE_BUDGET_BYTES
    store_windows: int = 2
    seed: int = 0

    def row_limit(self, key_widths: list[int], value_widths: list[int]) -> int:
        """Token rows per layer to keep as samples, for layers of these key and value widths."""
        if self.max_tokens_per_layer is not None:
            return self.max_tokens_per_layer
        row_bytes = 4 * sum(len(VALUE_TENSORS) * v + (len(SAMPLE_TENSORS) - len(VALUE_TENSORS)) * k
                            for k, v in zip(key_widths, value_widths))
        return max(1, SAMPLE_BUDGET_BYTES // row_bytes)


@dataclass
class CaptureResult:
    importance_k: torch.Tensor  # (layers,)
    importance_v: torch.Tensor
    tensors: dict[str, torch.Tensor]  # per-layer samples, statistics and windows, by artifact name
    counts: dict[str, int] = field(default_factory=dict)


def select_rows(nsamples: int, seqlen: int, sink: int, limit: int, seed: int) -> torch.Tensor:
    """Seeded subsample of (window, position) rows past the sink, sorted: (rows, 2) int64.
    The same rows are used for every layer, so statistics of different layers stay comparable."""
    per_window = seqlen - sink
    total = nsamples * per_window
    if total <= limit:
        flat = np.arange(total)
    else:
        flat = np.sort(np.random.default_rng(seed).choice(total, size=limit, replace=False))
    return torch.from_numpy(np.stack([flat // per_window, sink + flat % per_window], axis=1))


class _LayerRecorder:
    """Per-layer buffers, filled window by window."""

    def __init__(self, rows: int, key_width: int, value_width: int, q_width: int, windows: int, seqlen: int):
        width = {name: value_width if name in VALUE_TENSORS else key_width for name in SAMPLE_TENSORS}
        self.samples = {name: torch.zeros(rows, width[name]) for name in SAMPLE_TENSORS}
        self.minimum = {name: torch.full((width[name],), float("inf")) for name in STAT_TENSORS}
        self.maximum = {name: torch.full((width[name],), float("-inf")) for name in STAT_TENSORS}
        self.windows = {
            "q": torch.zeros(windows, seqlen, q_width, dtype=torch.float16),
            "k": torch.zeros(windows, seqlen, key_width, dtype=torch.float16),
            "v": torch.zeros(windows, seqlen, value_width, dtype=torch.float16),
        }

    def update_statistics(self, name: str, rows: torch.Tensor) -> None:
        self.minimum[name] = torch.minimum(self.minimum[name], rows.amin(dim=0))
        self.maximum[name] = torch.maximum(self.maximum[name], rows.amax(dim=0))

    def named_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{layer}"
        out = {}
        for name in ("k_pre", "k_post", "v"):
            out[f"{prefix}.{name}.samples"] = self.samples[name]
            out[f"{prefix}.{name}.min"] = self.minimum[name]
            out[f"{prefix}.{name}.max"] = self.maximum[name]
            out[f"{prefix}.{name}.absmax"] = torch.maximum(self.minimum[name].abs(), self.maximum[name].abs())
        out[f"{prefix}.k_pre.fisher"] = self.samples["k_pre_fisher"]
        out[f"{prefix}.v.fisher"] = self.samples["v_fisher"]
        if self.windows["q"].shape[0]:
            for name, tensor in self.windows.items():
                out[f"{prefix}.windows.{name}"] = tensor
        return out


class _ActivationHooks:
    """Forward hooks that keep each layer's pre-RoPE Q/K and V of the current window, and tensor
    hooks that keep dL/dK and dL/dV when the backward pass reaches them. Where the value is made from k_proj's output
    (value_from_key_projection), they also keep dL/dW_v, the part of k_proj's weight gradient that flows through
    the value: the v norm's input is replaced by an alias of it, whose gradient is the value path's alone. Where q and k
    are normed after RoPE (LayerHandles.rope_norms), the key's gradient is taken at its norm's output, still rotated
    (dL/dK_post), or not yet where they are normed before it (norms_before_rope): on that norm's second call in the
    attention where one norm serves both (the first norms the query)."""

    def __init__(self, adapter: ModelAdapter):
        self.activations: dict[tuple[str, int], torch.Tensor] = {}
        self.gradients: dict[tuple[str, int], torch.Tensor] = {}
        self.value_weight_gradients: dict[int, torch.Tensor] = {}
        self.keep_queries = False
        self._projection_inputs: dict[int, torch.Tensor] = {}
        self._norm_calls: dict[int, int] = {}
        self._handles = []
        for handles in adapter.layers:
            i = handles.index
            normed_after_rope = handles.rope_norms is not None
            self._handles.append(handles.key_source.register_forward_hook(self._hook("k", i, not normed_after_rope, handles)))
            if normed_after_rope:
                self._handles.append(handles.attention.register_forward_pre_hook(self._count_norm_calls_from_zero(i)))
                self._handles.append(handles.rope_norms[1].register_forward_hook(self._keep_rotated_key_gradient(handles)))
            self._handles.append(handles.value_source.register_forward_hook(self._hook("v", i, True, handles)))
            if handles.query_mixture:  # (JetMoE's queries, which no module's call returns)
                self._handles.append(handles.attention.register_forward_pre_hook(self._keep_attention_input(i),
                                                                                 with_kwargs=True))
            else:
                self._handles.append(handles.query_source.register_forward_hook(self._hook("q", i, False, handles)))
            if handles.value_from_key_projection:
                self._handles.append(handles.k_proj.register_forward_hook(self._keep_projection_input(i)))
                self._handles.append(handles.v_norm.register_forward_pre_hook(self._split_value_path(i)))

    def _keep_attention_input(self, layer: int):
        def before_forward(module, args, kwargs):
            if self.keep_queries:
                self.activations["attention input", layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs
                                                              else args[0]).detach()

        return before_forward

    def queries(self, handles: LayerHandles) -> torch.Tensor:
        """The layer's pre-RoPE queries of the window (batch, tokens, heads * head_dim); a query_mixture layer's made
        from its attention's input after the window's forward, whose output recorders would count its router's call
        again."""
        if not handles.query_mixture:
            return self.activations["q", handles.index]
        with torch.no_grad():
            return handles.tiled_queries(self.activations["attention input", handles.index])

    def _keep_projection_input(self, layer: int):
        def on_forward(module, inputs, output):
            self._projection_inputs[layer] = inputs[0].detach()

        return on_forward

    def _count_norm_calls_from_zero(self, layer: int):
        def before_forward(module, inputs):
            self._norm_calls[layer] = 0

        return before_forward

    def _keep_rotated_key_gradient(self, handles: LayerHandles):
        layer, key_call = handles.index, 2 if handles.rope_norms[0] is handles.rope_norms[1] else 1

        def on_forward(module, inputs, output):  # output: (batch, tokens, kv heads, head_dim), heads first where so,
            # or (batch * tokens, kv heads, head_dim) (Chameleon's): as the key's rows (batch, tokens, channels)
            self._norm_calls[layer] += 1
            if self._norm_calls[layer] == key_call:
                rows = self.activations["k", layer].shape[:2]
                output.register_hook(lambda grad: self.gradients.__setitem__(
                    ("k", layer), (grad.transpose(1, 2) if handles.heads_first else grad).detach().reshape(*rows, -1)))

        return on_forward

    def _split_value_path(self, layer: int):
        def before_forward(module, inputs):
            alias = inputs[0].view_as(inputs[0])

            def on_gradient(grad):  # (batch, tokens, kv heads, head_dim) . (batch, tokens, hidden) summed over tokens
                self.value_weight_gradients[layer] = torch.einsum("btc,bth->ch", grad.flatten(2).double(),
                                                                  self._projection_inputs[layer].double())

            alias.register_hook(on_gradient)
            return (alias, *inputs[1:])

        return before_forward

    def _hook(self, kind: str, layer: int, with_grad: bool, handles: LayerHandles):
        def on_forward(module, inputs, output):
            if kind == "q" and not self.keep_queries:
                return
            self.activations[kind, layer] = handles.source_rows(kind, output.detach())
            if with_grad:
                output.register_hook(lambda grad: self.gradients.__setitem__(
                    (kind, layer), handles.source_rows(kind, grad.detach(), gradient=True)))

        return on_forward

    def clear(self) -> None:
        self.activations.clear()
        self.gradients.clear()
        self.value_weight_gradients.clear()
        self._projection_inputs.clear()

    def weight_gradients(self, handles: LayerHandles) -> dict[str, torch.Tensor]:
        """dL/dW_k and dL/dW_v of one layer, after the backward pass: its projections' gradients, or where the value
        is made from k_proj's output, k_proj's split by the path it flowed through."""
        gradients = {kind: handles.weight_gradient(kind).double() for kind in "kv"}
        if handles.value_from_key_projection:
            value = self.value_weight_gradients[handles.index]
            gradients = {"k": gradients["k"] - value, "v": value}
        return gradients

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _enable_projection_grads_only(model: torch.nn.Module, adapter: ModelAdapter) -> dict[torch.nn.Parameter, bool]:
    """Only W_k and W_v need weight gradients; the rest stay frozen to save memory and time."""
    previous = {p: p.requires_grad for p in model.parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for handles in adapter.layers:
        handles.k_proj.weight.requires_grad_(True)
        handles.v_proj.weight.requires_grad_(True)
    return previous


def profile_gradients(
    model: torch.nn.Module,
    adapter: ModelAdapter,
    windows: torch.Tensor,
    settings: CaptureSettings,
    on_window: Callable[[int], None] | None = None,
) -> CaptureResult:
    """Run one forward + backward per row of `windows` (nsamples, seqlen) and collect the profile."""
    if torch.is_inference_mode_enabled():
        raise KvcalError("the gradient profile runs backward passes, which torch.inference_mode() forbids: profile "
                         "outside that block")
    nsamples, seqlen = windows.shape
    num_layers = len(adapter.layers)
    rows = select_rows(nsamples, seqlen, settings.sink, settings.row_limit(adapter.kv_widths, adapter.value_widths),
                       settings.seed)
    stored = 0 if adapter.latent else min(settings.store_windows, nsamples)
    recorders = [_LayerRecorder(len(rows), key_width, value_width, heads * head_dim, stored, seqlen)
                 for key_width, value_width, heads, head_dim in zip(adapter.kv_widths, adapter.value_widths,
                                                                    adapter.query_heads, adapter.head_dims)]
    importance = torch.zeros(2, num_layers, dtype=torch.float64)
    positions = torch.arange(seqlen) + adapter.first_position  # (RoPE's: the model's position ids)
    # read once, not per window: the frequencies of a forward over seqlen tokens (LongRoPE's long ones past its switch)
    rope = [(adapter.layer_inv_freq(i, seqlen), adapter.layer_rope_scaling(i)) for i in range(num_layers)]
    input_device = model.get_input_embeddings().weight.device
    counts = {"forward_passes": 0, "backward_passes": 0}

    previous_grad_flags = _enable_projection_grads_only(model, adapter)
    hooks = _ActivationHooks(adapter)
    try:
        for w in range(nsamples):
            hooks.clear()
            hooks.keep_queries = w < stored
            ids = windows[w : w + 1].to(input_device)
            with torch.enable_grad():  # (also under a caller's torch.no_grad())
                # (transformers shifts the labels itself)
                loss = model(input_ids=ids, labels=ids, use_cache=False, **text_inputs(model, ids)).loss
            counts["forward_passes"] += 1
            loss.backward()
            counts["backward_passes"] += 1
            window_rows = rows[rows[:, 0] == w]
            slots = torch.nonzero(rows[:, 0] == w).flatten()
            for handles, recorder in zip(adapter.layers, recorders):
                i = handles.index
                for slot, gradient in enumerate(hooks.weight_gradients(handles).values()):
                    importance[slot, i] += gradient.norm().item()  # importance stays on the CPU
                handles.k_proj.weight.grad = handles.v_proj.weight.grad = None
                key = hooks.activations["k", i][0].float().cpu()
                value = hooks.activations["v", i][0].float().cpu()
                key_post = rotate_keys(key, positions, adapter.kv_heads[i], *rope[i])
                key_gradient = hooks.gradients["k", i][0].float().cpu()
                if handles.rope_norms is not None:  # taken at the norm's output, in the model's channel order
                    key_gradient = adapter.rows_in_rope_order(key_gradient, i)
                    if not handles.norms_before_rope:  # dL/dK_post rotated back: RoPE's transpose is its inverse
                        key_gradient = rotate_keys(key_gradient, -positions, adapter.kv_heads[i], *rope[i])
                per_token = {
                    "k_pre": key,
                    "k_post": key_post,
                    "v": value,
                    "k_pre_fisher": key_gradient.square(),
                    "v_fisher": hooks.gradients["v", i][0].float().cpu().square(),
                }
                for name in STAT_TENSORS:
                    recorder.update_statistics(name, per_token[name][settings.sink :])
                for name in SAMPLE_TENSORS:
                    recorder.samples[name][slots] = per_token[name][window_rows[:, 1]]
                if w < stored:
                    recorder.windows["q"][w] = hooks.queries(handles)[0].cpu().half()
                    recorder.windows["k"][w] = key.half()
                    recorder.windows["v"][w] = value.half()
            if on_window is not None:
                on_window(w)
    finally:
        hooks.remove()
        for parameter, flag in previous_grad_flags.items():
            parameter.requires_grad_(flag)
        model.zero_grad(set_to_none=True)

    tensors = {
        "samples.window": rows[:, 0].to(torch.int32),
        "samples.position": rows[:, 1].to(torch.int32),
        "rope.inv_freq": stored_inv_freq([inv_freq for inv_freq, _ in rope]),
    }
    if stored:
        tensors["windows.positions"] = positions.to(torch.int32).expand(stored, seqlen).clone()
        tensors["windows.input_ids"] = windows[:stored].to(torch.int32)
    for i, recorder in enumerate(recorders):
        tensors.update(recorder.named_tensors(i))
    counts.update(
        tokens_seen=nsamples * seqlen,
        tokens_in_statistics=nsamples * (seqlen - settings.sink),
        sampled_rows=len(rows),
        stored_windows=stored,
    )
    importance = (importance / nsamples).float()
    return CaptureResult(importance_k=importance[0], importance_v=importance[1], tensors=tensors, counts=counts)
