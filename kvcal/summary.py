"""Readable summaries of kvcal artifacts (`kvcal inspect`), one summarizer per artifact kind, and of a model's
attention as kvcal reads it (`kvcal models`). A bundle is validated by load_bundle before it is summarized; any other
artifact's checksum is verified on reading, and whatever goes wrong summarizing a malformed one is one KvcalError
naming the file."""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure  # no pyplot: files only, never a window or a global backend
from matplotlib.patches import Patch

from kvcal import registry
from kvcal.adapters import (ModelAdapter, index_key_bytes, index_widths, kv_shapes, kv_widths, latent_attention,
                            query_heads, rope_orders, score_scale)
from kvcal.artifacts import check_writable, read_artifact, read_header, write_atomically
from kvcal.bundle import BUNDLE_KIND, PACKING, Bundle, load_bundle
from kvcal.errors import KvcalError
from kvcal.indexer_keys import DESCRIPTIONS, token_bytes
from kvcal.profile import PROFILE_KIND
from kvcal.registry import ArtifactSummary
from kvcal.rope import layer_inv_freq, layer_rope_scaling
from kvcal.runtime.backends import bundle_plan
from kvcal.runtime.memory import FP16_BYTES, cache_bytes, segment_lengths
from kvcal.spans import AttentionSpan, recorded_spans


def _profile_summary(tensors: dict, config: dict) -> ArtifactSummary:
    model, calibration, kvmix = config["model"], config["calibration"], config["kvmix"]
    fingerprint = model["fingerprint"]
    bits_k, bits_v = tensors["kvmix.bits.k"].float(), tensors["kvmix.bits.v"].float()
    rule = f"target {kvmix['target_bits']} bits" if kvmix["target_bits"] is not None else f"top {kvmix['high_frac']:.0%} of layers high"
    orders = "layer_rope_orders" if "layer_rope_orders" in fingerprint else "rope_order"  # (where layers differ: Laguna)
    # (each layer's where they differ: dots.note3's MLA)
    scales = " or ".join(f"{scale:.4g}" for scale in dict.fromkeys(model.get("score_scales", [score_scale(model)])))
    provenance = [
        ("model", model["spec"]),
        ("architecture", f"{fingerprint['architecture']}: {fingerprint['num_layers']} layers, "
                         f"{' or '.join(map(str, sorted(set(query_heads(fingerprint)))))} q / {_kv_heads_text(fingerprint)}"
                         + (f"; attention in decoder layers {', '.join(map(str, fingerprint['attention_layers']))}, the others "
                            "keep a recurrent state" if "attention_layers" in fingerprint else "")),
        ("attention", f"scores x {scales}; each layer's sliding window and RoPE below"
                      + (f"; q/k channels in RoPE pair order (fingerprint {orders})" if any(rope_orders(fingerprint)) else "")
                      + ("; attention sinks" if "attention_sinks" in model else "")
                      + (f"; scores soft-capped at {model['attention_softcap']:g}" if "attention_softcap" in model else "")
                      + (_latent_text([width for _, width in kv_shapes(fingerprint, "v")], [width for _, width in kv_shapes(fingerprint)])
                         if latent_attention(fingerprint) else "")),
        ("config sha256", fingerprint["config_sha256"]),
        ("dataset", calibration["dataset"]),
        ("windows", f"{calibration['nsamples']} x {calibration['seqlen']} tokens, seed {calibration['seed']}"),
        ("tokens", f"{calibration['corpus_tokens']} in corpus, {calibration['tokens_seen']} seen, "
                   f"{calibration['tokens_in_statistics']} in statistics (sink {calibration['sink']} excluded)"),
        ("sampled rows", f"{calibration['sampled_rows']} per layer; {calibration['stored_windows']} whole windows of Q/K/V"),
        ("passes", f"{calibration['forward_passes']} forward, {calibration['backward_passes']} backward"),
        ("kvmix", f"{rule}; K {kvmix['key_widths']['high']}/{kvmix['key_widths']['low']} bits, "
                  f"V {kvmix['value_widths']['high']}/{kvmix['value_widths']['low']} bits; "
                  f"mean K {bits_k.mean():.3f}, V {bits_v.mean():.3f}"),
        ("kvcal version", config["kvcal_version"]),
    ]
    spans = recorded_spans(model, bits_k.numel())
    head_dims = [head_dim for _, head_dim in kv_shapes(fingerprint)]
    columns = ["layer", "window / chunk", "RoPE", "s_k", "s_v", "bits K", "bits V", "RPC K", "RPC V"]
    rows = [
        [str(i), _span_text(spans[i]), _rope_of(tensors["rope.inv_freq"], config["rope"], i, head_dims[i]),
         f"{tensors['importance.k'][i]:.4g}", f"{tensors['importance.v'][i]:.4g}",
         str(int(bits_k[i])), str(int(bits_v[i])),
         f"{tensors['kvmix.rpc.k'][i]:.2f}", f"{tensors['kvmix.rpc.v'][i]:.2f}"]
        for i in range(bits_k.numel())
    ]
    return ArtifactSummary("profile", provenance, columns, rows)


