"""Whether the Hugging Face Hub answers, asked once per process. On a machine that cannot reach it, a hub id or hub
dataset is read from the local cache at once, as HF_HUB_OFFLINE=1 would, instead of after huggingface_hub's retries
(five per file, minutes per model, two log lines each) that end in that same cache."""

from __future__ import annotations

import contextlib
import functools
import sys


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached, in one line, or None when it answered (any HTTP status). One HEAD of the
    endpoint with huggingface_hub's own timeout, not sent when offline mode is already set."""
    from huggingface_hub import constants, get_session

    if constants.is_offline_mode():
        return "offline mode is set (HF_HUB_OFFLINE)"
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as exc:  # the transports raise their own types (httpx, httpx2, requests); all mean no answer
        return f"{constants.ENDPOINT} cannot be reached ({' '.join(str(exc).split()) or type(exc).__name__})"
    return None


@contextlib.contextmanager
def offline_if_unreachable():
    """Within: huggingface_hub, and datasets when it is imported, in offline mode if the Hub cannot be reached.
    Their flags are module globals they read on every call (HF_HUB_OFFLINE itself is read once, at import)."""
    if hub_unreachable() is None:
        yield
        return
    from huggingface_hub import constants

    flags = [constants] + ([sys.modules["datasets"].config] if "datasets" in sys.modules else [])
    saved = [module.HF_HUB_OFFLINE for module in flags]
    for module in flags:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in zip(flags, saved):
            module.HF_HUB_OFFLINE = value
