"""Rotation where the kernel gets it for free, against KVQuant's pre-RoPE per-channel keys (issue 14, item 5).

A post-RoPE key or a value rotated per head by an orthonormal Hadamard matrix with random signs (H) costs the
decode step nothing: q . (H k) = (H q) . k rotates the query once per step, and sum_t p_t H v_t = H (sum_t p_t v_t)
rotates the output once. So the cache may store H k and H v, quantized with Fisher-weighted nuq codebooks fit on
the rotated coordinates. This benchmark measures, at equal real bits, per layer and overall:

- nuqB-1%: KVQuant (pre-RoPE keys, per-channel thresholds; values per-token), the artifact `fit-nuq` writes;
- rotated K+V: post-RoPE keys and values rotated, keys per-channel and values per-token thresholds in the rotated
  coordinates, 1% outliers, codebooks by Fisher-weighted k-means (the profile's Fisher is per element of the
  unrotated tensor; the rotation mixes a head's channels, so each (token, head) weighs its rotated elements by its
  mean Fisher);
- rotated V: KVQuant's keys, rotated values;
- per layer: for each layer and each of K and V, the variant with the lower Fisher-weighted squared error of the
  calibration samples in the unrotated coordinates (the keys' errors compared pre-RoPE: RoPE is a rotation of
  channel pairs, so a post-RoPE error maps to the pre-RoPE one by the token's inverse rotation).

All variants store the same bytes per element (codes, per-token thresholds, 4-byte outliers); the table reports the
real bits the simulation counts. Evaluation: fake quantization with decode-time semantics (kvcal.evaluate), seqlen
512, 40 consecutive windows of wikitext-2 test and of held-out Python standard-library code.

Usage: python benchmarks/bench_rotation.py [--bits 3] [--windows 40] [--domains wikitext2 code]
Writes benchmarks/results/rotation.{json,md}; the profile and nuq artifact are bench_pareto's (made if missing).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, provenance, write_markdown, write_result  # noqa: E402

WORK = REPO / "artifacts" / "bench" / "pareto"
OUTLIERS, SINK, SEED = 0.01, 1, 0


@dataclass(frozen=True)
class RotatedCodec:
    """`inner` applied to the per-head rotated tensor; decoded values rotated back (what the query and output
    rotations make of them). Stores exactly what `inner` stores."""

    rotation: object
    inner: object
    block_tokens = 1

    def quantize(self, x: torch.Tensor):
        from kvcal.quantizers import Quantized

        q = self.inner.quantize(self.rotation.rotate(x))
        return Quantized(self.rotation.unrotate(q.values), q.row_bits, q.row_outliers)


def fit_rotated(samples, fisher, rotation, head_dim: int, per_channel: bool, bits: int):
    """A RotatedCodec fit on the rotated samples: thresholds and a Fisher-weighted nuq codebook."""
    from kvcal.fit.nuq import _inliers, fit_codebook
    from kvcal.quantizers import CodebookCodec

    rotated = rotation.rotate(samples)
    rows = samples.shape[0]
    weight = fisher.view(rows, -1, head_dim).mean(-1, keepdim=True).expand(rows, -1, head_dim).reshape(rows, -1)
    points, weights, thresholds = _inliers(rotated, weight, per_channel, OUTLIERS, SEED)
    codebook = fit_codebook(points, weights, bits, "nuq", bits <= 2, SEED)
    lo, hi = thresholds or (None, None)
    return RotatedCodec(rotation, CodebookCodec(codebook, lo, hi, OUTLIERS))


def pre_rope_error(codec, samples, fisher, rope=None) -> float:
    """Fisher-weighted squared error of `codec` on the pre-RoPE key samples; rope (positions, heads, inv_freq,
    attention_scaling): the codec quantizes the post-RoPE keys, and their error is rotated back by each token's own
    position (RoPE at -position)."""
    from kvcal.rope import rotate_keys

    if rope is None:
        return float((fisher * (samples - codec.quantize(samples).values) ** 2).sum())
    positions, heads, inv_freq, scaling = rope
    quantized = codec.quantize(rotate_keys(samples, positions, heads, inv_freq, scaling)).values
    back = rotate_keys(quantized, -positions, heads, inv_freq, 1.0 / scaling)
    return float((fisher * (samples - back) ** 2).sum())


def build_methods(profile_path: Path, base, bits: int, log):
    """(methods, per-layer choices): `base` (the nuq artifact's simulation Method) and the three rotated variants."""
    from kvcal.artifacts import read_artifact
    from kvcal.kv import SegmentPolicy
    from kvcal.quantizers import LayerCodecs
    from kvcal.rotation_codecs import HadamardRotation
    from kvcal.simulate import Method

    profile, config = read_artifact(str(profile_path), "profile")
    head_dim = config["model"]["fingerprint"]["head_dim"]
    rows = profile["samples.position"] >= SINK
    rope = (profile["samples.position"][rows], config["model"]["fingerprint"]["num_kv_heads"], profile["rope.inv_freq"],
            config["rope"]["attention_scaling"])
    rotation = HadamardRotation(head_dim, SEED)
    both, values_only, chosen, choices = [], [], [], []
    for layer, scheme in enumerate(base.layers):
        prefix = f"layers.{layer}"
        k_pre, k_fisher = profile[f"{prefix}.k_pre.samples"][rows], profile[f"{prefix}.k_pre.fisher"][rows]
        v, v_fisher = profile[f"{prefix}.v.samples"][rows], profile[f"{prefix}.v.fisher"][rows]
        k_post = profile[f"{prefix}.k_post.samples"][rows]
        rot_k = fit_rotated(k_post, k_fisher, rotation, head_dim, True, bits)
        rot_v = fit_rotated(v, v_fisher, rotation, head_dim, False, bits)
        both.append(LayerCodecs(rot_k, rot_v, False))
        values_only.append(LayerCodecs(scheme.key_codec, rot_v, True))
        k_errors = (pre_rope_error(scheme.key_codec, k_pre, k_fisher), pre_rope_error(rot_k, k_pre, k_fisher, rope))
        v_errors = (float((v_fisher * (v - scheme.value_codec.quantize(v).values) ** 2).sum()),
                    float((v_fisher * (v - rot_v.quantize(v).values) ** 2).sum()))
        # keys: one codec kind per layer (pre- or post-RoPE); a post-RoPE layer stores its keys rotated
        key_rotated, value_rotated = k_errors[1] < k_errors[0], v_errors[1] < v_errors[0]
        chosen.append(LayerCodecs(rot_k if key_rotated else scheme.key_codec, rot_v if value_rotated else scheme.value_codec,
                                  not key_rotated))
        choices.append({"layer": layer, "k_error": k_errors, "v_error": v_errors, "k_rotated": key_rotated,
                        "v_rotated": value_rotated})
        log(f"layer {layer}: K error pre-RoPE {k_errors[0]:.4g} rotated {k_errors[1]:.4g}; "
            f"V error {v_errors[0]:.4g} rotated {v_errors[1]:.4g}")
    policy = SegmentPolicy(sink=SINK)
    methods = [base,
               Method(f"rotated K+V nuq{bits}-1%", bits, both, policy, base.fingerprint),
               Method(f"rotated V nuq{bits}-1%", bits, values_only, policy, base.fingerprint),
               Method(f"per layer nuq{bits}-1%", bits, chosen, policy, base.fingerprint)]
    return methods, choices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=3, choices=(2, 3, 4), help="code width of every variant (default 3)")
    parser.add_argument("--windows", type=int, default=40, help="consecutive 512-token windows per domain (default 40)")
    parser.add_argument("--domains", nargs="+", default=["wikitext2", "code"], choices=["wikitext2", "code"],
                        help="evaluation domains (default both)")
    args = parser.parse_args(argv)
    if args.windows < 1:
        parser.error("--windows must be >= 1")
    started = time.perf_counter()
    started_with = provenance()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    from bench_pareto import DOMAINS, Fitter, catalog, ensure_profile, parse_args

    from kvcal.adapters import adapt
    from kvcal.data import load_text, tokenize
    from kvcal.evaluate import consecutive_windows, evaluate_ppl
    from kvcal.models import load_model

    pareto_args = parse_args(["--methods", f"nuq{args.bits}-1%"])
    profile = ensure_profile(pareto_args)
    entry = next(e for e in catalog(SEED) if e.name == f"nuq{args.bits}-1%")
    fitter = Fitter(profile, Path(pareto_args.work), False)
    model, tokenizer, source = load_model(None)
    adapter = adapt(model)
    base, nuq_path = fitter.method(entry, len(adapter.layers))
    methods, choices = build_methods(profile, base, args.bits, log)
    domains = {}
    for name in args.domains:
        description, dataset = DOMAINS[name]
        windows = consecutive_windows(tokenize(load_text(dataset), tokenizer), 512, args.windows)
        log(f"[{name}] evaluating {len(methods)} methods on {args.windows} windows")
        results = evaluate_ppl(model, adapter, windows, methods)
        domains[name] = {"description": description, "fp_ppl": results[0].ppl,
                         "rows": [{"method": r.method, "real_bits": r.effective_bits, "ppl": r.ppl, "delta_pct": r.delta_pct}
                                  for r in results[1:]]}
        for r in results[1:]:
            log(f"[{name}] {r.method}: {r.effective_bits:.3f} bits, ppl {r.ppl:.4f} ({r.delta_pct:+.2f}%)")
    rotated_k = sum(c["k_rotated"] for c in choices)
    rotated_v = sum(c["v_rotated"] for c in choices)
    payload = {"model": source.spec, "profile": str(profile), "nuq": str(nuq_path), "bits": args.bits, "outliers": OUTLIERS,
               "windows": args.windows, "domains": domains, "per_layer": choices, "rotated_layers": {"k": rotated_k, "v": rotated_v}}
    path = write_result("rotation", payload, started_with)
    lines = ["# Rotation where the kernel gets it for free vs KVQuant's pre-RoPE per-channel keys", "",
             f"`python benchmarks/bench_rotation.py --bits {args.bits} --windows {args.windows}`; {source.spec}; calibration "
             f"{profile.name}; {OUTLIERS:.0%} outliers, 1 fp16 sink; seqlen 512. Per layer: the lower Fisher-weighted "
             f"calibration error chose rotation for {rotated_k} of {len(choices)} layers' keys and {rotated_v} of "
             f"{len(choices)} layers' values.", ""]
    for name, domain in domains.items():
        lines += [f"## {domain['description']} (fp ppl {domain['fp_ppl']:.4f})", "", "| method | real bits | ppl | vs fp |",
                  "|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['real_bits']:.3f} | {r['ppl']:.4f} | {r['delta_pct']:+.2f}% |" for r in domain["rows"]]
        lines.append("")
    print(f"wrote {path} and {write_markdown('rotation', lines)}")


if __name__ == "__main__":
    main()
