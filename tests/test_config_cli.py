"""Configuration checking and the ``twophase`` command line, seen the way a user meets them.

``load_config`` is tested in-process (cheap): each bad config must raise ``ConfigError`` whose
message names the key path and what is allowed. The CLI is tested as a user runs it
(``python -m twophase`` in a subprocess): a user mistake ends with one readable line on stderr,
a meaningful exit status and no traceback. The subprocesses are started together by one
module-scoped fixture (each costs ~2 s of interpreter and torch start-up) and every test waits
only for its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from twophase import LLM, SamplingParams
from twophase.config import (
    BackendSection,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    WorkloadConfig,
    load_config,
)
from twophase.errors import ConfigError, TwophaseError

TINY = {"name": "tiny", "weights": "random"}
TINY_TOML = '[model]\nname = "tiny"\nweights = "random"\n'
TINY_RUN_TOML = TINY_TOML + """
[cache]
num_blocks = 64

[workload.synthetic]
num_requests = 3
input_len = [4, 12]
output_len = [2, 6]
"""


def config_error(source) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return info.value


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- load_config: TOML files -----------------------------------------------------------------

def test_toml_syntax_error_names_the_file(tmp_path):
    path = write(tmp_path, '[model\nname = "tiny"\n')
    err = config_error(path)
    msg = str(err)
    assert "TOML syntax error" in msg
    assert str(path) in msg
    assert "line 1" in msg


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    msg = str(config_error(missing))
    assert str(missing) in msg and "not found" in msg


@pytest.mark.parametrize("text, key, allowed", [
    ('[model]\nnam = "tiny"\n', "model.nam",
     ["name", "path", "weights", "dtype", "num_layers", "max_model_len", "seed", "quantization",
      "accuracy_level", "outlier_channels", "max_loras"]),
    (TINY_TOML + "[scheduler]\nfoo = 1\n", "scheduler.foo",
     ["policy", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "admission"]),
    ('[modle]\nname = "tiny"\n', "modle",
     ["model", "backend", "scheduler", "cache", "sampling", "workload", "bench", "server", "speculative",
      "cluster", "lora"]),
    (TINY_TOML + "[cache]\nblock_sise = 16\n", "cache.block_sise",
     ["block_size", "num_blocks", "memory_gb", "memory_utilization", "prefix_caching", "dtype", "prefault",
      "state_snapshot_every", "state_snapshots", "offload"]),
], ids=["model.nam", "scheduler.foo", "top-level-modle", "cache.block_sise"])
def test_unknown_key_lists_allowed_keys(tmp_path, text, key, allowed):
    err = config_error(write(tmp_path, text))
    msg = str(err)
    assert err.key == key
    assert msg.startswith(f"{key}: unknown key")
    listed = msg.split("allowed keys here:", 1)[1]
    assert [k.strip() for k in listed.split(",")] == allowed


def test_internal_field_is_not_a_key(tmp_path):
    # base_dir is set from the file's location, never from the file itself
    err = config_error(write(tmp_path, 'base_dir = "/etc"\n' + TINY_TOML))
    assert err.key == "base_dir"
    assert "base_dir" not in str(err).split("allowed keys here:", 1)[1]


@pytest.mark.parametrize("text, key, expected, got", [
    (TINY_TOML + '[scheduler]\nmax_num_seqs = "8"\n', "scheduler.max_num_seqs",
     "expected an integer", "got a string '8'"),
    (TINY_TOML + "[cache]\nblock_size = true\n", "cache.block_size",
     "expected an integer", "got a boolean True"),
    (TINY_TOML + "[scheduler]\nmax_num_seqs = 8.5\n", "scheduler.max_num_seqs",
     "expected an integer", "got a number 8.5"),
    (TINY_TOML + '[cache]\nnum_blocks = "many"\n', "cache.num_blocks",
     "expected an integer or 'auto'", "got a string 'many'"),
    (TINY_TOML + "[cache]\nnum_blocks = true\n", "cache.num_blocks",
     "expected an integer or 'auto'", "got a boolean True"),
    (TINY_TOML + "[sampling]\ntemperature = true\n", "sampling.temperature",
     "expected a number", "got a boolean True"),
    (TINY_TOML + '[sampling]\nstop = "END"\n', "sampling.stop",
     "expected a list", "got a string"),
    (TINY_TOML + '[sampling]\nstop_token_ids = [1, "a"]\n', "sampling.stop_token_ids[1]",
     "expected an integer", "got a string 'a'"),
    (TINY_TOML + "[scheduler]\nchunked_prefill = 1\n", "scheduler.chunked_prefill",
     "expected true or false", "got an integer 1"),
], ids=["str-for-int", "bool-for-int", "float-for-int", "str-for-int-or-auto",
        "bool-for-int-or-auto", "bool-for-float", "str-for-list", "list-item", "int-for-bool"])
def test_wrong_type_names_key_and_expected_type(tmp_path, text, key, expected, got):
    err = config_error(write(tmp_path, text))
    assert err.key == key
    assert str(err).startswith(f"{key}: {expected}")
    assert got in str(err)


@pytest.mark.parametrize("text, message", [
    ('[[model]]\nname = "tiny"\n', "model: must be a table, got a list"),   # array of tables
    ('model = ["tiny"]\n', "model: must be a table, got a list"),
    ('model = "tiny"\n', "model: must be a table, got a string"),
    (TINY_TOML + "[backend]\noptions = [1, 2]\n", "backend.options: expected a table, got a list"),
])
def test_non_table_for_a_table(tmp_path, text, message):
    err = config_error(write(tmp_path, text))
    assert str(err) == message
    assert err.key == message.split(":")[0]


@pytest.mark.parametrize("section, key, value, allowed", [
    ("scheduler", "policy", "fifo", "'decode-first', 'prefill-first'"),
    ("model", "weights", "randon", "'pretrained', 'random'"),
    ("model", "dtype", "fp16", "'auto', 'float32', 'bfloat16', 'float16'"),
    ("model", "quantization", "q4_k_m", "'none', 'q4', 'gguf'"),
    ("cache", "dtype", "e5m2", "'auto', 'float32', 'bfloat16', 'float16', 'int8', 'fp8'"),
])
def test_value_outside_literal_lists_allowed_values(section, key, value, allowed):
    cfg = {"model": dict(TINY)}
    cfg.setdefault(section, {})[key] = value
    err = config_error(cfg)
    assert err.key == f"{section}.{key}"
    assert str(err) == f"{section}.{key}: must be one of {allowed}; got {value!r}"


@pytest.mark.parametrize("section, key, value", [
    ("cache", "block_size", 0),
    ("cache", "num_blocks", 0),
    ("scheduler", "max_num_seqs", -1),
    ("scheduler", "max_num_batched_tokens", 0),
    ("model", "num_layers", 0),
    ("model", "max_model_len", -5),
    ("sampling", "max_tokens", 0),
])
def test_non_positive_integers(section, key, value):
    err = config_error({"model": dict(TINY), section: {key: value}})
    assert err.key == f"{section}.{key}"
    assert str(err) == f"{section}.{key}: must be a positive integer, got {value}"


def test_non_positive_block_size_from_toml(tmp_path):
    err = config_error(write(tmp_path, TINY_TOML + "[cache]\nblock_size = 0\n"))
    assert str(err) == "cache.block_size: must be a positive integer, got 0"


def test_batched_tokens_must_exceed_max_num_seqs_under_decode_first():
    for tokens in (64, 10):
        err = config_error({"model": dict(TINY),
                            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": tokens}})
        assert err.key == "scheduler.max_num_batched_tokens"
        assert "must exceed scheduler.max_num_seqs (64)" in str(err)
        assert "decode-first" in str(err)
    # one more token is enough; prefill-first and unchunked prefill do not need the margin
    load_config({"model": dict(TINY), "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 65}})
    load_config({"model": dict(TINY), "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 64,
                                                    "policy": "prefill-first"}})
    load_config({"model": dict(TINY), "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 64,
                                                    "chunked_prefill": False}})


@pytest.mark.parametrize("key, value", [
    ("input_len", [0, 8]),
    ("input_len", [9, 8]),
    ("input_len", [8]),
    ("input_len", [1, 2, 3]),
    ("output_len", [4, 2]),
])
def test_bad_synthetic_lengths(key, value):
    err = config_error({"model": dict(TINY), "workload": {"synthetic": {key: value}}})
    assert err.key == f"workload.synthetic.{key}"
    assert str(err) == (f"workload.synthetic.{key}: must be [min, max] with 1 <= min <= max, "
                        f"got {value}")


@pytest.mark.parametrize("section, key, value, text", [
    ("sampling", "temperature", -0.5, "must be >= 0"),
    ("sampling", "top_p", 0.0, "must be in (0, 1]"),
    ("sampling", "top_p", 1.5, "must be in (0, 1]"),
])
def test_sampling_ranges(section, key, value, text):
    err = config_error({"model": dict(TINY), section: {key: value}})
    assert str(err) == f"{section}.{key}: {text}, got {value!r}"


@pytest.mark.parametrize("key, value, text", [
    ("threads", 0, "must be at least 1"),
    ("prefill_threads", 0, "must be at least 1"),
    ("decode_threads", -2, "must be at least 1"),
    ("prefill_workers", -1, "must be at least 0"),
    ("prefill_nice", 20, "must be a nice value in [0, 19]"),
    ("prefill_nice", -5, "must be a nice value in [0, 19]"),
])
def test_cluster_ranges(key, value, text):
    err = config_error({"model": dict(TINY), "cluster": {"prefill_workers": 1, "decode_workers": 1, key: value}})
    assert str(err) == f"cluster.{key}: {text}, got {value}"


def test_a_config_file_given_as_the_model_is_named(tmp_path):
    toml = write(tmp_path, TINY_TOML)
    err = config_error({"model": {"path": str(toml)}})
    assert err.key == "model.path"
    assert "is a file but not a .gguf" in str(err) and "CONFIG argument" in str(err)


@pytest.mark.parametrize("key", ["prefill_threads", "decode_threads", "prefill_nice"])
def test_role_keys_without_disaggregation_are_refused(key):
    err = config_error({"model": dict(TINY), "cluster": {"replicas": 2, key: 1}})
    assert str(err).startswith(f"cluster.{key}: applies to disaggregated serving")


def test_only_model_section_gets_every_default(tmp_path):
    path = write(tmp_path, TINY_TOML)
    cfg = load_config(path)
    assert cfg.model == ModelConfig(name="tiny", weights="random")
    assert cfg.backend == BackendSection()
    assert cfg.scheduler == SchedulerConfig()
    assert cfg.cache == CacheConfig()
    assert cfg.sampling == SamplingParams()
    assert cfg.workload == WorkloadConfig()
    assert cfg.workload.synthetic is None
    assert (cfg.backend.name, cfg.backend.device) == ("torch", "cpu")
    assert cfg.scheduler.policy == "decode-first" and cfg.cache.num_blocks == "auto"
    # paths in the config are relative to the config file's folder
    assert cfg.base_dir == tmp_path.resolve()
    assert cfg.resolve("w.jsonl") == tmp_path.resolve() / "w.jsonl"
    # the same from a dict
    assert load_config({"model": dict(TINY)}).cache == CacheConfig()
    # and it runs: an engine with an auto-sized pool that serves a prompt
    llm = LLM(cfg)
    assert llm.max_model_len == 2048 and llm.num_blocks >= 1
    out, = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_defaults_are_not_shared_between_configs():
    a = load_config({"model": dict(TINY)})
    a.sampling.stop.append("X")
    a.backend.options["threads"] = 1
    b = load_config({"model": dict(TINY)})
    assert b.sampling.stop == [] and b.backend.options == {}


# -- errors inside sections, file encodings and value ranges --------------------------------

def test_unknown_key_inside_synthetic_is_named():
    err = config_error({"model": dict(TINY), "workload": {"synthetic": {"num_request": 3}}})
    assert err.key == "workload.synthetic.num_request"
    assert "num_requests" in str(err).split("allowed keys here:", 1)[1]


def test_wrong_type_inside_synthetic_is_named():
    err = config_error({"model": dict(TINY), "workload": {"synthetic": {"num_requests": "3"}}})
    assert err.key == "workload.synthetic.num_requests"


def test_non_utf8_config_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[model]\nname = "caf\xe9"\n')
    assert str(path) in str(config_error(path))


@pytest.mark.parametrize("n", [0, -2])
def test_synthetic_num_requests_must_be_positive(n):
    err = config_error({"model": dict(TINY), "workload": {"synthetic": {"num_requests": n}}})
    assert err.key == "workload.synthetic.num_requests"


def test_memory_gb_must_be_positive():
    assert config_error({"model": dict(TINY), "cache": {"memory_gb": -1.0}}).key == "cache.memory_gb"


def test_sampling_top_k_checked_by_load_config():
    assert config_error({"model": dict(TINY), "sampling": {"top_k": -1}}).key == "sampling.top_k"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "iree"])
def test_malformed_device_string_is_a_user_error(backend):
    """Every backend refuses a device name torch does not know with the same clear message."""
    with pytest.raises(TwophaseError, match="'gpu' is not a device name"):
        LLM.from_config({"model": dict(TINY), "backend": {"name": backend, "device": "gpu"},
                         "cache": {"num_blocks": 8}})


# -- LLM.generate: a rejected request does not sink the others ------------------------------

def test_rejected_prompt_among_good_ones():
    llm = LLM.from_config({"model": {**TINY, "max_model_len": 64}, "cache": {"num_blocks": 64}})
    assert llm.max_model_len == 64
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    too_long = list(range(3, 3 + 70))
    prompts = [[5, 6, 7, 8], too_long, "hello", [9] * 60]   # 60 + 4 = 64 fits exactly
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "rejected", "length", "length"]
    bad = outs[1]
    assert "model.max_model_len" in bad.error
    assert "prompt (70 tokens)" in bad.error and "context of 64 tokens" in bad.error
    assert bad.token_ids == [] and bad.prompt_token_ids == too_long and bad.times is None
    for i in (0, 2, 3):
        assert len(outs[i].token_ids) == 4 and outs[i].error is None
    assert outs[0].prompt_token_ids == [5, 6, 7, 8] and outs[2].prompt == "hello"
    # a prompt one token over the limit is rejected too; the engine is still usable after
    over, ok = llm.generate([[9] * 61, [4, 4]], params)
    assert over.finish_reason == "rejected" and "= 65 exceeds" in over.error
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    # the report counts only the served requests
    assert llm.report([over, ok])["requests"] == 1


# -- the CLI as a user runs it ---------------------------------------------------------------

@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    max_rss_mib: float

    def __str__(self) -> str:
        return (f"twophase {' '.join(self.args)} -> {self.returncode} in {self.wall_s:.1f} s\n"
                f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}")


# ``python -m twophase`` that writes its own peak RSS (VmHWM) at exit. A child's ``ru_maxrss``
# would not do: it keeps the high-water mark of the forked pytest process it started as.
_WITH_PEAK_RSS = """
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f, open(os.environ["TWOPHASE_TEST_PEAK"], "w") as out:
        out.write(next(line for line in f if line.startswith("VmHWM")).split()[1])
