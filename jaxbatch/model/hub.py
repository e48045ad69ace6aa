"""Models by name from the Hugging Face Hub, resolved to a local path the loader reads.

  * `OWNER/NAME` of a safetensors repository: its config, tokenizer files and weights
    (as `vllm serve OWNER/NAME`);
  * `OWNER/NAME:QUANT` of a GGUF repository: the file whose name carries that quant tag,
    matched case-insensitively (as `llama-server -hf OWNER/NAME:QUANT`); a GGUF repository
    named without a tag gets llama.cpp's default: Q4_K_M, else another Q4, else its first file.

Everything goes through huggingface_hub, so its cache (shared with transformers and vLLM:
$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), its token ($HF_TOKEN, or
`hf auth login`), $HF_ENDPOINT (a mirror), $HF_HUB_OFFLINE=1 (the cache only, never the network)
and its downloads (progress bars; an interrupted file resumes from its `.incomplete` part) work
as they do there. `download_dir` is huggingface_hub's `cache_dir` (vLLM's `--download-dir`);
`revision` a branch, tag or commit. When the Hub cannot be reached the cache answers, as
huggingface_hub's own downloads do.

A split GGUF (`...-00001-of-00003.gguf`) is refused before anything is downloaded: the loader
reads one file (merge the parts with llama.cpp's `llama-gguf-split --merge`).

Host only: no jax.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

log = logging.getLogger(__name__)

# OWNER/NAME[:QUANT]: the Hub's repo id characters; the tag as llama.cpp's -hf takes it
_HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.+-]+))?$")
# llama.cpp's split naming (llama_split_path): PREFIX-00001-of-00003.gguf
SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# a safetensors repository's files the loader reads (top level only: repos keep other formats
# such as onnx/ or original/ in folders), plus the sentence-transformers pooling config
_HF_FILES = re.compile(r"^(?:[^/]+\.(?:json|safetensors|jinja|txt|tiktoken)|tokenizer\.model"
                       r"|\d+_Pooling/config\.json)$")
# what llama.cpp's -hf picks without a tag (the Hub's "latest" manifest): these, in order
_DEFAULT_TAGS = ("Q4_K_M", "Q4")
_LISTED = 40  # file names an error lists before "... N more"


class HubError(RuntimeError):
    """A model name the Hub cannot give: no such repository, a gated one without access, no file
    for the quant tag, nothing in the cache while offline. The message says what the repository
    has, where that is known."""


@dataclasses.dataclass(frozen=True)
class HubName:
    repo_id: str
    tag: str | None  # the quant tag after ':' (a GGUF file), None: the repository's default


@dataclasses.dataclass(frozen=True)
class Selection:
    """The files of one repository that make the model: `files` are downloaded, `entry` (one of
    them, or '' for the snapshot folder) is what the loader is given."""

    kind: str  # "gguf" | "safetensors"
    files: tuple[str, ...]
    entry: str


def parse_name(model: str) -> HubName | None:
    """`OWNER/NAME[:QUANT]` -> HubName; None for anything else (an existing path, a built-in
    name, an absolute or deeper path)."""
    if os.path.exists(model):
        return None
    m = _HUB_NAME.match(model)
    if m is None:
        return None
    return HubName(m.group("repo"), m.group("tag"))


# ---------------------------------------------------------------------------------------------
# Which files (pure: the repository's file list in, the selection out)
# ---------------------------------------------------------------------------------------------
def select_files(repo_id: str, files: list[str], tag: str | None) -> Selection:
    """The files to download for `tag` (None: the repository's default) out of the repository's
    `files` (paths relative to its root); HubError when none fit, listing what it has."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and "mmproj" not in os.path.basename(f).lower())  # vision projectors
    weights = [f for f in files if "/" not in f and f.endswith(".safetensors")]
    has_hf = "config.json" in files and bool(weights)
    if tag is None and has_hf:
        return Selection("safetensors", tuple(sorted(f for f in files if _HF_FILES.match(f))),
                         "")
    if not ggufs:
        what = (f"a quant tag (:{tag}) picks one of a GGUF repository's files, and {repo_id} "
                f"has none; name it without the tag to load its safetensors weights"
                if tag is not None and has_hf else
                f"{repo_id} holds neither GGUF files nor config.json with .safetensors weights "
                f"(the formats jaxbatch reads)")
        raise HubError(f"{what}; it has: {_listing(files)}")
    groups = _gguf_groups(ggufs)
    if tag is not None:
        key = _best_match(groups, tag)
        if key is None:
            raise HubError(f"no GGUF file of {repo_id} matches the quant tag {tag!r} "
                           f"(matched case-insensitively in the file names); its GGUF files: "
                           f"{_listing(list(groups))}")
    else:
        key = next((k for t in _DEFAULT_TAGS if (k := _best_match(groups, t)) is not None),
                   sorted(groups)[0])
        log.info("%s: no quant tag given, picked %s (as llama.cpp's -hf default)", repo_id, key)
    parts = groups[key]
    if len(parts) > 1:
        raise HubError(f"{repo_id}'s {key} is a split GGUF in {len(parts)} parts "
                       f"({', '.join(parts)}); jaxbatch reads one GGUF file: merge the parts "
                       f"with llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf` and "
                       f"pass OUT.gguf, or pick another quant tag")
    return Selection("gguf", tuple(parts), parts[0])


def _gguf_groups(ggufs: list[str]) -> dict[str, list[str]]:
    """{model file, its split suffix removed: [its parts, in order]}; a split whose parts are not
    all in the repository is refused."""
    groups: dict[str, list[str]] = {}
    for f in ggufs:
        groups.setdefault(SPLIT_GGUF.sub(".gguf", f), []).append(f)
    for key, parts in groups.items():
        m = SPLIT_GGUF.search(parts[0])
        if m is not None and len(parts) != int(m.group(2)):
            raise HubError(f"{key} is split into {int(m.group(2))} parts but the repository "
                           f"holds {len(parts)}: {', '.join(parts)}")
    return groups


def _best_match(groups: dict[str, list[str]], tag: str) -> str | None:
    """The group whose path carries `tag` as a whole word (`Q4_K_M` in `model-Q4_K_M.gguf`)
    before one where it starts a longer tag (`Q4` in `Q4_K_M`, which the name-default prefers,
    else the first in name order); None if no path carries it."""
    t = re.escape(tag.lower())
    whole = re.compile(rf"(?:^|[^a-z0-9]){t}(?:\.gguf$|[^a-z0-9_])")
    start = re.compile(rf"(?:^|[^a-z0-9]){t}_")
    keys = sorted(groups)
    exact = [k for k in keys if whole.search(k.lower())]
    if exact:
        return exact[0]
    longer = [k for k in keys if start.search(k.lower())]
    preferred = [k for k in longer if re.search(r"(?:^|[^a-z0-9])q4_k_m(?:[^a-z0-9_]|\.gguf$)",
                                                 k.lower())]
    return next(iter(preferred or longer), None)


def _listing(files: list[str]) -> str:
    if not files:
        return "no files"
    shown = ", ".join(sorted(files)[:_LISTED])
    more = len(files) - _LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


# ---------------------------------------------------------------------------------------------
# The Hub and its cache
# ---------------------------------------------------------------------------------------------
_RESOLVED: dict[tuple, str] = {}  # one resolution per process (load_arch then load_model)


def resolve(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A Hub model name -> the local path the loader reads (the GGUF file, or the snapshot
    folder of a safetensors repository), downloading what the cache lacks. Any other `model`
    is returned unchanged."""
    name = parse_name(model)
    if name is None:
        return model
    from huggingface_hub import constants

    cache = download_dir or constants.HF_HUB_CACHE
    key = (model, revision, os.path.abspath(cache), constants.ENDPOINT,
           constants.is_offline_mode())
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve(name, revision, cache)
    return _RESOLVED[key]


def _resolve(name: HubName, revision: str | None, cache: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    files = _list_files(name.repo_id, revision, cache)
    sel = select_files(name.repo_id, files, name.tag)
    log.info("%s: %s %s", name.repo_id, sel.kind, ", ".join(sel.files))
    try:
        folder = snapshot_download(name.repo_id, revision=revision, cache_dir=cache,
                                   allow_patterns=list(sel.files))
    except LocalEntryNotFoundError as e:
        raise HubError(f"{name.repo_id}: {', '.join(sel.files)} not in the Hugging Face cache "
                       f"{cache} and the Hub cannot be used ({_why_offline()}): {e}") from None
    except Exception as e:  # noqa: BLE001 - the Hub's errors, each made one clear message
        raise _hub_error(name.repo_id, revision, e) from None
    missing = [f for f in sel.files if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise HubError(f"{name.repo_id}: the download left out {', '.join(missing)}")
    return os.path.join(folder, sel.entry) if sel.entry else folder


def _list_files(repo_id: str, revision: str | None, cache: str) -> list[str]:
    """The repository's file paths at `revision`: from the Hub, or from the cache when offline
    or when the Hub cannot be reached."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    if not constants.is_offline_mode():
        try:
            info = HfApi().model_info(repo_id, revision=revision)
            return [s.rfilename for s in info.siblings or []]
        except OfflineModeIsEnabled:
            pass
        except Exception as e:  # noqa: BLE001 - a connection failure falls back to the cache
            if not _is_connection_error(e):
                raise _hub_error(repo_id, revision, e) from None
            log.warning("the Hub (%s) cannot be reached (%s); using the cache", constants.ENDPOINT,
                        e)
    return _cached_files(repo_id, revision, cache)


def _cached_files(repo_id: str, revision: str | None, cache: str) -> list[str]:
    """The files of `repo_id` at `revision` that the huggingface_hub cache holds."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    storage = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    rev = revision or "main"
    commit = rev if REGEX_COMMIT_HASH.fullmatch(rev) else None
    ref = os.path.join(storage, "refs", rev)
    if commit is None and os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(storage, "snapshots", commit) if commit else ""
    if commit is None or not os.path.isdir(snapshot):
        raise HubError(f"{repo_id!r} is not a local file or directory, and revision {rev} of "
                       f"the repository is not in the Hugging Face cache {cache} while the Hub "
                       f"cannot be used ({_why_offline()}); download it once online, or name a "
                       f"local file or directory")
    out = set()
    for root, _, names in os.walk(snapshot):
        out |= {os.path.relpath(os.path.join(root, n), snapshot) for n in names}
    return sorted(out | _listed_files(storage, commit))


def _listed_files(storage: str, commit: str) -> set[str]:
    """The whole repository's file list at `commit` as huggingface_hub cached it with its last
    download (so that offline a file never downloaded is named as missing from the cache rather
    than from the repository); empty where this huggingface_hub keeps none."""
    try:
        from huggingface_hub._tree_cache import read_tree_cache
    except ImportError:
        return set()
    return set(read_tree_cache(storage, commit) or ())


def _why_offline() -> str:
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else \
        f"{constants.ENDPOINT} cannot be reached"


def _is_connection_error(e: BaseException) -> bool:
    import httpx

    return isinstance(e, (httpx.ConnectError, httpx.TimeoutException, ConnectionError))


def _hub_error(repo_id: str, revision: str | None, e: Exception) -> Exception:
    """huggingface_hub's exception -> one HubError saying what to do (others pass through)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import get_token

    where = f"{constants.ENDPOINT}/{repo_id}"
    if isinstance(e, GatedRepoError):  # before RepositoryNotFoundError, its base class
        how = ("the token in use has no access to it: accept its terms on " + where
               if get_token() else
               "no token is set: accept its terms on " + where + " and set HF_TOKEN (or run "
               "`hf auth login`)")
        return HubError(f"{repo_id} is a gated repository and {how}")
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)")
    if isinstance(e, RepositoryNotFoundError):
        token = "" if get_token() else " (a private one needs HF_TOKEN)"
        return HubError(f"{repo_id!r} is neither a local file or directory nor a repository on "
                        f"{constants.ENDPOINT}{token}")
    if isinstance(e, HfHubHTTPError):
        return HubError(f"{repo_id}: the Hub answered {_status(e)}: {e}")
    return e


def _status(e: Any) -> str:
    response = getattr(e, "response", None)
    return str(getattr(response, "status_code", "an error"))
