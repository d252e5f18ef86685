"""llama.cpp's own perplexity under its KV cache types (`-ctk` / `-ctv`), measured by its `llama-perplexity` binary,
beside kvcal's simulation of the same types (kvcal.methods.llama_cpp) on the same model file and the very same tokens:
how far the cost kvcal's tables and `kvcal plan --engine llama.cpp` give a cache type is from what llama.cpp measures.
With --engine ik_llama.cpp the binary is ik_llama.cpp's and a setting may give the first / last layers of K or V
another type (`q4_0;k_first=q8_0,2;v_last=q8_0,2`, as `kvcal plan --engine ik_llama.cpp` prints it), run with the
arguments that plan prints (kvcal.methods.llama_cpp.ik_llama_cpp_arguments: -ctk-first ..., -khad / -vhad).

Both sides score what llama-perplexity scores (tools/perplexity/perplexity.cpp, perplexity()): the text tokenized by
llama.cpp (`llama-tokenize --ids --no-parse-special`, BOS added where the model's GGUF asks for it), chunks of --ctx
tokens whose first token is replaced by BOS, each token of a chunk's second half predicted from the ones before it.
llama.cpp runs its quantized weights and its own kernels, kvcal transformers' dequantized fp32 ones, so the two
unquantized perplexities differ a little; what is compared is each type's change against its own side's unquantized
cache (llama.cpp's f16, kvcal's fp32).

Usage: python -m benchmarks.llama_cpp_types --llama-cpp BUILD/bin [--engine ik_llama.cpp] [--model gemma3-270m]
[--chunks 20] [--types T ...]
Writes benchmarks/results/<llama_cpp | ik_llama_cpp>_types-<model's name>.{json,md} (gemma3-270m, smollm2-135m, a
file's stem).
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.common import SHARED, provenance, write_markdown, write_result
from kvcal.errors import KvcalError
from kvcal.methods import baseline_method
from kvcal.methods.llama_cpp import (CACHE_TYPES, cache_type_pair, first_last_method, ik_llama_cpp_arguments,
                                     ik_llama_cpp_setting)

ENGINES = ("llama.cpp", "ik_llama.cpp")
DEFAULT_TYPES = {"llama.cpp": ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "q8_0/q4_0", "f16/q4_0"),
                 "ik_llama.cpp": ("q8_0", "q4_0", "q4_0;k_first=q8_0,2;k_last=q8_0,2;v_first=q8_0,2;v_last=q8_0,2")}
# llama.cpp prints "PPL = x +/- e", ik_llama.cpp "PPL over N chunks for n_ctx=C = x +/- e"
FINAL_ESTIMATE = re.compile(r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = ([0-9.]+) \+/- ([0-9.]+)")
BINARIES = ("llama-perplexity", "llama-tokenize")


def llama_cpp_tokens(folder: Path, gguf: Path, text: Path) -> list[int]:
    """The text as llama-perplexity tokenizes it (common_tokenize: BOS where the model adds one, special tokens' spellings
    in the text read as text)."""
    out = subprocess.run([folder / "llama-tokenize", "-m", gguf, "-f", text, "--ids", "--no-parse-special", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def cache_arguments(engine: str, spec: str) -> list[str]:
    """The binary's cache arguments for a setting: -ctk / -ctv (llama.cpp), or what `kvcal plan --engine ik_llama.cpp`
    prints for it (ik_llama.cpp); f16 is both tensors unquantized."""
    if spec == "f16":
        return ["-ctk", "f16", "-ctv", "f16"]
    if engine == "ik_llama.cpp":
        return ik_llama_cpp_arguments(spec).split()
    type_k, type_v = cache_type_pair(spec)
    return ["-ctk", type_k, "-ctv", type_v]


def check_setting(engine: str, spec: str) -> None:
    """Refuses a setting the engine has no arguments for (KvcalError)."""
    if engine == "ik_llama.cpp":
        ik_llama_cpp_setting(spec)
    elif cache_type_pair(spec) is None:
        raise KvcalError(f"--types {spec}: not a llama.cpp cache type or K/V pair of them ({', '.join(CACHE_TYPES)})")


def llama_cpp_ppl(folder: Path, gguf: Path, text: Path, ctx: int, chunks: int, cache: list[str], threads: int) -> dict:
    """llama-perplexity's final estimate under the cache arguments, flash attention on (a quantized V cache needs it)."""
    command = [folder.resolve() / "llama-perplexity", "-m", gguf.resolve(), "-f", text.resolve(), "-c", ctx, "-b", ctx,
               "--chunks", chunks, *cache, "-fa", "on", "-t", threads]
    with tempfile.TemporaryDirectory() as scratch:  # ik_llama.cpp writes llama.log where it runs
        run = subprocess.run([str(part) for part in command], capture_output=True, text=True, cwd=scratch)
    found = FINAL_ESTIMATE.search(run.stdout + run.stderr)
    if run.returncode != 0 or found is None:
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        raise SystemExit(f"llama-perplexity {' '.join(cache)} failed (exit {run.returncode}): " + " | ".join(tail))
    return {"ppl": float(found.group(1)), "error": float(found.group(2))}