atexit.register(_peak)
sys.argv[0] = "twophase"
runpy.run_module("twophase", run_name="__main__", alter_sys=True)
"""


def _run_cli(args: list[str], cwd: Path, timeout: float = 180) -> Result:
    """``python -m twophase ARGS`` in ``cwd``, with its own wall time and peak memory."""
    peak = cwd / ".peak_kib"
    # wide enough that rich does not wrap the report
    env = {**os.environ, "COLUMNS": "200", "TWOPHASE_TEST_PEAK": str(peak)}
    out, err = cwd / ".stdout", cwd / ".stderr"
    t0 = time.monotonic()
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-c", _WITH_PEAK_RSS, *args], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=fo, stderr=fe)
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak_kib = int(peak.read_text()) if peak.exists() else usage.ru_maxrss
    return Result(args, proc.returncode, out.read_text(), err.read_text(), time.monotonic() - t0,
                  peak_kib / 1024)


def _case_dir(root: Path, name: str, files: dict[str, str]) -> Path:
    d = root / name
    d.mkdir()
    for fname, text in files.items():
        (d / fname).write_text(text)
    return d


CLI_CASES = {
    "unknown_key": ({"c.toml": '[model]\nname = "tiny"\nweights = "random"\nnam = "x"\n'},
                    ["run", "c.toml"]),
    "missing_file": ({}, ["run", "missing.toml"]),
    "unknown_backend": ({"c.toml": TINY_TOML + '[backend]\nname = "nope"\n'}, ["run", "c.toml"]),
    "no_cuda": ({"c.toml": TINY_TOML + '[backend]\ndevice = "cuda"\n'}, ["run", "c.toml"]),
    "unknown_shape": ({"c.toml": '[model]\nname = "tiny2"\nweights = "random"\n'}, ["run", "c.toml"]),
    "too_big": ({"c.toml": '[model]\nname = "llama3-70b"\nweights = "random"\ndtype = "float32"\n'},
                ["run", "c.toml"]),
    "bad_jsonl": ({"c.toml": TINY_TOML + '[cache]\nnum_blocks = 64\n[workload]\njsonl = "w.jsonl"\n',
                   "w.jsonl": '{"prompt": "hi", "max_tokens": 2}\n\n{"prompt": oops}\n'},
                  ["run", "c.toml"]),
    "run_tiny": ({"c.toml": TINY_RUN_TOML}, ["run", "c.toml", "--json", "out.json"]),
    "run_flags": ({}, ["run", "--model", "tiny", "--prompt", "Hi", "--prompt", "Yo", "--max-tokens", "3"]),
    "empty_prompts": ({"c.toml": TINY_TOML + "[workload]\nprompts = []\n"}, ["run", "c.toml"]),
    "version": ({}, ["--version"]),
    "backends": ({}, ["backends"]),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Starts every CLI case in the background; ``cli(name)`` waits for that case's result."""
    root = tmp_path_factory.mktemp("cli")
    pool = ThreadPoolExecutor(max_workers=3)
    futures: dict[str, Future] = {}
    for name, (files, args) in CLI_CASES.items():
        futures[name] = pool.submit(_run_cli, args, _case_dir(root, name, files))
    yield lambda name: (futures[name].result(), root / name)
    pool.shutdown(wait=True)


