"""NATS credentials and TLS from URLs and advisor settings, on private nats-servers
(user/password, token, mutual TLS), and URL redaction: no secret in errors or logs."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _wait_port

from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane import EventURLError, PublisherConfig, TransportError, make_publisher, store, subscribe
from event_plane.errors import ConfigError
from event_plane.nats_auth import PASSWORD_FILE_ENV, NatsAuth, publisher_defaults, redact_url, write_password_file
from event_plane.urls import _ALLOWED, nats_connection
from storage_backends.local_s3 import free_port

NATS = shutil.which("nats-server") or "/usr/sbin/nats-server"
USER = "kvworker"


def _write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by the owner only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def _start(tmp_path: Path, body: str) -> Iterator[int]:
    """A private nats-server with config ``body`` (``{port}`` filled in); yields its port."""
    port = free_port()
    conf = _write_private(tmp_path / "nats.conf", f"listen: 127.0.0.1:{port}\n" + body)
    proc = subprocess.Popen([NATS, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, "nats-server")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _batch_goes_through(pub_url: str, sub_url: str, **kw: object) -> None:
    """Publish one batch at ``pub_url``; assert the subscriber at ``sub_url`` gets it."""
    sub = subscribe(sub_url, **kw)
    sub.start()
    pub = make_publisher(pub_url, "w0", config=PublisherConfig(max_events=1), **kw)
    try:
        pub.publish([store(1, 1, None, 4096, "g2")])
        pub.flush()
        got = sub.get(5.0)
        assert got is not None and got.source == "w0" and got.events[0].sequence_hash == 1
    finally:
        pub.close()
        sub.close()


@pytest.fixture()
def password() -> str:
    return "pw-" + secrets.token_hex(12)


@pytest.fixture()
def user_server(tmp_path: Path, password: str) -> Iterator[int]:
    body = f'authorization {{ user: {USER}, password: "{password}" }}\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
    yield from _start(tmp_path, body)


def test_redact_url_masks_passwords_tokens_and_unknown_params() -> None:
    assert redact_url("nats://alice:s3cr%40t@h:4222?namespace=ns") == "nats://alice:***@h:4222?namespace=ns"
    assert redact_url("nats://TOKEN123@h:4222") == "nats://***@h:4222"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    shown = redact_url("jetstream://h:1?creds=/a.creds&tls_ca=/ca.pem&token=abc&password=x#frag")
    assert shown == "jetstream://h:1?creds=/a.creds&tls_ca=/ca.pem&token=***&password=***"
    assert redact_url(b"nats://a:b@h:1") == "<bytes>"
    # every parameter a URL may carry is known to be safe to show (none holds a secret)
    for scheme, names in _ALLOWED.items():
        for name in names:
            assert redact_url(f"{scheme}://h:1?{name}=v") == f"{scheme}://h:1?{name}=v"


def test_url_errors_never_show_the_secret(caplog: pytest.LogCaptureFixture) -> None:
    secret = "hunter2-" + secrets.token_hex(6)
    for bad in (f"nats://u:{secret}@h:4222?bogus=1", f"nats://u:{secret}@h:port", f"nats://h:1?token={secret}",
                f"ftp://u:{secret}@h:1", f"jetstream://u:{secret}@h:1?max_bytes=-5", f"nats://h:1?tls=maybe&x={secret}"):
        with pytest.raises(EventURLError) as info:
            make_publisher(bad, "w0")
        assert secret not in str(info.value)
        assert "***" in str(info.value) or "h:port" in bad
    assert secret not in caplog.text


def test_connect_options_from_url_and_precedence(tmp_path: Path) -> None:
    token = _write_private(tmp_path / "token", "tok-" + secrets.token_hex(8) + "\n")
    server, opts = nats_connection(f"nats://127.0.0.1:1?token_file={token}")
    assert server == "nats://127.0.0.1:1" and opts == {"token": token.read_text().strip()}
    server, opts = nats_connection("tls://a%3Ab:p%40ss@127.0.0.1:1")
    assert server == "tls://127.0.0.1:1" and (opts["user"], opts["password"]) == ("a:b", "p@ss")
    assert opts["tls"].verify_mode.name == "CERT_REQUIRED"
    defaults = NatsAuth(user="settings", password="from-settings", tls_hostname="nats.example")
    # the URL's authentication wins as a whole; TLS fields not in the URL come from the defaults
    server, opts = nats_connection(f"nats://127.0.0.1:1?token_file={token}&tls=1", defaults)
    assert "user" not in opts and opts["token"] and opts["tls_hostname"] == "nats.example"
    assert server == "tls://127.0.0.1:1"
    server, opts = nats_connection("nats://127.0.0.1:1", defaults)
    assert (opts["user"], opts["password"], server) == ("settings", "from-settings", "tls://127.0.0.1:1")
    assert "from-settings" not in repr(defaults)
    with pytest.raises(EventURLError, match="give one of"):
        nats_connection(f"nats://u:p@127.0.0.1:1?token_file={token}")
    with pytest.raises(EventURLError, match="needs its key"):
        nats_connection("nats://127.0.0.1:1?tls_cert=/c.pem")
    with pytest.raises(EventURLError, match="token file .* is empty"):
        nats_connection(f"nats://127.0.0.1:1?token_file={_write_private(tmp_path / 'empty', '')}")
    with pytest.raises(EventURLError, match="creds file"):
        nats_connection(f"nats://127.0.0.1:1?creds={tmp_path / 'missing.creds'}")
    nkey = _write_private(tmp_path / "seed.nk", "SUAXXX")
    assert nats_connection(f"jetstream://127.0.0.1:1?nkey_seed={nkey}")[1] == {"nkeys_seed": str(nkey)}
    with pytest.raises(ConfigError):
        NatsAuth(password="only")


def test_a_password_file_gives_user_and_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    password = "pw-" + secrets.token_hex(8)
    path = tmp_path / "w0.json"
    write_password_file(path, "w0", password)
    assert path.stat().st_mode & 0o777 == 0o600
    _server, opts = nats_connection(f"jetstream://127.0.0.1:1?namespace=ns&password_file={path}")
    assert (opts["user"], opts["password"], opts["inbox_prefix"]) == ("w0", password, "_INBOX.w0")
    assert redact_url(f"nats://h:1?password_file={path}") == f"nats://h:1?password_file={path}"
    assert password not in repr(NatsAuth(password_file=str(path)))
    with pytest.raises(EventURLError, match="give one of"):
        nats_connection(f"nats://u:p@127.0.0.1:1?password_file={path}")
    bad = _write_private(tmp_path / "bad.json", password)  # the bare password: not the file's format
    with pytest.raises(EventURLError, match="must hold JSON") as info:
        nats_connection(f"nats://127.0.0.1:1?password_file={bad}")
    assert password not in str(info.value)
    # $KVADVISOR_NATS_PASSWORD_FILE: a publisher's default where its caller sets no authentication
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(path))
    assert publisher_defaults(None) == NatsAuth(password_file=str(path))
    assert publisher_defaults(NatsAuth(token="t")) == NatsAuth(token="t")
    tls = publisher_defaults(NatsAuth(tls_hostname="nats.example"))
    assert tls is not None and (tls.password_file, tls.tls_hostname) == (str(path), "nats.example")


def test_settings_validate_and_hide_nats_secrets(password: str) -> None:
    s = AdvisorSettings(nats_user=USER, nats_password=password)
    assert password not in repr(s) and password not in str(s.model_dump())
    auth = s.nats_auth()
    assert (auth.user, auth.password) == (USER, password) and password not in repr(auth)
    with pytest.raises(ValueError, match="give one of") as info:
        AdvisorSettings(nats_user=USER, nats_password=password, nats_token="t-" + password)
    assert password not in str(info.value)


def test_user_password_server(user_server: int, password: str, tmp_path: Path,
                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    ns = "auth" + secrets.token_hex(3)
    base = f"127.0.0.1:{user_server}"
    # no credentials: refused, clearly
    with pytest.raises(TransportError, match="(?i)authorization") as info:
        make_publisher(f"nats://{base}?namespace={ns}", "w0", connect_timeout_s=2)
    # a wrong password: refused, and neither it nor the right one is shown
    wrong = "wrong-" + secrets.token_hex(6)
    with pytest.raises(TransportError, match="(?i)authorization") as info:
        make_publisher(f"nats://{USER}:{wrong}@{base}?namespace={ns}", "w0", connect_timeout_s=2)
    assert wrong not in str(info.value) and password not in str(info.value) and base in str(info.value)
    with pytest.raises(TransportError) as info:
        subscribe(f"nats://{USER}:{wrong}@{base}?namespace={ns}", connect_timeout_s=2).start()
    assert wrong not in str(info.value)
    # a wrong host: the error names the host but not the password
    with pytest.raises(TransportError) as info:
        make_publisher(f"nats://{USER}:{password}@127.0.0.1:{free_port()}", "w0", connect_timeout_s=0.5)
    assert password not in str(info.value) and "127.0.0.1" in str(info.value)
    # credentials in the URL
    _batch_goes_through(f"nats://{USER}:{password}@{base}?namespace={ns}", f"nats://{USER}:{password}@{base}?namespace={ns}")
    # credentials from the advisor settings
    settings = AdvisorSettings(nats_user=USER, nats_password=password)
    _batch_goes_through(f"nats://{base}?namespace={ns}", f"nats://{base}?namespace={ns}", nats_auth=settings.nats_auth())
    # JetStream URLs take the same credentials (URL for the publisher, settings for the subscriber)
    durable = "d" + secrets.token_hex(3)
    _batch_goes_through(f"jetstream://{USER}:{password}@{base}?namespace={ns}",
                        f"jetstream://{base}?namespace={ns}&durable={durable}", nats_auth=settings.nats_auth())
    with pytest.raises(TransportError, match="(?i)authorization"):
        subscribe(f"jetstream://{base}?namespace={ns}&durable={durable}", connect_timeout_s=2).start()
    # an advisor whose settings carry the credentials ingests from the protected server
    svc = AdvisorService(AdvisorSettings(
        journal_path=str(tmp_path / "journal.sqlite"), subscribe_urls=[f"nats://{base}?namespace={ns}"],
        nats_user=USER, nats_password=password, api_enabled=False, snapshot_store="none", policy_interval_s=0,
    ))
    svc.start()
    try:
        pub = make_publisher(f"nats://{USER}:{password}@{base}?namespace={ns}", "w1")
        try:
            pub.publish([store(7, 7, None, 4096, "g2")])
            pub.flush()
            assert svc.wait_position(1, 10.0)
        finally:
            pub.close()
    finally:
        svc.stop()
    for secret in (password, wrong):
        assert secret not in caplog.text


def test_token_server_with_token_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = "tok-" + secrets.token_hex(16)
    token_file = _write_private(tmp_path / "nats.token", token + "\n")
    bad_file = _write_private(tmp_path / "bad.token", "nope-" + secrets.token_hex(4))
    for port in _start(tmp_path, f'authorization {{ token: "{token}" }}\n'):
        ns = "tok" + secrets.token_hex(3)
        url = f"nats://127.0.0.1:{port}?namespace={ns}&token_file={token_file}"
        _batch_goes_through(url, url)
        # JetStream URLs take the same parameters; here refused for the wrong token
        with pytest.raises(TransportError, match="(?i)authorization") as info:
            make_publisher(f"nats://127.0.0.1:{port}?namespace={ns}&token_file={bad_file}", "w0", connect_timeout_s=2)
        assert bad_file.read_text() not in str(info.value)
        settings = AdvisorSettings(nats_token=token)
        _batch_goes_through(f"nats://127.0.0.1:{port}?namespace={ns}", f"nats://127.0.0.1:{port}?namespace={ns}",
                            nats_auth=settings.nats_auth())
    assert token not in caplog.text


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_pki(d: Path) -> None:
    """A CA, a server certificate (localhost / 127.0.0.1) and a client certificate in ``d``."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvadvisor test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for name, usage, san in (("server", "serverAuth", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"),
                             ("client", "clientAuth", "")):
        (d / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
            f"subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n{san}")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (needed to make test certificates)")
