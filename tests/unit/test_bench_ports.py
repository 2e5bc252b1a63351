"""Servers' ports are drawn below the kernel's ephemeral range, where no outgoing
connection takes them between the draw and the bind."""

from __future__ import annotations

import socket

from kvrag_integrations.bench.ports import ephemeral_range, free_port


def test_a_drawn_port_is_free_and_below_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    assert 0 < low <= high
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # drawn at random: parallel processes rarely meet
    assert all(port < low for port in ports)
    for port in list(ports)[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nothing holds it


def test_a_listened_port_is_never_drawn() -> None:
    held = []
    try:
        while len(held) < 200:
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            held.append(sock)
        assert len({s.getsockname()[1] for s in held}) == 200
    finally:
        for sock in held:
            sock.close()
