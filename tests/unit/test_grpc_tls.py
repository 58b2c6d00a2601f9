"""Mutual TLS on a real grpc.aio server (`baton certs` files): our channels are served, a plaintext caller,
one with another CA's certificate and one with no certificate are refused at the handshake, and a
certificate of the right CA that is not a service's is UNAUTHENTICATED and counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from proto.baton.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from shared.errors import ConfigError
from shared.grpc_auth import unauthenticated_calls
from shared.grpc_common import channel, check_health
from shared.grpc_tls import TlsFiles, channel_credentials, load_tls, set_tls, target_name_options
from shared.tls_certs import make_ca, make_dev_certs, make_leaf, write_pair
from tests.unit.test_grpc_errors import FailingDecode, WritingFailingDecode, _rpc_error, failing_server


@pytest.fixture
def certs(tmp_path: Path) -> Iterator[Path]:
    make_dev_certs(tmp_path / "certs")
    set_tls(tmp_path / "certs", "kv_transfer")
    yield tmp_path / "certs"
    set_tls(None, "")


async def _release(ch: grpc.aio.Channel) -> kv_transfer_pb2.ReleaseResponse:
    return await kv_transfer_pb2_grpc.KVTransferServiceStub(ch).Release(
        kv_transfer_pb2.ReleaseRequest(handoff_id="fine"), timeout=5)


def _secure(address: str, files: TlsFiles) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, channel_credentials(files), options=target_name_options())


@pytest.mark.parametrize("decode", [FailingDecode, WritingFailingDecode])
def test_services_talk_over_mutual_tls_and_strangers_are_refused(certs: Path, tmp_path: Path, decode: type) -> None:
    """Both ways of writing a streaming method pass the peer check as such (a coroutine that calls
    context.write, as decode's Generate is, once failed inside a generator wrapper with a TypeError)."""
    ca = load_tls(certs, "prefill").ca
    make_dev_certs(tmp_path / "other")  # a stack with another CA

    async def scenario() -> None:
        async with failing_server(decode) as handle:
            async with channel(handle.address) as ch:  # ours: the kv_transfer pair, checked against ca.pem
                assert (await _release(ch)).found
                stream = decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(handoff_id="context"))
                assert (await _rpc_error(stream)).code() is grpc.StatusCode.INVALID_ARGUMENT  # served, then failed
            async with _secure(handle.address, load_tls(certs, "prefill")) as ch:  # another service of the stack
                assert (await _release(ch)).found
            assert await check_health(handle.address)
            strangers = [
                grpc.aio.insecure_channel(handle.address),  # plaintext
                _secure(handle.address, load_tls(tmp_path / "other", "prefill")),  # another CA's certificate
                grpc.aio.secure_channel(handle.address, grpc.ssl_channel_credentials(root_certificates=ca),
                                        options=target_name_options()),  # no client certificate
            ]
            for stranger in strangers:
                async with stranger as ch:
                    assert (await _rpc_error(_release(ch))).code() is grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


@pytest.mark.parametrize("decode", [FailingDecode, WritingFailingDecode])
def test_a_certificate_of_the_ca_that_is_not_a_services_is_unauthenticated_and_counted(certs: Path,
                                                                                        decode: type) -> None:
    """Signed by the stack's CA, but without the SAN baton-internal (say, one issued to a person)."""
    ca_cert, ca_key = make_ca()
    write_pair(certs, "ca", ca_cert, ca_key)  # re-issue the stack under a CA whose key this test holds
    for name, sans in (("kv_transfer", ["baton-internal"]), ("alice", ["alice.example"])):
        cert, key = make_leaf(ca_cert, ca_key, name, sans)
        write_pair(certs, name, cert, key)
    set_tls(certs, "kv_transfer")

    async def scenario() -> None:
        async with failing_server(decode) as handle:
            before = unauthenticated_calls()
            alice = load_tls(certs, "alice")
            async with grpc.aio.secure_channel(handle.address, channel_credentials(alice),
                                               options=target_name_options()) as ch:
                exc = await _rpc_error(_release(ch))
                assert exc.code() is grpc.StatusCode.UNAUTHENTICATED and "baton-internal" in exc.details()
                stream = decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(handoff_id="x"))
                assert (await _rpc_error(stream)).code() is grpc.StatusCode.UNAUTHENTICATED
            assert unauthenticated_calls() - before == 2
            async with channel(handle.address) as ch:
                assert (await _release(ch)).found

    asyncio.run(scenario())


def test_missing_files_are_a_config_error_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="router-key.pem"):
        load_tls(tmp_path, "router")
