import json
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers.local_hub import closed_port_url
from helpers.tiny_models import TINY_VOCAB
from kvcal.data import PYTHON_CODE, builtin_text, load_text, sample_windows, tokenize
from kvcal.errors import KvcalError


def test_builtin_corpus_is_real_text(tiny_tokenizer):
    text = load_text("builtin")
    assert text == builtin_text() and len(text) > 100_000 and "lambda" in text
    assert tokenize(text[:5000], tiny_tokenizer).max() < TINY_VOCAB


def test_a_special_tokens_spelling_in_the_text_is_tokenized_as_text(tiny_tokenizer):
    """wikitext's "<unk>" markers: as text, never as the tokenizer's special token of that spelling."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<eos>")
    ids = tokenize("a word <eos> and <eos>", tiny_tokenizer)
    assert eos not in ids.tolist() and tiny_tokenizer.decode(ids) == "a word <eos> and <eos>"


def test_local_txt_is_read_whole_through_datasets(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first line\n\nsecond paragraph\n")
    assert load_text(str(path)) == "first line\n\nsecond paragraph\n"


def test_jsonl_parquet_and_folders(tmp_path):
    import datasets

    rows = [{"id": 1, "text": "alpha"}, {"id": 2, "text": "beta"}]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "part.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_text(str(tmp_path / "j" / "part.jsonl")) == "alpha\n\nbeta"
    assert load_text(str(tmp_path / "j")) == "alpha\n\nbeta"
    datasets.Dataset.from_list([{"body": "gamma"}, {"body": "delta"}]).to_parquet(str(tmp_path / "p.parquet"))
    assert load_text(str(tmp_path / "p.parquet")) == "gamma\n\ndelta"


def test_missing_or_unreadable_datasets_are_clear_errors(tmp_path):
    with pytest.raises(KvcalError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(KvcalError, match="not a .txt/.jsonl/.parquet"):
        load_text(str(tmp_path / "x.csv"))
    (tmp_path / "n.jsonl").write_text(json.dumps({"n": 1}))
    with pytest.raises(KvcalError, match="no text column"):
        load_text(str(tmp_path / "n.jsonl"))


def test_a_hub_dataset_not_cached_on_a_machine_without_the_hub_is_one_line_without_retries(hub_endpoint, tmp_path,
                                                                                           monkeypatch, caplog):
    import datasets

    url = closed_port_url()
    hub_endpoint(url)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    with pytest.raises(KvcalError, match=rf"'kvcal-tests/absent:main:test': it is not in the datasets cache and {url} "
                                         r"cannot be reached \(.*\); pass a local file or folder") as refused:
        load_text("kvcal-tests/absent:main:test")
    assert "OfflineModeIsEnabled" in str(refused.value.__cause__)  # (datasets never tried the endpoint)
    assert "Retry" not in caplog.text


def test_windows_are_seeded_slices_of_the_corpus():
    ids = torch.arange(10_000)
    first = sample_windows(ids, 8, 128, seed=0)
    assert first.shape == (8, 128)
    assert torch.all(first[:, 1:] - first[:, :-1] == 1)  # contiguous slices
    assert torch.equal(first, sample_windows(ids, 8, 128, seed=0))
    assert not torch.equal(first, sample_windows(ids, 8, 128, seed=1))


def test_asking_for_more_text_than_exists_says_how_many_tokens():
    with pytest.raises(KvcalError, match="has 100 tokens, fewer than one window"):
        sample_windows(torch.arange(100), 1, 128, seed=0)
    with pytest.raises(KvcalError, match="has only 1000"):
        sample_windows(torch.arange(1000), 8, 128, seed=0)


def test_python_code_is_the_standard_library_source_in_file_order():
    text = load_text(PYTHON_CODE)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [line[len("# file: "):] for line in text.splitlines() if line.startswith("# file: ")]
    assert names == sorted(p.name for p in stdlib.glob("*.py")) and "os.py" in names
    assert (stdlib / "os.py").read_text() in text and len(text) > 1_000_000
