"""The accuracy harness: perplexity change vs real bits on SmolLM2-135M for every calibrated kvcal recipe and every
uncalibrated baseline of `kvcal eval ppl`, on wikitext-2 test and on a held-out code corpus (the Python standard
library's own sources, dataset `python-code`), with the Pareto front marked. The ablations are method sets
(`--methods nuq-ablation`, `skvq-ablation`, `mixed-widths`, `fp8`, `engine-layers`, `engine-types`; written with
`--out-name <set>`), evaluated the same way on the same profile.

Real bits are `eval ppl`'s effective bits: what the runtime stores per K/V element (codes packed in int32
words, per-token/per-block parameters in their storage dtype, 4-byte outliers and their offset tables, fp16 sinks, windows and
residuals), averaged over each evaluated window at --seqlen tokens.

Calibrated recipes are fit once from one profile: --profile, or by default one made here with
kvcal.profile.run_profile on the --calibration corpus (wikitext-2 valid, or kvcal's built-in corpus, the
default of `kvcal calibrate`; 16 x 512, seed --seed, sink 1, every sampled token kept as a row, 2 stored
windows). Fitted artifacts are cached under --work (keyed by the profile file and the
settings) so that a rerun only evaluates; --refit ignores the cache. The model is loaded once, each
domain is tokenized once, and fp is evaluated once per domain (first, by kvcal.evaluate.evaluate_ppl).

Writes benchmarks/results/<out-name>.json, .md (a table per domain, and for every baseline the best
calibrated recipe at <= its real bits) and .png (one panel per domain). Progress goes to stderr. With --update
the rows of the existing <out-name>.json for methods not evaluated now are kept (each row names the commit it
was measured at), provided both runs evaluated the same way: same model, profile, windows and fp perplexity.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO, RESULTS, SHARED, provenance, write_markdown, write_result

CALIBRATED, BASELINE = "calibrated", "baseline"
DOMAINS = {  # name -> (description, kvcal dataset spec)
    "wikitext2": ("wikitext-2 test", str(SHARED / "data" / "wikitext-2" / "test.txt")),
    "code": ("held-out code (Python stdlib sources)", "python-code"),
}
CALIBRATIONS = {  # --calibration -> (profile name, description, kvcal dataset spec)
    "wikitext2": ("wikitext2-valid", "wikitext-2 valid", str(SHARED / "data" / "wikitext-2" / "valid.txt")),
    "builtin": ("builtin", "kvcal's built-in corpus (Python's pydoc topics)", "builtin"),
}
PROFILE_SAMPLES, PROFILE_SEQLEN, PROFILE_SINK, PROFILE_WINDOWS = 16, 512, 1, 2
BITS_EPS = 1e-9  # real bits compare equal within this
PLOT_FLOOR_PCT = 0.01  # the log-scale y axis shows changes <= this (fp8, q8_0 can be <= 0) at this floor
FIT_KINDS = ("nuq", "skvq", "kvmix", "fp8")


# ---------------------------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class Entry:
    """One method of the benchmark. kind: 'baseline' (an `eval ppl --baseline` spec), 'nuq', 'skvq', 'kvmix'
    (fit from the profile), or 'fp8' (vLLM FP8 e4m3 KV cache; spec ('unit', 'tensor') = scale 1.0, ('absmax', strategy) =
    absmax/448 of the profile's calibration tokens, ('calibrated', strategy) = searched on its stored windows, per tensor or
    per KV head: kvcal export vllm's scales)."""

    name: str
    family: str
    kind: str
    spec: object = None  # baseline spec text, fit settings as a dict, or the fp8 (scales, strategy)
    aliases: tuple[str, ...] = ()  # other names, and the method sets it belongs to (METHOD_SETS)
    in_all: bool = True  # False: only in its method sets (the ablations), not in all / calibrated / baselines

    @property
    def needs_profile(self) -> bool:
        return ((self.kind in FIT_KINDS and self.spec != ("unit", "tensor")) or (self.kind == "layers" and "plan" in self.spec)
                or self.kind in ("types", "first_last"))


def catalog(seed: int) -> list[Entry]:
    entries = []
    for bits in (4, 3, 2):
        entries.append(Entry(f"nuq{bits}-1%", CALIBRATED, "nuq", {"bits": bits, "outliers": 0.01, "seed": seed}, (f"nuq{bits}", "nuq")))
    entries.append(Entry("nuq2-0%", CALIBRATED, "nuq", {"bits": 2, "outliers": 0.0, "seed": seed}))  # under turbo2's bits
    # wider codes and fewer outliers, under the bits of turbo4 (nuq4-0%), q5_0/q5_1 (nuq5), fp8 (nuq6) and q8_0 (nuq8)
    for bits, outliers in ((4, 0.0), (5, 0.0), (5, 0.001), (6, 0.001), (8, 0.001)):
        entries.append(Entry(f"nuq{bits}-{outliers * 100:g}%", CALIBRATED, "nuq", {"bits": bits, "outliers": outliers, "seed": seed}))
    # the same with a uniform codebook (`fit-nuq --codebook uniform`: thresholds calibrated, no k-means)
    for bits, outliers in ((3, 0.01), (4, 0.01), (4, 0.0), (5, 0.0), (5, 0.001), (6, 0.001), (8, 0.001)):
        entries.append(Entry(f"uq{bits}-{outliers * 100:g}%", CALIBRATED, "nuq", {"bits": bits, "outliers": outliers, "seed": seed, "codebook": "uniform"}))
    # with the newest tokens kept fp16 (`fit-nuq --window`): at 512-token contexts they carry much of the attention, and
    # 4 of them cost 0.1 bits; wider windows under KIVI's bits (its fp16 residual of 32 / 128 tokens)
    for bits, outliers, window, codebook in ((4, 0.01, 4, "nuq"), (3, 0.01, 4, "nuq"), (2, 0.01, 4, "nuq"), (4, 0.01, 28, "uniform"),
                                             (4, 0.01, 32, "uniform"), (4, 0.01, 80, "uniform"), (5, 0.001, 32, "uniform")):
        name = f"{'uq' if codebook == 'uniform' else 'nuq'}{bits}-{outliers * 100:g}%-w{window}"
        entries.append(Entry(name, CALIBRATED, "nuq", {"bits": bits, "outliers": outliers, "window": window, "seed": seed, "codebook": codebook},
                             ("windowed",)))
    entries.append(Entry("mixed", CALIBRATED, "nuq", {"target_bits": 3.0, "outliers": 0.01, "seed": seed}))
    entries.append(Entry("mixed-4.0", CALIBRATED, "nuq", {"target_bits": 4.0, "outliers": 0.01, "seed": seed}))
    entries.append(Entry("mixed-3.55", CALIBRATED, "nuq", {"target_bits": 3.55, "outliers": 0.01, "seed": seed}))  # passkey at <= 3.6 bits
    entries.append(Entry("nuq-kvmix-widths", CALIBRATED, "nuq", {"bits_from_profile": True, "outliers": 0.01, "seed": seed}))
    for window in (0, 32, 128):
        settings = {"kbits": 2, "vbits": 2, "group_size": 64, "window": window, "sink": 5, "fp8": True, "seed": seed}
        entries.append(Entry(f"skvq-K2V2-fp8-w{window}", CALIBRATED, "skvq", settings, (f"skvq-w{window}", "skvq")))
    entries.append(Entry("kvmix", CALIBRATED, "kvmix", {}))
    for bits in (4, 3, 2):
        entries.append(Entry(f"int{bits}-g64", BASELINE, "baseline", f"int{bits}-g64", (f"int{bits}", "int")))
    for bits in (4, 3, 2):
        for residual in (32, 128):
            spec = f"kivi{bits}-g32-r{residual}"
            entries.append(Entry(spec, BASELINE, "baseline", spec, (f"kivi{bits}", "kivi")))
    for bits in (4, 3, 2):
        entries.append(Entry(f"hadamard-int{bits}", BASELINE, "baseline", f"hadamard-int{bits}", ("hadamard",)))
    for bits in (4, 3, 2):
        entries.append(Entry(f"turbo{bits}", BASELINE, "baseline", f"turbo{bits}", ("turbo",)))
    for name in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"):
        entries.append(Entry(name, BASELINE, "baseline", name, ("llama.cpp",)))
    entries.append(Entry("fp4_e2m1", BASELINE, "baseline", "fp4_e2m1", ("sglang",)))
    entries.append(Entry("fp8-scale1", BASELINE, "fp8", ("unit", "tensor"), ("fp8",)))
    entries.append(Entry("fp8-absmax", BASELINE, "fp8", ("absmax", "tensor"), ("fp8",)))
    return entries + ablations(seed)


# Method sets beside the Pareto catalog (selected by name with --methods): each changes one thing against a default.
NUQ_ABLATIONS = {  # name part -> fit-nuq settings changed against nuqB-1%
    "per-token-k": {"key_granularity": "token"}, "post-rope-k": {"key_rope": "post"}, "uniform": {"codebook": "uniform"},
    "nf": {"codebook": "nf"}, "unweighted": {"weighting": "none"}, "no-outliers": {"outliers": 0.0},
    "qnorm-flipped": {"qnorm": "flip"}, "no-sink": {"sink": 0},
}
SKVQ_FULL = {"kbits": 2, "vbits": 2, "group_size": 64, "window": 128, "clip": "group", "reorder": True, "sink": 5}
SKVQ_STEPS = {  # SKVQ's Tables 3 and 4: each step adds one component to the previous
    "rtn": {"window": 0, "clip": "none", "reorder": False, "sink": 0},
    "window": {"window": 128, "clip": "none", "reorder": False, "sink": 0},
    "clip": {"window": 128, "clip": "group", "reorder": False, "sink": 0},
    "reorder": {"window": 128, "clip": "group", "reorder": True, "sink": 0},
    "sink": {}, "fp8": {"fp8": True}, "v1.5": {"vbits": 1.5}, "g32": {"group_size": 32}, "g128": {"group_size": 128},
}
METHOD_SETS = {
    "nuq-ablation": "KVQuant's components, one at a time, at 4, 3 and 2 bits, with int-g64 and KIVI at residual 32 and 128",
    "skvq-ablation": "SKVQ's components added one at a time at K2V2 (paper Tables 3 and 4), with KIVI-2 (g64) and int2",
    "mixed-widths": "per-layer widths: the Fisher knapsack at 2.6-4.0 bits, KVmix's widths, one width for all layers",
    "fp8": "vLLM's FP8 cache: scale 1.0, absmax / 448 and searched scales, per tensor and per KV head",
    "engine-layers": "vLLM's int4_per_token_head, nvfp4 and turboquant_k3v4_nc with layers kept fp16: none (beyond TurboQuant's "
                     "own boundary layers), by hand (at each end, the sliding-window ones) and by kvcal plan "
                     "(Fisher-weighted error, gradient importance) at the same bytes",
    "engine-types": "llama.cpp's -ctk / -ctv: one type for K and V, q8_0 keys with q4_0 values, and kvcal plan's pair at the "
                    "bytes of each; ik_llama.cpp's first/last layers: q4_0 with q8_0 at 2 or 4 layers of each end, and "
                    "kvcal plan's settings at the bytes of each",
}
# an engine dtype -> its hand rules: the layers users keep fp16 by hand, on top of those the dtype keeps itself
# (TurboQuant's first and last two): rule -> the layers kept, of a model of `layers` layers with `windows`
_ENDS = {"first-last": 1, "two-at-each-end": 2, "three-at-each-end": 3, "four-at-each-end": 4}
HAND_RULES = {
    "none": lambda layers, windows: [],
    **{rule: (lambda n: lambda layers, windows: [*range(n), *range(layers - n, layers)])(n) for rule, n in _ENDS.items()},
    "sliding": lambda layers, windows: [i for i, window in enumerate(windows) if window is not None],  # vLLM's sliding_window
}
ENGINE_RULES = {"int4_per_token_head": ("none", "first-last", "two-at-each-end", "sliding"),
                "nvfp4": ("none", "first-last", "two-at-each-end", "sliding"),
                "turboquant_k3v4_nc": ("none", "three-at-each-end", "four-at-each-end", "sliding")}
PLAN_EXTRA_LAYERS = (2, 4)  # the names of kvcal plan at the bytes of a dtype's two end rules: layers fp16 beyond its own
LLAMA_CPP_BY_HAND = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0/q4_0")  # one type for both, or the common q8_0 keys
# ik_llama.cpp by hand: q4_0 with the first and last N layers of K and V at q8_0 (the "layer adaptive" heuristic)
IK_LLAMA_CPP_BY_HAND = {f"q4_0-q8_0-ends-{n}": "q4_0" + "".join(f";{t}_{end}=q8_0,{n}" for t in "kv" for end in ("first", "last"))
                        for n in (2, 4)}


def ablations(seed: int) -> list[Entry]:
    """The entries only the method sets hold (their other members are catalog entries that carry the set as an alias)."""
    entries = []
    for bits in (4, 3, 2):
        for part, changes in NUQ_ABLATIONS.items():
            if changes.get("qnorm") == "flip":  # Q-Norm is on at 2 bits by default: flipped is off there, on above
                changes = {"qnorm": "off" if bits <= 2 else "on"}
            entries.append(Entry(f"nuq{bits}-1%-{part}", CALIBRATED, "nuq", {"bits": bits, "outliers": 0.01, "seed": seed, **changes},
                                 ("nuq-ablation",), in_all=False))
    for step, changes in SKVQ_STEPS.items():
        entries.append(Entry(f"skvq-K2V2-{step}", CALIBRATED, "skvq", {**SKVQ_FULL, **changes, "seed": seed}, ("skvq-ablation",),
                             in_all=False))
    entries.append(Entry("kivi2-g64-r128", BASELINE, "baseline", "kivi2-g64-r128", ("skvq-ablation",), in_all=False))
    for target in (2.6, 3.3):
        entries.append(Entry(f"mixed-{target:g}", CALIBRATED, "nuq", {"target_bits": target, "outliers": 0.01, "seed": seed},
                             ("mixed-widths",), in_all=False))
    entries.append(Entry("fp8-absmax-head", BASELINE, "fp8", ("absmax", "attn_head"), ("fp8",), in_all=False))
    for dtype, rules in ENGINE_RULES.items():
        for rule in rules:
            entries.append(Entry(f"{dtype}-{rule}", BASELINE, "layers", {"dtype": dtype, "rule": rule}, ("engine-layers",),
                                 in_all=False))
        ends = [rule for rule in rules if rule in _ENDS]
        for label, rule in (*zip(PLAN_EXTRA_LAYERS, ends), ("sliding", "sliding")):  # kvcal's choice at a hand rule's bytes
            for by in ("fisher", "importance"):
                entries.append(Entry(f"{dtype}-plan-{by}-{label}", CALIBRATED, "layers",
                                     {"dtype": dtype, "plan": by, "bytes_of": rule}, ("engine-layers",), in_all=False))
    entries.append(Entry("q8_0/q4_0", BASELINE, "baseline", "q8_0/q4_0", ("engine-types",), in_all=False))
    for hand in LLAMA_CPP_BY_HAND:  # kvcal plan's pair at the bytes of each hand choice
        entries.append(Entry(f"llama.cpp-plan-{hand.replace('/', '-')}", CALIBRATED, "types", {"bytes_of": hand},
                             ("engine-types",), in_all=False))
    for name, spec in IK_LLAMA_CPP_BY_HAND.items():  # and kvcal plan's ik_llama.cpp settings at the bytes of each
        entries.append(Entry(name, BASELINE, "baseline", spec, ("engine-types",), in_all=False))
        entries.append(Entry(f"ik_llama.cpp-plan-{name}", CALIBRATED, "first_last", {"bytes_of": spec}, ("engine-types",),
                             in_all=False))
    for strategy, suffix in (("tensor", ""), ("attn_head", "-head")):
        entries.append(Entry(f"fp8-calibrated{suffix}", CALIBRATED, "fp8", ("calibrated", strategy), ("fp8",), in_all=False))
    return entries


# members of the method sets that are in the Pareto catalog too
SET_MEMBERS = {
    "nuq-ablation": [f"{name}{bits}{rest}" for bits in (4, 3, 2)
                     for name, rest in (("nuq", "-1%"), ("int", "-g64"), ("kivi", "-g32-r128"), ("kivi", "-g32-r32"))],
    "skvq-ablation": ["int2-g64"],
    "mixed-widths": ["mixed", "mixed-3.55", "mixed-4.0", "nuq-kvmix-widths", "nuq2-1%", "nuq3-1%"],
    "engine-types": [name for name in LLAMA_CPP_BY_HAND if "/" not in name],
}


def select(entries: list[Entry], selectors: list[str]) -> list[Entry]:
    """Entries picked by name, alias, method set (METHOD_SETS) or group ('all', 'calibrated', 'baselines': the Pareto
    catalog without the sets' own entries), in catalog order."""
    picked = set()
    for selector in selectors:
        matches = {e.name for e in entries if selector in (e.name, *e.aliases) or e.name in SET_MEMBERS.get(selector, ())
                   or (e.in_all and (selector == "all" or (selector == "calibrated" and e.family == CALIBRATED)
                                     or (selector == "baselines" and e.family == BASELINE)))}
        if not matches:
            raise ValueError(f"unknown method '{selector}'; choose from all, calibrated, baselines, "
                             + ", ".join(dict.fromkeys(n for e in entries for n in (e.name, *e.aliases))))
        picked |= matches
    return [e for e in entries if e.name in picked]


# ------------------------------------------------------------------------------- pure result analysis


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """For (bits, ppl) points: True where no other point has bits <= and ppl <= with one of them strictly
    lower (minimizing both). Equal points are both on the front; NaN points never are."""
    on = []
    for i, (bits, ppl) in enumerate(points):
        if math.isnan(bits) or math.isnan(ppl):
            on.append(False)
            continue
        dominated = any(
            j != i and b <= bits + BITS_EPS and p <= ppl and (b < bits - BITS_EPS or p < ppl)
            for j, (b, p) in enumerate(points)
        )
        on.append(not dominated)
    return on


def best_recipe_at(bits: float, recipes: list[dict]) -> dict | None:
    """The row of `recipes` (dicts with effective_bits and ppl) with the lowest ppl among those at <= `bits`
    real bits; ties in ppl go to fewer bits, then to the earlier row. None if none fits the budget."""
    fitting = [r for r in recipes if r["effective_bits"] <= bits + BITS_EPS and not math.isnan(r["ppl"])]
    return min(fitting, key=lambda r: (r["ppl"], r["effective_bits"])) if fitting else None


def annotate(domain: dict) -> dict:
    """A domain's rows marked on or off the Pareto front, and every baseline against the recipes."""
    rows = domain["rows"]
    for row, on in zip(rows, pareto_front([(r["effective_bits"], r["ppl"]) for r in rows])):
        row["on_front"] = on
    domain["baselines_vs_recipes"] = compare_baselines(rows)
    return domain


SAME_RUN_KEYS = ("model", "calibration", "evaluation", "seed")
NO_CALIBRATION = "no calibrated recipe selected"  # a run of baselines only: no profile, so any earlier one's is kept
SAME_DOMAIN_KEYS = ("dataset", "tokens", "windows", "seqlen")
# fp's perplexity repeats exactly on one machine; CPUs with other vector units (AVX2, AVX-512) sum in other orders and
# differ near the 5th digit, far below the percent steps between methods
FP_PPL_TOLERANCE = 1e-4


def calibration_settings(calibration: str | None) -> str | None:
    """A run's calibration without the profile's path: how the profile was made (its corpus, samples, seed, sink
    and rows), which with the model fixes its content (profiles are deterministic), wherever the file lies."""
    found = re.fullmatch(r"profile .* (\(.*\))", calibration or "")
    return found.group(1) if found else calibration


def check_same_run(payload: dict, previous: dict) -> dict:
    """`payload`, its calibration taken from `previous` when it fits nothing (a run of baselines only reads no
    profile) or from the same settings at another path; raises ValueError unless both runs evaluated the same way
    (SAME_RUN_KEYS)."""
    if payload["calibration"] == NO_CALIBRATION or (
            calibration_settings(payload["calibration"]) == calibration_settings(previous.get("calibration"))):
        payload = {**payload, "calibration": previous.get("calibration")}
    for key in SAME_RUN_KEYS:
        if previous.get(key) != payload[key]:
            raise ValueError(f"the earlier results have {key} {previous.get(key)!r}, this run {payload[key]!r}")
    return payload


def merge_previous(payload: dict, previous: dict, order: list[str]) -> dict:
    """`payload` with the rows of `previous` (an earlier run's JSON) for the methods of `order` (the catalog) this run
    did not evaluate, each keeping the commit it was measured at; raises ValueError unless both runs evaluated the
    same way (check_same_run, SAME_DOMAIN_KEYS of every domain both have, and fp's perplexity to FP_PPL_TOLERANCE).
    Rows of methods no longer in the catalog are dropped."""
    payload = check_same_run(payload, previous)
    domains = {}
    for name in [*payload["domains"], *(n for n in previous["domains"] if n not in payload["domains"])]:
        new, old = payload["domains"].get(name), previous["domains"].get(name)
        for key in SAME_DOMAIN_KEYS if new and old else ():
            if old[key] != new[key]:
                raise ValueError(f"domain {name}: the earlier results have {key} {old[key]!r}, this run {new[key]!r}")
        if new and old and abs(new["fp_ppl"] / old["fp_ppl"] - 1) > FP_PPL_TOLERANCE:
            raise ValueError(f"domain {name}: the earlier results have fp_ppl {old['fp_ppl']!r}, this run {new['fp_ppl']!r}")
        fresh = new["rows"] if new else []
        evaluated = {r["name"] for r in fresh}
        kept = [{"commit": previous["commit"], **r} for r in (old["rows"] if old else []) if r["name"] not in evaluated]
        rows = sorted((r for r in kept + fresh if r["name"] in order), key=lambda r: order.index(r["name"]))
        domains[name] = annotate({**(new or old), "rows": rows})
    rows = [r for d in domains.values() for r in d["rows"]]
    return {**payload, "domains": domains, "methods": [n for n in order if any(r["name"] == n for r in rows)],
            "seconds_per_window": sum(r["seconds"] for r in rows) / sum(d["windows"] * len(d["rows"]) for d in domains.values())}


def compare_baselines(rows: list[dict]) -> list[dict]:
    """For every baseline row: the best calibrated recipe at <= its real bits and whether its ppl is lower. An engine
    dtype's layer rule is held against kvcal's layer plans for the same dtype only: the question is which layers."""
    recipes = [r for r in rows if r["family"] == CALIBRATED]
    out = []
    for row in rows:
        if row["family"] != BASELINE:
            continue
        dtype = next((d for d in ENGINE_RULES if row["name"].startswith(f"{d}-")), None)
        best = best_recipe_at(row["effective_bits"], [r for r in recipes if dtype is None or r["name"].startswith(f"{dtype}-")])
        out.append({"baseline": row["name"], "bits": row["effective_bits"], "ppl": row["ppl"], "delta_pct": row["delta_pct"],
                    "best_recipe": best and best["name"], "recipe_bits": best and best["effective_bits"],
                    "recipe_ppl": best and best["ppl"], "recipe_delta_pct": best and best["delta_pct"],
                    "recipe_lower_ppl": bool(best is not None and best["ppl"] < row["ppl"])})
    return out


# ------------------------------------------------------------------------------------------- progress

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ fitting


def _bits_of(spec: str, fingerprint: dict) -> float:
    """The real bits per element of an engine spec (a hand choice) on a profile's model."""
    from kvcal.adapters import decoder_kind, kv_shapes
    from kvcal.plan import dtype_bits

    return dtype_bits(spec, kv_shapes(fingerprint), decoder_kind(fingerprint))


@dataclass
class Fitter:
    """Fits calibrated methods from one profile, caching each artifact under work/fits-<profile key>/."""

    profile: Path
    work: Path
    refit: bool
    seqlen: int  # the evaluated windows' tokens: what a sliding-window layer stores is priced at it
    fitted: set = field(default_factory=set)  # paths fit in this run (--refit fits each once)

    def cached(self, path: Path) -> bool:
        return path.exists() and (not self.refit or path in self.fitted)

    @property
    def folder(self) -> Path:
        stat = self.profile.stat()
        key = hashlib.sha1(f"{self.profile.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
        return self.work / f"fits-{key}"

    def path_for(self, entry: Entry, suffix: str = ".safetensors") -> Path:
        settings = json.dumps({"kind": entry.kind, "spec": entry.spec}, sort_keys=True)
        digest = hashlib.sha1(settings.encode()).hexdigest()[:8]
        safe = entry.name.replace("%", "pct")
        return self.folder / f"{safe}-{digest}{suffix}"

    def method(self, entry: Entry, num_layers: int, windows: list[int | None]):
        """(simulation Method, artifact path) of a calibrated entry, fitting it unless cached (or cached by a
        kvcal that wrote another artifact schema)."""
        from kvcal.errors import KvcalError
        from kvcal.methods import artifact_method

        if entry.kind == "fp8":
            return self._fp8(entry, num_layers), self.fp8_scales(entry.spec[1])
        if entry.kind == "layers":
            return self._plan(entry, num_layers, windows)
        if entry.kind == "types":
            return self._types(entry, num_layers)
        if entry.kind == "first_last":
            return self._first_last(entry, num_layers)
        path = self.path_for(entry)
        cached = self.cached(path)
        started = time.perf_counter()
        if not cached:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fit(entry, path)
            self.fitted.add(path)
        log(f"fit {entry.name}: {'cached ' + path.name if cached else f'{time.perf_counter() - started:.1f} s -> {path.name}'}")
        try:
            return artifact_method(str(path)), path
        except KvcalError as exc:
            if not cached:
                raise
            log(f"fit {entry.name}: the cached artifact is not readable by this kvcal ({exc}); fitting it again")
            self.fitted.add(path)  # so that a second failure is not retried
            self._fit(entry, path)
            return artifact_method(str(path)), path

    def _fit(self, entry: Entry, path: Path) -> None:
        if entry.kind == "nuq":
            from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq

            write_nuq(path, *fit_nuq(str(self.profile), NuqSettings(**entry.spec)))
        elif entry.kind == "skvq":
            from kvcal.fit.skvq import SkvqSettings, fit_skvq, write_skvq

            write_skvq(path, *fit_skvq(str(self.profile), SkvqSettings(**entry.spec)))
        elif entry.kind == "kvmix":
            from kvcal.bundle import write_bundle
            from kvcal.calibration import build_bundle

            write_bundle(path, *build_bundle(str(self.profile), "kvmix"))
        else:
            raise ValueError(f"no fit for kind {entry.kind}")

    def _engine_plan(self, entry: Entry, num_layers: int, choose):
        """The baseline method of a kvcal plan entry: choose(fingerprint) makes the plan, written as JSON. Never read
        back from an earlier run: a plan takes seconds, and one cached by an older planner would be evaluated as this
        one's."""
        from kvcal.adapters import decoder_kind, kv_shapes
        from kvcal.artifacts import read_header
        from kvcal.methods import baseline_method

        fingerprint = read_header(str(self.profile))[1]["model"]["fingerprint"]
        path = self.path_for(entry, ".json")
        started = time.perf_counter()
        chosen = choose(fingerprint)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(chosen.as_dict(), indent=2) + "\n")
        spec = chosen.baseline_spec()
        log(f"plan {entry.name}: {time.perf_counter() - started:.1f} s -> {spec}")
        return baseline_method(spec, [head_dim for _, head_dim in kv_shapes(fingerprint)],
                               decoder=decoder_kind(fingerprint)), path

    def _plan(self, entry: Entry, num_layers: int, windows: list[int | None]):
        """kvcal plan's layers for entry.spec['dtype'] at the real bits of the hand rule entry.spec['bytes_of'] (with the
        layers the dtype keeps fp16 itself), sliding-window layers priced at what they store at --seqlen tokens."""
        from kvcal.adapters import decoder_kind, kv_shapes
        from kvcal.fit.nuq import stored_shares
        from kvcal.spans import attention_span
        from kvcal.plan import dtype_bits, fixed_fp16_layers, plan_layers

        def choose(fingerprint: dict):
            shapes, dtype, decoder = kv_shapes(fingerprint), entry.spec["dtype"], decoder_kind(fingerprint)
            wide = fixed_fp16_layers(dtype, [head_dim for _, head_dim in shapes], decoder)
            wide |= set(HAND_RULES[entry.spec["bytes_of"]](num_layers, windows))
            # each layer's elements stored at --seqlen weigh its price, as plan_layers weighs them
            shares = stored_shares([attention_span(window, None) for window in windows], self.seqlen)
            weights = [share * heads * head_dim for share, (heads, head_dim) in zip(shares, shapes)]
            stored = sum(weight * (16.0 if i in wide else dtype_bits(dtype, [shapes[i]], decoder)) for i, weight in enumerate(weights))
            return plan_layers(str(self.profile), "vllm", dtype, stored / sum(weights) + 1e-9, entry.spec["plan"], self.seqlen)

        return self._engine_plan(entry, num_layers, choose)

    def _types(self, entry: Entry, num_layers: int):
        """kvcal plan's llama.cpp -ctk / -ctv pair at the real bits of the hand choice entry.spec['bytes_of']."""
        from kvcal.plan import plan_cache_types

        return self._engine_plan(entry, num_layers, lambda fingerprint: plan_cache_types(
            str(self.profile), _bits_of(entry.spec["bytes_of"], fingerprint)))

    def _first_last(self, entry: Entry, num_layers: int):
        """kvcal plan's ik_llama.cpp settings at the real bits of the hand choice entry.spec['bytes_of']."""
        from kvcal.plan import plan_first_last

        return self._engine_plan(entry, num_layers, lambda fingerprint: plan_first_last(
            str(self.profile), _bits_of(entry.spec["bytes_of"], fingerprint) + 1e-9))

    def fp8_scales(self, strategy: str) -> Path:
        return self.folder / f"fp8-{strategy}-scales.safetensors"  # one calibrate_scales serves absmax and calibrated

    def _fp8(self, entry: Entry, num_layers: int):
        from safetensors.torch import load_file, save_file

        from kvcal.export.fp8 import Fp8KvScales
        from kvcal.export.scales import calibrate_scales
        from kvcal.methods.fp8 import fp8_method

        scales, strategy = entry.spec
        scales_path = self.fp8_scales(strategy)
        started = time.perf_counter()
        cached = self.cached(scales_path)
        if not cached:
            fit, _ = calibrate_scales(str(self.profile), strategy)
            tensors = {}
            for i, layer in enumerate(fit.layers):
                tensors.update({f"{i}.k_absmax": layer.k_absmax.float().flatten(), f"{i}.v_absmax": layer.v_absmax.float().flatten(),
                                f"{i}.k": layer.k.float().flatten(), f"{i}.v": layer.v.float().flatten()})
            scales_path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(scales_path.with_suffix(".tmp")))
            scales_path.with_suffix(".tmp").replace(scales_path)
            self.fitted.add(scales_path)
        tensors = load_file(str(scales_path))
        log(f"fit {entry.name}: {'cached ' + scales_path.name if cached else f'{time.perf_counter() - started:.1f} s -> {scales_path.name}'}")
        suffix = "_absmax" if scales == "absmax" else ""
        return fp8_method(entry.name, Fp8KvScales(tuple(tensors[f"{i}.k{suffix}"] for i in range(num_layers)),
                                                  tuple(tensors[f"{i}.v{suffix}"] for i in range(num_layers))))


