"""The pure parts of benchmarks/accuracy.py: the Pareto front, the best calibrated recipe at <= a
baseline's real bits, method selection and the method sets. No model is loaded."""

from __future__ import annotations

import math

import pytest

from benchmarks import accuracy


@pytest.fixture(scope="module")
def bench():
    return accuracy


def test_pareto_front_minimizes_bits_and_ppl(bench):
    points = [(4.5, 26.0), (3.5, 27.0), (4.5, 26.5), (5.0, 26.0), (2.5, 40.0), (3.0, 45.0), (8.0, 25.7)]
    #          front       front        same bits,    more bits,   front        dominated by   front
    #                                   higher ppl    same ppl                  (2.5, 40)
    assert bench.pareto_front(points) == [True, True, False, False, True, False, True]


def test_pareto_front_ties_and_nan(bench):
    assert bench.pareto_front([(3.0, 10.0), (3.0, 10.0)]) == [True, True]
    assert bench.pareto_front([(3.0, 10.0), (3.0 + 1e-12, 10.0)]) == [True, True]  # equal within BITS_EPS
    assert bench.pareto_front([(3.0, math.nan), (4.0, 10.0)]) == [False, True]
    assert bench.pareto_front([]) == []


def test_best_recipe_at_bits(bench):
    recipes = [{"name": "nuq4", "effective_bits": 4.45, "ppl": 26.1},
               {"name": "nuq3", "effective_bits": 3.44, "ppl": 27.3},
               {"name": "skvq", "effective_bits": 2.60, "ppl": 27.3},
               {"name": "nuq2", "effective_bits": 2.44, "ppl": 35.5}]
    assert bench.best_recipe_at(4.5, recipes)["name"] == "nuq4"
    assert bench.best_recipe_at(4.45, recipes)["name"] == "nuq4"  # <= bits, inclusive
    assert bench.best_recipe_at(3.5, recipes)["name"] == "skvq"  # equal ppl: fewer bits wins
    assert bench.best_recipe_at(2.5, recipes)["name"] == "nuq2"
    assert bench.best_recipe_at(2.0, recipes) is None


def test_compare_baselines(bench):
    rows = [{"name": "nuq3", "family": "calibrated", "effective_bits": 3.44, "ppl": 27.3, "delta_pct": 6.5},
            {"name": "nuq2", "family": "calibrated", "effective_bits": 2.44, "ppl": 35.5, "delta_pct": 38.7},
            {"name": "hadamard-int3", "family": "baseline", "effective_bits": 3.5, "ppl": 32.0, "delta_pct": 26.0},
            {"name": "turbo2", "family": "baseline", "effective_bits": 2.25, "ppl": 70.0, "delta_pct": 171.0},
            {"name": "int2", "family": "baseline", "effective_bits": 2.5, "ppl": 30.0, "delta_pct": 17.0}]
    by_name = {c["baseline"]: c for c in bench.compare_baselines(rows)}
    assert set(by_name) == {"hadamard-int3", "turbo2", "int2"}
    assert by_name["hadamard-int3"]["best_recipe"] == "nuq3" and by_name["hadamard-int3"]["recipe_lower_ppl"]
    assert by_name["turbo2"]["best_recipe"] is None and not by_name["turbo2"]["recipe_lower_ppl"]
    assert by_name["int2"]["best_recipe"] == "nuq2" and not by_name["int2"]["recipe_lower_ppl"]


def test_engine_layer_rules_meet_only_plans_of_their_own_dtype(bench):
    rows = [{"name": "int4_per_token_head-plan-fisher-2", "family": "calibrated", "effective_bits": 5.2, "ppl": 30.7, "delta_pct": 3.7},
            {"name": "turboquant_k3v4_nc-plan-fisher-2", "family": "calibrated", "effective_bits": 6.3, "ppl": 33.0, "delta_pct": 11.0},
            {"name": "turboquant_k3v4_nc-three-at-each-end", "family": "baseline", "effective_bits": 6.3, "ppl": 34.0, "delta_pct": 15.0},
            {"name": "int4_per_token_head-none", "family": "baseline", "effective_bits": 4.5, "ppl": 30.8, "delta_pct": 4.0}]
    by_name = {c["baseline"]: c for c in bench.compare_baselines(rows)}
    assert by_name["turboquant_k3v4_nc-three-at-each-end"]["best_recipe"] == "turboquant_k3v4_nc-plan-fisher-2"
    assert by_name["int4_per_token_head-none"]["best_recipe"] is None


