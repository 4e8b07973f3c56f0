"""Third-party backends: the example plugin installs, is discovered, runs and uninstalls; broken
plugins are reported without breaking the others; the conformance kit passes every built-in
backend and the plugin, and fails a backend that writes K/V at the wrong slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "plugins" / "twophase-numpy"
KIT = ["-m", "pytest", "-p", "twophase.testing", "--pyargs", "twophase.testing", "-q",
       "-p", "no:cacheprovider"]


def _run(python, *args, env=None, cwd=None, timeout=900):
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A virtual environment that sees this one's packages (twophase, torch, setuptools) and
    gets the plugin installed with pip, as a user would. A ``.pth`` file, not
    ``--system-site-packages``: from inside a venv, that flag shows the *base* interpreter's
    packages, whose setuptools may predate ``bdist_wheel`` (a fresh machine's does)."""
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # an "import" line runs: addsitedir also reads the outer .pth files (an editable install)
    Path(site, "outer-env.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in sorted(outer)))
    assert _pip(python, "install", "--no-deps", "--no-build-isolation", str(PLUGIN)).returncode == 0
    return python


def _pip(python, *args):
    """This environment's pip (and its setuptools) acting on ``python``'s environment."""
    run = _run(sys.executable, "-m", "pip", "--python", str(python), "-q", *args)
    assert run.returncode == 0 or "show" in args, run.stderr
    return run


def test_plugin_is_discovered_runs_and_uninstalls(venv, tmp_path):
    listed = _run(venv, "-m", "twophase", "backends", env={"COLUMNS": "200"})
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if "numpy" in line)
    assert "twophase-numpy" in row and "yes" in row
    cfg = tmp_path / "numpy.toml"
    cfg.write_text('[model]\nname = "tiny"\nweights = "random"\n[backend]\nname = "numpy"\n'
                   '[workload.synthetic]\nnum_requests = 3\ninput_len = [4, 20]\noutput_len = [3, 6]\n')
    ran = _run(venv, "-m", "twophase", "run", str(cfg), "--quiet", env={"COLUMNS": "200"})
    assert ran.returncode == 0, ran.stderr
    assert "numpy" in ran.stdout + ran.stderr
    # TWOPHASE_PLUGINS limits third-party plugins; built-in backends always load
    only = _run(venv, "-m", "twophase", "backends", env={"COLUMNS": "200", "TWOPHASE_PLUGINS": "other"})
    assert "twophase-numpy" not in only.stdout and "torch" in only.stdout
    _pip(venv, "uninstall", "-y", "twophase-numpy")
    after = _run(venv, "-m", "twophase", "backends", env={"COLUMNS": "200"})
    assert "twophase-numpy" not in after.stdout and "torch" in after.stdout


