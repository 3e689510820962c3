"""`dsv4 prepare --hf-repo ORG/NAME`: an official-format checkpoint from the Hugging Face Hub, as a safe stage.

The download goes through huggingface_hub's ``snapshot_download`` (its own token lookup: ``HF_TOKEN`` or
``hf auth login``; its own retries) and lands in the prepare cache as every other prepare stage does
(:func:`converters.staging.run_stage`: one file lock per destination, so concurrent preparers download
once; a completion sentinel, so a rerun with the same repository and revision is a no-op without any
network call; the result renamed into place, never half-written):

1. The files are downloaded into ``.<out>.download`` beside the destination (huggingface_hub's
   ``local_dir`` mode). That folder outlives a failed or killed run: the files it completed are not
   fetched again (huggingface_hub keeps their commit and ETag in ``.cache/huggingface``); a file cut off
   half-way is downloaded again from its start.
2. Only the files a checkpoint needs are fetched (:data:`ALLOW_PATTERNS`, top-level files only): config,
   tokenizer, safetensors shards and their index.
3. Free space for what is still to download is checked first (a dry run lists it).
4. The folder is verified as an official-format checkpoint (``core.checkpoint.open_checkpoint``: config,
   index, every shard header, name, shape and dtype). A folder that fails is removed, so a rerun starts
   clean instead of finding the same bad files.
5. The files are hard-linked (moved where links are not possible) into the stage's temporary folder with
   ``dsv4_hf_source.json`` (repository, revision, the commit it resolved to, endpoint); the stage renames
   it into place; then the download folder is removed.

``--hf-revision`` is a branch, tag or commit (default ``main``); ``--hf-endpoint`` (or ``HF_ENDPOINT``)
points at a mirror or a Hub-compatible server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from core.checkpoint.tokenizer import TOKENIZER_FILE
from core.errors import UserInputError

__all__ = ["ALLOW_PATTERNS", "OFFICIAL_REPOS", "SOURCE_FILE", "HubError", "default_out", "prepare_from_hub"]

#: The repositories of the official checkpoints (docs/checkpoints.md).
OFFICIAL_REPOS = ("deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro")

#: What a checkpoint needs; fnmatch patterns on repository paths (nested paths are ignored).
ALLOW_PATTERNS = ("config.json", "generation_config.json", "model.safetensors.index.json", "*.safetensors",
                  "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                  "chat_template*", TOKENIZER_FILE)
IGNORE_PATTERNS = ("*/*",)

SOURCE_FILE = "dsv4_hf_source.json"
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class HubError(UserInputError):
    """The Hub (or the endpoint given) could not provide the repository."""


def check_repo_id(repo: str) -> str:
    if not isinstance(repo, str) or not _REPO_ID.fullmatch(repo) or ".." in repo:
        raise UserInputError(f"--hf-repo {repo!r}: expected ORG/NAME, e.g. {OFFICIAL_REPOS[0]}")
    return repo


def default_out(cache: Path, repo: str, revision: str) -> Path:
    """``<cache>/hf/<org>--<name>--<revision>``: one folder per repository and revision."""
    org, name = check_repo_id(repo).split("/")
    rev = re.sub(r"[^A-Za-z0-9_.-]", "-", revision)
    return Path(cache) / "hf" / f"{org}--{name}--{rev}"


def _download_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.download"


def _hub_error(repo: str, revision: str, endpoint: Optional[str], exc: BaseException) -> HubError:
    from huggingface_hub import errors

    while isinstance(exc, (errors.DryRunError, errors.LocalEntryNotFoundError)) and exc.__cause__ is not None:
        exc = exc.__cause__  # the Hub's own answer (repository / revision not found, 401, ...)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = endpoint or "the Hugging Face Hub"
    return HubError(f"--hf-repo {repo} (revision {revision}) from {where}: {type(exc).__name__}: {first}")


def _hub_errors() -> tuple:
    """What a download can fail with that is not a bug: the Hub's answers and the transport's errors."""
    from huggingface_hub import errors

    try:
        import httpx2  # huggingface_hub's HTTP client (2.x)

        transport = (httpx2.HTTPError,)
    except ImportError:
        transport = ()
    return (errors.HfHubHTTPError, errors.DryRunError, errors.FileMetadataError, errors.LocalEntryNotFoundError,
            errors.OfflineModeIsEnabled, ConnectionError, TimeoutError, *transport)


def _snapshot(repo: str, revision: str, endpoint: Optional[str], local_dir: Path, *, dry_run: bool):
    from huggingface_hub import snapshot_download
    from tqdm.auto import tqdm

    class _Silent(tqdm):  # the dry run's listing needs no progress bar
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return snapshot_download(repo, revision=revision, endpoint=endpoint, local_dir=local_dir,
                             allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS),
                             dry_run=dry_run, tqdm_class=_Silent if dry_run else None)


def _place(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s file: a hard link (the download keeps its copy until the stage is done),
    or the file itself where the file system has no hard links."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.move(str(src), str(dst))


def _build(repo: str, revision: str, endpoint: Optional[str], download: Path, tmp: Path) -> None:
    from converters.staging import check_disk_space
    from core.checkpoint import open_checkpoint

    try:
        plan = _snapshot(repo, revision, endpoint, download, dry_run=True)
        if not plan:
            raise HubError(f"--hf-repo {repo} (revision {revision}): no checkpoint files in the repository "
                           f"(looked for {', '.join(ALLOW_PATTERNS)})")
        commit = plan[0].commit_hash  # the revision as resolved now: the download fetches exactly this commit
        check_disk_space(download.parent, sum(int(f.file_size or 0) for f in plan if f.will_download))
        download.mkdir(exist_ok=True)
    except _hub_errors() as exc:
        raise _hub_error(repo, revision, endpoint, exc) from exc
    try:
        _snapshot(repo, commit, endpoint, download, dry_run=False)
    except _hub_errors() as exc:
        err = _hub_error(repo, revision, endpoint, exc)
        raise HubError(f"{err} (a rerun resumes: the files completed are kept in {download})") from exc
    files = sorted(f.filename for f in plan)
    try:
        open_checkpoint(download)
    except UserInputError as exc:
        shutil.rmtree(download, ignore_errors=True)  # a rerun downloads again instead of finding the same files
        raise HubError(f"--hf-repo {repo} (revision {revision}): the downloaded files are not a valid "
                       f"official-format checkpoint, removed them: {exc}") from exc
    for name in files:
        _place(download / name, tmp / name)
    source = {"repo": repo, "revision": revision, "commit": commit, "endpoint": endpoint or "https://huggingface.co",
              "files": files}
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")


def _drop_download(out: Path) -> None:
    """Remove the download folder once the stage is complete (under the stage's lock: a preparer building
    the same destination owns it until then)."""
    from filelock import FileLock

    from converters.staging import lock_path_for, read_sentinel

    download = _download_dir(out)
    if not download.exists():
        return
    with FileLock(str(lock_path_for(out))):
        if read_sentinel(out) is not None and download.exists():
            shutil.rmtree(download, ignore_errors=True)


def prepare_from_hub(repo: str, out: Path, *, revision: Optional[str] = None, endpoint: Optional[str] = None,
                     overwrite: bool = False) -> bool:
    """Download ``repo`` at ``revision`` into ``out`` (see the module docstring); True when this call wrote
    it, False when it was already prepared."""
    from converters.staging import normalize_dest, run_stage

    check_repo_id(repo)
    revision = revision or "main"
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
    out = normalize_dest(out)
    download = _download_dir(out)
    result = run_stage(out, lambda tmp: _build(repo, revision, endpoint, download, tmp), name="prepare", input_paths=(),
                       inputs={"hf_repo": repo, "revision": revision}, overwrite=overwrite, verbose=False)
    _drop_download(out)
    return result.built