def test_turboquant_rules_and_plans_count_layers_beyond_its_own_boundary(bench):
    from kvcal.plan import fixed_fp16_layers

    entries = {e.name: e for e in bench.select(bench.ablations(0), ["engine-layers"])}
    assert entries["turboquant_k3v4_nc-none"].spec == {"dtype": "turboquant_k3v4_nc", "rule": "none"}
    assert fixed_fp16_layers("turboquant_k3v4_nc", [64] * 10, "dense") == {0, 1, 8, 9}  # vLLM's boundary layers
    assert fixed_fp16_layers("turboquant_k3v4_nc", [64] * 10, "recurrent") == set()  # none in a hybrid
    assert bench.HAND_RULES["three-at-each-end"](10, [None] * 10) == [0, 1, 2, 7, 8, 9]  # two layers beyond it
    assert entries["turboquant_k3v4_nc-plan-fisher-2"].spec["bytes_of"] == "three-at-each-end"
    assert {e.spec["bytes_of"] for name, e in entries.items() if name.startswith("turboquant") and "plan" in e.spec} == \
        {"three-at-each-end", "four-at-each-end", "sliding"}


def test_select_by_name_alias_and_group(bench):
    entries = bench.catalog(0)
    assert [e.name for e in bench.select(entries, ["q4_0", "int4"])] == ["int4-g64", "q4_0"]  # catalog order
    assert [e.name for e in bench.select(entries, ["kivi2"])] == ["kivi2-g32-r32", "kivi2-g32-r128"]
    assert all(e.family == "calibrated" for e in bench.select(entries, ["calibrated"]))
    assert len(bench.select(entries, ["all"])) == sum(e.in_all for e in entries)
    with pytest.raises(ValueError, match="unknown method 'int5'"):
        bench.select(entries, ["int5"])


def _run(commit: str, rows: dict[str, tuple[str, float, float]], fp_ppl: float = 25.0) -> dict:
    """A results payload of one domain: rows name -> (family, bits, ppl)."""
    domain = {"dataset": "test.txt", "tokens": 1000, "windows": 2, "seqlen": 8, "fp_ppl": fp_ppl, "description": "d",
              "rows": [{"name": n, "family": f, "effective_bits": b, "ppl": p, "delta_pct": 100 * (p / fp_ppl - 1), "seconds": 1.0,
                        "commit": commit} for n, (f, b, p) in rows.items()]}
    return {"commit": commit, "model": "m", "calibration": "c", "evaluation": "e", "seed": 0, "domains": {"wiki": domain}}


def test_update_keeps_earlier_rows_of_methods_not_evaluated_now(bench):
    previous = _run("aaa", {"nuq4": ("calibrated", 4.4, 26.0), "q8_0": ("baseline", 8.5, 25.1), "gone": ("calibrated", 3.0, 27.0)})
    previous["domains"]["wiki"]["rows"][0].pop("commit")  # rows written before rows named their commit
    now = _run("bbb", {"nuq8": ("calibrated", 8.1, 25.05), "nuq4": ("calibrated", 4.4, 26.5)})
    merged = bench.merge_previous(now, previous, ["nuq8", "nuq4", "q8_0"])
    rows = {r["name"]: r for r in merged["domains"]["wiki"]["rows"]}
    assert list(rows) == ["nuq8", "nuq4", "q8_0"]  # catalog order; a method no longer in the catalog is dropped
    assert rows["nuq4"]["ppl"] == 26.5 and rows["nuq4"]["commit"] == "bbb"  # evaluated now: the new row
    assert rows["q8_0"]["commit"] == "aaa" and rows["nuq8"]["commit"] == "bbb"
    assert merged["methods"] == ["nuq8", "nuq4", "q8_0"] and merged["seconds_per_window"] == 0.5
    (vs,) = merged["domains"]["wiki"]["baselines_vs_recipes"]
    assert vs["best_recipe"] == "nuq8" and vs["recipe_lower_ppl"] and rows["nuq8"]["on_front"] and not rows["q8_0"]["on_front"]


def test_update_of_baselines_only_keeps_the_earlier_calibration(bench):
    """A run that fits nothing reads no profile: its baseline rows join results made on any."""
    previous = _run("aaa", {"nuq4": ("calibrated", 4.4, 26.0)})
    now = _run("bbb", {"q8_0": ("baseline", 8.5, 25.1)})
    now["calibration"] = bench.NO_CALIBRATION
    merged = bench.merge_previous(now, previous, ["nuq4", "q8_0"])
    assert merged["calibration"] == "c" and [r["name"] for r in merged["domains"]["wiki"]["rows"]] == ["nuq4", "q8_0"]