def ensure_profile(args) -> Path:
    """--profile, or the default profile under --work (made once with kvcal.profile.run_profile; again when
    this kvcal cannot read the cached one; delete it to force a new one)."""
    from kvcal.artifacts import read_header
    from kvcal.errors import KvcalError

    if args.profile is not None:
        path = Path(args.profile)
        kind, _ = read_header(str(path))
        if kind != "profile":
            raise SystemExit(f"accuracy: --profile '{path}' is a kvcal {kind}, not a profile")
        log(f"profile: reusing {path}")
        return path
    profile_name, description, dataset = CALIBRATIONS[args.calibration]
    path = Path(args.work) / f"profile-{profile_name}-{PROFILE_SAMPLES}x{PROFILE_SEQLEN}-seed{args.seed}.safetensors"
    if path.exists():
        try:
            read_header(str(path))
            log(f"profile: cached {path}")
            return path
        except KvcalError as exc:
            log(f"profile: the cached profile is not readable by this kvcal ({exc}); making it again")
    from kvcal.capture import CaptureSettings
    from kvcal.profile import KvmixSettings, ProfileRequest, run_profile

    path.parent.mkdir(parents=True, exist_ok=True)
    request = ProfileRequest(model=args.model, dataset=dataset, nsamples=PROFILE_SAMPLES, seqlen=PROFILE_SEQLEN,
                             seed=args.seed, kvmix=KvmixSettings(),
                             capture=CaptureSettings(sink=PROFILE_SINK, max_tokens_per_layer=PROFILE_SAMPLES * PROFILE_SEQLEN,
                                                     store_windows=PROFILE_WINDOWS, seed=args.seed))
    started = time.perf_counter()
    log(f"profile: making {path} ({description}, {PROFILE_SAMPLES} x {PROFILE_SEQLEN}, all rows kept)")
    run_profile(request, path, on_window=lambda w: log(f"  profile window {w + 1}/{PROFILE_SAMPLES}"))
    log(f"profile: {time.perf_counter() - started:.1f} s")
    return path


