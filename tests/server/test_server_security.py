"""Tokens, adapter-root confinement, TLS and mutual TLS, each against a real server."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

ADMIN, API = "admin-s3cret", "api-t0ken"


@pytest.fixture(scope="module")
def admin_server(serve, make_engine, tiny_llama: Path, tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("adapter_root")
    return serve(lambda: make_engine(tiny_llama), admin_token=ADMIN, adapter_roots=[root])


def code_of(fn, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    return info.value.code()


# ---- tokens ------------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "wrong", API])
def test_admin_without_right_token_is_unauthenticated(admin_server, token: str | None) -> None:
    with admin_server.client(admin_token=token) as client:
        for call in (client.list_adapters, lambda: client.unload_adapter("x"),
                     lambda: client.load_adapter("x", "/tmp")):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "--admin-token" in info.value.details()


def test_admin_with_token_passes_auth(admin_server) -> None:
    with admin_server.client(admin_token=ADMIN) as client:
        try:
            client.list_adapters()
        except grpc.RpcError as e:  # the engine may lack multi-LoRA; auth passed either way
            assert e.code() == grpc.StatusCode.UNIMPLEMENTED


def test_only_admin_token_guards_inference_too(admin_server) -> None:
    """One token set: every route but health needs one (the admin token, the only one)."""
    with admin_server.client() as client:
        assert code_of(client.generate, "the cat", max_new_tokens=2) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert client.health() == "SERVING"
    with admin_server.client(api_token=ADMIN) as client:
        assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
        info = client.server_info()
        assert info.admin_token_required and info.api_token_required


def test_bearer_scheme_is_required(admin_server) -> None:
    with grpc.insecure_channel(admin_server.target) as channel:
        from loraplex.proto import loraplex_pb2 as pb
        from loraplex.proto import loraplex_pb2_grpc as pb_grpc

        stub = pb_grpc.AdapterAdminStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListAdapters(pb.ListAdaptersRequest(), metadata=[("authorization", ADMIN)])
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_api_token_guards_inference_and_info(serve, make_engine, tiny_llama: Path) -> None:
    server = serve(lambda: make_engine(tiny_llama), api_token=API, admin_token=ADMIN)
    for token in (None, "wrong"):
        with server.client(api_token=token) as client:
            for method in (client.generate, client.generate_stream):
                assert code_of(method, "the cat", max_new_tokens=2) == \
                    grpc.StatusCode.UNAUTHENTICATED
            assert code_of(client.server_info) == grpc.StatusCode.UNAUTHENTICATED
            assert client.health() == "SERVING"  # health stays open for probes
    for token in (API, ADMIN):  # the admin token is accepted everywhere
        with server.client(api_token=token) as client:
            assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
            assert len(list(client.generate_stream("the cat", max_new_tokens=2))) == 2
            assert client.server_info().api_token_required


# ---- adapter roots -----------------------------------------------------------------------
def escape_paths(root: Path, outside: Path) -> list[str]:
    link = root / "link-out"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    return [str(outside), f"{root}/../{outside.name}", str(link), "/etc"]


def test_path_outside_roots_is_permission_denied(admin_server, tmp_path: Path) -> None:
    root = admin_server.options.adapter_roots[0]
    outside = tmp_path / "evil"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    with admin_server.client(admin_token=ADMIN) as client:
        for path in escape_paths(root, outside):
            with pytest.raises(grpc.RpcError) as info:
                client.load_adapter("evil", path)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, path
            # says what is allowed, and echoes the path as sent: not the roots, nor where the
            # path leads
            details = info.value.details().replace(repr(path), "")
            assert "--adapter-root" in details
            assert str(root) not in details and str(outside) not in details


@pytest.mark.parametrize("name", ["", "bad name", "../x", "-lead", "a" * 129, "tiny;drop"])
def test_bad_adapter_name_is_invalid_argument(admin_server, name: str) -> None:
    root = admin_server.options.adapter_roots[0]
    with admin_server.client(admin_token=ADMIN) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.load_adapter(name, root)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "letters, digits" in info.value.details()


def test_empty_names_and_paths_are_invalid_argument(admin_server) -> None:
    with admin_server.client(admin_token=ADMIN) as client:
        assert code_of(client.load_adapter, "ok", "") == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(client.unload_adapter, "") == grpc.StatusCode.INVALID_ARGUMENT


# ---- TLS ---------------------------------------------------------------------------------
def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject_key: Any, common_name: str, issuer: tuple[Any, Any] | None = None,
          ca: bool = False) -> Any:
    """A certificate for ``subject_key``; self-signed unless ``issuer`` = (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_cert, issuer_key = issuer if issuer else (None, subject_key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer_cert.subject if issuer_cert else name)
               .public_key(subject_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, key: Any, cert: Any) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    key_path, cert_path = folder / f"{name}.key", folder / f"{name}.crt"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(key_path, 0o600)
    return key_path, cert_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server cert (localhost, 127.0.0.1) and a client cert, both signed by the CA."""
    pytest.importorskip("cryptography")
    folder = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca = _cert(ca_key, "loraplex test CA", ca=True)
    server_key, client_key = _key(), _key()
    out: dict[str, Path] = {}
    _, out["ca"] = _write(folder, "ca", ca_key, ca)
    out["server_key"], out["server_cert"] = _write(
        folder, "server", server_key, _cert(server_key, "localhost", (ca, ca_key)))
    out["client_key"], out["client_cert"] = _write(
        folder, "client", client_key, _cert(client_key, "client", (ca, ca_key)))
    return out


def test_tls(serve, make_engine, tiny_llama: Path, pki: dict[str, Path]) -> None:
    server = serve(lambda: make_engine(tiny_llama), ssl_certfile=pki["server_cert"],
                   ssl_keyfile=pki["server_key"])
    with server.client(root_certificates=pki["ca"]) as client:
        assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
        assert client.server_info().tls
    with server.client(timeout=3.0) as plaintext:
        assert code_of(plaintext.generate, "the cat") == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(serve, make_engine, tiny_llama: Path, pki: dict[str, Path]) -> None:
    server = serve(lambda: make_engine(tiny_llama), ssl_certfile=pki["server_cert"],
                   ssl_keyfile=pki["server_key"], ssl_ca_certs=pki["ca"])
    with server.client(root_certificates=pki["ca"], certificate_chain=pki["client_cert"],
                       private_key=pki["client_key"]) as client:
        assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
        assert client.health() == "SERVING"
    with server.client(root_certificates=pki["ca"], timeout=3.0) as no_client_cert:
        assert code_of(no_client_cert.generate, "the cat") == grpc.StatusCode.UNAVAILABLE


def test_http_front_takes_the_same_tls(serve, make_engine, tiny_llama: Path,
                                       pki: dict[str, Path]) -> None:
    """--ssl-* apply to the HTTP port too: https with the server's cert, and with
    --ssl-ca-certs a client certificate signed by that CA is required."""
    import ssl

    import httpx

    server = serve(lambda: make_engine(tiny_llama), ssl_certfile=pki["server_cert"],
                   ssl_keyfile=pki["server_key"], ssl_ca_certs=pki["ca"], http_port=0)
    url = f"https://127.0.0.1:{server.server.http_port}"
    trusted = ssl.create_default_context(cafile=str(pki["ca"]))
    with_cert = ssl.create_default_context(cafile=str(pki["ca"]))
    with_cert.load_cert_chain(pki["client_cert"], pki["client_key"])
    assert httpx.get(f"{url}/health", verify=with_cert).status_code == 200
    r = httpx.post(f"{url}/v1/completions", verify=with_cert, timeout=30,
                   json={"prompt": "the cat", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    with pytest.raises(httpx.HTTPError):  # no client certificate
        httpx.get(f"{url}/health", verify=trusted, timeout=3.0)
    with pytest.raises(httpx.HTTPError):  # plaintext
        httpx.get(f"http://127.0.0.1:{server.server.http_port}/health", timeout=3.0)
