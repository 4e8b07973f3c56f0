"""The tiers under a real engine: a prefix the pool evicted comes back from host memory, a
restarted process finds it on disk, each with the tokens a cold run gives; another model or K/V
format never reads those blocks; damaged files cost the cache, not the request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from twophase import LLM, SamplingParams
from twophase.errors import ConfigError

A, B, C = list(range(5, 60)), list(range(100, 160)), list(range(200, 260))
P = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)


def _cfg(disk, **cache):
    return {"model": {"name": "tiny", "weights": "random"},
            "cache": {"num_blocks": 24, "block_size": 4, **cache,
                      "offload": {"host_gib": 0.01, "disk_dir": str(disk), "disk_gib": 0.01}}}


@pytest.fixture(scope="module")
def cold():
    """A's tokens computed from nothing, without tiers."""
    return LLM.from_config({"model": {"name": "tiny", "weights": "random"},
                            "cache": {"num_blocks": 24, "block_size": 4}}).generate([A], P)[0]


def _evict(llm):
    llm.generate([B], P)
    llm.generate([C], P)                   # 24 blocks: A's are gone from the pool now


def test_an_evicted_prefix_comes_back_from_host_memory(tmp_path, cold):
    llm = LLM.from_config(_cfg(tmp_path))
    first = llm.generate([A], P)[0]
    _evict(llm)
    again = llm.generate([A], P)[0]
    assert again.metrics["num_cached_tokens"] == 52 and llm.engine.kv.restored["host"] == 13
    assert first.token_ids == again.token_ids == cold.token_ids
    assert [lp[t] for t, lp in zip(again.token_ids, again.logprobs)] == \
        pytest.approx([lp[t] for t, lp in zip(cold.token_ids, cold.logprobs)], abs=1e-5)
    assert llm.report([again])["kv_tiers"]["host_hits"] == 13


RESTARTED = """
import json, sys
from twophase import LLM, SamplingParams
llm = LLM.from_config(json.loads(sys.argv[1]))
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(max_tokens=6, ignore_eos=True))[0]
print(json.dumps({"cached": out.metrics["num_cached_tokens"], "tokens": out.token_ids,
                  "restored": llm.engine.kv.restored}))
"""


