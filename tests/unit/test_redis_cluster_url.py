"""Cluster store URLs: what ``redis+cluster://`` lists and what it refuses, without a server.

The cluster itself (connections, checks at start) is tested against real
servers in tests/integration/test_store_redis_cluster.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrag_integrations.errors import StoreURLError
from kvrag_integrations.store.redis_client import (
    check_prefix,
    is_cluster_url,
    slot_key,
    split_cluster_url,
)
from kvrag_integrations.store.url import redact_url


@pytest.mark.parametrize(
    ("url", "nodes", "first"),
    [
        ("redis+cluster://a:7000", [("a", 7000)], "redis://a:7000"),
        ("redis+cluster://a,b:7001/", [("a", 6379), ("b", 7001)], "redis://a:6379/"),
        (
            "rediss+cluster://u:p%40w@[::1]:7000,10.0.0.2:7001/0?ssl_cert_reqs=none",
            [("::1", 7000), ("10.0.0.2", 7001)],
            "rediss://u:p%40w@[::1]:7000/0?ssl_cert_reqs=none",
        ),
    ],
)
def test_a_cluster_url_lists_its_nodes_and_keeps_the_options(
    url: str, nodes: list, first: str
) -> None:
    assert is_cluster_url(url) and split_cluster_url(url) == (nodes, first)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://a:7000", "not a Redis Cluster URL"),
        ("redis+cluster://", "without a host"),
        ("redis+cluster://a:7000,,b", "without a host"),
        ("redis+cluster://a:99999", "bad port"),
        ("redis+cluster://a:\u00b2", "bad port"),  # a digit to str.isdigit, not to int()
        ("redis+cluster://a:7000/3", "database 0 only"),
    ],
)
def test_a_bad_cluster_url_is_a_store_url_error(url: str, match: str) -> None:
    with pytest.raises(StoreURLError, match=match):
        split_cluster_url(url)


def test_keys_are_tagged_on_a_cluster_only_and_its_prefix_has_no_brace() -> None:
    assert slot_key("p:", "ab", cluster=True) == "p:{ab}"
    assert slot_key("p:", "ab", cluster=False) == "p:ab"
    check_prefix("{any}", cluster=False)
    with pytest.raises(ValueError, match="cannot hold"):
        check_prefix("team{a}:", cluster=True)


def test_credentials_of_a_cluster_url_are_redacted() -> None:
    text = "cannot open rediss+cluster://user:s3cret@a:1,b:2/0?password=s3cret"
    assert "s3cret" not in redact_url(text)


@given(st.text(max_size=80))
def test_any_text_after_the_scheme_parses_or_is_a_store_url_error(rest: str) -> None:
    try:
        nodes, first = split_cluster_url("redis+cluster://" + rest)
    except StoreURLError:
        return
    assert nodes and all(host and 0 < port < 65536 for host, port in nodes)
    assert first.startswith("redis://")


hosts = st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True)


@given(st.lists(st.tuples(hosts, st.integers(1, 65535)), min_size=1, max_size=6))
def test_listed_nodes_come_back_in_order(nodes: list[tuple[str, int]]) -> None:
    url = "redis+cluster://:pw@" + ",".join(f"{h}:{p}" for h, p in nodes)
    assert split_cluster_url(url)[0] == nodes