def test_mutual_tls(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    pki.mkdir(mode=0o700)
    _make_pki(pki)
    body = (f'tls {{ cert_file: "{pki}/server.pem", key_file: "{pki}/server.key", ca_file: "{pki}/ca.pem", '
            "verify: true, timeout: 2 }\n")
    for port in _start(tmp_path, body):
        ns = "tls" + secrets.token_hex(3)
        files = f"tls_ca={pki}/ca.pem&tls_cert={pki}/client.pem&tls_key={pki}/client.key"
        _batch_goes_through(f"tls://127.0.0.1:{port}?namespace={ns}&{files}",
                            f"nats://localhost:{port}?namespace={ns}&tls=1&{files}")
        # from the advisor settings, with the certificate's host name given explicitly
        settings = AdvisorSettings(nats_tls_ca_file=f"{pki}/ca.pem", nats_tls_cert_file=f"{pki}/client.pem",
                                   nats_tls_key_file=f"{pki}/client.key", nats_tls_hostname="localhost")
        _batch_goes_through(f"nats://127.0.0.1:{port}?namespace={ns}", f"nats://127.0.0.1:{port}?namespace={ns}",
                            nats_auth=settings.nats_auth())
        # the host name is checked: a name the server's certificate does not carry is refused
        with pytest.raises(TransportError, match="Hostname mismatch"):
            make_publisher(f"tls://127.0.0.1:{port}?namespace={ns}&{files}&tls_hostname=other.example", "w0",
                           connect_timeout_s=2)
        # the server verifies clients: without a client certificate the connection is refused
        # (TLS 1.3: the server's alert reaches the client as an SSL error, or, when the
        # client has already written its CONNECT, as the server closing the connection)
        with pytest.raises(TransportError, match="(?i)SSL.*certificate|broken pipe|connection reset|EOF occurred"):
            make_publisher(f"tls://127.0.0.1:{port}?namespace={ns}&tls_ca={pki}/ca.pem", "w0", connect_timeout_s=2)
        # a client that does not trust the server's CA refuses the server
        with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            make_publisher(f"tls://127.0.0.1:{port}?namespace={ns}&tls_cert={pki}/client.pem&tls_key={pki}/client.key",
                           "w0", connect_timeout_s=2)