# ------------------------------------------------------------------------------------------ outputs


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(payload: dict) -> list[str]:
    lines = [f"# Perplexity change vs real bits: {payload['model']}", "",
             f"{payload['evaluation']}. Calibrated recipes fit once from: {payload['calibration']}. "
             "Real bits = what the runtime stores per K/V element at the window length (packed int32 code words, "
             "parameters in their storage dtype, 4-byte outliers and their offset tables, fp16 sinks/windows/residuals). "
             "front = on the Pareto front (no other method has <= bits and <= ppl).", ""]
    commits = {}
    for domain in payload["domains"].values():
        for row in domain["rows"]:
            commits.setdefault(row.get("commit", payload["commit"]), []).append(row["name"])
    if len(commits) > 1:  # merged by --update
        lines += ["Rows measured at " + "; ".join(f"commit {c}: {', '.join(dict.fromkeys(names))}" for c, names in commits.items()) + ".", ""]
    for domain in payload["domains"].values():
        lines += [f"## {domain['description']} ({domain['windows']} x {domain['seqlen']} tokens, fp ppl {domain['fp_ppl']:.4f})", "",
                  "| method | family | real bits | K bits | V bits | ppl | vs fp | front |", "|---|---|---|---|---|---|---|---|"]
        for row in sorted(domain["rows"], key=lambda r: (r["effective_bits"], r["ppl"])):
            lines.append(f"| {row['name']} | {row['family']} | {row['effective_bits']:.3f} | {fmt(row['key_bits'], '.3f')} | "
                         f"{fmt(row['value_bits'], '.3f')} | {row['ppl']:.4f} | {row['delta_pct']:+.2f}% | {'yes' if row['on_front'] else ''} |")
        comparisons = domain["baselines_vs_recipes"]
        if comparisons:
            beaten = sum(c["recipe_lower_ppl"] for c in comparisons)
            lines += ["", f"Every baseline against the best calibrated recipe at <= its real bits: {beaten} of {len(comparisons)} "
                      "have a recipe with lower perplexity.", "",
                      "| baseline | real bits | vs fp | best recipe at <= bits | its real bits | its vs fp | lower ppl |",
                      "|---|---|---|---|---|---|---|"]
            for c in sorted(comparisons, key=lambda c: c["bits"]):
                lines.append(f"| {c['baseline']} | {c['bits']:.3f} | {c['delta_pct']:+.2f}% | {c['best_recipe'] or 'none'} | "
                             f"{fmt(c['recipe_bits'], '.3f')} | {fmt(c['recipe_delta_pct'], '+.2f')}{'%' if c['best_recipe'] else ''} | "
                             f"{'yes' if c['recipe_lower_ppl'] else 'NO'} |")
        lines.append("")
    lines.append(f"Evaluation time: {payload['seconds_per_window']:.2f} s per method x domain x window on average "
                 f"({payload['device']}).")
    return lines


