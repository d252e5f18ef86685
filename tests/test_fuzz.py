"""Fuzzing what reads a bundle: `load_bundle`, `kvcal inspect` (through typer's CliRunner) and two generated
tokens through `kvcal.runtime.quantized_cache` on the tiny Llama the session bundles are for.

Every recipe's bundle (conftest's `recipe_bundles`) is mutated, seeded and deterministic: bytes flipped in the
header or the data, truncations, the 8-byte header length field, metadata fields (`kvcal.config` leaves and
subtrees, and the top-level keys) set to wrong types and values or deleted, tensors renamed, added, dropped,
retyped or reshaped. Metadata and tensor mutations come twice: as written (the checksum no longer matches) and
resealed with a valid checksum (as a buggy or malicious writer would make them), so that the validation
behind the checksum is exercised too. Each mutated bundle must either work fully (load_bundle accepts it,
`kvcal inspect` exits 0 and a cache made from it generates) or be refused with KvcalError by load_bundle, by
`inspect` (exit 2, one error line) and by quantized_cache alike; anything else (another exception, a
traceback, inspect and load_bundle disagreeing) fails the test naming the mutation that caused it. The
profile and the fitted nuq and skvq artifacts get the same mutations through `kvcal inspect` alone: a
summary or one error line, never a traceback."""

from __future__ import annotations

import json
import math
import random
import struct
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers.artifact_files import join_raw, split_raw
from helpers.tiny_models import tiny_model
from kvcal.artifacts import CHECKSUM_KEY, artifact_checksum
from kvcal.bundle import load_bundle
from kvcal.cli import app
from kvcal.errors import KvcalError
from kvcal.model_caches import cache_argument
from kvcal.runtime import quantized_cache

pytestmark = pytest.mark.slow

SEED = 15
MUTATIONS_PER_RECIPE = 110  # x 5 recipes = 550 mutated bundles
NEW_TOKENS = 2

WRONG_VALUES = [None, True, False, 0, -1, 1, 3, 2**31, 2**63, -(2**63), 1e308, -1e-9, 0.5, 2.5, 30.0, math.nan, math.inf, "",
                "x", "3", "nuq", [], [1], {}, {"a": 1}]
TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool]
SAFETENSORS_DTYPES = ["F16", "BF16", "F32", "F64", "I8", "I16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "X"]


def _paths(node, prefix=()):
    """Every path into a JSON tree (inner nodes and leaves)."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _set(tree, path, value, delete: bool):
    node = tree
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    elif delete:
        node.pop(path[-1])
    else:
        node[path[-1]] = value


def _sealed(tensors: dict, metadata: dict, reseal: bool) -> bytes:
    """The safetensors bytes of `tensors` and `metadata`, with a matching checksum if `reseal`."""
    if reseal:
        metadata = {**metadata, CHECKSUM_KEY: artifact_checksum(tensors, metadata)}
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


class Mutator:
    """Seeded mutations of one bundle's bytes; each returns (description, mutated bytes)."""

    def __init__(self, data: bytes, rng: random.Random):
        self.data, self.rng = data, rng
        self.header, self.body = split_raw(data)
        self.metadata = dict(self.header["__metadata__"])
        self.tensors = None

    def _loaded(self) -> dict:
        if self.tensors is None:
            self.tensors = load_file_from_bytes(self.data)
        return {name: tensor.clone() for name, tensor in self.tensors.items()}

    def flip(self):
        rng, data = self.rng, bytearray(self.data)
        header_end = 8 + struct.unpack("<Q", self.data[:8])[0]
        region = rng.choice(["header", "data", "anywhere"])
        low, high = {"header": (0, header_end), "data": (header_end, len(data)), "anywhere": (0, len(data))}[region]
        positions = [rng.randrange(low, high) for _ in range(rng.choice([1, 1, 2, 8]))]
        for position in positions:
            data[position] ^= rng.randrange(1, 256)
        return f"flip {region} bytes at {positions}", bytes(data)

    def truncate(self):
        header_end = 8 + struct.unpack("<Q", self.data[:8])[0]
        cut = self.rng.choice([0, 4, 8, header_end - 1, header_end, header_end + 1, len(self.data) - 1,
                               self.rng.randrange(len(self.data))])
        return f"truncate to {cut} of {len(self.data)} bytes", self.data[:cut]

    def header_length(self):
        length = struct.unpack("<Q", self.data[:8])[0]
        value = self.rng.choice([0, 1, 2, length - 1, length + 1, length - 8, length + 8, len(self.data), 2**32, 2**63, 2**64 - 1,
                                 self.rng.randrange(2**64)])
        return f"header length {length} -> {value}", struct.pack("<Q", value) + self.data[8:]

    def metadata_field(self, reseal: bool):
        rng = self.rng
        metadata = dict(self.metadata)
        if rng.random() < 0.2:  # a top-level metadata entry
            key = rng.choice(["kvcal.kind", "kvcal.schema", "kvcal.version", "kvcal.config", "format", CHECKSUM_KEY])
            value = rng.choice([None, "", "profile", "nuq", "1", "2", "3", "{}", "[]", "not json", "null", '{"model": 1}'])
            if value is None:
                metadata.pop(key, None)
            else:
                metadata[key] = value
            what = f"metadata {key} = {value!r}"
        else:
            config = json.loads(metadata["kvcal.config"])
            paths = [p for p in _paths(config) if p]
            weighted = [p for p in paths if p[0] in ("recipe", "model")] * 3 + paths
            path = rng.choice(weighted)
            delete = rng.random() < 0.15
            value = rng.choice(WRONG_VALUES)
            _set(config, path, value, delete)
            metadata["kvcal.config"] = json.dumps(config)  # NaN and Infinity as Python's json writes them
            what = f"config {'.'.join(map(str, path))} {'deleted' if delete else f'= {value!r}'}"
        return f"{what}{' (resealed)' if reseal else ''}", _sealed(self._loaded(), metadata, reseal)

    def tensor(self, reseal: bool):
        rng = self.rng
        tensors = self._loaded()
        names = sorted(tensors)
        name = rng.choice(names)
        action = rng.choice(["rename", "add", "drop", "retype", "reshape", "values"])
        if action == "rename":
            new = rng.choice([n for n in names if n != name] + [name + ".x", name.replace("layers.0", "layers.7"), "rope.inv_freq"])
            tensors[new] = tensors.pop(name)
            what = f"rename {name} -> {new}"
        elif action == "add":
            new = rng.choice(["layers.0.k.extra", "layers.2.k.codebook", "junk", name + "2"])
            tensors[new] = torch.zeros(rng.choice([1, 3, 16]), dtype=rng.choice(TORCH_DTYPES))
            what = f"add {new}"
        elif action == "drop":
            del tensors[name]
            what = f"drop {name}"
        elif action == "retype":
            dtype = rng.choice(TORCH_DTYPES)
            tensors[name] = tensors[name].to(dtype)
            what = f"retype {name} to {dtype}"
        elif action == "reshape":
            tensor = tensors[name]
            flat = tensor.reshape(-1)
            tensors[name] = rng.choice([lambda: tensor.reshape(1, -1), lambda: flat[:-1] if flat.numel() > 1 else torch.cat([flat, flat]),
                                        lambda: torch.cat([tensor, tensor]), lambda: flat[:0]])().clone()
            what = f"reshape {name} {tuple(tensor.shape)} -> {tuple(tensors[name].shape)}"
        else:
            tensor = tensors[name]
            if tensor.numel():
                flat = tensor.reshape(-1)
                value = rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30, 2**31 - 1, -(2**31)])
                if not tensor.is_floating_point() and not math.isfinite(value):
                    value = -1
                flat[rng.randrange(flat.numel())] = value
            what = f"set a value of {name}"
        return f"{what}{' (resealed)' if reseal else ''}", _sealed(tensors, self.metadata, reseal)

    def header_dtype(self):
        """A tensor's dtype, shape or offsets edited in the raw header, data untouched."""
        rng = self.rng
        header = json.loads(json.dumps(self.header))
        name = rng.choice([n for n in header if n != "__metadata__"])
        field = rng.choice(["dtype", "shape", "data_offsets"])
        if field == "dtype":
            header[name]["dtype"] = rng.choice(SAFETENSORS_DTYPES)
        elif field == "shape":
            header[name]["shape"] = rng.choice([[], [0], [1], [2**40], [-1], ["a"], header[name]["shape"] + [1]])
        else:
            start, end = header[name]["data_offsets"]
            header[name]["data_offsets"] = rng.choice([[end, start], [start, end + 4], [start + 4, end], [0, 2**40], [-1, end]])
        return f"raw header {name}.{field} = {header[name][field]!r}", join_raw(header, self.body)

    def mutate(self):
        choice = self.rng.choices(["flip", "truncate", "header_length", "metadata", "metadata_resealed", "tensor", "tensor_resealed",
                                   "header_dtype"], weights=[3, 1, 1, 2, 4, 1, 3, 1])[0]
        if choice in ("metadata", "metadata_resealed"):
            return choice, *self.metadata_field(choice.endswith("resealed"))
        if choice in ("tensor", "tensor_resealed"):
            return choice, *self.tensor(choice.endswith("resealed"))
        return choice, *getattr(self, choice)()


def load_file_from_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def _category(message: str) -> str:
    for key, category in (("checksum", "checksum"), ("truncated", "not safetensors / truncated"), ("schema", "schema"),
                          ("not a kvcal artifact", "not a kvcal artifact"), ("kvcal.config", "config unreadable"),
                          ("is a kvcal", "wrong kind"), ("was made for", "another model"), ("recipe", "recipe"),
                          ("tensor", "tensors"), ("fingerprint", "fingerprint"), ("metadata", "metadata"), ("settings", "settings")):
        if key in message:
            return category
    return "other"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama").eval()  # the model of conftest's tiny profile (conftest), whose fingerprint the bundles carry


