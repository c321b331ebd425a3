"""The webhook server renews its certificate while it runs: on 127.0.0.1, a real TLS handshake each poll."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from binbatch_operator.webhook import WebhookServer, self_signed_certificate


async def _served_certificate(port: int, bundle: bytes) -> bytes:
    """The certificate the server presents, in PEM; the handshake verifies it against ``bundle``."""
    context = ssl.create_default_context(cadata=bundle.decode())
    _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=context), timeout=5)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        await writer.wait_closed()
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


async def test_a_running_server_swaps_to_the_renewed_certificate_and_every_handshake_verifies(tmp_path: Path) -> None:
    first, first_key = self_signed_certificate(["127.0.0.1"], lifetime_seconds=3)  # renewed about 2 s in
    renewed = self_signed_certificate(["127.0.0.1"], lifetime_seconds=3600)
    (tmp_path / "tls.crt").write_bytes(first)
    (tmp_path / "tls.key").write_bytes(first_key)
    bundles: list[bytes] = []

    async def on_ca(pem: bytes) -> None:
        bundles.append(pem)

    async def renew() -> tuple[bytes, bytes]:
        return renewed

    async def review(request: Any, **_: Any) -> Any:
        return {}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = WebhookServer(addr="127.0.0.1", port=port, host="127.0.0.1", certfile=tmp_path / "tls.crt",
                           pkeyfile=tmp_path / "tls.key", on_ca=on_ca, renew=renew, swap_grace=0.2)  # fmt: skip
    configs = server(review)
    await configs.__anext__()
    try:
        assert bundles == [first]
        served = [await _served_certificate(port, bundles[-1])]
        deadline = asyncio.get_running_loop().time() + 15
        # Handshake after handshake, each verified against the CA bundle published at that moment.
        while served[-1] != renewed[0]:
            assert asyncio.get_running_loop().time() < deadline, "the server never served the renewed certificate"
            await asyncio.sleep(0.05)  # ok-sleep: a bounded poll for the swap the server makes on its own timer
            served.append(await _served_certificate(port, bundles[-1]))
        assert bundles == [first, renewed[0] + first]  # the old CA stays in the bundle beside the new one
        assert served[0] == first and set(served) == {first, renewed[0]}
        assert Path(server.certfile).read_bytes() == renewed[0] and server.renewals == 1
    finally:
        await configs.aclose()
