"""The server tests' fixtures: a tiny checkpoint and the default tiny server (server/servers.py starts them)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server.servers import SERVER_CONTEXT, Server, start_server, stop_server
from tiny_checkpoints import build_fim_checkpoint, build_tiny_checkpoint


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("serve-tiny"), context=SERVER_CONTEXT)


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="session")
def tiny_server(server_model_dir: Path, server_tmp: Path) -> Iterator[Server]:
    """The default server (method auto) with room for 4 rows and a queue of 64; a request may pick a
    draft-model method (the draft: the target's first layer, in fp32 as the target: the default draft
    format would build its kernels in this server's empty cache during the first such request, ~45 s)."""
    server = start_server(server_model_dir, server_tmp, "--max-batch", "4", "--max-queue", "64", "--draft", "self:1",
                          "--draft-dtype", "fp32")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose tokenizer has Qwen2.5-Coder's fill-in-the-middle tokens."""
    return build_fim_checkpoint(tmp_path_factory.mktemp("fim-tiny"), context=SERVER_CONTEXT)


@pytest.fixture(scope="session")
def fim_server(fim_model: Path, server_tmp: Path) -> Iterator[Server]:
    """A server of the FIM checkpoint (method auto): /infill and `suffix` work on it."""
    server = start_server(fim_model, server_tmp, "--max-batch", "2")
    yield server
    stop_server(server)
