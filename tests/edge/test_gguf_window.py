"""The sliding window straight on a GGUF file (``edge.formats.gguf_window``): logits equal the
fully resident model bit for bit (W=1, W=2, W from a memory budget; one device, a TP rank, a
pipeline stage), ggml blocks are views of the file while transformed tensors (llama's permuted
q/k, Gemma's shifted norms) are copies, what is mapped stays within the window's blocks, a
budget that holds no block is refused, and ``edge serve FILE.gguf --window 2`` answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from edge.cluster.stage import LayerRange, load_stage
from edge.formats.gguf_window import fixed_bytes
from edge.quant.linear import GGMLLinear
from edge.shardio import WindowConfig, load_shard
from edge.tp import make_reduce
from lowband.errors import ConfigError
from lowband.models.llama import Span
from tests.conftest import run_ranks, tp_head
from tests.edge.test_gguf_kquants import TYPES, write_mixed
from tests.edge.test_window import _decode
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(600)  # may build the C++ extension first (minutes here)

LAYERS = 6  # blk.0 and blk.1 K-quant / 32-block mixes, blk.2.. F32 (views too)
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
MIB2 = 2 << 20


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_mixed(tmp_path_factory.mktemp("gw") / "m.gguf", TYPES, num_hidden_layers=LAYERS)[1]


@pytest.fixture(scope="module")
def resident(gguf_file):
    """The whole file in memory, eager and unfused like the window's model."""
    sh = load_shard(gguf_file, fuse=False, fast=False)
    return sh.model


def _mapped_rss(mapping) -> int:
    """Rss of ``mapping`` (/proc/self/smaps), bytes."""
    rss = mapping.resident_bytes()
    assert rss is not None, "mapping not found"
    return rss


