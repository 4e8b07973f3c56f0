"""``model.name = "org/repo"`` or ``"org/repo:Q4_K_M"``: a Hugging Face repository, as vLLM
and llama.cpp users name models, resolved through ``huggingface_hub``.

The user's HF cache answers first (``HF_HOME`` / ``HF_HUB_CACHE``); a download happens only where
the cache lacks the files and ``HF_HUB_OFFLINE`` is not set. A repository of safetensors gives
its folder; a GGUF repository gives the one ``.gguf`` file whose name carries the tag (a quant
tag, as llama.cpp's ``-hf`` takes it), or its only ``.gguf`` without a tag.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from twophase.errors import ModelError

log = logging.getLogger(__name__)

# what a safetensors repository needs here; never its other formats (pytorch_model.bin, onnx/)
FOLDER_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]
NAME = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?")


def is_repo_name(name: str) -> bool:
    return bool(NAME.fullmatch(name))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(name: str, config_only: bool = False) -> Path:
    """A local HF folder or ``.gguf`` file for ``org/repo[:TAG]``; ``config_only``: of a
    safetensors repository only its ``config.json`` (what the planner reads), not its weights."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, _, tag = name.partition(":")
    try:
        return _resolve(repo, tag, config_only)
    except LocalEntryNotFoundError:
        raise ModelError(f"{repo} is not in the Hugging Face cache and HF_HUB_OFFLINE is set (or the hub "
                         f"cannot be reached); download it once, or set model.path to a local folder") from None
    except GatedRepoError:
        raise ModelError(f"{repo} is gated: accept its licence on huggingface.co and log in "
                         f"(`hf auth login`), or set model.path") from None
    except RepositoryNotFoundError:
        raise ModelError(f"no Hugging Face repository {repo!r} (or it is private)") from None
    except HfHubHTTPError as exc:
        raise ModelError(f"{repo}: the hub answered {exc}") from None


def _resolve(repo: str, tag: str, config_only: bool) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    files, cached_only = _files(repo)
    ggufs = [f for f in files if f.endswith(".gguf") and not Path(f).name.startswith("mmproj")]
    shards = [f for f in ggufs if re.search(r"-\d{5}-of-\d{5}\.gguf$", f)]
    ggufs = [f for f in ggufs if f not in shards]
    if not tag and "config.json" in files and any(f.endswith(".safetensors") for f in files):
        patterns = ["config.json"] if config_only else FOLDER_FILES
        return Path(snapshot_download(repo, allow_patterns=patterns, ignore_patterns=["consolidated*"],
                                      local_files_only=cached_only))
    tags = ", ".join(sorted({_tag_of(f) for f in ggufs})) or "none"
    if tag:
        bounded = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9])", re.IGNORECASE)
        matches = [f for f in ggufs if bounded.search(Path(f).stem)]
        exact = [f for f in matches if _tag_of(f).lower() == tag.lower()]
        if not matches:
            split = " (split GGUF files are not supported yet)" if any(bounded.search(f) for f in shards) else ""
            raise ModelError(f"{repo} has no .gguf file tagged {tag!r}{split}; its tags: {tags}")
        chosen = (exact or matches)[0]
    elif len(ggufs) == 1:
        chosen = ggufs[0]
    elif ggufs:
        raise ModelError(f"{repo} holds several GGUF files: name one by its quant tag, e.g. "
                         f"{repo}:{_tag_of(ggufs[0])} (its tags: {tags})")
    elif cached_only:
        raise ModelError(f"{repo}: the Hugging Face cache holds {', '.join(files[:4]) or 'nothing'} of it, "
                         f"not its weights, and the hub is not used (HF_HUB_OFFLINE, or unreachable); "
                         f"download it once, or set model.path")
    else:
        raise ModelError(f"{repo} has neither config.json with *.safetensors nor a .gguf file")
    log.info("model %s is %s", f"{repo}:{tag}" if tag else repo, chosen)
    return Path(hf_hub_download(repo, chosen, local_files_only=cached_only))


def _files(repo: str) -> tuple[list[str], bool]:
    """The repository's files, and whether they are only the cache's: listed by the hub, or
    those in the cache when offline or when the hub cannot be reached."""
    from huggingface_hub import list_repo_files, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    if not offline():
        try:
            return list_repo_files(repo), False
        except HfHubHTTPError:
            raise
        except Exception as exc:          # no network: what the cache holds answers
            log.warning("the Hugging Face hub cannot be reached (%s); using the cache", type(exc).__name__)
    folder = Path(snapshot_download(repo, local_files_only=True))
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink()), True


def _tag_of(filename: str) -> str:
    """``Q4_K_M`` of ``Qwen3-0.6B-Q4_K_M.gguf``."""
    stem = Path(filename).stem
    m = re.search(r"[-.]((?:I?Q\d\w*)|F16|BF16|F32)$", stem, re.IGNORECASE)
    return m[1] if m else stem
