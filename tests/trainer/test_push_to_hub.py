"""`--output.push_to_hub`: after a run, the weights file and its model card reach the Hub repo in one commit;
a malformed repo id, offline mode, a missing, rejected or read-only token and an unreachable Hub are refused
before training; a failed upload keeps the run's files and prints the command that retries it.

The Hub is `testing.hub_endpoint.LocalHub` on 127.0.0.1 (the real `huggingface_hub` client talks to it
over HTTP); no test touches the network.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from testing.hub_endpoint import TOKEN, USER, LocalHub
from testing.trainer_assets import write_base, write_cache
from tests.trainer.test_comfyui_output import _one_line_error
from tests.trainer.test_run_cli import _argv as cli_argv
from trainer import push
from trainer.cli import parse_args
from trainer.publishing.hub import HubError
from trainer.run import main
from trainer.train import run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("push_to_hub")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A LocalHub the in-process client talks to, with its write token in HF_TOKEN and no saved login."""
    with LocalHub() as server:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
        for name in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def _argv(inputs, out, repo: str, *extra: str) -> list[str]:
    return cli_argv(inputs, out, "--output.push_to_hub", repo, *extra)


def _assert_committed(hub: LocalHub, repo_id: str, out: Path, name: str) -> None:
    """Exactly one commit, to `repo_id`, of the local weights file and card, byte for byte."""
    [commit] = hub.commits
    assert (commit.repo_id, commit.revision) == (repo_id, "main")
    assert commit.files == {name: (out / name).read_bytes(), "README.md": (out / "README.md").read_bytes()}
    assert commit.summary == f"Upload {name} and its model card"


def test_a_run_uploads_the_weights_and_card_in_one_commit_through_hf_endpoint(inputs, tmp_path):
    """The command line as a user runs it: HF_ENDPOINT and HF_TOKEN in the environment, read by huggingface_hub."""
    out = tmp_path / "out"
    with LocalHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf")}
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            env.pop(name, None)
        command = [sys.executable, "trainer/run.py", *_argv(inputs, out, "tester/tiny-t5")]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_committed(hub, "tester/tiny-t5", out, "t5.safetensors")
    assert hub.repos == {"tester/tiny-t5": None}  # created with the Hub's default visibility
    assert "# T5 attention weights: `t5.safetensors`" in hub.commits[0].files["README.md"].decode()


def test_a_bare_name_goes_under_the_token_user_and_a_private_repo_is_asked_for(inputs, tmp_path, hub):
    out = tmp_path / "out"
    argv = _argv(inputs, out, "tiny-t5", "--output.hub_private", "true", "--output.name", "tiny.safetensors")
    assert main(argv) == 0
    _assert_committed(hub, f"{USER}/tiny-t5", out, "tiny.safetensors")
    assert hub.repos == {f"{USER}/tiny-t5": "private"}


@pytest.mark.parametrize("repo", ["a/b/c", "tester/bad..name", "tester/-lead", "has space"])
def test_a_malformed_repo_id_is_refused_before_anything_is_written(inputs, tmp_path, hub, capsys, repo):
    out = tmp_path / "out"
    assert main(_argv(inputs, out, repo)) == 2
    error = _one_line_error(capsys)
    assert f"--output.push_to_hub {repo!r} is not a Hub repo id" in error and "give `namespace/name`" in error
    assert not out.exists() and hub.requests == []


def test_offline_mode_is_refused_before_training(inputs, tmp_path, hub, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    assert main(_argv(inputs, out, "tester/tiny-t5")) == 2
    error = _one_line_error(capsys)
    assert "--output.push_to_hub needs the network, but HF_HUB_OFFLINE=1" in error and "trainer/push.py" in error
    assert not out.exists() and hub.requests == []


def test_no_token_is_refused_before_training_and_says_how_to_log_in(inputs, tmp_path, hub, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    out = tmp_path / "out"
    assert main(_argv(inputs, out, "tester/tiny-t5")) == 2
    error = _one_line_error(capsys)
    assert "no Hugging Face token found" in error and "`hf auth login`" in error and "HF_TOKEN" in error
    assert not out.exists() and hub.requests == []


@pytest.mark.parametrize(
    ("token", "role", "message"),
    [("hf_not_a_token", "write", "rejected the token"), (TOKEN, "read", "the token is read-only")],
    ids=["rejected", "read-only"],
)
def test_a_token_that_cannot_write_is_refused_before_training(
    inputs, tmp_path, hub, capsys, monkeypatch, token, role, message
):
    monkeypatch.setenv("HF_TOKEN", token)
    hub.tokens[TOKEN] = (USER, role)
    out = tmp_path / "out"
    assert main(_argv(inputs, out, "tester/tiny-t5")) == 2
    error = _one_line_error(capsys)
    assert error.startswith("trainer/run.py: error: --output.push_to_hub: ") and message in error
    assert "`hf auth login`" in error and "HF_TOKEN" in error
    assert not out.exists() and hub.requests == ["GET /api/whoami-v2"] and not hub.repos


def test_an_unreachable_hub_is_refused_before_training(inputs, tmp_path, hub, monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", closed)
    out = tmp_path / "out"
    with pytest.raises(HubError, match=f"cannot reach the Hub at {closed}.*check the network and HF_ENDPOINT"):
        run(parse_args(_argv(inputs, out, "tester/tiny-t5")))
    assert not out.exists()


def test_a_failed_upload_keeps_the_files_and_its_retry_command_uploads_them(inputs, tmp_path, hub, capsys):
    hub.fail["commit"] = 500
    out = tmp_path / "out"
    with pytest.raises(HubError) as caught:
        run(parse_args(_argv(inputs, out, "tester/tiny-t5")))
    message = str(caught.value)
    assert "\n" not in message and "the upload to tester/tiny-t5" in message and "failed" in message
    assert "500" in message and f"the run's files are kept in {out}" in message
    assert not hub.commits and all((out / name).is_file() for name in ("t5.safetensors", "README.md", "report.json"))

    del hub.fail["commit"]
    command = shlex.split(message.split("Retry the upload with: ")[1])
    assert command[:2] == ["python", "trainer/push.py"]
    assert push.main(command[2:]) == 0
    assert "uploaded to " in capsys.readouterr().out
    _assert_committed(hub, "tester/tiny-t5", out, "t5.safetensors")


def test_push_refuses_a_folder_without_a_finished_run(tmp_path, hub, capsys):
    assert push.main(["--output.dir", str(tmp_path), "--output.push_to_hub", "tester/tiny-t5"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("trainer/push.py: error: ") and error.count("\n") == 1
    assert f"{tmp_path / 't5.safetensors'} does not exist" in error and hub.requests == []


def test_hub_private_needs_a_repo():
    with pytest.raises(ValueError, match="--output.hub_private: needs --output.push_to_hub REPO"):
        parse_args(["--output.hub_private", "true"])