@pytest.fixture(scope="module", autouse=True)
def _start_cli_early(request):
    """Start the CLI subprocesses with the module's first test, so they overlap the in-process
    tests, but only if a selected test needs them."""
    if any("cli" in item.fixturenames for item in request.session.items
           if item.module is request.module):
        request.getfixturevalue("cli")


def assert_one_line_error(r: Result, prefix: str) -> str:
    assert "Traceback" not in r.stderr + r.stdout, str(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, str(r)
    assert lines[0].startswith(prefix), str(r)
    return lines[0]


def test_cli_bad_config_one_line(cli):
    r, _ = cli("unknown_key")
    assert r.returncode == 2, str(r)
    line = assert_one_line_error(r, "twophase: config error: ")
    assert "model.nam" in line and "allowed keys here: name, path, weights" in line
    assert r.stdout == ""


def test_cli_missing_config_file(cli):
    r, _ = cli("missing_file")
    assert r.returncode == 2, str(r)
    line = assert_one_line_error(r, "twophase: config error: ")
    assert "missing.toml" in line and "not found" in line


def test_cli_unknown_backend_lists_installed(cli):
    r, _ = cli("unknown_backend")
    assert r.returncode == 2, str(r)
    line = assert_one_line_error(r, "twophase: config error: backend.name: ")
    assert "'nope'" in line
    installed = [b.strip() for b in line.split("installed backends:", 1)[1].split(",")]
    assert "torch" in installed


def test_cli_cuda_on_cpu_only_machine(cli):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r, _ = cli("no_cuda")
    assert r.returncode != 0, str(r)
    line = assert_one_line_error(r, "twophase: ")
    assert "no CUDA device" in line and "'cuda'" in line


def test_cli_unknown_shape_lists_shapes(cli):
    r, _ = cli("unknown_shape")
    assert r.returncode == 2, str(r)
    line = assert_one_line_error(r, "twophase: config error: model.name: ")
    assert "'tiny2'" in line
    shapes = [s.strip() for s in line.split("shapes:", 1)[1].split(",")]
    assert {"tiny", "llama3-8b", "llama3-70b"} <= set(shapes)


def test_cli_too_big_model_refused_before_allocation(cli):
    from twophase.device import available_memory
    if available_memory("cpu") > 300 * (1 << 30):
        pytest.skip("this machine could hold llama3-70b in fp32")
    r, _ = cli("too_big")
    assert r.returncode == 1, str(r)
    line = assert_one_line_error(r, "twophase: ")
    m = re.search(r"llama3-70b\S* needs ([\d.]+) GiB .*float32.* but cpu has ([\d.]+) GiB "
                  r"available", line)
    assert m, line
    need, have = float(m.group(1)), float(m.group(2))
    assert 255 < need < 270, line              # 70.6 B parameters x 4 bytes = 262.8 GiB
    assert 0 < have < need
    # refused from the shape alone: no weights were allocated or initialised
    assert r.max_rss_mib < 2048, f"peak RSS {r.max_rss_mib:.0f} MiB\n{r}"


def test_cli_bad_jsonl_line_names_file_and_line(cli):
    r, _ = cli("bad_jsonl")
    assert r.returncode == 2, str(r)
    assert "Traceback" not in r.stderr, str(r)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("twophase: config error: workload.jsonl (w.jsonl:3): not JSON"), str(r)


def test_cli_run_tiny_prints_report_and_writes_json(cli):
    r, d = cli("run_tiny")
    assert r.returncode == 0, str(r)
    assert "Traceback" not in r.stderr
    assert "prefill tokens" in r.stdout and "decode tokens" in r.stdout, str(r)
    data = json.loads((d / "out.json").read_text())
    assert {"report", "outputs", "steps"} <= set(data)
    assert len(data["outputs"]) == 3
    for o in data["outputs"]:
        assert o["finish_reason"] == "length"          # synthetic requests ignore EOS
        assert 2 <= len(o["token_ids"]) <= 6
        assert 4 <= len(o["prompt_token_ids"]) <= 12
    assert isinstance(data["steps"], list) and data["steps"]
    assert isinstance(data["report"], dict) and data["report"]["backend"]["prefill"] == "torch"
    assert data["config"] == str((d / "c.toml").resolve())


def test_cli_runs_without_a_config_from_flags(cli):
    r, _ = cli("run_flags")
    assert r.returncode == 0, str(r)
    assert "#0 (length, 3 tokens)" in r.stdout and "#1 (length, 3 tokens)" in r.stdout
    assert "requests / output tokens" in r.stdout and "2 / 6" in r.stdout


def test_cli_empty_prompts_is_an_error_not_the_examples(cli):
    r, _ = cli("empty_prompts")
    assert r.returncode == 2, str(r)
    line = assert_one_line_error(r, "twophase: config error: workload.prompts: ")
    assert "is empty" in line


def test_cli_version(cli):
    from importlib.metadata import version

    r, _ = cli("version")
    assert r.returncode == 0 and r.stdout.strip() == f"twophase {version('twophase')}", str(r)


def test_flags_override_the_config_key_by_key():
    import argparse

    from twophase.cli import flags

    def parsed(*argv):
        p = argparse.ArgumentParser()
        flags.add(p)
        return p.parse_args(argv)

    split = {"backend": {"prefill": {"name": "onnxruntime"}, "decode": {"name": "native"}}}
    got = flags.overrides(parsed("--threads", "2"), split)
    assert got["backend"] == {k: {"options": {"threads": 2}} for k in ("prefill", "decode")}
    got = flags.overrides(parsed("--backend", "torch", "--threads", "1"), split)
    assert got["backend"] == {"name": "torch", "prefill": None, "decode": None, "options": {"threads": 1}}
    cfg = load_config(split, flags.overrides(parsed("--backend", "torch", "--model", "tiny"), split))
    assert cfg.backend.name == "torch" and cfg.backend.prefill is None
    assert (cfg.model.name, cfg.model.weights) == ("tiny", "random")
    cfg = load_config({"model": {"path": "x.gguf"}},
                      flags.overrides(parsed("--model", "smollm2-135m-instruct", "--quantization", "q4"), {}))
    assert (cfg.model.name, cfg.model.path, cfg.model.weights, cfg.model.quantization) == \
        ("smollm2-135m-instruct", None, "pretrained", "q4")
    cfg = load_config(None, flags.overrides(parsed("--prompt", "a", "--max-tokens", "5"), {}))
    assert cfg.workload.prompts == ["a"] and cfg.sampling.max_tokens == 5
    cfg = load_config(None, flags.overrides(parsed("--backend", "onnxruntime"), {}))      # no config file
    assert cfg.backend.name == "onnxruntime" and cfg.backend.prefill is None


def test_chat_auto_uses_the_template_only_where_the_model_has_one():
    from twophase.cli import workload

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages):
            return f"<user>{messages[0]['content']}</user>"

    cfg = load_config({"workload": {"prompts": ["hi"]}})
    assert workload.build(cfg, Tok(), 512)[0][0] == "<user>hi</user>"
    Tok.chat_template = None
    assert workload.build(cfg, Tok(), 512)[0][0] == "hi"
    cfg = load_config({"workload": {"prompts": ["hi"], "chat": False}})
    Tok.chat_template = "x"
    assert workload.build(cfg, Tok(), 512)[0][0] == "hi"


