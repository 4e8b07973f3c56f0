"""GGUF files of each family, written as llama.cpp's ``convert_hf_to_gguf.py`` writes them
(``helpers.gguf_writer``: F32, llama.cpp's keys and tensor names, Q/K permuted for the Llama
converter family, ``1 + w`` Gemma norms, stacked experts), loaded through ``model.path``:

* ours gives the original HF model's logits and greedy tokens, on a prompt longer than the
  windows;
* where transformers reads the architecture's GGUF files itself, its logits from the file are
  the original model's: the file is laid out as an independent reader expects it.

Each tiny model is ``tiny_hf_model``'s, with the config changed where llama.cpp's files cannot
carry it (stated per family below)."""

from __future__ import annotations

import re
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import hf_models
from helpers.gguf_writer import CHAT_TEMPLATE, write_gguf
from helpers.hf_models import tiny_hf_model

from twophase import LLM, SamplingParams
from twophase.core.batch import prefill_batch

transformers = pytest.importorskip("transformers")

PROMPT = [(7 * i) % 290 + 5 for i in range(40)]       # longer than the windows of 24
NEW = 24

# what llama.cpp's files leave to the architecture, so the model must have it for its file to
# say what it is: Gemma's query scale is head_dim's and Gemma 2 drops lm_head (tied); Gemma 3
# slides five layers in six; qwen3moe has no dense layers
CHANGES = {
    "gemma2": {"query_pre_attn_scalar": 16, "tie_word_embeddings": True},
    "gemma3": {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    "qwen3_moe": {"mlp_only_layers": []},
    "qwen3_next": {"mlp_only_layers": []},
    # llama.cpp's converter squeezes the convolution weight alone, and its LFM2 has no biases
    "lfm2": {"conv_bias": False},
    # its Mamba-2 converters pad the vocabulary to a multiple of 8 with unused tokens the
    # embedding has no rows for: a multiple of 8 keeps the file's vocabulary the model's
    "granitemoehybrid": {"vocab_size": 304},
}
# what transformers' GGUF reader does not take from the file (given to it as config overrides,
# so its load checks the tensors' layout): Llama's biases, Gemma 2's soft-caps and the Gemma
# query scale, Qwen3's head_dim, the Phi-3 rotary fraction, Qwen3-MoE's expert width
TRANSFORMERS_OVERRIDES = {
    "llama": {"attention_bias": True},
    "gemma2": {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 16},
    "gemma3": {"query_pre_attn_scalar": 16},
    "qwen3": {"head_dim": 24},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    "qwen3_moe": {"moe_intermediate_size": 32},
}
FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral", "gpt_oss",
            *hf_models.STATE_FAMILIES]
# our family of a test family whose name is HF's model_type
OUR_FAMILY = {"granitemoehybrid": "granite"}
# the architectures transformers' GGUF reader takes (Mixtral's files say llama, which it reads
# as a dense Llama)
TRANSFORMERS_READS = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "lfm2", "qwen3_5"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_reference(model) -> tuple[torch.Tensor, list[int]]:
    """The original model's logits at every prompt position and its greedy tokens after it."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    return logits, want


def _allocated(llm, prompt=PROMPT):
    """A request for ``prompt`` with its blocks allocated, to prefill by hand."""
    req = llm.engine.add_request(prompt, SamplingParams(max_tokens=1))
    assert llm.engine.kv.allocate(req, len(prompt))
    return req


def _prefill_logits(llm, req, start: int, n: int) -> torch.Tensor:
    """The backend's logits at every position of tokens ``start .. start + n`` of ``req``."""
    b = prefill_batch([(req, start, n)], llm.engine.kv)
    b.logits = "all"
    return llm.prefill_backend.prefill(b)


def _tiny(family: str, folder):
    """``tiny_hf_model(family)`` with ``CHANGES[family]`` set on its config."""
    base = hf_models.hf_config

    def changed(name):
        c = base(name)
        for k, v in CHANGES.get(name, {}).items():
            setattr(c, k, v)
        return c

    with mock.patch.object(hf_models, "hf_config", changed):
        return tiny_hf_model(family, folder)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small gain nothing from a second thread, and on a loaded machine OpenMP's
    wait for it made each small ``index_add_`` of the MoE layers cost ~30 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def gguf_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = _tiny(request.param, folder / "hf")
    path = write_gguf(folder / "hf", folder / f"tiny-{request.param}.gguf")
    return request.param, model, path


def test_ours_from_the_gguf_gives_the_original_models_logits_and_greedy_tokens(gguf_model):
    family, model, path = gguf_model
    llm = LLM.from_config({"model": {"path": str(path)}, "cache": {"num_blocks": 64, "block_size": 8}})
    assert llm.model.arch.family == OUR_FAMILY.get(family, family)
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE           # the file's, kept
    starts = llm.tokenizer.encode("ab")[0] == llm.model.arch.bos_token_id
    assert starts == family.startswith("gemma")                   # the file's add_bos_token
    logits, want = _hf_reference(model)
    req = _allocated(llm)
    assert _rel(_prefill_logits(llm, req, 0, len(PROMPT)), logits) < 1e-4
    llm.engine.abort(req.request_id)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW, ignore_eos=True))[0].token_ids
    assert out == want