def kvcal_method(engine: str, spec: str, adapter):
    """kvcal's simulation of a setting as the engine stores it (ik_llama.cpp: rotated under -khad / -vhad)."""
    if engine == "ik_llama.cpp":
        return first_last_method(*ik_llama_cpp_setting(spec), adapter.head_dims)
    return baseline_method(spec, adapter.head_dims, adapter.windows, value_dims=adapter.value_dims, latent=adapter.latent)


def chunks_of(tokens: list[int], ctx: int, chunks: int, bos: int | None) -> torch.Tensor:
    """llama-perplexity's chunks: consecutive --ctx tokens, the first of each replaced by BOS where the model adds one."""
    if len(tokens) < max(2, chunks) * ctx:
        raise KvcalError(f"the text tokenizes to {len(tokens)} tokens, fewer than {max(2, chunks)} chunks of {ctx}; "
                         "lower --chunks or --ctx")
    batch = torch.tensor(tokens[:chunks * ctx]).view(chunks, ctx)
    if bos is not None:
        batch[:, 0] = bos
    return batch


def kvcal_ppl(model, adapter, batch: torch.Tensor, method) -> float:
    """exp of the mean NLL over every chunk's second half, as llama-perplexity's process_logits counts it."""
    from contextlib import nullcontext

    from kvcal.simulate import StorageTally, simulated

    ctx = batch.shape[1]
    first = ctx // 2
    nll, count = 0.0, 0
    with torch.inference_mode(), nullcontext() if method is None else simulated(model, adapter, method, StorageTally()):
        for chunk in batch:
            logits = model(input_ids=chunk[None], use_cache=False, logits_to_keep=ctx - first).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, chunk[first + 1:], reduction="sum"))
            count += ctx - 1 - first
    return math.exp(nll / count)