def _folios(hull: tuple[int, int]) -> int:
    """Bytes of ``hull`` widened to 2 MiB: what populating it may map with huge folios."""
    return -(-hull[1] // MIB2) * MIB2 - hull[0] // MIB2 * MIB2


@pytest.mark.parametrize("w", [1, 2, "budget"])
def test_window_on_gguf_equals_resident(gguf_file, resident, w) -> None:
    ref = _decode(resident, IDS)
    if w == "budget":  # room for the fixed bytes and the two largest blocks, not three
        probe = load_shard(gguf_file, window=WindowConfig(window=1), fast=False)
        sizes = sorted((b.size for b in probe.scheduler.files), reverse=True)
        fixed = fixed_bytes(probe.model, probe.scheduler.files[0].file, range(LAYERS))
        probe.close()
        mb = (fixed + sizes[0] + sizes[1] + sizes[2] // 2) / 2**20
        win = WindowConfig(memory_budget_mb=mb)
    else:
        win = WindowConfig(window=w)
    sh = load_shard(gguf_file, window=win, fast=False)
    try:
        sched = sh.scheduler
        assert sched.n == LAYERS and sched.window == (2 if w == "budget" else w)
        layer0 = sh.model.model.layers[0]
        mapping = sched.files[0].file
        # stored blocks are the file's bytes; llama's permuted q/k rows are copies
        for name in ("v_proj", "o_proj"):
            mod = getattr(layer0.self_attn, name)
            assert isinstance(mod, GGMLLinear) and mapping.holds(mod.blocks)
        assert not mapping.holds(layer0.self_attn.q_proj.blocks)
        assert mapping.holds(sh.model.model.layers[3].mlp.up_proj.weight)  # an F32 view
        assert not any(mapping.holds(t) for t in sh.model.model.embed_tokens.buffers())
        got = _decode(sh.model, IDS)
        sched.settle()
        assert len(sched.resident()) == sched.window
        rss = _mapped_rss(mapping)
        assert rss <= sum(_folios(sched.files[i].hull) for i in sched.resident())
    finally:
        sh.close()
    assert torch.equal(got, ref)


def test_whole_window_maps_every_block_and_compiles(gguf_file, resident) -> None:
    """W = L: every block stays mapped (the Rss the bounds above are measured with) and
    decoding takes the compiled step; same greedy tokens as the model in memory."""
    sh = load_shard(gguf_file, window=WindowConfig(window=LAYERS))
    try:
        sched = sh.scheduler
        assert getattr(sh.model, "fast_decode", None) is not None
        with torch.no_grad():
            got = sh.model(IDS)
        sched.settle()
        assert _mapped_rss(sched.files[0].file) >= 0.9 * sum(b.size for b in sched.files)
    finally:
        sh.close()
    with torch.no_grad():
        assert torch.equal(got.argmax(-1), resident(IDS).argmax(-1))


def test_budget_below_one_block_is_refused(gguf_file) -> None:
    with pytest.raises(ConfigError, match="cannot hold even one layer block"):
        load_shard(gguf_file, window=WindowConfig(memory_budget_mb=0.5))
    with pytest.raises(ConfigError, match="layers"):  # a layer range needs a window
        load_shard(gguf_file, layers=(0, 2))


def _tp(path: Path, x: torch.Tensor, window: WindowConfig | None, sizes: dict[int, int]):
    """Rank 0's logits of two TP ranks on ``path`` (eager, unfused), each with ``window``;
    ``sizes``: each rank's mapped block bytes."""
    comms = LoopbackGroup(2, timeout=60).comms()

    def body(r: int):
        def run():
            reduce = make_reduce(comms[r])
            sh = load_shard(path, r, 2, reduce=reduce, window=window, fuse=False, fast=False)
            try:
                if window is not None:
                    assert sh.scheduler.window == window.window
                    sizes[r] = sum(b.size for b in sh.scheduler.files)
                    mapping = sh.scheduler.files[0].file
                    for t in [
                        *sh.model.model.layers.parameters(),
                        *sh.model.model.layers.buffers(),
                    ]:
                        if not mapping.holds(t):  # a copy of this rank's slice, not of the whole
                            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
                with torch.no_grad():
                    h = sh.model.forward_layers(x, cache=None, start=0)
                    return tp_head(sh.model, sh.plan, r, h, reduce)
            finally:
                sh.close()

        return run

    return run_ranks([body(0), body(1)], timeout=300)[0]


def test_tp_ranks_stream_only_their_rows(gguf_file) -> None:
    """Two TP ranks on the file, each with W=1: the same logits as the two ranks with the
    file in memory, and each rank's blocks are only its output rows (its input-column slices,
    o_proj and down_proj, are copies: fixed bytes), under half of one device's blocks."""
    x = torch.randn(1, 5, 512, generator=torch.Generator().manual_seed(3))
    whole = load_shard(gguf_file, window=WindowConfig(window=1), fast=False)
    one_device = sum(b.size for b in whole.scheduler.files)
    whole.close()
    sizes: dict[int, int] = {}
    got = _tp(gguf_file, x, WindowConfig(window=1), sizes)
    assert torch.equal(got, _tp(gguf_file, x, None, {}))
    assert sorted(sizes) == [0, 1]
    assert all(0 < s < 0.5 * one_device for s in sizes.values()), (sizes, one_device)


def test_pipeline_stage_maps_only_its_layers(gguf_file, resident) -> None:
    """A stage of layers 2..4 with W=1: its window covers those 3 layers only, and its
    hidden states equal one device's over the same layers."""
    rng = LayerRange(2, 5, LAYERS)
    stage = load_stage(str(gguf_file), rng, None, window=WindowConfig(window=1))
    try:
        assert stage.shard.scheduler.n == 3 and stage.shard.scheduler.window == 1
        x = torch.randn(1, 6, 512, generator=torch.Generator().manual_seed(4))
        got = stage.run(x, [Span(stage.new_cache(), 0, 6)])
        with torch.inference_mode():
            want = resident.forward_ragged(x, [Span(resident.new_cache(), 0, 6)], layers=(2, 5))
    finally:
        stage.close()
    assert torch.equal(got, want)


def test_cli_serve_gguf_with_window(tmp_path, spawn) -> None:
    """``lowband edge serve FILE.gguf --window 2`` on a 6-layer Gemma 3 file of Q5_0 blocks
    (shifted norms copied, blocks mapped) answers the greedy text of the same file's window
    loaded in this process."""
    from edge.engine import Engine, LocalRunner
    from edge.sampling import SamplingParams
    from edge.source import resolve_model
    from lowband.proc import free_port
    from tests.cli.test_edge_cli import _http, _wait_health
    from tests.edge.test_gguf_models import hf_gemma3, write_file

    path = write_file(tmp_path / "g.gguf", hf_gemma3(), "gemma3", "qwen2", quant="Q5_0")
    sh = load_shard(path, window=WindowConfig(window=2))
    eng = Engine(LocalRunner(sh.model, sh.close), resolve_model(path).tokenizer(), model_name="g")
    want = eng.complete("hello world", SamplingParams(max_tokens=8))[0]
    eng.close()
    sh.close()
    port = free_port()
    master = spawn(
        [sys.executable, "-m", "cli", "edge", "serve", str(path), "--window", "2"]
        + ["--port", str(port), "--threads", "1"]
    )
    _wait_health(port, master, timeout=400)
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
    status, out = _http(port, "/v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["text"] == want


def test_pipeline_layout_with_a_window_is_refused(gguf_file) -> None:
    """The pipeline layout does not pass the window to its stages: refused before anything
    starts, never ignored; the tensor-parallel layout takes it."""
    from edge.cluster import ClusterConfig
    from edge.launch import check_model

    with pytest.raises(ConfigError, match="pipeline layout"):
        check_model(str(gguf_file), ClusterConfig(devices=2, layout="pipeline", window=1))
    check_model(str(gguf_file), ClusterConfig(devices=2, layout="tp", window=1))


def test_cli_run_two_devices_with_window_on_a_q4_k_file(tmp_path, spawn) -> None:
    """``lowband edge run FILE.gguf --devices 2 --window 1``: the devices (the master and a
    worker process) stream their slices of the file's Q4_K blocks (the master logs its window),
    and the answer is the one-device greedy text (as ``test_cli_run_two_devices_on_a_q4_k_file``
    without a window)."""
    from edge.engine import Engine, LocalRunner
    from edge.sampling import SamplingParams
    from edge.source import resolve_model
    from lowband.proc import free_port
    from tests.cli.test_edge_cli import _http, _wait_health
    from tests.edge.test_gguf_models import hf_qwen25, write_file

    path = write_file(tmp_path / "q.gguf", hf_qwen25(512, 512), "qwen2", "qwen2", quant="Q4_K")
    tok = resolve_model(path).tokenizer()
    eng = Engine(LocalRunner(load_shard(path).model), tok, model_name="q")
    want = eng.complete("hello world", SamplingParams(max_tokens=8))[0]
    eng.close()
    port = free_port()
    master = spawn(
        [sys.executable, "-m", "cli", "-v", "edge", "run", str(path), "--devices", "2"]
        + ["--window", "1", "--port", str(port), "--threads", "1"],
        stderr=-1,
    )
    _wait_health(port, master, timeout=400)
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
    status, out = _http(port, "/v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["text"] == want
    master.terminate()
    _, err = master.communicate(timeout=60)
    assert "sliding window on q.gguf: 1 of 2 layer blocks" in err.decode()  # the master's