def test_update_takes_the_same_profile_settings_at_another_path(bench):
    """A profile made the same way (model, corpus, samples, seed) is the same profile wherever it lies; other settings
    are another calibration."""
    settings = "(wikitext-2 valid, 16 x 512, seed 0, sink 1, 8192 rows/layer max)"
    previous = _run("aaa", {"nuq4": ("calibrated", 4.4, 26.0)})
    previous["calibration"] = f"profile /tmp/a/profile.safetensors {settings}"
    now = _run("bbb", {"nuq3": ("calibrated", 3.4, 27.0)})
    now["calibration"] = f"profile /tmp/b/profile.safetensors {settings}"
    merged = bench.merge_previous(now, previous, ["nuq4", "nuq3"])
    assert merged["calibration"] == previous["calibration"] and len(merged["domains"]["wiki"]["rows"]) == 2
    now["calibration"] = f"profile /tmp/a/profile.safetensors {settings.replace('seed 0', 'seed 1')}"
    with pytest.raises(ValueError, match="the earlier results have calibration"):
        bench.merge_previous(now, previous, ["nuq4", "nuq3"])


@pytest.mark.parametrize("change, message", [
    (lambda run: run.update(model="other"), "model 'm'"),
    (lambda run: run["domains"]["wiki"].update(fp_ppl=25.01), "domain wiki: the earlier results have fp_ppl 25.0"),
    (lambda run: run["domains"]["wiki"].update(windows=40), "windows 2"),
])
def test_update_refuses_results_evaluated_another_way(bench, change, message):
    previous, now = _run("aaa", {"q8_0": ("baseline", 8.5, 25.1)}), _run("bbb", {"nuq8": ("calibrated", 8.1, 25.05)})
    change(now)
    with pytest.raises(ValueError, match=message):
        bench.merge_previous(now, previous, ["nuq8", "q8_0"])


def test_update_takes_fp_within_another_cpus_rounding(bench):
    """fp measured on a CPU with other vector units differs near the 5th digit: still the same evaluation."""
    previous, now = _run("aaa", {"q8_0": ("baseline", 8.5, 25.1)}), _run("bbb", {"nuq8": ("calibrated", 8.1, 25.05)}, fp_ppl=25.001)
    merged = bench.merge_previous(now, previous, ["nuq8", "q8_0"])
    assert [r["name"] for r in merged["domains"]["wiki"]["rows"]] == ["nuq8", "q8_0"]


def test_calibration_and_update_options(bench):
    args = bench.parse_args(["--calibration", "builtin", "--update", "--methods", "nuq3", "uq8-0.1%"])
    assert args.calibration == "builtin" and args.update and [e.name for e in args.entries] == ["nuq3-1%", "uq8-0.1%"]
    assert bench.CALIBRATIONS[args.calibration][2] == "builtin"  # the dataset spec of `kvcal calibrate`'s default
    with pytest.raises(SystemExit):
        bench.parse_args(["--calibration", "c4"])


def test_method_sets_hold_their_ablations_and_stay_out_of_all(bench):
    entries = bench.catalog(0)
    assert len({e.name for e in entries}) == len(entries)
    everything = {e.name for e in bench.select(entries, ["all"])}
    for name in bench.METHOD_SETS:
        members = {e.name for e in bench.select(entries, [name])}
        assert members and set(bench.SET_MEMBERS.get(name, ())) <= members
    ablation = {e.name: e.spec for e in bench.select(entries, ["nuq-ablation"])}
    assert len(ablation) == 3 * (len(bench.NUQ_ABLATIONS) + 4)  # per width: the ablations, nuqB-1%, int, two KIVI
    assert ablation["nuq2-1%-qnorm-flipped"]["qnorm"] == "off" and ablation["nuq3-1%-qnorm-flipped"]["qnorm"] == "on"
    assert not everything & {"nuq3-1%-no-sink", "skvq-K2V2-rtn", "mixed-2.6", "fp8-calibrated-head"}


def test_skvq_steps_add_one_component_at_a_time(bench):
    specs = {e.name: e.spec for e in bench.select(bench.catalog(0), ["skvq-ablation"])}
    steps = [specs[f"skvq-K2V2-{step}"] for step in ("rtn", "window", "clip", "reorder", "sink", "fp8")]
    for before, after in zip(steps, steps[1:]):
        assert sum(before.get(k) != after.get(k) for k in {*before, *after}) == 1
