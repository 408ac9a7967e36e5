"""`--output.push_to_hub`: the exported weights file and its model card, uploaded to a Hugging Face Hub repo
in one commit.

`hub_target` checks before training that the upload can happen: a well-formed repo id, the Hub not in
offline mode (`HF_HUB_OFFLINE=1`), and a token (`HF_TOKEN`, or the one `hf auth login` saved) that the Hub
accepts and that may write. `push_to_hub` uploads after training: it creates the repo when missing and
commits the file under its name and the card as `README.md`. The client is `huggingface_hub`, so
`HF_ENDPOINT` points it at another Hub. A failed upload keeps the run folder as it is, and its error gives
the `python trainer/push.py` command that retries the upload alone.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

from trainer.config import OutputConfig
from trainer.publishing.model_card import RUN_CARD

__all__ = ["HubError", "HubTarget", "hub_target", "push_to_hub", "retry_command"]

FLAG = "--output.push_to_hub"
_LOGIN = "run `hf auth login` (or `huggingface-cli login`), or set HF_TOKEN to a write token"

logger = logging.getLogger(__name__)


class HubError(OSError):
    """The Hub could not be reached, or it refused the upload; the run's local files are untouched."""


@dataclass(frozen=True, slots=True)
class HubTarget:
    """Where `--output.push_to_hub` uploads, checked before training.

    Attributes:
        repo_id: `namespace/name` (a bare name resolved to the token owner's namespace).
        private: create the repo private (`--output.hub_private`); an existing repo keeps its visibility.
        endpoint: the Hub the client talks to (`HF_ENDPOINT`, default https://huggingface.co).
    """

    repo_id: str
    private: bool
    endpoint: str


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def hub_target(output: OutputConfig) -> HubTarget | None:
    """Check `--output.push_to_hub` before training: a valid repo id, online, and a write token the Hub accepts.

    Returns:
        The target, or None when `--output.push_to_hub` is not set.

    Raises:
        ValueError: a malformed repo id, or `HF_HUB_OFFLINE=1`.
        PermissionError: no token, a token the Hub rejects, or a read-only token.
        HubError: the Hub could not be reached.
    """
    if not output.push_to_hub:
        return None
    # Imported here: a run that does not upload never loads the Hub client.
    import huggingface_hub
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id = output.push_to_hub
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(
            f"{FLAG} {repo_id!r} is not a Hub repo id ({_one_line(error)}); give `namespace/name`, such as "
            "`your-name/sd35-medium-t5`."
        ) from None
    if huggingface_hub.is_offline_mode():
        raise ValueError(
            f"{FLAG} needs the network, but HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) is set; unset it, or drop "
            f"{FLAG} and upload later with `python trainer/push.py`."
        )
    token = huggingface_hub.get_token()
    if token is None:
        raise PermissionError(f"{FLAG}: no Hugging Face token found; {_LOGIN}.")
    api = HfApi()
    try:
        user = api.whoami(token=token)
    except HfHubHTTPError as error:
        if error.response is not None and error.response.status_code == 401:
            raise PermissionError(f"{FLAG}: the Hub at {api.endpoint} rejected the token; {_LOGIN}.") from None
        raise HubError(f"{FLAG}: cannot check the token at {api.endpoint}: {_one_line(error)}") from None
    # huggingface_hub raises its own HTTP errors, its transport's and OSError: any of them means "unreachable".
    except Exception as error:
        raise HubError(
            f"{FLAG}: cannot reach the Hub at {api.endpoint} ({_one_line(error)}); check the network and HF_ENDPOINT."
        ) from None
    if user.get("auth", {}).get("accessToken", {}).get("role") == "read":
        raise PermissionError(f"{FLAG}: the token is read-only; {_LOGIN}.")
    if "/" not in repo_id:
        repo_id = f"{user['name']}/{repo_id}"
    return HubTarget(repo_id, output.hub_private, api.endpoint)


def retry_command(target: HubTarget, weights: Path) -> str:
    """The shell command that uploads a run folder's weights file and card again (`trainer/push.py`)."""
    argv = ["python", "trainer/push.py", "--output.dir", str(weights.parent.resolve()), "--output.name", weights.name]
    argv += [FLAG, target.repo_id] + (["--output.hub_private", "true"] if target.private else [])
    return shlex.join(argv)


def push_to_hub(target: HubTarget, weights: Path) -> str:
    """Upload the weights file and the model card beside it (`README.md`) to the repo, in one commit.

    Args:
        target: the checked target (`hub_target`).
        weights: the exported weights file; its folder holds the card.

    Returns:
        The commit's URL.

    Raises:
        HubError: the repo could not be created or the commit failed; the local files are untouched and the
            message gives the command that retries the upload.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=target.endpoint)
    operations = [
        CommitOperationAdd(path_in_repo=weights.name, path_or_fileobj=weights),
        CommitOperationAdd(path_in_repo=RUN_CARD, path_or_fileobj=weights.parent / RUN_CARD),
    ]
    try:
        api.create_repo(target.repo_id, private=target.private or None, exist_ok=True)
        commit = api.create_commit(
            target.repo_id, operations, commit_message=f"Upload {weights.name} and its model card"
        )
    # As in `hub_target`, whatever the client raised: the trained files are safe and the user needs the retry line.
    except Exception as error:
        raise HubError(
            f"{FLAG}: the upload to {target.repo_id} at {target.endpoint} failed ({_one_line(error)}); the run's "
            f"files are kept in {weights.parent}. Retry the upload with: {retry_command(target, weights)}"
        ) from None
    logger.info("Export: uploaded %s and %s to %s", weights.name, RUN_CARD, commit.commit_url)
    return commit.commit_url