def _fake_dist(site: Path, dist: str, module: str, source: str) -> None:
    """An installed distribution (a dist-info with an entry point) and its module, on a path."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[twophase.backends]\n{module} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))


def test_broken_plugins_are_reported_and_the_others_still_load(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "broken-import", "broken_import", "raise ImportError('needs libfoo.so')\n")
    _fake_dist(site, "dup-plugin", "dup_plugin", """
        from twophase.backends.hookspecs import hookimpl
        from twophase.backends.torch_eager import TorchBackend
        class Again(TorchBackend):
            name = "torch"
            def load(self, model, cfg):
                raise RuntimeError("the impostor ran")
        @hookimpl
        def twophase_backends():
            return [Again]
        """)
    _fake_dist(site, "bad-contract", "bad_contract", """
        from twophase.backends.hookspecs import hookimpl
        class NotABackend:
            name = "oops"
        @hookimpl
        def twophase_backends():
            return [NotABackend]
        """)
    _fake_dist(site, "returns-none", "returns_none", """
        from twophase.backends.hookspecs import hookimpl
        @hookimpl
        def twophase_backends():
            return [None]
        """)
    # PYTHONPATH comes first on sys.path: the impostor's entry point is found before the
    # built-in's, and the built-in must still win
    out = _run(sys.executable, "-m", "twophase", "backends",
               env={"PYTHONPATH": str(site), "COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "broken-import" in text and "ImportError: needs libfoo.so" in text
    assert "dup-plugin" in text and "'torch' belongs to a built-in backend" in text
    assert "bad-contract" in text and "not a twophase Backend" in text
    none_row = next(line for line in text.splitlines() if "returns-none" in line)
    assert "returns_none" in none_row and "None" in none_row.split("returns-none", 1)[1]
    assert "onnxruntime" in text and "built-in" in text
    torch_rows = [line for line in text.splitlines() if line.startswith("│ torch")]
    assert torch_rows and "built-in" in torch_rows[0]
    cfg = tmp_path / "torch.toml"
    cfg.write_text('[model]\nname = "tiny"\nweights = "random"\n[backend]\nname = "torch"\n'
                   '[workload.synthetic]\nnum_requests = 1\ninput_len = [4, 4]\noutput_len = [2, 2]\n')
    ran = _run(sys.executable, "-m", "twophase", "run", str(cfg), "--json", str(tmp_path / "r.json"),
               env={"PYTHONPATH": str(site), "COLUMNS": "200"})
    assert ran.returncode == 0, ran.stderr
    assert json.loads((tmp_path / "r.json").read_text())["outputs"], "the built-in torch backend ran"


def test_a_backend_hidden_by_twophase_plugins_is_named_in_the_error(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "hidden-plugin", "hidden_plugin", """
        from twophase.backends.hookspecs import hookimpl
        from twophase.backends.torch_eager import TorchBackend
        class Hidden(TorchBackend):
            name = "hidden"
        @hookimpl
        def twophase_backends():
            return [Hidden]
        """)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nname = "tiny"\nweights = "random"\n[backend]\nname = "hidden"\n')
    ran = _run(sys.executable, "-m", "twophase", "run", str(cfg),
               env={"PYTHONPATH": str(site), "TWOPHASE_PLUGINS": "other"})
    assert ran.returncode == 2
    assert "TWOPHASE_PLUGINS" in ran.stderr and "hidden_plugin (from hidden-plugin)" in ran.stderr


def _kit_runs(with_default_model: tuple[tuple[str, str], ...]):
    from twophase.backends.registry import Registry

    runs = [("torch", "{}", "none"), ("onnxruntime", "{}", "none"), ("iree", "{}", "none"),
            ("iree", '{"pool": "owned"}', "none"), ("onnxruntime", "{}", "q4")]
    if not Registry().availability("native", "cpu"):
        runs.append(("native", "{}", "q4"))
    return [(n, o, q, (n, o) in with_default_model) for n, o, q in runs]


@pytest.mark.slow
def test_conformance_kit_passes_the_builtin_backends(tmp_path):
    """From a directory outside the repository, as a plugin author would run it. The iree
    modules come from the cache the iree tests filled; tensorrt cannot run here and is skipped
    with its reason. iree runs twice: over the engine's pool, and keeping its own; the q4
    backends (int8 activations) in the kit's tolerance mode. The kit's default-model check runs
    in the exhaustive lane (on torch and iree); each backend has its own default-model test
    (test_default_model, test_onnxruntime, test_native, test_quant: CI time)."""
    _run_kit(tmp_path, [r for r in _kit_runs(with_default_model=()) if r[:3] not in VARIANTS])
    run = _run(sys.executable, *KIT, "--backend", "tensorrt", "-rs", cwd=tmp_path)
    assert run.returncode == 0 and "1 passed, 10 skipped" in run.stdout and "TensorRT" in run.stdout


# second settings of a backend the kit also runs plainly; each has its own tests beside its
# backend's (the owned pool in test_iree, q4 graphs in test_onnxruntime and test_quant)
VARIANTS = {("iree", '{"pool": "owned"}', "none"), ("onnxruntime", "{}", "q4")}


@pytest.mark.exhaustive
def test_conformance_kit_passes_the_builtin_backends_second_settings(tmp_path):
    _run_kit(tmp_path, [r for r in _kit_runs(with_default_model=()) if r[:3] in VARIANTS])


@pytest.mark.exhaustive        # compiles the default model's 30 layers for IREE
def test_conformance_kit_runs_the_default_model_on_iree(tmp_path):
    _run_kit(tmp_path, [("iree", "{}", "none", True)])


@pytest.mark.exhaustive
def test_conformance_kit_runs_the_default_model_on_torch(tmp_path):
    _run_kit(tmp_path, [("torch", "{}", "none", True)])


def _run_kit(tmp_path, runs) -> None:
    for name, options, quantization, full in runs:
        quality = [] if full else ["--skip-default-model"]
        run = _run(sys.executable, *KIT, "--backend", name, "--backend-options", options,
                   "--quantization", quantization, *quality, cwd=tmp_path)
        assert run.returncode == 0, f"{name} {options} {quantization}:\n{run.stdout[-3000:]}"
        skipped = len(quality) + (name != "torch")      # torch alone claims adapters
        expect = f"{11 - skipped} passed" + (f", {skipped} skipped" if skipped else "")
        assert expect in run.stdout, run.stdout[-500:]


@pytest.mark.parametrize("full", [
    False, pytest.param(True, marks=pytest.mark.exhaustive)], ids=["quick", "default-model"])
def test_conformance_kit_passes_the_numpy_plugin(venv, tmp_path, full):
    """As a plugin author runs it; the default lane without the kit's default-model check (the
    135M model in numpy: most of the run), the exhaustive lane with it."""
    if _pip(venv, "show", "twophase-numpy").returncode:            # uninstalled above
        _pip(venv, "install", "--no-deps", "--no-build-isolation", str(PLUGIN))
    run = _run(venv, *KIT, "--backend", "numpy", *([] if full else ["--skip-default-model"]), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:]
    assert ("10 passed, 1 skipped" if full else "9 passed, 2 skipped") in run.stdout   # it claims no adapters


def _kit_on_a_broken_torch(tmp_path, name: str, methods: str, only: str):
    """The kit, on the checks ``only`` selects, against torch with ``methods`` (its class body)
    broken in a plugin of its own."""
    site, module = tmp_path / "site", name.replace("-", "_")
    body = textwrap.indent(textwrap.dedent(methods).strip(), " " * 12)
    _fake_dist(site, name, module, f"""
        from twophase.backends.hookspecs import hookimpl
        from twophase.backends.torch_eager import TorchBackend
        class Broken(TorchBackend):
            name = {name!r}
{body}
        @hookimpl
        def twophase_backends():
            return [Broken]
        """)
    return _run(sys.executable, *KIT, "--backend", name, "--skip-default-model", "-k", only,
                env={"PYTHONPATH": str(site)}, cwd=tmp_path)


def test_conformance_kit_fails_a_backend_that_writes_kv_at_the_wrong_slots(tmp_path):
    run = _kit_on_a_broken_torch(tmp_path, "wrong-slots", """
        def prefill(self, batch):
            batch.slot_mapping = batch.slot_mapping + 1      # one slot off
            return super().prefill(batch)
        """, "fresh_prompts")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "K/V written at the wrong slots" in run.stdout


def test_conformance_kit_fails_a_backend_that_claims_adapters_and_ignores_them(tmp_path):
    run = _kit_on_a_broken_torch(tmp_path, "no-adapters", """
        def place_adapter(self, slot, adapter):
            pass                                  # claims them, applies none
        """, "adapters")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "logits differ from the torch reference" in run.stdout