def model_summary(adapter: ModelAdapter, spec: str) -> ArtifactSummary:
    """A model's attention as kvcal reads it (what `kvcal models MODEL` prints): its layers' heads, spans and RoPE, and
    the bytes one token takes in each layer's cache kept fp16, which a quantized cache's bits divide (a windowed layer
    keeps its span's tokens alone, so a context's cache counts at most that many of them)."""
    fingerprint = adapter.fingerprint()
    readers = [f"decoder layer {r.decoder_index} reads layer {r.source}'s cache" for r in adapter.readers]
    fp16 = [FP16_BYTES * (k + v) + index for k, v, index in
            zip(adapter.kv_widths, adapter.value_widths, adapter.index_bytes(torch.float16))]
    context = 32768
    at_context = sum(size * min(context, span.size if span else context) for size, span in zip(fp16, adapter.spans))
    provenance = [
        ("model", spec),
        ("architecture", f"{adapter.architecture} ({adapter.model_type}): {adapter.num_model_layers} decoder layers"
                         + (f", {len(adapter.layers)} of them keeping a cache" if adapter.hybrid else "")),
        ("attention", f"{' or '.join(map(str, sorted(set(adapter.query_heads))))} query heads / {_kv_heads_text(fingerprint)}; "
                      f"scores x {' or '.join(f'{scale:.4g}' for scale in dict.fromkeys(adapter.score_scales))}"
                      + (f", soft-capped at {adapter.softcap:g}" if adapter.softcap else "")
                      + ("; attention sinks" if adapter.layers[0].sinks is not None else "")
                      + (_latent_text(adapter.value_dims, adapter.head_dims) if adapter.latent else "")),
        ("decoder", {"dense": "every layer keeps keys and values", "shared": "; ".join(readers),
                     "recurrent": "a recurrent state beside the layers' caches (transformers' to keep)",
                     "cross": f"layers {list(adapter.cross_attention)} attending across to an image (its keys and values "
                              "transformers' to keep)"}[adapter.decoder_kind]
                    + ("; images cached as tokens" if adapter.images_as_tokens else "")
                    + ("; its prompt (token type 0) attended both ways, text alone read causally (token type 1)"
                       if adapter.prefix_lm else "; an image's tokens attended both ways" if adapter.image_blocks
                       else "")),
        ("fp16 cache", f"{sum(fp16):,} bytes per token of K and V" + (" and indexer keys" if any(adapter.index_widths) else "")
                       + f"; {at_context / 2 ** 30:.2f} GiB for a sequence of {context} tokens"),
    ]
    decoder_column = adapter.model_layers != tuple(range(len(adapter.layers)))  # (hybrids, KV sharing, sublayers)
    sparse_column = any(handles.sparse for handles in adapter.layers)
    columns = (["layer"] + ["decoder layer"] * decoder_column + ["window / chunk"] + ["attends"] * sparse_column
               + ["q heads", "K (heads x dim)", "V", "RoPE", "fp16 bytes / token"])
    rows = [[str(i)] + [str(adapter.model_layers[i])] * decoder_column + [_span_text(span)]
            + [("an indexer's pick" if handles.sparse else "all it sees")] * sparse_column
            + [str(adapter.query_heads[i]), f"{adapter.kv_heads[i]} x {adapter.head_dims[i]}", str(adapter.value_widths[i]),
               _rope_text(adapter.layer_inv_freq(i), adapter.layer_rope_scaling(i)), f"{fp16[i]:,}"]
            for i, (handles, span) in enumerate(zip(adapter.layers, adapter.spans))]
    return ArtifactSummary("model", provenance, columns, rows)