def test_transformers_reads_the_gguf_as_the_original_model(gguf_model):
    family, model, path = gguf_model
    if family not in TRANSFORMERS_READS:
        pytest.skip(f"transformers reads no {family} GGUF")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        **TRANSFORMERS_OVERRIDES.get(family, {})).eval()
    with torch.no_grad():
        got = ref(torch.tensor([PROMPT])).logits
        want = model(torch.tensor([PROMPT])).logits
    assert _rel(got, want) < 1e-4


NATIVE = {"backend": {"name": "native", "options": {"threads": 2}},
          "cache": {"num_blocks": 64, "block_size": 8}, "scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 4}}


def test_native_runs_the_file_as_stored_as_the_original_model(gguf_model):
    """The C step on every family's departures from the Llama block (biases, QK-norm, the
    Gemma norms, GELU, soft-caps, query scales, partial rotary, a RoPE base per layer type,
    sliding windows over a pool in groups, experts): the original model's logits, whole and in
    chunks after cached tokens, and its greedy tokens with the prompt chunked and the context
    past the windows (the sliding groups' blocks given back as the window passes them). Experts
    on q4 weights are refused by name."""
    from twophase.backends.native.kernel import check_machine
    from twophase.errors import BackendUnavailable

    family, model, path = gguf_model
    try:
        check_machine()
    except BackendUnavailable as e:
        pytest.skip(str(e))
    cfg = {**NATIVE, "model": {"path": str(path), "quantization": "gguf"}}
    if family in hf_models.STATE_FAMILIES:     # the C step runs no state layers: refused by name
        with pytest.raises(BackendUnavailable, match="native: .* (is|are) not implemented"):
            LLM.from_config(cfg)
        return
    if family in ("mixtral", "qwen3_moe"):
        with pytest.raises(BackendUnavailable, match="native: mixture-of-experts MLPs on 'q4' weights"):
            LLM.from_config({**cfg, "model": {"path": str(path), "quantization": "q4"}})
    llm = LLM.from_config(cfg)
    logits, want = _hf_reference(model)
    req = _allocated(llm)
    for start, n in ((0, len(PROMPT)), (0, 30), (30, 1), (31, len(PROMPT) - 31)):
        assert _rel(_prefill_logits(llm, req, start, n), logits[start:start + n]) < 1e-4, (start, n)
    llm.engine.abort(req.request_id)
    out = llm.generate([PROMPT, PROMPT[:9]], SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert out[0].token_ids == want


def test_the_avx2_build_computes_every_family_as_this_cpus_build(gguf_model, monkeypatch):
    """The whole step on the AVX2 build (no AVX-512, no VNNI: what a Zen 3 machine runs) gives
    this machine's build's logits bit for bit: the families' code and the stored types' dots are
    the same 256-bit arithmetic on both (on a CPU without AVX-512 the two builds are one)."""
    from helpers.native import PATHS, native_or_skip

    from twophase.backends.native import kernel

    native_or_skip()
    family, _, path = gguf_model
    if family in hf_models.STATE_FAMILIES:
        pytest.skip(f"the native backend runs no {family} model")
    cfg = {**NATIVE, "model": {"path": str(path), "quantization": "gguf"}}
    logits = {}
    for name in ("native", "avx2"):
        build = kernel.load
        monkeypatch.setattr(kernel, "load", lambda flags=(), build=build, name=name: build(flags or PATHS[name]))
        llm = LLM.from_config(cfg)
        logits[name] = _prefill_logits(llm, _allocated(llm), 0, len(PROMPT))
        llm.close()
        monkeypatch.setattr(kernel, "load", build)
    assert torch.equal(logits["native"], logits["avx2"])


@pytest.mark.parametrize("wide", [False, True], ids=["experts", "wide-router"])
def test_native_experts_on_stored_blocks_give_each_row_what_it_gets_alone(tmp_path, wide):
    """Qwen3-MoE's experts in Q8_0 and Q5_0 blocks: a 40-token prefill in one step gathers each
    expert's rows (the tiled path where an expert's rows start on a group of four, the one-row
    path elsewhere), and every row's logits are what that token gets prefilled alone after the
    ones before it, bit for bit. wide: a 1024-wide model whose router is Q8_0 too, over 131
    tokens (the router reads its rounded activations, larger there than the q4 layout's, while
    it writes the scores laid out after them). The int8 paths: AMX tiles compute a step of 24
    rows or more in bf16 (tests/backends/test_native_amx.py)."""
    from helpers.native import native_or_skip

    native_or_skip()
    changes = {**CHANGES["qwen3_moe"], **({"hidden_size": 1024} if wide else {})}
    with mock.patch.dict(CHANGES, {"qwen3_moe": changes}):
        model = _tiny("qwen3_moe", tmp_path / "hf")
    types = {f"blk.{i}.ffn_{p}_exps.weight": "Q8_0" if i % 2 else "Q5_0"
             for i in range(model.config.num_hidden_layers) for p in ("gate", "up", "down")}
    if wide:
        types |= {f"blk.{i}.ffn_gate_inp.weight": "Q8_0" for i in range(model.config.num_hidden_layers)}
    path = write_gguf(tmp_path / "hf", tmp_path / "tiny-qwen3_moe-q.gguf", types)
    backend = {"name": "native", "options": {"threads": 2, "amx": False}}
    llm = LLM.from_config({**NATIVE, "backend": backend, "model": {"path": str(path), "quantization": "gguf"}})
    prompt = (PROMPT * 4)[:131] if wide else PROMPT
    req = _allocated(llm, prompt)
    whole = _prefill_logits(llm, req, 0, len(prompt))
    alone = torch.cat([_prefill_logits(llm, req, i, 1) for i in range(len(prompt))])
    assert torch.equal(whole, alone)
    llm.close()


@pytest.mark.parametrize("family, dropped, named", [
    ("qwen3_next", "model.layers.0.linear_attn.A_log", "blk.0.ssm_a"),
    ("qwen3_5", "model.layers.0.linear_attn.in_proj_a.weight", "blk.0.ssm_alpha.weight"),
    ("lfm2", "model.layers.0.conv.conv.weight", "blk.0.shortconv.conv.weight"),
    ("granitemoehybrid", "model.layers.0.mamba.D", "blk.0.ssm_d"),
])
def test_a_file_lacking_a_state_tensor_is_refused_naming_it(tmp_path, family, dropped, named):
    """A state layer's tensor missing from the file: a ModelError naming it by its GGUF name,
    before any converted folder is written."""
    from helpers import gguf_writer

    from twophase.errors import ModelError

    _tiny(family, tmp_path / "hf")
    every = gguf_writer._tensors
    with mock.patch.object(gguf_writer, "_tensors",
                           lambda folder, c: {k: v for k, v in every(folder, c).items() if k != dropped}):
        path = write_gguf(tmp_path / "hf", tmp_path / f"tiny-{family}.gguf")
    ours = OUR_FAMILY.get(family, family)
    with pytest.raises(ModelError, match=rf"lacks the tensor {re.escape(named)}, which its {ours} model"):
        LLM.from_config({"model": {"path": str(path)}, "cache": {"num_blocks": 64, "block_size": 8}})


def test_a_granite_file_gives_back_every_tensor_of_the_original(tmp_path):
    """Every tensor of a ``granitehybrid`` file, undone as the reader undoes it, is the original
    checkpoint's, bit for bit but A_log (``log(-(-exp(A_log)))`` in float32): q and k rows too,
    whose permutation the logits of a model without RoPE would not show."""
    from safetensors.numpy import load_file

    from twophase.models.gguf import gguf_family, hf_config, hf_tensors
    from twophase.models.gguf_file import GGUFFile

    _tiny("granitemoehybrid", tmp_path / "hf")
    header = GGUFFile(write_gguf(tmp_path / "hf", tmp_path / "tiny-granitemoehybrid.gguf"))
    config, fam = hf_config(header), gguf_family(header)
    got = {}
    for name in header.tensors:
        got.update(hf_tensors(header, name, fam, config["num_attention_heads"], config["num_key_value_heads"]))
    want = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape, k
        assert np.allclose(got[k], v, rtol=1e-6, atol=1e-6) if k.endswith("A_log") else (got[k] == v).all(), k


def test_a_qwen3_5_file_with_a_next_token_prediction_block_loads_its_model_alone(tmp_path, caplog):
    """llama.cpp's newest converter writes Qwen3.5's next-token-prediction layer as one more
    block (``blk.{n}``, its ``nextn.*`` tensors among it) and states ``nextn_predict_layers``:
    the model is the blocks before it, with the tokens of the file without it, and the log says
    the extra block is not loaded."""
    from helpers import gguf_writer

    _tiny("qwen3_5", tmp_path / "hf")
    plain = write_gguf(tmp_path / "hf", tmp_path / "plain.gguf")
    meta = gguf_writer._metadata

    def with_nextn(w, model_type, c):
        meta(w, model_type, c)
        n, h = c.num_hidden_layers, c.hidden_size
        w.add_block_count(n + 1)
        w.add_uint32("qwen35.nextn_predict_layers", 1)
        rng = np.random.default_rng(0)
        for name, shape in ((f"blk.{n}.attn_norm.weight", (h,)), (f"blk.{n}.nextn.eh_proj.weight", (h, 2 * h)),
                            (f"blk.{n}.nextn.enorm.weight", (h,))):
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    with mock.patch.object(gguf_writer, "_metadata", with_nextn):
        extra = write_gguf(tmp_path / "hf", tmp_path / "nextn.gguf")
    caplog.set_level("INFO")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    cfg = {"cache": {"num_blocks": 64, "block_size": 8}}
    want = LLM.from_config({"model": {"path": str(plain)}, **cfg}).generate([PROMPT], params)[0].token_ids
    llm = LLM.from_config({"model": {"path": str(extra)}, **cfg})
    assert llm.spec.arch.num_layers == 4 and "next-token-prediction block(s)" in caplog.text
    assert llm.generate([PROMPT], params)[0].token_ids == want
