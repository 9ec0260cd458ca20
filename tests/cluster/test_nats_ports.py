"""Ports for the embedded NATS servers: picked where no outgoing connection can take them, and picked again
when something else takes one before its server listens there (real nats-server processes, real sockets)."""

from __future__ import annotations

import socket

import pytest

from services.runtime import natsd
from services.runtime.natsd import EmbeddedNats, NatsCluster, NatsServerError, free_port


def _hold(port: int) -> socket.socket:
    """A listener on ``port`` standing for whatever took it between the pick and the server's bind."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_picked_ports_lie_outside_the_ephemeral_range_and_are_not_handed_out_twice():
    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    span = natsd.listen_port_range()
    assert span is not None and (span[1] < lo or span[0] > hi), span
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi and span[0] <= p <= span[1] for p in ports), ports
    # an outgoing connection's source port comes from the ephemeral range, never from where we pick
    with _hold(ports[0]) as server, socket.create_connection(("127.0.0.1", ports[0])) as client:
        assert lo <= client.getsockname()[1] <= hi
        server.accept()[0].close()


def test_a_server_whose_picked_port_was_taken_starts_on_another(tmp_path, caplog):
    server = EmbeddedNats(tmp_path / "nats", port=None)
    taken = server.port
    with _hold(taken), caplog.at_level("WARNING", logger="rlbus.natsd"):
        server.start()
        try:
            assert server.running and server.port != taken
            with socket.create_connection(("127.0.0.1", server.port)) as c:
                assert c.recv(4096).startswith(b"INFO")
        finally:
            server.stop()
    assert f"client port {taken} was taken" in caplog.text


def test_a_port_asked_for_and_taken_at_start_is_a_clear_error_naming_it(tmp_path):
    port = free_port()
    server = EmbeddedNats(tmp_path / "nats", port=port)  # free when asked for: kept, never swapped
    with _hold(port), pytest.raises(NatsServerError) as e:
        server.start()
    assert e.value.taken_port == port
    assert "exited with code 1 at start" in str(e.value)
    assert f"127.0.0.1:{port}: bind: address already in use" in str(e.value)  # the server's own words
    assert not server.running


@pytest.mark.parametrize("which", ["route", "monitoring"])
def test_a_cluster_whose_picked_port_was_taken_starts_again_on_other_ports(tmp_path, caplog, which):
    cluster = NatsCluster(tmp_path / "cluster", size=3)
    node = cluster.nodes[1]
    taken = node.http_port if which == "monitoring" else int(node.extra_args[node.extra_args.index("--cluster") + 1]
                                                               .rsplit(":", 1)[1])
    assert taken is not None
    with _hold(taken), caplog.at_level("WARNING", logger="rlbus.natsd"):
        cluster.start()
        try:
            assert all(n.running and n.healthy() for n in cluster.nodes)
            assert taken not in {n.http_port for n in cluster.nodes}
            assert f"nats-route://127.0.0.1:{taken}" not in " ".join(cluster.nodes[0].extra_args)
        finally:
            cluster.stop()
    assert f"port {taken} of the NATS cluster was taken" in caplog.text


def test_a_cluster_keeps_a_client_port_asked_for_and_says_when_it_is_taken(tmp_path):
    port = free_port()
    cluster = NatsCluster(tmp_path / "cluster", size=2, ports=[port])
    assert cluster.nodes[0].port == port
    with _hold(port), pytest.raises(NatsServerError, match=f"127.0.0.1:{port}: bind: address already in use"):
        cluster.start()
    assert not any(n.running for n in cluster.nodes)