def _latent_text(value_dims: list[int], rotated_widths: list[int]) -> str:
    """An MLA model's cache in a summary line: its latent (of each width its layers have), beside a rotated key where a
    layer rotates one (none of GLM-5 Next's does)."""
    key = "beside the rotated key" if any(rotated_widths) else "alone (no layer rotates a key)"
    widths = " or ".join(map(str, dict.fromkeys(value_dims)))
    return f"; multi-head latent attention: the value is a latent of {widths} channels {key}"


def _kv_heads_text(fingerprint: dict) -> str:
    """The KV heads and head_dim of a model's layers: one pair, or each pair and its layers where they differ."""
    shapes = kv_shapes(fingerprint)
    layers = {shape: [str(i) for i, s in enumerate(shapes) if s == shape] for shape in dict.fromkeys(shapes)}
    if len(layers) == 1:
        return f"{shapes[0][0]} kv heads, head_dim {shapes[0][1]}"
    return "; ".join(f"{kv_heads} kv heads, head_dim {head_dim} in layer{'s' * (len(at) > 1)} {', '.join(at)}"
                     for (kv_heads, head_dim), at in layers.items())


def _span_text(span: AttentionSpan | None) -> str:
    return "-" if span is None else f"chunk {span.size}" if span.chunked else str(span.size)


def _rope_of(inv_freq, rope_config: dict, layer: int, head_dim: int) -> str:
    """A layer's RoPE as the profile records it (_rope_text)."""
    return _rope_text(layer_inv_freq(inv_freq, layer, head_dim), layer_rope_scaling(rope_config, layer))


def _rope_text(frequencies, scaling: float) -> str:
    """A layer's RoPE: "none" (frequencies of zero: a layer that applies none), else its cos/sin scaling and, where it
    rotates part of each head, how many channels (its nonzero frequencies' pairs)."""
    rotated = int(frequencies.count_nonzero())
    if not rotated:
        return "none"
    part = f" over {2 * rotated} of {2 * frequencies.numel()} channels" if rotated < frequencies.numel() else ""
    return f"x{scaling:.4g}{part}"


def _get(config, *keys):
    """config[k1][k2]..., or '-' where the provenance lacks it (a bundle needs it only to be shown)."""
    for key in keys:
        if not isinstance(config, dict) or key not in config:
            return "-"
        config = config[key]
    return config


def _model_rows(config: dict) -> list[tuple[str, str]]:
    fingerprint = ("model", "fingerprint")
    return [
        ("model", str(_get(config, "model", "spec"))),
        ("architecture", f"{_get(config, *fingerprint, 'architecture')}: {_get(config, *fingerprint, 'num_layers')} layers, "
                         f"config {_get(config, *fingerprint, 'config_sha256')}"),
        ("calibration", f"{_get(config, 'calibration', 'dataset')}, {_get(config, 'calibration', 'nsamples')} x "
                        f"{_get(config, 'calibration', 'seqlen')}, seed {_get(config, 'calibration', 'seed')}"),
    ]


EFFECTIVE_BITS_CONTEXTS = (512, 4096)


def effective_bits(layers: list, fingerprint: dict, tokens: int, indexer_keys: str = "model") -> float:
    """Cache bits per element after a prefill of `tokens` (kvcal.runtime.memory) for the layers of an artifact's
    model, with each layer's outlier fraction of its quantized elements as outliers; sparse layers' indexer keys count
    among the elements, kept in format `indexer_keys` (kvcal.indexer_keys; "model": as a bf16 or fp16 model computes
    them, index_key_bytes)."""
    kv_heads = [heads for heads, _ in kv_shapes(fingerprint)]
    widths = {kind: kv_widths(fingerprint, kind) for kind in "kv"}
    index = index_widths(fingerprint)
    outliers = round(sum(layer.outliers * segment_lengths(layer, tokens, kind == "k")[1] * widths[kind][i]
                         for i, layer in enumerate(layers) for kind in "kv"))
    key_bytes = index_key_bytes(fingerprint["model_type"], FP16_BYTES)
    stored = cache_bytes(layers, widths["k"], tokens, outliers, kv_heads=kv_heads, value_width=widths["v"],
                         index_bytes=[token_bytes(indexer_keys, width, key_bytes) for width in index])
    return stored * 8 / (tokens * (sum(widths["k"]) + sum(widths["v"]) + sum(index)))


