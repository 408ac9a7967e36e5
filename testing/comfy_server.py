"""A real ComfyUI server for the tests and checks that need one (the browser test, the Dynamic VRAM
check): `main.py` of a ComfyUI tree on loopback, from a throw-away base directory whose
`custom_nodes/` holds this pack (and, on request, the testing nodes), its log kept in a file.

    with ComfyServer.start(tree, base_dir, custom_nodes=(comfy_env.TESTING_NODES,)) as server:
        prompt_id = server.queue(prompt)
        history = server.wait(prompt_id)
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from testing.comfy_env import REPO_ROOT

PACK_NAME = "comfyui-t5-linearize"
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_TAG = re.compile(r"^\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ")


class ServerError(RuntimeError):
    """The server did not start, or a prompt failed; the message ends with the server log's tail."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ComfyServer:
    """A running ComfyUI server (use `start`; a context manager that stops it)."""

    process: subprocess.Popen
    url: str
    base_dir: Path
    log_path: Path

    @classmethod
    def start(
        cls,
        tree: Path,
        base_dir: Path,
        *,
        custom_nodes: tuple[Path, ...] = (),
        args: tuple[str, ...] = (),
        cpu: bool = True,
        timeout_s: float = 180.0,
    ) -> ComfyServer:
        """Start `tree/main.py` serving `base_dir` (created) with this pack and `custom_nodes` linked
        into `base_dir/custom_nodes/`; return once `/object_info` answers.

        Raises:
            ServerError: the process exited or did not answer within `timeout_s`.
        """
        nodes_dir = base_dir / "custom_nodes"
        nodes_dir.mkdir(parents=True, exist_ok=True)
        for source, name in ((REPO_ROOT, PACK_NAME), *((path, path.name) for path in custom_nodes)):
            link = nodes_dir / name
            if not link.exists():
                link.symlink_to(source, target_is_directory=source.is_dir())
        port = _free_port()
        log_path = base_dir / "server.log"
        command = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(port)]
        command += ["--base-directory", str(base_dir), "--disable-auto-launch", *(["--cpu"] if cpu else []), *args]
        # the default database is tree/user/comfyui.db, inside the (read-only) tree
        command += ["--database-url", "sqlite:///:memory:"]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=tree,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        server = cls(process, f"http://127.0.0.1:{port}", base_dir, log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerError(
                    f"ComfyUI at {tree} exited with {process.returncode} while starting.{server.log_tail()}"
                )
            try:
                server.get("/object_info/T5Linearize")
                return server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        server.stop()
        raise ServerError(f"ComfyUI at {tree} did not answer within {timeout_s:.0f} s.{server.log_tail()}")

    def __enter__(self) -> ComfyServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate the server (kill it if it does not stop within 10 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def messages(self) -> list[str]:
        """The log's lines as logged: without the terminal colour codes and the `[INFO]` level tag
        ComfyUI puts in front."""
        return [_TAG.sub("", _COLOUR.sub("", line)) for line in self.log().splitlines()]

    def log_tail(self, lines: int = 40) -> str:
        tail = "\n".join(self.log().splitlines()[-lines:])
        return f"\n--- last {lines} lines of {self.log_path} ---\n{tail}"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def queue(self, prompt: dict) -> str:
        """POST an API-format prompt; returns its id. Raises ServerError when ComfyUI refuses it."""
        request = urllib.request.Request(
            self.url + "/prompt", json.dumps({"prompt": prompt}).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())["prompt_id"]
        except urllib.error.HTTPError as error:
            raise ServerError(f"ComfyUI refused the prompt: {error.read().decode(errors='replace')}") from error

    def wait(self, prompt_id: str, timeout_s: float = 300.0) -> dict:
        """The prompt's `/history` entry once it has finished; ServerError if it failed or timed out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if entry["status"].get("status_str") != "success":
                    messages = [
                        data for event, data in entry["status"].get("messages", []) if event == "execution_error"
                    ]
                    raise ServerError(f"prompt {prompt_id} failed: {messages}{self.log_tail()}")
                return entry
            if self.process.poll() is not None:
                raise ServerError(f"ComfyUI exited while running prompt {prompt_id}.{self.log_tail()}")
            time.sleep(0.2)
        raise ServerError(f"prompt {prompt_id} did not finish within {timeout_s:.0f} s.{self.log_tail()}")