def test_a_templated_prompt_says_so_and_raw_sends_it_as_written(caplog):
    import argparse
    import logging

    from twophase.cli import flags, workload

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages):
            return f"<user>{messages[0]['content']}</user>"

    p = argparse.ArgumentParser()
    flags.add(p)
    for argv, want, said in ((["--prompt", "The capital of France is"], "<user>", True),
                             (["--prompt", "The capital of France is", "--raw"], "The", False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, "twophase"):
            cfg = load_config(None, flags.overrides(p.parse_args(argv), {}))
            assert workload.build(cfg, Tok(), 512)[0][0].startswith(want)
        assert ("chat template" in caplog.text and "--raw" in caplog.text) == said, caplog.text


def test_cache_lists_kinds_and_clears_only_what_is_named(tmp_path):
    from twophase.cli import cache_contents as cc

    (tmp_path / "onnx" / "m-1").mkdir(parents=True)
    (tmp_path / "onnx" / "m-1" / "model.onnx").write_bytes(b"x" * 1000)
    (tmp_path / "onnx" / "m-2.tmp").mkdir()
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "a.gguf").write_bytes(b"y" * 10)
    (tmp_path / "calibration.json").write_text("{}")
    (tmp_path / "mine").mkdir()
    got = {(e.kind, e.name): (e.bytes, e.complete) for e in cc.entries(tmp_path)}
    assert got == {("onnx", "m-1"): (1000, True), ("onnx", "m-2.tmp"): (0, False),
                   ("gguf", "a.gguf"): (10, True), ("calibration.json", ""): (2, True)}
    assert cc.unknown(tmp_path) == ["mine"]
    assert cc.clear(tmp_path, ["onnx", "calibration.json"]) == 1002
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf", "mine"]
    assert cc.human(1536) == "1.5 KB" and cc.human(3 << 30) == "3.0 GB"