def _bundle_summary(bundle: Bundle) -> ArtifactSummary:
    """The summary of a bundle that load_bundle validated: layers and tensors are sound, provenance is shown as found."""
    config, layers, tensors = bundle.config, bundle.layers, bundle.tensors
    fingerprint = bundle.fingerprint
    bits = ", ".join(f"{effective_bits(layers, fingerprint, n, bundle.indexer_keys):.3f} at {n} tokens"
                     for n in EFFECTIVE_BITS_CONTEXTS)
    indexed = [("indexer keys", DESCRIPTIONS[bundle.indexer_keys])] * any(index_widths(fingerprint))
    provenance = _model_rows(config) + [
        ("recipe", f"{bundle.recipe_name}; codes packed {PACKING['bit_order']} in int{PACKING['word_bits']} words, "
                   f"layout {PACKING['layout']} (3-bit: {PACKING['3-bit layout']}; 5-7-bit: {PACKING['5-7-bit layouts']})"),
        *indexed,
        ("effective bits", f"{bits} (everything the cache stores / elements, after one prefill, with the recipe's outlier "
                           "fraction of elements as outliers; the real count depends on the text: `kvcal eval ppl` measures it)"),
        ("kvcal version", str(_get(config, "kvcal_version"))),
    ]
    columns = ["layer", "method", "bits K", "bits V", "pre-RoPE", "group", "window", "sink", "residual", "RPC K/V", "outliers", "fp8",
               "s_k", "s_v"]
    keys = kv_widths(fingerprint, "k")  # ("-": an MLA key of no channel, which no recipe stores)
    rows = [[str(i), r.method, f"{r.k_bits:g}" if keys[i] else "-", f"{r.v_bits:g}", str(r.pre_rope), str(r.group_size or "-"),
             str(r.window), str(r.sink), str(r.residual), f"{r.rpc_k:.2g}/{r.rpc_v:.2g}", f"{r.outliers:.1%}", str(r.fp8),
             f"{float(tensors[f'layers.{i}.importance.k']):.4g}", f"{float(tensors[f'layers.{i}.importance.v']):.4g}"]
            for i, r in enumerate(layers)]
    return ArtifactSummary("bundle", provenance, columns, rows)


def _fitted_summary(spec: registry.MethodSpec, tensors: dict, config: dict) -> ArtifactSummary:
    summary = spec.summarize_artifact(tensors, config)
    summary.provenance = _model_rows(config) + summary.provenance + [("kvcal version", str(_get(config, "kvcal_version")))]
    return summary


def _malformed(path, kind: str, exc: Exception) -> KvcalError:
    detail = " ".join(str(exc).split())[:160] or "no detail"
    return KvcalError(f"'{path}' is a malformed kvcal {kind} ({type(exc).__name__}: {detail}); re-create it with the kvcal command "
                      "that wrote it")


def _as_text(summary: ArtifactSummary) -> ArtifactSummary:
    """Every cell a string, whatever type an artifact's provenance holds."""
    summary.provenance = [(str(key), str(value)) for key, value in summary.provenance]
    summary.columns = [str(column) for column in summary.columns]
    summary.rows = [[str(cell) for cell in row] for row in summary.rows]
    return summary


def summarize(path: str | Path) -> ArtifactSummary:
    kind, _ = read_header(path)
    if kind == BUNDLE_KIND:
        bundle = load_bundle(path)  # validated like any bundle the runtime would use
        try:
            return _as_text(_bundle_summary(bundle))
        except Exception as exc:  # noqa: BLE001 - a bundle that loads must summarize; never a traceback
            raise _malformed(path, kind, exc) from exc
    spec = registry.method_for_artifact(kind)
    if kind != PROFILE_KIND and spec is None:
        kinds = [PROFILE_KIND, BUNDLE_KIND, *dict.fromkeys(s.artifact_kind for s in registry.methods() if s.artifact_kind)]
        raise KvcalError(f"'{path}' is a kvcal {kind}; this kvcal can summarize: {', '.join(kinds)}")
    tensors, config = read_artifact(path, kind)  # verifies the checksum
    try:
        return _as_text(_profile_summary(tensors, config) if kind == PROFILE_KIND else _fitted_summary(spec, tensors, config))
    except KvcalError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a malformed artifact breaks becomes one line naming it
        raise _malformed(path, kind, exc) from exc


