"""The plugin contract's version: a plugin written for version 1 (``dict(model.arch)``) still
runs, through a deprecated view, and warns in a way Python shows by default; one that declares no
version is taken as version 1; one written for a version this twophase does not know is refused
when it is discovered, naming both versions, and ``twophase backends`` shows that as the reason it
cannot run; the conformance kit checks the declaration; the example plugin and the built-in
backends declare the current version."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from twophase import LLM, SamplingParams
from twophase.backends.registry import Registry
from twophase.config import load_config
from twophase.contract import CONTRACT_VERSION, V1_ARCH_KEYS, ArchV1, BackendUnavailable
from twophase.models.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[2]
KIT = ["-m", "pytest", "-p", "twophase.testing", "--pyargs", "twophase.testing", "-q",
       "-p", "no:cacheprovider", "--skip-default-model"]
TINY = {"model": {"name": "tiny", "weights": "random"}, "cache": {"num_blocks": 64}}
PROMPTS = [[5, 6, 7, 8], list(range(20, 45))]

# a plugin written from the first release's documentation: the architecture was a mapping of
# Llama config keys, and its own model is built from them (here: checked against them, then the
# torch backend's, so its tokens can be compared)
V1_BACKEND = """
    from twophase.backends.hookspecs import hookimpl
    from twophase.backends.torch_eager import TorchBackend

    class Old(TorchBackend):
        name = "old"
        {declaration}

        def load(self, model, cfg):
            arch = dict(model.arch)
            layers = arch["num_layers"]
            width = arch["hidden_size"] // arch["num_heads"]
            assert width == arch["head_dim"] and arch["intermediate_size"] > 0, arch
            assert not arch["attention_bias"] and arch.get("rope_scaling") is None, arch
            self.read = (layers, arch["rope_theta"], sorted(arch))
            super().load(model, cfg)

    @hookimpl
    def twophase_backends():
        return [Old]
    """

NEWER_BACKEND = """
    from twophase.backends.hookspecs import hookimpl
    from twophase.backends.torch_eager import TorchBackend

    class Newer(TorchBackend):
        name = "newer"
        contract_version = {version}

        @classmethod
        def check_available(cls, device="cpu"):
            raise RuntimeError("a refused plugin's code ran")

        def load(self, model, cfg):
            raise RuntimeError("a refused plugin's code ran")

    @hookimpl
    def twophase_backends():
        return [Newer]
    """


def _fake_dist(site: Path, dist: str, module: str, source: str) -> Path:
    """An installed distribution (a dist-info with an entry point) and its module, on a path:
    what ``pip install`` leaves, as in test_plugins."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[twophase.backends]\n{module} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Installs fake plugin distributions for this test only (a fresh module name each test,
    so a module another test imported is never reused)."""
    site = tmp_path / "site"
    made = []

    def install(dist: str, source: str) -> str:
        module = f"{dist.replace('-', '_')}_{len(made)}_{tmp_path.name}".replace("-", "_")
        _fake_dist(site, dist, module, source)
        made.append(module)
        return module

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("TWOPHASE_PLUGINS", raising=False)
    yield install
    for m in made:
        sys.modules.pop(m, None)


def _tokens(registry: Registry, backend: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(load_config({**TINY, "backend": {"name": backend}}), registry)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("declaration", ["contract_version = 1", "pass  # declares none"])
def test_a_version_1_plugin_using_dict_arch_still_runs_and_warns(installed, declaration):
    installed("old-plugin", V1_BACKEND.format(declaration=declaration))
    with pytest.warns(FutureWarning, match="contract version 1.*Contract versions") as seen:
        reg = Registry()
    assert "old" in reg.backends and reg.backends["old"].refused is None, reg.failures
    assert any("old-plugin" in str(w.message) for w in seen)
    with pytest.warns(DeprecationWarning, match=r"model\.arch as a mapping.*contract_version = 2"):
        llm, got = _tokens(reg, "old")
    layers, theta, keys = llm.prefill_backend.read
    assert (layers, theta, keys) == (2, 10000.0, sorted(V1_ARCH_KEYS))
    assert got == _tokens(reg, "torch")[1], "the version-1 plugin computed another model"


@pytest.mark.parametrize("version", [CONTRACT_VERSION + 1, '"2"'])
def test_a_plugin_for_a_version_this_twophase_does_not_know_is_refused_at_discovery(installed, version):
    installed("newer-plugin", NEWER_BACKEND.format(version=version))
    reg = Registry()
    info = reg.backends["newer"]                 # still listed, under its name, with the reason
    why = info.refused
    assert why and "Contract versions" in why and "docs/plugins.md" in why
    if isinstance(version, int):
        assert f"version {version}, newer than this twophase's ({CONTRACT_VERSION})" in why
        assert "newer-plugin" in why
    else:
        assert "'2'" in why and f"its own is {CONTRACT_VERSION}" in why
    assert reg.availability("newer", "cpu") == why == reg.availability("newer", "cuda")
    # a config naming it stops with the reason, and none of the plugin's code runs
    with pytest.raises(BackendUnavailable, match="plugin contract version|contract_version"):
        LLM(load_config({**TINY, "backend": {"name": "newer"}}), reg)
    with pytest.raises(BackendUnavailable):
        info.cls().capabilities()


def test_twophase_backends_shows_the_refusal_as_why_the_plugin_cannot_run(tmp_path):
    site = _fake_dist(tmp_path / "site", "newer-plugin", "newer_plugin",
                      NEWER_BACKEND.format(version=CONTRACT_VERSION + 1))
    out = subprocess.run([sys.executable, "-m", "twophase", "backends"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
                                           "COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("│ newer "))
    assert "newer-plugin" in row
    cpu, cuda = row.split("│")[5:7]
    for cell in (cpu, cuda):
        assert cell.strip().startswith(f"no: newer is written for plugin contract version "
                                       f"{CONTRACT_VERSION + 1}, newer than this twophase's ({CONTRACT_VERSION})")
    assert "torch" in out.stdout, "the other backends still load"


def test_a_version_1_plugin_warns_its_user_outside_pytest(tmp_path):
    """Python hides a DeprecationWarning outside __main__; the user of an old plugin sees this
    one with no -W flag: the plugin, both versions, where the migration is described."""
    site = _fake_dist(tmp_path / "site", "old-plugin", "old_plugin",
                      V1_BACKEND.format(declaration="contract_version = 1"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-m", "twophase", "backends"], capture_output=True, text=True,
                         timeout=300, env={**env, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert out.returncode == 0, out.stderr
    assert "FutureWarning: backend 'old' from old-plugin is written for twophase's plugin contract " \
           f"version 1, deprecated; this twophase's is {CONTRACT_VERSION}: see docs/plugins.md, " \
           "section 'Contract versions'" in out.stderr, out.stderr


def test_the_v1_view_reads_as_the_first_releases_mapping():
    arch = SHAPES["tiny"]
    view = ArchV1.of(arch)
    assert view.num_layers == arch.num_layers and view.layers == arch.layers      # still typed
    with pytest.warns(DeprecationWarning, match="contract version 1"):
        as_dict = dict(view)
    assert tuple(as_dict) == V1_ARCH_KEYS
    assert as_dict["num_layers"] == arch.num_layers
    assert as_dict["intermediate_size"] == arch.intermediate_size
    assert as_dict["rope_theta"] == arch.rope_theta
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert view["head_dim"] == arch.head_dim       # warned once a view, not per key
    with pytest.raises(KeyError):
        view["layers"]                                 # version 2's own fields are no v1 keys


def _kit(site: Path, backend: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *KIT, "--backend", backend, "-k", "contract_version", "-rs"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})


def test_the_kit_checks_the_declared_contract_version(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "newer-plugin", "newer_plugin", NEWER_BACKEND.format(version=CONTRACT_VERSION + 1))
    _fake_dist(site, "undeclared-plugin", "undeclared_plugin",
               V1_BACKEND.format(declaration="pass").replace('"old"', '"undeclared"'))
    _fake_dist(site, "old-plugin", "old_plugin", V1_BACKEND.format(declaration="contract_version = 1"))
    newer = _kit(site, "newer", tmp_path)
    assert newer.returncode == 1 and "1 failed" in newer.stdout, newer.stdout[-2000:]
    assert f"newer than this twophase's ({CONTRACT_VERSION})" in newer.stdout
    undeclared = _kit(site, "undeclared", tmp_path)
    assert undeclared.returncode == 1 and "declares no plugin contract version" in undeclared.stdout, \
        undeclared.stdout[-2000:]
    old = _kit(site, "old", tmp_path)
    assert old.returncode == 0 and "1 passed" in old.stdout, old.stdout[-2000:]
    assert "DeprecationWarning" in old.stdout


def test_the_example_plugin_and_the_builtin_backends_declare_the_current_version(monkeypatch):
    monkeypatch.setenv("TWOPHASE_PLUGINS", "none-but-the-built-in-ones")
    monkeypatch.syspath_prepend(str(ROOT / "plugins" / "twophase-numpy" / "src"))
    from twophase_numpy.backend import NumpyBackend

    from twophase.backends.registry import contract_refusal, declared_version

    assert declared_version(NumpyBackend) == CONTRACT_VERSION
    assert contract_refusal(NumpyBackend, "twophase-numpy") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)       # no built-in is deprecated
        reg = Registry()
    for name, info in reg.backends.items():
        if info.source == "built-in":
            assert declared_version(info.cls) == CONTRACT_VERSION, name
            assert info.refused is None and info.cls.__module__.startswith("twophase."), name


def test_a_plugin_class_declares_for_itself_not_through_a_builtin_base():
    from twophase.backends.registry import declared_version
    from twophase.backends.torch_eager import TorchBackend

    class Sub(TorchBackend):                    # a plugin subclassing a built-in, declaring none
        name = "sub"

    class Base(TorchBackend):                   # a plugin's own base declares for its subclasses
        name = "base"
        contract_version = 2

    class Leaf(Base):
        name = "leaf"

    assert declared_version(TorchBackend) == CONTRACT_VERSION
    assert declared_version(Sub) is None and declared_version(Leaf) == 2