def _restarted(cfg, prompt) -> dict:
    run = subprocess.run([sys.executable, "-c", RESTARTED, json.dumps(cfg), json.dumps(prompt)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_restarted_process_finds_the_prefix_on_disk(tmp_path, cold):
    llm = LLM.from_config(_cfg(tmp_path))
    llm.generate([A], P)
    _evict(llm)
    llm.close()                            # what host memory holds goes to disk
    got = _restarted(_cfg(tmp_path), A)
    assert got["cached"] == 52 and got["restored"]["disk"] == 13 and got["tokens"] == cold.token_ids


def test_another_model_or_kv_format_finds_nothing_and_the_cli_clears_it(tmp_path, capsys):
    llm = LLM.from_config(_cfg(tmp_path))
    llm.generate([A], P)
    llm.close()
    for cfg in ({**_cfg(tmp_path), "model": {"name": "tiny", "weights": "random", "seed": 1}},
                _cfg(tmp_path, dtype="float16")):
        other = LLM.from_config(cfg)
        assert other.generate([A], P)[0].metrics["num_cached_tokens"] == 0
        assert other.engine.tier_stats()["disk_hits"] == 0
    from twophase.cli.main import main

    assert main(["cache", "--kv-dir", str(tmp_path)]) == 0
    assert "fingerprint" in capsys.readouterr().out
    assert main(["cache", "clear", "--kv-dir", str(tmp_path)]) == 0
    assert "removed 15 K/V blocks" in capsys.readouterr().out and not list(tmp_path.rglob("*.kv"))   # 61 tokens


def test_damaged_files_cost_the_cache_not_the_request(tmp_path, cold):
    llm = LLM.from_config(_cfg(tmp_path))
    llm.generate([A], P)
    _evict(llm)
    llm.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for f in files:                                 # flip a byte near the end of each block
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    llm = LLM.from_config(_cfg(tmp_path))
    out = llm.generate([A], P)[0]
    assert out.metrics["num_cached_tokens"] == 0 and out.token_ids == cold.token_ids
    assert llm.report([out])["kv_tiers"]["disk_corrupt"] >= 1


def test_what_the_tiers_cannot_hold_yet_is_refused_by_name(tmp_path):
    off = {"host_gib": 0.01}
    with pytest.raises(ConfigError, match="cache.offload: .*prefix_caching"):
        LLM.from_config({"model": {"name": "tiny", "weights": "random"},
                         "cache": {"num_blocks": 24, "prefix_caching": False, "offload": off}})
    with pytest.raises(ConfigError, match="cache.offload.disk_gib: needs disk_dir"):
        LLM.from_config({"model": {"name": "tiny", "weights": "random"},
                         "cache": {"offload": {"disk_gib": 1}}})


def test_metrics_show_the_tiers(tmp_path):
    pytest.importorskip("uvicorn")
    import httpx
    from helpers.server import serving

    llm = LLM.from_config(_cfg(tmp_path))
    with serving(llm) as (url, app):
        for prompt in (A, B, C, A):
            r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
        text = httpx.get(url + "/metrics").text
    assert 'twophase_kv_tier{counter="restored_blocks",tier="host"} 13.0' in text
    assert "twophase_kv_tier_restore_seconds" in text


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_every_kv_format_round_trips_through_the_tiers(tmp_path, dtype):
    """int8 rows are runs of 32 values: a shape with heads of 64."""
    model = {"name": "smollm2-135m", "weights": "random", "num_layers": 2}
    want = LLM.from_config({"model": model, "cache": {"num_blocks": 24, "block_size": 4, "dtype": dtype}}
                           ).generate([A], P)[0]
    llm = LLM.from_config({**_cfg(tmp_path, dtype=dtype), "model": model})
    llm.generate([A], P)
    _evict(llm)
    again = llm.generate([A], P)[0]
    assert again.metrics["num_cached_tokens"] == 52 and llm.engine.kv.restored["host"] == 13
    assert again.token_ids == want.token_ids


def test_a_pool_in_groups_round_trips_through_the_tiers(tmp_path):
    """Gemma 3's sliding and full layers: a block a group, each kept and brought back; of the
    three sliding groups' 13 blocks only the 6 the hit reads (its end's 24-token window), so
    the blocks before it do not take the room the hit's blocks need."""
    pytest.importorskip("transformers")
    from helpers.hf_models import tiny_hf_model

    tiny_hf_model("gemma3", tmp_path / "gemma3")
    model = {"path": str(tmp_path / "gemma3")}
    want = LLM.from_config({"model": model, "cache": {"num_blocks": 72, "block_size": 4}}).generate([A], P)[0]
    llm = LLM.from_config({**_cfg(tmp_path / "disk", num_blocks=72), "model": model})
    assert llm.engine.kv.num_groups > 1
    llm.generate([A], P)
    _evict(llm)
    again = llm.generate([A], P)[0]
    assert again.metrics["num_cached_tokens"] == 52 and llm.engine.kv.restored["host"] == 13 + 3 * 6
    assert again.token_ids == want.token_ids


def test_blocks_still_in_the_pool_at_close_survive_a_restart(tmp_path, cold):
    llm = LLM.from_config(_cfg(tmp_path))
    llm.generate([A], P)                   # never evicted: in the pool when the engine closes
    llm.close()
    got = _restarted(_cfg(tmp_path), A)
    assert got["cached"] == 52 and got["tokens"] == cold.token_ids


def test_a_hybrid_models_snapshots_go_down_and_come_back(tmp_path):
    """Qwen3.5's state layers: a prefix hit restores the state saved at a boundary; evicted,
    the snapshot goes to the tiers with the blocks, and both come back."""
    pytest.importorskip("transformers")
    from helpers.hf_models import tiny_hf_model

    tiny_hf_model("qwen3_5", tmp_path / "q")
    model = {"path": str(tmp_path / "q")}
    cache = {"num_blocks": 40, "block_size": 4, "state_snapshot_every": 16, "state_snapshots": 2}
    want = LLM.from_config({"model": model, "cache": cache}).generate([A], P)[0]
    llm = LLM.from_config({"model": model, "cache": {**cache, "offload": {"host_gib": 0.01}},
                           "scheduler": {"max_num_seqs": 2}})
    llm.generate([A], P)
    _evict(llm)
    again = llm.generate([A], P)[0]
    assert again.metrics["num_cached_tokens"] == 48
    assert llm.engine.kv.restored["host"] > 0      # the snapshot at 48 (the 2 rows went to B and C) and blocks
    assert again.token_ids == want.token_ids