def test_cli_backends_lists_torch_builtin(cli):
    r, _ = cli("backends")
    assert r.returncode == 0, str(r)
    assert "Traceback" not in r.stderr
    rows = [line for line in r.stdout.splitlines() if "torch" in line and "built-in" in line]
    assert rows, str(r)
    assert "yes" in rows[0]          # the torch backend runs on the CPU here
    native = [line for line in r.stdout.splitlines() if line.startswith("│ native")]
    assert native and "q4, gguf" in native[0] and "int8" in native[0] and "fp8" not in native[0], str(r)


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "examples").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_example_config_passes_the_checks(path):
    from twophase.config import load_config

    load_config(path)


def test_a_context_the_pool_cannot_hold_is_refused_or_lowered(monkeypatch):
    from twophase.models import loader

    llm = LLM.from_config({"model": dict(TINY), "cache": {"num_blocks": 8}})        # 128 tokens
    assert llm.max_model_len == 128
    out, = llm.generate([[5] * 200], SamplingParams(max_tokens=2))
    assert out.finish_reason == "rejected" and "context of 128 tokens" in out.error

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the config was refused")

    monkeypatch.setattr(loader, "model_spec", no_weights)
    with pytest.raises(ConfigError) as info:
        LLM.from_config({"model": {**TINY, "max_model_len": 512}, "cache": {"num_blocks": 8}})
    assert info.value.key == "model.max_model_len"
    assert "holds 128" in str(info.value) and "set it to 128 at most" in str(info.value)


