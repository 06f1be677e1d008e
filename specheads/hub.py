"""Drafters on the Hugging Face Hub: resolve a repo id to a local folder, publish a folder as a repo.

`--heads ORG/NAME` (any name that is not a local folder but has that shape) downloads through
huggingface_hub's cache; with `HF_HUB_OFFLINE=1` a cached copy is used without network. Publishing is
`create_repo` then one `upload_folder` commit; the local folder is never changed by either.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    """ORG/NAME that is not a local path (write ./ORG/NAME for a local folder of that name)."""
    return bool(_REPO_ID.match(name)) and not Path(name).exists()


def resolve_heads(path: str | os.PathLike) -> Path:
    """A local folder as is; a Hub repo id as its snapshot in the local cache (downloaded unless offline)."""
    folder = Path(path)
    if folder.is_dir() or not looks_like_repo_id(str(path)):
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return _snapshot(str(path), snapshot_download)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        raise ValueError(f"{path} is neither a local folder nor a Hub repo that could be fetched "
                         f"({type(err).__name__}: {str(err).splitlines()[0]}); check the name, the network, "
                         "or HF_HUB_OFFLINE with a cached copy") from None


@functools.lru_cache(maxsize=16)
def _snapshot(repo_id: str, download: Any) -> Path:
    # Options check a Hub id before any model loads and the loader resolves it again: one download (or cache
    # lookup) serves both.
    return Path(download(repo_id=repo_id))


def push_folder(folder: Path, repo_id: str, *, private: bool = False, token: str | None = None,
                endpoint: str | None = None) -> str:
    """Publish `folder` as the Hub model repo `repo_id` (created if needed); returns the commit URL.

    A missing token or an unreachable Hub raises ValueError in one line; `folder` is left as it is."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message=f"Upload drafter exported by specheads from {folder.name}")
    except HfHubHTTPError as err:
        raise ValueError(f"pushing to the Hub repo {repo_id} failed ({str(err).splitlines()[0]}); the export in "
                         f"{folder} is intact: log in (`hf auth login` or HF_TOKEN) and retry") from None
    except Exception as err:  # no network or a refused connection: the HTTP client's own transport errors
        raise ValueError(f"cannot reach the Hub to push {repo_id} ({type(err).__name__}: {err}); the export in "
                         f"{folder} is intact: retry with network") from None
    return str(getattr(info, "commit_url", info))
