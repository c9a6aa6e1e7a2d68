"""The control store on an etcd that speaks TLS and asks clients for a certificate, as a
shared production etcd does: certificates made here with openssl (a CA, the members', a
client's), a real 3-member etcd on loopback ports. The client's files come from etcdctl's own
variables. Skipped with the reason when etcd or openssl is missing."""

import shutil
import subprocess

import pytest

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_missing
from recycle_planner.executor.control.store import (PUT, EtcdStore, EtcdTls,
                                                    StoreUnavailable)

pytestmark = [pytest.mark.skipif(etcd_missing() is not None, reason=str(etcd_missing())),
              pytest.mark.skipif(shutil.which("openssl") is None,
                                 reason="openssl is not installed")]


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(folder):
    """A CA, and a certificate it signed for the members (127.0.0.1) and one for a client."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=folder)
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("member", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.crt",
                 cwd=folder)
    return folder


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    folder = _certificates(tmp_path_factory.mktemp("tls"))
    client = EtcdTls(str(folder / "ca.crt"), str(folder / "client.crt"),
                     str(folder / "client.key"))
    with EtcdCluster(3, tls=(str(folder / "member.crt"), str(folder / "member.key"),
                             client)) as cluster:
        yield cluster, client, folder


def test_the_store_speaks_tls_with_the_files_etcdctl_is_given(secured, monkeypatch):
    cluster, client, _ = secured
    assert cluster.endpoints.startswith("https://")
    for name, path in zip(EtcdTls.ENV, (client.ca, client.cert, client.key)):
        monkeypatch.setenv(name, path)
    store = EtcdStore(cluster.endpoints, timeout=5)
    try:
        rev = store.put("/tls/a", "1")
        watch = store.watch("/tls/", rev + 1)
        store.put("/tls/b", "2")
        event = watch.get(10)
        assert event is not None and (event.kind, event.key) == (PUT, "/tls/b")
        watch.cancel()
        assert store.get("/tls/a").value == "1"
    finally:
        store.close()


def test_without_a_client_certificate_the_store_is_refused(secured):
    cluster, client, _ = secured
    store = EtcdStore(cluster.endpoints, timeout=2, tls=EtcdTls(client.ca))
    try:
        with pytest.raises(StoreUnavailable):
            store.put("/tls/c", "1")
    finally:
        store.close()


def test_tls_settings_are_checked(secured, monkeypatch):
    cluster, client, folder = secured
    with pytest.raises(RecycleError, match="mix"):
        EtcdStore(f"https://{cluster.endpoint(0)},http://{cluster.endpoint(1)}")
    monkeypatch.setenv("ETCDCTL_CERT", client.cert)
    with pytest.raises(RecycleError, match="go together"):
        EtcdTls.from_env()
    monkeypatch.setenv("ETCDCTL_KEY", str(folder / "missing.key"))
    with pytest.raises(RecycleError, match="no such file"):
        EtcdTls.from_env()


def test_a_cluster_asked_from_elsewhere_is_asked_over_tls(secured):
    """Members started in another network namespace are asked whether they are ready from
    there, by a process of its own (`EtcdCluster.wrap`; `env` stands in for `ip netns exec
    NS` here): that probe speaks TLS with the client's files too, else a TLS cluster in a
    namespace never became ready."""
    _, client, folder = secured
    with EtcdCluster(1, tls=(str(folder / "member.crt"), str(folder / "member.key"), client),
                     wrap=("env",)) as cluster:
        assert cluster._answers()
