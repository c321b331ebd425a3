"""Reload by file content (``server/config_watcher.py``): a changed valid file is
applied, a bad or missing one keeps the running config and says why."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from binbatch_sidecar.config import LoadedConfig, load_config
from binbatch_sidecar.server.config_watcher import ConfigWatcher


def write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc))


@pytest.fixture
def cfg_path(tmp_path) -> Path:
    path = tmp_path / "sidecar.yaml"
    write(path, {"batch": {"staticSize": 16}})
    return path


def watcher_for(path: Path, applied: list[LoadedConfig]) -> ConfigWatcher:
    return ConfigWatcher(path, initial=load_config(path), on_change=applied.append, poll_seconds=1.0)


async def test_watcher_applies_a_changed_file_and_bumps_generation(cfg_path):
    applied: list[LoadedConfig] = []
    watcher = watcher_for(cfg_path, applied)
    assert not await watcher.check()  # unchanged
    write(cfg_path, {"batch": {"staticSize": 24}})
    assert await watcher.check()
    assert watcher.current.config.batch.static_size == 24
    assert watcher.current.generation == 2
    assert watcher.current.sha256 == hashlib.sha256(cfg_path.read_bytes()).hexdigest()
    assert applied == [watcher.current]
    assert watcher.last_error is None


async def test_identical_rewrite_does_not_bump_generation(cfg_path):
    applied: list[LoadedConfig] = []
    watcher = watcher_for(cfg_path, applied)
    write(cfg_path, {"batch": {"staticSize": 16}})
    assert not await watcher.check()
    assert watcher.current.generation == 1 and applied == []


async def test_bad_file_keeps_the_old_config_and_names_the_field(cfg_path, caplog):
    applied: list[LoadedConfig] = []
    watcher = watcher_for(cfg_path, applied)
    before = watcher.current
    write(cfg_path, {"batch": {"staticSize": 16, "minBatchSize": 100}})
    with caplog.at_level(logging.WARNING, logger="binbatch.config"):
        assert not await watcher.check()
        assert not await watcher.check()  # the same bad bytes: refused again, logged once
    assert watcher.current is before and applied == []
    assert watcher.last_error is not None and watcher.last_error.startswith("batch.minBatchSize: ")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    # a fixed file applies and clears the error
    write(cfg_path, {"batch": {"staticSize": 32}})
    assert await watcher.check()
    assert watcher.current.generation == 2 and watcher.last_error is None


async def test_reverting_to_the_running_file_clears_the_error(cfg_path):
    watcher = watcher_for(cfg_path, [])
    good = cfg_path.read_bytes()
    cfg_path.write_text("batch: [\n")
    assert not await watcher.check()
    assert watcher.last_error is not None and "invalid YAML at line" in watcher.last_error
    cfg_path.write_bytes(good)
    assert not await watcher.check()
    assert watcher.last_error is None and watcher.current.generation == 1


async def test_deleted_file_keeps_the_old_config(cfg_path):
    watcher = watcher_for(cfg_path, [])
    before = watcher.current
    cfg_path.unlink()
    assert not await watcher.check()
    assert watcher.current is before
    assert watcher.last_error is not None and "No such file" in watcher.last_error
    write(cfg_path, {"batch": {"staticSize": 8}})  # the ConfigMap swap completes
    assert await watcher.check()
    assert watcher.current.config.batch.static_size == 8 and watcher.last_error is None


async def test_on_change_may_be_async(cfg_path):
    seen: list[int] = []

    async def apply(loaded: LoadedConfig) -> None:
        await asyncio.sleep(0)  # ok-sleep: a bare yield to the event loop; no time passes
        seen.append(loaded.generation)

    watcher = ConfigWatcher(cfg_path, initial=load_config(cfg_path), on_change=apply, poll_seconds=1.0)
    write(cfg_path, {"batch": {"staticSize": 24}})
    assert await watcher.check()
    assert seen == [2]


async def test_config_the_server_cannot_apply_is_refused(cfg_path):
    def apply(loaded: LoadedConfig) -> None:
        raise ValueError("engine.url: the new engine cannot be reached")

    watcher = ConfigWatcher(cfg_path, initial=load_config(cfg_path), on_change=apply, poll_seconds=1.0)
    write(cfg_path, {"batch": {"staticSize": 24}})
    assert not await watcher.check()
    assert watcher.current.generation == 1
    assert watcher.last_error is not None and "cannot be reached" in watcher.last_error


async def test_run_polls_until_cancelled(cfg_path):
    applied = asyncio.Event()
    watcher = ConfigWatcher(
        cfg_path, initial=load_config(cfg_path), on_change=lambda _: applied.set(), poll_seconds=0.01
    )
    task = asyncio.create_task(watcher.run())
    write(cfg_path, {"batch": {"staticSize": 24}})
    await asyncio.wait_for(applied.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watcher.current.generation == 2


def _kubelet_publish(volume, data: dict, generation: int) -> None:
    """What kubelet's AtomicWriter does for a ConfigMap volume: write a fresh
    timestamped directory, point a new symlink at it and rename that over
    ``..data``; the user-visible file is a fixed symlink into ``..data``."""
    stamp = volume / f"..2026_11_23_00_00_0{generation}.000000000"
    stamp.mkdir()
    (stamp / "sidecar.yaml").write_text(yaml.safe_dump(data))
    tmp = volume / "..data_tmp"
    tmp.symlink_to(stamp.name)
    os.replace(tmp, volume / "..data")
    if not (volume / "sidecar.yaml").is_symlink():
        (volume / "sidecar.yaml").symlink_to("..data/sidecar.yaml")


async def test_a_configmap_volume_update_is_picked_up(tmp_path):
    """The file path never changes and its own mtime is the symlink's: only the
    content tells that kubelet swapped in a new version."""
    volume = tmp_path / "binbatch"
    volume.mkdir()
    _kubelet_publish(volume, {"batch": {"staticSize": 16}}, 1)
    path = volume / "sidecar.yaml"
    watcher = ConfigWatcher(path, initial=load_config(path), on_change=lambda loaded: None, poll_seconds=1)
    assert not await watcher.check()
    _kubelet_publish(volume, {"batch": {"staticSize": 24}}, 2)
    assert await watcher.check()
    assert watcher.current.config.batch.static_size == 24 and watcher.current.generation == 2


async def test_a_truncated_file_on_reload_keeps_the_old_config(cfg_path):
    applied: list[LoadedConfig] = []
    w = watcher_for(cfg_path, applied)
    cfg_path.write_text("")  # an editor truncates, then writes
    assert not await w.check()
    assert applied == [] and w.current.config.batch.static_size == 16
    assert "holds no config" in (w.last_error or "")
    write(cfg_path, {"batch": {"staticSize": 8}})
    assert await w.check() and w.current.config.batch.static_size == 8


async def test_run_reports_a_refused_file_once_however_often_it_polls(cfg_path):
    refused: list[str] = []
    watcher = ConfigWatcher(cfg_path, initial=load_config(cfg_path), on_change=lambda _: None,
                            poll_seconds=0.001, on_refused=refused.append)  # fmt: skip
    polls, enough = 0, asyncio.Event()
    check = watcher.check

    async def counted() -> bool:
        nonlocal polls
        polls += 1
        if polls == 5:
            enough.set()
        return await check()

    watcher.check = counted  # type: ignore[method-assign]
    cfg_path.write_text("batch: [\n")
    task = asyncio.create_task(watcher.run())
    await asyncio.wait_for(enough.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(refused) == 1 and "invalid YAML" in refused[0]


async def test_overlapping_checks_never_put_an_older_file_back(cfg_path):
    """The poll loop and an explicit check() overlap while an apply awaits (an engine swap).

    The first check applies file A and is held inside on_change; meanwhile the file becomes B
    and a second check runs.  Unserialised, B was applied while A's apply was still running,
    and A's finished last: the watcher then ran A with B on disk.
    """
    release, entered = asyncio.Event(), asyncio.Event()
    applied: list[int] = []

    async def slow_apply(new: LoadedConfig) -> None:
        if new.config.batch.static_size == 24:
            entered.set()
            await release.wait()
        applied.append(new.config.batch.static_size)

    watcher = ConfigWatcher(cfg_path, initial=load_config(cfg_path), on_change=slow_apply, poll_seconds=1.0)
    write(cfg_path, {"batch": {"staticSize": 24}})
    first = asyncio.create_task(watcher.check())
    await entered.wait()
    write(cfg_path, {"batch": {"staticSize": 32}})
    second = asyncio.create_task(watcher.check())
    await asyncio.sleep(0)  # ok-sleep: one turn, so an unserialised second check would run now
    release.set()
    assert await first and await second
    assert applied == [24, 32]
    assert watcher.current.config.batch.static_size == 32
    assert watcher.current.generation == 3
