"""[nats] replicas on a real 3-node JetStream cluster: every stream, consumer, KV bucket and object store
a run creates is replicated; existing definitions are never lowered, and services (whose users may create
but not update streams) leave differences alone and say so instead of failing."""

from __future__ import annotations

import logging

import msgspec
import nats
import pytest

from proto import catalog, weights
from services.launcher.auth import generate_auth
from services.launcher.runfile import RunFile, provision_run
from services.runtime import bus
from services.runtime.config import ConfigError, NatsSection, convert

RUN = "repl"


async def replicas(js, stream: str) -> int:
    info = await js.stream_info(stream)
    assert info.cluster is not None, f"{stream} has no cluster info"
    return 1 + len(info.cluster.replicas or [])


def test_url_takes_a_list_or_commas_and_replicas_are_checked():
    listed = convert({"url": ["nats://a:1", "nats://b:2"], "replicas": 3}, NatsSection, "nats")
    commas = convert({"url": "nats://a:1, nats://b:2"}, NatsSection, "nats")
    assert listed.servers() == commas.servers() == ["nats://a:1", "nats://b:2"]
    with pytest.raises(ConfigError, match="nats.replicas"):
        convert({"replicas": 2}, NatsSection, "nats")


async def test_run_streams_buckets_and_consumers_get_replicas_never_lowered(nats_cluster, tmp_path, caplog):
    nc = await bus.connect(NatsSection(url=nats_cluster.url, replicas=3), "test-r3")
    js = nc.jetstream()
    tree = RunFile.from_tree({"services": {"weightsync": {"relay": {"scope": "edge"}}}})
    await provision_run(js, tree)
    for name in catalog.STREAMS:
        assert await replicas(js, name) == 3, name
    for kv in [*catalog.KV_BUCKETS.values()]:
        assert await replicas(js, f"KV_{kv.bucket}") == 3, kv.bucket
    for scope in ("main", "edge"):
        assert await replicas(js, f"KV_{weights.kv_bucket(scope)}") == 3
        assert await replicas(js, f"OBJ_{weights.object_bucket(scope)}") == 3
    ci = await bus.ensure_consumer(js, catalog.ROLLOUT_PROMPTS.for_run(RUN))
    assert ci.cluster is not None and 1 + len(ci.cluster.replicas or []) == 3  # inherited from PROMPTS

    # an operator changed METRICS (longer retention); a service connecting with replicas = 1 as its own
    # per-service user (no STREAM.UPDATE right) neither lowers anything nor fails, and says what differs
    changed = msgspec.structs.replace(catalog.METRICS_STREAM, max_age_s=7200.0)
    await bus.ensure_stream(js, changed, update=True)
    auth = generate_auth(tmp_path, ["rollout"], run_id=RUN)
    rollout = auth.for_role("rollout")
    svc_cfg = NatsSection(url=nats_cluster.url, replicas=1, user=rollout.user, password=rollout.password,
                          inbox_prefix=rollout.inbox_prefix)
    # the cluster's nodes were started without users: this checks the code path (no update call), the
    # permission itself is checked on a server with users below
    svc = await bus.connect(svc_cfg, "test-r1")
    with caplog.at_level(logging.INFO, logger="rlbus.bus"):
        await bus.provision_all(svc.jetstream())
    assert (await js.stream_info("METRICS")).config.max_age == 7200.0
    for name in catalog.STREAMS:
        assert await replicas(js, name) == 3, name
    assert "stream PROMPTS keeps its replicas 3 (not lowered to 1)" in caplog.text
    assert "stream METRICS differs from this version's definition (max_age: 7200.0 -> " in caplog.text
    await svc.close()

    # the launcher's provisioning (update=True) brings METRICS back to the catalog, still R3
    await provision_run(js, tree)
    info = await js.stream_info("METRICS")
    assert info.config.max_age == catalog.METRICS_STREAM.max_age_s
    assert await replicas(js, "METRICS") == 3
    await nc.close()


async def test_services_without_update_rights_start_against_changed_streams(tmp_path):
    """On a server with per-service users: a service provisions against an operator-changed stream."""
    from services.runtime.natsd import EmbeddedNats

    auth = generate_auth(tmp_path, ["judge"], run_id=RUN)
    with EmbeddedNats(tmp_path / "nats", port=None, config_file=auth.server_config) as server:
        admin = auth.for_role("launcher")
        nc = await bus.connect(NatsSection(url=server.url, user=admin.user, password=admin.password), "launcher")
        js = nc.jetstream()
        await bus.provision_all(js, update=True)
        await bus.ensure_stream(js, msgspec.structs.replace(catalog.ROLLOUTS_STREAM, max_age_s=99999.0))
        judge = auth.for_role("judge")
        svc = await bus.connect(NatsSection(url=server.url, user=judge.user, password=judge.password,
                                            inbox_prefix=judge.inbox_prefix), "judge")
        await bus.provision_all(svc.jetstream())  # no STREAM.UPDATE call: returns, does not time out
        assert (await js.stream_info("ROLLOUTS")).config.max_age == 99999.0
        await svc.close()
        await nc.close()


async def test_replicas_beyond_the_servers_nodes_is_a_clear_error(nats_url):
    nc = await bus.connect(NatsSection(url=nats_url, replicas=3), "test")
    with pytest.raises(bus.BusError, match="needs a JetStream cluster of at least 3 nodes"):
        await bus.ensure_stream(nc.jetstream(), catalog.PROMPTS_STREAM)
    await nc.close()


async def test_a_client_fails_over_when_its_node_is_killed(nats_cluster):
    nc = await bus.connect(NatsSection(url=nats_cluster.url, replicas=3), "failover")
    js = nc.jetstream()
    await bus.provision_all(js)
    first = nc.connected_url.port
    victim = next(i for i, n in enumerate(nats_cluster.nodes) if n.port == first)
    nats_cluster.kill(victim)
    ack = await bus.publish(js, catalog.ECHO_REQUESTS.subject(RUN), _echo())
    assert ack.stream == "ECHO"
    assert nc.connected_url.port != first
    nats_cluster.restart(victim)
    await nc.close()


def _echo():
    return catalog.ECHO_REQUESTS.msg_type(run_id=RUN, text="hello")


def test_merge_keeps_higher_replicas_and_the_storage_type():
    existing = bus.stream_config(catalog.PROMPTS_STREAM, 3)
    existing.storage = nats.js.api.StorageType.MEMORY
    target, kept = bus.merge_stream_config(existing, bus.stream_config(catalog.PROMPTS_STREAM, 1))
    assert target.num_replicas == 3 and target.storage == nats.js.api.StorageType.MEMORY
    assert kept == ["replicas 3 (not lowered to 1)", "storage memory (not changed to file)"]
