"""Readable summaries of kvcal artifacts (`kvcal inspect`), one summarizer per artifact kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvcal.artifacts import read_artifact, read_header
from kvcal.errors import KvcalError


@dataclass
class ArtifactSummary:
    kind: str
    provenance: list[tuple[str, str]]
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)


def _profile_summary(tensors: dict, config: dict) -> ArtifactSummary:
    model, calibration, kvmix = config["model"], config["calibration"], config["kvmix"]
    fingerprint = model["fingerprint"]
    bits_k, bits_v = tensors["kvmix.bits.k"].float(), tensors["kvmix.bits.v"].float()
    rule = f"target {kvmix['target_bits']} bits" if kvmix["target_bits"] is not None else f"top {kvmix['high_frac']:.0%} of layers high"
    provenance = [
        ("model", model["spec"]),
        ("architecture", f"{fingerprint['architecture']}: {fingerprint['num_layers']} layers, "
                         f"{fingerprint['num_heads']} q / {fingerprint['num_kv_heads']} kv heads, head_dim {fingerprint['head_dim']}"),
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
    columns = ["layer", "s_k", "s_v", "bits K", "bits V", "RPC K", "RPC V"]
    rows = [
        [str(i), f"{tensors['importance.k'][i]:.4g}", f"{tensors['importance.v'][i]:.4g}",
         str(int(bits_k[i])), str(int(bits_v[i])),
         f"{tensors['kvmix.rpc.k'][i]:.2f}", f"{tensors['kvmix.rpc.v'][i]:.2f}"]
        for i in range(bits_k.numel())
    ]
    return ArtifactSummary("profile", provenance, columns, rows)


def _model_rows(config: dict) -> list[tuple[str, str]]:
    fingerprint = config["model"]["fingerprint"]
    calibration = config["calibration"]
    return [
        ("model", config["model"]["spec"]),
        ("architecture", f"{fingerprint['architecture']}: {fingerprint['num_layers']} layers, config {fingerprint['config_sha256']}"),
        ("calibration", f"{calibration['dataset']}, {calibration['nsamples']} x {calibration['seqlen']}, seed {calibration['seed']}"),
    ]


def _codebook(tensor) -> str:
    return " ".join(f"{value:+.2f}" for value in tensor.tolist())


def _nuq_summary(tensors: dict, config: dict) -> ArtifactSummary:
    nuq = config["nuq"]
    provenance = _model_rows(config) + [
        ("settings", f"outliers {nuq['outliers']:.2%}, sink {nuq['sink']}, keys {nuq['key_rope']}-RoPE per-{nuq['key_granularity']}, "
                     f"codebook {nuq['codebook']}, weighting {nuq['weighting']}, Q-Norm {nuq['qnorm']}"),
        ("kvcal version", config["kvcal_version"]),
    ]
    rows = [[str(i), str(nuq["bits_k"][i]), str(nuq["bits_v"][i]), _codebook(tensors[f"layers.{i}.k.codebook"]),
             _codebook(tensors[f"layers.{i}.v.codebook"])] for i in range(len(nuq["bits_k"]))]
    return ArtifactSummary("nuq", provenance, ["layer", "bits K", "bits V", "K codebook", "V codebook"], rows)


def _skvq_summary(tensors: dict, config: dict) -> ArtifactSummary:
    skvq = config["skvq"]
    provenance = _model_rows(config) + [
        ("settings", f"K{skvq['kbits']:g} V{skvq['vbits']:g}, group {skvq['group_size']}, window {skvq['window']}, sink {skvq['sink']}, "
                     f"clip {skvq['clip']}, reorder {skvq['reorder']}, fp8 {skvq['fp8']}"),
        ("kvcal version", config["kvcal_version"]),
    ]
    rows = []
    for i in range(config["model"]["fingerprint"]["num_layers"]):
        cells = [str(i)]
        for kind in ("k", "v"):
            starts = tensors[f"layers.{i}.{kind}.group_start"]
            cells += [" ".join(map(str, (starts[1:] - starts[:-1]).tolist())),
                      " ".join(f"{a:.2f}" for a in tensors[f"layers.{i}.{kind}.clip"].tolist())]
        rows.append(cells)
    return ArtifactSummary("skvq", provenance, ["layer", "K group sizes", "K clip", "V group sizes", "V clip"], rows)


EFFECTIVE_BITS_CONTEXTS = (512, 4096)


def effective_bits(layers: list, width: int, tokens: int) -> float:
    """Cache bits per K/V element after a prefill of `tokens` (kvcal.runtime.memory), with each layer's
    outlier fraction of its quantized elements as outliers."""
    from kvcal.runtime.memory import cache_bytes, segment_lengths

    outliers = round(sum(layer.outliers * segment_lengths(layer, tokens, keys)[1] * width for layer in layers for keys in (True, False)))
    return cache_bytes(layers, width, tokens, outliers) * 8 / (len(layers) * 2 * tokens * width)


def _bundle_summary(tensors: dict, config: dict) -> ArtifactSummary:
    from kvcal.bundle import LayerRecipe

    recipe = config["recipe"]
    packing = recipe["packing"]
    fingerprint = config["model"]["fingerprint"]
    layers = [LayerRecipe(**r) for r in recipe["layers"]]
    width = fingerprint["num_kv_heads"] * fingerprint["head_dim"]
    bits = ", ".join(f"{effective_bits(layers, width, n):.3f} at {n} tokens" for n in EFFECTIVE_BITS_CONTEXTS)
    provenance = _model_rows(config) + [
        ("recipe", f"{recipe['name']}; codes packed {packing['bit_order']} in int{packing['word_bits']} words, layout {packing['layout']}"),
        ("effective bits", f"{bits} (everything the cache stores / elements, after one prefill)"),
        ("kvcal version", config["kvcal_version"]),
    ]
    columns = ["layer", "method", "bits K", "bits V", "pre-RoPE", "group", "window", "sink", "residual", "RPC K/V", "outliers", "fp8",
               "s_k", "s_v"]
    rows = [[str(i), r["method"], f"{r['k_bits']:g}", f"{r['v_bits']:g}", str(r["pre_rope"]), str(r["group_size"] or "-"),
             str(r["window"]), str(r["sink"]), str(r["residual"]), f"{r['rpc_k']:.2g}/{r['rpc_v']:.2g}", f"{r['outliers']:.1%}", str(r["fp8"]),
             f"{float(tensors[f'layers.{i}.importance.k']):.4g}", f"{float(tensors[f'layers.{i}.importance.v']):.4g}"]
            for i, r in enumerate(recipe["layers"])]
    return ArtifactSummary("bundle", provenance, columns, rows)


SUMMARIZERS = {"profile": _profile_summary, "nuq": _nuq_summary, "skvq": _skvq_summary, "bundle": _bundle_summary}


def summarize(path: str | Path) -> ArtifactSummary:
    kind, _ = read_header(path)
    if kind not in SUMMARIZERS:
        raise KvcalError(f"'{path}' is a kvcal {kind}; this kvcal can summarize: {', '.join(SUMMARIZERS)}")
    tensors, config = read_artifact(path, kind)
    return SUMMARIZERS[kind](tensors, config)


def plot_profile(path: str | Path, png: str | Path) -> Path:
    """Per-layer K and V importance as bars, coloured by the chosen bit width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tensors, config = read_artifact(path, "profile")
    figure, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    palette = {1: "#bbbbbb", 2: "#4c72b0", 3: "#dd8452", 4: "#c44e52"}
    for axis, kind, label in ((axes[0], "k", "key"), (axes[1], "v", "value")):
        importance = tensors[f"importance.{kind}"].numpy()
        bits = tensors[f"kvmix.bits.{kind}"].tolist()
        axis.bar(range(len(bits)), importance, color=[palette[b] for b in bits])
        axis.set_ylabel(f"s_{kind} = ||dL/dW_{kind}||")
        axis.set_title(f"{label} importance; colour = bits (mean {sum(bits) / len(bits):.3f})")
        axis.legend(handles=[Patch(color=palette[w], label=f"{w} bits") for w in sorted(set(bits))], loc="upper right")
    axes[1].set_xlabel("decoder layer")
    figure.suptitle(f"KVmix importance: {config['model']['spec']}")
    figure.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=120)
    plt.close(figure)
    return png