LABEL_OFFSETS = ((4, 3), (4, -10), (-4, 3), (-4, -10), (4, 12), (4, -19), (-4, 12), (-4, -19), (4, 21), (4, -28))  # points


def _place_labels(renderer, labels: list) -> None:
    """Move each annotation to the first offset where it stays inside its axes and overlaps neither a placed
    label nor a marker (else to the offset with the fewest overlaps)."""
    placed = []
    for ann, markers, frame in labels:
        best, best_overlap = None, None
        for dx, dy in LABEL_OFFSETS:
            ann.set_position((dx, dy))
            ann.set_horizontalalignment("left" if dx > 0 else "right")
            box = ann.get_window_extent(renderer)
            outside = box.x0 < frame.x0 or box.x1 > frame.x1 or box.y0 < frame.y0 or box.y1 > frame.y1
            overlap = 3 * outside + sum(box.overlaps(other) for other in placed) + sum(box.overlaps(m) for m in markers)
            if best_overlap is None or overlap < best_overlap:
                best, best_overlap = (dx, dy), overlap
            if overlap == 0:
                break
        ann.set_position(best)
        ann.set_horizontalalignment("left" if best[0] > 0 else "right")
        placed.append(ann.get_window_extent(renderer))


def plot(payload: dict, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import Bbox

    domains = list(payload["domains"].values())
    fig = Figure(figsize=(8 * len(domains), 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(domains), squeeze=False)[0]
    styles = {CALIBRATED: ("tab:blue", "o", "calibrated (kvcal)"), BASELINE: ("tab:orange", "s", "baseline (no calibration)")}
    pending = []
    for ax, domain in zip(axes, domains):
        rows = domain["rows"]
        shown = {id(r): max(r["delta_pct"], PLOT_FLOOR_PCT) for r in rows}
        for family, (colour, marker, label) in styles.items():
            members = [r for r in rows if r["family"] == family]
            if members:
                ax.scatter([r["effective_bits"] for r in members], [shown[id(r)] for r in members],
                           c=colour, marker=marker, s=36, label=label, zorder=3)
        front = sorted((r for r in rows if r["on_front"]), key=lambda r: r["effective_bits"])
        if front:
            xs, ys = [r["effective_bits"] for r in front], [shown[id(r)] for r in front]
            ax.step(xs, ys, where="post", color="black", linewidth=1, alpha=0.7, zorder=2)
            ax.scatter(xs, ys, s=110, facecolors="none", edgecolors="black", linewidths=1, zorder=4, label="Pareto front")
        if any(r["delta_pct"] <= PLOT_FLOOR_PCT for r in rows):
            ax.axhline(PLOT_FLOOR_PCT, color="grey", linewidth=0.6, linestyle=":")
        ax.set_yscale("log")
        ax.margins(x=0.07, y=0.08)
        ax.set_xlabel("real bits per K/V element (as the runtime stores them)")
        ax.set_ylabel(f"perplexity change vs fp, % (log; <= {PLOT_FLOOR_PCT}% drawn at {PLOT_FLOOR_PCT}%)")
        ax.set_title(f"{domain['description']}: fp ppl {domain['fp_ppl']:.3f}, {domain['windows']} x {domain['seqlen']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        for r in sorted(rows, key=lambda r: (r["effective_bits"], -shown[id(r)])):
            text = r["name"] if r["delta_pct"] > PLOT_FLOOR_PCT else f"{r['name']} ({r['delta_pct']:+.3f}%)"
            ann = ax.annotate(text, (r["effective_bits"], shown[id(r)]), xytext=LABEL_OFFSETS[0], textcoords="offset points",
                              fontsize=6.5, color=styles[r["family"]][0], va="bottom")
            ann.set_in_layout(False)
            pending.append((ax, ann, rows, shown))
    fig.suptitle(f"KV-cache quantization on {payload['model']}: accuracy per real bit")
    fig.canvas.draw()  # the constrained layout fixes the axes; labels are then placed in display space
    renderer = fig.canvas.get_renderer()
    labels = []
    for ax, ann, rows, shown in pending:
        points = ax.transData.transform([(r["effective_bits"], shown[id(r)]) for r in rows])
        markers = [Bbox.from_extents(x - 4, y - 4, x + 4, y + 4) for x, y in points]
        labels.append((ann, markers, ax.get_window_extent(renderer)))
    _place_labels(renderer, labels)
    fig.set_layout_engine("none")  # keep the axes where the labels were placed
    fig.savefig(path, dpi=150)
    return path


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    names = ", ".join(e.name for e in catalog(0) if e.in_all)
    sets = "; ".join(f"{name}: {what}" for name, what in METHOD_SETS.items())
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods: {names}. Aliases: nuqN, skvq, skvq-wW, intN, int, kiviN, kivi, hadamard, turbo, llama.cpp, sglang, fp8; "
               f"groups: all, calibrated, baselines. Method sets (not in all): {sets}.")
    parser.add_argument("--methods", nargs="+", default=["all"], metavar="NAME",
                        help="methods to evaluate, by name, alias, group or method set (default: all)")
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=list(DOMAINS),
                        help="evaluation domains: wikitext2 (wikitext-2 test) and code (held-out Python stdlib sources); default both")
    parser.add_argument("--windows", type=int, default=40, help="consecutive windows per domain (default 40)")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--profile", default=None, help="reuse this kvcal profile for the calibrated recipes (default: make one "
                        "on the --calibration corpus, 16 x 512, under --work)")
    parser.add_argument("--calibration", default="wikitext2", choices=list(CALIBRATIONS),
                        help="corpus of the default profile: wikitext2 (wikitext-2 valid) or builtin (kvcal's built-in corpus, "
                             "the default of `kvcal calibrate`); default wikitext2")
    parser.add_argument("--work", default=str(REPO / "artifacts" / "bench" / "pareto"),
                        help="folder for the default profile and the cached fitted artifacts (default artifacts/bench/pareto)")
    parser.add_argument("--refit", action="store_true", help="fit every calibrated recipe again instead of using cached "
                        "artifacts (the default profile is kept; a cached file this kvcal cannot read is remade anyway)")
    parser.add_argument("--model", default=None, help="model to evaluate (default: the packaged SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the default profile, the fits and torch (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--update", action="store_true", help="keep the rows of the existing results/<out-name>.json for the "
                        "methods not evaluated now (refused unless it was evaluated the same way: model, profile, windows, fp ppl)")
    parser.add_argument("--out-name", default="pareto",
                        help="write benchmarks/results/<out-name>.{json,md,png} (default pareto; use another name for trial runs)")
    args = parser.parse_args(argv)
    if args.windows < 1 or args.seqlen < 2:
        parser.error("--windows must be >= 1 and --seqlen >= 2")
    try:
        args.entries = select(catalog(args.seed), args.methods)
    except ValueError as exc:
        parser.error(str(exc))
    args.domains = list(dict.fromkeys(args.domains))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws a tqdm bar; progress here is one line per step
    started_with = provenance()
    import torch

    from kvcal.errors import KvcalError

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    missing = [DOMAINS[d][1] for d in args.domains if DOMAINS[d][1].startswith("/") and not Path(DOMAINS[d][1]).is_file()]
    if missing:
        raise SystemExit(f"accuracy: evaluation text {missing[0]} is missing; it is expected at ../shared beside the checkout")
    try:
        run(args, started_with)
    except KvcalError as exc:
        raise SystemExit(f"accuracy: {exc}") from exc


def run(args, started_with: dict) -> None:
    from kvcal.adapters import adapt
    from kvcal.artifacts import read_header
    from kvcal.data import load_text, tokenize
    from kvcal.evaluate import check_model_matches, consecutive_windows, evaluate_ppl
    from kvcal.export.fp8 import Fp8KvScales
    from kvcal.methods import baseline_method
    from kvcal.methods.fp8 import fp8_method
    from kvcal.models import load_model

    entries = list(args.entries)
    profile = ensure_profile(args) if any(e.needs_profile for e in entries) else None
    log("loading model")
    model, tokenizer, source = load_model(args.model)
    adapter = adapt(model)
    num_layers = len(adapter.layers)
    if not any(adapter.windows):  # the sliding-window rule keeps nothing on a model without windows
        entries = [e for e in entries if not (e.kind == "layers" and "sliding" in (e.spec.get("rule"), e.spec.get("bytes_of")))]
    fitter = Fitter(profile, Path(args.work), args.refit, args.seqlen) if profile is not None else None
    methods, artifacts = [], {}
    for entry in entries:
        if entry.kind == "baseline":
            methods.append(baseline_method(entry.spec, adapter.head_dims, decoder=adapter.decoder_kind,
                                           value_dims=adapter.value_dims, latent=adapter.latent,
                                           indexed=any(adapter.index_widths)))
            continue
        if entry.kind == "layers" and "rule" in entry.spec:
            kept = HAND_RULES[entry.spec["rule"]](num_layers, adapter.windows)
            spec = entry.spec["dtype"] + (f";skip={'+'.join(map(str, kept))}" if kept else "")
            methods.append(baseline_method(spec, adapter.head_dims, adapter.windows, adapter.decoder_kind,
                                           adapter.value_dims, adapter.latent, any(adapter.index_widths)))
            continue
        if entry.needs_profile:
            method, path = fitter.method(entry, num_layers, adapter.windows)
            artifacts[entry.name] = str(path)
            if entry.kind != "fp8":
                check_model_matches(method, adapter, source.spec, str(path))
        else:  # fp8 at vLLM's default scale 1.0
            method = fp8_method(entry.name, Fp8KvScales.unit(num_layers))
        methods.append(method)

    calibration = NO_CALIBRATION
    if profile is not None:
        cal = read_header(str(profile))[1]["calibration"]
        calibration = (f"profile {profile} ({cal['dataset']}, {cal['nsamples']} x {cal['seqlen']}, seed {cal['seed']}, "
                       f"sink {cal['sink']}, {cal['max_tokens_per_layer']} rows/layer max)")
    run_keys = {"model": source.spec, "calibration": calibration,
                "evaluation": f"seqlen {args.seqlen}, {args.windows} consecutive windows per domain, fake quantization with "
                              "decode-time semantics (kvcal.evaluate.evaluate_ppl)", "seed": args.seed}
    previous_path = RESULTS / f"{args.out_name}.json"

    def cannot_update(exc: Exception) -> SystemExit:
        return SystemExit(f"accuracy: --update cannot keep the rows of {previous_path}: {exc}; run without --update")

    if args.update:  # refused before the evaluation, not after it
        try:
            previous = json.loads(previous_path.read_text())
            check_same_run(run_keys, previous)
        except (OSError, ValueError, KeyError) as exc:
            raise cannot_update(exc) from exc

    domains, eval_seconds = {}, 0.0
    for name in args.domains:
        description, dataset = DOMAINS[name]
        log(f"[{name}] tokenizing {dataset}")
        ids = tokenize(load_text(dataset), tokenizer)
        windows = consecutive_windows(ids, args.seqlen, args.windows)
        labels = ["fp", *(e.name for e in entries)]
        ticks, last = [0], [time.perf_counter()]
        seconds = []

        def on_step():
            ticks[0] += 1
            if ticks[0] % args.windows == 0:
                now = time.perf_counter()
                index = ticks[0] // args.windows - 1
                seconds.append(now - last[0])
                log(f"[{name}] {index}/{len(entries)} {labels[index]}: {now - last[0]:.1f} s ({(now - last[0]) / args.windows:.2f} s/window)")
                last[0] = now

        results = evaluate_ppl(model, adapter, windows, methods, on_step=on_step)
        fp = results[0]
        rows = []
        for entry, method, result, secs in zip(entries, methods, results[1:], seconds[1:]):
            rows.append({"name": entry.name, "family": entry.family, "kvcal_name": method.name, **result.as_dict(),
                         "artifact": artifacts.get(entry.name), "seconds": round(secs, 2), "commit": started_with["commit"]})
        for row in rows:
            del row["method"]
        eval_seconds += sum(seconds[1:])
        domains[name] = annotate({"description": description, "dataset": dataset, "tokens": ids.numel(), "windows": args.windows,
                                  "seqlen": args.seqlen, "fp_ppl": fp.ppl, "fp_seconds": round(seconds[0], 2), "rows": rows})

    runs = len(entries) * len(domains) * args.windows
    payload = {**run_keys, "methods": [e.name for e in entries], "domains": domains,
               "seconds_per_window": eval_seconds / runs if runs else float("nan"), "argv": sys.argv[1:]}
    if args.update:
        try:
            payload = merge_previous(payload, previous, [e.name for e in catalog(args.seed)])
        except (ValueError, KeyError) as exc:
            raise cannot_update(exc) from exc
        log(f"kept the rows of {previous_path} for the methods not evaluated now")
    json_path = write_result(args.out_name, payload, started_with)
    md_path = write_markdown(args.out_name, markdown({**started_with, **payload}))
    png_path = plot(payload, RESULTS / f"{args.out_name}.png")
    log(f"wrote {json_path}, {md_path} and {png_path}")


if __name__ == "__main__":
    main()
