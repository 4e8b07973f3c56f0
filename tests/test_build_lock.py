"""Two processes on one cache build an artefact once: the second waits for the first's lock and
finds its build fresh (a server and a benchmark, or two test workers, started together)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_two_processes_asking_for_one_artefact_build_it_once(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from twophase.exporters.cache import build_cached

        def build(tmp):
            with open({str(tmp_path / "builds.log")!r}, "a") as log:
                log.write("built\\n")
            time.sleep(1.0)                    # long enough for the other process to arrive
            (tmp / "artefact.bin").write_bytes(b"x" * 10)

        build_cached(Path({str(tmp_path / "artefact")!r}), {{"model_id": "m", "v": 1}}, build)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert (tmp_path / "artefact" / "artefact.bin").read_bytes() == b"x" * 10
