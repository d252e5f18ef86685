"""benchmarks.nvfp4_scales: what a calibrated global scale buys vLLM's nvfp4 KV cache, per layer."""

import json

import pytest

from benchmarks import nvfp4_scales
from kvcal.artifacts import read_artifact
from kvcal.plan import key_cost, value_cost
from kvcal.vllm_codecs import Nvfp4


def test_each_layer_is_priced_at_unit_absmax_and_searched_scales_by_the_plans_fisher_cost(tiny_profile):
    _, path = tiny_profile
    profile, config = read_artifact(str(path), "profile")
    fingerprint = config["model"]["fingerprint"]
    got = nvfp4_scales.layer_costs(profile, config, 1, four_over_six=False)
    absmax = float(profile["layers.1.v.absmax"].max()) / (6 * 448)
    assert got["k"]["unit"] == key_cost(profile, config, 1, Nvfp4(fingerprint["head_dim"]), fingerprint["num_kv_heads"])
    assert got["v"]["absmax"] == value_cost(profile, 1, Nvfp4(fingerprint["head_dim"], k_scale=absmax))
    assert got["v"]["absmax_scale"] == absmax
    for side in ("k", "v"):  # the search starts at absmax / 2688 and keeps it unless a multiple does better
        assert got[side]["best"] <= got[side]["absmax"]
        assert 0.5 <= got[side]["best_multiple"] <= 2.0


def test_the_script_writes_a_table_per_profile_and_refuses_a_missing_one(tiny_profile, tmp_path, capsys):
    _, path = tiny_profile
    out = tmp_path / "scales"
    nvfp4_scales.main(["--profile", str(path), "--name", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    layers = read_artifact(str(path), "profile")[1]["model"]["fingerprint"]["num_layers"]
    assert [row["layer"] for row in result["models"][0]["rows"]] == list(range(layers))
    assert "| all layers |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        nvfp4_scales.main(["--profile", str(tmp_path / "none.safetensors"), "--name", str(out)])
    assert exit_info.value.code == 2
    assert "no such file" in capsys.readouterr().err
