"""Backend discovery: pluggy over the ``twophase.backends`` entry-point group.

Built-in backends register through the same entry points as third-party ones, so there is one
discovery path. Entry points are loaded one by one (not with pluggy's
``load_setuptools_entrypoints``, which stops at the first plugin that fails to import), so one
broken plugin is reported and the others still load. ``TWOPHASE_PLUGINS`` (a comma list of entry
point names) limits which third-party plugins load; built-in ones always do. Built-in backends
load first and their names always win: a plugin that registers a backend named ``torch`` is
reported, never run in the built-in's place.

Each backend class declares the contract version it was written for (``contract_version``; a
plugin's class does not inherit a built-in's declaration: see ``declared_version``). One
this twophase does not know (newer, or not a version at all) is refused here: it stays listed
under its name, and ``check_available`` says why it cannot run, naming both versions. A
version-1 class, or one that declares none, runs through a subclass whose ``load`` gets
``model.arch`` as the deprecated ``ArchV1`` view, with a ``FutureWarning`` (Python shows it by
default, so a user who never runs pytest sees it too).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points

import pluggy

from twophase.backends import hookspecs
from twophase.contract import (
    CONTRACT_VERSION,
    MIGRATION,
    SUPPORTED_CONTRACT_VERSIONS,
    ArchV1,
    Backend,
    BackendConfig,
    BackendUnavailable,
    Capabilities,
    DecodeBatch,
    KVCache,
    KVCacheSpec,
    ModelSpec,
    PrefillBatch,
)
from twophase.errors import ConfigError

log = logging.getLogger(__name__)
GROUP = "twophase.backends"
BUILTIN_DIST = "twophase"


@dataclass
class BackendInfo:
    name: str
    source: str                    # "built-in" or the distribution that installed it
    cls: type[Backend] | None
    error: str | None = None       # why it failed to load (import error, contract violation)
    refused: str | None = None     # why it may not run: a contract version this twophase does not know


class Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, BackendInfo] = {}
        self.failures: list[BackendInfo] = []
        self.hidden: list[str] = []          # plugin entry points TWOPHASE_PLUGINS left out
        self._discover()

    def _discover(self) -> None:
        allowed = os.environ.get("TWOPHASE_PLUGINS")
        allowed_names = {n.strip() for n in allowed.split(",") if n.strip()} if allowed else None
        eps = sorted(entry_points(group=GROUP), key=lambda ep: _source(ep) != "built-in")
        for ep in eps:                              # built-in first: their names always win
            dist = ep.dist.name if ep.dist is not None else "?"
            source = _source(ep)
            if source != "built-in" and allowed_names is not None and ep.name not in allowed_names:
                self.hidden.append(f"{ep.name} (from {source})")
                continue
            try:
                plugin = ep.load()
                if self.pm.is_registered(plugin):
                    continue
                self.pm.register(plugin, name=f"{dist}:{ep.name}")
            except Exception as exc:  # a broken plugin must not break the others
                self.failures.append(BackendInfo(ep.name, source, None, f"{type(exc).__name__}: {exc}"))
                log.warning("backend plugin %s from %s failed to load: %s", ep.name, source, exc)
                continue
            hook = getattr(plugin, "twophase_backends", None)
            try:
                classes = hook() if hook is not None else []
            except Exception as exc:
                self.failures.append(BackendInfo(ep.name, source, None, f"{type(exc).__name__}: {exc}"))
                continue
            if not isinstance(classes, (list, tuple)):
                classes = [classes]
            for cls in classes:
                self._add(cls, source, ep.name)

    def _add(self, cls: object, source: str, entry_point: str) -> None:
        name = getattr(cls, "name", None)
        if not (isinstance(cls, type) and issubclass(cls, Backend)) or not isinstance(name, str):
            self.failures.append(BackendInfo(entry_point, source, None,
                                             f"its hook returned {cls!r}, not a twophase Backend "
                                             f"class with a name"))
            log.warning("backend plugin %s from %s returned %r, not a Backend class", entry_point,
                        source, cls)
            return
        if name in self.backends:
            first = self.backends[name].source
            why = (f"the name {name!r} belongs to a built-in backend; this plugin's is not used"
                   if first == "built-in" else f"duplicate backend name {name!r}, already "
                   f"provided by {first}")
            self.failures.append(BackendInfo(name, source, None, why))
            log.warning("backend %r from %s ignored: %s", name, source, why)
            return
        refused = contract_refusal(cls, source)
        if refused:
            log.warning("backend %r from %s refused: %s", name, source, refused)
            self.backends[name] = BackendInfo(name, source, _refused(cls, refused), refused=refused)
            return
        declared = declared_version(cls)
        version = declared if isinstance(declared, int) else 1
        if version < CONTRACT_VERSION:     # FutureWarning: shown by default, to whoever runs the plugin
            warnings.warn(f"backend {name!r} from {source} is written for twophase's plugin contract "
                          f"version {declared or '1 (it declares none)'}, deprecated; "
                          f"this twophase's is {CONTRACT_VERSION}: see {MIGRATION}",
                          FutureWarning, stacklevel=2)
        if version == 1:
            cls = _v1(cls)
        self.backends[name] = BackendInfo(name, source, cls)

    def get(self, name: str, key: str = "backend.name") -> type[Backend]:
        info = self.backends.get(name)
        if info is None or info.cls is None:
            allowed = ", ".join(sorted(self.backends)) or "none installed"
            hidden = (f"; TWOPHASE_PLUGINS={os.environ.get('TWOPHASE_PLUGINS')!r} leaves out the "
                      f"plugins {', '.join(self.hidden)}" if self.hidden else "")
            raise ConfigError(key, f"unknown backend {name!r}; installed backends: {allowed}{hidden}")
        return info.cls

    def availability(self, name: str, device: str = "cpu") -> str | None:
        """None if the backend can run on ``device`` here, else the reason it cannot."""
        try:
            self.get(name).check_available(device)
        except BackendUnavailable as exc:
            return str(exc)
        return None


def declared_version(cls: type) -> object:
    """The contract version ``cls`` declares (``contract_version``), from its own definition or
    a base's; None: none. A plugin's class does not inherit the declaration of twophase's own
    classes (it subclasses ``TorchBackend``): the version is what its author wrote it for."""
    ours = cls.__module__.partition(".")[0] == "twophase"
    for c in cls.__mro__:
        if "contract_version" in vars(c) and (ours or c.__module__.partition(".")[0] != "twophase"):
            return vars(c)["contract_version"]
    return None


def contract_refusal(cls: type[Backend], source: str) -> str | None:
    """Why ``cls`` may not run under this twophase's contract, or None: it declares a version
    this twophase does not know (a newer one, or not an integer)."""
    declared = declared_version(cls)
    if declared is None or (type(declared) is int and declared in SUPPORTED_CONTRACT_VERSIONS):
        return None
    known = ", ".join(map(str, SUPPORTED_CONTRACT_VERSIONS))
    what = (f"plugin contract version {declared}, newer than this twophase's ({CONTRACT_VERSION}): "
            f"upgrade twophase, or install a release of {source} for version {CONTRACT_VERSION}"
            if type(declared) is int and declared > CONTRACT_VERSION else
            f"contract_version = {declared!r}, which is not a plugin contract version this twophase "
            f"knows ({known}; its own is {CONTRACT_VERSION})")
    return f"{cls.name} is written for {what}; see {MIGRATION}"


def _v1(cls: type[Backend]) -> type[Backend]:
    """``cls`` with ``load`` given ``model.arch`` as version 1's view too (``ArchV1``)."""
    load = cls.load

    def load_v1(self, model: ModelSpec, cfg: BackendConfig) -> None:
        load(self, dataclasses.replace(model, arch=ArchV1.of(model.arch)), cfg)

    return type(cls)(cls.__name__, (cls,), {"load": load_v1, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def _refused(cls: type[Backend], why: str) -> type[Backend]:
    """A stand-in for a refused class: listed under its name, it runs nothing and says why."""

    class Refused(Backend):
        name = cls.name
        quantizations = ()          # it runs none

        @classmethod
        def check_available(cls, device: str = "cpu") -> None:
            raise BackendUnavailable(why)

        def capabilities(self) -> Capabilities:
            raise BackendUnavailable(why)

        def load(self, model: ModelSpec, cfg: BackendConfig) -> None:
            raise BackendUnavailable(why)

        def kv_cache_spec(self) -> KVCacheSpec:
            raise BackendUnavailable(why)

        def bind_kv_cache(self, kv: KVCache) -> None:
            raise BackendUnavailable(why)

        def prefill(self, batch: PrefillBatch):
            raise BackendUnavailable(why)

        def decode(self, batch: DecodeBatch):
            raise BackendUnavailable(why)

    Refused.__qualname__ = Refused.__name__ = f"Refused{cls.__name__}"
    return Refused


def _source(ep) -> str:
    """``"built-in"`` for this package's own entry points, else the distribution's name."""
    dist = ep.dist.name if ep.dist is not None else "?"
    return "built-in" if dist == BUILTIN_DIST else dist
