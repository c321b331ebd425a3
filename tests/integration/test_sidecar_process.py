"""``binbatch sidecar`` as a real process: flags, JSON logs, SIGTERM drain, exit status."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import grpc
import yaml
from sidecar_harness import prompt_request, sidecar_config

from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

STARTUP_TIMEOUT = 60


async def test_sidecar_process_serves_then_drains_on_sigterm(tmp_path):
    async with running_emulator(EmulatorConfig(step_a=0.001, step_c=0.0001)) as url:
        path = tmp_path / "sidecar.yaml"
        path.write_text(yaml.safe_dump(sidecar_config(url)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "binbatch_sidecar.cli", "sidecar", "--config", str(path),
            "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0",
            cwd=tmp_path, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            port = None
            lines = []
            async with asyncio.timeout(STARTUP_TIMEOUT):
                while port is None:
                    line = (await proc.stderr.readline()).decode()
                    assert line, f"sidecar exited early: {lines}"
                    lines.append(line)
                    record = json.loads(line)  # every log line is one JSON object
                    match = re.search(r"serving gRPC on 127\.0\.0\.1:(\d+)", record["message"])
                    port = int(match.group(1)) if match else None
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                resp = await pb_grpc.InferenceStub(channel).Generate(prompt_request(1, 5), timeout=30)
                assert resp.completion_tokens == 5
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(STARTUP_TIMEOUT):
                rest = (await proc.stderr.read()).decode()
                assert await proc.wait() == 0
            records = [json.loads(x) for x in rest.splitlines() if x.strip()]
            assert any("draining" in r["message"] for r in records)
            assert any("sidecar stopped (0 requests cut off" in r["message"] for r in records)
            assert not any("request 1: tell me" in x for x in lines + rest.splitlines())  # no prompt text in logs
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def read_until(proc: asyncio.subprocess.Process, seen: list[str], want) -> str:
    """Read stderr lines into ``seen`` until ``want(line)``; bounded by STARTUP_TIMEOUT."""
    assert proc.stderr is not None
    async with asyncio.timeout(STARTUP_TIMEOUT):
        while True:
            line = (await proc.stderr.readline()).decode()
            assert line, f"sidecar exited early: {seen}"
            seen.append(line)
            if want(line):
                return line


async def test_log_lines_are_json_with_the_request_id_and_a_reload_switches_them_to_text(tmp_path):
    """Issue 12: logs carry the request id as a JSON field (python-json-logger);
    ``logging.format`` switches the output live."""
    async with running_emulator(EmulatorConfig(step_a=0.001, step_c=0.0001)) as url:
        doc = sidecar_config(url, logging={"logPrompts": True}, server={"configPollMilliseconds": 100})
        path = tmp_path / "sidecar.yaml"
        path.write_text(yaml.safe_dump(doc))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "binbatch_sidecar.cli", "sidecar", "--config", str(path),
            "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0",
            cwd=tmp_path, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        seen: list[str] = []
        try:
            started = json.loads(await read_until(proc, seen, lambda line: "serving gRPC" in line))
            port = int(re.search(r"127\.0\.0\.1:(\d+)", started["message"]).group(1))  # type: ignore[union-attr]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                resp = await pb_grpc.InferenceStub(channel).Generate(prompt_request(1, 5, request_id="req-42"),
                                                                     timeout=30)  # fmt: skip
                assert resp.request_id == "req-42"
            await read_until(proc, seen, lambda line: "completion" in line)
            records = [json.loads(line) for line in seen]  # every line is one JSON object
            assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
            prompts = [r for r in records if r["logger"] == "binbatch.prompts"]
            assert [(r["level"], r["request_id"]) for r in prompts] == [("INFO", "req-42")] * 2

            doc["logging"]["format"] = "Text"
            path.write_text(yaml.safe_dump(doc))
            applied = await read_until(proc, seen, lambda line: "generation 2 applied" in line)
            assert not applied.startswith("{") and " INFO binbatch.config: config " in applied
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(STARTUP_TIMEOUT):
                    await proc.communicate()