@pytest.mark.parametrize("model", ["/no/such/path", "./no-such.gguf", "no/such/deep/path"])
def test_a_missing_path_is_reported_alike_by_the_cli_and_the_api(model):
    """``--model`` that reads as a path is a path: the CLI and the API (``model.path``) say the
    same thing about a missing one (not "unknown model")."""
    from twophase.cli import flags

    run = subprocess.run([sys.executable, "-m", "twophase", "run", "--model", model], capture_output=True,
                         text=True)
    with pytest.raises(ConfigError) as info:
        LLM.from_config({"model": {"path": model}})
    api = info.value
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert f"config error: {api}" in run.stderr and "does not exist" in str(api)
    assert flags.model_keys(model)["path"] == model


def test_every_run_says_what_happens_to_its_prompts():
    """Template, none, and why: a base model without a chat template gets its prompts as written,
    and the run says so."""
    from types import SimpleNamespace

    from twophase.cli.workload import prompt_handling

    base, instruct = SimpleNamespace(chat_template=None), SimpleNamespace(chat_template="{{ x }}")
    assert prompt_handling("auto", base).startswith("sent as written: this model has no chat template")
    assert prompt_handling("auto", instruct).startswith("through the model's chat template")
    assert prompt_handling(False, instruct).startswith("sent as written (workload.chat = false, or --raw)")
    assert prompt_handling("auto", None).startswith("token ids only")
    run = subprocess.run([sys.executable, "-m", "twophase", "run", "--model", "tiny", "--prompt", "x",
                          "--max-tokens", "1"], capture_output=True, text=True)
    assert run.returncode == 0 and "prompts: " in run.stderr


def test_lora_flags_join_the_configs_adapters():
    import argparse

    from twophase.cli import flags

    p = argparse.ArgumentParser()
    flags.add(p)
    data = {"lora": [{"name": "sql", "path": "adapters/sql"}]}
    cfg = load_config(data, flags.overrides(p.parse_args(["--lora", "chat=/a/chat", "--lora", "x = y"]), data))
    assert [(a.name, a.path) for a in cfg.lora] == [("sql", "adapters/sql"), ("chat", "/a/chat"), ("x", "y")]
    with pytest.raises(SystemExit):
        p.parse_args(["--lora", "no-path"])


@pytest.mark.parametrize("flags, says", [
    ({"avx2", "fma", "f16c"}, "AVX2 int8 dots"),
    ({"avx2", "avx512f", "avx512_vnni"}, "AVX-512 VNNI int8 dots"),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}, "on AMX bf16 tiles"),
])
def test_the_native_backend_says_what_it_computes_with_on_this_cpu(monkeypatch, flags, says):
    """What ``twophase backends`` prints beside "yes", from the CPU's flags alone."""
    import twophase.backends.native as native

    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    got = native.NativeBackend.engines_here("cpu")
    assert got is not None and says in got and ("AMX" in got) == ("amx_tile" in flags)
