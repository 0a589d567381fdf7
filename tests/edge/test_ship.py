"""Shipping weights to a worker that has no model file: hashes, cache, resume, bounds, and the
same over the in-process communicator."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from edge.cluster.ship import (
    MAX_CHUNK,
    Chunk,
    CommChannel,
    FetchConfig,
    Manifest,
    ShipFile,
    ShipServer,
    Want,
    fetch,
    offer,
    receive,
    wants_needed,
)
from lowband.errors import ConfigError, CorruptWeights, PeerLost, ProtocolError
from transport.loopback import LoopbackGroup


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    (d / "layers").mkdir(parents=True)
    rng = os.urandom
    (d / "config.json").write_bytes(b'{"layers": 2}')
    (d / "layers" / "0.bin").write_bytes(rng(300_000))
    (d / "layers" / "1.bin").write_bytes(rng(123_457))
    (d / "empty.bin").write_bytes(b"")
    return d


def _same_tree(a, b):
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_a_directory_arrives_byte_identical_and_is_cached(model, tmp_path):
    server = ShipServer.of(model)
    asked: list[Want] = []

    def ask(w):
        asked.append(w)
        return server.answer(w)

    cfg = FetchConfig(cache_dir=tmp_path / "cache", chunk_bytes=64 << 10)
    first = fetch(server.manifest, ask, cfg)
    _same_tree(model, first.path)
    assert first.fetched_bytes == server.manifest.total == 300_000 + 123_457 + 13
    assert len(asked) == wants_needed(server.manifest, 64 << 10)
    assert all(w.length <= 64 << 10 for w in asked)
    asked.clear()
    again = fetch(server.manifest, ask, cfg)  # cached: nothing asked
    assert again.path == first.path and again.fetched_bytes == 0 and asked == []


def test_a_broken_transfer_resumes_where_it_stopped(model, tmp_path):
    server = ShipServer.of(model)
    cfg = FetchConfig(cache_dir=tmp_path / "cache", chunk_bytes=50_000)
    served = []

    def flaky(w):
        if len(served) == 5:
            raise PeerLost("the link went down")
        served.append(w)
        return server.answer(w)

    with pytest.raises(PeerLost):
        fetch(server.manifest, flaky, cfg)
    got = sum(w.length for w in served)
    out = fetch(server.manifest, server.answer, cfg)
    # config.json (13 bytes) was complete and kept; layers/0.bin's part is resumed
    assert out.resumed_bytes == got - 13 > 0
    assert out.fetched_bytes == server.manifest.total - got  # nothing asked twice
    _same_tree(model, out.path)


def test_bytes_that_do_not_match_the_hash_are_refused_and_refetched(model, tmp_path):
    server = ShipServer.of(model)
    cfg = FetchConfig(cache_dir=tmp_path / "cache")

    def tampered(w):
        c = server.answer(w)
        return Chunk(c.name, c.offset, bytes([c.data[0] ^ 1]) + c.data[1:]) if c.data else c

    with pytest.raises(CorruptWeights, match="sha256"):
        fetch(server.manifest, tampered, cfg)
    assert not list((tmp_path / "cache").rglob("*.part"))  # the bad part is gone
    _same_tree(model, fetch(server.manifest, server.answer, cfg).path)


def test_a_single_gguf_file_ships_under_its_name(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + os.urandom(10_000))
    server = ShipServer.of(f)
    assert [x.name for x in server.manifest.files] == ["m.gguf"]
    assert server.manifest.files[0].sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    out = fetch(server.manifest, server.answer, FetchConfig(cache_dir=tmp_path / "c"))
    assert (out.path / "m.gguf").read_bytes() == f.read_bytes()


def test_over_the_budget_is_refused_before_writing(model, tmp_path):
    server = ShipServer.of(model)
    cfg = FetchConfig(cache_dir=tmp_path / "cache", budget_mb=0.4)
    with pytest.raises(ConfigError, match="budget"):
        fetch(server.manifest, server.answer, cfg)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "name", ["../x", "/etc/passwd", "a/../../b", "a//b", "", "a\\b", "x" * 300]
)
def test_names_that_leave_the_cache_are_protocol_errors(name):
    with pytest.raises(ProtocolError):
        Manifest.decode({"files": [[name, 1, "0" * 64]]})


@pytest.mark.parametrize(
    "meta",
    [
        {"files": "x"},
        {"files": []},
        {"files": [["a", -1, "0" * 64]]},
        {"files": [["a", 1, "zz"]]},
        {"files": [["a", 1, "0" * 64], ["a", 2, "1" * 64]]},
        {"files": [["a", 1]]},
    ],
)
def test_malformed_manifests_are_protocol_errors(meta):
    with pytest.raises(ProtocolError):
        Manifest.decode(meta)


def test_wants_are_bounded_and_only_inside_the_manifest(model):
    server = ShipServer.of(model)
    with pytest.raises(ProtocolError):
        Want(name="config.json", offset=0, length=MAX_CHUNK + 1)
    with pytest.raises(ProtocolError):
        server.answer(Want(name="config.json", offset=10, length=10))  # past its end
    with pytest.raises(ProtocolError):
        server.answer(Want(name="other.bin", offset=0, length=1))


def test_manifest_round_trips_and_names_its_contents():
    m = Manifest(files=(ShipFile(name="a/b.bin", size=3, sha256="a" * 64),))
    assert Manifest.decode(m.encode()) == m
    other = Manifest(files=(ShipFile(name="a/b.bin", size=3, sha256="b" * 64),))
    assert m.digest != other.digest


def test_bad_fetch_configs(tmp_path):
    with pytest.raises(ConfigError):
        FetchConfig(cache_dir=tmp_path, chunk_bytes=MAX_CHUNK + 1)
    with pytest.raises(ConfigError):
        FetchConfig(cache_dir=tmp_path, budget_mb=-1)


@pytest.mark.timeout(60)
def test_over_the_in_process_communicator(model, tmp_path):
    master, worker = LoopbackGroup(2, timeout=30).comms()
    server = ShipServer.of(model)
    cfg = FetchConfig(cache_dir=tmp_path / "cache", chunk_bytes=100_000)
    served: list[int] = []
    for expected in (wants_needed(server.manifest, cfg.chunk_bytes), 0):  # then: all cached
        t = threading.Thread(target=lambda: served.append(offer(master, 1, server)), daemon=True)
        t.start()
        out = receive(worker, 0, cfg)
        t.join(30)
        assert not t.is_alive() and served[-1] == expected
        _same_tree(model, out.path)


@pytest.mark.timeout(60)
def test_a_failed_fetch_still_releases_the_master(model, tmp_path):
    master, worker = LoopbackGroup(2, timeout=30).comms()
    server = ShipServer.of(model)
    cfg = FetchConfig(cache_dir=tmp_path / "cache", budget_mb=0.1)
    served: list[int] = []
    t = threading.Thread(target=lambda: served.append(offer(master, 1, server)), daemon=True)
    t.start()
    with pytest.raises(ConfigError, match="budget"):
        receive(worker, 0, cfg)
    t.join(30)
    assert served == [0]


@pytest.mark.timeout(60)
def test_the_master_refuses_a_want_outside_the_manifest_over_the_communicator(model):
    master, worker = LoopbackGroup(2, timeout=30).comms()
    server = ShipServer.of(model)
    t = threading.Thread(target=CommChannel(master, 1).serve_one, args=(server,), daemon=True)
    t.start()
    with pytest.raises(ProtocolError, match="refused"):
        CommChannel(worker, 0).ask(Want(name="nope.bin", offset=0, length=1))
    t.join(30)
