"""Turn any calibrated artifact into a simulation Method, by its kind."""

from __future__ import annotations

from kvcal.artifacts import read_header
from kvcal.errors import KvcalError


def artifact_method(path: str):
    from kvcal.bundle import BUNDLE_KIND, bundle_method
    from kvcal.nuq import NUQ_KIND, nuq_method
    from kvcal.skvq import SKVQ_KIND, skvq_method

    builders = {NUQ_KIND: nuq_method, SKVQ_KIND: skvq_method, BUNDLE_KIND: bundle_method}
    kind, _ = read_header(path)
    if kind not in builders:
        raise KvcalError(f"'{path}' is a kvcal {kind}; --quant takes a {' or '.join(builders)} artifact")
    return builders[kind](path)
