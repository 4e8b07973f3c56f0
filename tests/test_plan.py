"""The memory planner: its figures against hand counts, against what a loaded engine measures,
and ``twophase plan`` as a user runs it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

from twophase import LLM, SamplingParams
from twophase.config import load_config
from twophase.errors import ConfigError
from twophase.plan import check, plan, profile
from twophase.plan.budget import GiB, MiB

TINY = {"name": "tiny", "weights": "random"}
DEFAULT = {"name": "smollm2-135m-instruct"}


def weights(p) -> dict[str, int]:
    return {i.name.split(" ")[0]: i.bytes for i in p.items if i.kind == "weights"}


def test_tiny_weights_and_kv_by_hand():
    # vocab 512, hidden 64, ffn 128, 2 layers, 4 heads and 2 KV heads of 16, head untied
    p = plan(load_config({"model": TINY}), profile("cpu"))
    qkv, o = (4 + 2 * 2) * 16 * 64, 64 * 64
    assert weights(p) == {"embedding": 512 * 64 * 4, "attention": 2 * (qkv + o) * 4,
                          "mlp": 2 * 3 * 64 * 128 * 4, "norms": 5 * 64 * 4, "head": 512 * 64 * 4}
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_llama3_8b_bf16_on_an_h200_by_hand():
    p = plan(load_config({"model": {"name": "llama3-8b", "weights": "random"}}), profile("h200"))
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    params = 32 * per_layer + 2 * 128256 * 4096 + 4096
    assert p.total("weights") == params * 2 == 16_060_522_496            # "16.06 GB"
    assert p.kv_bytes_per_token == 128 * 1024
    # everything but the pool and the reserve, then the pool in whole blocks: one more block
    # would eat into the reserve
    rest = p.total() - p.total("kv cache") - p.total("reserve")
    per_block = p.kv_bytes_per_token * p.block_size
    assert p.total("reserve") == int(0.1 * p.device.total_bytes)
    assert rest + p.total("kv cache") + p.total("reserve") <= p.device.total_bytes
    assert rest + (p.num_blocks + 1) * per_block + p.total("reserve") > p.device.total_bytes
    # the padded decode is sliced: no 34 GB gather at 64 sequences of 131,072 tokens
    assert p.total("activations") < 4 * GiB
    assert p.concurrency(8192) == p.num_blocks // 512


def test_default_model_fp32_and_q4_by_hand():
    """smollm2-135m: vocab 49152 (tied), hidden 576, ffn 1536, 30 layers, 9 heads and 3 KV heads
    of 64. q4: GGUF blocks of 32 (20 bytes and a zero-point byte), 8 outlier columns in float32
    with int32 indices, Q8_0 head (34 bytes a block), float32 embedding and norms."""
    fp32 = plan(load_config({"model": DEFAULT}), profile("cpu"))
    assert fp32.total("weights") == 134_515_008 * 4
    assert fp32.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4
    q4 = plan(load_config({"model": {**DEFAULT, "quantization": "q4"}, "backend": {"name": "native"}}),
              profile("cpu"))

    def proj(n, k):
        return n * (k // 32) * 21 + n * 8 * 4 + 8 * 4

    assert weights(q4) == {"embedding": 49152 * 576 * 4,
                           "attention": 30 * (proj(960, 576) + proj(576, 576)),
                           "mlp": 30 * (proj(3072, 576) + proj(576, 1536)),
                           "norms": 61 * 576 * 4, "head": 49152 * 18 * 34}


def test_plan_matches_the_native_backends_packed_files():
    """The q4 layout to the byte: the arrays the native backend maps are what the plan counts."""
    pytest.importorskip("gguf")
    from twophase.backends.native import kernel

    try:
        kernel.load()
    except Exception as exc:      # no C compiler or an unsupported CPU
        pytest.skip(f"native kernel unavailable: {exc}")
    cfg = {"model": {**DEFAULT, "quantization": "q4"}, "backend": {"name": "native"}, "cache": {"num_blocks": 64}}
    # packed first (a cold cache packs in this process, whose heap then holds ~20% more for a while):
    # the check is of a load from the packed files, whatever ran before this test
    LLM.from_config(cfg).close()
    llm = LLM.from_config(cfg)
    try:
        held = sum(a.nbytes for a in llm.prefill_backend.weights.arrays.values())
        # the RoPE frequencies and the layers' windows are the architecture's tables, not weights
        held -= sum(llm.prefill_backend.weights.arrays[k].nbytes for k in ("inv_freq", "window"))
        assert held == llm.plan.total("weights")
        got = llm.memory["check"]["weights"]
        assert abs(got["measured"] - got["predicted"]) <= 0.1 * got["predicted"], got
    finally:
        llm.close()


def test_loaded_default_model_measures_what_the_plan_predicts():
    """fp32 on torch: the resident set grows by the weights the plan counts, within 10% (after a
    first torch model, whose threads and kernels the plan counts as the runtime's)."""
    LLM.from_config({"model": TINY}).close()
    llm = LLM.from_config({"model": DEFAULT, "cache": {"num_blocks": 64}})
    try:
        got = llm.memory["check"]["weights"]
        assert got["predicted"] == 134_515_008 * 4
        assert abs(got["measured"] - got["predicted"]) <= 0.1 * got["predicted"], got
        assert llm.memory["weight_bytes"] == got["predicted"]
    finally:
        llm.close()


def test_a_gap_is_a_warning_naming_the_item(caplog):
    caplog.set_level(logging.INFO, logger="twophase.memory")
    check.compare({"weights": 100 * MiB, "kv cache": 1 * GiB}, {"weights": 101 * MiB, "kv cache": 2 * GiB})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("memory: kv cache took 2048.0 MiB"), warnings
    assert any("predicted vs measured" in r.getMessage() for r in caplog.records)


def test_small_items_within_the_floor_do_not_warn(caplog):
    caplog.set_level(logging.INFO, logger="twophase.memory")
    check.compare({"weights": 10 * MiB}, {"weights": 200 * MiB})    # 20x, but under 256 MiB
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_unknown_device_and_bad_numbers_are_config_errors():
    with pytest.raises(ConfigError, match="unknown device 'h300'; known: cpu, cuda, h200"):
        profile("h300")
    with pytest.raises(ConfigError, match="--memory-gb"):
        profile("h200", memory_gb=0)
    with pytest.raises(ConfigError, match="cache.memory_utilization"):
        load_config({"cache": {"memory_utilization": 1.5}})


def test_users_that_do_not_fit_wait(tmp_path):
    p = plan(load_config({"model": TINY, "cache": {"num_blocks": 64}}), profile("cpu"), context=256, users=6)
    d = p.to_dict()
    assert (d["kv_tokens"], d["max_concurrency"], d["users_fit"], d["users_waiting"]) == (1024, 4, False, 2)


def _plan_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "twophase", "plan", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_cli_plans_llama3_70b_on_an_h100_without_loading_anything(tmp_path):
    r = _plan_cli("--model", "llama3-70b", "--device", "h100-80gb", "--json", "p.json", "--plot", "p.png",
                  cwd=tmp_path)
    assert r.returncode == 1, r.stderr                    # 141 GB of bf16 weights do not fit 80 GB
    assert "does not fit" in r.stdout and "Traceback" not in r.stderr
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["totals"]["weights"] == 141_107_412_992 and d["num_blocks"] == 0
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_cli_llama3_8b_on_an_h200_json_figures_are_bytes(tmp_path):
    r = _plan_cli("--model", "llama3-8b", "--device", "h200", "--context", "8192", "--users", "100",
                  "--json", "p.json", "--plot", "", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["totals"]["weights"] == 16_060_522_496 and d["kv_bytes_per_token"] == 131072
    assert d["users_fit"] and d["max_concurrency"] == d["num_blocks"] // 512
    assert sum(i["bytes"] for i in d["items"]) <= d["device_bytes"]
    assert "max concurrency at 8,192 tokens" in r.stdout
    assert not list(tmp_path.glob("*.png"))


def test_cli_bad_device_is_one_line(tmp_path):
    r = _plan_cli("--model", "tiny", "--device", "tpu", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("twophase: config error: --device: unknown device 'tpu'")
    assert "Traceback" not in r.stderr


def test_q4_weights_on_onnxruntime_count_each_graph(tmp_path):
    p = plan(load_config({"model": {**DEFAULT, "quantization": "q4"}, "backend": {"name": "onnxruntime"}}),
             profile("cpu"))
    one = plan(load_config({"model": {**DEFAULT, "quantization": "q4"},
                            "backend": {"name": "onnxruntime", "options": {"decode_graph": False}}}),
               profile("cpu"))
    assert p.total("weights") == 3 * one.total("weights")
    assert np.isclose(one.total("weights"), 232_775_424, rtol=1e-4)      # the exported graph's data


def test_float_onnxruntime_holds_a_tied_embedding_beside_its_packed_head():
    """Gemma 3 270M in float32, its 262,144 x 640 head tied: ONNX Runtime prepacks every MatMul
    and Gemm weight, the head too, and keeps the embedding's original (mapped from the external
    data) for the Gather; the packing reads that mapping through, so all of it is resident
    (measured at session start: 1,067 MiB more anonymous memory, 649 MiB more file-backed).
    QK-norm keeps Gemma's decodes on the step graph: one copy."""
    cfg = {"model": {"name": "gemma3-270m", "dtype": "float32"}}
    torch_plan = plan(load_config(cfg), profile("cpu"))
    ort_plan = plan(load_config({**cfg, "backend": {"name": "onnxruntime"}}), profile("cpu"))
    table = 262144 * 640 * 4
    assert weights(torch_plan) == {"embedding": table, "attention": 18 * 1_638_400 * 4,
                                   "mlp": 18 * 3 * 640 * 2048 * 4, "norms": 55_936 * 4}
    assert weights(ort_plan) == {**weights(torch_plan), "head": table}
    assert round(ort_plan.total("weights") / MiB, 1) == 1662.7      # measured: 1,694 to 1,704 MiB


def test_the_plan_counts_what_a_backend_says_it_holds():
    """A plugin describes its own memory (``Backend.memory``): two copies of the weights, its
    embedding mapped, its activations in a workspace of its own."""
    from twophase.backends.registry import BackendInfo, Registry
    from twophase.backends.torch_eager import TorchBackend
    from twophase.contract import BackendMemory, Workspace

    class TwoCopies(TorchBackend):
        name = "two-copies"

        @classmethod
        def memory(cls, query):
            return BackendMemory(weight_copies=2, mapped_embedding=True, step_activations=False,
                                 workspace=Workspace("its buffers", 5 * MiB, "fixed"))

    registry = Registry()
    registry.backends["two-copies"] = BackendInfo("two-copies", "a test", TwoCopies)
    p = plan(load_config({"model": TINY, "backend": {"name": "two-copies"}}), profile("cpu", 8),
             registry=registry)
    plain = plan(load_config({"model": TINY}), profile("cpu", 8), registry=registry)
    assert weights(p) == {g: 2 * n for g, n in weights(plain).items()}
    assert [i.name for i in p.items if not i.resident] == ["embedding (two-copies ×2 graphs)"]
    assert p.total("activations") == 0 < plain.total("activations")
    assert [(i.name, i.bytes) for i in p.items if i.kind == "workspace"] == [("its buffers", 5 * MiB)]


def _cuda_sizer(p):
    """The engine's CUDA pool sizing (``twophase.builder.pool.cuda_pool_bytes``) on a plan, in
    blocks, without a GPU."""
    from twophase.builder.pool import cuda_pool_bytes

    return lambda free, per_block: cuda_pool_bytes(p, free, shares_pool=True) // (per_block + p.draft_bytes_per_block)


def test_the_cuda_pool_is_the_plans_capped_by_what_is_free_now():
    from twophase.errors import ModelError

    p = plan(load_config({"model": {"name": "llama3-8b", "weights": "random", "max_model_len": 8192}}),
             profile("h100-80gb"))
    per_block = p.kv_bytes_per_token * p.block_size
    later = sum(i.bytes for i in p.items if i.kind in ("activations", "logits", "cuda graphs", "workspace"))
    size = _cuda_sizer(p)
    free_after_weights = p.device.total_bytes - p.total("weights") - p.total("runtime")
    assert size(free_after_weights, per_block) == p.num_blocks               # an idle GPU: the plan
    busy = free_after_weights - 10 * GiB                                       # another process holds 10 GiB
    assert size(busy, per_block) == (busy - later - p.total("reserve")) // per_block < p.num_blocks
    with pytest.raises(ModelError, match="no room for a KV pool on the GPU"):
        size(later + p.total("reserve"), per_block)


def test_an_automatic_pool_stays_within_what_the_backends_can_index(monkeypatch):
    """onnxruntime on CUDA before 1.26 gathers with 32-bit offsets: its capabilities say so, and
    an automatic pool is sized within them (shown here on the CPU with a small limit)."""
    import dataclasses

    from twophase.backends.torch_eager import TorchBackend

    real = TorchBackend.capabilities
    per_block = 2 * 2 * 2 * 16 * 16                  # tiny: layers x K/V x heads x block x head_dim
    monkeypatch.setattr(TorchBackend, "capabilities",
                        lambda self: dataclasses.replace(real(self), max_pool_elements=100 * per_block + 5))
    llm = LLM.from_config({"model": TINY})
    assert llm.num_blocks == 100
    assert llm.kv_cache.pool.numel() <= 100 * per_block + 5


@pytest.mark.gpu
def test_on_a_gpu_the_plan_matches_what_the_engine_measures():
    """llama3-1b in bf16 on the first GPU: the weights and the pool as the plan predicts them
    (within 10%), and everything together within the card's memory_utilization."""
    import torch

    llm = LLM.from_config({"model": {"name": "llama3-1b", "weights": "random", "max_model_len": 8192},
                           "backend": {"device": "cuda"}})
    try:
        check = llm.memory["check"]
        for item in ("weights", "kv cache"):
            got = check[item]
            assert abs(got["measured"] - got["predicted"]) <= 0.1 * got["predicted"], (item, got)
        free, total = torch.cuda.mem_get_info()
        assert total - free <= 0.92 * total, f"{(total - free) / GiB:.1f} GiB of {total / GiB:.1f} in use"
        out = llm.generate([[5] * 1000] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
        assert all(len(o.token_ids) == 8 for o in out)
    finally:
        llm.close()


def test_a_draft_model_is_planned_beside_the_target():
    """Its weights, and a pool with as many blocks as the target's: the two pools share the
    budget block for block, and the CUDA sizer divides by both."""
    cfg = load_config({"model": {"name": "llama3-8b", "weights": "random"},
                       "speculative": {"method": "draft", "draft": {"name": "llama3-1b"}}})
    p = plan(cfg, profile("h200"))
    alone = plan(load_config({"model": {"name": "llama3-8b", "weights": "random"}}), profile("h200"))
    draft_weights = sum(i.bytes for i in p.items if i.name.startswith("draft model:"))
    assert draft_weights == 2 * (16 * (2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048)
                                 + 128256 * 2048 + 2048)                 # llama3-1b bf16, tied head
    assert p.draft_bytes_per_block == 16 * 2 * 8 * 64 * 2 * 16
    pools = {i.name: i.bytes for i in p.items if i.kind == "kv cache"}
    assert pools["draft model's KV pool"] == p.num_blocks * p.draft_bytes_per_block
    assert p.num_blocks < alone.num_blocks
    size = _cuda_sizer(p)
    per_block = p.kv_bytes_per_token * p.block_size
    free = p.device.total_bytes - p.total("runtime") - alone.total("weights")    # the draft loads later
    assert size(free, per_block) == p.num_blocks


def _resident(t) -> int:
    """Bytes of ``t``'s pages the OS backs now (mincore over the tensor's address range)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")
def test_prefault_backs_every_page_and_keeps_the_zeros():
    """A pool's pages cost nothing until written (calloc'd, as here a fresh anonymous mapping),
    unless prefaulted; and a config that asks for it gets its pool backed before any request."""
    import mmap

    import torch

    from twophase.builder.pool import prefault

    buf = mmap.mmap(-1, 64 << 20)
    t = torch.frombuffer(buf, dtype=torch.float32)
    assert _resident(t) == 0
    prefault(t)
    assert _resident(t) == 64 << 20 and not t.any()
    del t
    buf.close()
    llm = LLM.from_config({"model": TINY, "cache": {"num_blocks": 4096, "prefault": True}})
    pool = llm.kv_cache.pool
    assert _resident(pool) >= pool.numel() * pool.element_size() and not pool.any()


def test_sliding_layers_count_their_window_not_the_context():
    """Gemma 3 27B at 128k: 10 full-attention layers hold every token, 52 sliding layers their
    1,024-token window (7 groups of 10 slots: 8 slots of padding), about 11.2 GB in bf16 against
    the 66.6 GB of counting every layer at every token, which K/V moving between engines in one
    block table (disaggregated prefill and decode) keep; onnxruntime reads the groups too."""
    cfg = {"model": {"name": "gemma3-27b", "weights": "random"}}
    p = plan(load_config(cfg), profile("h200"), context=131072)
    per_token_layer = 2 * 16 * 128 * 2
    full, sliding = 10 * 131072 * per_token_layer, 60 * (1024 + 16) * per_token_layer
    assert p.sequence_kv_bytes(131072) == full + sliding
    assert round(p.sequence_kv_bytes(131072) / 1e9, 1) == 11.2
    ort = plan(load_config({**cfg, "backend": {"name": "onnxruntime", "device": "cuda"}}), profile("h200"),
               context=131072)
    assert ort.sequence_kv_bytes(131072) == p.sequence_kv_bytes(131072)
    every = plan(load_config({**cfg, "cluster": {"prefill_workers": 1, "decode_workers": 1}}), profile("h200"),
                 context=131072)
    assert round(every.sequence_kv_bytes(131072) / 1e9, 1) == 66.6
    assert p.concurrency(131072) > 5 * every.concurrency(131072) > 0


def test_a_tensorrt_pool_stops_at_what_its_engine_can_index():
    """TensorRT indexes a tensor in 32 bits: the plan caps the pool as the engine does, one
    scratch block below 2^31 - 1 elements (llama3-8b, 16-token blocks: 2,047 blocks fit)."""
    cfg = load_config({"model": {"name": "llama3-8b", "weights": "random"}, "backend": {"name": "tensorrt"}})
    p = plan(cfg, profile("h200"))
    assert p.num_blocks == (2**31 - 1) // (32 * 2 * 8 * 16 * 128) - 1 == 2046
    assert any("max_pool_elements" in n for n in p.notes)
    free = plan(load_config({"model": {"name": "llama3-8b", "weights": "random"}}), profile("h200"))
    assert free.num_blocks > 20 * p.num_blocks


@pytest.mark.parametrize("shape, device, context, attending, kv_heads, state_layers, v_heads, gain", [
    # Qwen3-Next 80B-A3B (transformers' Qwen3NextConfig shape), 4-bit to fit an H200
    ("qwen3-next-80b-a3b", "h200", 262144, 12, 2, 36, 32, 3),
    # Qwen3.5-27B (its published multimodal config.json, read as its text model), 4-bit
    ("qwen3.5-27b", "h100-80gb", 32768, 16, 4, 48, 48, 1),
])
def test_cli_plans_a_hybrids_state_beside_the_attention_layers_kv(tmp_path, shape, device, context, attending,
                                                                 kv_heads, state_layers, v_heads, gain):
    """K/V for the attention layers only (heads of 256, bf16), a state of Gated DeltaNet layers
    (16 key heads and ``v_heads`` value heads of 128) a sequence counted by hand, and at least
    ``gain`` times the sequences the same memory holds were every layer attending."""
    r = _plan_cli("--model", shape, "--device", device, "--context", str(context),
                  "--quantization", "q4", "--json", "p.json", "--plot", "", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["kv_bytes_per_token"] == attending * 2 * kv_heads * 256 * 2
    conv = (2 * 16 * 128 + v_heads * 128) * 3 * 4        # the convolution's last 3 inputs, float32
    delta = v_heads * 128 * 128 * 4                      # a 128 x 128 matrix a value head
    assert d["state_bytes_per_sequence"] == state_layers * (conv + delta) and d["state_layers"] == state_layers
    state = next(i for i in d["items"] if i["name"] == "state slots")
    assert state["bytes"] == d["state_slots"] * d["state_bytes_per_sequence"]
    assert d["max_concurrency"] >= gain * d["full_attention_concurrency"] > 0
    assert f"in the {attending} attention layers" in r.stdout and f"{state_layers} state layers" in r.stdout


@pytest.mark.parametrize("shape, active_b, total_b, share", [
    ("gpt-oss-120b", 5.13, 116.83, (0.035, 0.05)),      # its model card: 5.1B of 117B
    ("qwen3-30b-a3b", 3.04, 30.53, (0.08, 0.12)),       # its card: 3.3B, the embedding counted whole (+0.31B)
])
def test_cli_names_a_mixture_of_experts_active_weights_against_total(tmp_path, shape, active_b, total_b, share):
    """Active parameters as the model cards count them (top k of each layer's experts, the rest
    whole, the embedding one row), and the bytes a token reads against the weights held."""
    r = _plan_cli("--model", shape, "--device", "h200", "--quantization", "q4", "--json", "p.json", "--plot", "",
                  cwd=tmp_path)
    assert r.returncode in (0, 1), r.stderr
    d = json.loads((tmp_path / "p.json").read_text())
    assert share[0] < d["active_weight_bytes"] / d["totals"]["weights"] < share[1]
    assert f"{active_b:.2f}B of {total_b:.2f}B parameters" in " ".join(r.stdout.split())
    dense = _plan_cli("--model", "llama3-8b", "--json", "q.json", "--plot", "", cwd=tmp_path)
    assert "active weights" not in dense.stdout and "active_weight_bytes" not in (tmp_path / "q.json").read_text()
