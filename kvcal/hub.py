"""Whether the Hugging Face Hub answers, asked once per load. On a machine that cannot reach it, a hub id or hub
dataset is read from the local cache at once, as HF_HUB_OFFLINE=1 would, instead of after huggingface_hub's retries
(five per file, minutes per model, two log lines each) that end in that same cache."""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached, in one line, or None when it answered (any HTTP status). One HEAD of the
    endpoint with huggingface_hub's own timeout, not sent when offline mode is already set. A refused or failed
    connection and a timeout count as unreachable, as datasets counts them; any other error is left to the load."""
    from huggingface_hub import constants, get_session

    if constants.is_offline_mode():
        return "offline mode is set (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)"
    session = get_session()
    transport = importlib.import_module(type(session).__module__.split(".")[0])  # httpx, or httpx2 from hub 2.x
    try:
        session.head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (transport.ConnectError, transport.TimeoutException) as exc:
        return f"{constants.ENDPOINT} cannot be reached ({' '.join(str(exc).split()) or type(exc).__name__})"
    except Exception:  # (a proxy's or the protocol's error: the load meets it again and says so)
        pass
    return None


_switch = threading.Lock()
_offline_loads = 0  # loads running offline now: the first sets the flags, the last restores them
_saved_flags: dict[str, bool] = {}  # each library's flag before the first


@contextlib.contextmanager
def offline_if_unreachable():
    """Within, yields hub_unreachable(); where it is not None, huggingface_hub and datasets run in offline mode (their
    HF_HUB_OFFLINE flags: module globals they read on every call; the environment variable is read once, at import).
    The flags are process-wide: while one load runs offline, so does every other hub read of the process."""
    global _offline_loads
    reason = hub_unreachable()
    if reason is None:
        yield None
        return
    with _switch:
        if _offline_loads == 0:
            _saved_flags.clear()
            _saved_flags.update({module: flags.HF_HUB_OFFLINE for module, flags in _flags().items()})
        _offline_loads += 1
        for flags in _flags().values():
            flags.HF_HUB_OFFLINE = True
    try:
        yield reason
    finally:
        with _switch:
            _offline_loads -= 1
            if _offline_loads == 0:  # datasets first imported within copied the hub's flag then: it gets the hub's back
                for module, flags in _flags().items():
                    flags.HF_HUB_OFFLINE = _saved_flags.get(module, _saved_flags["huggingface_hub"])


def _flags() -> dict:
    """The modules holding each library's offline flag, by library: huggingface_hub's, and datasets' once imported."""
    from huggingface_hub import constants

    return {"huggingface_hub": constants, **({"datasets": sys.modules["datasets"].config} if "datasets" in sys.modules
                                            else {})}