PLOT_FORMATS = tuple(sorted(Figure().canvas.get_supported_filetypes()))


def check_plot(path: str | Path, artifact: str | Path) -> Path:
    """Refuse a --plot destination before anything is printed: the artifact must be a profile, the path a
    writable file (not the artifact itself) whose extension names an image format."""
    kind, _ = read_header(artifact)
    if kind != PROFILE_KIND:
        raise KvcalError(f"--plot draws a profile's importance; '{artifact}' is a kvcal {kind}: leave --plot out")
    path = check_writable(path, "--plot", inputs=[artifact])
    if path.suffix.lstrip(".").lower() not in PLOT_FORMATS:
        raise KvcalError(f"--plot '{path}' does not end in an image format's extension ({', '.join('.' + f for f in PLOT_FORMATS)}); "
                         "use e.g. .png")
    return path


PLAN_DEVICES = ("cpu", "cuda")


def check_plan_device(device: str, artifact: str | Path) -> None:
    """Refuse a --device before anything is printed: a device kvcal plans for, and a bundle to plan."""
    if device not in PLAN_DEVICES:
        raise KvcalError(f"--device {device!r} is not one of {', '.join(PLAN_DEVICES)}")
    kind, _ = read_header(artifact)
    if kind != BUNDLE_KIND:
        raise KvcalError(f"--device shows what serves a bundle's decode steps; '{artifact}' is a kvcal {kind}: leave --device out")


def decode_plan(path: str | Path, device: str) -> tuple[str, list[str], list[list[str]]]:
    """(title, columns, rows) of what serves each layer of a bundle on `device` (kvcal.runtime.backends.bundle_plan)."""
    plans = bundle_plan(load_bundle(path), device)
    where = "this machine's CPU" if device == "cpu" else "a CUDA GPU with CuPy"
    columns = ["layer", "bodies", "fp16 segments", "K append", "V append", "short steps", "why not faster"]
    rows = [[str(p.layer), p.bodies, p.fp16_segments, p.key_append, p.value_append,
             f"up to {p.short_steps} tokens" if p.short_steps else "-", p.why or "-"] for p in plans]
    return f"decode steps on {where}", columns, rows


def plot_profile(path: str | Path, png: str | Path) -> Path:
    """Per-layer K and V importance as bars, coloured by the chosen bit width, written atomically to `png`
    (any extension matplotlib knows: .png, .pdf, .svg, ...)."""
    png = check_plot(png, path)
    tensors, config = read_artifact(path, PROFILE_KIND)
    try:
        figure = _importance_figure(tensors, config)
    except Exception as exc:  # noqa: BLE001
        raise _malformed(path, PROFILE_KIND, exc) from exc
    return write_atomically(png, lambda temp: figure.savefig(temp, dpi=120, format=png.suffix.lstrip(".").lower()), "--plot")


def _importance_figure(tensors: dict, config: dict) -> Figure:
    figure = Figure(figsize=(10, 6))
    axes = figure.subplots(2, 1, sharex=True)
    palette = {1: "#bbbbbb", 2: "#4c72b0", 3: "#dd8452", 4: "#c44e52"}
    for axis, kind, label in ((axes[0], "k", "key"), (axes[1], "v", "value")):
        importance = tensors[f"importance.{kind}"].numpy()
        bits = tensors[f"kvmix.bits.{kind}"].tolist()
        axis.bar(range(len(bits)), importance, color=[palette[b] for b in bits])
        axis.set_ylabel(f"s_{kind} = ||dL/dW_{kind}||")
        axis.set_title(f"{label} importance; colour = bits (mean {sum(bits) / len(bits):.3f})")
        axis.legend(handles=[Patch(color=palette[w], label=f"{w} bits") for w in sorted(set(bits))], loc="upper right")
    axes[1].set_xlabel("decoder layer")
    figure.suptitle(f"KVmix importance: {_get(config, 'model', 'spec')}")
    figure.tight_layout()
    return figure