def _generate(model, bundle) -> torch.Tensor:
    ids = torch.tensor([[0, 0, 5, 17, 99, 3], [11, 12, 13, 14, 15, 16]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, **cache_argument(cache), pad_token_id=0)


def _check(path: Path, model, runner) -> str:
    """The outcome of one bundle: 'works', or 'refused: <category>'; AssertionError for anything else."""
    try:
        bundle = load_bundle(path)
        refusal = None
    except KvcalError as exc:
        bundle, refusal = None, str(exc)
        assert "\n" not in refusal, f"a multi-line message: {refusal!r}"
    shown = runner.invoke(app, ["inspect", str(path)])
    if shown.exception is not None and not isinstance(shown.exception, SystemExit):
        raise AssertionError(f"inspect raised {type(shown.exception).__name__}: {shown.exception}") from shown.exception
    if bundle is None:
        assert shown.exit_code == 2, f"load_bundle refused ({refusal}) but inspect exited {shown.exit_code}"
        lines = shown.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"inspect's refusal is not one line: {shown.stderr!r}"
        with pytest.raises(KvcalError):
            quantized_cache(model, path)
        return f"refused: {_category(refusal)}"
    assert shown.exit_code == 0, f"load_bundle accepted it but inspect exited {shown.exit_code}: {shown.stderr.strip()}"
    try:
        out = _generate(model, bundle)
    except KvcalError as exc:  # allowed, counted apart (an edited fingerprint loads, then is refused for this model)
        return f"loads, then quantized_cache refuses: {_category(str(exc))}"
    assert out.shape == (2, 6 + NEW_TOKENS), f"generated shape {tuple(out.shape)}"
    return "works"


def test_mutated_bundles_work_fully_or_raise_kvcal_error(recipe_bundles, model, tmp_path):
    runner = CliRunner()
    started = time.perf_counter()
    outcomes, kinds, failures = Counter(), Counter(), []
    for recipe, source in recipe_bundles.items():  # the originals work
        assert _check(source, model, runner) == "works", recipe
    for r, (recipe, source) in enumerate(sorted(recipe_bundles.items())):
        mutator = Mutator(source.read_bytes(), random.Random(SEED * 1000 + r))
        for i in range(MUTATIONS_PER_RECIPE):
            kind, description, data = mutator.mutate()
            path = tmp_path / f"{recipe}-{i}.safetensors"
            path.write_bytes(data)
            kinds[kind] += 1
            try:
                outcomes[_check(path, model, runner)] += 1
            except Exception as exc:  # noqa: BLE001 - collected, reported with the mutation below
                failures.append(f"{recipe} #{i} [{kind}] {description}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            path.unlink()
    elapsed = time.perf_counter() - started
    total = sum(kinds.values())
    print(f"\n{total} mutated bundles in {elapsed:.1f} s; mutations: {dict(sorted(kinds.items()))}")
    for outcome, count in sorted(outcomes.items(), key=lambda item: -item[1]):
        print(f"  {count:4d}  {outcome}")
    assert total >= 500
    assert not failures, f"{len(failures)} of {total} mutated bundles broke the contract:\n" + "\n".join(failures[:40])


def test_mutated_profiles_and_fitted_artifacts_are_summarized_or_refused_in_one_line(tiny_profile, fitted, tmp_path):
    runner = CliRunner()
    sources = {"profile": tiny_profile[1], **fitted}
    outcomes, failures = Counter(), []
    for r, (name, source) in enumerate(sorted(sources.items())):
        mutator = Mutator(source.read_bytes(), random.Random(SEED * 2000 + r))
        for i in range(40):
            kind, description, data = mutator.mutate()
            path = tmp_path / f"{name}-{i}.safetensors"
            path.write_bytes(data)
            shown = runner.invoke(app, ["inspect", str(path)])
            lines = shown.stderr.strip().splitlines()
            if shown.exception is not None and not isinstance(shown.exception, SystemExit):
                failures.append(f"{name} #{i} [{kind}] {description}: {type(shown.exception).__name__}: {shown.exception}")
            elif shown.exit_code not in (0, 2) or (shown.exit_code == 2 and (len(lines) != 1 or not lines[0].startswith("error: "))):
                failures.append(f"{name} #{i} [{kind}] {description}: exit {shown.exit_code}: {shown.stderr!r}")
            else:
                outcomes["summarized" if shown.exit_code == 0 else f"refused: {_category(lines[0])}"] += 1
            path.unlink()
    print(f"\n{sum(outcomes.values()) + len(failures)} mutated profile/nuq/skvq artifacts: {dict(outcomes)}")
    assert not failures, "\n".join(failures[:40])