def bos_token(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts first, or None where the GGUF says not to add one."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def scalar(name):
        field = fields.get(name)
        return None if field is None else field.parts[field.data[0]][0].item()

    return int(scalar("tokenizer.ggml.bos_token_id")) if scalar("tokenizer.ggml.add_bos_token") else None


def measure(args) -> dict:
    from kvcal.adapters import adapt
    from kvcal.models import load_model, resolve_model

    source = resolve_model(args.model)
    if source.gguf_file is None:
        raise KvcalError(f"--model {args.model} is not a .gguf file, which llama.cpp reads; pass smollm2-135m, gemma3-270m "
                         "or a .gguf path")
    gguf = Path(source.path) / source.gguf_file
    tokens = llama_cpp_tokens(args.llama_cpp, gguf, args.text)
    batch = chunks_of(tokens, args.ctx, args.chunks, bos_token(gguf))
    model, _, _ = load_model(args.model)
    adapter = adapt(model)
    rows = []
    methods = {spec: kvcal_method(args.engine, spec, adapter) for spec in args.types}  # a bad layer count fails here
    rows = []
    for spec in ["f16", *args.types]:
        cache = cache_arguments(args.engine, spec)
        llama = llama_cpp_ppl(args.llama_cpp, gguf, args.text, args.ctx, args.chunks, cache, args.threads)
        rows.append({"type": spec, "arguments": " ".join(cache), "llama_cpp": llama,
                     "kvcal": kvcal_ppl(model, adapter, batch, methods.get(spec))})
        print(f"{spec}: {args.engine} {llama['ppl']:.4f} +/- {llama['error']:.4f}, kvcal {rows[-1]['kvcal']:.4f}", flush=True)
    return {"model": source.spec, "engine": args.engine, "gguf": gguf.name, "text": str(args.text), "ctx": args.ctx,
            "chunks": args.chunks, "tokens": len(tokens), "llama_cpp_version": llama_cpp_version(args.llama_cpp), "rows": rows}


def llama_cpp_version(folder: Path) -> str:
    run = subprocess.run([folder / "llama-perplexity", "--version"], capture_output=True, text=True)
    return " ".join((run.stdout + run.stderr).split())


def markdown(result: dict) -> list[str]:
    base, engine = result["rows"][0], result["engine"]
    lines = [f"# {engine}'s cache types: its own perplexity against kvcal's simulation ({result['model']})", "",
             f"`python -m benchmarks.llama_cpp_types --engine {engine}` at commit {result['commit']}, {result['date']}; "
             f"{engine} {result['llama_cpp_version']}. {result['chunks']} chunks of {result['ctx']} tokens of "
             f"{Path(result['text']).name} as llama-perplexity reads them (its tokens, BOS first, the second half of each "
             f"chunk scored); `llama-perplexity -fa on` with each row's arguments on {result['gguf']} beside `kvcal eval "
             "ppl`'s simulation of the same setting on the same tokens. Changes are against each side's own "
             f"full-precision cache ({engine} f16, kvcal fp32).", "",
             f"| setting | arguments | {engine} ppl | {engine} change | kvcal ppl | kvcal change | difference (points) |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        llama = 100 * (row["llama_cpp"]["ppl"] / base["llama_cpp"]["ppl"] - 1)
        kvcal = 100 * (row["kvcal"] / base["kvcal"] - 1)
        name = "f16 (kvcal: fp32)" if row is base else row["type"]
        lines.append(f"| {name} | `{row['arguments']}` | {row['llama_cpp']['ppl']:.4f} +/- {row['llama_cpp']['error']:.4f} | "
                     f"{llama:+.2f}% | {row['kvcal']:.4f} | {kvcal:+.2f}% | {kvcal - llama:+.2f} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama_cpp_types", description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="the folder holding a llama.cpp (or ik_llama.cpp) build's llama-perplexity and llama-tokenize")
    parser.add_argument("--engine", choices=ENGINES, default="llama.cpp",
                        help="whose build --llama-cpp holds, which sets the settings' arguments and rotation "
                             "(default: %(default)s)")
    parser.add_argument("--model", default="gemma3-270m",
                        help="a kvcal --model that is a .gguf file (the packaged smollm2-135m or gemma3-270m, or a path) "
                             "(default: %(default)s)")
    parser.add_argument("--text", type=Path, default=SHARED / "data" / "wikitext-2" / "test.txt",
                        help="evaluation text (default: wikitext-2 test)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk, llama-perplexity's -c (default: %(default)s)")
    parser.add_argument("--chunks", type=int, default=20, help="chunks from the start of the text (default: %(default)s)")
    parser.add_argument("--types", nargs="+", metavar="SETTING",
                        help="settings, T or K/V, and with --engine ik_llama.cpp optionally ;k_first=TYPE,N (k_last, "
                             "v_first, v_last) after it; f16 is always run first (default: "
                             + "; ".join(f"{engine}: {' '.join(types)}" for engine, types in DEFAULT_TYPES.items()) + ")")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads of both sides (default: torch's, %(default)s)")
    parser.add_argument("--name", default=None,
                        help="result name in benchmarks/results (default: llama_cpp_types-<model's name>, with "
                             "--engine ik_llama.cpp ik_llama_cpp_types-<model's name>)")
    args = parser.parse_args(argv)
    args.types = [spec.strip() for spec in args.types or DEFAULT_TYPES[args.engine]]
    if args.ctx < 4 or args.chunks < 1:
        parser.error(f"--ctx must be at least 4 and --chunks at least 1 (got {args.ctx}, {args.chunks})")
    if not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    for name in BINARIES:
        if not (args.llama_cpp / name).is_file():
            parser.error(f"--llama-cpp {args.llama_cpp}: no {name} there; pass the bin folder of a llama.cpp build "
                         f"(cmake -B build && cmake --build build --target {' '.join(BINARIES)})")
    try:
        for spec in args.types:
            check_setting(args.engine, spec)
    except KvcalError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    started = provenance()
    try:
        result = measure(args)
    except KvcalError as exc:
        parser.error(str(exc))
    name = args.name or f"{args.engine.replace('.', '_')}_types-{Path(args.model).stem.lower()}"
    write_result(name, result, started)
    write_markdown(name, markdown({**started, **result}))


if __name__ == "__main__":
    main()
