"""Stand-ins for the Hugging Face Hub's endpoint on this machine (a port nothing listens on, a server answering every
HEAD with one status) and its cache layout, so that what kvcal does offline is tested without a network."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def closed_port_url() -> str:
    """The URL of a local port nothing listens on (bound, then released): connections are refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def answering_server(status: int, delay_s: float = 0.0):
    """(url, requests): a local server answering every HEAD with `status` after `delay_s`; `requests` lists
    "HEAD <path>" as they come."""
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):
            requests.append(f"HEAD {self.path}")
            time.sleep(delay_s)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requests
    finally:
        server.shutdown()
        server.server_close()


def cache_as_hub_model(model_dir: Path, hf_home: Path, repo_id: str) -> None:
    """Put a saved model folder into `hf_home`'s hub cache as huggingface_hub lays out a download of `repo_id`."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
