"""What is checked before a cluster serves anything, and the router's memory of prefixes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from twophase.cluster.affinity import PrefixMap, prefix_keys
from twophase.cluster.board import labelled
from twophase.cluster.launch import Cluster, check_layouts
from twophase.core.proposer import KVLayout
from twophase.errors import ConfigError


def test_workers_with_different_kv_layouts_are_refused_by_name():
    a = KVLayout(30, 3, 64, 16, "float32")
    check_layouts({"prefill-0": {"layout": a}, "decode-0": {"layout": a}})
    with pytest.raises(ConfigError, match=r"prefill-0 and decode-0 differ \(block_size 16 vs 32, dtype"):
        check_layouts({"prefill-0": {"layout": a},
                       "decode-0": {"layout": KVLayout(30, 3, 64, 32, "bfloat16")}})


def test_prefix_keys_cover_whole_blocks_and_the_deepest_known_prefix_wins():
    ids = list(range(100))
    assert len(prefix_keys(ids, 16, 8)) == 6                 # 99 tokens before the last: 6 blocks
    assert prefix_keys(ids[:16], 16, 8) == []                # the last token never counts
    m = PrefixMap()
    m.record(prefix_keys(ids[:40], 16, 8), "r1")             # 2 blocks went to r1
    m.record(prefix_keys(ids, 16, 8), "r2")                  # all 6 to r2 (the first 2 now too)
    other = ids[:33] + [999] * 40
    assert m.best(prefix_keys(other, 16, 8), {"r1", "r2"}) == "r2"
    assert m.best(prefix_keys(other, 16, 8), {"r1"}) is None   # r2 gone: nobody holds it
    m.forget("r2")
    assert m.best(prefix_keys(ids, 16, 8), {"r1", "r2"}) is None


def test_prefill_workers_are_picked_by_prefix_unless_busy_and_decode_workers_by_load():
    from twophase.config import load_config

    cfg = load_config({"cluster": {"prefill_workers": 3, "decode_workers": 2, "route_imbalance": 2}})
    c = Cluster(cfg, "ns", board=None, workers={"prefill": ["p0", "p1", "p2"], "decode": ["d0", "d1"]})
    shared = list(range(3, 100))
    c.busy.update({"p0": 1, "p1": 1})
    first = c.pick("prefill", shared + [1, 2])
    assert first == "p2"                                     # unknown prefix: the least busy
    c.busy.update({"p2": 3})                                 # p2 3, the others 1: within 2
    assert c.pick("prefill", shared + [7, 8, 9]) == "p2"     # the same 6 blocks: where they went
    assert c.pick("prefill", [5] * 99) in ("p0", "p1")       # another prefix: by load
    c.busy.update({"p2": 1})                                 # p2 4: past the imbalance
    assert c.pick("prefill", shared) in ("p0", "p1")
    c.busy.update({"d0": 1})
    assert c.pick("decode") == "d1"                          # no prompt given: by load alone


def test_the_workers_metrics_are_labelled_by_worker():
    text = labelled({"w0": "# HELP x_total a\n# TYPE x_total counter\nx_total 3.0\n",
                     "w1": "# HELP x_total a\n# TYPE x_total counter\nx_total{k=\"v\"} 4.0\n"})
    assert 'x_total{replica="w0"} 3.0' in text and 'x_total{k="v",replica="w1"} 4.0' in text
    assert text.count("# TYPE x counter") == 1           # one family, as Prometheus names it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_a_prefill_workers_priority_is_lowered_on_its_thread_and_the_ones_it_starts():
    """In a process of its own (niceness cannot be raised back): the engine's threads, started
    after, are lowered; threads that were there before (Ray's) are not."""
    code = """
import os, threading
from twophase.cluster.workers import lower_priority
before = threading.Thread(target=threading.Event().wait, daemon=True); before.start()
lower_priority(7)
after = threading.Thread(target=threading.Event().wait, daemon=True); after.start()
nice = lambda t: os.getpriority(os.PRIO_PROCESS, t.native_id)
print(nice(before), nice(threading.current_thread()), nice(after))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "7", "7"]
