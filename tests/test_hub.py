"""kvcal.hub: the Hub asked once per load; within offline_if_unreachable the libraries are offline exactly when it
does not answer, and back as they were after the last such load."""

import datasets
import pytest
from huggingface_hub import constants

from helpers.local_hub import answering_server, closed_port_url
from kvcal import hub


def test_a_hub_that_refuses_connections_is_unreachable_and_the_reason_names_it(hub_endpoint):
    url = closed_port_url()
    hub_endpoint(url)
    reason = hub.hub_unreachable()
    assert reason is not None and reason.startswith(f"{url} cannot be reached (") and "\n" not in reason


def test_a_hub_that_does_not_answer_in_time_is_unreachable(hub_endpoint, monkeypatch):
    with answering_server(200, delay_s=1.0) as (url, _):
        hub_endpoint(url)
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.2)
        assert hub.hub_unreachable().startswith(f"{url} cannot be reached (")


@pytest.mark.parametrize("status", [200, 404, 503])
def test_a_hub_that_answers_with_any_status_is_reachable(hub_endpoint, status):
    with answering_server(status) as (url, requests):
        hub_endpoint(url)
        assert hub.hub_unreachable() is None
        assert requests == ["HEAD /"]


def test_a_load_asks_the_hub_once(hub_endpoint):
    with answering_server(200) as (url, requests):
        hub_endpoint(url)
        with hub.offline_if_unreachable() as unreachable:
            assert unreachable is None
        assert len(requests) == 1


def test_offline_mode_set_by_the_user_is_the_reason_and_nothing_is_asked(hub_endpoint, monkeypatch):
    with answering_server(200) as (url, requests):
        hub_endpoint(url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert hub.hub_unreachable() == "offline mode is set (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)"
        assert requests == []


def test_an_unreachable_hub_puts_both_libraries_offline_until_the_last_such_load_ends(hub_endpoint):
    hub_endpoint(closed_port_url())
    with hub.offline_if_unreachable() as outer:
        assert outer.endswith(")") and constants.is_offline_mode() and datasets.config.HF_HUB_OFFLINE
        with hub.offline_if_unreachable():
            pass
        assert constants.is_offline_mode() and datasets.config.HF_HUB_OFFLINE  # (the outer load still reads offline)
    assert not constants.is_offline_mode() and not datasets.config.HF_HUB_OFFLINE


def test_a_reachable_hub_leaves_the_libraries_online(hub_endpoint):
    with answering_server(200) as (url, _):
        hub_endpoint(url)
        with hub.offline_if_unreachable():
            assert not constants.is_offline_mode() and not datasets.config.HF_HUB_OFFLINE
