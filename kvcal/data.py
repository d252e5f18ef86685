"""Calibration and evaluation text: `builtin` (English prose), `python-code` (a held-out code domain), a
local .txt/.jsonl/.parquet file or folder, or a `datasets` hub spec, tokenized once and cut into seeded
random windows (the GPTQ recipe) or consecutive ones (evaluation). Both built-in corpora ship with every
CPython: nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import sysconfig

import numpy as np
import torch

from kvcal.errors import KvcalError
from kvcal.hub import offline_if_unreachable

BUILTIN = "builtin"
PYTHON_CODE = "python-code"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def builtin_text() -> str:
    """Python's own documentation topics: a real English corpus installed with every CPython."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def python_code_text() -> str:
    """The Python standard library's own top-level .py sources (about 4.7 MB on CPython 3.11), in file-name
    order, each preceded by a `# file: NAME` line: code no calibration set of ours contains, for evaluating
    on a domain the cache was not calibrated on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join(f"# file: {path.name}\n{path.read_text(encoding='utf-8', errors='replace')}" for path in sorted(stdlib.glob("*.py")))


def _text_column(dataset, spec: str) -> str:
    columns = [name for name, feature in dataset.features.items() if getattr(feature, "dtype", None) == "string"]
    if "text" in columns:
        return "text"
    if not columns:
        raise KvcalError(f"dataset '{spec}' has no text column (columns: {', '.join(dataset.column_names)})")
    return columns[0]


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS)
    builders = {_BUILDERS.get(p.suffix) for p in files}
    if not files or None in builders:
        raise KvcalError(f"dataset '{path}' is not a .txt/.jsonl/.parquet file or a folder of them")
    if len(builders) > 1:
        raise KvcalError(f"dataset folder '{path}' mixes file types; keep one of .txt/.jsonl/.parquet")
    return builders.pop(), [str(p) for p in files]


def load_text(spec: str) -> str:
    """The whole corpus as one string. Rows of tabular data are joined as paragraphs."""
    if spec == BUILTIN:
        return builtin_text()
    if spec == PYTHON_CODE:
        return python_code_text()
    path = Path(spec).expanduser()
    if path.exists():
        builder, files = _local_files(path)
        if builder == "text":  # each file whole, newlines included, as datasets' text builder by document reads it
            try:
                return "\n\n".join(text for text in (Path(f).read_text(encoding="utf-8") for f in files) if text)
            except (OSError, UnicodeDecodeError) as exc:
                raise KvcalError(f"could not read dataset '{spec}': {exc}") from exc
    import datasets

    datasets.disable_progress_bars()
    unreachable = None
    try:
        if path.exists():
            dataset = datasets.load_dataset(builder, data_files=files, split="train")
        elif spec.startswith((".", "/", "~")) or Path(spec).suffix in _BUILDERS:
            raise KvcalError(f"dataset file '{spec}' does not exist; pass a file, a folder, 'builtin' or a hub spec")
        else:
            name, config, split = (spec.split(":") + [None, None])[:3]
            with offline_if_unreachable() as unreachable:
                dataset = datasets.load_dataset(name, config or None, split=split or "train")
    except KvcalError:
        raise
    except Exception as exc:  # datasets raises many types; all mean "this spec cannot be read"
        if unreachable is not None and isinstance(exc, ConnectionError):  # (datasets' error offline: not in the cache)
            raise KvcalError(f"could not read dataset '{spec}': it is not in the datasets cache and {unreachable}; "
                             "pass a local file or folder") from exc
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KvcalError(f"could not read dataset '{spec}': {first_line}") from exc
    column = _text_column(dataset, spec)
    return "\n\n".join(row for row in dataset[column] if row)


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """The corpus as one 1-D tensor of token ids. No special tokens are added, and a special token's spelling in the
    text is read as text, as llama.cpp's perplexity reads it: wikitext's "<unk>" markers would otherwise become
    Gemma's <unk> token, a target the model never predicts."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False,
                    verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def check_seed(seed: int) -> None:
    """A seed numpy's generators and k-means' random state take (what every seeded step of kvcal draws with)."""
    if not 0 <= seed < 2**32:
        raise KvcalError(f"--seed must be in 0 to 2^32 - 1 (got {seed})")


def sample_windows(ids: torch.Tensor, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`nsamples` windows of `seqlen` tokens at seeded random offsets: (nsamples, seqlen)."""
    total = ids.numel()
    if total < seqlen:
        raise KvcalError(f"the text has {total} tokens, fewer than one window of --seqlen {seqlen}; use more text or a shorter --seqlen")
    if nsamples * seqlen > total:
        raise KvcalError(
            f"asked for {nsamples} x {seqlen} = {nsamples * seqlen} tokens but the text has only {total}; "
            "lower --nsamples or --seqlen"
        )
    starts = np.random.default_rng(seed).integers(0, total - seqlen + 1, size=nsamples)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])
